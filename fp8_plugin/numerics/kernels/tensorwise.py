"""Fused per-tensor FP8 casts in Triton: one read of the high-precision tensor per cast.

Each kernel equals, byte for byte, the torch ops it replaces (:func:`reference_cast`, built from
:func:`fp8_plugin.numerics.scaling.quantize`, ``amax`` and ``scale_from_amax``), as Transformer
Engine's ``cast_transpose`` (transformer_engine/common/transpose/cast_transpose.cu) fuses them:

- :func:`cast_transpose` (the scale known before the cast): reads ``x`` once, writes the FP8
  rowwise copy and, where asked, the transposed copy, and folds ``amax(x)`` into an amax buffer;
  1 launch (plus a 4-byte zero fill where the caller's buffer is new). Bytes per element:
  ``x``'s size read, 1 written per copy.
- :func:`cast_transpose_delayed` (delayed scaling as the layers run it): the state's scale and
  ``initialized`` flag are read on the device; in the steady state ``x`` is read once (the amax
  for the history folded into the cast), on a tensor's first cast twice (its own amax first);
  2 launches (an amax pass whose loads are masked off once initialized, the cast), 1 once the
  host knows the state holds a scale (the scale update sends the flags back without a wait).
- :func:`cast_transpose_current` (current scaling): one pass for the amax (``x`` read once,
  nothing written per element), then the cast, whose every program computes the scale from that
  amax on the device (TE's ``(FP8_MAX / amax) / 2**margin``, correctly rounded, guarded) and
  whose first program writes ``scale`` and ``scale_inv``: no host read; 2 launches. Bytes per
  element: twice ``x``'s size read, 1 or 2 written.

The two casts the layers run record the amax into the layer's ``ScalingState`` themselves, as
``record_amax`` / ``observe_current`` do in torch ops: the tile amaxes fold into a small
per-state workspace (int32 ``[3, 2]``: the amax bits and a count of finished programs); the last
program of the cast to finish (the count tells it) moves the amax into the state and zeroes the
workspace, so a steady-state cast needs no zero fill and no bookkeeping op of its own.

Launched with ``enable_fp_fusion=False``: no multiply is contracted with an addition into an FMA
(one rounding instead of two), so a GPU computes what the interpreter and torch compute. Tiles of
64 x 64 elements; ``x`` may have any strides (a transposed view is read as it is). The
amax is folded as an integer maximum of the absolute values' float32 bits (non-negative floats
order as their bits, and a NaN's bits exceed infinity's), so a NaN anywhere makes the amax NaN,
as ``x.abs().amax()`` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from functools import lru_cache

from ..formats import fp8_max
from .launch import KernelLaunch, LaunchSite
from .rows import StateRows
from ..scaling import amax as torch_amax
from ..scaling import divide, quantize, scale_from_amax
from .fp8_bits import as_float32, byte_pointer, e4m3_bits, e5m2_bits, raw_pointer, saturated

__all__ = ["cast_transpose", "cast_transpose_delayed", "cast_transpose_current", "RecordingCast", "reference_cast",
           "reference_delayed", "reference_current"]

_TILE = 64


@triton.jit
def _fold_amax(x, amax_bits_ptr):
    # max |x| of the tile into the buffer, as an integer maximum of the float32 bits (module docstring).
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(amax_bits_ptr, tl.max(tl.max(bits.to(tl.int32), axis=1), axis=0))


@triton.jit
def _own_scale(amax, MAX_OVER_MARGIN):
    # scale_from_amax(amax, fp8_max, margin, previous=1): correctly rounded division (div_rn:
    # Triton's "/" is approximate on a GPU), clamped to the float32 max, 1.0 where the amax is 0,
    # infinite or NaN.
    scale = tl.minimum(tl.math.div_rn(MAX_OVER_MARGIN, amax), 3.4028234663852886e38)
    return tl.where((amax > 0) & (amax < float("inf")), scale, 1.0)


@triton.jit
def _write_scale(scale, scale_out_ptr, scale_inv_out_ptr, pid_m, pid_n, SCALE_OUT: tl.constexpr):
    # The first program writes the scale the cast used (where asked) and its correctly rounded
    # reciprocal.
    if (pid_m == 0) & (pid_n == 0):
        if SCALE_OUT:
            tl.store(scale_out_ptr, scale)
        tl.store(scale_inv_out_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _cast_tile(x_ptr, out_ptr, out_t_ptr, amax_bits_ptr, scale, M, N, stride_xm, stride_xn,
               pid_m, pid_n, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr,
               AMAX: tl.constexpr, TILE: tl.constexpr):
    rows = pid_m * TILE + tl.arange(0, TILE)[:, None]
    cols = pid_n * TILE + tl.arange(0, TILE)[None, :]
    inside = (rows < M) & (cols < N)
    x = as_float32(tl.load(raw_pointer(x_ptr) + rows * stride_xm + cols * stride_xn, mask=inside, other=0))
    if AMAX:
        _fold_amax(x, amax_bits_ptr)
    s = saturated(x, scale, FP8_MAX, E4M3)
    if E4M3:
        code = e4m3_bits(s)
    else:
        code = e5m2_bits(s)
    tl.store(byte_pointer(out_ptr) + rows * N + cols, code, mask=inside)
    if TRANSPOSE:
        tl.store(byte_pointer(out_t_ptr) + cols * M + rows, code, mask=inside)
    return x


@triton.jit
def _bias_partials(x, partials_ptr, pid_m, pid_n, N, TILE: tl.constexpr):
    # The tile's column sums of the unscaled input (the bias gradient's share of these rows), in
    # float32: row pid_m of a [row tiles, N] buffer that one sum over its rows finishes.
    cols = pid_n * TILE + tl.arange(0, TILE)
    tl.store(partials_ptr + pid_m * N + cols, tl.sum(x, axis=0), mask=cols < N)


@triton.jit
def _cast_transpose_kernel(x_ptr, out_ptr, out_t_ptr, amax_bits_ptr, scale_ptr, M, N, stride_xm, stride_xn,
                           FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr,
                           AMAX: tl.constexpr, TILE: tl.constexpr):
    scale = tl.load(scale_ptr)
    _cast_tile(x_ptr, out_ptr, out_t_ptr, amax_bits_ptr, scale, M, N, stride_xm, stride_xn,
               tl.program_id(0), tl.program_id(1), FP8_MAX, E4M3, TRANSPOSE, AMAX, TILE)


@triton.jit
def _amax_tile(x_ptr, amax_bits_ptr, rows_limit, N, stride_xm, stride_xn, TILE: tl.constexpr):
    # The amax of this program's tile, rows below rows_limit only (none when it is 0: no load).
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)[:, None]
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)[None, :]
    x = as_float32(tl.load(raw_pointer(x_ptr) + rows * stride_xm + cols * stride_xn,
                           mask=(rows < rows_limit) & (cols < N), other=0))
    _fold_amax(x, amax_bits_ptr)


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, M, N, stride_xm, stride_xn, TILE: tl.constexpr):
    _amax_tile(x_ptr, amax_bits_ptr, M, N, stride_xm, stride_xn, TILE)


@triton.jit
def _read_amax(workspace_ptr):
    # The amax folded so far, as float32. An atomic read: its value reaches every warp of the
    # program through the atomic's broadcast, before this program's count in _finish, so the
    # last program cannot zero the workspace under a warp that has not read it yet.
    return tl.atomic_max(workspace_ptr, 0).to(tl.float32, bitcast=True)


@triton.jit
def _finish(workspace_ptr, n_programs, history_ptr, count_ptr, state_scale_ptr, scale,
            RECORD: tl.constexpr, CURRENT: tl.constexpr):
    # Every program counts itself done; the last one records the tensor's amax into the scaling
    # state, as ScalingState.record_amax (delayed) or observe_current (current) do, and zeroes
    # the workspace for the next cast: no zero fill and no bookkeeping op of its own.
    # Every thread's folds and reads of the workspace come before this program counts itself
    # done (the count is one thread's atomic; its release then covers them all).
    tl.debug_barrier()
    done = tl.atomic_add(workspace_ptr + 1, 1)
    if done == n_programs - 1:
        bits = tl.atomic_xchg(workspace_ptr, 0)
        tl.atomic_xchg(workspace_ptr + 1, 0)
        if RECORD:
            finite = bits < 0x7F800000  # not inf (0x7F800000), not NaN (above it)
            amax = bits.to(tl.float32, bitcast=True)
            tl.store(count_ptr, tl.load(count_ptr) + 1 - finite.to(tl.int64))
            slot = tl.load(history_ptr)
            if CURRENT:
                tl.store(history_ptr, tl.where(finite, amax, slot))
                tl.store(state_scale_ptr, scale)
            else:
                tl.store(history_ptr, tl.where(finite, tl.maximum(slot, amax), slot))


@triton.jit
def _cast_and_record(x_ptr, out_ptr, out_t_ptr, workspace_ptr, history_ptr, count_ptr, state_scale_ptr, scale_out_ptr,
                     scale_inv_out_ptr, partials_ptr, scale, M, N, stride_xm, stride_xn, n_programs,
                     FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr, AMAX: tl.constexpr,
                     RECORD: tl.constexpr, BGRAD: tl.constexpr, CURRENT: tl.constexpr, SCALE_OUT: tl.constexpr,
                     TILE: tl.constexpr):
    # The common tail of the two recording casts, once the scale is chosen: the scale written
    # by the first program, the tile cast (its amax folded where AMAX), the bias partials, and
    # the last program's recording into the state.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    _write_scale(scale, scale_out_ptr, scale_inv_out_ptr, pid_m, pid_n, SCALE_OUT)
    x = _cast_tile(x_ptr, out_ptr, out_t_ptr, workspace_ptr, scale, M, N, stride_xm, stride_xn,
                   pid_m, pid_n, FP8_MAX, E4M3, TRANSPOSE, AMAX, TILE)
    if BGRAD:
        _bias_partials(x, partials_ptr, pid_m, pid_n, N, TILE)
    _finish(workspace_ptr, n_programs, history_ptr, count_ptr, state_scale_ptr, scale, RECORD, CURRENT)


@triton.jit
def _current_kernel(x_ptr, out_ptr, out_t_ptr, workspace_ptr, history_ptr, count_ptr, state_scale_ptr,
                    scale_out_ptr, scale_inv_out_ptr, partials_ptr, M, N, stride_xm, stride_xn, n_programs,
                    MAX_OVER_MARGIN, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr,
                    RECORD: tl.constexpr, BGRAD: tl.constexpr, SCALE_OUT: tl.constexpr, TILE: tl.constexpr):
    scale = _own_scale(_read_amax(workspace_ptr), MAX_OVER_MARGIN)
    _cast_and_record(x_ptr, out_ptr, out_t_ptr, workspace_ptr, history_ptr, count_ptr, state_scale_ptr, scale_out_ptr,
                     scale_inv_out_ptr, partials_ptr, scale, M, N, stride_xm, stride_xn, n_programs, FP8_MAX, E4M3,
                     TRANSPOSE, False, RECORD, BGRAD, True, SCALE_OUT, TILE)


@triton.jit
def _amax_unless_initialized_kernel(x_ptr, workspace_ptr, initialized_ptr, M, N, stride_xm, stride_xn,
                                    TILE: tl.constexpr):
    # Delayed scaling's first cast of a tensor needs its own amax before the cast; once the state
    # holds a scale, the loads are masked off and this kernel reads nothing.
    rows_needed = M * (1 - tl.load(initialized_ptr).to(tl.int32))  # M rows, or none once initialized
    _amax_tile(x_ptr, workspace_ptr, rows_needed, N, stride_xm, stride_xn, TILE)


@triton.jit
def _delayed_kernel(x_ptr, out_ptr, out_t_ptr, workspace_ptr, initialized_ptr, state_scale_ptr, history_ptr,
                    count_ptr, scale_out_ptr, scale_inv_out_ptr, partials_ptr, M, N, stride_xm, stride_xn, n_programs,
                    MAX_OVER_MARGIN, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr,
                    RECORD: tl.constexpr, BGRAD: tl.constexpr, SCALE_OUT: tl.constexpr, TILE: tl.constexpr):
    # The scale of PerTensorQuantizer under delayed scaling: the state's scale once initialized,
    # else the tensor's own from the amax the previous kernel folded (which this kernel's own
    # folds cannot change: they fold the same values).
    initialized = tl.load(initialized_ptr).to(tl.int32) != 0
    own = _own_scale(_read_amax(workspace_ptr), MAX_OVER_MARGIN)
    scale = tl.where(initialized, tl.load(state_scale_ptr), own)
    _cast_and_record(x_ptr, out_ptr, out_t_ptr, workspace_ptr, history_ptr, count_ptr, state_scale_ptr, scale_out_ptr,
                     scale_inv_out_ptr, partials_ptr, scale, M, N, stride_xm, stride_xn, n_programs, FP8_MAX, E4M3,
                     TRANSPOSE, True, RECORD, BGRAD, False, SCALE_OUT, TILE)


@lru_cache(maxsize=None)
def _plain_cast(dtype: torch.dtype, transpose: bool, amax: bool) -> KernelLaunch:
    # The launcher of cast_transpose's kernel for these constexprs, made once.
    return KernelLaunch(_cast_transpose_kernel, FP8_MAX=fp8_max(dtype), E4M3=dtype == torch.float8_e4m3fn,
                        TRANSPOSE=transpose, AMAX=amax, TILE=_TILE, enable_fp_fusion=False)


@lru_cache(maxsize=None)
def _recording_cast(kind: str, dtype: torch.dtype, transpose: bool, record: bool, bias_grad: bool,
                    scale_out: bool) -> tuple[KernelLaunch, KernelLaunch]:
    # The launchers of a recording cast ("delayed" or "current"): its amax pass and its cast,
    # for these constexprs, made once.
    amax_pass = _amax_unless_initialized_kernel if kind == "delayed" else _amax_kernel
    cast = _delayed_kernel if kind == "delayed" else _current_kernel
    return (KernelLaunch(amax_pass, TILE=_TILE, enable_fp_fusion=False),
            KernelLaunch(cast, FP8_MAX=fp8_max(dtype), E4M3=dtype == torch.float8_e4m3fn, TRANSPOSE=transpose,
                         RECORD=record, BGRAD=bias_grad, SCALE_OUT=scale_out, TILE=_TILE, enable_fp_fusion=False))


def _check(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x.dtype={x.dtype} has no fused cast; valid: float32, bfloat16, float16")
    fp8_max(dtype)  # raises for a dtype that is not FP8


def _outputs(x: torch.Tensor, dtype: torch.dtype, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    out_t = torch.empty(n, m, dtype=dtype, device=x.device) if transpose else out
    return out, out_t


def _partials(x: torch.Tensor, grid: tuple[int, int], bias_grad_out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # The per-row-tile column sums of x for a fused bias gradient (None: not asked).
    if bias_grad_out is None:
        return None
    if bias_grad_out.shape != (x.shape[1],) or bias_grad_out.dtype != torch.float32:
        raise ValueError(f"bias_grad_out must be float32 [{x.shape[1]}], got {bias_grad_out.dtype} "
                         f"{list(bias_grad_out.shape)}")
    return torch.empty(grid[0], x.shape[1], dtype=torch.float32, device=x.device)


def _grid(x: torch.Tensor) -> tuple[int, int]:
    # Integer arithmetic: triton.cdiv called on the host goes through Triton's JIT wrapper (µs).
    return (-(-max(x.shape[0], 1) // _TILE), -(-max(x.shape[1], 1) // _TILE))


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, transpose: bool,
                   amax_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``quantize(x, scale, dtype)``, its transpose if asked, and ``amax(x)`` folded into ``amax_out``.

    Args:
        x: ``[M, N]`` float32, bfloat16 or float16, any strides.
        scale: float32 0-dim (or 1-element) tensor on ``x``'s device: the delayed-scaling scale.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: also write ``x.T`` ``[N, M]`` in FP8, row-major (the columnwise copy).
        amax_out: float32 1-element tensor holding a non-negative amax (or 0): on return it holds
            ``max(amax_out, amax(x))`` (NaN if ``x`` has one). None: no amax.

    Returns:
        ``(data [M, N], data_t [N, M] or None)``, row-major FP8.

    Raises:
        ValueError: ``x`` not 2-D or of another dtype; ``dtype`` not FP8.
    """
    _check(x, dtype)
    out, out_t = _outputs(x, dtype, transpose)
    if x.numel():
        amax_bits = amax_out.view(torch.int32) if amax_out is not None else out
        _plain_cast(dtype, transpose, amax_out is not None)(
            _grid(x), x, out, out_t, amax_bits, scale, x.shape[0], x.shape[1], x.stride(0), x.stride(1))
    return out, (out_t if transpose else None)


