"""FP8 mixture-of-experts experts: the grouped GEMMs of transformers' experts modules in FP8.

In transformers 5.x the experts of a MoE block (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS and every other model whose experts class is decorated with
``@transformers.integrations.use_experts_implementation``) are one module with 3-D parameters:
``gate_up_proj`` ``[E, 2I, H]`` (``up_proj`` ``[E, I, H]`` without a gate) and ``down_proj``
``[E, H, I]``, or ``[E, H, 2I]`` / ``[E, I, H]`` where the decorator says ``is_transposed=True``
(GPT-OSS), optionally with biases ``*_bias`` ``[E, out]``. Its forward is picked from
transformers' ``ExpertsInterface`` by ``config._experts_implementation``.

The seam: each experts module keeps its identity, its parameters and its hooks; its class
becomes a subclass of its own class (``FP8<Name>``, built once per class) whose ``forward``
runs the FP8 grouped GEMMs inside :func:`fp8_plugin.autocast` and calls the original
forward (transformers' dispatch, whatever ``_experts_implementation`` says) otherwise. Not
an ``"fp8"`` entry of ``ExpertsInterface`` selected through the config, because the config is
one object shared by every experts module of the model (and written by ``save_pretrained``):
per-module switches (``use_fp8``, include / exclude, the reference checks' fallback) need
per-module behaviour, a saved ``config.json`` must not name an implementation that plain
transformers lacks, and the user's choice of high-precision implementation must stay in force.
The class change adds one submodule, ``fp8_scaling`` (FP8 scaling state only, no parameters):
parameter names, shapes and ``save_pretrained`` output stay those of the model.

Numerics (per experts module, for each of the two projections): the routed tokens are sorted
by expert, and input, weight and grad_output are cast with one scale per expert per role, each
expert's scaling state a :class:`~fp8_plugin.numerics.quantizers.ScalingState` of its own
(``fp8_scaling.<proj>.<expert>.fp8_state``): delayed scaling keeps an amax history per expert
per role, current scaling scales each expert's tokens by their own amax. Forward casts to the
recipe's forward format (E4M3), gradients to its backward format (E5M2 under HYBRID); fprop,
dgrad and wgrad are grouped FP8 GEMMs with FP32 accumulation
(:mod:`fp8_plugin.numerics.grouped_gemm`); master weights stay in their dtype (FP32). The
routing stays on the device: each expert's rows are given to the grouped GEMMs as int32 end
offsets (:func:`~fp8_plugin.numerics.grouped_gemm.group_offsets`), never read on the host in
the forward or the backward (only the per-layer statistics, while attached, slice each expert's
rows on the host), so a training step does not wait for the GPU and compiles whole under
``torch.compile(fullgraph=True)``; in compiled code, as for ``FP8Linear``, the loop applies the
pending scale updates after each step (:func:`fp8_plugin.update_pending_scales`). Biases,
the gate activation and the routing weights stay in high precision, as in transformers'
``grouped_mm`` implementation, whose steps this forward follows.

On a CUDA GPU the per-expert casts are fused kernels (:mod:`.expert_casts`), 3 launches each
at any expert count. Block-scaled recipes (MXFP8, 128-blockwise) are refused for experts: their
grouped casts and GEMMs are not implemented. Routers (``gate`` / ``router``) stay in high precision: routing
decisions flip on small logit changes, and Transformer Engine and Megatron-LM keep them out of
FP8 too. Expert parallelism (``_is_expert_parallel``) runs the experts in high precision, with
a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._private.torch_api import in_backward_pass
from ..numerics.grouped_gemm import EXPERT_GEMMS, group_offsets
from ..numerics.quantizers import QuantizedTensor, ScalingState, recipe_key
from ..numerics.recipes import DelayedScaling, Recipe
from .autocast import current_context, note_fp8_forward
from .expert_casts import cast_expert_weights  # noqa: F401  (public here too)
from .frozen_experts import FrozenExpertsMixin
from .grouped_linear import (  # noqa: F401  (EXPERT_RECIPES: public here too)
    EXPERT_RECIPES, check_experts_recipe, check_token_scaling, fp8_grouped_linear,
)
from .linear_function import output_dtype
from .scaling_group import ScalingGroup
from .weight_cache import WeightCache, keeps_weight_casts, weight_cast_key

__all__ = ["FP8ExpertsMixin", "FP8ExpertGEMM", "fp8_grouped_linear", "convert_experts", "is_experts_module",
           "check_experts_recipe", "expert_gemm_counts", "EXPERT_RECIPES", "ROUTER_REASON",
           "ROUTER_NAMES"]

# Names of the router submodules of a MoE block (transformers' naming).
ROUTER_NAMES = ("gate", "router")
ROUTER_REASON = "MoE router: high precision, its logits choose the experts (as Transformer Engine, Megatron-LM)"


def expert_gemm_counts() -> dict[str, int]:
    """Grouped FP8 expert GEMMs run in this process, by kind: ``{"fprop", "dgrad", "wgrad"}``.

    A model whose experts silently ran in high precision leaves them unchanged: tests compare
    them before and after a step."""
    return {kind: EXPERT_GEMMS[kind] for kind in ("fprop", "dgrad", "wgrad")}


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (``@use_experts_implementation``) whose
    3-D weights this module knows: ``gate_up_proj`` (or ``up_proj``) and ``down_proj``."""
    if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts", "config")):
        return False
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    return all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in (first, down))


