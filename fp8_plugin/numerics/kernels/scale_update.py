"""Delayed scaling's scale update for a whole model in a fixed number of launches.

As Transformer Engine's ``fused_amax_and_scale_update_after_reduction`` (``kernel_bulk`` in
transformer_engine/common/recipe/delayed_scaling.cu) updates every FP8 tensor of a model in one
launch, :func:`bulk_update` updates every pending (layer, role) row of a model's
:class:`~fp8_plugin.numerics.quantizers.ScalingState` objects in at most three launches, whatever
the layer count:

- with an amax reduction: a gather of each row's current-step amax into one flat float32 tensor
  (1 launch), the reduction itself (an all-reduce: 1), the update (1);
- without: the update alone (1), reading the amaxes from the histories.

Each row gets the numerics of :func:`fp8_plugin.numerics.quantizers.update_delayed_scaling`'s
torch ops (its reference, which the tests compare bit for bit): the outlier check and its
policy, ``amax = max(history)`` or ``history[0]``, ``scale = (FP8_MAX / amax) / 2**margin``
(correctly rounded, clamped to the float32 max, the previous scale kept where the amax is 0 or
not finite), ``initialized``, the history rolled by one step with a zeroed current slot.

The states stay where they are (each layer's own tensors, saved as before): the kernels reach
them through a table of their addresses, built on the host from ``data_ptr()`` and copied to the
device once per layout (the set of rows and their tensors' addresses); steady-state steps reuse
it with no host-to-device copy. A layout changes when states are reallocated (a checkpoint
load, a device move, a new history length) or the pending rows change.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..._private.torch_api import in_dispatch_mode
from ..device_kind import fp8_family
from ..formats import fp8_dtype, fp8_max
from .launch import KernelLaunch, recording_launches
from .rows import tensors_epoch

__all__ = ["bulk_update", "build_table", "Row", "Tables", "table_for"]

# The row of grad_output in a ScalingState (quantizers.GRAD_OUTPUT; the kernels sit below the
# quantizers, which call them): its format is the recipe's backward one.
GRAD_OUTPUT_ROLE = 2
_POLICIES = {"clip": 0, "keep": 1, "skip": 2}
_ALGOS = {"max": 0, "most_recent": 1}
# Columns of the address table: history row, scale, initialized, outlier count, outlier ratio
# (addresses), history length, amax algorithm, outlier policy, non-finite amax count (address).
FIELDS = 9
# Columns of the parameter table (float32): FP8 max, 2**margin, FP8 max / 2**margin, outlier factor.
_PARAMS = 4
# Layouts a caller's cache keeps: one per reduction setting or (experts) per role and projection,
# and room for a changing pending set.
_CACHED_LAYOUTS = 8

# One row: (recipe, role, state).
Row = tuple


@triton.jit
def _gather_kernel(table_ptr, current_ptr, FIELDS: tl.constexpr):
    row = tl.program_id(0)
    history = tl.load(table_ptr + row * FIELDS).to(tl.pointer_type(tl.float32))
    tl.store(current_ptr + row, tl.load(history))


@triton.jit
def _update_kernel(table_ptr, params_ptr, current_ptr, flags_ptr, FROM_CURRENT: tl.constexpr, FIELDS: tl.constexpr,
                   PARAMS: tl.constexpr, BLOCK: tl.constexpr, FLAGS: tl.constexpr):
    row = tl.program_id(0)
    base = table_ptr + row * FIELDS
    history = tl.load(base).to(tl.pointer_type(tl.float32))
    scale_ptr = tl.load(base + 1).to(tl.pointer_type(tl.float32))
    initialized_ptr = tl.load(base + 2).to(tl.pointer_type(tl.int8))
    count_ptr = tl.load(base + 3).to(tl.pointer_type(tl.int64))
    ratio_ptr = tl.load(base + 4).to(tl.pointer_type(tl.float32))
    length = tl.load(base + 5)
    algo = tl.load(base + 6)
    policy = tl.load(base + 7)
    fp8_max = tl.load(params_ptr + row * PARAMS)
    margin_pow = tl.load(params_ptr + row * PARAMS + 1)
    max_over_margin = tl.load(params_ptr + row * PARAMS + 2)
    factor = tl.load(params_ptr + row * PARAMS + 3)

    previous = tl.load(scale_ptr)
    initialized = tl.load(initialized_ptr) != 0
    index = tl.arange(0, BLOCK)
    h = tl.load(history + index, mask=index < length, other=0.0)
    if FROM_CURRENT:
        current = tl.load(current_ptr + row)  # the reduced amax
    else:
        current = tl.load(history)
    # Outliers (quantizers._handle_outliers): against the amax the previous scale came from.
    bound = tl.math.div_rn(tl.math.div_rn(fp8_max, previous), margin_pow)
    limit = factor * bound
    finite = tl.abs(current) < float("inf")  # false for inf and NaN
    outlier = initialized & finite & (current > limit)
    ratio = tl.math.div_rn(current, bound)
    current = tl.where(outlier & (policy == 0), limit, current)
    current = tl.where(outlier & (policy == 2), 0.0, current)
    tl.store(count_ptr, tl.load(count_ptr) + outlier.to(tl.int64))
    tl.store(ratio_ptr, tl.where(outlier, ratio, tl.load(ratio_ptr)))
    # amax from the history (recipe.reduce_history), then the scale (scaling.scale_from_amax).
    h = tl.where(index == 0, current, h)
    amax = tl.where(algo == 0, tl.max(h, axis=0), current)
    valid = (amax > 0) & (amax < float("inf"))
    scale = tl.minimum(tl.math.div_rn(max_over_margin, amax), 3.4028234663852886e38)  # the float32 max
    tl.store(scale_ptr, tl.where(valid, scale, previous))
    tl.store(initialized_ptr, (initialized | valid).to(tl.int8))
    if FLAGS:  # each row's flag, contiguous, for the host (bulk_update's _publish_initialized)
        tl.store(flags_ptr + row, (initialized | valid).to(tl.int8))
    # Roll by one step: every column moves one older, the current slot starts at 0. All loads
    # of the row are done before any store (the barrier: other threads' loads of the same row).
    tl.debug_barrier()
    tl.store(history + index + 1, h, mask=index + 1 < length)
    tl.store(history, 0.0)


def build_table(rows: Sequence[Row], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The address table (int64 ``[n, 9]``) and parameter table (float32 ``[n, 4]``) of ``rows``
    on ``device`` (on ``meta``: shapes only). Copied from pinned memory without blocking the
    host on a GPU. A recipe without delayed scaling's fields (current scaling: its casts read
    the table for the states' addresses alone) gets their defaults."""
    if device.type == "meta":
        return (torch.empty(len(rows), FIELDS, dtype=torch.int64, device=device),
                torch.empty(len(rows), _PARAMS, dtype=torch.float32, device=device))
    table, params = [], []
    for recipe, role, state in rows:
        max_value = fp8_max(fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT_ROLE,
                                      family=fp8_family(state.device)))
        algo = getattr(recipe, "amax_compute_algo", "max")
        table.append([state.amax_history[role].data_ptr(), state.scale[role].data_ptr(),
                      state.initialized[role].data_ptr(), state.outlier_count[role].data_ptr(),
                      state.outlier_ratio[role].data_ptr(), state.amax_history.shape[1],
                      _ALGOS.get(algo, 0) if isinstance(algo, str) else 0,
                      _POLICIES[getattr(recipe, "amax_outlier_policy", "keep")],
                      state.nonfinite_amax_count[role].data_ptr()])
        params.append([max_value, 2.0**recipe.margin, max_value / 2.0**recipe.margin,
                       float(getattr(recipe, "amax_outlier_factor", 1.0))])
    return (_to_device(torch.tensor(table, dtype=torch.int64), device),
            _to_device(torch.tensor(params, dtype=torch.float32), device))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory and non-blocking on a GPU: the copy waits in the stream, not the host
    # (torch's pinned-memory allocator keeps the buffer until the copy has run).
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def layout_key(rows: Sequence[Row]) -> tuple:
    """What a table depends on: each row's role, recipe object and state object, with the state's
    ``generation`` (which counts the replacements of its tensors: a load, a move, a resized
    history; each changes the addresses and history lengths a table holds). Identities, read on
    the host: no tensor attribute read and no recipe hashed per row (a model's update has three
    rows per layer, every step). The cache that keys on it keeps the objects alive
    (:func:`table_for`), so that no identity is reused while it holds a table."""
    return tuple((role, id(recipe), id(state), state.generation) for recipe, role, state in rows)


