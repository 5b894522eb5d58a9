"""FP8 grouped linear: the experts' GEMMs as one autograd function, ``y[rows of e] = x_e @ W_e.T``.

The routed token rows, sorted by expert, and a stack of expert weights are cast with one scale
per expert per role (:mod:`.expert_casts`); fprop, dgrad and wgrad are grouped FP8 GEMMs with
FP32 accumulation (:mod:`fp8_plugin.numerics.grouped_gemm`). :class:`~.experts.FP8ExpertsMixin`
calls it for each projection; the reference checks call it to replay one GEMM.

Token scaling (``token_scaling``): the weights follow the recipe (delayed scaling: each
expert's amax history; current scaling: its own amax), and so do the token rows (input in
fprop, grad_output in the backward) with ``"recipe"``. With ``"current"`` (the default) the
token rows of each expert are scaled by their own amax at the cast, TE's current-scaling
formula ``fp8_max / amax / 2**margin``, whatever the recipe, and recorded as current scaling
records (the amax and scale of the last cast, for statistics; no delayed update). Why: an
expert's rows are the tokens its router sent it this step, so its history covers only the
tokens it happened to see, and a young history (the first steps, an expert the router rarely
picks) saturates on a token larger than all it saw: measured on the SmolLM2 upcycle over its
first 4 FP8 steps (docs/moe.md, "Fidelity"), per-expert delayed histories fell to 0.1 dB SQNR
(an expert's ``down_proj`` fprop and wgrad at step 1), token scaling kept every expert GEMM at
22 dB or more. The cost: the fused cast reads the rows twice (the amax pass, then the cast)
instead of once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..numerics.device_kind import fp8_family
from ..numerics.formats import fp8_dtype
from ..numerics.grouped_gemm import group_offsets, grouped_gemm, grouped_gemm_wgrad
from ..numerics.quantizers import GRAD_OUTPUT, INPUT, WEIGHT, QuantizedTensor, ScalingState, mark_recorded
from ..numerics.recipes import DelayedScaling, Float8CurrentScaling, Recipe
from ..numerics.device import recipe_name
from .expert_casts import cast_expert_weights, cast_rows
from .function_outputs import unaliased_output

__all__ = ["fp8_grouped_linear", "check_experts_recipe", "check_token_scaling", "EXPERT_RECIPES", "TOKEN_SCALINGS"]

# Recipes whose per-expert casts and grouped GEMMs exist.
EXPERT_RECIPES = (DelayedScaling, Float8CurrentScaling)
# How the experts' token rows (input, grad_output) are scaled: see the module docstring.
TOKEN_SCALINGS = ("current", "recipe")


def check_experts_recipe(recipe: Recipe, owner: str = "convert_model") -> None:
    """Raise unless ``recipe`` has FP8 experts (per-tensor delayed or current scaling).

    Raises:
        ValueError: a block-scaled recipe (MXFP8, 128-blockwise), naming it and the valid ones;
            a recipe whose ``override_linear_precision`` keeps GEMMs in high precision (the
            experts' grouped GEMMs have no per-GEMM switch: they would run in FP8 regardless).
    """
    override = getattr(recipe, "override_linear_precision", None)
    if override is not None and any(override):
        raise ValueError(
            f"{owner}: {recipe_name(recipe)}(override_linear_precision={tuple(override)}) cannot be applied to MoE "
            "experts (their grouped GEMMs have no per-GEMM high-precision switch); valid for experts: no override. "
            "Leave the experts in high precision with exclude=['experts'], or drop the override"
        )
    if not isinstance(recipe, EXPERT_RECIPES):
        raise ValueError(
            f"{owner}: recipe {recipe_name(recipe)} is not available for MoE experts (their grouped FP8 GEMMs are "
            "per-expert scaled only); valid for experts: DelayedScaling, Float8CurrentScaling. To keep this "
            "recipe for the linear layers, leave the experts in high precision with exclude=['experts']"
        )


def check_token_scaling(value: Any, owner: str = "token_scaling") -> str:
    """``value`` if it is one of :data:`TOKEN_SCALINGS`.

    Raises:
        ValueError: any other value, naming it and the valid ones.
    """
    if not isinstance(value, str) or value not in TOKEN_SCALINGS:
        raise ValueError(f"{owner}={value!r} is not a token scaling; valid: {', '.join(map(repr, TOKEN_SCALINGS))}")
    return value


@dataclass(frozen=True)
class _Info:
    recipe: Recipe
    record_forward: bool
    record_backward: bool
    transposed: bool
    out_dtype: torch.dtype
    own_token_scale: bool  # token rows scaled by their own amax (token_scaling "current")
    observers: tuple = ()  # statistics: called with (role, high-precision rows, their cast)


def _observe(observers: tuple, role: int, x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor,
             group_of_row: torch.Tensor) -> None:
    # Statistics only (observers attached): every row at once, each with its expert's scale, a
    # (1, cols) block scale gathered on the device. No host read: experts' row counts are never
    # needed on the host. Training without statistics never comes here.
    if x.shape[0] == 0:  # no rows routed: nothing was cast
        return
    cast = QuantizedTensor(data, scale_inv[group_of_row].unsqueeze(1), (1, data.shape[1]))
    for fn in observers:
        fn(role, x, cast)


class _FP8GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of e] = x_e @ W_e.T`` for the token rows ``x`` ``[S, K]`` sorted by expert;
    ``weight`` ``[E, N, K]`` (``[E, K, N]`` when transposed). Saves the FP8 copies (1 byte per
    value) for dgrad and wgrad, which cast grad_output per expert in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group_of_row: torch.Tensor, offsets: torch.Tensor,
                states: list[ScalingState], info: _Info, qw: torch.Tensor, sw_inv: torch.Tensor,
                tables: Optional[dict]) -> torch.Tensor:
        # qw [E, N, K] / sw_inv [E]: the weight's cast, made (or taken from the cache) before the call.
        recipe = info.recipe
        dtype = fp8_dtype(recipe.fp8_format, backward=False, family=fp8_family(x.device))
        with torch.no_grad():
            qx, sx_inv = cast_rows(x, group_of_row, states, INPUT, recipe, dtype, info.record_forward, tables,
                                   own_scale=info.own_token_scale)
            out = grouped_gemm(qx, sx_inv, qw, sw_inv, offsets, info.out_dtype, "fprop")
            if info.observers and info.record_forward:
                _observe(info.observers, INPUT, x, qx, sx_inv, group_of_row)
        ctx.save_for_backward(qx, sx_inv, qw, sw_inv, group_of_row, offsets)
        ctx.states, ctx.info, ctx.tables = states, info, tables
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        return unaliased_output(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        qx, sx_inv, qw, sw_inv, group_of_row, offsets = ctx.saved_tensors
        info: _Info = ctx.info
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        dtype = fp8_dtype(info.recipe.fp8_format, backward=True, family=fp8_family(grad_out.device))
        with torch.no_grad():
            qg, sg_inv = cast_rows(grad_out, group_of_row, ctx.states, GRAD_OUTPUT, info.recipe, dtype,
                                   info.record_backward, ctx.tables, own_scale=info.own_token_scale)
        if info.observers and info.record_backward:
            _observe(info.observers, GRAD_OUTPUT, grad_out, qg, sg_inv, group_of_row)
        if need_x:  # dgrad: g_e [m, N] @ W_e [N, K]
            grad_x = grouped_gemm(qg, sg_inv, qw.transpose(1, 2).contiguous(), sw_inv, offsets, ctx.x_dtype, "dgrad")
        if need_w:  # wgrad: g_e.T [N, m] @ x_e [m, K]
            grad_w = grouped_gemm_wgrad(qg, sg_inv, qx, sx_inv, offsets, torch.float32)
            if info.transposed:
                grad_w = grad_w.transpose(1, 2)
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, expert_of_row: torch.Tensor,
                       offsets: Optional[torch.Tensor],
                       states: list[ScalingState], recipe: Recipe, *, transposed: bool = False,
                       record_forward: bool = True, record_backward: bool = True,
                       out_dtype: Optional[torch.dtype] = None, observers: tuple = (),
                       weight_cast: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       tables: Optional[dict] = None, observe_weight: bool = True,
                       token_scaling: str = "current") -> torch.Tensor:
    """``y[rows of e] = x_e @ W_e.T`` with FP8 grouped GEMMs (fprop; dgrad and wgrad in backward).

    Args:
        x: ``[S, K]`` token rows sorted by expert, any floating dtype (differentiable).
        weight: ``[E, N, K]``, or ``[E, K, N]`` with ``transposed`` (differentiable).
        expert_of_row: int64 ``[S]``, the expert of each row (non-decreasing).
        offsets: int32 ``[E]`` on ``x``'s device, the end row of each expert's rows (torch's
            ``offs``; an expert without rows ends where the one before it does), or None to
            compute them from ``expert_of_row``
            (:func:`~fp8_plugin.numerics.grouped_gemm.group_offsets`). Never read on the host
            (except by ``observers``): the GEMMs run without a host sync and compile whole.
        states: E :class:`~fp8_plugin.numerics.quantizers.ScalingState`, one per expert, each
            with the rows input, weight, grad_output.
        recipe: :class:`~fp8_plugin.numerics.recipes.DelayedScaling` or
            :class:`~fp8_plugin.numerics.recipes.Float8CurrentScaling`: one scale per expert per
            role, from its amax history or from the tensor being cast (TE's formula
            ``fp8_max / amax / 2**margin``). E4M3 forward; the backward format for gradients.
        token_scaling: ``"current"`` (default): the token rows (``x``, and grad_output in the
            backward) scaled by each expert's own amax and recorded as current scaling does,
            whatever the recipe; ``"recipe"``: as the recipe scales them (see the module
            docstring).
        record_forward, record_backward: record the amaxes of input and weight / of grad_output
            (training casts).
        out_dtype: the output dtype; None means ``x``'s.
        observers: callables ``(role, rows, cast)`` given the high-precision rows of every
            expert at once (``x``'s ``[S, K]``; the weight's ``[E * N, K]``) and their
            :class:`QuantizedTensor` with each row's expert's scale (a ``(1, K)`` block scale
            ``[rows, 1]``) at every recording cast (per-layer statistics), without a host read.
        weight_cast: the weight's cast from :func:`cast_expert_weights` under this recipe and
            these scales (a cache's); None casts it here.
        tables: a dict the caller keeps between calls (its module's): the fused casts' cache of
            the experts' state addresses (:func:`fp8_plugin.numerics.kernels.ops.cast_groups`);
            None builds them at each call.
        observe_weight: False leaves the weight out of ``observers`` (a frozen FP8 weight, which
            has no high-precision rows).

    Returns:
        ``[S, N]`` in ``out_dtype``. The gradients: ``x`` in its dtype, ``weight`` in its dtype
        (zeros for experts without rows), from FP8 GEMMs with FP32 accumulation.

    Raises:
        ValueError: a block-scaled recipe, a ``token_scaling`` not in :data:`TOKEN_SCALINGS`, or
            ``offsets`` whose shape or dtype do not fit.
    """
    check_experts_recipe(recipe, "fp8_grouped_linear")
    own = check_token_scaling(token_scaling, "fp8_grouped_linear: token_scaling") == "current"
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    info = _Info(recipe, record_forward, record_backward and grad, transposed, out_dtype or x.dtype, own,
                 tuple(observers))
    if weight_cast is None:
        weight_cast = cast_expert_weights(weight, states, recipe, record_forward, transposed, tables)
    qw, sw_inv = weight_cast
    if info.observers and record_forward and observe_weight:
        w = weight.detach().transpose(1, 2) if transposed else weight.detach()
        experts, n = w.shape[0], w.shape[1]
        rows_of = torch.arange(experts, device=w.device).repeat_interleave(n)  # each weight row's expert
        _observe(info.observers, WEIGHT, w.reshape(experts * n, -1), qw.reshape(experts * n, -1), sw_inv, rows_of)
    if offsets is None:
        offsets = group_offsets(expert_of_row, weight.shape[0])
    out = _FP8GroupedLinearFunction.apply(x, weight, expert_of_row, offsets, states, info, qw, sw_inv,
                                          None if torch.compiler.is_compiling() else tables)
    token_recorded = not own or not recipe.delayed()  # own-amax rows leave no delayed update pending
    for state in states:
        if record_forward:
            if token_recorded:
                mark_recorded(state, recipe, INPUT)
            mark_recorded(state, recipe, WEIGHT)
        if info.record_backward and token_recorded:
            mark_recorded(state, recipe, GRAD_OUTPUT)
    return out

