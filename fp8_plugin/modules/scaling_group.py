"""Delayed-scaling updates: the FP8 layers of one model turn their amaxes into scales together.

Amaxes recorded during a training step (forward and backward) wait in each layer's
:class:`~fp8_plugin.numerics.quantizers.ScalingState` (``pending``). The first FP8 forward of the next
training step updates every pending layer of its :class:`ScalingGroup` at once: one flat tensor
of amaxes, one amax reduction across ranks, a fixed number of batched kernels per (recipe, role).
The group belongs to the model (``convert_model`` makes one per call), not to the process: a
dropped model is freed with it, and two models or two threads never share an update.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .._private.torch_api import registered_submodule
from ..numerics.quantizers import ScalingState, update_delayed_scaling
from ..numerics.recipes import DelayedScaling, Recipe, kept_per_recipe

__all__ = ["ScalingGroup", "AmaxReducer", "update_pending_scales", "scaling_groups"]

AmaxReducer = Callable[[torch.Tensor], None]


class ScalingGroup:
    """FP8 layers whose pending delayed-scaling amaxes become scales in one update.

    Attributes:
        layers: the FP8 layers, in conversion order (the order every rank reduces them in).
        step: id of the :func:`fp8_plugin.autocast` training step in which the group last
            updated; a forward in another step updates first.
    """

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []
        self.step: Optional[int] = None
        # The fused scale update's device tables of this group's states (update_delayed_scaling).
        self._tables: dict = {}
        # Recipes by identity -> (the recipe, the first equal recipe seen: its update group).
        self._recipe_groups: dict[int, tuple[Recipe, Recipe]] = {}
        # The last update's pending layers and their grouping (update's steady state), or None.
        self._last_update: Optional[tuple[list, list]] = None

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) starts without the device tables and recipe groups: both are
        # keyed by the identities of this process's objects, and the tables hold their addresses.
        return {**self.__dict__, "_tables": {}, "_recipe_groups": {}, "_last_update": None}

    def add(self, layer: nn.Module) -> None:
        """Make ``layer`` (it has ``fp8_state`` and ``recipe``) a member; it leaves its old group."""
        old = getattr(layer, "scaling_group", None)
        if old is self:
            return
        if old is not None:
            old.layers = [m for m in old.layers if m is not layer]
        self.layers.append(layer)
        layer.scaling_group = self

    def update(self, reduce_amax: Optional[AmaxReducer] = None, recipe: Optional[Recipe] = None) -> None:
        """Turn every pending amax of the group into new scales, now.

        Args:
            reduce_amax: in-place reduction (MAX across ranks) of one flat float32 tensor holding
                the current-step amaxes of recipes with ``reduce_amax=True``; None skips it.
            recipe: the recipe in force (the autocast's), for amaxes whose recording recipe is
                unknown (restored from a checkpoint); None means each layer's own.

        Every rank must call this at the same point with the same layers pending when
        ``reduce_amax`` is a collective. Amaxes recorded under a recipe that is not delayed
        scaling (after a recipe change) are dropped.
        """
        taken = []  # (layer, its state, the roles and recipes it had pending)
        known = True  # every pending amax's recorder known (none restored from a checkpoint)
        for layer in self.layers:
            state: ScalingState = registered_submodule(layer, "fp8_state")  # past nn.Module.__getattr__
            if state.pending:
                pending = state.take_pending()
                for recorder in pending.values():  # by identity: `None in` would call each recipe's __eq__
                    if recorder is None:
                        known = False
                taken.append((layer, state, pending))
        # The steady state: the same layers and states with the same roles pending under the same
        # recipe objects as the last update: its grouping again (one comparison, in C, per layer).
        kept = self.__dict__.get("_last_update")  # a group unpickled from before it has none
        if known and kept is not None and kept[0] == taken:
            entries = kept[1]
        else:
            entries = self._entries(taken, recipe)
            self._last_update = (taken, entries) if known else None
        reduced = [e for e in entries if e[0].reduce_amax]
        if reduced:
            update_delayed_scaling(reduced, reduce_amax, self._tables)
        if len(reduced) < len(entries):
            update_delayed_scaling([e for e in entries if not e[0].reduce_amax], None, self._tables)

    def _entries(self, taken: list, recipe: Optional[Recipe]) -> list[tuple[DelayedScaling, int, list[ScalingState]]]:
        # The update's (recipe, role, states) groups of what the layers had pending (update's
        # ``taken``): layers whose recipes are equal update as one group, per role.
        groups: dict[tuple[int, int], tuple[DelayedScaling, list[ScalingState]]] = {}
        last: tuple[Optional[Recipe], Optional[Recipe]] = (None, None)  # rows in a row mostly share one recipe
        for layer, state, pending in taken:
            for role in sorted(pending):
                given = pending[role] or recipe or layer.recipe
                if given is not last[0]:
                    last = (given, self._update_group(given))
                chosen = last[1]
                if isinstance(chosen, DelayedScaling):
                    groups.setdefault((id(chosen), role), (chosen, []))[1].append(state)
        return [(r, role, states) for (_, role), (r, states) in groups.items()]

    def _update_group(self, recipe: Recipe) -> Recipe:
        # The first recipe equal to ``recipe`` this group has seen: layers whose recipes are equal
        # objects (each converted layer holds its own) update as one group. Found by identity,
        # so that a recipe is compared (every field) once, not once per layer, role and step.
        return kept_per_recipe(self._recipe_groups, recipe, self._first_equal, limit=4 * len(self.layers) + 16)

    def _first_equal(self, recipe: Recipe) -> Recipe:
        firsts = {id(k[1]): k[1] for k in self._recipe_groups.values()}.values()  # each group's recipe once
        return next((f for f in firsts if f == recipe), recipe)


def scaling_groups(model: nn.Module) -> list[ScalingGroup]:
    """The distinct scaling groups of the FP8 layers in ``model``, in module order."""
    seen: dict[int, ScalingGroup] = {}
    for module in model.modules():
        group = getattr(module, "scaling_group", None)
        if isinstance(group, ScalingGroup):
            seen.setdefault(id(group), group)
    return list(seen.values())


def update_pending_scales(model: nn.Module, reduce_amax: Optional[AmaxReducer] = None) -> None:
    """Turn every amax ``model``'s FP8 layers recorded since their last update into scales, now.

    The next training forward does this on its own; call it to settle the state first, for
    example before saving or comparing checkpoints. With ``reduce_amax`` (a collective), every
    rank must call it.

    Args:
        model: a converted model or an FP8 layer.
        reduce_amax: as in :meth:`ScalingGroup.update`.
    """
    for group in scaling_groups(model):
        group.update(reduce_amax)

