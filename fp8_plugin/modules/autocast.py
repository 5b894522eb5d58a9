"""``fp8_plugin.autocast``: the context inside which FP8 layers run their GEMMs in FP8.

Modelled on Transformer Engine's ``te.autocast`` (formerly ``fp8_autocast``). Outside the
context, FP8 layers compute exactly as the layers they replaced. An outermost enabled context
entered with grad enabled is a training step: its forwards record amaxes, and the first FP8
forward in it turns the previous step's amaxes into scales (one batched update and one amax
reduction per step, see :mod:`fp8_plugin.modules.scaling_group`). A context entered without grad
(evaluation, prediction) runs FP8 with the current scales and changes no state: as in
Transformer Engine, evaluation never moves training numerics and never issues a collective.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..numerics.device import resolve_recipe
from ..numerics.recipes import Recipe, check_recipe
from .scaling_group import AmaxReducer, update_pending_scales
from .shared_input import drop_kept_cast

__all__ = ["autocast", "replay", "is_fp8_enabled", "get_fp8_recipe", "new_step_id", "update_pending_scales",
           "AmaxReducer"]


@dataclass(frozen=True)
class _FP8Context:
    enabled: bool = False
    recipe: Optional[Recipe] = None
    reduce_amax: Optional[AmaxReducer] = None
    # Unique id of the training step (outermost enabled entry with grad on); None outside one.
    step: Optional[int] = None
    # Inside a training step (step is not None): what compiled code reads, never the id itself.
    training: bool = False
    # The dtype an FP8 layer's GEMMs run in where they run in high precision (a reference replay;
    # in training, a layer or GEMM moved to high precision), outside torch autocast; None: as
    # nn.Linear computes (the torch autocast dtype). Training and the reference checks' replays
    # set the same one, so that a move's replay computes what training will.
    high_precision_dtype: Optional[torch.dtype] = None
    # Made by replay(): a reference check's replay, whose FP8 switch the loops' own forward
    # contexts leave alone.
    replaying: bool = False


class _Local(threading.local):
    def __init__(self) -> None:
        self.context = _FP8Context()
        self.fp8_forwards = 0  # FP8 forwards run on this thread, to spot an autocast that ran none


_local = _Local()
_step_ids = itertools.count()  # unique across threads: a model moved between threads still updates


# Set by FP8 forwards in compiled code. torch.compile replays a compiled region's writes to plain
# objects such as this dict, but not to a threading.local; and it writes a constant, because a
# value read in compiled code (a count) would be guarded on and recompile the graph every step.
_compiled_forwards: dict[str, bool] = {}
# The step id of training contexts entered in compiled code: a fresh id per step would be a new
# constant of the graph every step. Compiled FP8 forwards never compare step ids.
COMPILED_STEP = -1


def note_fp8_forward(compiling: Optional[bool] = None) -> None:
    """Note an FP8 forward (called by FP8 layers): counted on this thread, or flagged in compiled
    code. ``compiling``: ``torch.compiler.is_compiling()``, where the caller has asked (None: asked here)."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        _compiled_forwards["ran"] = True
    else:
        _local.fp8_forwards += 1


def fp8_forward_count() -> int:
    """FP8 forwards run on this thread so far (eager ones; compiled code is not counted): the
    reference checks compare it before and after each replay."""
    return _local.fp8_forwards


_warned_no_fp8 = False


def _warn_no_fp8_layer() -> None:
    global _warned_no_fp8
    if not _warned_no_fp8:
        _warned_no_fp8 = True
        warnings.warn(
            "fp8_plugin.autocast() was entered for a training step in which no FP8 layer ran: the model runs in "
            "high precision. Convert it first (fp8_plugin.convert_model(model); its report says which layers "
            "were swapped and why the others were not)",
            stacklevel=3,
        )


def new_step_id() -> int:
    """A fresh training-step id for :func:`autocast`'s ``step`` (unique in the process)."""
    return next(_step_ids)


def is_fp8_enabled() -> bool:
    """True inside an enabled :func:`autocast` on this thread."""
    return _local.context.enabled


def get_fp8_recipe() -> Optional[Recipe]:
    """Recipe of the innermost enabled :func:`autocast`, or None (layers use their own)."""
    return _local.context.recipe