def _projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _in_out(module: nn.Module, proj: str) -> tuple[int, int]:
    # (in_features, out_features) of one expert's projection.
    _, a, b = getattr(module, proj).shape
    return (a, b) if module.is_transposed else (b, a)


class FP8ExpertGEMM(nn.Module):
    """The scaling state of one expert's projection: a member of the model's
    :class:`~fp8_plugin.modules.scaling_group.ScalingGroup`, updated with the FP8 linear layers
    in the step's single update (one amax reduction)."""

    def __init__(self, recipe: Recipe, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.recipe = recipe
        self.fp8_state = ScalingState(_history_len(recipe), device=device)
        self.fp8_state.recipe = recipe_key(recipe)
        ScalingGroup().add(self)


def _history_len(recipe: Recipe) -> int:
    return recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1


@dataclass(frozen=True)
class _ForwardContext:
    # How the last forward ran, for an activation-checkpoint recomputation (as FP8Linear keeps it).
    recipe: Optional[Recipe]
    training: bool
    group_step: Optional[int]


_warned_expert_parallel = False


class FP8ExpertsMixin(FrozenExpertsMixin):
    """What a converted experts module adds to its own class (``FP8<ExpertsClass>``).

    Attributes:
        recipe: the experts' recipe when the autocast gives none.
        fp8_scaling: ``ModuleDict`` ``{projection: ModuleList of E FP8ExpertGEMM}``, the
            scaling state of each expert's projection (``gate_up_proj`` or ``up_proj``, then
            ``down_proj``).
        use_fp8: whether any expert runs in FP8 inside the autocast; setting it sets every
            expert's switch (False: the module's original forward, as ``FP8Linear.use_fp8``).
        fp8_experts: each expert's own switch, a tuple of E bools (the reference checks' fallback
            moves one expert to high precision without the others); saved with each expert's
            scaling state.
        token_scaling: ``"current"`` (default) or ``"recipe"``: how each expert's token rows
            (its input in fprop, its grad_output in the backward) are scaled: by their own amax
            at the cast, or as the recipe says (delayed: the expert's amax history); the weights
            always follow the recipe (:mod:`fp8_plugin.modules.grouped_linear` says why).
            Setting another value raises ValueError. Not saved in checkpoints: a module made
            by ``convert_model`` has the default.
        cache_fp8_weights: ``"auto"`` (default), True or False: whether a forward keeps each
            projection's FP8 weight cast for the next while the weights, scales and recipe are
            unchanged, as ``FP8Linear`` does (:mod:`fp8_plugin.modules.weight_cache`);
            :meth:`clear_weight_cache` drops them.

    Forward: ``(hidden_states [T, H], top_k_index int [T, k], top_k_weights [T, k]) -> [T, H]``
    in ``hidden_states``' dtype, as the experts module's own. Outside the autocast, with
    ``use_fp8 = False``, or inside a high-precision replay, it is the original forward. With
    some experts switched off it is the sum of two passes over the routed tokens: the FP8
    grouped GEMMs with the routing weights of those experts' slots zeroed, and the original
    forward with the others' zeroed (each slot counted once, its gradients in one of the two;
    the routed rows' GEMMs run twice, a cost of the fallback only).
    """

    def __reduce_ex__(self, protocol: int):
        # The FP8 class is made at run time and cannot be pickled by name: pickle its base class.
        # The casts' device tables stay behind: keyed by this process's objects, holding their addresses.
        return _new_fp8_experts, (type(self)._fp8_base,), {**self.__dict__, "_fp8_tables": {}}

    @property
    def use_fp8(self) -> bool:
        return any(self.fp8_experts)

    @use_fp8.setter
    def use_fp8(self, value: bool) -> None:
        for m in self._fp8_members():
            m.fp8_state.use_fp8 = bool(value)

    @property
    def fp8_experts(self) -> tuple[bool, ...]:
        # An expert is in FP8 when all its projections' states say so (they are switched together).
        return tuple(all(self.fp8_scaling[proj][e].fp8_state.use_fp8 for proj in self.fp8_scaling)
                     for e in range(self.num_experts))

    @fp8_experts.setter
    def fp8_experts(self, flags) -> None:
        flags = tuple(flags)
        if len(flags) != self.num_experts or not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"fp8_experts={flags!r}: give one bool per expert ({self.num_experts} experts)")
        for proj in self.fp8_scaling.values():
            for member, flag in zip(proj, flags):
                member.fp8_state.use_fp8 = flag

    @property
    def token_scaling(self) -> str:
        return self.__dict__.get("_token_scaling", "current")  # a module pickled before the switch: the default

    @token_scaling.setter
    def token_scaling(self, value: str) -> None:
        self.__dict__["_token_scaling"] = check_token_scaling(value, f"{type(self).__name__}.token_scaling")

    @property
    def scaling_group(self) -> ScalingGroup:
        return self._fp8_members()[0].scaling_group

    def _fp8_members(self) -> list[FP8ExpertGEMM]:
        return [m for proj in self.fp8_scaling.values() for m in proj]

    def _fp8_setup(self, recipe: Recipe) -> None:
        device = getattr(self, _projections(self)[0]).device
        self.recipe = recipe
        self.fp8_scaling = nn.ModuleDict({
            proj: nn.ModuleList([FP8ExpertGEMM(recipe, device) for _ in range(self.num_experts)])
            for proj in _projections(self)
        })
        group = ScalingGroup()  # one update for all its experts; convert_model joins it to the model's
        for member in self._fp8_members():
            group.add(member)
        self._forward_context: Optional[_ForwardContext] = None
        self._fp8_observers: OrderedDict[int, Callable] = OrderedDict()  # weakly referenced by the handles
        self.cache_fp8_weights: Union[bool, str] = "auto"
        self._fp8_weight_cache: dict[str, WeightCache] = {}  # per projection: its (data, scale_inv) cast
        self._fp8_tables: dict = {}  # the fused casts' address tables of the experts' states

    def clear_weight_cache(self) -> None:
        """Drop the cached FP8 casts of the expert weights (rebuilt at the next FP8 forward);
        training loops call it before each optimizer step, as for ``FP8Linear``."""
        self._fp8_weight_cache = {}

    def _weight_cast(self, proj: str, weight: torch.Tensor, states: list[ScalingState], recipe: Recipe,
                     record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # As FP8Linear's weight cache: the micro-batches of gradient accumulation and evaluation
        # batches cast each expert stack once, with identical numerics, keyed on all a cast
        # depends on (weight_cast_key: every expert's delayed scale among it).
        transposed = bool(self.is_transposed)
        if torch.compiler.is_compiling():
            return cast_expert_weights(weight, states, recipe, record, transposed, self._fp8_tables)
        step = self.scaling_group.step if record else None
        if not keeps_weight_casts(self, step):
            self._fp8_weight_cache.pop(proj, None)  # what an earlier forward kept goes
            return cast_expert_weights(weight, states, recipe, record, transposed, self._fp8_tables)
        key = weight_cast_key(weight, recipe, states, step)
        cached = self._fp8_weight_cache.get(proj)
        if cached is not None and cached.matches(key, record):
            return cached.rowwise
        self._fp8_weight_cache.pop(proj, None)  # free the stale cast before making a new one
        cast = cast_expert_weights(weight, states, recipe, record, transposed, self._fp8_tables)
        self._fp8_weight_cache[proj] = WeightCache(key, record, cast, None)
        return cast

    def observe_casts(self, fn: Callable[[str, int, torch.Tensor, QuantizedTensor], None]) -> RemovableHandle:
        """Call ``fn(projection, role, rows, cast)`` at every recording FP8 cast (training forwards
        and their backward): ``rows`` the high-precision rows of all experts (the routed tokens
        ``[S, K]`` sorted by expert, or the weights ``[E * N, K]``), ``cast`` their
        :class:`QuantizedTensor`, each row with its expert's scale (block ``(1, K)``, so that
        nothing is read on the host). Per-layer statistics use it. Returns a handle whose
        ``remove()`` stops the calls."""
        handle = RemovableHandle(self._fp8_observers)
        self._fp8_observers[handle.id] = fn
        return handle

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        original = super().forward  # transformers' dispatch on config._experts_implementation
        if args or kwargs:
            return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        saved = self._forward_context
        if torch.is_grad_enabled() and in_backward_pass() and saved is not None:
            # An activation-checkpoint recomputation: as the original forward ran, recording nothing twice.
            if saved.recipe is None:
                with self.dequantized():
                    return original(hidden_states, top_k_index, top_k_weights)
            if self.scaling_group.step != saved.group_step:
                raise RuntimeError(
                    "FP8 experts: an activation-checkpoint recomputation ran after the FP8 scales were updated by "
                    "a later training step; run each step's backward before the next step's forward")
            return self._fp8_or_mixed(original, hidden_states, top_k_index, top_k_weights, saved.recipe, False,
                                      saved.training, self.fp8_experts)
        context = current_context()
        flags = self.fp8_experts  # read once per forward: use_fp8 is any(flags)
        recipe = (context.recipe or self.recipe) if (any(flags) and context.enabled) else None
        if recipe is not None and getattr(self, "_is_expert_parallel", False):
            _warn_expert_parallel()
            recipe = None
        if recipe is None:
            self._forward_context = _ForwardContext(None, context.training, None)
            with self.dequantized():  # frozen FP8 projections, dequantized for the module's own forward
                return original(hidden_states, top_k_index, top_k_weights)
        check_experts_recipe(recipe, "FP8 experts")
        note_fp8_forward()
        group = self.scaling_group
        if context.training and not torch.compiler.is_compiling() and group.step != context.step:
            # First FP8 forward of a training step: last step's amaxes become scales (FP8Linear does the same).
            # Not in compiled code: there the loop applies them after the optimizer step, as for FP8Linear
            # (a step id compared in the graph would recompile it every step).
            group.step = context.step
            group.update(context.reduce_amax, context.recipe)
        self._forward_context = _ForwardContext(recipe, context.training, group.step)
        return self._fp8_or_mixed(original, hidden_states, top_k_index, top_k_weights, recipe, context.training,
                                  context.training, flags)

    def _fp8_or_mixed(self, original: Callable, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, recipe: Recipe, record_forward: bool,
                      record_backward: bool, flags: tuple[bool, ...]) -> torch.Tensor:
        # Every expert in FP8, or (a per-expert fallback) the FP8 pass plus the original forward,
        # each with the other's routing slots weighted zero: a slot's output and the gradient of
        # its routing weight come from the one pass its expert belongs to.
        if all(flags):
            return self._fp8_experts_forward(hidden_states, top_k_index, top_k_weights, recipe, record_forward,
                                             record_backward)
        on = torch.tensor(flags, device=top_k_index.device)[top_k_index]  # [T, k]: the slot's expert is FP8
        zero = top_k_weights.new_zeros(())
        fp8_part = self._fp8_experts_forward(hidden_states, top_k_index, torch.where(on, top_k_weights, zero), recipe,
                                             record_forward, record_backward)
        with self.dequantized():
            high = original(hidden_states, top_k_index, torch.where(on, zero, top_k_weights))
        return fp8_part + high.to(fp8_part.dtype)

    def _fp8_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor, recipe: Recipe, record_forward: bool,
                             record_backward: bool) -> torch.Tensor:
        # transformers' grouped_mm_experts_forward, step for step, with FP8 grouped GEMMs.
        num_experts, num_top_k = self.num_experts, top_k_index.size(-1)
        num_tokens, hidden_dim = hidden_states.shape
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids, stable=True)
        x = hidden_states[perm // num_top_k]
        _check_expert_ids(expert_ids_g, num_experts)
        # The end row of each expert's rows, on the device (as transformers' grouped_mm passes
        # offs): no host read, so no sync and no graph break.
        offsets = group_offsets(expert_ids_g, num_experts)
        out_dtype = output_dtype(hidden_states)
        first, second = _projections(self)
        h = self._fp8_projection(first, x, expert_ids_g, offsets, recipe, record_forward, record_backward, out_dtype)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = self._fp8_projection(second, h, expert_ids_g, offsets, recipe, record_forward, record_backward, out_dtype)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        y = y * sample_weights[perm].unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        y = y[inv_perm]
        return y.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def _fp8_projection(self, proj: str, x: torch.Tensor, expert_ids_g: torch.Tensor, offsets: torch.Tensor,
                        recipe: Recipe, record_forward: bool, record_backward: bool,
                        out_dtype: torch.dtype) -> torch.Tensor:
        weight = getattr(self, proj)
        states = [m.fp8_state for m in self.fp8_scaling[proj]]
        for state in states:  # host-side bookkeeping, as FP8Linear does before its casts
            if isinstance(recipe, DelayedScaling):
                state.resize_history(recipe.amax_history_len)
            if state.device != x.device:
                state.follow(x.device)
            state.use_recipe(recipe)
        observers = tuple(functools.partial(fn, proj) for fn in self._fp8_observers.values())
        frozen = self.frozen_cast(proj)  # kept only in FP8: the stored cast, no weight amax to record
        weight_cast = frozen or self._weight_cast(proj, weight, states, recipe, record_forward)
        out = fp8_grouped_linear(x, weight, expert_ids_g, offsets, states, recipe, transposed=bool(self.is_transposed),
                                 record_forward=record_forward, record_backward=record_backward, out_dtype=out_dtype,
                                 observers=observers, weight_cast=weight_cast, tables=self._fp8_tables,
                                 observe_weight=frozen is None, token_scaling=self.token_scaling)
        if self.has_bias:
            bias = getattr(self, f"{proj}_bias")
            out = out + bias[expert_ids_g].to(out.dtype)
        return out


def _check_expert_ids(expert_ids_g: torch.Tensor, num_experts: int) -> None:
    # Routing ids outside 0..E-1 would land in no expert's rows. Checked where reading them costs
    # no sync (eager, on the CPU); on a GPU and under torch.compile the ids are the router's top-k
    # indices, in range by construction, and an id past the scales raises in the indexing kernel.
    if torch.compiler.is_compiling() or expert_ids_g.device.type != "cpu" or expert_ids_g.numel() == 0:
        return
    if int(expert_ids_g[0]) < 0 or int(expert_ids_g[-1]) >= num_experts:
        raise ValueError(f"FP8 experts: top_k_index holds expert ids outside 0..{num_experts - 1} "
                         f"({num_experts} experts)")


def _warn_expert_parallel() -> None:
    global _warned_expert_parallel
    if not _warned_expert_parallel:
        _warned_expert_parallel = True
        warnings.warn("FP8 experts: expert parallelism is not supported; experts sharded across ranks run in "
                      "high precision", stacklevel=3)


_fp8_classes: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    # One FP8 subclass per experts class, named after it; the original stays in the MRO, so
    # isinstance checks and transformers' own dispatch keep working.
    if cls not in _fp8_classes:
        _fp8_classes[cls] = type(f"FP8{cls.__name__}", (FP8ExpertsMixin, cls),
                                 {"__module__": __name__, "__qualname__": f"FP8{cls.__qualname__}", "_fp8_base": cls})
    return _fp8_classes[cls]


def _new_fp8_experts(base: type) -> nn.Module:
    # Unpickling (torch.save of a whole model) and deepcopy: the class is rebuilt from its base.
    cls = _fp8_class(base)
    return cls.__new__(cls)


def convert_experts(module: nn.Module, recipe: Recipe) -> nn.Module:
    """Make ``module`` (an experts module, :func:`is_experts_module`) run its GEMMs in FP8, in
    place: same object, parameters and hooks; returns it."""
    module.__class__ = _fp8_class(type(module))
    module._fp8_setup(recipe)
    return module
