"""fp8_plugin/modules/linear.py: FP8Linear forward, dgrad and wgrad against float64 references."""

import copy

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.gemm import force_path
from fp8_plugin.numerics.gemm_kernels import emulated_bf16
from fp8_plugin import DelayedScaling, Float8CurrentScaling, Format
from reference import assert_within_bound, fp8_operand, fp8_operand_fp32, gemm_error_bound, te_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _amax(t):
    return t.detach().abs().max().item()


@pytest.mark.parametrize("path", ["native", "emulated", "emulated-bf16"])
@pytest.mark.parametrize("fmt, grad_dtype", [(Format.HYBRID, E5M2), (Format.E4M3, E4M3)])
@pytest.mark.parametrize("recipe_cls", [DelayedScaling, Float8CurrentScaling])
def test_forward_dgrad_wgrad_match_float64_reference(recipe_cls, fmt, grad_dtype, path, monkeypatch):
    layer = fp.FP8Linear(48, 32, recipe=recipe_cls(fp8_format=fmt))
    x = (torch.randn(4, 8, 48) * 3).requires_grad_()
    g = torch.randn(4, 8, 32) * 1e-3
    bf16_gemms = []
    monkeypatch.setattr(gemm, "_emulated_bf16", lambda *a: bf16_gemms.append(1) or emulated_bf16(*a))
    if path == "emulated-bf16":  # as a process that chose it runs: columnwise copies are views
        monkeypatch.setenv("FP8_PLUGIN_CPU_EMULATION", "bfloat16")
    with force_path(path), fp.autocast():
        y = layer(x)
    with force_path(path):
        y.backward(g)
    bf16 = path == "emulated-bf16"
    assert len(bf16_gemms) == (3 if bf16 else 0)  # fprop, dgrad, wgrad each a BF16 GEMM, or none

    # First step of delayed scaling and every step of current scaling: scale from own amax.
    xq = fp8_operand(x.detach(), te_scale(_amax(x), E4M3), E4M3)
    wq = fp8_operand(layer.weight.detach(), te_scale(_amax(layer.weight), E4M3), E4M3)
    gq = fp8_operand(g, te_scale(_amax(g), grad_dtype), grad_dtype)
    x2, g2 = xq.reshape(-1, 48), gq.reshape(-1, 32)
    bias = layer.bias.detach().double()
    # Tolerances from float32 accumulation error bounds (reference.gemm_error_bound), not from
    # what one CPU's kernel happened to give.
    # The BF16 emulation adds one bfloat16 rounding of each output (reference.bf16_rounding).
    assert_within_bound(y.reshape(-1, 32), x2 @ wq.t() + bias, gemm_error_bound(x2, wq, torch.float32, bias, bf16))
    assert_within_bound(x.grad.reshape(-1, 48), g2 @ wq, gemm_error_bound(g2, wq.t().contiguous(), bf16_gemm=bf16))
    assert_within_bound(layer.weight.grad, g2.t() @ x2,
                        gemm_error_bound(g2.t().contiguous(), x2.t().contiguous(), bf16_gemm=bf16))
    # The bias gradient is a float32 sum of the 32 unquantized grad_output rows.
    bias_grad_bound = 32 * 2.0**-24 * g.double().abs().sum((0, 1))
    assert_within_bound(layer.bias.grad, g.double().sum((0, 1)), bias_grad_bound)
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_a_bf16_weights_wgrad_is_the_fp32_accumulation_rounded_once_to_bf16(path):
    # The wgrad GEMM writes a BF16 weight's gradient itself: the float64 product of the FP8
    # operands within float32 accumulation's bound plus one bfloat16 rounding.
    torch.manual_seed(0)
    layer = fp.FP8Linear(48, 32, bias=False, dtype=torch.bfloat16)
    x = (torch.randn(64, 48) * 3).to(torch.bfloat16)
    g = (torch.randn(64, 32) * 1e-3).to(torch.bfloat16)
    with force_path(path), fp.autocast():
        y = layer(x)
    with force_path(path):
        y.backward(g)
    assert layer.weight.grad.dtype == torch.bfloat16
    xq, gq = fp8_operand_fp32(x, E4M3), fp8_operand_fp32(g, E5M2)
    gt, xt = gq.t().contiguous(), xq.t().contiguous()
    assert_within_bound(layer.weight.grad, gq.t() @ xq, gemm_error_bound(gt, xt, torch.bfloat16))


