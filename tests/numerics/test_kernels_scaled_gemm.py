"""The Triton FP8 GEMM (fp8_plugin/numerics/kernels/scaled_gemm.py) under Triton's interpreter.

Its products against the float64 product of the dequantized operands, within the error bound of
float32 accumulation (reference.scaled_gemm_error_bound, Higham 3.1); its epilogue's rounding to
bfloat16 bit for bit against torch's conversion (round to nearest even), on every class of value.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernel under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU); "
                "on a GPU, benchmarks/suite.py times it", allow_module_level=True)
import triton.language as tl  # noqa: E402

from fp8_plugin.numerics.kernels import scaled_gemm as kernel_module  # noqa: E402
from fp8_plugin.numerics.kernels.scaled_gemm import block_sizes, scaled_gemm  # noqa: E402
from reference import assert_within_bound, scaled_gemm_error_bound  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy on NaN lanes
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * 6).to(dtype)


def check(a, b, scale_a, scale_b, out_dtype, bias=None, fast=False):
    got = scaled_gemm(a, b, torch.tensor(scale_a), torch.tensor(scale_b), out_dtype, bias, fast)
    assert got.dtype == out_dtype and got.shape == (a.shape[0], b.shape[0]) and got.is_contiguous()
    exact = (a.double() * scale_a) @ (b.double() * scale_b).t() + (0 if bias is None else bias.double())
    assert_within_bound(got, exact, scaled_gemm_error_bound(a, scale_a, b, scale_b, out_dtype, bias))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dtype_a, dtype_b", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
def test_every_pairing_and_output_dtype_is_within_float32_accumulations_bound(dtype_a, dtype_b, out_dtype):
    # 70 x 200 x 40: no dim a multiple of the tile, K over two 128-slices.
    a, b = fp8(70, 200, dtype_a, 0), fp8(40, 200, dtype_b, 1)
    bias = (torch.randn(40, generator=torch.Generator().manual_seed(2)) * 50).to(out_dtype)
    check(a, b, 0.37, 1.9, out_dtype, bias)
    check(a, b, 2.0**-9, 3.0, out_dtype)


def test_fast_accumulation_and_split_accumulation_are_both_within_the_bound():
    # The interpreter accumulates in float32 either way; a GPU's fast accumulation is TE's fprop
    # choice and is not bounded here (benchmarks/gpu_probe.py compares it on the device).
    a, b = fp8(64, 300, E4M3, 3), fp8(48, 300, E4M3, 4)
    check(a, b, 0.5, 0.25, torch.bfloat16, fast=True)
    check(a, b, 0.5, 0.25, torch.bfloat16, fast=False)


@pytest.mark.parametrize("m, n, k", [(1, 3, 5), (16, 16, 32), (129, 17, 31), (5, 300, 64)])
def test_any_shape_runs_without_padding(m, n, k):
    check(fp8(m, k, E4M3, m), fp8(n, k, E5M2, n), 1.5, 0.75, torch.float32)


def test_strided_operands_are_read_as_they_are():
    # The columnwise copies of a layer are row-major, but a transposed view must read right too.
    a_t, b = fp8(96, 40, E4M3, 5), fp8(24, 96, E4M3, 6)
    check(a_t.t(), b, 1.0, 1.0, torch.float32)
    check(a_t.t(), fp8(96, 24, E4M3, 7).t(), 1.0, 1.0, torch.bfloat16)


@triton.jit
def _round_to_bfloat16(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, kernel_module._bfloat16_bits(x), mask=offsets < n)


def test_the_epilogue_rounds_to_bfloat16_as_torch_does_on_every_class_of_value():
    gen = torch.Generator().manual_seed(8)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 14,), generator=gen, dtype=torch.int64).to(torch.int32)
    # Exact ties (the low 16 bits 0x8000) with even and odd kept halves, one below and above each.
    ties = (torch.arange(-512, 512, dtype=torch.int32) << 16) | 0x8000
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895313892515355e38,
                             torch.finfo(torch.float32).max, 1e-40, -1e-45, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
    x = torch.cat([bits.view(torch.float32), ties.view(torch.float32), (ties - 1).view(torch.float32),
                   (ties + 1).view(torch.float32), specials])
    out = torch.empty(x.shape, dtype=torch.int16)
    _round_to_bfloat16[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    got = out.view(torch.bfloat16)
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert got[~finite].isnan().all()


def test_tiles_fit_hoppers_fp8_shapes_and_shrink_for_short_dims():
    assert block_sizes(4096, 2048, 2048) == (128, 128, 128)
    assert block_sizes(8, 40, 5) == (16, 64, 32)


def test_operands_that_do_not_multiply_and_unwritten_dtypes_are_refused():
    a, b = fp8(8, 32, E4M3, 0), fp8(8, 16, E4M3, 1)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"a \[8, 32\] and b \[8, 16\] do not multiply"):
        scaled_gemm(a, b, one, one, torch.float32)
    with pytest.raises(ValueError, match="torch.float64 is not written.*torch.float32, torch.bfloat16, torch.float16"):
        scaled_gemm(a, fp8(8, 32, E4M3, 2), one, one, torch.float64)
