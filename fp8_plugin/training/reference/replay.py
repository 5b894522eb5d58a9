"""The replay: the checked micro-batch run again from its training forward's RNG state, in FP8 and
in the reference precision, each into gradient buffers of its own, and the two compared
(:func:`compare`); the model's buffers, the RNG stream and ``.grad`` come back untouched.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..._private.torch_api import has_tensor_hooks
from ...modules.autocast import fp8_forward_count, replay
from ...modules.linear import FP8Linear
from ...numerics.device import bf16_matmul_is_fast
from ...numerics.device_kind import device_kind
from ...numerics.recipes import GEMMS, Recipe
from .expert_layers import ExpertLayer, checked_layers, expert_gemm_names, expert_sqnr_hooks
from .figures import _cosine, _has_gemm_figures, _rel_error, _shared_weights, gemm_sqnr_hooks, sqnr_db, sqnr_hook
from .gradients import FSDP2, WHOLE, fp8_weights, grad_stats, gradient_layout, take_gradients, trainable_parameters
from .result import ReferenceResult
from .training_pass import TrainingPass


def output_loss(output: Any) -> torch.Tensor:
    """The loss in a model's output: ``output.loss`` (transformers), ``output["loss"]``, or the
    output itself when it is a 0-dim tensor.

    Raises:
        ValueError: none of these; pass ``ReferenceCheck(output_loss=...)``.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"The reference check found no scalar loss in the model's output ({type(output).__name__}); valid: an "
            "output with .loss or ['loss'], or a 0-dim tensor. Pass ReferenceCheck(output_loss=fn) to read it"
        )
    return loss if loss.dim() == 0 else loss.reshape(())  # the tensor itself where it can: training_pass.py


@dataclass
class ReferenceSide:
    """The reference replay's loss and gradients of one micro-batch, kept for the verification
    replays of the same micro-batch (:func:`compare`'s ``reference``).

    The reference does not depend on a move: with FP8 off every FP8 layer computes in the
    reference dtype whatever its switches say, from the same parameters, buffers and RNG state.
    So a move's verification replay takes the check's reference loss and gradients from here and
    runs the reference forward alone, for the layer figures. Empty until a compare fills it.

    Attributes:
        names: the trainable parameters' names the gradients are of (None: empty).
        loss: the reference loss, float32 0-dim.
        grads: per parameter in ``names``, its gradient (or this rank's part of it) or None.
    """

    names: Optional[list[str]] = None
    loss: Optional[torch.Tensor] = None
    grads: Optional[list[Optional[torch.Tensor]]] = None


@dataclass(frozen=True)
class _RNGState:
    cpu: torch.Tensor
    device: Optional[torch.device]
    device_state: Optional[torch.Tensor]


