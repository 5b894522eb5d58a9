"""The contract suite's harness bites: what a GPU's kernels refuse fails here too, in the words
of the kernel the mode runs (meta tensors: torch's meta kernels; ``FP8_CONTRACT_DEVICE=cuda``:
torch 2.11's CUDA kernels), and the recorder flags what would make a GPU wait for the host
while letting through torch's own host-side attention seeds (conftest.py, docs/cuda_contract.md).
"""

from __future__ import annotations

import re

import pytest
import torch

from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.quantizers import QuantizedTensor
from test_cuda_contract import E4M3, cap, quantized

CONTRACT_DEVICES = ("meta", "cuda")  # tensors on cuda.device: these tests run on a real GPU too (conftest.py)

# ---------------------------------------------------------------------------------------------
# The harness bites: wrong layouts and shapes fail, as they would on a GPU. Each test expects the
# refusal of the kernel its mode runs, exactly: on meta tensors the meta kernel's
# (torch/_meta_registrations.py, the same lines in torch 2.11 and 2.13; torch._check raises
# RuntimeError), with FP8_CONTRACT_DEVICE=cuda torch 2.11's CUDA kernel's
# (aten/src/ATen/native/cuda/ScaledBlas.cpp, GroupedBlas.cpp; TORCH_CHECK raises RuntimeError,
# TORCH_CHECK_VALUE ValueError). docs/cuda_contract.md lists each source.

