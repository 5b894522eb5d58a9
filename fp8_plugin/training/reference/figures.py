"""The figures a replay gathers on the fly: the SQNR of each FP8 layer's output (:func:`sqnr_hook`)
and of its fprop, dgrad and wgrad GEMMs (:func:`gemm_sqnr_hooks`), and their arithmetic
(:func:`sqnr_db`, cosine, relative error).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..._private.torch_api import in_backward_pass
from ...modules.linear import FP8Linear
from ...numerics.cpu_emulation import BF16_EMULATION_SPEEDUP_REQUIRED
from ...numerics.device import bf16_matmul_speedup
from ...numerics.device_kind import device_kind, fp8_family
from ...numerics.formats import fp8_dtype
from ...numerics.gemm import forced_path, fp8_gemm, scaled_mm_supported
from ...numerics.gemm_kernels import fp8_gemm_in_bf16, fp8_values_in_bf16
from ...numerics.quantizers import GRAD_OUTPUT, INPUT, PerTensorQuantizer, QuantizedTensor, make_quantizer
from ...numerics.recipes import Recipe


def sqnr_hook(energy: torch.Tensor, recipe: Recipe, fprop_energy: Optional[torch.Tensor] = None) -> Callable:
    """A forward hook for an FP8 linear layer running in high precision (MoE experts:
    :func:`~fp8_plugin.training.reference.expert_layers.expert_sqnr_hooks`): adds the signal energy of its
    output, ``sum y^2``, to ``energy[0]`` and the energy of its FP8 output's error under
    ``recipe``, ``sum (y_fp8 - y)^2``, to ``energy[1]`` (``energy``: float64 ``[2]``, no host
    sync). The FP8 output is computed from the same input, recording nothing.

    ``fprop_energy`` (float64 ``[2]``, an :class:`~fp8_plugin.modules.linear.FP8Linear` only):
    also adds the signal energy of its GEMM, ``sum (y - b)^2`` (the output less the bias), and,
    when the layer runs its fprop GEMM in FP8, the same error energy: the fprop figure of
    :func:`gemm_sqnr_hooks`, at no further GEMM."""
    def hook(layer: FP8Linear, args: tuple, output: torch.Tensor) -> None:
        if torch.is_grad_enabled() and in_backward_pass():
            return  # an activation-checkpoint recomputation: this forward was counted already
        with torch.no_grad():
            fp8_out = layer._fp8_forward(args[0].detach(), recipe, record_forward=False, record_backward=False)
            reference = output.detach().to(torch.float64)
            energy[0] += reference.square().sum()
            noise = (fp8_out.to(torch.float64) - reference).square().sum()
            energy[1] += noise
            if fprop_energy is not None:
                gemm = reference if layer.bias is None else reference - layer.bias.detach().to(torch.float64)
                fprop_energy[0] += gemm.square().sum()
                if layer.gemms_in_fp8(recipe)[0]:  # else the fprop GEMM ran in high precision: no error
                    fprop_energy[1] += noise
    return hook


def _shared_weights(model: nn.Module) -> set[int]:
    # ids of the parameters more than one module holds (tied weights): their gradient is not one
    # layer's wgrad.
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return {key for key, n in counts.items() if n > 1}


def _has_gemm_figures(layer: nn.Module, recipe: Optional[Recipe]) -> bool:
    # FP8 linear layers that ran in FP8 in the FP8 replay (MoE experts: their output figure only).
    return recipe is not None and isinstance(layer, FP8Linear)


def gemm_sqnr_hooks(layer: FP8Linear, energy: torch.Tensor, recipe: Recipe, gemms: Sequence[bool] = (True, True, True),
                    dtype: torch.dtype = torch.float32, weight_shared: bool = False) -> list:
    """Hooks on an :class:`~fp8_plugin.modules.linear.FP8Linear` running in high precision (the
    reference replay) that measure its backward GEMMs' quantisation error; returns their handles.

    For dgrad (``dx = dy W``, row 1 of ``energy``) and wgrad (``dW = dy^T x``, row 2) it adds the
    signal energy ``sum z^2`` of the reference's own result ``z`` to ``energy[j, 0]``, and the
    noise energy ``sum (z_fp8 - z)^2`` of the same GEMM on the FP8 casts of its operands under
    ``recipe`` (current scales, recording nothing: forward format for the input ``x`` ``[M, K]``
    and the weight ``W`` ``[N, K]``, backward format for the grad_output ``dy`` ``[M, N]``,
    blocks along the reduction dim as training casts them; FP32 accumulation) to
    ``energy[j, 1]``. On a CPU whose BF16 GEMMs are at least
    :data:`BF16_FIGURES_SPEEDUP_REQUIRED` times faster than float32 ones (timed once per process,
    :func:`~fp8_plugin.numerics.device.bf16_matmul_speedup`), where the FP8 GEMM would be the
    float32 emulation, per-tensor operands are multiplied as a BF16 GEMM of their FP8 values
    (:func:`~fp8_plugin.numerics.gemm_kernels.fp8_gemm_in_bf16`: one more rounding, of at most 2^-8
    relative per output). ``energy``: float64 ``[3, 2]`` (:data:`GEMMS` order; row 0, fprop, is
    :func:`sqnr_hook`'s), no host sync.

    The reference's results are read, not recomputed: dgrad is the gradient the replay's
    backward hands to this layer's input (an identity on the input, this call's alone), wgrad the
    weight's gradient the replay's backward forms (a hook on the weight: the sum over the
    layer's calls in the micro-batch, as the FP8 side sums them; under FSDP2 a hook on the
    all-gathered weight, registered at its first forward: this rank's share, before the
    reduce-scatter); so the figures cost the FP8 GEMMs and casts alone. The FP8 dgrad runs when
    the reference's dgrad arrives, after the layer's own backward, whose weight FSDP2 and ZeRO-3
    have gathered by then. ``weight_shared`` (the weight is also another module's, or has a
    user's tensor hook, which runs first and may change the gradient): wgrad's reference is then
    recomputed per call in ``dtype`` (the reference replay's GEMM dtype), as the weight's
    gradient holds the other module's share too. The FP8 side runs when the
    backward reaches the layer's output (a tensor hook on it), and only what the training step
    computes: dgrad when ``x`` needs a gradient, wgrad when ``W`` does. A GEMM that ``gemms``
    (which GEMMs the layer ran in FP8: fprop, dgrad, wgrad) puts in high precision adds signal
    and no noise. ``x`` is held from the forward to the backward, as autograd holds it.

    Energies of a tensor are summed in float32 (pairwise, as torch's reductions sum: for ``n``
    non-negative terms a relative error at most ``ceil(log2 n) * 2^-24``, 1.2e-6 for a million
    terms, 5e-6 dB; Higham, "Accuracy and Stability of Numerical Algorithms", 4.2) and added up
    in float64.
    """
    current: list[dict] = [{}]  # the call in progress: its forward hook pairs with its pre-hook
    wgrad_fp8: list[Optional[torch.Tensor]] = [None]  # sum over the calls of the FP8 wgrad
    wgrad_pending = [False]
    needs_wgrad = layer.weight.requires_grad
    sharded_weight = needs_wgrad and not weight_shared and type(layer.weight).__name__ == "DTensor"

    def dgrad_done(call: dict, dx: torch.Tensor) -> None:  # the reference's own dgrad of one call
        with torch.no_grad():
            z = dx.detach().reshape(-1, layer.in_features).float()
            energy[1, 0] += z.square().sum()
            qg = call.pop("dgrad", None)
            if qg is not None:
                # dx [M, K] = dy [M, N] @ W [N, K], on the weight's transposed FP8 copy as cached.
                # Here, not when dy arrives: the layer's backward has just read its weight, which
                # ZeRO-3 gathers only after the hooks on the layer's output have run.
                fp8 = _figure_gemm(qg, layer._weight_casts(recipe, False, columnwise=True)[1])
                energy[1, 1] += fp8.sub_(z).square_().sum()  # the figure's own tensor: in place

    gathered_hooks: dict[int, Any] = {}  # FSDP2: the gathered weight's wgrad hook, by tensor id

    def pre_hook(module: FP8Linear, args: tuple):
        call: dict = {}
        current[0] = call
        if sharded_weight and id(module.weight) not in gathered_hooks:
            # Under FSDP2 the weight the GEMMs read is the all-gathered one (a tensor of its own,
            # kept across gathers); the sharded DTensor gets its .grad from the reduce-scatter,
            # not from autograd: the reference wgrad is read on the gathered weight, per rank.
            gathered_hooks[id(module.weight)] = module.weight.register_hook(weight_done)
        x = args[0]
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            return (_Tap.apply(x, functools.partial(dgrad_done, call)), *args[1:])
        return None

    def hook(module: FP8Linear, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # Fires once per backward through this output: a non-reentrant checkpoint's recomputed
            # output is not on the loss's graph, a reentrant one's original output needs no grad.
            call, x, needs_dgrad = current[0], args[0].detach(), args[0].requires_grad
            output.register_hook(lambda grad: backward(call, x, grad, needs_dgrad))

    def backward(call: dict, x: torch.Tensor, grad: torch.Tensor, needs_dgrad: bool) -> None:
        with torch.no_grad():
            g = grad.detach().reshape(-1, layer.out_features)  # [M, N]
            fp8_dgrad, fp8_wgrad = needs_dgrad and gemms[1], needs_wgrad and gemms[2]
            qg = qg_t = None
            in_bf16 = False
            if fp8_dgrad or fp8_wgrad:  # grad_output cast once for both, as the training backward casts it
                quantizer = make_quantizer(recipe, GRAD_OUTPUT, layer.fp8_state, record=False, host=False)
                in_bf16 = _figures_in_bf16(quantizer, g.device)
                qg, qg_t = _figure_casts(quantizer, g, fp8_wgrad, in_bf16)
            if fp8_dgrad:  # its FP8 GEMM runs when the reference's dgrad arrives (dgrad_done)
                call["dgrad"] = qg
            if not needs_wgrad:
                return
            x2d = x.reshape(-1, layer.in_features)  # dW [N, K] = dy^T [N, M] @ x [M, K]
            qx_t = None
            if fp8_wgrad:  # x^T [K, M], blocks along M; one scale per tensor: the transposed cast
                quantizer = make_quantizer(recipe, INPUT, layer.fp8_state.input_source, record=False, host=False)
                qx_t = _figure_casts(quantizer, x2d, True, in_bf16)[1] if isinstance(quantizer, PerTensorQuantizer) \
                    else quantizer.quantize(x2d.t().contiguous())
            x_t = x2d.t()
            if weight_shared:
                _gemm_energy(energy[2], dtype, g.t(), x_t, qg_t, qx_t)
                return
            wgrad_pending[0] = True
            if fp8_wgrad:
                fp8 = _figure_gemm(qg_t, qx_t)
                wgrad_fp8[0] = fp8 if wgrad_fp8[0] is None else wgrad_fp8[0].add_(fp8)

    def weight_done(grad_w: torch.Tensor) -> None:  # the reference's own wgrad, over the layer's calls
        if not wgrad_pending[0]:
            return
        with torch.no_grad():
            z = (grad_w.t() if layer.weight_transposed else grad_w).detach().float()
            energy[2, 0] += z.square().sum()
            if wgrad_fp8[0] is not None:
                energy[2, 1] += wgrad_fp8[0].sub_(z).square_().sum()
        wgrad_fp8[0], wgrad_pending[0] = None, False

    # The forward hook after a layer's own FSDP2 post-forward hook: FSDP's hook on the output, which
    # all-gathers the weight again for the backward, then fires before this one's.
    handles = [layer.register_forward_pre_hook(pre_hook), layer.register_forward_hook(hook),
               _Removal(gathered_hooks)]
    if needs_wgrad and not weight_shared and not sharded_weight:
        handles.append(layer.weight.register_hook(weight_done))
    return handles


class _Removal:
    """A handle removing the hooks a replay registered as it went (``{key: handle}``)."""

    def __init__(self, hooks: dict) -> None:
        self.hooks = hooks

    def remove(self) -> None:
        for handle in self.hooks.values():
            handle.remove()
        self.hooks.clear()


# A BF16 GEMM must be this many times faster than a float32 one for the figures to use it: the
# threshold of the CPU emulation's own choice.
BF16_FIGURES_SPEEDUP_REQUIRED = BF16_EMULATION_SPEEDUP_REQUIRED


def _figures_in_bf16(grad_quantizer, device: torch.device) -> bool:
    # Whether a layer's dgrad and wgrad figures multiply as BF16 GEMMs of the FP8 values
    # (fp8_gemm_in_bf16: one more rounding, 2^-8 relative, moving a figure near its band by
    # under 0.01 dB): per-tensor casts, on a CPU where the FP8 GEMM of the grad_output with a
    # forward-format operand would be the float32 emulation and BF16 GEMMs are clearly faster
    # than float32 ones. These two GEMMs per layer are most of what the figures add to a check.
    if not isinstance(grad_quantizer, PerTensorQuantizer) or device.type != "cpu" or forced_path() is not None:
        return False
    one = torch.ones(())  # scaled_mm_supported reads dtypes, blocks and the device alone
    pairing = [QuantizedTensor(torch.zeros(1, 1, dtype=dtype), one)
               for dtype in (grad_quantizer.dtype, fp8_dtype(grad_quantizer.recipe.fp8_format, backward=False,
                                                        family=fp8_family(device)))]
    return not scaled_mm_supported(*pairing)[0] and _cpu_bf16_is_faster()


def _figure_casts(quantizer, x: torch.Tensor, columnwise: bool,
                  in_bf16: bool) -> tuple[QuantizedTensor, Optional[QuantizedTensor]]:
    # quantize_pair, or for BF16 figures the per-tensor cast's FP8 values once in bfloat16 (exact)
    # and the columnwise operand a transposed view of them: one scale, the same values.
    if not in_bf16:
        return quantizer.quantize_pair(x, columnwise=columnwise)
    row = quantizer.quantize(x)
    row = QuantizedTensor(fp8_values_in_bf16(row.data), row.scale_inv)
    return row, (QuantizedTensor(row.data.t(), row.scale_inv) if columnwise else None)


def _figure_gemm(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    # The FP8 GEMM of a per-GEMM figure, float32 [M, N] and the caller's to overwrite.
    if a.data.dtype == torch.bfloat16:  # cast by _figure_casts for BF16 figures
        return fp8_gemm_in_bf16(a, b)
    return fp8_gemm(a, b, torch.float32)


def _cpu_bf16_is_faster() -> bool:  # bf16_matmul_speedup times once per process
    return bf16_matmul_speedup("cpu")[0] >= BF16_FIGURES_SPEEDUP_REQUIRED


class _Tap(torch.autograd.Function):
    """The identity on a layer's input, whose backward hands ``sink`` the gradient it receives:
    the input's gradient from that layer alone (its dgrad), before other uses of the input add
    theirs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.sink(grad)
        return grad, None


def _gemm_energy(energy: torch.Tensor, dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor,
                 qa: Optional[QuantizedTensor], qb: Optional[QuantizedTensor]) -> None:
    # a [M, K] @ b [N, K]^T in ``dtype`` on the unquantised operands; and, unless the GEMM runs
    # in high precision (no casts: no quantisation error), the FP8 GEMM on their casts ``qa``,
    # ``qb`` (row-wise: blocks along K, the reduction dim, as the training GEMM's operands).
    with torch.autocast(device_kind(a.device), enabled=False):
        exact = (a.to(dtype) @ b.to(dtype).t()).float()
    energy[0] += exact.square().sum()
    if qa is not None:
        energy[1] += _figure_gemm(qa, qb).sub_(exact).square_().sum()


def _cosine(dot: float, a2: float, b2: float) -> float:
    if a2 == 0 or b2 == 0:
        return 1.0 if a2 == b2 else 0.0
    return dot / math.sqrt(a2 * b2)


def _rel_error(ref2: float, diff2: float) -> float:
    if ref2 == 0:
        return 0.0 if diff2 == 0 else math.inf
    return math.sqrt(diff2 / ref2)


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB; ``inf`` for an exact output, ``-inf`` for a zero signal."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
