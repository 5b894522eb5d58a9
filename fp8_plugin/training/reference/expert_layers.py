"""The layers a reference check measures and moves: every FP8 linear layer, and every expert of an
FP8 experts module on its own (:class:`ExpertLayer`, named ``<experts module>[<index>]``, as
``model.layers.3.mlp.experts[2]``), so that a drifting expert is named with its index and falls
back alone (``FP8ExpertsMixin.fp8_experts``) while the module's other experts stay in FP8.

An expert's figure (:func:`expert_sqnr_hooks`) is the SQNR of its own output over the tokens
routed to it, each routed slot counted once and unweighted: ``10 log10(sum y_ref^2 / sum (y_fp8 -
y_ref)^2)`` over those rows, ``y_ref`` from the module's original forward and ``y_fp8`` from its
FP8 grouped GEMMs (current scales, recording nothing), both on the inputs of the reference
replay. An expert no token was routed to has no figure.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..._private.torch_api import in_backward_pass
from ...modules.experts import FP8ExpertsMixin
from ...modules.linear import FP8Linear
from ...numerics.recipes import Recipe

__all__ = ["ExpertLayer", "checked_layers", "expert_sqnr_hooks"]


class ExpertLayer:
    """One expert of an FP8 experts module, as the reference checks see a layer.

    Attributes:
        module: the experts module (:class:`~fp8_plugin.modules.experts.FP8ExpertsMixin`).
        index: the expert's index, 0 to E - 1.
        use_fp8: the expert's own switch (``module.fp8_experts[index]``); setting it moves this
            expert alone.
    """

    def __init__(self, module: FP8ExpertsMixin, index: int) -> None:
        self.module, self.index = module, index

    @property
    def use_fp8(self) -> bool:
        return self.module.fp8_experts[self.index]

    @use_fp8.setter
    def use_fp8(self, value: bool) -> None:
        flags = list(self.module.fp8_experts)
        flags[self.index] = bool(value)
        self.module.fp8_experts = tuple(flags)

    @property
    def _forward_context(self):
        # How the module's last forward ran (its recipe): the expert's too.
        return self.module._forward_context

    def __repr__(self) -> str:
        return f"ExpertLayer({type(self.module).__name__}, index={self.index})"


CheckedLayer = Union[FP8Linear, ExpertLayer]


def checked_layers(model: nn.Module) -> list[tuple[str, CheckedLayer]]:
    """``(name, layer)`` of every FP8 linear layer of ``model`` and of every expert of its FP8
    experts modules (``"<module name>[<index>]"``), in module order."""
    layers: list[tuple[str, CheckedLayer]] = []
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            layers.append((name, module))
        elif isinstance(module, FP8ExpertsMixin):
            layers += [(f"{name}[{e}]", ExpertLayer(module, e)) for e in range(module.num_experts)]
    return layers


def expert_sqnr_hooks(layers: Sequence[tuple[str, CheckedLayer]], energies: torch.Tensor,
                      recipes: dict[str, Optional[Recipe]]) -> list:
    """Forward hooks, one per experts module, on the experts of ``layers`` that ran in FP8 in the
    FP8 replay (a recipe in ``recipes``): in the reference replay each adds, for each of those
    experts, the signal and noise energies of its output (module docstring) to its row of
    ``energies`` (float64 ``[len(layers), 2]``, the rows of ``layers``' order), on the device.
    Returns the handles."""
    by_module: dict[int, tuple[FP8ExpertsMixin, Recipe, list[int], list[int]]] = {}
    for row, (name, layer) in enumerate(layers):
        if isinstance(layer, ExpertLayer) and recipes.get(name) is not None:
            entry = by_module.setdefault(id(layer.module), (layer.module, recipes[name], [], []))
            entry[2].append(layer.index)
            entry[3].append(row)
    # prepend: before the post-forward hook of a module FSDP2 shards on its own (which reshards).
    return [module.register_forward_hook(_expert_hook(energies, recipe, experts, rows), prepend=True)
            for module, recipe, experts, rows in by_module.values()]


def _expert_hook(energies: torch.Tensor, recipe: Recipe, experts: list[int], rows: list[int]) -> Callable:
    def hook(module: FP8ExpertsMixin, args: tuple, output: torch.Tensor) -> None:
        if torch.is_grad_enabled() and in_backward_pass():
            return  # an activation-checkpoint recomputation: this forward was counted already
        hidden_states, top_k_index, top_k_weights = (a.detach() for a in args[:3])
        # Each routed slot as a row of its own: token t's j-th slot is row t * k + j, routed to
        # its expert alone with weight 1, so that both forwards return that expert's own output.
        slots = top_k_index.shape[-1]
        x = hidden_states.repeat_interleave(slots, dim=0)
        expert_of_row = top_k_index.reshape(-1, 1)
        ones = torch.ones(expert_of_row.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        with torch.no_grad():
            fp8 = module._fp8_experts_forward(x, expert_of_row, ones, recipe, False, False)
            with module.dequantized():  # the original forward, as the reference replay ran it
                reference = super(FP8ExpertsMixin, module).forward(x, expert_of_row, ones)
            reference = reference.to(torch.float64)
            per_row = torch.stack([reference.square().sum(-1), (fp8.to(torch.float64) - reference).square().sum(-1)], 1)
            per_expert = per_row.new_zeros(module.num_experts, 2).index_add_(0, expert_of_row.flatten(), per_row)
            index = torch.tensor(rows, device=energies.device)
            energies.index_add_(0, index, per_expert[torch.tensor(experts, device=per_expert.device)].to(energies.device))
    return hook
