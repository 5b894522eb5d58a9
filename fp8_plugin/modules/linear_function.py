"""The autograd function of an FP8 linear layer: ``y = x @ W.T + b`` from FP8 operands cast
before the call (fprop), dgrad and wgrad from grad_output cast in the backward, any of the three
GEMMs in high precision instead where the layer says so (:class:`BackwardInfo`).

The layer (:class:`~fp8_plugin.modules.linear.FP8Linear`) does the casts and their host-side
bookkeeping; this module only multiplies, so that ``torch.compile`` traces it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..numerics.device_kind import device_kind, tensor_device_kind
from ..numerics.gemm import fp8_gemm, gemm_route
from ..numerics.kernels.ops import traced
from ..numerics.quantizers import GRAD_OUTPUT, QuantizedTensor, ScalingState, make_quantizer
from ..numerics.recipes import Recipe
from .frozen_weight import frozen_columnwise
from .function_outputs import unaliased_output

__all__ = ["BackwardInfo", "FP8LinearFunction", "StepPlan", "fp8_operands", "fprop", "high_precision_gemm",
           "output_dtype", "weight_2d"]

FPROP, DGRAD, WGRAD = 0, 1, 2
_UNRESOLVED = object()  # a GEMM route not yet asked for


def fp8_operands(qx: QuantizedTensor, qw: QuantizedTensor, qx_t: Optional[QuantizedTensor],
                 qw_t: Optional[QuantizedTensor]) -> tuple[Optional[torch.Tensor], ...]:
    """The FP8 operands of :class:`FP8LinearFunction` as it takes them, one tuple of 12 tensors or
    None: ``(x_data, x_scale_inv, w_data, w_scale_inv, xt_data, xt_scale_inv, wt_data,
    wt_scale_inv, x_gemm, w_gemm, xt_gemm, wt_gemm)``, the ``*_gemm`` being the block GEMM
    scales (``gemm_scale``). A columnwise copy absent is ``(None, None)``; its scale_inv is None
    where it is the rowwise copy's (per-tensor scaling), since torch.compile refuses one tensor
    passed twice to an autograd function. One tuple rather than 12 arguments: an autograd
    function's call costs host time per argument (about 0.5 µs each)."""
    xt_data, xt_scale_inv = _columnwise(qx_t, qx)
    wt_data, wt_scale_inv = _columnwise(qw_t, qw)
    return (qx.data, qx.scale_inv, qw.data, qw.scale_inv, xt_data, xt_scale_inv, wt_data, wt_scale_inv,
            qx.gemm_scale, qw.gemm_scale, qx_t and qx_t.gemm_scale, qw_t and qw_t.gemm_scale)


