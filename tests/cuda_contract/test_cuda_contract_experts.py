"""CUDA contract of the experts' grouped FP8 GEMMs (``fp8_plugin/numerics/grouped_gemm.py``) and
of an FP8 experts module's training step (``fp8_plugin/modules/experts.py``).

The native grouped kernels, ``torch._scaled_grouped_mm`` (E4M3 fprop and dgrad) and bfloat16
``torch._grouped_mm`` on the FP8 values (E5M2 dgrad, wgrad), are called here on tensors of the
``cuda`` fixture (conftest.py): meta tensors treated as a Hopper GPU, whose meta kernels check
torch's CUDA rules (E4M3 operands, the first operand row-major and the second column-major,
16-byte strides, float32 row-wise scales, int32 group offsets), or the real GPU. GPUs without
them (sm89 here) take the float32 emulation's custom operators. The groups are device-side
offsets throughout: a training step of an experts module reads nothing on the host.
"""

from __future__ import annotations

import re

import pytest
import torch

from fp8_plugin.modules.experts import expert_gemm_counts
from fp8_plugin.numerics import grouped_gemm

CONTRACT_DEVICES = ("meta", "cuda")
pytestmark = pytest.mark.filterwarnings("ignore:FP8 expert GEMMs emulated")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COUNTS = [5, 0, 37, 16]  # tokens per expert: one with none, none a multiple of 16 but the last
G, N, K = len(COUNTS), 64, 128
S = sum(COUNTS)
EMULATED = ("fp8_plugin.grouped_mm_float32.default", "fp8_plugin.grouped_mm_wgrad_float32.default")


def operands(device, dtype_a=E4M3):
    a = torch.zeros(S, K, device=device).to(dtype_a)
    b = torch.zeros(G, N, K, device=device).to(E4M3)
    return a, torch.ones(G, device=device), b, torch.ones(G, device=device)


def offsets(device):
    # The true ends of COUNTS: on a real GPU the kernels index with them (ends short of S put
    # rows in a group past the last, an index out of bounds). Built before the recorder's reset,
    # so the host-to-device copy is not counted.
    return torch.tensor(COUNTS, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90"), pytest.param((10, 0), id="sm100")],
                         indirect=True)
def test_native_grouped_kernel_is_called_as_cuda_needs_it(cuda):
    a, sa, b, sb = operands(cuda.device)
    ends = offsets(cuda.device)
    cuda.reset()
    out = grouped_gemm._native(a, sa, b, sb, ends, torch.bfloat16)
    assert out.shape == (S, N) and out.dtype == torch.bfloat16
    assert cuda.ops["aten._scaled_grouped_mm.default"] == 1
    (_, operand_list), = cuda.gemms
    (a_shape, a_stride, _), (b_shape, b_stride, _) = operand_list[:2]
    assert a_shape == (S, K) and a_stride[1] == 1  # the groups as routed (no padding), row-major
    assert b_shape == (G, K, N) and b_stride[-2] == 1  # column-major per expert
    cuda.clean()  # no host read


# The kernel's second operand is the stack transposed back, [G, K, N] with strides (K * N, N, 1):
# row-major per expert. Each mode's kernel refuses it in its own words (tests/cuda_contract/
# test_cuda_contract.py, "The harness bites"; docs/cuda_contract.md lists the sources).
ROW_MAJOR_EXPERT_STACK = {
    # torch/_meta_registrations.py, _meta_grouped_mm_common (torch 2.11 and 2.13):
    # torch._check(is_col_major(mat_b), ...)
    "meta": (RuntimeError, re.escape(f"Expected mat_b tensor to be column major in the last two dimensions, "
                                     f"got strides ({N}, 1)")),
    # torch 2.11's aten/src/ATen/native/cuda/GroupedBlas.cpp, _scaled_grouped_mm_cuda:
    # TORCH_CHECK_VALUE(check_valid_strides_and_return_transposed(mat_b), "Expected mat2 to be transposed")
    "cuda": (ValueError, re.escape("Expected mat2 to be transposed")),
}


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90")], indirect=True)
def test_grouped_harness_refuses_a_row_major_expert_stack(cuda):
    a, sa, _, sb = operands(cuda.device)
    wrong = torch.zeros(G, K, N, device=cuda.device).to(E4M3).transpose(-2, -1)  # [G, N, K], column-major
    with cuda.kernel_refusal(ROW_MAJOR_EXPERT_STACK):
        grouped_gemm._native(a, sa, wrong, sb, offsets(cuda.device), torch.bfloat16)


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90"), pytest.param((8, 9), id="sm89")],
                         indirect=True)
def test_e5m2_dgrad_and_wgrad_take_a_grouped_kernel_without_a_host_read(cuda):
    # HYBRID's E5M2 gradients never take torch._scaled_grouped_mm: on sm90 the bfloat16 grouped
    # kernel on the FP8 values, elsewhere the float32 emulation's custom operators.
    a, sa, b, sb = operands(cuda.device, E5M2)
    ends = offsets(cuda.device)
    grad = torch.zeros(S, N, device=cuda.device).to(E5M2)
    x = torch.zeros(S, K, device=cuda.device).to(E4M3)
    cuda.reset()
    out = grouped_gemm.grouped_gemm(a, sa, b, sb, ends, torch.bfloat16, kind="dgrad")
    wgrad = grouped_gemm.grouped_gemm_wgrad(grad, sa, x, sb, ends, torch.float32)
    assert out.shape == (S, N) and wgrad.shape == (G, N, K)
    native = cuda.capability[0] == 9
    assert cuda.ops["aten._grouped_mm.default"] == (2 if native else 0)
    assert sum(cuda.ops[op] for op in EMULATED) == (0 if native else 2)
    assert cuda.scaled_gemms() == 0
    cuda.clean()


def _tiny_experts(device: torch.device):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    import fp8_plugin

    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    with torch.device(device):
        experts = MixtralExperts(config)
    fp8_plugin.convert_model(experts)
    return experts


@pytest.mark.parametrize("cuda", [pytest.param((9, 0), id="sm90"), pytest.param((8, 9), id="sm89")],
                         indirect=True)
def test_fp8_experts_training_step_makes_no_host_read(cuda):
    # Routing, the device-side group offsets, per-expert casts and the grouped GEMMs of forward
    # and backward: nothing waits for the GPU (a .tolist() of the tokens per expert did).
    import fp8_plugin

    experts = _tiny_experts(cuda.device)
    tokens, top_k = 24, 2
    hidden = torch.randn(tokens, 64, device=cuda.device, requires_grad=True)
    top_k_index = torch.randint(0, 4, (tokens, top_k), device=cuda.device)
    top_k_weights = torch.rand(tokens, top_k, device=cuda.device)
    before = expert_gemm_counts()
    cuda.reset()
    with fp8_plugin.autocast():
        out = experts(hidden, top_k_index, top_k_weights)
    out.float().square().mean().backward()
    ran = {k: v - before[k] for k, v in expert_gemm_counts().items()}
    assert ran == {"fprop": 2, "dgrad": 2, "wgrad": 2}, ran
    assert hidden.grad.shape == hidden.shape and experts.gate_up_proj.grad.shape == experts.gate_up_proj.shape
    if cuda.capability[0] == 9:  # fprop of both projections on the FP8 grouped kernel
        assert cuda.ops["aten._scaled_grouped_mm.default"] == 2
    else:
        assert cuda.scaled_gemms() == 0 and sum(cuda.ops[op] for op in EMULATED) == 6
    cuda.clean()
