"""Fused block-scaled FP8 casts in Triton: MXFP8 (1x32, E8M0 scales) and 128-blockwise (1x128 or
128x128, float32 scales), the rowwise and columnwise copies from one read of the input.

Each kernel equals, byte for byte, the torch ops of :class:`~fp8_plugin.numerics.quantizers.BlockQuantizer`
(:func:`reference_blocks`: ``block_amax``, ``mx_scale_inv`` / ``blockwise_scale``,
``quantize_blocks`` of :mod:`fp8_plugin.numerics.block_scaling`, whose docstring gives the
sources: OCP MX v1.0 section 6.3, Transformer Engine's blockwise recipe). One program reads a
``B x B`` tile of ``x`` (``B`` = 32 or 128) and writes:

- 1xB blocks (activations, gradients, MXFP8 weights): the rowwise copy scaled per row of the tile
  and, where asked, the columnwise copy (the cast of ``x.T`` in 1xB blocks, so one scale per
  column of the tile), with the scale_inv of each;
- 128x128 blocks (blockwise weights): one scale for the tile, both copies.

The scales are written where the native GEMMs read them: 1xB grids column-major (the blockwise
GEMM's "M-major" layout), and for MXFP8 also the E8M0 bytes in cuBLAS's swizzled 32_4_4 layout
(``QuantizedTensor.gemm_scale``), so no conversion runs before the GEMM.

The tensor's amax goes to the layer's scaling state for statistics, as the torch ops record it
(``ScalingState.observe_current`` with scale 1): folded into the state's workspace and moved by
the cast's last program (:mod:`.tensorwise` explains the workspace). One launch. Bytes per
element: ``x``'s size read, 1 written per copy, plus 4 bytes of scale_inv per block and copy.

The exponent and power-of-two arithmetic is done on the float32 bits (``floor(log2 v)`` is the
exponent field), so a GPU, the interpreter and torch agree exactly; no ``tl.maximum`` touches a
value that may be NaN (Triton's maximum need not propagate it; torch's clamp does).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from ..block_scaling import E8M0_EMAX, block_amax, blockwise_scale, mx_scale_inv, quantize_blocks
from ..formats import fp8_max
from ..scaling import divide
from .fp8_bits import as_float32, e4m3_bits, e5m2_bits, loadable, saturated
from .tensorwise import _finish, _fold_amax, _state_pointers
from .launch import KernelLaunch, LaunchSite
from .rows import StateRows

__all__ = ["cast_blocks", "BlockCast", "reference_blocks", "grid_tensors"]



@triton.jit
def _block_scales(amax_bits, MX: tl.constexpr, FP8_MAX: tl.constexpr, EMAX: tl.constexpr,
                  POWER_2: tl.constexpr, EPS: tl.constexpr):
    # (scale, scale_inv) of blocks whose amaxes have these float32 bits (non-negative; NaN's
    # bits exceed infinity's).
    finite = amax_bits < 0x7F800000
    if MX:
        # mx_scale_inv: X = 2^(floor(log2(max(amax, tiny))) - emax), 2^-127 for a zero block,
        # clamped to E8M0's [-127, 127]; NaN where the amax is not finite. scale = 1 / X, exact.
        exponent = tl.where(amax_bits >> 23 > 1, amax_bits >> 23, 1) - 127 - EMAX
        exponent = tl.where(amax_bits == 0, -127, exponent)
        exponent = tl.where(exponent < -127, -127, tl.where(exponent > 127, 127, exponent))
        x_bits = tl.where(exponent >= -126, (exponent + 127) << 23, 0x00400000)
        inv_bits = tl.where(exponent <= 126, (127 - exponent) << 23, 0x00400000)
        scale_inv = tl.where(finite, x_bits.to(tl.float32, bitcast=True), float("nan"))
        scale = tl.where(finite, inv_bits.to(tl.float32, bitcast=True), float("nan"))
    else:
        # blockwise_scale: FP8_MAX / max(amax, eps), correctly rounded, clamped to the float32
        # max, truncated to a power of two if asked; 1.0 where the amax is 0 or not finite.
        amax = amax_bits.to(tl.float32, bitcast=True)
        if EPS > 0:
            amax = tl.where(amax < EPS, EPS, amax)  # a NaN amax stays NaN, as torch's clamp keeps it
        scale = tl.math.div_rn(FP8_MAX, amax)
        scale = tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale)
        if POWER_2:
            scale = (scale.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True)
        scale = tl.where((amax > 0) & finite, scale, 1.0)
        scale_inv = tl.math.div_rn(1.0, scale)
    return scale, scale_inv


@triton.jit
def _encode(x, scale, FP8_MAX: tl.constexpr, E4M3: tl.constexpr):
    # A block whose scale is NaN (MX: an inf or NaN in the block) is positive NaN throughout
    # (0x7F), as torch's cast of the product gives: which NaN a product of two NaNs carries is
    # the hardware's choice, and its sign means nothing.
    s = tl.where(scale != scale, float("nan"), saturated(x, scale, FP8_MAX, E4M3))
    if E4M3:
        return e4m3_bits(s)
    return e5m2_bits(s)


@triton.jit
def _e8m0_swizzled(gemm_ptr, rows, block_col, scale_inv, padded_block_cols):
    # E8M0 bytes (the float32 power of two's exponent field; NaN's is 0xFF) at their places in
    # cuBLAS's 32_4_4 layout (numerics/scale_layouts.swizzle_32_4_4): 128x4 tiles of the grid
    # padded to [round_up(R, 128), padded_block_cols], row of tiles by row of tiles, the scale at
    # (r, c) of a tile at byte (r % 32) * 16 + (r // 32) * 4 + c.
    e8m0 = ((scale_inv.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
    tile = (rows // 128) * (padded_block_cols // 4) + block_col // 4
    offset = tile * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + block_col % 4
    tl.store(gemm_ptr + offset, e8m0)


@triton.jit
def _block_cast_kernel(x_ptr, out_ptr, out_t_ptr, scale_inv_ptr, scale_inv_t_ptr, gemm_ptr, gemm_t_ptr,
                       workspace_ptr, history_ptr, count_ptr, state_scale_ptr, M, N, stride_xm, stride_xn,
                       n_programs, B: tl.constexpr, SQUARE: tl.constexpr, MX: tl.constexpr, FP8_MAX: tl.constexpr,
                       E4M3: tl.constexpr, EMAX: tl.constexpr, POWER_2: tl.constexpr, EPS: tl.constexpr,
                       TRANSPOSE: tl.constexpr, RECORD: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * B + tl.arange(0, B)[:, None]
    cols = pid_n * B + tl.arange(0, B)[None, :]
    inside = (rows < M) & (cols < N)
    x = as_float32(tl.load(x_ptr + rows * stride_xm + cols * stride_xn, mask=inside, other=0))
    bits = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    n_blocks_n = tl.cdiv(N, B)
    n_blocks_m = tl.cdiv(M, B)
    if SQUARE:
        tile_bits = tl.max(tl.max(bits, axis=1), axis=0)
        scale, scale_inv = _block_scales(tile_bits, MX, FP8_MAX, EMAX, POWER_2, EPS)
        code = _encode(x, scale, FP8_MAX, E4M3)
        tl.store(out_ptr + rows * N + cols, code, mask=inside)
        tl.store(scale_inv_ptr + pid_m * n_blocks_n + pid_n, scale_inv)
        if TRANSPOSE:
            tl.store(out_t_ptr + cols * M + rows, code, mask=inside)
            tl.store(scale_inv_t_ptr + pid_n * n_blocks_m + pid_m, scale_inv)
    else:
        # 1xB grids are written column-major ([R, C] with strides (1, R)): the layout the
        # blockwise GEMM takes (scale_layouts.blockwise_1x128_gemm_scale is then a view).
        row_bits = tl.max(bits, axis=1)  # [B]: one 1xB block per row of the tile
        scale, scale_inv = _block_scales(row_bits, MX, FP8_MAX, EMAX, POWER_2, EPS)
        code = _encode(x, scale[:, None], FP8_MAX, E4M3)
        tl.store(out_ptr + rows * N + cols, code, mask=inside)
        row = pid_m * B + tl.arange(0, B)
        tl.store(scale_inv_ptr + pid_n * M + row, scale_inv, mask=(row < M) & (row * 0 + pid_n < n_blocks_n))
        if MX:  # the grid covers the swizzled layout's padding: its blocks are zeros, E8M0 byte 0
            _e8m0_swizzled(gemm_ptr, row, pid_n, scale_inv, tl.num_programs(1))
        if TRANSPOSE:  # x.T in 1xB blocks: one block per column of the tile
            col_bits = tl.max(bits, axis=0)
            scale_t, scale_inv_t = _block_scales(col_bits, MX, FP8_MAX, EMAX, POWER_2, EPS)
            code_t = _encode(x, scale_t[None, :], FP8_MAX, E4M3)
            tl.store(out_t_ptr + cols * M + rows, code_t, mask=inside)
            col = pid_n * B + tl.arange(0, B)
            tl.store(scale_inv_t_ptr + pid_m * N + col, scale_inv_t, mask=(col < N) & (col * 0 + pid_m < n_blocks_m))
            if MX:
                _e8m0_swizzled(gemm_t_ptr, col, pid_m, scale_inv_t, tl.num_programs(0))
    _fold_amax(x, workspace_ptr)
    _finish(workspace_ptr, n_programs, history_ptr, count_ptr, state_scale_ptr, 1.0, RECORD, True)


def cast_blocks(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], *, mx: bool, power_2_scale: bool = False,
                amax_epsilon: float = 0.0, transpose: bool, record: bool, scale: torch.Tensor,
                amax_history: torch.Tensor, nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, role: int,
                rows: Optional[StateRows] = None) -> tuple[torch.Tensor, ...]:
    """Block-scaled cast of ``x`` and, where asked, of ``x.T``, in one pass.

    Args:
        x: ``[M, N]`` float32, bfloat16 or float16, any strides.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: ``(1, 32)`` with ``mx`` (MXFP8), ``(1, 128)`` or ``(128, 128)`` (blockwise).
        mx: E8M0 power-of-two scales (OCP MX) instead of blockwise float32 scales.
        power_2_scale, amax_epsilon: the blockwise recipe's scale options (``blockwise_scale``).
        transpose: also write the columnwise copy, ``x.T`` ``[N, M]`` cast in blocks of the
            same shape.
        record: the tensor's amax into the state for statistics, as
            ``ScalingState.observe_current(role, amax, 1)`` does; False leaves the state.
        scale, amax_history, nonfinite_amax_count, workspace, role, rows: the state's tensors
            and ``role``'s cached row views, as in
            :func:`~fp8_plugin.numerics.kernels.tensorwise.cast_transpose_current`.

    Returns:
        ``(data [M, N], scale_inv, data_t [N, M] or None, scale_inv_t or None, gemm_scale or
        None, gemm_scale_t or None)``: row-major FP8 and float32 ``scale_inv`` of ``[ceil(M /
        block[0]), ceil(N / block[1])]`` (the columnwise copy's of ``[ceil(N / block[0]), ceil(M
        / block[1])]``; 1xB grids column-major), bit for bit as :func:`reference_blocks`; with
        ``mx``, the E8M0 scales swizzled as the GEMM takes them (uint8, as
        :func:`~fp8_plugin.numerics.scale_layouts.mx_gemm_scale` makes them from ``scale_inv``).

    Raises:
        ValueError: ``x`` not 2-D or of another dtype; ``dtype`` not FP8; a block shape other
            than these; ``workspace`` of another shape or dtype.
    """
    _check_block_cast(x, block, mx)
    if rows is None:
        state_scale, history, count, work = _state_pointers(role, scale, amax_history, nonfinite_amax_count, workspace)
        rows = StateRows(state_scale, None, history, count, work)
    return BlockCast(x, dtype, block, mx, power_2_scale, amax_epsilon, transpose, record, rows)(x)


@lru_cache(maxsize=None)
def _block_cast(b: int, square: bool, mx: bool, dtype: torch.dtype, power_2_scale: bool, amax_epsilon: float,
                transpose: bool, record: bool) -> KernelLaunch:
    # The launcher of the block cast for these constexprs, made once.
    return KernelLaunch(_block_cast_kernel, B=b, SQUARE=square, MX=mx, FP8_MAX=fp8_max(dtype),
                        E4M3=dtype == torch.float8_e4m3fn, EMAX=E8M0_EMAX[dtype], POWER_2=power_2_scale,
                        EPS=amax_epsilon, TRANSPOSE=transpose, RECORD=record, enable_fp_fusion=False,
                        num_warps=8 if b == 128 else 4)


class BlockCast:
    """A block-scaled cast of one scaling-state row for one input layout, resolved once: its
    launcher, grid, scale grids' shapes, row views and constant arguments, so that a cast kept for
    a layer's steady state makes its outputs and launches and does nothing else on the host. It
    is also what :func:`cast_blocks` runs, made for one call.

    Args:
        x: an input of the layout it will cast (``[M, N]``, its strides and dtype).
        dtype, block, mx, power_2_scale, amax_epsilon, transpose, record: as :func:`cast_blocks`.
        rows: the state row's views (``ScalingState.kernel_rows``), which it keeps: a plan is
            valid while they are the state's.

    Raises:
        ValueError: as :func:`cast_blocks`.
    """

    __slots__ = ("rows", "device", "shape", "dtype", "block", "transpose", "mx", "grid", "launch", "tail",
                 "gemm_bytes")

    def __init__(self, x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], mx: bool, power_2_scale: bool,
                 amax_epsilon: float, transpose: bool, record: bool, rows: StateRows) -> None:
        _check_block_cast(x, block, mx)
        m, n = x.shape
        self.rows, self.device, self.shape, self.dtype, self.block = rows, x.device, (m, n), dtype, tuple(block)
        self.transpose, self.mx = transpose, mx
        b = block[1]
        if mx:  # the grid also covers the padding of the swizzled layout: 128 rows x 4 blocks per tile
            self.grid = (4 * -(-max(m, 1) // 128), 4 * -(-max(n, 1) // 128))
        else:
            self.grid = (-(-max(m, 1) // b), -(-max(n, 1) // b))
        self.gemm_bytes = self.grid[0] * self.grid[1] * 32 if mx else 0
        # A launch site: all but the per-call tensors' addresses (x, the outputs) is fixed by the plan.
        self.launch = LaunchSite(_block_cast(b, block[0] == block[1], mx, dtype, bool(power_2_scale),
                                             float(amax_epsilon), transpose, record), self.grid)
        self.tail = (m, n, x.stride(0), x.stride(1), self.grid[0] * self.grid[1])

    def __call__(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """Cast ``x`` (the plan's layout): as :func:`cast_blocks` returns."""
        m, n = self.shape
        device, rows = self.device, self.rows
        out = torch.empty(m, n, dtype=torch.uint8, device=device)
        out_t = torch.empty(n, m, dtype=torch.uint8, device=device) if self.transpose else out
        scale_inv, scale_inv_t = grid_tensors(m, n, self.block, self.transpose, device)
        gemm = torch.empty(self.gemm_bytes, dtype=torch.uint8, device=device) if self.mx else out
        gemm_t = torch.empty(self.gemm_bytes, dtype=torch.uint8, device=device) if self.mx and self.transpose else out
        scale_inv_t_arg = scale_inv if scale_inv_t is None else scale_inv_t
        addresses = (x.data_ptr() | out.data_ptr() | out_t.data_ptr() | scale_inv.data_ptr() | scale_inv_t_arg.data_ptr()
                     | gemm.data_ptr() | gemm_t.data_ptr())
        self.launch(None, addresses, loadable(x), out, out_t, scale_inv, scale_inv_t_arg, gemm, gemm_t, rows.workspace,
                    rows.amax_history, rows.nonfinite_amax_count, rows.scale, *self.tail)
        e8m0 = torch.float8_e8m0fnu
        return (out.view(self.dtype), scale_inv, out_t.view(self.dtype) if self.transpose else None, scale_inv_t,
                gemm.view(e8m0) if self.mx else None, gemm_t.view(e8m0) if self.mx and self.transpose else None)


def _check_block_cast(x: torch.Tensor, block: tuple[int, int], mx: bool) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x.dtype={x.dtype} has no fused cast; valid: float32, bfloat16, float16")
    valid = ((1, 32),) if mx else ((1, 128), (128, 128))
    if tuple(block) not in valid:
        raise ValueError(f"block={tuple(block)} has no fused {'MXFP8' if mx else 'blockwise'} cast; valid: "
                         f"{', '.join(map(str, valid))}")


def grid_tensors(m: int, n: int, block: tuple[int, int], transpose: bool, device: torch.device
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The (empty) float32 scale_inv grids of an ``[M, N]`` cast in ``block`` s and of its
    transpose (None without ``transpose``): 1xB grids column-major, 128x128 row-major."""
    def grid(rows: int, cols: int) -> torch.Tensor:
        shape = (-(-rows // block[0]), -(-cols // block[1]))
        if block[0] == block[1]:
            return torch.empty(size=shape, dtype=torch.float32, device=device)  # size=: see tensorwise.RecordingCast
        return torch.empty_strided(shape, (1, shape[0]), dtype=torch.float32, device=device)

    return grid(m, n), (grid(n, m) if transpose else None)


def reference_blocks(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], *, mx: bool,
                     power_2_scale: bool = False, amax_epsilon: float = 0.0):
    """The torch ops of ``BlockQuantizer``'s cast: ``(data, scale_inv, amax per block)``."""
    amax = block_amax(x, block)
    if mx:
        scale_inv = mx_scale_inv(amax, dtype)
        scale = divide(1.0, scale_inv)
    else:
        scale = blockwise_scale(amax, dtype, power_2_scale, amax_epsilon)
        scale_inv = divide(1.0, scale)
    return quantize_blocks(x, scale, block, dtype), scale_inv, amax
