"""``fp8_plugin.autocast``: the context inside which FP8 layers run their GEMMs in FP8.

Modelled on Transformer Engine's ``te.autocast`` (formerly ``fp8_autocast``). Outside the
context, FP8 layers compute exactly as the layers they replaced. Delayed-scaling amaxes recorded
during a step (forward and backward) are turned into new scales when the next outermost enabled
context is entered: one batched update, and one amax reduction, per step.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from .device import resolve_recipe
from .quantizers import ScalingState, update_delayed_scaling
from .recipes import DelayedScaling, Recipe, check_recipe

__all__ = ["autocast", "is_fp8_enabled", "get_fp8_recipe", "update_pending_scales", "AmaxReducer"]

AmaxReducer = Callable[[torch.Tensor], None]


@dataclass
class _FP8Context:
    enabled: bool = False
    recipe: Optional[Recipe] = None
    reduce_amax: Optional[AmaxReducer] = None


class _Local(threading.local):
    def __init__(self) -> None:
        self.context = _FP8Context()


_local = _Local()

# Amaxes recorded since the last scale update: {(recipe, role): {id(state): state}}, in
# insertion order so that every rank reduces them in the same order.
_pending: dict[tuple[DelayedScaling, int], dict[int, ScalingState]] = {}
_pending_lock = threading.Lock()


def mark_pending(state: ScalingState, role: int, recipe: Recipe) -> None:
    """Remember that ``state`` recorded an amax for ``role`` under ``recipe`` this step."""
    with _pending_lock:
        _pending.setdefault((recipe, role), {})[id(state)] = state
        state.pending_roles.add(role)


def set_pending(state: ScalingState, roles: set[int], recipe: Recipe) -> None:
    """Make ``roles`` the pending roles of ``state`` (after loading it), and no others."""
    with _pending_lock:
        for states in _pending.values():
            states.pop(id(state), None)
        state.pending_roles = set()
    for role in sorted(roles):
        mark_pending(state, role, recipe)


def update_pending_scales(reduce_amax: Optional[AmaxReducer] = None) -> None:
    """Turn every amax recorded since the last update into new scales, now.

    Called on entry to the outermost enabled :func:`autocast`; call it yourself only to apply a
    step's amaxes before the next forward (for example before saving a checkpoint).

    Args:
        reduce_amax: in-place reduction (MAX across ranks) of a flat float32 tensor holding all
            current-step amaxes; ``None`` skips the reduction. Recipes with
            ``reduce_amax=False`` are never reduced.
    """
    with _pending_lock:
        groups = [(recipe, role, list(states.values())) for (recipe, role), states in _pending.items()]
        _pending.clear()
        for _, role, states in groups:
            for state in states:
                state.pending_roles.discard(role)
    reduced = [g for g in groups if g[0].reduce_amax]
    local = [g for g in groups if not g[0].reduce_amax]
    update_delayed_scaling(reduced, reduce_amax)
    update_delayed_scaling(local, None)


def is_fp8_enabled() -> bool:
    """True inside an enabled :func:`autocast` on this thread."""
    return _local.context.enabled


def get_fp8_recipe() -> Optional[Recipe]:
    """Recipe of the innermost enabled :func:`autocast`, or None (layers use their own)."""
    return _local.context.recipe


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    *,
    reduce_amax: Optional[AmaxReducer] = None,
) -> Iterator[None]:
    """Run FP8 layers in FP8 inside this context (like ``transformer_engine.pytorch.autocast``).

    Args:
        enabled: False runs every FP8 layer in high precision, exactly as ``nn.Linear``.
        recipe: overrides each layer's own recipe for the duration of the context; None keeps
            the layers' recipes (the one given to ``convert_model``); an ``AutoRecipe`` is
            resolved for the current CUDA device, or the CPU.
        reduce_amax: in-place reduction over a flat float32 amax tensor, applied once per step
            before delayed-scaling updates (the distributed integration passes an all-reduce).

    Raises:
        TypeError: ``recipe`` is not a :class:`~fp8_plugin.recipes.Recipe`.

    Backward passes need not be inside the context: each layer keeps what it needs from its
    forward. Contexts nest; the innermost one decides.
    """
    check_recipe(recipe, "autocast")
    recipe = resolve_recipe(recipe)
    outer = _local.context
    if enabled and not outer.enabled:
        update_pending_scales(reduce_amax)
    _local.context = _FP8Context(
        enabled=enabled,
        recipe=recipe if recipe is not None else (outer.recipe if enabled else None),
        reduce_amax=reduce_amax if reduce_amax is not None else outer.reduce_amax,
    )
    try:
        yield
    finally:
        _local.context = outer
