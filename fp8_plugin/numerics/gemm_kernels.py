"""The FP8 GEMM calls themselves: the exact float32 emulation, the BF16 one, and the native scaled-GEMM kernels.

Which of them runs is decided in :mod:`fp8_plugin.numerics.gemm`; what a GPU's block kernels accept
is probed in :mod:`fp8_plugin.numerics.gemm_support`. Each function takes
:class:`~fp8_plugin.numerics.quantizers.QuantizedTensor` operands ``a`` ``[M, K]`` and ``b``
``[N, K]`` (row-major FP8 data, the "NT" layout) and returns ``a @ b.T`` ``[M, N]``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .._private.compile_marks import allow_in_graph
from .decode import decode_fp8
from .device_kind import device_kind, eager_on_cpu
from .quantizers import QuantizedTensor
from .scale_layouts import blockwise_1x128_gemm_scale, blockwise_128x128_gemm_scale, mx_gemm_scale

__all__ = ["emulated", "emulated_bf16", "fp8_gemm_in_bf16", "fp8_values_in_bf16", "kernel_bias", "scaled_mm_tensorwise",
           "scaled_mm_blocks", "scaled_mm_native", "outside_autocast", "row_major", "alignment", "pad_to_alignment"]

# K multiple of the block kinds' kernels: whole blocks along the contraction.
_BLOCK_KIND_K_MULTIPLE = {"blockwise": 128, "mxfp8": 32}


def emulated(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` as one float32 GEMM of the dequantized operands, cast to ``out_dtype``.

    Both operands are dequantised to float32, the second one as a row-major ``[K, N]`` matrix:
    the computation of torch's CPU ``_scaled_mm`` where oneDNN does not take it
    (aten/src/ATen/native/Blas.cpp, ``_scaled_mm_out_cpu_emulated``), so the two agree bit for bit
    there; the float32 GEMM's summation order follows the layout (the ``[K, N]`` view of a
    row-major ``[N, K]`` tensor sums otherwise on narrow outputs, N < ~16). Runs outside torch
    autocast, which would round the dequantized operands to bfloat16.
    """
    with torch.autocast(device_kind(a.data.device), enabled=False):
        out = a.dequantize(saturate=False) @ b.dequantize(saturate=False).t().contiguous()
    if bias is not None:
        out = out + kernel_bias(bias, out_dtype).to(torch.float32)
    return out.to(out_dtype)