def test_fp8_actually_changes_the_result_and_is_close_to_high_precision():
    lin = nn.Linear(64, 64)
    layer = fp.FP8Linear.from_module(copy.deepcopy(lin))
    x = torch.randn(32, 64)
    with fp.autocast():
        y8 = layer(x)
    y = lin(x)
    assert not torch.equal(y8, y)
    assert (y8 - y).norm() / y.norm() < 0.1


def test_outside_autocast_and_switched_off_layers_are_exactly_nn_linear():
    lin = nn.Linear(64, 32)
    layer = fp.FP8Linear.from_module(lin)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), lin(x))
    layer.use_fp8 = False
    with fp.autocast():
        assert torch.equal(layer(x), lin(x))
    with fp.autocast(enabled=False):
        layer.use_fp8 = True
        assert torch.equal(layer(x), lin(x))


def test_autocast_recipe_overrides_layer_recipe():
    layer = fp.FP8Linear(16, 16, recipe=DelayedScaling(amax_history_len=8))
    x = torch.randn(4, 16)
    with fp.autocast(recipe=Float8CurrentScaling()):
        layer(x)
    # Current scaling stores the cast's own scale; delayed would have stored nothing yet.
    assert layer.fp8_state.scale[0].item() == pytest.approx(te_scale(_amax(x), E4M3))
    with pytest.raises(TypeError, match="not a recipe"):
        with fp.autocast(recipe="hybrid"):
            pass


def test_backward_keeps_fp8_copies_not_high_precision_tensors():
    layer = fp.FP8Linear(32, 32)
    x = torch.randn(16, 32, requires_grad=True)
    with fp.autocast():
        y = layer(x)
    node = y.grad_fn if hasattr(y.grad_fn, "saved_tensors") else y.grad_fn.next_functions[0][0]
    saved = node.saved_tensors
    dtypes = sorted(str(t.dtype) for t in saved if t is not None and t.dim() == 2)  # None: no GEMM-layout scales
    assert dtypes == ["torch.float8_e4m3fn", "torch.float8_e4m3fn"]


def test_output_follows_torch_autocast_dtype():
    layer = fp.FP8Linear(32, 32)
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp.autocast():
        assert layer(x).dtype == torch.bfloat16
    with fp.autocast():
        assert layer(x).dtype == torch.float32


def test_state_dict_round_trip_restores_identical_scales():
    a = fp.FP8Linear(32, 32, recipe=DelayedScaling(amax_history_len=4))
    for _ in range(3):
        with fp.autocast():
            a(torch.randn(8, 32) * 5).sum().backward()
    b = fp.FP8Linear(32, 32, recipe=DelayedScaling(amax_history_len=16))
    b.load_state_dict(a.state_dict())
    for name, tensor in a.fp8_state.tensors().items():
        assert torch.equal(tensor, getattr(b.fp8_state, name)), name
    x = torch.randn(8, 32)
    with fp.autocast(recipe=DelayedScaling(amax_history_len=4)):
        assert torch.equal(a(x), b(x))


