"""The layers a reference check measures and moves: every FP8 linear layer, and every expert of an
FP8 experts module on its own (:class:`ExpertLayer`, named ``<experts module>[<index>]``, as
``model.layers.3.mlp.experts[2]``), so that a drifting expert is named with its index and falls
back alone (``FP8ExpertsMixin.fp8_experts``) while the module's other experts stay in FP8.

An expert's figure (:func:`expert_sqnr_hooks`) is the SQNR of its own output over the tokens
routed to it, each routed slot counted once and unweighted: ``10 log10(sum y_ref^2 / sum (y_fp8 -
y_ref)^2)`` over those rows, ``y_ref`` from the module's original forward and ``y_fp8`` from its
FP8 grouped GEMMs (current scales, recording nothing), both on the inputs of the reference
replay. An expert no token was routed to has no figure.

Its GEMMs' figures (:func:`expert_sqnr_hooks` with ``gemm_energies``), as a linear layer's, per
projection (``<expert>.gate_up_proj`` or ``.up_proj``, and ``<expert>.down_proj``): ``fprop``,
``dgrad`` and ``wgrad``, each the SQNR of the expert's FP8 grouped GEMM (its own scales, recording
nothing) against the same GEMM in float32 on the same operands: the projection's input and its
grad_output in the reference replay. The module's original forward does not expose its GEMMs, so
the hook recomputes the expert MLP on each routed slot's row in float32 with autograd
(projections, biases, gate, as the experts' forward), and, when the replay's backward reaches the
module's output, takes the rows' grad_output from it (``dL/dy`` of a slot: its routing weight
times the token's output gradient) and backpropagates the recomputation for the reference GEMMs;
the FP8 grouped GEMMs run on the same operands (:func:`~fp8_plugin.modules.grouped_linear.fp8_grouped_linear`).
A check on a MoE model so holds, per experts module, one float32 copy of its expert weights and
of its routed rows' activations until the backward has passed it. Frozen FP8 experts (kept only
in FP8) have their output figure only.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..._private.torch_api import in_backward_pass
from ...modules.experts import FP8ExpertsMixin, _projections
from ...modules.grouped_linear import fp8_grouped_linear
from ...modules.linear import FP8Linear
from ...numerics.grouped_gemm import group_offsets
from ...numerics.recipes import GEMMS, Recipe

__all__ = ["ExpertLayer", "checked_layers", "expert_sqnr_hooks", "expert_gemm_names", "expert_of"]


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
                      recipes: dict[str, Optional[Recipe]], gemm_energies: torch.Tensor) -> list:
    """Forward hooks, one per experts module, on the experts of ``layers`` that ran in FP8 in the
    FP8 replay (a recipe in ``recipes``): in the reference replay each adds, for each of those
    experts, the signal and noise energies of its output (module docstring) to its row of
    ``energies`` (float64 ``[len(layers), 2]``, the rows of ``layers``' order), on the device,
    and those of its GEMMs to ``gemm_energies`` (float64 ``[len(layers), 2, 3, 2]``: projection,
    GEMM in :data:`~fp8_plugin.numerics.recipes.GEMMS` order, signal and noise).
    Returns the handles."""
    by_module: dict[int, tuple[FP8ExpertsMixin, Recipe, list[int], list[int]]] = {}
    for row, (name, layer) in enumerate(layers):
        if isinstance(layer, ExpertLayer) and recipes.get(name) is not None:
            entry = by_module.setdefault(id(layer.module), (layer.module, recipes[name], [], []))
            entry[2].append(layer.index)
            entry[3].append(row)
    # prepend: before the post-forward hook of a module FSDP2 shards on its own (which reshards).
    return [module.register_forward_hook(_expert_hook(energies, recipe, experts, rows, gemm_energies), prepend=True)
            for module, recipe, experts, rows in by_module.values()]


def expert_gemm_names(name: str, layer: ExpertLayer) -> tuple[str, str]:
    """The names of an expert's two projections in ``gemm_sqnr_db``: ``<expert>.<projection>``."""
    return tuple(f"{name}.{proj}" for proj in _projections(layer.module))  # type: ignore[return-value]


def expert_of(name: str, layers: dict[str, CheckedLayer]) -> str:
    """The checked layer a ``gemm_sqnr_db`` name belongs to: the name itself, or for an expert's
    projection (``...experts[2].down_proj``) the expert, which moves as a whole."""
    if name in layers:
        return name
    owner = name.rpartition(".")[0]
    return owner if isinstance(layers.get(owner), ExpertLayer) else name


def _expert_hook(energies: torch.Tensor, recipe: Recipe, experts: list[int], rows: list[int],
                 gemm_energies: torch.Tensor) -> Callable:
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
            per_expert = _per_expert_rows(reference, fp8, expert_of_row.flatten(), module.num_experts)
            index = torch.tensor(rows, device=energies.device)
            chosen = per_expert[torch.tensor(experts, device=per_expert.device)]
            energies.index_add_(0, index, chosen.to(energies.device))
        if not any(module.frozen_cast(p) is not None for p in _projections(module)):
            _gemm_figures(module, recipe, x, args[0].requires_grad, expert_of_row.flatten(), top_k_weights, output,
                          experts, rows, gemm_energies)
    return hook


def _gemm_figures(module: FP8ExpertsMixin, recipe: Recipe, slot_rows: torch.Tensor, needs_dgrad: bool,
                  expert_of_row: torch.Tensor, top_k_weights: torch.Tensor, output: torch.Tensor,
                  experts: list[int], rows: list[int], gemm_energies: torch.Tensor) -> None:
    # fprop now, on the forward's operands; dgrad and wgrad when the backward reaches the output.
    # slot_rows [T * k, H]: each routed slot's token (row t * k + j), expert_of_row its expert.
    num_experts, slots = module.num_experts, top_k_weights.shape[-1]
    expert_of_slot, perm = torch.sort(expert_of_row, stable=True)
    x = slot_rows[perm].float()
    offsets = group_offsets(expert_of_slot, num_experts)
    ends = [0] + offsets.tolist()  # the reference's per-expert loop (a check reads the host anyway)
    first, second = _projections(module)
    weights = {p: _as_nk(module, getattr(module, p).detach().float()).clone().requires_grad_() for p in (first, second)}

    def project(proj: str, inputs: torch.Tensor) -> torch.Tensor:
        w = weights[proj]
        return torch.cat([inputs[ends[e]:ends[e + 1]] @ w[e].t() for e in range(num_experts)])

    with torch.enable_grad():
        x_ref = x.detach().requires_grad_(needs_dgrad)
        z1 = project(first, x_ref)
        h = z1 + getattr(module, f"{first}_bias")[expert_of_slot].float() if module.has_bias else z1
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        z2 = project(second, h)
        y = z2 + getattr(module, f"{second}_bias")[expert_of_slot].float() if module.has_bias else z2
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        # The FP8 side: the expert's grouped GEMMs on the reference's operands, recording nothing.
        fp8 = {}
        for proj, inputs in ((first, x_ref), (second, h)):
            states = [m.fp8_state for m in module.fp8_scaling[proj]]
            weight = getattr(module, proj)
            operand = inputs.detach().requires_grad_(inputs.requires_grad)
            cast = module._weight_cast(proj, weight, states, recipe, False)
            # A leaf of its own over the weight's data: the FP8 wgrad reaches no hook of the
            # parameter (ZeRO-3 reduce-scatters gradients from such hooks).
            param = weight.detach().requires_grad_(weight.requires_grad)
            out = fp8_grouped_linear(operand, param, expert_of_slot, offsets, states, recipe,
                                     transposed=bool(module.is_transposed), record_forward=False, record_backward=False,
                                     out_dtype=torch.float32, weight_cast=cast, tables=module._fp8_tables,
                                     observe_weight=False, token_scaling=module.token_scaling)
            fp8[proj] = (operand, param, out)
    select = (torch.tensor(rows, device=gemm_energies.device), torch.tensor(experts, device=x.device))
    for p, (proj, z) in enumerate(((first, z1), (second, z2))):
        _add(gemm_energies, select, p, 0, _per_expert_rows(z, fp8[proj][2], expert_of_slot, num_experts))
    if not output.requires_grad:
        return

    def backward_reached(grad: torch.Tensor) -> None:
        # dL/dy of each slot's row: its routing weight times its token's output gradient.
        dy = (grad.float().repeat_interleave(slots, dim=0) * top_k_weights.float().reshape(-1, 1))[perm]
        wanted = [z1, z2, h] + [weights[first], weights[second]] + ([x_ref] if x_ref.requires_grad else [])
        grads = torch.autograd.grad(y, wanted, dy)
        dz = {first: grads[0], second: grads[1]}
        dinput = {first: grads[5] if x_ref.requires_grad else None, second: grads[2]}
        dweight = {first: grads[3], second: grads[4]}
        for p, proj in enumerate((first, second)):
            operand, param, out = fp8[proj]
            inputs = [t for t in (operand, param) if t.requires_grad]
            fp8_grads = dict(zip([id(t) for t in inputs], torch.autograd.grad(out, inputs, dz[proj])))
            if operand.requires_grad and dinput[proj] is not None:
                _add(gemm_energies, select, p, 1,
                     _per_expert_rows(dinput[proj], fp8_grads[id(operand)], expert_of_slot, num_experts))
            if param.requires_grad:  # each expert's weight gradient as one row of its own
                wgrad8 = _as_nk(module, fp8_grads[id(param)])
                _add(gemm_energies, select, p, 2, _per_expert_rows(dweight[proj].flatten(1), wgrad8.flatten(1),
                                                                   torch.arange(num_experts, device=x.device),
                                                                   num_experts))
        fp8.clear()

    output.register_hook(backward_reached)


def _as_nk(module: FP8ExpertsMixin, weight: torch.Tensor) -> torch.Tensor:
    # An expert stack as [E, N, K] (out, in), whatever the module's layout.
    return weight.transpose(1, 2) if module.is_transposed else weight


def _per_expert_rows(reference: torch.Tensor, fp8: torch.Tensor, expert_of_row: torch.Tensor,
                     num_experts: int) -> torch.Tensor:
    # Float64 [E, 2]: per expert, the signal and noise energies of its rows.
    ref = reference.detach().double()
    per_row = torch.stack([ref.square().sum(-1), (fp8.detach().double() - ref).square().sum(-1)], 1)
    return per_row.new_zeros(num_experts, 2).index_add_(0, expert_of_row, per_row)


def _add(gemm_energies: torch.Tensor, select: tuple[torch.Tensor, torch.Tensor], proj: int, gemm: int,
         per_expert: torch.Tensor) -> None:
    rows, experts = select
    gemm_energies[:, proj, gemm].index_add_(0, rows, per_expert[experts].to(gemm_energies.device))


assert GEMMS == ("fprop", "dgrad", "wgrad")  # the order of gemm_energies' third dimension