# fp8_gemm's B^T is [64, 48] with strides (48, 1).
ROW_MAJOR_SECOND_OPERAND = {
    # _meta_registrations.py, _check_scaled_mm_sizes: torch._check(is_col_major(mat2.stride()) ...)
    "meta": (RuntimeError, re.escape("mat2 must be col_major, got stride (48, 1)")),
    # ScaledBlas.cpp, _scaled_gemm: TORCH_CHECK(args.transa == 't' && args.transb == 'n', ...)
    "cuda": (RuntimeError,
             re.escape("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")),
}
CONTRACTION_DIM_OFF_16 = {
    # _meta_registrations.py, _check_scaled_mm_sizes: torch._check(self.size(1) % 16 == 0, ...)
    "meta": (RuntimeError, re.escape("Expected self.size(1) to be divisible by 16, but got self.size(1)=60")),
    # ScaledBlas.cpp, _scaled_mm_out_cuda: TORCH_CHECK(mat1.sizes()[1] % 16 == 0, ...)
    "cuda": (RuntimeError,
             re.escape("Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (64x60).")),
}
# A 128x128-scaled B of [128, 256] whose scale grid is [2, 1] (not [1, 2]): the GEMM scale is [4, 2], not [4, 1].
WRONG_BLOCK_SCALE_SHAPE = {
    # _meta_registrations.py, _check_scaled_mm_sizes_v2, 1x128 x 128x128: torch._check(types_ok and
    # scale_a_ok and scale_b_ok, ...); its first line is not an f-string, L4 is a float.
    "meta": (RuntimeError, re.escape("For 1x128 x 128x128 blockwise scaling, L4 = {round_up(K / 128, 4)}, ") + ".*"
             + re.escape("scale b must have shape [4.0, 1] (got: torch.Size([4, 2]))")),
    # ScaledBlas.cpp, _scaled_block1x128_block128x128: TORCH_CHECK_VALUE(scale_b.size(0) == round_up(
    # ceil_div(K, 128), 4) && scale_b.size(1) == ceil_div(N, 128) && ..., "scale_b must have shape ", ...)
    "cuda": (ValueError, re.escape("scale_b must have shape 4 x 1 Float elements, got [4, 2]")),
}
BIAS_WITH_A_FLOAT32_OUTPUT = {
    "meta": None,  # the meta kernel accepts it; the suite's rule records it (conftest.py _cuda_rules)
    # ScaledBlas.cpp, _scaled_mm_out_cuda: TORCH_CHECK(out.scalar_type() != kFloat, ...)
    "cuda": (RuntimeError, re.escape("Bias is not supported when out_dtype is set to Float32")),
}


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_refuses_a_row_major_second_operand(cuda):
    dev = cuda.device
    a = quantized(dev, 64, 64)
    b = QuantizedTensor(torch.empty(64, 48, dtype=E4M3, device=dev).t(), torch.ones((), device=dev))  # column-major
    with cuda.kernel_refusal(ROW_MAJOR_SECOND_OPERAND):
        gemm.fp8_gemm(a, b, torch.bfloat16)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_refuses_a_contraction_dim_off_16(cuda):
    dev = cuda.device
    one = torch.ones((), device=dev)
    a, b = torch.empty(64, 60, dtype=E4M3, device=dev), torch.empty(48, 60, dtype=E4M3, device=dev)
    with cuda.kernel_refusal(CONTRACTION_DIM_OFF_16):
        torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_refuses_a_wrong_block_scale_shape(cuda):
    dev = cuda.device
    a = quantized(dev, 128, 256, block=(1, 128))
    b = quantized(dev, 128, 256, block=(128, 128))
    b = QuantizedTensor(b.data, torch.ones(2, 1, device=dev), (128, 128))  # the grid is [1, 2]
    with cuda.kernel_refusal(WRONG_BLOCK_SCALE_SHAPE):
        gemm.fp8_gemm(a, b, torch.bfloat16)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_flags_a_cpu_scale(cuda):
    if cuda.real:
        pytest.skip("a CPU scale given to the CUDA kernel: recorded by the same rule on meta tensors; not run on "
                    "a GPU, where a kernel reading a host pointer could break the CUDA context for the session")
    a = QuantizedTensor(torch.empty(32, 64, dtype=E4M3, device=cuda.device), torch.ones(()))  # a CPU scale
    gemm.fp8_gemm(a, quantized(cuda.device, 48, 64), torch.bfloat16)
    assert any("a tensor on cpu" in v for v in cuda.kernel_violations)
    assert cuda.mixed_devices


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_flags_a_bias_with_a_float32_output(cuda):
    # The meta kernel accepts it; the CUDA kernel refuses it (ScaledBlas.cpp), after the record.
    dev = cuda.device
    one = torch.ones((), device=dev)
    operands = (torch.empty(32, 64, dtype=E4M3, device=dev), torch.empty(48, 64, dtype=E4M3, device=dev).t(), one, one)
    bias = torch.empty(48, device=dev)
    with cuda.kernel_refusal(BIAS_WITH_A_FLOAT32_OUTPUT):
        torch._scaled_mm(*operands, bias=bias, out_dtype=torch.float32)
    assert cuda.kernel_violations == ["Bias is not supported when out_dtype is set to Float32"]


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_harness_records_host_reads_and_host_to_device_copies(cuda):
    # On meta tensors a host read raises as well; on a GPU it succeeds, and the record is what
    # fails a test's clean().
    value = torch.zeros((), device=cuda.device)
    if cuda.real:
        assert value.item() == 0.0
        assert value.cpu().item() == 0.0  # a device-to-host copy; the CPU tensor's .item() is no sync
        assert cuda.host_reads == ["aten._local_scalar_dense.default", "aten._to_copy.default"]
    else:
        with pytest.raises(RuntimeError, match="meta"):
            value.item()
        assert cuda.host_reads == ["aten._local_scalar_dense.default"]
    torch.ones(3).to(cuda.device)  # a blocking host-to-device copy
    assert cuda.to_device_copies == ["aten._to_copy.default: [(3,)]"]
    with pytest.raises(AssertionError):
        cuda.clean()


def test_recorder_lets_a_non_blocking_copy_into_pinned_memory_through_and_flags_a_blocking_one(cuda):
    # The scale update sends the initialized flags to the host so (scale_update._publish_initialized):
    # the H100 run of 2026-11-27 failed five training-step tests on the GPU, which had recorded that
    # copy as a CPU tensor mixed into a device op.
    if not cuda.real:
        pytest.skip("pinned memory and a device-to-host copy need a real GPU (meta tensors hold no values)")
    flags = torch.ones(4, dtype=torch.int8, device=cuda.device)
    host = torch.empty(4, dtype=torch.int8, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    assert cuda.async_host_copies == ["aten.copy_.default: [(4,), (4,)]"]
    assert not cuda.host_reads and not cuda.mixed_devices
    torch.empty(4, dtype=torch.int8).copy_(flags)  # pageable memory: the copy blocks the host
    assert cuda.host_reads == ["aten.copy_.default"] and not cuda.mixed_devices
    with pytest.raises(AssertionError):
        cuda.clean()


# torch's memory-efficient attention returns the philox seed and offset of its dropout as 0-dim
# int64 tensors on the host, and its backward takes them back: values the forward read from the
# generator on the host, no sync (conftest.py HOST_RNG_ARGUMENTS). [B, H, S, D] for the SDPA op,
# [B, S, H, D] for the op under it.
ATTENTION_SHAPES = {"sdpa": (2, 4, 64, 64), "efficient": (2, 64, 4, 64)}


def efficient_attention_forward(op, q, k, v):
    """(output, logsumexp, philox_seed, philox_offset) of a non-causal forward without dropout."""
    if op == "sdpa":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        return out, lse, seed, offset
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, None, None,
                                                                              0.0, 0, True)
    return out, lse, seed, offset


