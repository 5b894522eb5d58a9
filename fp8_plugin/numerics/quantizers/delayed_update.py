"""Delayed scaling's update: every pending amax of a model's layers becomes a scale, in a fixed
number of batched kernels (one launch where the fused kernels run), after one amax reduction."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable, Optional

import torch

from ..device_kind import fp8_family
from ..formats import fp8_dtype, fp8_max
from ..kernels import fused_casts
from ..recipes import DelayedScaling
from ..scaling import divide, scale_from_amax
from .state import ScalingState
from .tensor import GRAD_OUTPUT

__all__ = ["update_delayed_scaling"]

def update_delayed_scaling(
    groups: Iterable[tuple[DelayedScaling, int, list[ScalingState]]],
    reduce_amax: Optional[Callable[[torch.Tensor], None]] = None,
    tables: Optional[dict] = None,
) -> None:
    """Update the scales of every pending (recipe, role, states) group and roll their histories.

    All current-step amaxes are first gathered into one flat float32 tensor, so that one call to
    ``reduce_amax`` (an in-place MAX all-reduce in distributed runs) covers the whole step. Then,
    per group: ``amax = recipe.reduce_history(history)``, ``scale = (FP8_MAX / amax) /
    2 ** margin`` (kept where amax is 0 or not finite), and the history shifts by one step with
    a zeroed current slot. Each group costs a fixed number of batched kernels, not one per layer.
    Before the scale is computed, a current-step amax beyond ``recipe.amax_outlier_factor``
    times the amax the previous scale came from is counted and kept, clipped or skipped, as
    ``recipe.amax_outlier_policy`` says: after the reduction, so every rank decides alike.

    Where the fused kernels run (:func:`~fp8_plugin.numerics.kernels.fused_casts`), every row of
    every group is updated by :func:`~fp8_plugin.numerics.kernels.scale_update.bulk_update` in
    at most two launches plus the reduction, with the same numerics; ``tables`` (a dict the
    caller keeps, one per model) caches its device tables between steps. A callable
    ``amax_compute_algo`` keeps the torch ops.
    """
    groups = [g for g in groups if g[2]]
    if not groups:
        return
    with torch.no_grad():
        if fused_casts(groups[0][2][0].device)[0]:
            scale_update = _scale_update()
            if all(scale_update.supported(recipe) for recipe, _, _ in groups):
                rows = [(recipe, role, state) for recipe, role, states in groups for state in states]
                scale_update.bulk_update(rows, reduce_amax, tables)
                return
        histories = [torch.stack([s.amax_history[role] for s in states]) for _, role, states in groups]
        if reduce_amax is not None:
            current = torch.cat([h[:, 0] for h in histories])
            reduce_amax(current)
            for h, part in zip(histories, current.split([h.shape[0] for h in histories])):
                h[:, 0] = part
        for (recipe, role, states), history in zip(groups, histories):
            dtype = fp8_dtype(recipe.fp8_format, backward=role == GRAD_OUTPUT, family=fp8_family(states[0].device))
            previous = torch.stack([s.scale[role] for s in states])
            _handle_outliers(recipe, role, states, history, previous, fp8_max(dtype))
            amax = recipe.reduce_history(history)
            scale = scale_from_amax(amax, fp8_max(dtype), recipe.margin, previous)
            initialized = torch.stack([s.initialized[role] for s in states]) | (
                (amax > 0) & torch.isfinite(amax)
            )
            history = history.roll(1, dims=1)
            history[:, 0] = 0.0
            torch._foreach_copy_([s.amax_history[role] for s in states], list(history.unbind(0)))
            torch._foreach_copy_([s.scale[role] for s in states], list(scale.unbind(0)))
            torch._foreach_copy_([s.initialized[role] for s in states], list(initialized.unbind(0)))


@lru_cache(maxsize=None)
def _scale_update():
    # kernels.scale_update, imported at its first use (it imports Triton), then kept: an import
    # statement per update costs about a microsecond of CPU. Importing kernels.ops registers the
    # update's custom ops, which traced code calls.
    from ..kernels import ops, scale_update  # noqa: F401

    return scale_update


def _handle_outliers(recipe: DelayedScaling, role: int, states: list[ScalingState], history: torch.Tensor,
                     previous: torch.Tensor, max_value: float) -> None:
    # The amax the previous scale was computed from, recovered from the scale itself: the
    # history may be a single (already rolled) column, and the scale is what casts use.
    bound = divide(max_value, previous) / (2.0**recipe.margin)
    current = history[:, 0]
    initialized = torch.stack([s.initialized[role] for s in states])
    factor = float(recipe.amax_outlier_factor)
    outlier = initialized & torch.isfinite(current) & (current > factor * bound)
    ratio = current / bound
    if recipe.amax_outlier_policy == "clip":
        history[:, 0] = torch.where(outlier, factor * bound, current)
    elif recipe.amax_outlier_policy == "skip":
        history[:, 0] = torch.where(outlier, torch.zeros_like(current), current)
    counts = torch.stack([s.outlier_count[role] for s in states]) + outlier.to(torch.int64)
    ratios = torch.where(outlier, ratio, torch.stack([s.outlier_ratio[role] for s in states]))
    torch._foreach_copy_([s.outlier_count[role] for s in states], list(counts.unbind(0)))
    torch._foreach_copy_([s.outlier_ratio[role] for s in states], list(ratios.unbind(0)))