def _columnwise(q: Optional[QuantizedTensor], rowwise: QuantizedTensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    if q is None:
        return None, None
    return q.data, (None if q.scale_inv is rowwise.scale_inv else q.scale_inv)


@dataclass(frozen=True)
class BackwardInfo:
    """What one FP8 forward's GEMMs and backward need besides tensors: a hashable constant, so
    that torch.compile passes it through the autograd function unchanged. ``record``: the
    backward records grad_output's amax; ``x_block``, ``w_block``: the operands' scale blocks
    (None: per tensor); ``weight_transposed``: the weight is stored ``[in, out]`` (GPT-2's Conv1D)."""

    recipe: Recipe
    record: bool
    x_block: Optional[tuple[int, int]]
    w_block: Optional[tuple[int, int]]
    weight_transposed: bool
    gemms: tuple[bool, bool, bool] = (True, True, True)  # FP8 (True) or high precision: fprop, dgrad, wgrad
    # The recipe's use_split_accumulator per GEMM (fprop, dgrad, wgrad): plain bools, read from
    # the recipe outside the autograd function (its traced body takes constants only).
    split: tuple[bool, bool, bool] = (True, True, True)
    # The weight is kept only in FP8 (modules/frozen_weight.py): dgrad's transposed copy is made
    # in the backward from the forward's FP8 weight, and freed after.
    frozen: bool = False
    # The dtype the GEMMs run in high precision use (the autocast's high_precision_dtype), None:
    # the output dtype, as nn.Linear under torch autocast.
    high_precision: Optional[torch.dtype] = None
    # The eager step's plan (StepPlan), which made this; None in traced code. Not a constant of
    # the step: left out of the comparison and the hash.
    plan: Optional["StepPlan"] = field(default=None, compare=False, repr=False)


class StepPlan:
    """What an FP8 linear layer's eager step decides from its recipe, flags, input layout and the
    kernel settings, resolved once and kept by the layer under one key for them all, checked
    once per forward (``FP8Linear._step_info``): the quantizers of the three casts, the fused
    launch plans of the input and weight casts (None where the casts take another path), and
    each GEMM's route (:func:`gemm_route`, asked at its first call). Each of these would
    otherwise be looked up under a key of its own, every call."""

    __slots__ = ("out_dtype", "input_quantizer", "input_cast", "weight_quantizer", "weight_cast", "grad_quantizer",
                 "grad_cast", "routes")

    def __init__(self, out_dtype: torch.dtype, input_quantizer, input_cast, weight_quantizer, weight_cast,
                 grad_quantizer) -> None:
        self.out_dtype = out_dtype  # the forward's (output_dtype), part of the key
        self.input_quantizer, self.input_cast = input_quantizer, input_cast
        self.weight_quantizer, self.weight_cast = weight_quantizer, weight_cast
        self.grad_quantizer = grad_quantizer
        self.grad_cast: Optional[tuple] = None  # (grad_output's layout, its launches), at the first backward
        self.routes = [_UNRESOLVED] * 3  # fprop, dgrad, wgrad

    def grad_casts(self, grad_out: torch.Tensor, columnwise: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
        """grad_output's casts (the grad quantizer's ``quantize_pair``), through the launches
        kept for its layout: grad_output is laid out as the layer's output, step after step."""
        quantizer, kept = self.grad_quantizer, self.grad_cast
        layout = (grad_out.shape, grad_out.stride(), grad_out.dtype, columnwise)
        if kept is None or kept[0] != layout:
            cast = quantizer.eager_plan(grad_out, columnwise)
            if cast is None:
                return quantizer.quantize_pair(grad_out, columnwise=columnwise)
            kept = self.grad_cast = (layout, cast)
        return quantizer.cast_with(kept[1], grad_out, columnwise)

    def gemm(self, index: int, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor], use_split_accumulator: bool) -> torch.Tensor:
        """GEMM ``index`` (FPROP, DGRAD, WGRAD) of the step: :func:`fp8_gemm` with its kept route."""
        route = self.routes[index]
        if route is _UNRESOLVED:
            route = self.routes[index] = gemm_route(a, b, out_dtype, bias is not None, use_split_accumulator)
        return fp8_gemm(a, b, out_dtype, bias, use_split_accumulator, route=route)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer's output takes for input ``x``: torch autocast's where it is on
    for ``x``'s device kind, else ``x``'s (as ``nn.Linear``)."""
    kind = tensor_device_kind(x)
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def weight_2d(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``weight`` as ``[out_features, in_features]`` (a view), whatever the layout it is stored in."""
    return weight.t() if transposed else weight


def high_precision_gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A GEMM a layer runs in high precision: ``a [M, K] @ b [N, K].T (+ bias [N])`` in ``dtype``
    (the dtype ``nn.Linear`` computes in: torch autocast's, else the input's), outside torch
    autocast, returned ``[M, N]`` in ``out_dtype``."""
    with torch.autocast(device_kind(a.device), enabled=False):
        out = F.linear(a.to(dtype), b.to(dtype), None if bias is None else bias.to(dtype))
    return out.to(out_dtype)


def fprop(qx: QuantizedTensor, qw: QuantizedTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor],
          use_split_accumulator: bool, plan: Optional[StepPlan] = None) -> torch.Tensor:
    """fprop's FP8 GEMM, ``qx [M, K] @ qw [N, K].T (+ bias [N])`` with FP32 accumulation, as
    ``[M, N]`` in ``out_dtype`` (:func:`~fp8_plugin.numerics.gemm.fp8_gemm`, through ``plan``'s
    route where given). Every FP8 GEMM of an FP8 linear layer is called from this module: the
    forward of :class:`FP8LinearFunction`, and the layer itself where no backward will run."""
    return _gemm(plan, FPROP, qx, qw, out_dtype, bias, use_split_accumulator)


def _gemm(plan: Optional[StepPlan], index: int, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
          bias: Optional[torch.Tensor], use_split_accumulator: bool) -> torch.Tensor:
    # GEMM ``index`` (FPROP, DGRAD, WGRAD) of a step: through its plan's kept route where it has a plan.
    if plan is not None:
        return plan.gemm(index, a, b, out_dtype, bias, use_split_accumulator)
    return fp8_gemm(a, b, out_dtype, bias, use_split_accumulator)


class FP8LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b on 2-D ``x`` from FP8 operands cast before the call; dgrad and wgrad
    are FP8 GEMMs with grad_output cast in the backward.

    Only tensors and constants go in: the casts (and their host-side bookkeeping) happen
    before the call, so that ``torch.compile`` traces it whole. ``x2d``, ``weight`` and ``bias``
    carry the gradients; ``operands`` holds the FP8 copies (:func:`fp8_operands`), of which
    ``xt_*`` and ``wt_*`` (the transposed operands the backward consumes: wgrad needs x.T, dgrad
    needs W.T) are what is saved for backward, at 1 byte per value. The output is the GEMM's own
    tensor, not a view, so that a model may modify it in place.
    """

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                operands: tuple[Optional[torch.Tensor], ...], state: ScalingState, info: BackwardInfo) -> torch.Tensor:
        (x_data, x_scale_inv, w_data, w_scale_inv, xt_data, xt_scale_inv, wt_data, wt_scale_inv,
         x_gemm, w_gemm, xt_gemm, wt_gemm) = operands
        # A tensor's rowwise and columnwise copies have blocks of one shape (1xB along each
        # copy's rows, or BxB), so one block tuple per operand serves both.
        fp8_fprop, fp8_dgrad, fp8_wgrad = info.gemms
        dtype = output_dtype(x2d) if info.plan is None else info.plan.out_dtype
        hp_dtype = info.high_precision or dtype
        if fp8_fprop:
            qx = QuantizedTensor(x_data, x_scale_inv, info.x_block, x_gemm)
            qw = QuantizedTensor(w_data, w_scale_inv, info.w_block, w_gemm)
            out = fprop(qx, qw, dtype, bias, info.split[0], info.plan)
        else:
            out = high_precision_gemm(x2d, weight_2d(weight, info.weight_transposed), hp_dtype, dtype, bias)
        # A per-tensor scale_inv serves both copies and is passed once (None for the copy). A
        # backward GEMM in high precision reads the unquantised operand instead of its FP8 copy.
        unquantised = ([] if fp8_wgrad else [x2d]) + ([] if fp8_dgrad else [weight])
        if info.frozen:  # the stored FP8 weight itself: dgrad transposes it in the backward
            wt_data, wt_scale_inv = w_data, w_scale_inv
        ctx.save_for_backward(xt_data, x_scale_inv if xt_scale_inv is None else xt_scale_inv,
                              wt_data, w_scale_inv if wt_scale_inv is None else wt_scale_inv, xt_gemm, wt_gemm,
                              *unquantised)
        ctx.state, ctx.info, ctx.x_dtype, ctx.gemm_dtype = state, info, x2d.dtype, hp_dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return unaliased_output(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        info: BackwardInfo = ctx.info
        xt_data, xt_scale_inv, wt_data, wt_scale_inv, xt_gemm, wt_gemm, *unquantised = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        _, fp8_dgrad, fp8_wgrad = info.gemms
        x2d = None if fp8_wgrad else unquantised[0]
        weight = None if fp8_dgrad else unquantised[-1]
        fp8_x, fp8_w = need_x and fp8_dgrad, need_w and fp8_wgrad
        grad_x = grad_w = grad_b = None
        bias_sum = None  # grad_out.sum(0) in float32, from the grad_output cast where it runs
        # The forward's step plan, unless this backward is traced (compiled autograd, a dispatch mode).
        plan = info.plan if info.plan is not None and not traced(grad_out) else None
        if fp8_x or fp8_w:
            quantizer = (plan.grad_quantizer if plan is not None
                         else make_quantizer(info.recipe, GRAD_OUTPUT, ctx.state, info.record, host=False))
            if need_b:  # the bias gradient in the same pass over grad_out (TE's bgrad_quantize)
                qg, qg_t, bias_sum = quantizer.quantize_pair_and_sum(grad_out, columnwise=fp8_w)
            elif plan is not None:
                qg, qg_t = plan.grad_casts(grad_out, fp8_w)
            else:
                qg, qg_t = quantizer.quantize_pair(grad_out, columnwise=fp8_w)
        if fp8_x:  # dgrad [M, K] = g [M, N] @ W [N, K]
            qw_t = QuantizedTensor(wt_data, wt_scale_inv, info.w_block, wt_gemm)
            if info.frozen:
                qw_t = frozen_columnwise(qw_t, info.recipe)
            grad_x = _gemm(plan, DGRAD, qg, qw_t, ctx.x_dtype, None, info.split[1])
            del qw_t, qg  # grad_output's rowwise cast is dgrad's alone: freed before wgrad allocates
        elif need_x:
            w_t = weight_2d(weight, info.weight_transposed).t()  # [K, N]: W.T, as F.linear's b
            grad_x = high_precision_gemm(grad_out, w_t, ctx.gemm_dtype, ctx.x_dtype)
        if need_w:  # wgrad [N, K] = g.T [N, M] @ x [M, K]
            # Written in the weight's dtype (FP32 master weights: float32; a BF16 weight: BF16, as
            # nn.Linear's): one rounding of the FP32 accumulator, and no float32 [N, K] copy.
            if fp8_w:
                qx_t = QuantizedTensor(xt_data, xt_scale_inv, info.x_block, xt_gemm)
                grad_w = _gemm(plan, WGRAD, qg_t, qx_t, ctx.weight_dtype, None, info.split[2])
            else:
                grad_w = high_precision_gemm(grad_out.t(), x2d.t(), ctx.gemm_dtype, ctx.weight_dtype)
            if info.weight_transposed:
                grad_w = grad_w.t()
        if need_b:
            grad_b = (grad_out.to(torch.float32).sum(0) if bias_sum is None else bias_sum).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None
