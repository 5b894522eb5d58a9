"""What a check does with its figures (:func:`apply_policy`: log, warn, fallback, raise) and the
one-call check of a batch (:func:`reference_check`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...numerics.device_kind import device_kind
from ...numerics.recipes import Recipe
from ..reference_report import move_text
from .config import ReferenceCheck
from .localise import BLOCKWISE, _apply_moves, _escalation_warning, _is_rank_zero, _verified_fallback, log
from .expert_layers import checked_layers
from .replay import ReferenceSide, _RNGState, capture_rng_state, compare
from .result import FP8ReferenceCheckError, ReferenceResult, judge


def apply_policy(model: nn.Module, result: ReferenceResult, config: ReferenceCheck,
                 verify: Optional[Callable[[], Optional[ReferenceResult]]] = None) -> None:
    """Judge ``result`` against ``config``'s thresholds and act on a failure as its policy says.

    Under ``"fallback"`` with ``verify`` (a replay of the checked micro-batch with the model's
    switches as they are then, returning its :class:`ReferenceResult`; judged on its loss,
    gradient and layer figures, so it may leave out the per-GEMM ones, ``compare(gemm_figures=False)``,
    and take the check's reference loss and gradients, ``compare(reference=...)``),
    a move is kept only when a replay with it passes every threshold: first blockwise scaling of the per-tensor layers
    (``ReferenceCheck.fallback_blockwise``: every GEMM stays in FP8), then the candidate moves (see :func:`_candidates`
    for the order; at most ``max_fallback_replays`` replays), then, when none passes, the
    escalation (:data:`ESCALATION_STEPS`, at most ``max_escalation_replays`` replays, with one
    warning naming the step); when nothing passes, nothing is moved. ``ReferenceResult.fallback_tried``
    records every replay with its figures before and after. Without ``verify``, the offending
    layers move unverified: those under ``min_sqnr_db``, else the ``fallback_worst_k`` lowest.

    Under ``"raise"`` with ``verify``, the same replays run as a diagnosis (nothing is kept: the
    switches stay as they were) and the error lists them with their figures.

    Raises:
        FP8ReferenceCheckError: a failed check under ``policy="raise"``.
    """
    offending = judge(result, config)
    if not result.failures or config.policy == "log":
        return
    if config.policy in ("fallback", "raise") and verify is not None:
        low_layers = [name for name, db in result.layer_sqnr_db.items() if db < config.min_sqnr_db]
        kept = _verified_fallback(model, result, config, low_layers, verify)
        if config.policy == "raise":  # a diagnosis: the switches stay as they were
            for entry in result.fallback_tried:
                entry["kept"] = False
            result.fallback_escalation = ""
            _escalation_warning(result, config)
            raise FP8ReferenceCheckError(result)
        _escalation_warning(result, config)
        _apply_moves(dict(checked_layers(model)), kept)
        result.fallback_layers = [name for name, gemm in kept if gemm is None]
        result.fallback_gemms = [f"{name}.{gemm}" for name, gemm in kept if gemm not in (None, BLOCKWISE)]
        result.fallback_blockwise = [name for name, gemm in kept if gemm == BLOCKWISE]
    elif config.policy == "raise":
        raise FP8ReferenceCheckError(result)
    elif config.policy == "fallback":
        layers = dict(checked_layers(model))
        for name in offending:
            layers[name].use_fp8 = False
        result.fallback_layers = list(offending)
    if _is_rank_zero():
        warnings.warn(f"FP8 reference check at step {result.step + 1}: {result.describe()}", stacklevel=2)
        for entry in result.fallback_tried:
            if entry["kept"]:
                where = "blockwise scaling" if entry["stage"] == "blockwise" else "high precision"
                log.warning("FP8 reference check at step %d: moved to %s: %s", result.step + 1, where,
                            move_text(entry))


def reference_check(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                    compute_dtype: torch.dtype = torch.bfloat16, config: Optional[ReferenceCheck] = None,
                    recipe: Optional[Recipe] = None, group: Optional["dist.ProcessGroup"] = None,
                    step: int = 0, rng_state: Optional[_RNGState] = None) -> ReferenceResult:
    """Run one BF16 reference check by hand (plain PyTorch): call it before ``optimizer.step()``.

    ``loss_fn(model, batch)`` runs the forward and returns the scalar loss; it runs twice, in
    FP8 and with FP8 off, from the current RNG state (restored afterwards: the training run's
    random stream is unchanged), with gradients into separate buffers: ``.grad``, the optimizer
    and the FP8 scaling state are left as they were.

    Args:
        model: a converted model (:func:`fp8_plugin.convert_model`).
        batch: passed to ``loss_fn``.
        loss_fn: ``(model, batch) -> 0-dim tensor``.
        compute_dtype: dtype of the non-FP8 ops and of the reference (torch autocast); float32: none.
        config: thresholds and policy (default ``ReferenceCheck(policy="log")``: judge, do nothing).
        recipe: the recipe of the FP8 replay (None: each layer's own).
        group: process group whose ranks' figures are summed (None: the world, when initialised).
        step: recorded in the result.
        rng_state: replay from this RNG state (:func:`capture_rng_state` taken right before the
            training forward: the same dropout masks); None: the current one.

    Returns:
        :class:`ReferenceResult` (``failures`` filled in against the thresholds).

    Raises:
        FP8ReferenceCheckError: a failed check under ``policy="raise"``.
    """
    config = config if config is not None else ReferenceCheck(policy="log")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    rng_state = rng_state if rng_state is not None else capture_rng_state(device)
    reference_side = ReferenceSide()  # the check's reference loss and gradients, taken by its verification replays
    result = compare(model, lambda: loss_fn(model, batch), rng_state=rng_state, compute_dtype=compute_dtype,
                     device_type=device_kind(device), step=step, recipe=recipe, group=group, reference=reference_side)
    if result is None:
        raise ValueError("reference_check: loss_fn returned None; it must return the 0-dim loss tensor")
    apply_policy(model, result, config, verify=lambda: compare(
        model, lambda: loss_fn(model, batch), rng_state=rng_state, compute_dtype=compute_dtype,
        device_type=device_kind(device), step=step, recipe=recipe, group=group, gemm_figures=False,
        reference=reference_side))
    return result
