"""fp8_plugin/numerics/scaling.py and formats.py: casts against the OCP OFP8 error bounds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_plugin.numerics.formats import Format, fp8_max, parse_format
from fp8_plugin.numerics.scaling import amax, dequantize, quantize, scale_from_amax
from reference import MANTISSA_BITS, MAX, MIN_NORMAL_EXP

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_format_dtypes_follow_te_hybrid_definition():
    assert Format.HYBRID.forward_dtype == torch.float8_e4m3fn
    assert Format.HYBRID.backward_dtype == torch.float8_e5m2
    assert Format.E4M3.backward_dtype == torch.float8_e4m3fn
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(torch.float8_e5m2) == 57344.0


def test_unknown_format_name_lists_valid_ones():
    assert parse_format("hybrid") is Format.HYBRID
    with pytest.raises(ValueError, match="Format.E4M3, Format.E5M2, Format.HYBRID"):
        parse_format("E3M4")


@pytest.mark.parametrize("dtype", FP8)
@settings(max_examples=200, deadline=None)
@given(
    mantissa=st.floats(1.0, 2.0, exclude_max=True),
    exponent=st.integers(-30, 30),
    sign=st.sampled_from([-1.0, 1.0]),
    scale_exp=st.integers(-20, 20),
)
def test_roundtrip_error_within_format_bound(dtype, mantissa, exponent, sign, scale_exp):
    x = sign * mantissa * 2.0**exponent
    scale = 2.0**scale_exp * 1.37  # a non power of two scale, as real amaxes give
    if abs(x) * scale > MAX[dtype]:
        return  # saturation is tested on its own
    t = torch.tensor([x], dtype=torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    got = dequantize(quantize(t, s, dtype), s.reciprocal(), torch.float64).item()
    # Round to nearest: relative error <= 2^-(m+1) for normals; absolute error <= half the
    # subnormal spacing 2^(emin - m) below the normal range, both in the scaled domain.
    m = MANTISSA_BITS[dtype]
    bound = max(abs(x) * 2.0 ** -(m + 1), 2.0 ** (MIN_NORMAL_EXP[dtype] - m - 1) / scale)
    assert abs(got - x) <= bound * (1 + 1e-6) + abs(x) * 2**-23


# The caller's amax, where it has one, lets a CPU cast of finite data skip its infinity passes:
# the bytes must be those of the cast without it.
WITH_AMAX = pytest.mark.parametrize("with_amax", [False, True], ids=["cast", "cast-given-amax"])


@WITH_AMAX
@pytest.mark.parametrize("dtype", FP8)
def test_out_of_range_values_saturate_to_max(dtype, with_amax):
    x = torch.tensor([1e9, -1e9, 3 * MAX[dtype]])
    q = quantize(x, torch.tensor(1.0), dtype, amax(x) if with_amax else None).float()
    assert q.tolist() == [MAX[dtype], -MAX[dtype], MAX[dtype]]
    big = torch.tensor([1e30, -1e30])  # finite, but inf in float32 once scaled: saturates too
    assert quantize(big, torch.tensor(2.0**100), dtype, amax(big) if with_amax else None).float().tolist() == [
        MAX[dtype], -MAX[dtype]]
    if dtype == torch.float8_e5m2:
        # A plain cast overflows to inf (what the clamp protects against); torch's E4M3 cast
        # happens to saturate on CPU, which the clamp does not rely on.
        assert torch.tensor([1e9]).to(dtype).float().isinf().all()


@WITH_AMAX
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
def test_infinities_are_kept_not_saturated(dtype, input_dtype, with_amax):
    # OCP OFP8: E5M2 has inf, E4M3 (fn) has none and maps inf to NaN. An inf must survive the
    # cast so that GradScaler sees the overflow; a large finite value still saturates. The cast
    # works on a temporary of its own: the input is left as it was.
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30], dtype=input_dtype)
    before = x.clone()
    q = quantize(x, torch.tensor(2.0**100), dtype, amax(x) if with_amax else None).float()
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.float8_e5m2:
        assert q[0].item() == float("inf") and q[1].item() == -float("inf")
    else:
        assert math.isnan(q[0].item()) and math.isnan(q[1].item())
    assert math.isnan(q[2].item())
    assert q[3].item() == MAX[dtype]  # 1e30 * 2^100 is inf in float32, but x is finite


@pytest.mark.parametrize("dtype", FP8)
def test_a_cast_of_a_tensor_that_requires_grad_runs_under_autograd(dtype):
    # The cast works in place on its own temporary; autograd must accept that with grad enabled.
    x = torch.tensor([1.0, -1e9, float("inf")], requires_grad=True)
    q = quantize(x * 1.0, torch.tensor(1.0), dtype).float()
    assert q[:2].tolist() == [1.0, -MAX[dtype]]
    assert q[2].item() == float("inf") if dtype == torch.float8_e5m2 else math.isnan(q[2].item())


def test_scale_formula_and_guards():
    prev = torch.tensor([7.0, 7.0, 7.0, 7.0])
    a = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    s = scale_from_amax(a, 448.0, 2, prev)
    assert s[0].item() == pytest.approx(448.0 / 2.0 / 4.0)
    assert s[1:].tolist() == [7.0, 7.0, 7.0]  # zero and non-finite amaxes keep the previous scale
    tiny = scale_from_amax(torch.tensor([1e-45]), 448.0, 0, torch.tensor([1.0]))
    assert math.isfinite(tiny.item())


def test_amax_of_empty_and_nan_tensors():
    assert amax(torch.empty(0, 4)).item() == 0.0
    assert math.isnan(amax(torch.tensor([1.0, float("nan")])).item())
    assert amax(torch.tensor([-3.0, 2.0], dtype=torch.bfloat16)).dtype == torch.float32