def current_context() -> _FP8Context:
    """The innermost context on this thread (enabled, recipe, reducer, training step id)."""
    return _local.context


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    *,
    reduce_amax: Optional[AmaxReducer] = None,
    step: Optional[int] = None,
    high_precision_dtype: Optional[torch.dtype] = None,
) -> Iterator[None]:
    """Run FP8 layers in FP8 inside this context (like ``transformer_engine.pytorch.autocast``).

    Args:
        enabled: False runs every FP8 layer in high precision, exactly as ``nn.Linear``.
        recipe: overrides each layer's own recipe for the duration of the context; None keeps
            the layers' recipes (the one given to ``convert_model``); an ``AutoRecipe`` is
            resolved for the current CUDA device, or the CPU.
        reduce_amax: in-place reduction over a flat float32 amax tensor, applied once per step
            before delayed-scaling updates (the distributed integration passes an all-reduce).
        step: id of the training step (from :func:`new_step_id`) when several outermost
            contexts belong to one optimizer step, as the micro-batches of gradient
            accumulation do: they then share one scale update and one amax reduction, and
            their amaxes combine (max). None: each outermost entry with grad is a step of its own.
        high_precision_dtype: the dtype FP8 layers run the GEMMs they run in high precision in
            (``use_fp8 = False``, ``fp8_gemms``, the recipe's ``override_linear_precision``),
            outside torch autocast, their outputs in the autocast dtype; None (default, or the
            enclosing context's): as ``nn.Linear`` (the torch autocast dtype). The training loops
            set float32 on CPUs whose BF16 matmuls are slow, as the reference checks compute
            there (:func:`fp8_plugin.training.reference.reference_gemm_dtype`).

    Raises:
        TypeError: ``recipe`` is not a :class:`~fp8_plugin.numerics.recipes.Recipe`, or ``enabled`` not a bool.

    Warns:
        UserWarning: (once per process) an outermost context entered with grad enabled in which
            no FP8 layer ran, such as one around a model that was never converted.

    Enter it with grad enabled for training steps and under ``torch.no_grad()`` /
    ``torch.inference_mode()`` for evaluation. Backward passes need not be inside the context:
    each layer keeps what it needs from its forward, and activation-checkpoint recomputations
    (``torch.utils.checkpoint``, reentrant or not) rerun under the forward's context. Contexts
    nest; the innermost one decides.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled={enabled!r}) is invalid; valid: True, False")
    check_recipe(recipe, "autocast")
    recipe = resolve_recipe(recipe)
    outer = _local.context
    compiling = torch.compiler.is_compiling()
    # An outermost training context that runs no FP8 layer is a mistake (an unconverted model).
    watch = enabled and not outer.enabled and torch.is_grad_enabled() and not compiling
    forwards = _local.fp8_forwards
    if watch:
        _compiled_forwards.pop("ran", None)
    if enabled and not outer.enabled:
        if not torch.is_grad_enabled():
            step = None
        elif compiling:
            step = COMPILED_STEP
        elif step is None:
            step = next(_step_ids)
    else:
        step = outer.step
    _local.context = _FP8Context(
        enabled=enabled,
        recipe=recipe if recipe is not None else (outer.recipe if enabled else None),
        reduce_amax=reduce_amax if reduce_amax is not None else outer.reduce_amax,
        step=step,
        training=step is not None,
        high_precision_dtype=(high_precision_dtype or outer.high_precision_dtype) if enabled else None,
    )
    try:
        yield
    finally:
        _local.context = outer
        drop_kept_cast()  # no FP8 copy of an input outlives its forward
    if watch and _local.fp8_forwards == forwards and not _compiled_forwards.pop("ran", False):
        _warn_no_fp8_layer()


def in_replay() -> bool:
    """Whether this thread runs inside :func:`replay` (a reference check's replay)."""
    return _local.context.replaying


@contextlib.contextmanager
def replay(fp8: bool, recipe: Optional[Recipe] = None, *, reference_dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Rerun a training forward and backward without changing any FP8 state (reference checks).

    Inside, FP8 layers run in FP8 (``fp8=True``, with each layer's recipe or ``recipe``) or in
    high precision (``fp8=False``), with grad enabled or not, but as evaluation forwards do:
    with the current scales, recording no amax and updating no scale, whatever the grad mode.
    Replaying a micro-batch before the optimizer step therefore repeats its FP8 numerics exactly
    and leaves the step's pending amaxes alone.

    ``reference_dtype``: the dtype the FP8 layers compute their high-precision GEMMs in, outside
    torch autocast, returning their output in the autocast dtype, so that every other op runs as
    in training (float32 where BF16 matmuls are slow: CPUs without AVX512-BF16 or AMX): every GEMM
    with ``fp8=False`` (the reference), the GEMMs moved to high precision with ``fp8=True`` (as
    training runs them, :func:`autocast`'s ``high_precision_dtype``).
    """
    check_recipe(recipe, "replay")
    outer = _local.context
    _local.context = _FP8Context(enabled=fp8, recipe=resolve_recipe(recipe) if fp8 else None,
                                 high_precision_dtype=reference_dtype, replaying=True)
    drop_kept_cast()  # the replay casts with its own scales, recording nothing: take no training cast
    try:
        yield
    finally:
        _local.context = outer
        drop_kept_cast()