def _state_pointers(role: int, scale: torch.Tensor, amax_history: torch.Tensor, nonfinite_amax_count: torch.Tensor,
                    workspace: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # One role's row of each state tensor: views, whose data pointers Triton takes as they are.
    _check_workspace(workspace, amax_history.shape[0])
    return scale[role], amax_history[role], nonfinite_amax_count[role], workspace[role]


def _check_workspace(workspace: torch.Tensor, roles: int) -> None:
    if workspace.dtype != torch.int32 or workspace.shape != (roles, 2):
        raise ValueError(f"workspace must be int32 [{roles}, 2] zeros (ScalingState.kernel_workspace), "
                         f"got {workspace.dtype} {list(workspace.shape)}")


def _role_rows(role: int, scale: torch.Tensor, initialized: Optional[torch.Tensor], amax_history: torch.Tensor,
               nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, rows) -> tuple[torch.Tensor, ...]:
    # (scale, initialized, history, count, workspace) rows of ``role``: the caller's cached views
    # (ScalingState.kernel_rows) where given, else selected here.
    _check_workspace(workspace, amax_history.shape[0])
    if rows is not None:
        return rows.scale, rows.initialized, rows.amax_history, rows.nonfinite_amax_count, rows.workspace
    return (scale[role], None if initialized is None else initialized[role], amax_history[role],
            nonfinite_amax_count[role], workspace[role])


def cast_transpose_current(x: torch.Tensor, dtype: torch.dtype, margin: int, *, transpose: bool, record: bool,
                           scale: torch.Tensor, amax_history: torch.Tensor, nonfinite_amax_count: torch.Tensor,
                           workspace: torch.Tensor, role: int, bias_grad_out: Optional[torch.Tensor] = None,
                           rows: Optional[StateRows] = None, want_scale: bool = True
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Current scaling's cast of ``x``, its amax recorded into a :class:`ScalingState`'s tensors.

    Two launches, no host read: an amax pass (``x`` read once, folded into ``workspace``), then
    the cast, whose every program computes the scale from that amax on the device and whose last
    program records it as ``ScalingState.observe_current`` does (with ``record``). Bytes per
    element: twice ``x``'s size read, 1 written per copy.

    Args:
        x: ``[M, N]`` float32, bfloat16 or float16, any strides.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin: the recipe's margin (integer >= 0).
        transpose: also write the transposed copy.
        record: record the amax: with a finite amax ``amax_history[role, 0] = amax`` and
            ``scale[role]`` = the scale; else ``nonfinite_amax_count[role] += 1``. False leaves
            them as they are.
        scale, amax_history, nonfinite_amax_count: the state's float32 ``[3]``, float32
            ``[3, L]`` and int64 ``[3]`` tensors, updated in place.
        workspace: int32 ``[3, 2]``, zeros between casts (``ScalingState.kernel_workspace``):
            the running amax bits and the count of finished programs; zeroed again by the cast.
        role: the state's row: 0 input, 1 weight, 2 grad_output.
        bias_grad_out: float32 ``[N]`` or None: receives ``x.sum(0)`` in float32, the bias
            gradient of a layer whose grad_output ``x`` is (Transformer Engine's
            ``bgrad_quantize``): column sums of each 64-row tile in the cast, then one sum over
            the tiles (one more launch, ``ceil(M / 64) * N * 4`` bytes): not torch's summation
            order, within float32 summation error of it.
        rows: ``role``'s rows of those tensors as views, where the caller keeps them
            (:meth:`ScalingState.kernel_rows`): no select on the host; None selects them here.
        want_scale: return the scale too (False: None in its place, one tensor fewer to make).

    Returns:
        ``(data [M, N], data_t [N, M] or None, scale, scale_inv)``: ``scale`` is
        ``scale_from_amax(amax(x), fp8_max(dtype), margin, previous=1)`` and ``scale_inv`` its
        correctly rounded reciprocal, float32 0-dim tensors, bit for bit as the torch ops
        (:func:`reference_current`).

    Raises:
        ValueError: as :func:`cast_transpose`; ``workspace`` of another shape or dtype.
    """
    _check(x, dtype)  # before the state's tensors, as the messages have always come
    rows = StateRows(*_role_rows(role, scale, None, amax_history, nonfinite_amax_count, workspace, rows))
    plan = RecordingCast("current", x, dtype, margin, transpose, record, bias_grad_out is not None, rows, want_scale)
    data, data_t, scale_out, scale_inv, _ = plan(x, bias_grad_out=bias_grad_out)
    return data, data_t, scale_out, scale_inv


def cast_transpose_delayed(x: torch.Tensor, dtype: torch.dtype, margin: int, *, transpose: bool, record: bool,
                           scale: torch.Tensor, initialized: torch.Tensor, amax_history: torch.Tensor,
                           nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, role: int,
                           bias_grad_out: Optional[torch.Tensor] = None, rows: Optional[StateRows] = None,
                           want_scale: bool = True, initialized_known: bool = False
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Delayed scaling's cast: the state's scale once it holds one, else the tensor's own (first
    step); the amax recorded into the state's current-step history slot.

    At most two launches, whatever ``initialized`` holds (no host read): an amax pass whose loads are
    masked off once the state is initialized (the steady state: ``x`` read once, its amax folded
    into the cast; the pass is not launched where the host knows, ``initialized_known``), and
    the cast, whose last program records the amax as
    ``ScalingState.record_amax`` does. Bytes per element: ``x``'s size read (twice on a tensor's
    first cast), 1 written per copy.

    Args:
        x: ``[M, N]`` float32, bfloat16 or float16, any strides.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin: the recipe's margin (integer >= 0).
        transpose: also write the transposed copy.
        record: with a finite amax ``amax_history[role, 0] = max(amax_history[role, 0], amax)``,
            else ``nonfinite_amax_count[role] += 1``. False leaves them as they are.
        scale, initialized: the state's float32 and bool ``[3]``: the delayed scale, read.
        amax_history, nonfinite_amax_count, workspace, role, bias_grad_out, rows, want_scale: as in
            :func:`cast_transpose_current`.
        initialized_known: the host knows ``initialized[role]`` is true
            (:meth:`ScalingState.initialized_known`): the amax pass, which would read nothing,
            is not launched (1 launch). Never true of a state the device could find
            uninitialized: the cast would then scale by an amax still being folded.

    Returns:
        ``(data, data_t or None, scale, scale_inv)``: ``scale`` is ``where(initialized[role],
        scale[role], scale_from_amax(amax(x), fp8_max, margin, 1))`` and ``scale_inv`` its
        correctly rounded reciprocal, 0-dim float32, bit for bit as the torch ops
        (:func:`reference_delayed`).

    Raises:
        ValueError: as :func:`cast_transpose_current`.
    """
    _check(x, dtype)  # before the state's tensors, as the messages have always come
    rows = StateRows(*_role_rows(role, scale, initialized, amax_history, nonfinite_amax_count, workspace, rows))
    plan = RecordingCast("delayed", x, dtype, margin, transpose, record, bias_grad_out is not None, rows, want_scale)
    data, data_t, scale_out, scale_inv, _ = plan(x, initialized_known, bias_grad_out)
    return data, data_t, scale_out, scale_inv


class RecordingCast:
    """A recording cast of one scaling-state row for one input layout, resolved once: its
    launchers, grid, row views and constant arguments, so that a cast kept for a layer's steady
    state makes its outputs and launches and does nothing else on the host. It is also what
    :func:`cast_transpose_delayed` and :func:`cast_transpose_current` run, made for one call.

    Args:
        kind: ``"delayed"`` or ``"current"``.
        x: an input of the layout it will cast (``[M, N]``, its strides and dtype).
        dtype, margin, transpose, record: as :func:`cast_transpose_delayed`.
        bias_grad: also return ``x.sum(0)`` in float32 (``bias_grad_out``).
        rows: the state row's views (``ScalingState.kernel_rows``), which it keeps: a plan is
            valid while they are the state's.
        scale_out: also return the scale (``want_scale``).

    Raises:
        ValueError: as :func:`cast_transpose_delayed`.
    """

    __slots__ = ("kind", "rows", "device", "shape", "dtype", "transpose", "bias_grad", "scale_out", "grid",
                 "amax_pass", "cast", "args", "tail")

    def __init__(self, kind: str, x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool, record: bool,
                 bias_grad: bool, rows: StateRows, scale_out: bool = False) -> None:
        _check(x, dtype)
        self.kind, self.rows, self.device, self.shape, self.dtype = kind, rows, x.device, tuple(x.shape), dtype
        self.transpose, self.bias_grad, self.scale_out = transpose, bias_grad, scale_out
        self.grid = _grid(x)  # at least one program: the scale is written and recorded for an empty x too
        # Launch sites: all but the per-call tensors' addresses (x, the outputs) is fixed by the plan.
        self.amax_pass, self.cast = (LaunchSite(launch, self.grid)
                                     for launch in _recording_cast(kind, dtype, transpose, record, bias_grad, scale_out))
        self.args = (x.shape[0], x.shape[1], x.stride(0), x.stride(1))
        self.tail = (*self.args, self.grid[0] * self.grid[1], fp8_max(dtype) / 2.0**margin)

    def __call__(self, x: torch.Tensor, initialized_known: bool = False,
                 bias_grad_out: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], ...]:
        """Cast ``x`` (the plan's layout): ``(data, data_t or None, scale or None, scale_inv,
        bias_grad or None)``; ``initialized_known`` as in :func:`cast_transpose_delayed` (current
        scaling ignores it), ``bias_grad_out`` the caller's buffer for the bias gradient (None:
        one is made)."""
        m, n = self.shape
        device, rows = self.device, self.rows
        out = torch.empty(m, n, dtype=self.dtype, device=device)
        out_t = torch.empty(n, m, dtype=self.dtype, device=device) if self.transpose else out
        # size= by keyword: a positional tuple makes torch's argument parser try (and fail) an
        # overload first, about a third more host work per tensor.
        scale_inv = torch.empty(size=(), dtype=torch.float32, device=device)
        scale = torch.empty(size=(), dtype=torch.float32, device=device) if self.scale_out else None
        bias = partials = None
        if self.bias_grad and bias_grad_out is None:
            bias = torch.empty(n, dtype=torch.float32, device=device)
            partials = torch.empty(self.grid[0], n, dtype=torch.float32, device=device)
        elif self.bias_grad:
            bias, partials = bias_grad_out, _partials(x, self.grid, bias_grad_out)  # the caller's buffer, checked
        outputs = (scale_inv if scale is None else scale, scale_inv, scale_inv if partials is None else partials)
        x_address = x.data_ptr()
        addresses = (x_address | out.data_ptr() | out_t.data_ptr() | outputs[0].data_ptr() | scale_inv.data_ptr()
                     | outputs[2].data_ptr())
        if self.kind == "delayed":
            if not initialized_known:
                self.amax_pass(None, x_address, x, rows.workspace, rows.initialized, *self.args)
            self.cast(None, addresses, x, out, out_t, rows.workspace, rows.initialized, rows.scale, rows.amax_history,
                      rows.nonfinite_amax_count, *outputs, *self.tail)
        else:
            self.amax_pass(None, x_address, x, rows.workspace, *self.args)
            self.cast(None, addresses, x, out, out_t, rows.workspace, rows.amax_history, rows.nonfinite_amax_count,
                      rows.scale, *outputs, *self.tail)
        if partials is not None:
            torch.sum(partials, 0, out=bias)
        return out, (out_t if self.transpose else None), scale, scale_inv, bias


def reference_delayed(x: torch.Tensor, state_scale: torch.Tensor, initialized: torch.Tensor, dtype: torch.dtype,
                      margin: int, transpose: bool):
    """Delayed scaling's cast in torch ops, as PerTensorQuantizer runs it: ``(data, data_t, scale, scale_inv, amax)``."""
    amax = torch_amax(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scale = torch.where(initialized, state_scale, scale_from_amax(amax, fp8_max(dtype), margin, one))
    data, data_t, _ = reference_cast(x, scale, dtype, transpose)
    return data, data_t, scale, divide(1.0, scale), amax


def reference_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The torch ops the kernels replace: ``(quantize(x, scale, dtype), its transpose, amax(x))``."""
    data = quantize(x, scale, dtype)
    return data, (data.t().contiguous() if transpose else None), torch_amax(x)


def reference_current(x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool):
    """Current scaling in torch ops: ``(data, data_t, scale, scale_inv, amax)``."""
    amax = torch_amax(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scale = scale_from_amax(amax, fp8_max(dtype), margin, one)
    data, data_t, _ = reference_cast(x, scale, dtype, transpose)
    return data, data_t, scale, divide(1.0, scale), amax
