"""Block scales in the memory layouts the native block-scaled GEMMs read.

This project keeps block scales as plain float32 ``scale_inv`` grids ``[ceil(R / br), ceil(C / bc)]``
(row-major, one entry per block). The cuBLAS kernels behind ``torch.nn.functional.scaled_mm``
want other layouts:

- MXFP8 (``ScalingType.BlockWise1x32``, sm100+): E8M0 bytes in cuBLAS's "block scaling factors
  layout" (``SwizzleType.SWIZZLE_32_4_4``): the ``[R, C]`` scale grid, padded to multiples of
  128 rows and 4 columns, is cut into 128x4 tiles stored one after another (row of tiles by row
  of tiles); inside a tile the scale at (r, c) sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``.
  Source: cuBLAS docs, "1D Block Scaling Factors Layout"; torch's ``to_blocked`` test helper.
- 128-blockwise (``BlockWise1x128`` / ``BlockWise128x128``, sm90): float32, "M-major" (column-
  major). A 1x128 grid ``[R, K / 128]`` with strides ``(1, R)``; a 128x128 grid of the second
  operand as ``[round_up(K / 128, 4), N / 128]`` with strides ``(1, round_up(K / 128, 4))``.
  Source: the shape checks of ``torch._scaled_mm_v2`` (``torch/_meta_registrations.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["e8m0_bits", "swizzle_32_4_4", "mx_gemm_scale", "blockwise_1x128_gemm_scale", "blockwise_128x128_gemm_scale"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def e8m0_bits(scale_inv: torch.Tensor) -> torch.Tensor:
    """E8M0 encoding (OCP MX v1.0, 5.4) of float32 powers of two in [2^-127, 2^127], or NaN.

    E8M0 is an 8-bit biased exponent: byte ``e + 127`` means ``2^e``, 0xFF is NaN. For a float32
    power of two that byte is exactly its exponent field (2^-127, a float32 subnormal, has field
    0), so the encoding is a bit shift, no rounding. Returns uint8 of ``scale_inv``'s shape.
    """
    bits = scale_inv.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def swizzle_32_4_4(grid: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scaling-factor layout of a ``[R, C]`` scale grid (any 1-byte dtype).

    Returns a flat tensor of ``round_up(R, 128) * round_up(C, 4)`` entries, zero-padded.
    """
    rows, cols = grid.shape
    padded_rows, padded_cols = _round_up(rows, 128), _round_up(cols, 4)
    raw = grid.view(torch.uint8) if grid.dtype != torch.uint8 else grid
    if (rows, cols) != (padded_rows, padded_cols):
        raw = F.pad(raw, (0, padded_cols - cols, 0, padded_rows - rows))
    # [row tile, 4 row groups of 32, 32, col tile, 4] -> [row tile, col tile, 32, 4 groups, 4]
    tiles = raw.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(grid.dtype)


def mx_gemm_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """MXFP8 ``scale_inv`` grid ``[R, K / 32]`` (float32) -> swizzled ``torch.float8_e8m0fnu``."""
    return swizzle_32_4_4(e8m0_bits(scale_inv)).view(torch.float8_e8m0fnu)


def blockwise_1x128_gemm_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """1x128 ``scale_inv`` grid ``[R, K / 128]`` -> the same values with strides ``(1, R)``: the
    grid itself where it is laid out so already (the casts make it column-major), no op."""
    if scale_inv.stride() == (1, scale_inv.shape[0]):
        return scale_inv
    return scale_inv.t().contiguous().t()


def blockwise_128x128_gemm_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """128x128 grid ``[N / 128, K / 128]`` of the second operand -> ``[round_up(K / 128, 4), N / 128]``
    with strides ``(1, round_up(K / 128, 4))``, the K-block padding zero-filled: the grid's own
    transpose, no op, where it is row-major with whole groups of 4 K blocks (the casts make it
    row-major; K a multiple of 512)."""
    k_blocks = scale_inv.shape[1]
    if k_blocks % 4 == 0 and scale_inv.stride() == (k_blocks, 1):
        return scale_inv.t()
    padded = F.pad(scale_inv, (0, _round_up(k_blocks, 4) - k_blocks)).contiguous()
    return padded.t()
