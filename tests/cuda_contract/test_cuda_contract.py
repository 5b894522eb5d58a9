"""The CUDA contract suite: the project's CUDA code paths, run on meta tensors treated as a GPU.

The ``cuda`` fixture (conftest.py) makes the project treat ``meta`` tensors as a CUDA GPU of a
chosen compute capability, through the project's own seam
(:mod:`fp8_plugin.numerics.device_kind`). torch's meta kernels of ``torch._scaled_mm`` and
``torch.nn.functional.scaled_mm`` check the CUDA kernels' rules for meta tensors (the second
operand column-major, dims multiples of 16, the block-scale tensors' padded and swizzled
shapes); the fixture adds the rules of the CUDA kernels the meta kernels leave out, and records
every read of a value on the host. What passes here calls the kernels as a GPU needs them
called; what it cannot show is the kernels' numerics and speed (docs/cuda_contract.md).

With ``FP8_CONTRACT_DEVICE=cuda`` on a machine with a GPU the same tests run on real ``cuda``
tensors (conftest.py): only the GPU's own compute capability, and the refusals the harness tests
expect are then the CUDA kernels' own. Every tensor is made on ``cuda.device`` for that reason.

The GPU's expected native kernels are taken from NVIDIA's documents, not from the code under
test: FP8 tensor cores from compute capability 8.9 (Ada; cuBLASLt FP8 GEMMs), 128-blockwise
scaling in cuBLAS on Hopper (sm90; Transformer Engine's Float8BlockScaling), MXFP8 on Blackwell
(sm100, sm120; cuBLAS block-scaled GEMMs, Transformer Engine's MXFP8BlockScaling).

Branches of ``fp8_plugin/numerics/gemm.py`` taken only on a CUDA device, and the test of each:

1. ``_native_gemm``, tensorwise: compute capability below 8.9 is not native (emulated), 8.9 and
   up native without a probe -- ``test_native_kernels_per_compute_capability``,
   ``test_without_a_native_kernel_the_layer_runs_the_emulation``.
2. ``_native_gemm``, block kinds: torch without ``F.scaled_mm`` -- ``test_block_kinds_need_torch_scaled_mm``;
   a major outside the kind's list (blockwise off sm90, MXFP8 off sm10x-12x) -- the two tests
   of 1; the kind's own major: the probe (``gemm_support.probe_block_kind``), which reads its
   result on the host and so cannot run on meta tensors --
   ``test_the_block_probe_reads_the_host_so_tests_force_the_native_path`` shows it stops there;
   under ``force_path("native")``, native without the probe -- every block-kind test.
3. ``_plan``: on CUDA the tensorwise kernel is taken without the CPU's timed choice
   -- ``test_tensorwise_auto_path_on_cuda_takes_the_kernel_untimed``; E5M2 x E5M2 has no CUDA
   kernel and is emulated -- ``test_e5m2_by_e5m2_is_emulated_on_cuda``.
4. ``fp8_gemm``: the padding of every operand to the kernel's multiples (``gemm_kernels.alignment``:
   16 / 16 / 16 tensorwise, K to 128 blockwise with N to 128 for 128x128 weights, K to 32
   MXFP8), the bias padded with N, the output cut back -- ``test_gemm_pads_to_the_kernels_multiples``
   and the layer tests with token counts and feature sizes off the multiples.
5. ``_native`` of a block kind whose kernel does not write ``out_dtype`` (the probe found so):
   bfloat16 then cast -- ``test_block_kernel_output_dtype_fallback``.
6. ``_scaled_mm_blocks``: MXFP8 (swizzled E8M0 scales), blockwise with 128x128 and with 1x128
   second operands -- the layer tests (weights 128x128, dgrad and wgrad 1x128) and
   ``test_gemm_pads_to_the_kernels_multiples``.
7. ``_scaled_mm_tensorwise``: the bias fused into the epilogue for BF16 / FP16 outputs (in the
   output dtype), added after a float32 output -- ``test_tensorwise_bias_follows_the_cuda_kernel_rules``.
8. ``tensorwise_choice``'s ``torch.cuda.synchronize``: never reached on CUDA (the choice is timed
   on CPU only, by 3); the fixture makes it raise.
9. ``normalize_device``'s current-device index for a bare ``"cuda"`` (the key of the per-device
   caches) -- ``test_a_bare_cuda_device_is_pinned_to_the_current_index``.

``fp8_plugin/modules/fsdp_fp8.py`` has no branch on the device type; the paths a GPU run takes
through it, and their tests (``test_fsdp_fp8_all_gather_hooks_on_one_rank``): the
pre-all-gather cast of a shard with the whole weight's scale, the padding of an uneven shard to
FSDP's padded size, the statistics of a training gather, the empty shard; the post-all-gather
wrap (``out=None``) and the in-place reuse (``out`` given); the gathered weight as the GEMM's
FP8 operand, plain and transposed (GPT-2's Conv1D layout), in forward, dgrad and wgrad. The amax
all-reduce across ranks (world size > 1) needs a process group of two ranks: the two-rank gloo
test (tests/modules/test_fsdp_fp8.py) covers it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8_plugin
from fp8_plugin import FP8Linear
from fp8_plugin.modules.fsdp_fp8 import FP8AllGatherWeight, FP8GatheredWeight
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device_kind import cuda_capability, device_kind, meta_as_cuda, tensor_device_kind
from fp8_plugin.numerics.quantizers import QuantizedTensor
from fp8_plugin.training.core import FP8Training
from fp8_plugin.training.reference.replay import _restore_rng_state, capture_rng_state

META = torch.device("meta")
CONTRACT_DEVICES = ("meta", "cuda")  # tensors on cuda.device: these tests run on a real GPU too (conftest.py)
SM = {"sm80": (8, 0), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

RECIPES = {
    "delayed": fp8_plugin.DelayedScaling,
    "current": fp8_plugin.Float8CurrentScaling,
    "blockwise": fp8_plugin.Float8BlockScaling,
    "mxfp8": fp8_plugin.MXFP8BlockScaling,
}
# Which recipes each GPU runs on its tensor cores (NVIDIA's documents; module docstring).
NATIVE = {
    "sm89": ("delayed", "current"),
    "sm90": ("delayed", "current", "blockwise"),
    "sm100": ("delayed", "current", "mxfp8"),
    "sm120": ("delayed", "current", "mxfp8"),
}
NATIVE_CASES = [(sm, name) for sm, names in NATIVE.items() for name in names]
EMULATED_CASES = [("sm80", "delayed"), ("sm89", "blockwise"), ("sm89", "mxfp8"), ("sm90", "mxfp8"),
                  ("sm100", "blockwise"), ("sm120", "blockwise")]


def cap(sm: str):
    return pytest.param(SM[sm], id=sm)


def run_layer(device, recipe, dtype, bias, tokens, features, transposed=False):
    """One FP8Linear forward and backward on ``device``; returns layer, input, output.
    ``transposed``: the weight stored ``[in, out]``, as a converted GPT-2 Conv1D keeps it."""
    in_features, out_features = features
    layer = FP8Linear(in_features, out_features, bias=bias, device=device, dtype=dtype, recipe=recipe)
    if transposed:
        layer.weight = nn.Parameter(torch.empty(in_features, out_features, device=device, dtype=dtype))
        layer.weight_transposed = True
    x = torch.empty(*tokens, in_features, device=device, dtype=dtype, requires_grad=True)
    with fp8_plugin.autocast():
        y = layer(x)
    y.backward(torch.empty_like(y))
    return layer, x, y


@pytest.mark.parametrize("cuda,recipe_name", [(SM[sm], name) for sm, name in NATIVE_CASES], indirect=["cuda"],
                         ids=[f"{sm}-{name}" for sm, name in NATIVE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("tokens,features", [((2, 64), (256, 384)), ((3, 40), (192, 208))],
                         ids=["aligned", "ragged"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_fp8_linear_forward_and_backward_run_the_native_kernels(cuda, recipe_name, dtype, bias, tokens, features,
                                                                 transposed):
    # "ragged": 120 tokens (M of fprop / dgrad, K of wgrad) and features that are multiples of
    # 16 but not of 128 or 32: every block kernel needs padding somewhere.
    layer, x, y = run_layer(cuda.device, RECIPES[recipe_name](), dtype, bias, tokens, features, transposed)
    assert y.shape == (*tokens, features[1]) and y.dtype == dtype and y.is_contiguous()
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert layer.weight.grad.shape == tuple(layer.weight.shape) and layer.weight.grad.dtype == dtype
    if bias:
        assert layer.bias.grad.shape == (features[1],) and layer.bias.grad.dtype == dtype
    assert cuda.scaled_gemms() == 3  # fprop, dgrad, wgrad on the kernels
    assert cuda.float32_mm == 0  # the emulation never ran
    cuda.clean()
    for op, operands in cuda.gemms:
        (a_shape, a_stride, _), (b_shape, b_stride, _) = operands[:2]
        assert a_stride[1] == 1 and b_stride[0] == 1, (op, operands)  # row-major x column-major


@pytest.mark.parametrize("cuda,recipe_name", [(SM["sm90"], "delayed"), (SM["sm90"], "blockwise"), (SM["sm100"], "mxfp8")],
                         indirect=["cuda"], ids=["sm90-delayed", "sm90-blockwise", "sm100-mxfp8"])
@pytest.mark.parametrize("high", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["fprop", "dgrad", "wgrad"])
def test_a_gemm_kept_in_high_precision_leaves_the_others_on_the_kernels(cuda, recipe_name, high):
    # Transformer Engine's override_linear_precision: True runs that GEMM in high precision.
    recipe = RECIPES[recipe_name](override_linear_precision=high)
    layer, x, y = run_layer(cuda.device, recipe, torch.bfloat16, True, (3, 40), (256, 384))
    assert y.shape == (3, 40, 384) and x.grad.shape == x.shape and layer.weight.grad.shape == (384, 256)
    assert cuda.scaled_gemms() == 2 and cuda.float32_mm == 0
    assert cuda.ops["aten.mm.default"] + cuda.ops["aten.addmm.default"] == 1  # the one in BF16, as nn.Linear
    cuda.clean()


@pytest.mark.parametrize("cuda,recipe_name", [(SM[sm], name) for sm, name in EMULATED_CASES], indirect=["cuda"],
                         ids=[f"{sm}-{name}" for sm, name in EMULATED_CASES])
def test_without_a_native_kernel_the_layer_runs_the_emulation(cuda, recipe_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "FP8 GEMM emulated ...": once per process
        layer, x, y = run_layer(cuda.device, RECIPES[recipe_name](), torch.bfloat16, True, (2, 64), (256, 384))
    assert y.shape == (2, 64, 384) and x.grad.shape == x.shape
    assert cuda.scaled_gemms() == 0 and cuda.float32_mm == 3
    cuda.clean()


@pytest.mark.parametrize("cuda", [cap(sm) for sm in SM], indirect=True)
def test_native_kernels_per_compute_capability(cuda):
    sm = next(name for name, value in SM.items() if value == cuda.capability)
    assert device_kind(cuda.device) == "cuda" and cuda_capability(cuda.device) == cuda.capability
    assert tensor_device_kind(torch.empty(1, device=cuda.device)) == "cuda"  # a real GPU's tensor too
    expected = {"tensorwise": sm != "sm80", "blockwise": sm == "sm90", "mxfp8": sm in ("sm100", "sm120")}
    for kind, native in expected.items():
        support = gemm.native_gemm(kind, cuda.device)
        assert support.native == native, (kind, support)
        if not native:
            assert ("8.9" in support.reason) if kind == "tensorwise" else (f"not {sm}" in support.reason)
    # "auto" picks MXFP8 where its GEMMs are native, else delayed scaling (docs/recipes.md).
    auto = fp8_plugin.numerics.device.auto_recipe(device=cuda.device)
    assert isinstance(auto, fp8_plugin.MXFP8BlockScaling if expected["mxfp8"] else fp8_plugin.DelayedScaling)
    cuda.clean()


def test_meta_is_cuda_only_inside_the_seam():
    meta, cpu = torch.empty(1, device=META), torch.empty(1)
    assert device_kind(META) == tensor_device_kind(meta) == "meta" and device_kind("cpu") == tensor_device_kind(cpu) == "cpu"
    with meta_as_cuda((10, 0)):
        assert device_kind(META) == tensor_device_kind(meta) == "cuda"
        assert device_kind("cpu") == tensor_device_kind(cpu) == "cpu"
    with pytest.raises(ValueError, match=r"meta_as_cuda\(capability=9\).*valid: a \(major, minor\) pair"):
        with meta_as_cuda(9):
            pass


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_a_bare_cuda_device_is_pinned_to_the_current_index(cuda):
    index = torch.cuda.current_device()  # 0 in the meta mode (the fixture's stand-in)
    assert gemm.normalize_device("cuda") == torch.device("cuda", index)
    assert gemm.normalize_device(cuda.device) == cuda.device
    assert gemm.normalize_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_block_kinds_need_torch_scaled_mm(cuda, monkeypatch):
    monkeypatch.delattr(F, "scaled_mm")
    support = gemm.native_gemm("blockwise", cuda.device)
    assert not support.native and "has no torch.nn.functional.scaled_mm" in support.reason


@pytest.mark.parametrize("cuda", [cap("sm90"), cap("sm100")], indirect=True)
def test_the_block_probe_reads_the_host_so_tests_force_the_native_path(cuda):
    # Outside force_path("native") a block kind is probed once per device: a small GEMM whose
    # result is compared on the host with the emulation. On meta tensors that read fails, as the
    # fixture's record shows; on a GPU it is one sync per device and process, before training,
    # and the probe's verdict there is the kernel's numerics against the emulation.
    kind = "blockwise" if cuda.capability == (9, 0) else "mxfp8"
    gemm.clear_plans()
    if cuda.real:
        with gemm.force_path("auto"):
            support = gemm.native_gemm(kind, cuda.device)
        assert support.native and torch.bfloat16 in support.out_dtypes, support
        # Its operands are made on the host, its errors read back: syncs, once per device.
        assert cuda.to_device_copies and "aten._local_scalar_dense.default" in cuda.host_reads
    else:
        with gemm.force_path("auto"), pytest.raises(RuntimeError, match="meta"):
            gemm.native_gemm(kind, cuda.device)
        assert cuda.host_reads == ["aten._local_scalar_dense.default"]
    assert cuda.scaled_gemms() >= 1  # the probe reached its kernel before the read


def quantized(device, rows, cols, dtype=E4M3, block=None):
    data = torch.empty(rows, cols, dtype=dtype, device=device)
    if block is None:
        return QuantizedTensor(data, torch.ones((), device=device))
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    return QuantizedTensor(data, torch.ones(grid, device=device), block)


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_tensorwise_auto_path_on_cuda_takes_the_kernel_untimed(cuda):
    before = gemm.tensorwise_choice.cache_info()
    with gemm.force_path("auto"):
        out = gemm.fp8_gemm(quantized(cuda.device, 32, 64), quantized(cuda.device, 48, 64), torch.bfloat16)
    assert out.shape == (32, 48) and cuda.scaled_gemms() == 1
    assert gemm.tensorwise_choice.cache_info() == before  # no timing on a GPU
    cuda.clean()


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_e5m2_by_e5m2_is_emulated_on_cuda(cuda):
    # cuBLASLt has no E5M2 x E5M2 FP8 GEMM (torch's CUDA _scaled_mm refuses the pair).
    a, b = quantized(cuda.device, 32, 64, E5M2), quantized(cuda.device, 48, 64, E5M2)
    supported, reason = gemm.scaled_mm_supported(a, b)
    assert not supported and reason == "E5M2 x E5M2 has no CUDA kernel"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = gemm.fp8_gemm(a, b, torch.bfloat16)
    assert out.shape == (32, 48) and cuda.scaled_gemms() == 0 and cuda.float32_mm == 1
    # E5M2 x E4M3 (HYBRID dgrad / wgrad) has a kernel.
    assert gemm.scaled_mm_supported(quantized(cuda.device, 32, 64, E5M2), quantized(cuda.device, 48, 64))[0]
    cuda.clean()


# (kind's blocks, capability, (M, K, N), the kernel's (M, K, N): multiples of 16; K of 128
# (blockwise) or 32 (MXFP8); N of 128 for a 128x128-scaled second operand).
PADDING = [
    ("tensorwise", None, None, "sm89", (60, 40, 50), (64, 48, 64)),
    ("tensorwise", None, None, "sm90", (64, 64, 64), (64, 64, 64)),
    ("blockwise", (1, 128), (128, 128), "sm90", (100, 200, 150), (112, 256, 256)),
    ("blockwise", (1, 128), (1, 128), "sm90", (100, 200, 150), (112, 256, 160)),
    ("mxfp8", (1, 32), (1, 32), "sm100", (100, 80, 150), (112, 96, 160)),
    ("mxfp8", (1, 32), (1, 32), "sm120", (128, 128, 128), (128, 128, 128)),
]


@pytest.mark.parametrize("cuda,kind,block_a,block_b,mkn,kernel_mkn",
                         [(SM[sm], kind, ba, bb, mkn, kmkn) for kind, ba, bb, sm, mkn, kmkn in PADDING],
                         indirect=["cuda"], ids=[f"{k}-{bb}-{sm}-{mkn}" for k, _, bb, sm, mkn, _ in PADDING])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemm_pads_to_the_kernels_multiples(cuda, kind, block_a, block_b, mkn, kernel_mkn, out_dtype):
    m, k, n = mkn
    a, b = quantized(cuda.device, m, k, block=block_a), quantized(cuda.device, n, k, block=block_b)
    bias = torch.empty(n, device=cuda.device, dtype=torch.bfloat16)
    out = gemm.fp8_gemm(a, b, out_dtype, bias)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    assert len(cuda.gemms) == 1
    (a_shape, _, _), (bt_shape, bt_stride, _) = cuda.gemms[0][1][:2]
    km, kk, kn = kernel_mkn
    assert a_shape == (km, kk) and bt_shape == (kk, kn) and bt_stride[0] == 1
    cuda.clean()


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tensorwise_bias_follows_the_cuda_kernel_rules(cuda, out_dtype, bias_dtype):
    bias = torch.empty(48, device=cuda.device, dtype=bias_dtype)
    out = gemm.fp8_gemm(quantized(cuda.device, 32, 64), quantized(cuda.device, 48, 64), out_dtype, bias)
    assert out.shape == (32, 48) and out.dtype == out_dtype
    kernel_bias = [operands[4:5] for _, operands in cuda.gemms][0]
    if out_dtype == torch.float32:
        assert kernel_bias == []  # added after the GEMM: the kernel takes no bias for float32 outputs
    else:
        assert kernel_bias[0][2] == out_dtype  # fused, in the output dtype
    cuda.clean()


@pytest.mark.parametrize("cuda,kind", [(SM["sm90"], "blockwise"), (SM["sm100"], "mxfp8")], indirect=["cuda"],
                         ids=["sm90-blockwise", "sm100-mxfp8"])
def test_block_kernel_output_dtype_fallback(cuda, kind):
    # A kernel the probe found not to write float32: bfloat16 from the kernel, then the cast.
    block = (1, 128) if kind == "blockwise" else (1, 32)
    a, b = quantized(cuda.device, 128, 256, block=block), quantized(cuda.device, 128, 256, block=block)
    support = gemm.NativeGemm(True, "", (torch.bfloat16,))
    out = gemm._native(kind, support, a, b, torch.float32, torch.empty(128, device=cuda.device))
    assert out.dtype == torch.float32 and out.shape == (128, 128)
    assert cuda.gemms[0][0] == "aten._scaled_mm_v2.default"
    cuda.clean()


# ---------------------------------------------------------------------------------------------
# Tiny transformers models, one training step through the loop-neutral core. Two blocks, but
# layers of an LLM's width: on a GPU, convert_model leaves layers too small for FP8 to be faster
# in high precision (skip_small, torchao's H100 thresholds). Meta tensors cost nothing.


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                         vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=4096, n_layer=2, n_head=32,
                                      bos_token_id=0, eos_token_id=0))


MODEL_CASES = [("llama", "sm90", "delayed"), ("gpt2", "sm89", "current"), ("llama", "sm90", "blockwise"),
               ("gpt2", "sm100", "mxfp8"), ("gpt2", "sm90", "delayed")]


@pytest.mark.parametrize("cuda,model_name,recipe_name", [(SM[sm], m, r) for m, sm, r in MODEL_CASES],
                         indirect=["cuda"], ids=[f"{m}-{sm}-{r}" for m, sm, r in MODEL_CASES])
def test_training_step_of_a_converted_model_runs_native_without_a_host_sync(cuda, model_name, recipe_name):
    with torch.device(cuda.device):
        model = (tiny_llama if model_name == "llama" else tiny_gpt2)().to(torch.bfloat16)
    # As the Lightning and Accelerate adapters drive it (fp8_plugin/lightning/precision.py,
    # fp8_plugin/accelerate/accelerator.py); the model is in bf16, as CUDA autocast is off here.
    run = FP8Training(RECIPES[recipe_name](), compute_dtype=torch.bfloat16)
    run.convert(model)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == {"llama": 14, "gpt2": 8}[model_name]  # 7 / 4 linear layers per block, lm_head stays
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.zeros(2, 24, dtype=torch.long, device=cuda.device)  # 48 tokens: padded for every kernel
    cuda.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")  # torch.autocast("cuda")
        with run.forward_context(device_kind(cuda.device)):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if recipe_name == "delayed":  # amaxes wait for the update
        follows = [layer.fp8_state.input_source is not layer.fp8_state for layer in layers]
        # Llama's k, v and up take q's and gate's input cast (one tensor, one amax); GPT-2 has no such pair.
        assert sum(follows) == {"llama": 3 * 2, "gpt2": 0}[model_name]
        assert all(set(layer.fp8_state.pending) == ({1, 2} if follow else {0, 1, 2})
                   for layer, follow in zip(layers, follows))
    optimizer.step()
    optimizer.zero_grad()
    run.after_optimizer_step()  # the scale update, with the amax reduction when distributed
    assert not any(layer.fp8_state.pending for layer in layers)
    assert cuda.scaled_gemms() == 3 * len(layers)  # every FP8 GEMM on a kernel
    assert cuda.float32_mm == 0
    cuda.clean()  # no host sync in forward, backward, optimizer step and scale update


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_the_fault_check_is_the_steps_one_host_read(cuda):
    # Deciding whether to take the optimizer step (non-finite gradients, amax events) needs the
    # host, as GradScaler's does: FP8Training.before_optimizer_step reads one tensor, once.
    with torch.device(cuda.device):
        # Wide enough for FP8 on a GPU (skip_small)
        model = nn.Sequential(nn.Linear(64, 2048), nn.Linear(2048, 2048)).to(torch.bfloat16)
    run = FP8Training(fp8_plugin.DelayedScaling(), compute_dtype=torch.bfloat16)
    run.convert(model)
    assert len(run.report.swapped) == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        with run.forward_context():
            # Zeros: finite gradients on a GPU too, where the check's verdict is read.
            out = model(torch.zeros(32, 64, device=cuda.device, dtype=torch.bfloat16))
    out.sum().backward()
    cuda.clean()
    if cuda.real:
        assert run.before_optimizer_step() is True
    else:
        with pytest.raises(RuntimeError, match="meta"):
            run.before_optimizer_step()
    assert cuda.host_reads == ["aten._to_copy.default"]


# ---------------------------------------------------------------------------------------------
# FSDP2's FP8 all-gather hooks, on rank 0 of two.


class _RankOfTwo:
    """The mesh FSDP2 hands the hooks, as rank 0 of a 2-rank shard group sees it; its group is a
    1-process gloo group, so the amax all-reduce (world size > 1) is not taken here."""

    def __init__(self, group):
        self.group = group

    def get_group(self):
        return self.group

    def size(self):
        return 2


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_fsdp_fp8_all_gather_hooks_on_one_rank(cuda, one_process_group, transposed):
    rows, cols = (256, 200) if transposed else (200, 256)  # stored layout; 200 rows: an uneven shard
    dev = cuda.device
    layer = FP8Linear(256, 200, bias=False, device=dev, dtype=torch.bfloat16, recipe=fp8_plugin.Float8CurrentScaling())
    layer.weight_transposed = transposed
    mesh = _RankOfTwo(one_process_group)
    shard = FP8AllGatherWeight(torch.empty(rows // 2 - 4, cols, device=dev, dtype=torch.bfloat16))
    x = torch.empty(3, 40, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    with fp8_plugin.autocast():  # FSDP gathers in the forward: a training gather
        (data,), (scale_inv,) = shard.fsdp_pre_all_gather(mesh, torch.Size((rows, cols)), (cols, 1), layer, None)
        assert data.dtype == E4M3 and data.shape == (rows // 2, cols) and data.is_contiguous()  # FSDP's padded shard
        assert scale_inv.shape == () and scale_inv.dtype == torch.float32 and scale_inv.device == dev
        empty = FP8AllGatherWeight(torch.empty(0, cols, device=dev, dtype=torch.bfloat16))
        (empty_data,), _ = empty.fsdp_pre_all_gather(mesh, torch.Size((rows, cols)), (cols, 1), layer, None)
        assert empty_data.shape == (rows // 2, cols)
        gathered_data = torch.empty(rows, cols, dtype=E4M3, device=dev)  # what the all-gather returns
        weight, inner = shard.fsdp_post_all_gather((gathered_data,), (scale_inv,), torch.bfloat16)
        assert isinstance(weight, FP8GatheredWeight) and inner == (gathered_data,) and weight.dtype == torch.bfloat16
        assert shard.fsdp_post_all_gather((gathered_data,), (scale_inv,), torch.bfloat16, out=weight) is None
        unpadded = weight.view(rows, cols)  # FSDP views the gathered weight at its unpadded size
        assert isinstance(unpadded, FP8GatheredWeight)
        layer.weight = nn.Parameter(unpadded, requires_grad=False)
        cuda.clean()
        cuda.reset()
        y = layer(x)
    y.backward(torch.empty_like(y))
    assert y.shape == (3, 40, 200) and x.grad.shape == x.shape
    assert cuda.scaled_gemms() == 2 and cuda.float32_mm == 0  # fprop and dgrad; a frozen gathered weight
    cuda.clean()


# ---------------------------------------------------------------------------------------------
# The reference check's RNG capture and restore on a CUDA device.


@pytest.mark.parametrize("cuda", [cap("sm90")], indirect=True)
def test_reference_check_captures_and_restores_the_cuda_rng(cuda):
    dev = cuda.device
    cpu_before = torch.get_rng_state()
    state = capture_rng_state(dev)
    assert state.device == dev and state.device_state.dtype == torch.uint8
    captured = state.device_state.clone()
    # The training forward draws its dropout masks: both generators move on.
    torch.rand(3)
    if cuda.real:
        torch.rand(3, device=dev)
        assert not torch.equal(cuda.device_rng_state(), captured)
    else:
        torch.cuda.set_rng_state(torch.Generator().manual_seed(99).get_state(), dev)
    _restore_rng_state(state)  # the replay starts where the training forward started
    assert torch.equal(cuda.device_rng_state(), captured)
    assert torch.equal(torch.get_rng_state(), cpu_before)
    # FP8Training keeps the state with the replay when a check is due.
    with torch.device(dev):
        model = nn.Sequential(nn.Linear(64, 2048)).to(torch.bfloat16)
    run = FP8Training(fp8_plugin.DelayedScaling(), reference_check=fp8_plugin.ReferenceCheck(every=1))
    run.convert(model)
    assert len(run.report.swapped) == 1
    run.capture_replay(lambda: torch.zeros((), device=dev))
    _, kept = run.reference._capture
    assert kept.device == dev and torch.equal(kept.device_state, cuda.device_rng_state())
    cuda.clean()