def emulated_bf16(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` as one BF16 GEMM of the FP8 values, for per-tensor scales.

    Every E4M3 and E5M2 value is exact in bfloat16, so the products are exact; torch's BF16 GEMMs
    accumulate them in float32. A bfloat16 ``out_dtype`` (in eager code on CPU) takes the product
    of the two ``scale_inv`` (rounded once in float32) as the GEMM's ``alpha`` and the bias as
    :func:`kernel_bias` gives it as its addend (``torch.addmm``), applied to the float32 sums:
    one rounding per output, as :func:`emulated`. Otherwise each sum is rounded once to bfloat16
    (relative error at most 2^-8, bfloat16's unit roundoff), then the scales and the bias are
    applied in float32 and the result is cast to ``out_dtype``: one more rounding per output than
    :func:`emulated`, the one :mod:`~fp8_plugin.numerics.cpu_emulation` describes. Runs outside
    torch autocast.

    ``a.data`` and ``b.data`` may be FP8 in any layout, or already their bfloat16 values
    (:func:`~fp8_plugin.numerics.decode.decode_fp8`'s, for an operand of several GEMMs).

    Raises:
        ValueError: an operand with block scales (their scales vary along K, inside the sum).
    """
    if a.block is not None or b.block is not None:
        raise ValueError(f"a BF16 emulated GEMM takes per-tensor scales only, got blocks {a.block} x {b.block}")
    scale = a.scale_inv * b.scale_inv
    with torch.autocast(device_kind(a.data.device), enabled=False):
        a16, b16 = decode_fp8(a.data, torch.bfloat16), decode_fp8(b.data, torch.bfloat16).t()
        if out_dtype == torch.bfloat16 and eager_on_cpu(a16):
            # The scales' product applied to the float32 sums inside the GEMM (addmm's alpha, read
            # back: free on CPU), and the bias added there: one rounding per output, as a GPU's
            # scaled GEMM rounds, and no float32 temporary of the output's size.
            if bias is None:
                return torch.addmm(a16.new_zeros(()), a16, b16, beta=0, alpha=float(scale))
            return torch.addmm(kernel_bias(bias, out_dtype), a16, b16, alpha=float(scale))
        out = a16 @ b16
    out = out.to(torch.float32).mul_(scale)
    if bias is not None:
        out = out.add_(kernel_bias(bias, out_dtype).to(torch.float32))
    return out.to(out_dtype)


def fp8_gemm_in_bf16(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """``(a.data @ b.data.T) * (a.scale_inv * b.scale_inv)`` as a BF16 GEMM of the FP8 values.

    Every E4M3 and E5M2 value is exact in bfloat16 (3 or 2 mantissa bits of its 7, exponents
    within its range), so the products are exact; torch's BF16 GEMMs (oneDNN's on CPU, cuBLAS's)
    accumulate them in float32 and round the sum once to bfloat16, a relative error of at most
    2^-8 per output (bfloat16's unit roundoff); the product of the two per-tensor scales, rounded
    once in float32, is then applied in float32. Against :func:`~fp8_plugin.numerics.gemm.fp8_gemm` in float32 that is one
    more rounding, the size of the BF16 output rounding of a training GEMM under bf16-mixed and
    far below the quantisation error of E5M2 (unit roundoff 2^-3) and E4M3 (2^-4): an SQNR
    figure of a GEMM near its healthy band (about 25 dB, an error of 6% rms) moves by under
    0.01 dB. On CPUs whose BF16 GEMMs outrun float32 ones (AVX512-BF16, AMX) it is faster than
    the float32 emulation; the reference checks' per-GEMM figures use it there, and training
    GEMMs where :mod:`~fp8_plugin.numerics.cpu_emulation` chose it
    (:func:`emulated_bf16`, the same computation).

    Args:
        a: ``[M, K]`` FP8 data with a per-tensor (0-dim float32) ``scale_inv``; the data may also
            be :func:`fp8_values_in_bf16`'s bfloat16 copy (an operand of two GEMMs, converted
            once), and any layout (a transposed view multiplies as it is).
        b: ``[N, K]``, the same.

    Returns:
        ``[M, N]`` float32 tensor.

    Raises:
        ValueError: an operand with block scales (their scales vary along K, inside the sum).
    """
    return emulated_bf16(a, b, torch.float32)


def fp8_values_in_bf16(data: torch.Tensor) -> torch.Tensor:
    """FP8 ``data`` (any shape and layout, kept) as bfloat16, exactly; bfloat16 data is returned as is.

    On CPU through :func:`~fp8_plugin.numerics.decode.decode_fp8`'s integer path (torch's own
    CPU cast from FP8 decodes with scalar code).
    """
    return decode_fp8(data, torch.bfloat16)


def kernel_bias(bias: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The bias a GEMM epilogue adds: in the output dtype (cuBLASLt and oneDNN take it so for
    low-precision outputs), float32 for float32 and float64 outputs."""
    return bias.to(out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32)


def scaled_mm_tensorwise(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                         bias: Optional[torch.Tensor], fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` with per-tensor float32 ``scale_inv`` operands.

    The kernel's epilogue takes a bias only for low-precision outputs (torch's CUDA check: "Bias
    is not supported when out_dtype is set to Float32"); with a float32 output the bias is added
    after, in float32. ``fast_accum``: torch's ``use_fast_accum`` (a GPU's tensor cores keep
    their partial sums in their own precision over the whole K).
    """
    fused = bias is not None and out_dtype != torch.float32
    out = torch._scaled_mm(
        a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
        bias=kernel_bias(bias, out_dtype) if fused else None, out_dtype=out_dtype, use_fast_accum=fast_accum,
    )  # fmt: skip
    return out + kernel_bias(bias, out_dtype) if bias is not None and not fused else out


def _mx_scale(q: QuantizedTensor) -> torch.Tensor:
    # The swizzled E8M0 scales: the fused cast's own, else converted from scale_inv.
    return q.gemm_scale if q.gemm_scale is not None else mx_gemm_scale(q.scale_inv)


def scaled_mm_blocks(kind: str, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with block scales, no bias.

    ``kind`` "mxfp8": ``BlockWise1x32`` E8M0 scales swizzled as cuBLAS reads them (sm100+);
    "blockwise": ``BlockWise1x128`` for ``a`` and ``BlockWise128x128`` or ``BlockWise1x128`` for
    ``b`` (cuBLAS, sm90), the scales in the layouts of :mod:`~fp8_plugin.numerics.scale_layouts`.
    """
    if kind == "mxfp8":
        return _block_scaled_mm(a.data, b.data.t(), _mx_scale(a), _mx_scale(b), "mxfp8", out_dtype)
    if b.block == (128, 128):
        scale_b, layout_b = blockwise_128x128_gemm_scale(b.scale_inv), "128x128"
    else:
        scale_b, layout_b = blockwise_1x128_gemm_scale(b.scale_inv), "1x128"
    return _block_scaled_mm(a.data, b.data.t(), blockwise_1x128_gemm_scale(a.scale_inv), scale_b, layout_b, out_dtype)