def test_vanilla_state_dict_loads_into_converted_layer():
    lin = nn.Linear(32, 16)
    layer = fp.FP8Linear(32, 16)
    result = layer.load_state_dict(lin.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(layer.weight, lin.weight)


def test_model_to_bfloat16_keeps_scaling_state_float32():
    layer = fp.FP8Linear(16, 16)
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_state.scale.dtype == torch.float32
    assert layer.fp8_state.amax_history.dtype == torch.float32


def test_large_input_saturates_instead_of_overflowing():
    recipe = DelayedScaling(amax_history_len=2)
    layer = fp.FP8Linear(16, 16, recipe=recipe)
    with fp.autocast():
        layer(torch.full((4, 16), 0.01))  # history now says amax 0.01
    with fp.autocast():
        y = layer(torch.full((4, 16), 1e4))  # far beyond 448 / scale: clamps to +-448
    assert torch.isfinite(y).all()


def test_output_may_be_modified_in_place():
    # Models add to a linear's output in place (Falcon's attention); the output must not be a
    # view made inside the autograd Function.
    lin = nn.Linear(32, 32)
    layer = fp.FP8Linear.from_module(copy.deepcopy(lin))
    x = torch.randn(2, 8, 32)
    with fp.autocast():
        y = layer(x)
        y.add_(1.0)
    y.sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("shape, gemms", [((32,), (True, True, True)), ((3, 5, 32), (True, True, True)),
                                           ((3, 5, 32), (True, False, False)), ("transposed", (True, True, True))])
def test_an_nd_input_gives_the_2d_runs_output_and_gradients_bit_for_bit(shape, gemms):
    # The layer sees [..., K] as [M, K] (a 2-D input as it is, with no view): the output and
    # every gradient equal the same layer's run on the input flattened beforehand, for a 1-D
    # input, a 3-D one, one whose dgrad and wgrad run in high precision, and a non-contiguous one
    # (a transposed 3-D tensor).
    torch.manual_seed(0)
    x = torch.randn(5, 3, 32).transpose(0, 1) if shape == "transposed" else torch.randn(*shape)
    grad = torch.randn(*x.shape[:-1], 16)
    runs = []
    for flat in (False, True):
        layer = fp.FP8Linear(32, 16, recipe=Float8CurrentScaling())
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(-1, 1, 512).reshape(16, 32)), layer.bias.fill_(0.25)
        layer.fp8_gemms = gemms
        xi = x.clone().requires_grad_()
        with fp.autocast():
            y = layer(xi.reshape(-1, 32)) if flat else layer(xi)
        assert y.shape == ((x.numel() // 32, 16) if flat else (*x.shape[:-1], 16))
        if flat:  # the function's own output, no view node between it and the caller
            assert type(y.grad_fn).__name__ == "FP8LinearFunctionBackward"
        y.reshape(*x.shape[:-1], 16).backward(grad)
        runs.append((y.reshape(-1, 16), xi.grad, layer.weight.grad, layer.bias.grad))
    for got, expected in zip(*runs):
        assert torch.equal(got, expected)


def test_float64_layer_runs_fp8_gemms_and_returns_float64():
    layer = fp.FP8Linear(32, 16, dtype=torch.float64, recipe=Float8CurrentScaling())
    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    with fp.autocast():
        y = layer(x)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.float64
    xq = fp8_operand(x.detach(), te_scale(_amax(x), E4M3), E4M3)
    wq = fp8_operand(layer.weight.detach(), te_scale(_amax(layer.weight), E4M3), E4M3)
    ref = xq @ wq.t() + layer.bias.detach()
    # float32 accumulation over K = 32 terms of products of FP8 values (exact in float32).
    bound = 32 * 2.0**-24 * (xq.abs() @ wq.abs().t()) + 2.0**-24 * layer.bias.detach().abs()
    assert ((y.detach() - ref).abs() <= bound).all()


def test_scaling_state_is_float32_under_bfloat16_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = fp.FP8Linear(16, 16)
    finally:
        torch.set_default_dtype(previous)
    state = layer.fp8_state
    assert state.scale.dtype == state.amax_history.dtype == torch.float32


def test_scaling_state_is_not_a_buffer_data_parallel_wrappers_would_broadcast():
    # DDP broadcasts buffers from rank 0 before every forward: FP8 state must not be one.
    layer = fp.FP8Linear(16, 16)
    assert [name for name, _ in layer.named_buffers()] == []
    assert list(layer.state_dict()) == ["weight", "bias", "fp8_state._extra_state"]


def test_evaluation_forwards_leave_the_scaling_state_alone():
    # Transformer Engine updates delayed scaling only for forwards with grad: validation
    # batches (here 10x larger) must not cut the training scales.
    layer = fp.FP8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
    for _ in range(2):
        with fp.autocast():
            layer(torch.randn(8, 16)).sum().backward()
    before = {k: v.clone() for k, v in layer.fp8_state.tensors().items()}
    pending = dict(layer.fp8_state.pending)
    calls = []
    with torch.no_grad(), fp.autocast(reduce_amax=calls.append):
        for _ in range(4):
            layer(torch.randn(8, 16) * 10)
    with torch.inference_mode(), fp.autocast(reduce_amax=calls.append):
        layer(torch.randn(8, 16) * 10)
    for name, tensor in layer.fp8_state.tensors().items():
        assert torch.equal(tensor, before[name]), name
    assert layer.fp8_state.pending == pending
    assert calls == []  # no amax reduction (a collective in distributed runs) outside training