def capture_rng_state(device: torch.device) -> _RNGState:
    """The CPU RNG state and, on CUDA, the device's: what a training forward draws dropout from."""
    device = torch.device(device)
    if device_kind(device) == "cuda":
        return _RNGState(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
    return _RNGState(torch.get_rng_state(), None, None)


def _restore_rng_state(state: _RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.device is not None:
        torch.cuda.set_rng_state(state.device_state, state.device)


def compare(model: nn.Module, run_replay: Callable[[], torch.Tensor], *, rng_state: _RNGState,
            compute_dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu", step: int = 0,
            recipe: Optional[Recipe] = None, reference_dtype: Optional[torch.dtype] = None,
            group: Optional["dist.ProcessGroup"] = None,
            fp8_pass: Optional[TrainingPass] = None, gemm_figures: bool = True,
            reference: Optional[ReferenceSide] = None) -> Optional[ReferenceResult]:
    """Replay one micro-batch in FP8 and in high precision and compare (no policy applied).

    Returns None, comparing nothing, when ``run_replay`` returns None (a loop that skips the
    micro-batch, as Lightning does when ``training_step`` returns None).

    Gradients (:mod:`.gradients`): with whole parameters (one process, DDP, ZeRO-1 and 2) each
    rank takes its own micro-batch's gradients with ``torch.autograd.grad`` (no DDP all-reduce,
    no ZeRO hook), and the figures sum the ranks' ``<g8, gr>``, ``|g8|^2``, ... With FSDP2-sharded
    parameters (``fully_shard``: DTensors) each replay runs FSDP's own backward (its all-gathers,
    one module's parameters at a time; its reduce-scatter, averaging over the ranks) into the
    sharded ``.grad``, which is taken and cleared; training's ``.grad`` is set aside and put back.
    Under ZeRO-3 each parameter's gradient is reduce-scattered (averaged) as it is formed, and
    this rank keeps its part. In these two the figures sum the ranks' products over their parts:
    those of the whole averaged gradient, not of a part. Per rank a check then holds the two
    replays' parts of the gradients (twice the trainable parameters' bytes over the ranks) and
    one micro-batch's activations, as a training step does.

    Args:
        model: the converted model whose parameters and FP8 layers are compared.
        run_replay: runs the micro-batch's forward through ``model`` and returns its scalar loss.
        rng_state: the RNG state at the start of the training forward being replayed.
        compute_dtype: dtype of the non-FP8 ops (torch autocast; float32: none); the reference
            runs the FP8 layers in it too.
        device_type: the autocast device type.
        step: recorded in the result.
        recipe: the recipe the FP8 replay runs (None: each layer's own, as in training).
        reference_dtype: the dtype the reference runs the FP8 layers' GEMMs in, outside torch
            autocast (None: ``compute_dtype``, as ``nn.Linear`` would under autocast), and the FP8
            replay the GEMMs it runs in high precision (a move being verified: as training runs
            them, :func:`fp8_plugin.autocast`'s ``high_precision_dtype``); the other ops run in
            ``compute_dtype`` either way.
        group: process group whose ranks' figures are summed; None means the world when
            torch.distributed is initialised (every rank of it must call this together).
        fp8_pass: the training step's own FP8 pass of this micro-batch (:mod:`.training_pass`):
            its loss and gradients are the FP8 side, and only the reference is replayed. Taken
            only with ``recipe`` None and for the parameters compared here (else the FP8 side
            is replayed).
        gemm_figures: measure each FP8 linear layer's dgrad and wgrad on its own (its two FP8
            GEMMs again, in the reference's backward: ``gemm_sqnr_db``); False leaves them out
            of ``gemm_sqnr_db`` (fprop's, which costs no further GEMM, stays). A move's
            verification replay (:func:`~fp8_plugin.training.reference.policy.apply_policy`) is
            judged without them, and saves two of its nine GEMMs per layer.
        reference: an empty :class:`ReferenceSide` is filled with this replay's reference loss
            and gradients; a filled one (of the same trainable parameters) is taken as the
            reference's, and the reference runs its forward alone, without gradients, for the
            layer figures: a move's verification replay (:func:`~fp8_plugin.training.reference.
            policy.apply_policy`) then saves the reference backward, a third of its work.
            None: the reference is replayed whole and not kept.

    Raises:
        ValueError: the replay's loss is not a scalar tensor, or ``model`` is partly sharded, or
            its FP8 weights are all-gathered in FP8 (:func:`.gradients.gradient_layout`), or
            a filled ``reference`` with ``gemm_figures`` True (the dgrad and wgrad figures need
            the reference backward) or for other parameters.
    """
    start = time.perf_counter()
    names, params = trainable_parameters(model)
    kept = reference is not None and reference.names is not None
    if kept and (gemm_figures or reference.names != names):
        why = ("gemm_figures=True: the dgrad and wgrad figures need the reference backward" if gemm_figures
               else "its gradients are of other parameters than the model's trainable ones now")
        raise ValueError(f"compare: the kept reference cannot be taken ({why}); pass reference=None to replay it whole")
    every_layer = checked_layers(model)
    layout = gradient_layout(names, params, fp8_weights(every_layer))
    layers = [(name, layer) for name, layer in every_layer if layer.use_fp8]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [rng_state.device] if rng_state.device is not None else []
    # FSDP2: each replay's backward reduce-scatters into .grad; training's gradients wait aside.
    training_grads = [p.grad for p in params] if layout == FSDP2 else []
    replay_step = functools.partial(_replay, layout=layout, group=group)
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_kind(devices[0]) if devices else "cuda"):
            if fp8_pass is not None and recipe is None and fp8_pass.matches(names):
                # The training pass ran this micro-batch in FP8 already: the same guard as a replay's.
                _check_fp8_forwards(True, fp8_pass.fp8_forwards, _ran_fp8(layers))
                loss_fp8, grads_fp8 = fp8_pass.loss, fp8_pass.grads
            else:
                # The FP8 replay's high-precision GEMMs (a move being verified) in reference_dtype, as
                # training runs them.
                replayed = replay_step(run_replay, params, rng_state, True, compute_dtype, device_type, recipe,
                                       reference_dtype, fp8_layers=_ran_fp8(layers))
                if replayed is None:
                    return None
                loss_fp8, grads_fp8 = replayed
            recipes = {name: layer._forward_context.recipe if layer._forward_context else None
                       for name, layer in layers}
            # Per layer: output signal and noise; per GEMM (fprop, dgrad, wgrad) signal and noise.
            energies = torch.zeros(len(layers), 2, dtype=torch.float64, device=loss_fp8.device)
            gemm_energies = torch.zeros(len(layers), len(GEMMS), 2, dtype=torch.float64, device=loss_fp8.device)
            # prepend: before the post-forward hook of a layer FSDP2 shards on its own (which reshards).
            handles = [layer.register_forward_hook(sqnr_hook(
                energies[i], recipes[name], gemm_energies[i, 0] if _has_gemm_figures(layer, recipes[name]) else None),
                prepend=True)
                for i, (name, layer) in enumerate(layers)
                if recipes[name] is not None and isinstance(layer, FP8Linear)]
            # Each expert's own figures: its output, and per projection its fprop, dgrad and wgrad.
            expert_gemm_energies = torch.zeros(len(layers), 2, len(GEMMS), 2, dtype=torch.float64,
                                               device=loss_fp8.device)
            handles += expert_sqnr_hooks(layers, energies, recipes, expert_gemm_energies)
            gemm_dtype = reference_dtype or compute_dtype  # the dtype the reference replay's GEMMs run in
            shared = _shared_weights(model)
            handles += [handle for i, (name, layer) in enumerate(layers)
                        if gemm_figures and _has_gemm_figures(layer, recipes[name])
                        for handle in gemm_sqnr_hooks(layer, gemm_energies[i], recipes[name],
                                                      layer._forward_context.gemms, gemm_dtype,
                                                      id(layer.weight) in shared or has_tensor_hooks(layer.weight))]
            try:
                # A kept reference: its forward alone, for the layer figures (no gradient, no backward).
                replayed = replay_step(run_replay, params, rng_state, False, compute_dtype, device_type, None,
                                       reference_dtype, backward=not kept)
                loss_ref, grads_ref = (reference.loss, reference.grads) if kept else replayed
                if reference is not None and not kept:
                    reference.names, reference.loss, reference.grads = list(names), loss_ref, list(grads_ref)
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        with torch.no_grad():  # running statistics and the like: as the training forward left them
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for param, grad in zip(params, training_grads):
            param.grad = grad
    # One flat float64 tensor: the losses, the layers' signal and noise energies, and per
    # parameter <g8, gr>, |g8|^2, |gr|^2, |g8 - gr|^2; summed over ranks in one all-reduce.
    stats = [torch.stack([loss_fp8, loss_ref]).to(torch.float64), energies.flatten(), gemm_energies.flatten(),
             expert_gemm_energies.flatten()]
    for g8, gr in zip(grads_fp8, grads_ref):
        stats.append(grad_stats(g8, gr, loss_fp8.device))
    flat = torch.cat([s.to(loss_fp8.device) for s in stats])
    world = 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    values = flat.tolist()
    loss8, lossr = values[0] / world, values[1] / world
    layer_values = values[2:2 + 2 * len(layers)]
    gemm_start = 2 + 2 * len(layers)
    gemm_values = values[gemm_start:gemm_start + 2 * len(GEMMS) * len(layers)]
    expert_start = gemm_start + 2 * len(GEMMS) * len(layers)
    expert_values = values[expert_start:expert_start + 4 * len(GEMMS) * len(layers)]
    grad_values = values[expert_start + 4 * len(GEMMS) * len(layers):]
    sqnr, gemm_sqnr = {}, {}
    for i, (name, layer) in enumerate(layers):
        # An expert no token was routed to (no signal, no noise) has no figure.
        measured = isinstance(layer, FP8Linear) or layer_values[2 * i] or layer_values[2 * i + 1]
        if recipes[name] is not None and measured:
            sqnr[name] = sqnr_db(layer_values[2 * i], layer_values[2 * i + 1])
        if _has_gemm_figures(layer, recipes[name]):
            pairs = gemm_values[2 * len(GEMMS) * i:2 * len(GEMMS) * (i + 1)]
            # A GEMM that did not run (no signal, no noise) has no figure.
            gemm_sqnr[name] = _gemm_figures(pairs)
        elif isinstance(layer, ExpertLayer) and recipes[name] is not None:
            for p, proj_name in enumerate(expert_gemm_names(name, layer)):
                start = 4 * len(GEMMS) * i + 2 * len(GEMMS) * p
                figures = _gemm_figures(expert_values[start:start + 2 * len(GEMMS)])
                if figures:
                    gemm_sqnr[proj_name] = figures
    totals = [0.0, 0.0, 0.0, 0.0]
    param_figures = {}
    for i, name in enumerate(names):
        four = grad_values[4 * i:4 * i + 4]
        param_figures[name] = (_cosine(*four[:3]), _rel_error(four[2], four[3]))
        totals = [t + v for t, v in zip(totals, four)]
    return ReferenceResult(
        step=step,
        loss_fp8=loss8,
        loss_reference=lossr,
        loss_rel_diff=abs(loss8 - lossr) / abs(lossr) if lossr != 0 else (0.0 if loss8 == 0 else math.inf),
        grad_cosine=_cosine(*totals[:3]),
        grad_rel_error=_rel_error(totals[2], totals[3]),
        param_figures=param_figures,
        layer_sqnr_db=sqnr,
        gemm_sqnr_db=gemm_sqnr,
        seconds=time.perf_counter() - start,
    )


def _gemm_figures(pairs: Sequence[float]) -> dict[str, float]:
    # (signal, noise) per GEMM in GEMMS order -> SQNR; a GEMM that did not run (no signal, no
    # noise) has no figure.
    return {gemm: sqnr_db(pairs[2 * j], pairs[2 * j + 1]) for j, gemm in enumerate(GEMMS)
            if pairs[2 * j] != 0 or pairs[2 * j + 1] != 0}


def reference_gemm_dtype(compute_dtype: torch.dtype, device_type: str) -> Optional[torch.dtype]:
    """The dtype a reference check runs the FP8 layers' GEMMs in: float32 on a CPU whose BF16
    matmuls are slow (no AVX512-BF16 or AMX: tens of times slower than float32, which made a
    check cost a dozen training steps there), else None (``compute_dtype``, as in training).
    A float32 reference is the more exact one; the other ops stay in ``compute_dtype``."""
    if device_type != "cpu" or compute_dtype != torch.bfloat16:
        return None
    return None if _cpu_bf16_is_fast() else torch.float32


def _cpu_bf16_is_fast() -> bool:  # bf16_matmul_speedup times once per process
    return bf16_matmul_is_fast("cpu")[0]


def _replay(run_replay: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], rng_state: _RNGState, fp8: bool,
            compute_dtype: torch.dtype, device_type: str, recipe: Optional[Recipe],
            reference_dtype: Optional[torch.dtype] = None, fp8_layers: int = 0, layout: str = WHOLE,
            group: Optional["dist.ProcessGroup"] = None, backward: bool = True):
    # fp8_layers: the FP8 layers the FP8 replay must run in FP8 (the guard below); layout, group:
    # how the gradients are taken (gradients.py); backward False: the forward alone, under
    # no_grad (as an evaluation forward runs under DDP, FSDP2 and ZeRO-3), no gradient taken.
    _restore_rng_state(rng_state)
    before = fp8_forward_count()
    with torch.set_grad_enabled(backward), replay(fp8, recipe if fp8 else None, reference_dtype=reference_dtype), \
            torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
        loss = run_replay()
    _check_fp8_forwards(fp8, fp8_forward_count() - before, fp8_layers)
    if loss is None:
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"The reference replay must return a scalar loss tensor, got {type(loss).__name__}")
    loss = loss.reshape(())
    if not params or not loss.requires_grad or not backward:
        return loss.detach().float(), [None] * len(params)
    return loss.detach().float(), take_gradients(loss, params, layout, group)