# torch 2.11's dynamo cannot trace torch._scaled_mm_v2, the op F.scaled_mm calls ("Dynamo does
# not know how to trace the builtin"): every compiled block-scaled GEMM broke the graph, and
# fullgraph=True raised. Marked allow_in_graph, the call is put in the graph as it is and traced
# below dynamo (AOTAutograd sees the aten op and its fake kernel), on every torch; eager code
# calls it as a plain function. Marked once dynamo is imported (_private/compile_marks.py).
@allow_in_graph
def _block_scaled_mm(a_data: torch.Tensor, b_data_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     layout_b: str, out_dtype: torch.dtype) -> torch.Tensor:
    # ``layout_b``: "mxfp8" (both operands BlockWise1x32, swizzled), else b's blockwise scales
    # ("128x128" or "1x128"; a's are 1x128).
    S = F.ScalingType
    if layout_b == "mxfp8":
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_mm(a_data, b_data_t, scale_a, S.BlockWise1x32, scale_b, S.BlockWise1x32,
                           swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)
    recipe_b = S.BlockWise128x128 if layout_b == "128x128" else S.BlockWise1x128
    return F.scaled_mm(a_data, b_data_t, scale_a, S.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype)


def scaled_mm_native(kind: str, support: Any, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                     bias: Optional[torch.Tensor], fast_accum: bool = False) -> torch.Tensor:
    """The native GEMM of ``kind`` (``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``) on operands it
    takes as they are: :func:`scaled_mm_tensorwise`, or :func:`scaled_mm_blocks` in ``out_dtype``
    where ``support`` (the device's :class:`~fp8_plugin.numerics.gemm_support.NativeGemm`) says the
    kernel writes it for this operand pairing, else in bfloat16 and then cast; a block GEMM's
    bias is added in float32 after it (rounded as :func:`kernel_bias`), the sum rounded once."""
    if kind == "tensorwise":
        return scaled_mm_tensorwise(a, b, out_dtype, bias, fast_accum)
    kernel_dtype = out_dtype if out_dtype in support.pairing_out_dtypes(a.data.dtype, b.data.dtype) else torch.bfloat16
    out = scaled_mm_blocks(kind, a, b, kernel_dtype)
    if bias is not None:
        out = (out.float() + kernel_bias(bias, out_dtype).float()).to(out_dtype)
    return out.to(out_dtype)


def outside_autocast(device_type: str, gemm: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``gemm(*args)`` outside torch autocast, for a native GEMM: on CPU, ``_scaled_mm`` under
    autocast takes a path about 40x slower. The context is entered only where autocast is on (a
    forward under the integrations): it costs microseconds of CPU, and backward GEMMs run with
    autocast off."""
    if device_type not in ("cuda", "cpu") or torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return gemm(*args)
    return gemm(*args)


def row_major(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` with row-major FP8 data, as the CPU kernels read their operands (a copy where it is
    not: a transposed view of per-tensor bytes, :func:`~fp8_plugin.numerics.quantizers.columnwise_copy`)."""
    return q if q.data.is_contiguous() else QuantizedTensor(q.data.contiguous(), q.scale_inv, q.block, q.gemm_scale)


def alignment(kind: str, b: QuantizedTensor) -> tuple[int, int, int]:
    """The multiples ``(M, K, N)`` a CUDA kernel of GEMM ``kind`` needs (``b`` the ``[N, K]``
    operand): 16 everywhere (cuBLASLt FP8), K a whole number of blocks for the block kinds, and
    whole 128x128 blocks for a 128x128-scaled operand."""
    k = _BLOCK_KIND_K_MULTIPLE.get(kind, 16)
    n = 128 if b.block == (128, 128) else 16
    return 16, k, n


def _pad_rows_cols(q: QuantizedTensor, rows: int, cols: int) -> QuantizedTensor:
    # Zero FP8 data beyond the original [r, c]: zeros add nothing to any product. A block grid
    # gains rows of 1.0 for the new 1xB rows; new columns stay inside its last block, or in
    # whole blocks of zeros (scale 1.0) for 128x128 rows.
    r, c = q.data.shape
    if (r, c) == (rows, cols):
        return q
    data = q.data.new_zeros(rows, cols)
    data[:r, :c].copy_(q.data)
    scale_inv = q.scale_inv
    if q.block is not None:
        grid_rows, grid_cols = -(-rows // q.block[0]), -(-cols // q.block[1])
        grid = scale_inv.new_ones(grid_rows, grid_cols)
        grid[: scale_inv.shape[0], : scale_inv.shape[1]].copy_(scale_inv)
        scale_inv = grid
    return QuantizedTensor(data, scale_inv, q.block)


def pad_to_alignment(a: QuantizedTensor, b: QuantizedTensor, multiples: tuple[int, int, int]) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``a`` ``[M, K]`` and ``b`` ``[N, K]`` zero-padded to multiples ``(m, k, n)`` of M, K, N.

    ``a @ b.T`` of the padded operands holds the original product in its top-left ``[M, N]``,
    exactly: the padding is FP8 zeros, and block grids grow by blocks of scale 1.0 (new rows) or
    not at all (K padded inside its last block). Costs one copy of each operand that grows.
    """
    (m, k), n = a.data.shape, b.data.shape[0]
    mm, mk, mn = multiples
    if not (m % mm or k % mk or n % mn):  # aligned already (the common case): nothing to build
        return a, b
    up = lambda d, mult: -(-d // mult) * mult  # noqa: E731
    k2 = up(k, mk)
    return _pad_rows_cols(a, up(m, mm), k2), _pad_rows_cols(b, up(n, mn), k2)
