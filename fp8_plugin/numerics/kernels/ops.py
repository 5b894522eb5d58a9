"""The fused casts as torch custom ops (``torch.ops.fp8_plugin.*``), for whatever traces them.

``torch.compile``, ``FakeTensorMode``, a ``TorchDispatchMode`` (the CUDA contract suite's recorder,
the cost model's op counter) and ``meta`` tensors see each fused cast as one op with a fake
implementation (shapes and dtypes only), not as the Triton launches inside it. The per-tensor and
block casts declare the state they mutate; the experts' casts and the scale update write their
states through an address table no schema can name, and never run inside a compiled graph.
Plain eager calls skip the dispatcher: a Python custom op costs about 22 µs of CPU time per call
against 1.4 µs for a direct call (measured on this project's CI machine, torch 2.13); see
:func:`cast_delayed`, :func:`cast_current`, :func:`cast_blocks` and :func:`cast_groups`, the entry
points the quantizers and the experts call.

Triton is imported only when a kernel runs, not when the ops are registered (fake tensors need
no Triton).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._private.torch_api import in_dispatch_mode
from .launch import capturing, recording_launches

__all__ = ["cast_delayed", "cast_current", "cast_blocks", "cast_groups", "eager_cast", "eager_cast_plan",
           "skips_amax_pass", "traced", "dispatched", "OP_LAUNCHES", "OP_INPUT_READS",
           "op_input_reads"]

# Kernel launches per call of each op (zero fills included), for the cost model and the
# launch-count tests, which check them against what each eager entry point launches.
OP_LAUNCHES = {"cast_delayed": 2, "cast_current": 2, "cast_blocks": 1, "cast_groups": 3, "scale_update_gather": 1,
               "scale_update": 1}
# Reads of the whole input per call: delayed scaling's steady state reads it once (its first cast
# twice, once per training run), current scaling twice (amax, then the cast).
OP_INPUT_READS = {"cast_delayed": 1, "cast_current": 2, "cast_blocks": 1, "cast_groups": 1}


def op_input_reads(name: str, arguments: dict) -> int:
    """Reads of the whole input by one call of the fused op ``name`` (``"cast_delayed"``, ...)
    given its arguments by name: :data:`OP_INPUT_READS`, except the experts' ``cast_groups``,
    which reads its input once with delayed scales (``delayed``), twice without (an amax pass)."""
    if name == "cast_groups":
        return 1 if arguments.get("delayed") else 2
    return OP_INPUT_READS.get(name, 1)


def _outputs(x: torch.Tensor, dtype: torch.dtype, transpose: bool, bias_grad: bool) -> tuple[torch.Tensor, ...]:
    m, n = x.shape
    data_t = x.new_empty((n, m) if transpose else (0,), dtype=dtype)
    scalar = x.new_empty((), dtype=torch.float32)
    bias = x.new_empty((n,) if bias_grad else (0,), dtype=torch.float32)
    return x.new_empty((m, n), dtype=dtype), data_t, scalar, x.new_empty((), dtype=torch.float32), bias


def _tensorwise(kind: str, x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool, record: bool,
                bias_grad: bool, **state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # tensorwise.cast_transpose_<kind> with the op's outputs: every one a tensor (empty where
    # not asked for), the bias gradient last.
    from . import tensorwise

    bias = torch.empty(x.shape[1] if bias_grad else 0, dtype=torch.float32, device=x.device)
    data, data_t, s, s_inv = getattr(tensorwise, f"cast_transpose_{kind}")(
        x, dtype, margin, transpose=transpose, record=record, bias_grad_out=bias if bias_grad else None, **state)
    return data, (data_t if transpose else x.new_empty((0,), dtype=dtype)), s, s_inv, bias


def _cast_delayed_eager(x: torch.Tensor, scale: torch.Tensor, initialized: torch.Tensor, amax_history: torch.Tensor,
                        nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, role: int, dtype: torch.dtype,
                        margin: int, transpose: bool, record: bool, bias_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tensorwise("delayed", x, dtype, margin, transpose, record, bias_grad, scale=scale, initialized=initialized,
                       amax_history=amax_history, nonfinite_amax_count=nonfinite_amax_count, workspace=workspace,
                       role=role)


_cast_delayed_op = torch.library.custom_op("fp8_plugin::cast_delayed", _cast_delayed_eager,
                                           mutates_args=("amax_history", "nonfinite_amax_count", "workspace"))


@_cast_delayed_op.register_fake
def _(x, scale, initialized, amax_history, nonfinite_amax_count, workspace, role, dtype, margin, transpose, record,
      bias_grad):
    return _outputs(x, dtype, transpose, bias_grad)


def _cast_current_eager(x: torch.Tensor, scale: torch.Tensor, amax_history: torch.Tensor,
                        nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, role: int, dtype: torch.dtype,
                        margin: int, transpose: bool, record: bool, bias_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tensorwise("current", x, dtype, margin, transpose, record, bias_grad, scale=scale,
                       amax_history=amax_history, nonfinite_amax_count=nonfinite_amax_count, workspace=workspace,
                       role=role)


_cast_current_op = torch.library.custom_op("fp8_plugin::cast_current", _cast_current_eager,
                                           mutates_args=("scale", "amax_history", "nonfinite_amax_count", "workspace"))


@_cast_current_op.register_fake
def _(x, scale, amax_history, nonfinite_amax_count, workspace, role, dtype, margin, transpose, record, bias_grad):
    return _outputs(x, dtype, transpose, bias_grad)


def _cast_blocks_eager(x: torch.Tensor, scale: torch.Tensor, amax_history: torch.Tensor,
                       nonfinite_amax_count: torch.Tensor, workspace: torch.Tensor, role: int, dtype: torch.dtype,
                       block_rows: int, block_cols: int, mx: bool, power_2_scale: bool, amax_epsilon: float,
                       transpose: bool, record: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import blockwise

    outputs = blockwise.cast_blocks(
        x, dtype, (block_rows, block_cols), mx=mx, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
        transpose=transpose, record=record, scale=scale, amax_history=amax_history,
        nonfinite_amax_count=nonfinite_amax_count, workspace=workspace, role=role)
    return _absent_as_empty(x, outputs, dtype)


def _absent_as_empty(x: torch.Tensor, outputs: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # A custom op returns tensors only: an output not asked for is an empty tensor.
    kinds = (dtype, torch.float32, dtype, torch.float32, torch.float8_e8m0fnu, torch.float8_e8m0fnu)
    return tuple(t if t is not None else x.new_empty((0,), dtype=kind) for t, kind in zip(outputs, kinds))


_cast_blocks_op = torch.library.custom_op("fp8_plugin::cast_blocks", _cast_blocks_eager,
                                          mutates_args=("amax_history", "nonfinite_amax_count", "workspace", "scale"))


@_cast_blocks_op.register_fake
def _(x, scale, amax_history, nonfinite_amax_count, workspace, role, dtype, block_rows, block_cols, mx, power_2_scale,
      amax_epsilon, transpose, record):
    from .blockwise import grid_tensors

    m, n = x.shape
    scale_inv, scale_inv_t = grid_tensors(m, n, (block_rows, block_cols), transpose, x.device)
    gemm = gemm_t = None
    if mx:
        gemm = x.new_empty((512 * -(-m // 128) * -(-n // 128),), dtype=torch.float8_e8m0fnu)
        gemm_t = torch.empty_like(gemm) if transpose else None
    data_t = x.new_empty((n, m), dtype=dtype) if transpose else None
    return _absent_as_empty(x, (x.new_empty((m, n), dtype=dtype), scale_inv, data_t, scale_inv_t, gemm, gemm_t), dtype)


def _cast_groups_eager(x: torch.Tensor, group_of_row: Optional[torch.Tensor], table: torch.Tensor, experts: int,
                       dtype: torch.dtype, margin: int, delayed: bool, record: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    from . import grouped

    return grouped.cast_groups(x, group_of_row, table, experts, dtype, margin, delayed=delayed, record=record)


# Writes the experts' states through the addresses in ``table`` (as the scale update does); its
# outputs are always used, so nothing that traces it drops it. Not run inside compiled graphs.
_cast_groups_op = torch.library.custom_op("fp8_plugin::cast_groups", _cast_groups_eager, mutates_args=())


@_cast_groups_op.register_fake
def _(x, group_of_row, table, experts, dtype, margin, delayed, record):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((experts,), dtype=torch.float32)


def _scale_update_gather_eager(table: torch.Tensor, current: torch.Tensor) -> None:
    from . import scale_update

    scale_update._gather(table, current)


def _scale_update_eager(table: torch.Tensor, params: torch.Tensor, current: torch.Tensor, from_current: bool,
                        block: int) -> None:
    from . import scale_update

    scale_update._update(table, params, current, from_current, block)


# The scale update writes the states through the addresses in ``table``, which no schema can
# name; both ops declare ``current`` mutated so that nothing that traces them drops them as
# unused (they never run inside a compiled graph: the update happens between steps).
torch.library.custom_op("fp8_plugin::scale_update_gather", _scale_update_gather_eager, mutates_args=("current",))
torch.library.custom_op("fp8_plugin::scale_update", _scale_update_eager, mutates_args=("current",))
torch.library.register_fake("fp8_plugin::scale_update_gather", lambda table, current: None)
torch.library.register_fake("fp8_plugin::scale_update", lambda table, params, current, from_current, block: None)


def traced(x: torch.Tensor) -> bool:
    """Whether something other than a plain eager launch will see a cast of ``x`` (compiling, a
    dispatch mode, meta tensors): it then goes through the dispatcher as a custom op."""
    return torch.compiler.is_compiling() or dispatched(x)


def dispatched(x: torch.Tensor) -> bool:
    """:func:`traced` for code known not to be compiling: a dispatch mode, or meta tensors."""
    # Meta tensors too, except while launches are only recorded (the host profile measures
    # the eager path of a GPU on them).
    return in_dispatch_mode() or (x.is_meta and not recording_launches())  # is_meta: no device object made


def cast_delayed(x: torch.Tensor, state, role: int, dtype: torch.dtype, margin: int, *, transpose: bool,
                 record: bool, bias_grad: bool = False) -> tuple[Optional[torch.Tensor], ...]:
    """Delayed scaling's fused cast of ``x`` ``[M, N]`` for ``role`` of ``state`` (a
    :class:`~fp8_plugin.numerics.quantizers.ScalingState`): see
    :func:`~fp8_plugin.numerics.kernels.tensorwise.cast_transpose_delayed` (arguments, bytes,
    results, errors); ``(data, data_t or None, scale_inv, bias_grad or None)``, the last
    ``x.sum(0)`` in float32 where ``bias_grad`` (the scale itself is not returned: nothing reads
    it, and an eager cast then makes one tensor fewer)."""
    if not traced(x):
        return eager_cast("delayed", x, state, role, dtype, margin, transpose, record, bias_grad)
    args = (x, state.scale, state.initialized, state.amax_history, state.nonfinite_amax_count,
            state.kernel_workspace, role, dtype, margin, transpose, record, bias_grad)
    data, data_t, _, scale_inv, bias = torch.ops.fp8_plugin.cast_delayed(*args)
    return data, (data_t if transpose else None), scale_inv, (bias if bias_grad else None)


def cast_current(x: torch.Tensor, state, role: int, dtype: torch.dtype, margin: int, *, transpose: bool,
                 record: bool, bias_grad: bool = False) -> tuple[Optional[torch.Tensor], ...]:
    """Current scaling's fused cast of ``x`` ``[M, N]`` for ``role`` of ``state``: see
    :func:`~fp8_plugin.numerics.kernels.tensorwise.cast_transpose_current`; as
    :func:`cast_delayed`."""
    if not traced(x):
        return eager_cast("current", x, state, role, dtype, margin, transpose, record, bias_grad)
    args = (x, state.scale, state.amax_history, state.nonfinite_amax_count, state.kernel_workspace, role, dtype,
            margin, transpose, record, bias_grad)
    data, data_t, _, scale_inv, bias = torch.ops.fp8_plugin.cast_current(*args)
    return data, (data_t if transpose else None), scale_inv, (bias if bias_grad else None)


def eager_cast(kind: str, x: torch.Tensor, state, role: int, dtype: torch.dtype, margin: int, transpose: bool,
               record: bool, bias_grad: bool) -> tuple[Optional[torch.Tensor], ...]:
    """A per-tensor cast as a plain eager call (where :func:`traced` is false): ``kind``
    ``"delayed"`` or ``"current"``, the rest as :func:`cast_delayed`. The cast's plan for this
    state row and input layout (:class:`~fp8_plugin.numerics.kernels.tensorwise.RecordingCast`) is
    made on the first call and kept while the state's tensors are the same; later calls make the
    outputs and launch, nothing else. Returns ``(data, data_t or None, scale_inv, bias_grad or None)``."""
    plan = eager_cast_plan(kind, x, state, role, dtype, margin, transpose, record, bias_grad)
    data, data_t, _, scale_inv, bias = plan(x, skips_amax_pass(kind, state, role))
    return data, data_t, scale_inv, bias


def eager_cast_plan(kind: str, x: torch.Tensor, state, role: int, dtype: torch.dtype, margin: int, transpose: bool,
                    record: bool, bias_grad: bool):
    """The :class:`~fp8_plugin.numerics.kernels.tensorwise.RecordingCast` that :func:`eager_cast`
    runs for these arguments: made on the first call and kept by ``state`` while its tensors are
    the same (arguments as :func:`eager_cast`). Call it as ``plan(x, skips_amax_pass(kind, state,
    role))``."""
    from . import tensorwise

    rows = state.kernel_rows(role)
    key = (kind, role, x.shape, x.stride(), x.dtype, dtype, margin, transpose, record, bias_grad)
    return _kept_plan(state, rows, key, lambda: tensorwise.RecordingCast(kind, x, dtype, margin, transpose, record,
                                                                         bias_grad, rows))


def skips_amax_pass(kind: str, state, role: int) -> bool:
    """Whether a delayed cast of ``role`` of ``state`` may skip its amax pass now: the host knows
    the state holds a scale. Not inside a CUDA graph, whose replay must be right whatever the
    state holds then; never for current scaling, whose scale is its amax."""
    return kind == "delayed" and not capturing() and state.initialized_known(role)


def _kept_plan(state, rows, key: tuple, make):
    # The cast plan ``state`` keeps under ``key``: made by ``make()`` on the first call, and again
    # once the state's row views are new (a load, a move, a reset).
    plans = state.__dict__.setdefault("_cast_plans", {})  # a state unpickled from before the plans
    plan = plans.get(key)
    if plan is None or plan.rows is not rows:
        plan = make()
        if len(plans) >= _PLANS_PER_STATE:  # shapes that keep changing: keep the newest few
            plans.clear()
        plans[key] = plan
    return plan


# Launch plans kept per scaling state: a layer sees a few input layouts (training, evaluation,
# the last short batch of an epoch).
_PLANS_PER_STATE = 16


def cast_blocks(x: torch.Tensor, state, role: int, dtype: torch.dtype, block: tuple[int, int], *, mx: bool,
                power_2_scale: bool, amax_epsilon: float, transpose: bool, record: bool) -> tuple[Optional[torch.Tensor], ...]:
    """The block-scaled fused cast of ``x`` ``[M, N]`` for ``role`` of ``state``: see
    :func:`~fp8_plugin.numerics.kernels.blockwise.cast_blocks`; ``(data, scale_inv, data_t,
    scale_inv_t, gemm_scale, gemm_scale_t)``, None for what was not made."""
    if not traced(x):  # a plain eager call: the cast's plan for this row and input layout
        return eager_block_plan(x, state, role, dtype, block, mx=mx, power_2_scale=power_2_scale,
                                amax_epsilon=amax_epsilon, transpose=transpose, record=record)(x)
    args = (x, state.scale, state.amax_history, state.nonfinite_amax_count, state.kernel_workspace, role, dtype,
            block[0], block[1], mx, power_2_scale, float(amax_epsilon), transpose, record)
    outputs = torch.ops.fp8_plugin.cast_blocks(*args)
    made = (True, True, transpose, transpose, mx, mx and transpose)
    return tuple(t if keep else None for t, keep in zip(outputs, made))


def eager_block_plan(x: torch.Tensor, state, role: int, dtype: torch.dtype, block: tuple[int, int], *, mx: bool,
                     power_2_scale: bool, amax_epsilon: float, transpose: bool, record: bool):
    """The :class:`~fp8_plugin.numerics.kernels.blockwise.BlockCast` that :func:`cast_blocks` runs
    for these arguments in plain eager code: made on the first call and kept by ``state`` while
    its tensors are the same, as :func:`eager_cast_plan` keeps a per-tensor cast's. Call it as
    ``plan(x)``."""
    from . import blockwise

    rows = state.kernel_rows(role)
    key = ("blocks", role, x.shape, x.stride(), x.dtype, dtype, block, mx, power_2_scale, amax_epsilon,
           transpose, record)
    return _kept_plan(state, rows, key, lambda: blockwise.BlockCast(
        x, dtype, block, mx, power_2_scale, amax_epsilon, transpose, record, rows))


def cast_groups(x: torch.Tensor, group_of_row: Optional[torch.Tensor], states: list, role: int, recipe,
                dtype: torch.dtype, *, record: bool, tables: Optional[dict] = None, own_scale: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' fused per-expert cast of token rows ``[S, K]`` (with ``group_of_row``) or a
    weight stack ``[E, N, K]``: see :func:`~fp8_plugin.numerics.kernels.grouped.cast_groups`;
    ``own_scale`` casts and records as current scaling does whatever the recipe (the experts'
    token rows under ``token_scaling="current"``);
    ``states`` are the E experts' :class:`ScalingState`, ``tables`` the caller's cache of their
    address table (:func:`~fp8_plugin.numerics.kernels.scale_update.bulk_update`'s). Returns
    ``(data, scale_inv [E])``."""
    from . import scale_update

    table = scale_update.table_for([(recipe, role, state) for state in states], x.device, tables)[0]
    args = (x, group_of_row, table, len(states), dtype, recipe.margin, recipe.delayed() and not own_scale, record)
    return torch.ops.fp8_plugin.cast_groups(*args) if traced(x) else _cast_groups_eager(*args)
