"""Block-scaled FP8 casts: MXFP8 (E8M0 scale per 32 values) and 128-blockwise (FP32 scales).

Sources:
- OCP Microscaling Formats (MX) Specification v1.0, section 6.3: for a block V of 32 values,
  ``shared_exp = floor(log2(max|V|)) - emax_elem`` (emax_elem = 8 for E4M3, 15 for E5M2),
  ``X = 2 ** shared_exp`` stored as E8M0 (exponents -127..127, 0xFF = NaN), and each element is
  ``P_i = saturate(V_i / X)`` in the element format. The rounding of the exponent is the spec's
  floor; Transformer Engine instead rounds ``amax / 448`` *up* to a power of two (no element
  saturates). This module follows the spec.
- Transformer Engine, "FP8 Blockwise Scaling" (after DeepSeek-V3, arXiv:2412.19437): blocks of
  1x128 (activations, gradients) or 128x128 (weights), ``scale = FP8_MAX / amax`` in FP32,
  optionally truncated to a power of two (mantissa bits zeroed), ``data = saturate(x * scale)``.

Edge cases, the same for both: an all-zero block gets the smallest scale step (MX: X = 2^-127;
blockwise: scale 1.0) and zero data. A block with an inf or NaN gets a NaN scale under MX (the
E8M0 NaN, so the block reads back as NaN, never silently finite) and scale 1.0 under blockwise
(values saturate, NaN stays NaN). Dims that are not multiples of the block are padded with zeros
for the scale computation: a partial block's scale comes from its own values only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import fp8_max
from .scaling import dequantize, divide, saturate

__all__ = ["block_amax", "mx_scale_inv", "blockwise_scale", "quantize_blocks", "dequantize_blocks", "E8M0_EMAX"]

# Exponent of the largest normal of each element format (OCP MX v1.0, table 2: emax_elem).
E8M0_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def _padded_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    xp = F.pad(x.to(torch.float32), (0, pad_c, 0, pad_r)) if pad_r or pad_c else x.to(torch.float32)
    return xp.reshape(xp.shape[0] // br, br, xp.shape[1] // bc, bc)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Absolute max of each ``block = (rows, cols)`` tile of a 2-D tensor, NaN if the tile has one.

    Returns float32 ``[ceil(R / block[0]), ceil(C / block[1])]``.
    """
    return _padded_blocks(x.detach(), block).abs().amax(dim=(1, 3))


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    # frexp: v = m * 2**e with m in [0.5, 1), so floor(log2 v) = e - 1, exactly (no log2 rounding).
    return torch.frexp(v)[1].to(torch.float32) - 1


def mx_scale_inv(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MX shared scale ``X = 2 ** (floor(log2 amax) - emax_elem)`` per block (OCP MX v1.0, 6.3).

    Args:
        amax: float32 block amaxes.
        dtype: element format, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        float32 X of ``amax``'s shape: powers of two in [2^-127, 2^127]; 2^-127 for zero blocks;
        NaN where amax is not finite.
    """
    exp = _floor_log2(amax.clamp(min=torch.finfo(torch.float32).tiny)) - E8M0_EMAX[dtype]
    exp = torch.where(amax > 0, exp, torch.full_like(exp, _E8M0_MIN_EXP)).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    x = torch.exp2(exp)
    return torch.where(torch.isfinite(amax), x, torch.full_like(x, float("nan")))


def blockwise_scale(amax: torch.Tensor, dtype: torch.dtype, power_2_scale: bool, amax_epsilon: float) -> torch.Tensor:
    """Blockwise ``scale = FP8_MAX / max(amax, amax_epsilon)``, as Transformer Engine computes it.

    Zero amax gives 1.0, an overflowing scale the float32 max, a non-finite amax 1.0; with
    ``power_2_scale`` the scale is truncated to a power of two (its mantissa zeroed).
    Returns float32 of ``amax``'s shape.
    """
    amax = amax.clamp(min=amax_epsilon) if amax_epsilon > 0 else amax
    scale = divide(fp8_max(dtype), amax).clamp(max=torch.finfo(torch.float32).max)
    if power_2_scale:
        scale = torch.exp2(_floor_log2(scale))
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize_blocks(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale[block]`` (float32 product) to ``dtype``, of ``x``'s shape;
    infinities of ``x`` are kept, as in :func:`fp8_plugin.numerics.scaling.quantize`, except in a block
    whose scale is NaN (MX, a block holding an inf or NaN): its data is NaN throughout.

    ``scale`` is ``[ceil(R / block[0]), ceil(C / block[1])]``: the blockwise scale, or ``1 / X``
    for MX (exact, X being a power of two). The result is row-major (contiguous) whatever the
    layout of ``x`` (the columnwise copy casts the transposed view ``x.T``): the FP8 GEMM kernels
    read their operands row-major and refuse any other layout.
    """
    rows, cols = x.shape
    padded = _padded_blocks(x, block)
    tiles = saturate(padded * scale[:, None, :, None], padded, dtype)
    data = tiles.reshape(tiles.shape[0] * block[0], -1)[:rows, :cols]
    return data.to(dtype, memory_format=torch.contiguous_format)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32, saturate: bool = True) -> torch.Tensor:
    """``data * scale_inv`` broadcast over blocks, in ``dtype`` (float32 by default), of
    ``data``'s shape; finite data reads back finite, as in :func:`fp8_plugin.numerics.scaling.dequantize`."""
    rows, cols = data.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return dequantize(data, full, dtype, saturate)