class Tables(NamedTuple):
    """:func:`build_table`'s two tables of some rows, the longest amax history among them, and the
    rows' recipes and states (kept alive while their identities key a cache: :func:`layout_key`)."""

    table: torch.Tensor
    params: torch.Tensor
    longest_history: int
    objects: list


def table_for(rows: Sequence[Row], device: torch.device, tables: Optional[dict]) -> Tables:
    """:func:`build_table` of ``rows``, from the caller's cache ``tables`` (a dict it keeps
    between steps, keyed by :func:`layout_key`; None builds anew) where the layout is there."""
    # Meta tables (shapes alone) are kept only while launches are recorded (the host profile,
    # which measures a GPU's steady state): traced code on meta makes its own.
    key = layout_key(rows) if device.type != "meta" or recording_launches() else None
    cached = tables.get(key) if tables is not None and key is not None else None
    if cached is None:
        cached = Tables(*build_table(rows, device), max(state.amax_history.shape[1] for _, _, state in rows),
                        [(recipe, state) for recipe, _, state in rows])
        if tables is not None and key is not None:
            while len(tables) >= _CACHED_LAYOUTS:  # the oldest first: the steady state repeats a few
                tables.pop(next(iter(tables)))
            tables[key] = cached
    return cached


def supported(recipe) -> bool:
    """Whether the kernel computes this recipe's update (a callable ``amax_compute_algo`` runs as
    torch ops)."""
    return recipe.amax_compute_algo in _ALGOS and recipe.amax_outlier_policy in _POLICIES


