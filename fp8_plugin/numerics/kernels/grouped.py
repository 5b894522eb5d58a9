"""Fused per-expert FP8 casts in Triton: the token rows of every expert (sorted by expert) or a
stack of expert weights, one scale per expert, in a fixed number of launches whatever the
expert count.

The torch ops it replaces (``fp8_plugin.modules.experts``: ``group_amax``, ``_scales``,
``quantize_groups``, and ``cast_expert_weights``) cost a handful of ops per expert for the amax
recording alone; here:

- a zero fill of an int32 ``[E + 1]`` workspace (each expert's amax bits, a program count);
- an amax pass: each row's amax folded into its expert's slot, rows of experts whose state
  holds a delayed scale masked off (no read: their amax is folded in the cast);
- the cast: each row scaled by its expert's scale (delayed: the state's once initialized, else
  its own from the amax; current: its own), the amax folded; the last program records every
  expert's amax into its state (``ScalingState.record_amax`` / ``observe_current``) and writes
  the ``[E]`` scale_inv.

3 launches. Bytes per element: the input's size read once (current scaling, and a delayed
expert's first cast: twice), 1 written. The experts' states are reached through the address
table of :mod:`.scale_update` (built once per layout by the caller's cache). The group of a row
comes from ``group_of_row`` on the device (token rows) or from its index (weights: ``N`` rows
per expert): no host read. Bit for bit the torch ops (:func:`reference_groups`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import fp8_max
from ..scaling import divide, quantize, scale_from_amax
from .fp8_bits import as_float32, e4m3_bits, e5m2_bits, loadable, saturated
from .scale_update import FIELDS
from .tensorwise import _own_scale
from .launch import KernelLaunch

__all__ = ["cast_groups", "reference_groups"]

_TILE_ROWS, _TILE_COLS = 32, 128


@triton.jit
def _tile(x_ptr, group_ptr, pid_m, pid_n, S, K, ROWS_PER_GROUP, stride_g, stride_r, stride_k,
          TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr):
    # Rows of the tile, their groups and addresses. Token rows: 2-D [S, K] and group_of_row.
    # Weights (ROWS_PER_GROUP > 0): [E, N, K] with any strides, row = expert * N + n.
    rows = pid_m * TILE_ROWS + tl.arange(0, TILE_ROWS)
    cols = pid_n * TILE_COLS + tl.arange(0, TILE_COLS)
    in_rows = rows < S
    if ROWS_PER_GROUP > 0:
        groups = rows // ROWS_PER_GROUP
        offsets = groups * stride_g + (rows % ROWS_PER_GROUP) * stride_r
    else:
        groups = tl.load(group_ptr + rows, mask=in_rows, other=0).to(tl.int32)
        offsets = rows * stride_r
    return rows, cols, in_rows, groups, offsets


@triton.jit
def _group_state(table_ptr, groups, mask, FIELD: tl.constexpr, FIELDS: tl.constexpr):
    # Column FIELD of the address table for each group (rows outside the tensor read nothing).
    return tl.load(table_ptr + groups * FIELDS + FIELD, mask=mask, other=0)


@triton.jit
def _group_amax_kernel(x_ptr, group_ptr, table_ptr, workspace_ptr, S, K, ROWS_PER_GROUP, stride_g, stride_r,
                       stride_k, DELAYED: tl.constexpr, FIELDS: tl.constexpr, TILE_ROWS: tl.constexpr,
                       TILE_COLS: tl.constexpr):
    rows, cols, in_rows, groups, offsets = _tile(x_ptr, group_ptr, tl.program_id(0), tl.program_id(1), S, K,
                                                 ROWS_PER_GROUP, stride_g, stride_r, stride_k, TILE_ROWS, TILE_COLS)
    needed = in_rows
    if DELAYED:  # an expert whose state holds a scale casts with it: its amax is folded in the cast
        initialized = tl.load(_group_state(table_ptr, groups, in_rows, 2, FIELDS).to(tl.pointer_type(tl.int8)),
                              mask=in_rows, other=0)
        needed = in_rows & (initialized == 0)
    mask = needed[:, None] & (cols < K)[None, :]
    x = as_float32(tl.load(x_ptr + offsets[:, None] + cols[None, :] * stride_k, mask=mask, other=0))
    bits = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    tl.atomic_max(workspace_ptr + groups, tl.max(bits, axis=1), mask=needed)


@triton.jit
def _group_scale(table_ptr, groups, amax_bits, mask, MAX_OVER_MARGIN, DELAYED: tl.constexpr, FIELDS: tl.constexpr):
    # The scale of each group: delayed, the state's once initialized, else its own from the amax.
    own = _own_scale(amax_bits.to(tl.float32, bitcast=True), MAX_OVER_MARGIN)
    if DELAYED:
        initialized_ptr = _group_state(table_ptr, groups, mask, 2, FIELDS).to(tl.pointer_type(tl.int8))
        scale_ptr = _group_state(table_ptr, groups, mask, 1, FIELDS).to(tl.pointer_type(tl.float32))
        initialized = tl.load(initialized_ptr, mask=mask, other=0)
        return tl.where(initialized != 0, tl.load(scale_ptr, mask=mask, other=1.0), own)
    return own


@triton.jit
def _group_cast_kernel(x_ptr, group_ptr, table_ptr, workspace_ptr, out_ptr, scale_inv_ptr, S, K, ROWS_PER_GROUP,
                       stride_g, stride_r, stride_k, n_programs, MAX_OVER_MARGIN, E: tl.constexpr,
                       FP8_MAX: tl.constexpr, E4M3: tl.constexpr, DELAYED: tl.constexpr, RECORD: tl.constexpr,
                       FIELDS: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr):
    # E (the expert count) is a compile-time constant: the recording loop's bound (Triton 3.6's
    # interpreter cannot take a loop bound from a kernel argument), one compile per model.
    rows, cols, in_rows, groups, offsets = _tile(x_ptr, group_ptr, tl.program_id(0), tl.program_id(1), S, K,
                                                 ROWS_PER_GROUP, stride_g, stride_r, stride_k, TILE_ROWS, TILE_COLS)
    # Each row's expert amax so far, by atomic reads (see tensorwise._read_amax), then its scale.
    amax_bits = tl.atomic_max(workspace_ptr + groups, 0, mask=in_rows)
    scale = _group_scale(table_ptr, groups, amax_bits, in_rows, MAX_OVER_MARGIN, DELAYED, FIELDS)
    mask = in_rows[:, None] & (cols < K)[None, :]
    x = as_float32(tl.load(x_ptr + offsets[:, None] + cols[None, :] * stride_k, mask=mask, other=0))
    s = saturated(x, scale[:, None], FP8_MAX, E4M3)
    if E4M3:
        code = e4m3_bits(s)
    else:
        code = e5m2_bits(s)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], code, mask=mask)
    bits = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    tl.atomic_max(workspace_ptr + groups, tl.max(bits, axis=1), mask=in_rows)
    # The last program records every expert's amax and writes the scale_inv of all E. Every
    # thread's atomics on the workspace come before this program counts itself done.
    tl.debug_barrier()
    done = tl.atomic_add(workspace_ptr + E, 1)
    if done == n_programs - 1:
        for g in range(0, E):
            one = tl.arange(0, 1)  # the expert as a 1-element vector: the helpers take vectors
            amax_bits_g = tl.atomic_xchg(workspace_ptr + g + one, 0)
            scale_g = _group_scale(table_ptr, g + one, amax_bits_g, one == 0, MAX_OVER_MARGIN, DELAYED, FIELDS)
            tl.store(scale_inv_ptr + g + one, tl.math.div_rn(1.0, scale_g))
            if RECORD:
                finite = amax_bits_g < 0x7F800000
                amax = amax_bits_g.to(tl.float32, bitcast=True)
                count_ptr = _group_state(table_ptr, g + one, one == 0, 8, FIELDS).to(tl.pointer_type(tl.int64))
                tl.store(count_ptr, tl.load(count_ptr) + 1 - finite.to(tl.int64))
                history_ptr = _group_state(table_ptr, g + one, one == 0, 0, FIELDS).to(tl.pointer_type(tl.float32))
                slot = tl.load(history_ptr)
                if DELAYED:
                    tl.store(history_ptr, tl.where(finite, tl.maximum(slot, amax), slot))
                else:
                    tl.store(history_ptr, tl.where(finite, amax, slot))
                    scale_ptr = _group_state(table_ptr, g + one, one == 0, 1, FIELDS).to(tl.pointer_type(tl.float32))
                    tl.store(scale_ptr, scale_g)
        tl.atomic_xchg(workspace_ptr + E, 0)


def cast_groups(x: torch.Tensor, group_of_row: Optional[torch.Tensor], table: torch.Tensor, experts: int,
                dtype: torch.dtype, margin: int, *, delayed: bool, record: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert cast of token rows or of a weight stack, one scale per expert.

    Args:
        x: token rows ``[S, K]`` sorted by expert (with ``group_of_row``), or expert weights
            ``[E, N, K]`` (``group_of_row`` None: row ``n`` of expert ``e``), float32, bfloat16
            or float16, any strides.
        group_of_row: int64 ``[S]`` on ``x``'s device, the expert of each row; None for weights.
        table: the address table of the E experts' ``(state, role)`` rows
            (:func:`~fp8_plugin.numerics.kernels.scale_update.build_table`, in expert order).
        experts: E.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin: the recipe's margin.
        delayed: delayed scaling (the state's scale once initialized) or current scaling.
        record: record each expert's amax into its state, as ``record_amax`` (delayed) or
            ``observe_current`` (current) do; False leaves the states.

    Returns:
        ``(data, scale_inv)``: FP8 of ``x``'s shape, contiguous, and float32 ``[E]``, bit for
        bit as :func:`reference_groups`.

    Raises:
        ValueError: ``x`` neither ``[S, K]`` with ``group_of_row`` nor ``[E, N, K]`` without.
    """
    if not ((x.dim() == 2 and group_of_row is not None) or (x.dim() == 3 and group_of_row is None)):
        raise ValueError(f"x of shape {list(x.shape)}: token rows [S, K] take group_of_row, weights [E, N, K] "
                         "do not")
    if x.dim() == 3:
        rows, k = x.shape[0] * x.shape[1], x.shape[2]
        per_group, strides = x.shape[1], (x.stride(0), x.stride(1), x.stride(2))
        groups = x  # unused by the kernels
    else:
        rows, k = x.shape
        per_group, strides = 0, (0, x.stride(0), x.stride(1))
        groups = group_of_row
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty(experts, dtype=torch.float32, device=x.device)
    workspace = torch.zeros(experts + 1, dtype=torch.int32, device=x.device)
    grid = (-(-max(rows, 1) // _TILE_ROWS), -(-max(k, 1) // _TILE_COLS))
    source = loadable(x)
    amax_pass, cast = _group_launches(experts, dtype, delayed, record)
    amax_pass(grid, source, groups, table, workspace, rows, k, per_group, *strides)
    cast(grid, source, groups, table, workspace, out.view(torch.uint8), scale_inv, rows, k, per_group, *strides,
         grid[0] * grid[1], fp8_max(dtype) / 2.0**margin)
    return out, scale_inv


@lru_cache(maxsize=None)
def _group_launches(experts: int, dtype: torch.dtype, delayed: bool, record: bool
                    ) -> tuple[KernelLaunch, KernelLaunch]:
    # The launchers of the experts' amax pass and cast for these constexprs, made once.
    return (KernelLaunch(_group_amax_kernel, DELAYED=delayed, FIELDS=FIELDS, TILE_ROWS=_TILE_ROWS,
                         TILE_COLS=_TILE_COLS),
            KernelLaunch(_group_cast_kernel, E=experts, FP8_MAX=fp8_max(dtype), E4M3=dtype == torch.float8_e4m3fn,
                         DELAYED=delayed, RECORD=record, FIELDS=FIELDS, TILE_ROWS=_TILE_ROWS, TILE_COLS=_TILE_COLS,
                         enable_fp_fusion=False))


def reference_groups(x: torch.Tensor, group_of_row: Optional[torch.Tensor], scale: torch.Tensor,
                     initialized: torch.Tensor, dtype: torch.dtype, margin: int, delayed: bool):
    """The torch ops: ``(data, scale_inv, amax [E])`` with the experts' ``scale`` and
    ``initialized`` (``[E]``) as the states hold them."""
    experts = scale.shape[0]
    if x.dim() == 3:
        amax = x.abs().amax(dim=(1, 2)).to(torch.float32) if x.numel() else x.new_zeros(experts, dtype=torch.float32)
        row_scale = lambda s: s.view(-1, 1, 1)  # noqa: E731
    else:
        amax = torch.zeros(experts, dtype=torch.float32, device=x.device)
        if x.numel():
            amax = amax.scatter_reduce(0, group_of_row, x.abs().amax(dim=1).to(torch.float32), "amax")
        row_scale = lambda s: s[group_of_row].unsqueeze(1)  # noqa: E731
    one = torch.ones((), dtype=torch.float32, device=x.device)
    own = scale_from_amax(amax, fp8_max(dtype), margin, one)
    used = torch.where(initialized, scale, own) if delayed else own
    return quantize(x, row_scale(used), dtype).contiguous(), divide(1.0, used), amax
