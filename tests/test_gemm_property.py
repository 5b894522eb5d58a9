"""fp8_plugin/gemm.py, property-based: the CPU paths agree bit for bit and stay within the bound.

Over random shapes, operand formats, scales, biases and output dtypes, both paths (the float32
emulation and ``torch._scaled_mm``) are within the float32-accumulation error bound of a
float64 reference. Bit for bit they agree wherever float32 accumulation is exact: the two
kernels sum the K products in different orders (seen on narrow outputs, e.g. N = 2), so on
general data they may differ by the roundings the bound allows, and no more.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_plugin.gemm import force_path, fp8_gemm, native_gemm
from fp8_plugin.quantizers import QuantizedTensor
from reference import assert_within_bound, gemm_error_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
# Keep native products small: on some CPUs the E4M3 x E4M3 kernel is a reference one (~200 ns
# per multiply-accumulate), and a bounded test must stay fast there too.
MAX_NATIVE_MACS = 2**18

pytestmark = pytest.mark.skipif(not native_gemm("tensorwise", "cpu").native, reason="no torch._scaled_mm on CPU")


def _operand(gen, rows, cols, dtype, scale_inv):
    data = (torch.randn(rows, cols, generator=gen) * 16).to(dtype)
    return QuantizedTensor(data, torch.tensor(scale_inv, dtype=torch.float32))


def _grid_operand(gen, rows, cols, dtype, scale_inv):
    # FP8 values on a 2^-2 grid within +-8: products are multiples of 2^-4 below 64 in
    # magnitude, so any sum of up to 96 of them is exact in float32, in any order.
    values = (torch.randn(rows, cols, generator=gen) * 8).round().clamp(-32, 32) / 4
    return QuantizedTensor(values.to(dtype), torch.tensor(scale_inv, dtype=torch.float32))


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 96), k=st.sampled_from([16, 32, 48, 64, 96]), n=st.integers(1, 96),
    pair=st.sampled_from(PAIRS), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    exp_a=st.integers(-12, 4), exp_b=st.integers(-12, 4), with_bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_paths_agree_bit_for_bit_where_float32_accumulation_is_exact(m, k, n, pair, out_dtype, exp_a, exp_b,
                                                                         with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    a, b = _grid_operand(gen, m, k, pair[0], 2.0**exp_a), _grid_operand(gen, n, k, pair[1], 2.0**exp_b)
    # A bias on the same grid, scaled like the products: the epilogue's add is exact too.
    bias = (torch.randn(n, generator=gen) * 64).round() / 16 * 2.0 ** (exp_a + exp_b) if with_bias else None
    with force_path("emulated"):
        emulated = fp8_gemm(a, b, out_dtype, bias)
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    bias64 = None if bias is None else bias.to(out_dtype if out_dtype != torch.float32 else torch.float32).double()
    bound = gemm_error_bound(a64, b64, out_dtype, bias64)
    expected = a64 @ b64.t() + (0 if bias64 is None else bias64)
    assert_within_bound(emulated, expected, bound)
    if m * k * n <= MAX_NATIVE_MACS:
        with force_path("native"):
            native = fp8_gemm(a, b, out_dtype, bias)
        assert native.dtype == emulated.dtype == out_dtype
        assert torch.equal(native, emulated)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 64), k=st.sampled_from([16, 32, 64]), n=st.integers(1, 64), pair=st.sampled_from(PAIRS),
    scale_a=st.floats(1e-3, 1e3), scale_b=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16),
)
def test_any_float32_scales_stay_within_the_bound_on_both_paths(m, k, n, pair, scale_a, scale_b, seed):
    # Scales from TE's formula (448 / amax) are arbitrary float32 values: the products of FP8
    # values and scales are then rounded, by the emulation per element and by the kernel after
    # the sum, so the two paths may differ by roundings; both stay within the bound.
    gen = torch.Generator().manual_seed(seed)
    a, b = _operand(gen, m, k, pair[0], scale_a), _operand(gen, n, k, pair[1], scale_b)
    a64 = a.data.double() * float(a.scale_inv)
    b64 = b.data.double() * float(b.scale_inv)
    # Two more roundings per product (each operand's dequantisation, or the scales' product).
    bound = gemm_error_bound(a64, b64) + 2 * 2.0**-24 * (a64.abs() @ b64.abs().t())
    for path in ("emulated", "native"):
        with force_path(path):
            got = fp8_gemm(a, b, torch.float32)
        assert_within_bound(got, a64 @ b64.t(), bound)
