"""fp8_plugin/linear.py: FP8Linear forward, dgrad and wgrad against float64 references."""

import copy

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8CurrentScaling, Format
from reference import fp8_operand, te_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _amax(t):
    return t.detach().abs().max().item()


@pytest.mark.parametrize("fmt, grad_dtype", [(Format.HYBRID, E5M2), (Format.E4M3, E4M3)])
@pytest.mark.parametrize("recipe_cls", [DelayedScaling, Float8CurrentScaling])
def test_forward_dgrad_wgrad_match_float64_reference(recipe_cls, fmt, grad_dtype):
    layer = fp.FP8Linear(48, 32, recipe=recipe_cls(fp8_format=fmt))
    x = (torch.randn(4, 8, 48) * 3).requires_grad_()
    g = torch.randn(4, 8, 32) * 1e-3
    with fp.autocast():
        y = layer(x)
    y.backward(g)

    # First step of delayed scaling and every step of current scaling: scale from own amax.
    xq = fp8_operand(x.detach(), te_scale(_amax(x), E4M3), E4M3)
    wq = fp8_operand(layer.weight.detach(), te_scale(_amax(layer.weight), E4M3), E4M3)
    gq = fp8_operand(g, te_scale(_amax(g), grad_dtype), grad_dtype)
    ref_y = xq @ wq.t() + layer.bias.double()
    ref_dx = gq @ wq
    ref_dw = gq.reshape(-1, 32).t() @ xq.reshape(-1, 48)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(layer.weight.grad.double(), ref_dw, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(layer.bias.grad.double(), g.double().sum((0, 1)), rtol=1e-5, atol=1e-9)
    assert layer.weight.grad.dtype == torch.float32


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
    saved = y.grad_fn.saved_tensors
    dtypes = sorted(str(t.dtype) for t in saved if t.dim() == 2)
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
    for name, buf in a.fp8_state.named_buffers():
        assert torch.equal(buf, getattr(b.fp8_state, name)), name
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