def bulk_update(rows: Sequence[Row], reduce_amax: Optional[Callable[[torch.Tensor], None]],
                tables: Optional[dict] = None) -> None:
    """Update every row's scale and roll its history, as ``update_delayed_scaling`` does.

    Args:
        rows: ``(recipe, role, state)`` per pending row: a :class:`DelayedScaling` whose
            :func:`supported` is true, the role (0 input, 1 weight, 2 grad_output) and the
            layer's :class:`ScalingState`, all on one device.
        reduce_amax: in-place MAX reduction of the float32 ``[n]`` current-step amaxes (in row
            order), or None.
        tables: a dict the caller keeps between steps (its model's), caching the device tables
            by :func:`layout_key`; None builds them anew.
    """
    if not rows:
        return
    device = rows[0][2].scale.device
    # Traced (meta tensors, a dispatch mode): the custom ops of .ops, which the quantizers import;
    # while launches are only recorded (the host profile), meta tensors run the eager path.
    traced = (device.type == "meta" and not recording_launches()) or in_dispatch_mode()
    # The eager steady state: the same rows as the last update, every state's tensors and flags as
    # they were then (tensors_epoch), all known initialized: its tables, no per-row key or scan.
    epoch, last = tensors_epoch(), None if traced or tables is None else tables.get(_LAST)
    steady = last is not None and last[1] == epoch and last[0] == rows
    kept = last[2] if steady else table_for(rows, device, tables)
    table, params, longest, _ = kept
    block = triton.next_power_of_2(longest) if device.type != "meta" else 1
    current = torch.empty(len(rows), dtype=torch.float32, device=device)
    if reduce_amax is not None:
        (torch.ops.fp8_plugin.scale_update_gather if traced else _gather)(table, current)
        reduce_amax(current)
    if traced:
        torch.ops.fp8_plugin.scale_update(table, params, current, reduce_amax is not None, block)
        return
    # Rows whose state does not yet know, on the host, that it holds a scale: their flags come
    # back (once per state and role, in the first steps of a run or after a load).
    unknown = [] if steady else [i for i, (_, role, state) in enumerate(rows) if not state.initialized_known(role)]
    if tables is not None and not unknown and not steady:
        tables[_LAST] = (list(rows), epoch, kept)
    if device.type == "meta" and unknown:  # recorded launches: no flags come back; the steady state of a GPU, whose do, set
        _publish_initialized(rows, torch.ones(len(rows), dtype=torch.int8), unknown)
        unknown = []
    flags = torch.empty(len(rows), dtype=torch.int8, device=device) if unknown else None
    _update(table, params, current, reduce_amax is not None, block, flags)
    if unknown:
        _publish_initialized(rows, flags, unknown)


# The key, in a caller's ``tables``, of the last steady update: (its rows, tensors_epoch, Tables).
_LAST = "last steady update"


def _gather(table: torch.Tensor, current: torch.Tensor) -> None:
    _launch("gather")((table.shape[0],), table, current)


def _update(table: torch.Tensor, params: torch.Tensor, current: torch.Tensor, from_current: bool, block: int,
            flags: Optional[torch.Tensor] = None) -> None:
    # ``flags``: int8 [n] receiving each row's ``initialized`` after the update, or None.
    _launch("update", from_current, block, flags is not None)(
        (table.shape[0],), table, params, current, current if flags is None else flags)


@lru_cache(maxsize=None)
def _launch(kernel: str, from_current: bool = False, block: int = 1, flags: bool = False) -> KernelLaunch:
    # The launcher of the gather or the update kernel for these constexprs, made once.
    if kernel == "gather":
        return KernelLaunch(_gather_kernel, FIELDS=FIELDS)
    return KernelLaunch(_update_kernel, FROM_CURRENT=from_current, FIELDS=FIELDS, PARAMS=_PARAMS, BLOCK=block,
                        FLAGS=flags, enable_fp_fusion=False)


def _publish_initialized(rows: Sequence[Row], flags: torch.Tensor, unknown: list[int]) -> None:
    # The rows' ``initialized`` flags to the host without waiting for the device: a non-blocking
    # copy into pinned memory and an event on a GPU (on a CPU the flags are already there).
    # Each state reads its own once the event has completed (ScalingState.initialized_known):
    # a delayed cast then skips the amax pass that only a first cast needs.
    if flags.device.type == "cuda":
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = flags, None
    for index in unknown:
        _, role, state = rows[index]
        state.expect_initialized(role, host, index, event)
