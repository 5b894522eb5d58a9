"""What ``convert_model`` does with a model's MoE experts and routers: :func:`plan_experts` finds
the experts modules (:func:`~fp8_plugin.modules.experts.is_experts_module`) and the routers
beside them and decides, per experts module, whether it becomes FP8 (:class:`ExpertsPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..numerics.recipes import DelayedScaling, Recipe
from .experts import (ROUTER_NAMES, ROUTER_REASON, FP8ExpertsMixin, _in_out, _projections, check_experts_recipe,
                      convert_experts, is_experts_module)

__all__ = ["ExpertsPlan", "plan_experts"]


@dataclass
class ExpertsPlan:
    """What ``convert_model`` will do with a model's experts and routers.

    Attributes:
        decisions: ``(name, kind, in_features, out_features, swapped, reason)`` per expert
            projection (named ``<experts>.gate_up_proj`` ...; features of one expert) and per
            router that is not an ``nn.Linear`` (those are judged with the linear layers).
        routers: ``id(router) -> reason`` for routers that are ``nn.Linear`` candidates.
    """

    decisions: list[tuple[str, str, int, int, bool, str]] = field(default_factory=list)
    routers: dict[int, str] = field(default_factory=dict)
    todo: list[nn.Module] = field(default_factory=list)
    recipe: Optional[Recipe] = None

    def router_reason(self, module: nn.Module) -> str:
        return self.routers.get(id(module), "")

    def apply(self) -> None:
        """Convert the planned experts modules."""
        for module in self.todo:
            convert_experts(module, self.recipe)


def plan_experts(model: nn.Module, recipe: Optional[Recipe], pattern_reason: Callable[[str], str],
                 linear_types: tuple[type, ...] = (nn.Linear,)) -> ExpertsPlan:
    """Find the experts modules and routers of ``model`` and decide what becomes FP8.

    Args:
        model: any module; transformers MoE models have experts modules.
        recipe: the conversion's recipe (None: ``DelayedScaling()``).
        pattern_reason: ``name -> reason`` from include / exclude patterns ("" to convert).
        linear_types: layer types ``convert_model`` judges itself (routers of these types are
            reported by it, with :attr:`ExpertsPlan.routers`).

    Raises:
        ValueError: experts would be converted under a recipe they do not support
            (:func:`check_experts_recipe`); nothing has been changed then.
    """
    plan = ExpertsPlan(recipe=recipe if recipe is not None else DelayedScaling())
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        kind = type(module).__name__
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        for child_name, child in parent.named_children():
            if child_name in ROUTER_NAMES and child is not module:
                if isinstance(child, linear_types):
                    plan.routers[id(child)] = ROUTER_REASON
                else:
                    prefix = f"{name.rpartition('.')[0]}." if "." in name else ""
                    w = getattr(child, "weight", None)
                    out_f, in_f = (w.shape[0], w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() == 2 else (0, 0)
                    plan.decisions.append((f"{prefix}{child_name}", type(child).__name__, in_f, out_f, False,
                                           ROUTER_REASON))
        already = isinstance(module, FP8ExpertsMixin)
        at = f"{name}." if name else ""
        reasons = [pattern_reason(f"{at}{proj}") for proj in _projections(module)]
        # Both projections of an experts module share one forward: they convert together.
        reason = "" if already else next((r for r in reasons if r), "")
        for proj in _projections(module):
            in_f, out_f = _in_out(module, proj)
            why = "already FP8" if already else reason
            plan.decisions.append((f"{at}{proj}", kind, in_f, out_f, already or not reason, why))
        if not already and not reason:
            plan.todo.append(module)
    if plan.todo:
        check_experts_recipe(plan.recipe)
    return plan