def _ran_fp8(layers: Sequence[tuple[str, nn.Module]]) -> int:
    # The FP8 layers expected to run in FP8: a GEMM in FP8, and a last forward (if any) in FP8.
    return sum(1 for _, layer in layers if any(getattr(layer, "fp8_gemms", (True,)))
               and (layer._forward_context is None or layer._forward_context.recipe is not None))


def _check_fp8_forwards(fp8: bool, ran: int, fp8_layers: int) -> None:
    # A check that cannot fail is worse than none: the reference replay must run no FP8 GEMM,
    # and the FP8 replay some, or the two compare FP8 with FP8 (or high precision with itself).
    if not fp8 and ran:
        raise RuntimeError(
            f"FP8 reference check: the reference replay ran {ran} FP8 forwards: the replayed step enters "
            "fp8_plugin.autocast() inside the check's own FP8 switch (for example a loss_fn that wraps the model "
            "call in fp8_plugin.autocast() inside), so both replays ran in FP8 and the check could not fail; "
            "call the model in loss_fn without fp8_plugin.autocast (the check turns FP8 on and off itself)")
    if fp8 and fp8_layers and not ran:
        raise RuntimeError(
            f"FP8 reference check: the FP8 replay ran no FP8 forward, though {fp8_layers} FP8 layers ran in FP8 in "
            "training: the replayed step turns FP8 off (fp8_plugin.autocast(enabled=False) inside loss_fn) or "
            "does not call the model; call the model in loss_fn without fp8_plugin.autocast")
