"""fp8_plugin/numerics/gemm.py, property-based: the two CPU paths agree bit for bit and stay within the bound.

Over random shapes (any M, N; K any multiple of 8 and some odd ones), the operand pairings of a
training step, power-of-two and arbitrary float32 scales, with and without bias, float32 and
bfloat16 outputs, both paths (the float32 emulation and ``torch._scaled_mm``) are compared with a
float64 reference. What holds, and is asserted:

- Within the float32-accumulation error bound of the float64 reference, on both paths, always.
- Bit for bit, for any data and scales, where torch computes ``_scaled_mm`` itself (CPUs without
  AMX): it dequantizes and runs one float32 GEMM, as the emulation does with the same layout.
- Bit for bit, on any CPU, where float32 accumulation is exact (values on a coarse grid) and the
  scales are powers of two: then the summation order and where the scales are applied (oneDNN
  applies them to the accumulator) cannot matter, and only the bias rule can make paths differ.

On a CPU whose E4M3 x E4M3 kernel is a reference one (~200 ns per multiply-accumulate), native
products are kept under ``MAX_NATIVE_MACS``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_plugin.numerics.gemm import force_path, fp8_gemm, native_gemm
from fp8_plugin.numerics.quantizers import QuantizedTensor
from reference import assert_within_bound, cpu_scaled_mm_uses_onednn, gemm_error_bound, scaled_gemm_error_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
MAX_NATIVE_MACS = 2**18

pytestmark = pytest.mark.skipif(not native_gemm("tensorwise", "cpu").native, reason="no torch._scaled_mm on CPU")


def _grid_operand(gen, rows, cols, dtype, scale_inv):
    # FP8 values on a 2^-2 grid within +-8: products are multiples of 2^-4 below 64 in
    # magnitude, so any sum of up to 96 of them is exact in float32, in any order.
    values = (torch.randn(rows, cols, generator=gen) * 8).round().clamp(-32, 32) / 4
    return QuantizedTensor(values.to(dtype), torch.tensor(scale_inv, dtype=torch.float32))


def _bias_as_added(bias, out_dtype):
    # The one bias rule: rounded to a low-precision output dtype, float32 otherwise.
    return bias.to(out_dtype if out_dtype != torch.float32 else torch.float32)


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 96), k=st.sampled_from([16, 32, 48, 64, 96]), n=st.integers(1, 96),
    pair=st.sampled_from(PAIRS), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    exp_a=st.integers(-12, 4), exp_b=st.integers(-12, 4), with_bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_paths_agree_bit_for_bit_on_any_cpu_where_float32_accumulation_is_exact(m, k, n, pair, out_dtype, exp_a,
                                                                                  exp_b, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    a, b = _grid_operand(gen, m, k, pair[0], 2.0**exp_a), _grid_operand(gen, n, k, pair[1], 2.0**exp_b)
    # A bias off the bfloat16 grid, so that rounding it first or not shows in bfloat16 outputs.
    bias = (torch.randn(n, generator=gen) * 64 + 1 / 3) * 2.0 ** (exp_a + exp_b) if with_bias else None
    with force_path("emulated"):
        emulated = fp8_gemm(a, b, out_dtype, bias)
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    bias64 = None if bias is None else _bias_as_added(bias, out_dtype).double()
    expected = a64 @ b64.t() + (0 if bias64 is None else bias64)
    assert_within_bound(emulated, expected, gemm_error_bound(a64, b64, out_dtype, bias64))
    if m * k * n <= MAX_NATIVE_MACS:
        with force_path("native"):
            native = fp8_gemm(a, b, out_dtype, bias)
        assert native.dtype == emulated.dtype == out_dtype
        assert torch.equal(native, emulated)


@settings(max_examples=400, deadline=None)
@given(
    m=st.integers(1, 128), k=st.sampled_from([1, 7, 16, 24, 40, 64, 100, 128, 256]), n=st.integers(1, 128),
    pair=st.sampled_from(PAIRS), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale_a=st.one_of(st.integers(-12, 4).map(lambda e: 2.0**e), st.floats(1e-3, 1e3)),
    scale_b=st.one_of(st.integers(-12, 4).map(lambda e: 2.0**e), st.floats(1e-3, 1e3)),
    with_bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_both_paths_within_the_bound_and_bit_for_bit_where_torch_computes_scaled_mm(
        m, k, n, pair, out_dtype, scale_a, scale_b, with_bias, seed):
    # Scales from TE's formula (448 / amax) are arbitrary float32 values; FP8 data spread over
    # the formats' ranges (|x| up to ~100, E4M3 saturates at 448).
    gen = torch.Generator().manual_seed(seed)
    scale_a, scale_b = float(torch.tensor(scale_a, dtype=torch.float32)), float(torch.tensor(scale_b, dtype=torch.float32))
    a = QuantizedTensor((torch.randn(m, k, generator=gen) * 16).to(pair[0]), torch.tensor(scale_a))
    b = QuantizedTensor((torch.randn(n, k, generator=gen) * 16).to(pair[1]), torch.tensor(scale_b))
    bias = torch.randn(n, generator=gen) * scale_a * scale_b * 100 if with_bias else None
    bias_added = None if bias is None else _bias_as_added(bias, out_dtype)
    expected = (a.data.double() * scale_a) @ (b.data.double() * scale_b).t()
    expected = expected + (0 if bias_added is None else bias_added.double())
    bound = scaled_gemm_error_bound(a.data, scale_a, b.data, scale_b, out_dtype, bias_added)
    with force_path("emulated"):
        emulated = fp8_gemm(a, b, out_dtype, bias)
    assert_within_bound(emulated, expected, bound)
    onednn = cpu_scaled_mm_uses_onednn(*pair)
    if onednn and pair == (E4M3, E4M3) and m * k * n > MAX_NATIVE_MACS:
        return  # possibly a reference kernel: too slow to run here
    with force_path("native"):
        native = fp8_gemm(a, b, out_dtype, bias)
    assert native.dtype == emulated.dtype == out_dtype
    assert_within_bound(native, expected, bound)
    if not onednn:
        assert torch.equal(native, emulated)