def efficient_attention_backward(op, q, k, v, out, lse, seed, offset):
    aten, grad = torch.ops.aten, torch.empty_like(out)
    if op == "sdpa":
        return aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, None, out, lse, seed, offset, 0.0,
                                                                     [True, True, True, False], False)
    seq_q, seq_k = q.shape[1], k.shape[1]
    return aten._efficient_attention_backward(grad, q, k, v, None, out, None, None, seq_q, seq_k, lse, 0.0, seed,
                                              offset, 0, False)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
@pytest.mark.parametrize("op", ["sdpa", "efficient"])
def test_recorder_exempts_the_host_philox_seed_and_offset_of_efficient_attention(cuda, op):
    q, k, v = (torch.empty(ATTENTION_SHAPES[op], device=cuda.device, dtype=torch.bfloat16) for _ in range(3))
    out, lse, seed, offset = efficient_attention_forward(op, q, k, v)
    if not cuda.real:
        # The meta kernel returns meta tensors; torch's CUDA kernel returns these (attention.cu,
        # _efficient_attention_forward, Note [Seed and Offset Device]).
        seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
    for t in (seed, offset):  # on a GPU: what torch 2.11's kernel gave
        assert t.device.type == "cpu" and t.dim() == 0 and t.dtype == torch.int64, t
    efficient_attention_backward(op, q, k, v, out, lse, seed, offset)
    cuda.clean()


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_recorder_still_flags_other_cpu_tensors_mixed_into_device_ops(cuda):
    host = torch.zeros((), dtype=torch.int64)  # as the attention's seed, but given to another op
    torch.mul(torch.ones(3, device=cuda.device), host)
    assert cuda.mixed_devices == ["aten.mul.Tensor: [('" + cuda.device.type + "', (3,)), ('cpu', ())]"]
    if cuda.real:
        return  # below: arguments torch's CUDA kernels never get
    cuda.reset()
    q, k, v = (torch.empty(ATTENTION_SHAPES["sdpa"], device=cuda.device, dtype=torch.bfloat16) for _ in range(3))
    out, lse, _, _ = efficient_attention_forward("sdpa", q, k, v)
    # Only a 0-dim int64 seed and offset on the host are torch's; any other CPU tensor there is flagged.
    for seed in (torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.float32)):
        efficient_attention_backward("sdpa", q, k, v, out, lse, seed, torch.zeros((), dtype=torch.int64))
    assert [entry.split(":")[0] for entry in cuda.mixed_devices] == [
        "aten._scaled_dot_product_efficient_attention_backward.default"] * 2
    # FlashAttention keeps its RNG state on the device (next test): a host one there is flagged.
    cuda.reset()
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    torch.ops.aten._scaled_dot_product_flash_attention_backward(
        torch.empty_like(res[0]), q, k, v, res[0], res[1], res[2], res[3], res[4], res[5], 0.0, True,
        torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    assert [entry.split(":")[0] for entry in cuda.mixed_devices] == [
        "aten._scaled_dot_product_flash_attention_backward.default"]


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_flash_attention_keeps_its_rng_state_on_the_device(cuda):
    # torch >= 2.11 (CUDA): FlashAttention's forward returns its RNG state as a [2] uint64 tensor and
    # an unused 0-dim one, both on the GPU (flash_api.cpp mha_fwd, "[Note] BC breaking change to
    # flash seed/offset"; the meta kernel says the same outside ROCm), so its backward mixes in nothing.
    q, k, v = (torch.empty(ATTENTION_SHAPES["sdpa"], device=cuda.device, dtype=torch.bfloat16) for _ in range(3))
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True)
    assert rng_state.device == cuda.device and rng_state.shape == (2,) and rng_state.dtype == torch.uint64
    assert unused.device == cuda.device and unused.dim() == 0
    torch.ops.aten._scaled_dot_product_flash_attention_backward(torch.empty_like(out), q, k, v, out, lse, cum_q, cum_k,
                                                                max_q, max_k, 0.0, True, rng_state, unused)
    cuda.clean()
