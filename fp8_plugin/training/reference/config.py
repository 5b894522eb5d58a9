"""What a reference check is asked to do: :class:`ReferenceCheck` (how often, how strict, what a
failure does), checked once, and how an integration's arguments resolve into one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch



POLICIES = ("log", "warn", "fallback", "raise")


METRIC_PREFIX = "fp8_ref/"


@dataclass(frozen=True)
class ReferenceCheck:
    """Settings of the periodic BF16 reference checks.

    Args:
        every: optimizer steps between checks (the check runs on steps ``every``, ``2 * every``,
            ...); 0 turns checks off. The default, 200, keeps their cost near 1% of training
            time (a check costs about one FP8 and one BF16 forward and backward of a micro-batch,
            and the FP8 GEMMs of its per-GEMM figures; the FP8 side is the training pass itself
            where ``training_pass`` allows it).
        policy: what a failed check does: ``"log"`` (record it), ``"warn"`` (also a warning),
            ``"fallback"`` (also move layers or single GEMMs to high precision from the next
            step on, on every rank, each move kept only when a replay with it passes, see
            :func:`apply_policy`; saved in checkpoints), ``"raise"`` (stop with
            :class:`FP8ReferenceCheckError` before the optimizer step, so the weights are still
            the ones the check judged and a checkpoint can be written).
        min_sqnr_db: a layer whose output SQNR is below this fails the check. A healthy E4M3
            GEMM gives about 29 dB (both operands rounded to 3 mantissa bits: about 32 dB each,
            whose noises add); 20 dB (10% RMS error, 8x the healthy noise power) is reached
            only when values underflow or saturate (a wrong scale, an outlier channel).
        max_loss_rel_diff: the check fails when the FP8 loss differs from the reference by more
            than this fraction. Healthy FP8 stays far below 1%; 5% is a difference that shows.
        min_grad_cosine, max_grad_rel_error: the check fails when the global gradient's cosine
            similarity falls below, or its relative error rises above, these. Both defaults
            mark an FP8 gradient error as large as the gradient itself (signal-to-noise 0 dB:
            relative error 1, cosine 1 / sqrt(2) = 0.71 for an error orthogonal to the
            gradient). Healthy runs stay far from it, yet not near 1: E5M2 gradients (2
            mantissa bits) compound over depth, and a 30-layer language model in healthy FP8
            training (same final perplexity as BF16) shows cosines of 0.92 to 0.99 per micro-batch.
        fallback_worst_k: under ``"fallback"``, when a check fails on the loss or the gradients
            while no layer is under ``min_sqnr_db``, this many layers with the lowest SQNR move
            to high precision (without verification: when the check cannot replay; with it,
            the GEMMs furthest below their healthy band are tried one by one instead).
        min_gemm_sqnr_db: under ``"fallback"``, the GEMMs (fprop, dgrad, wgrad) whose own SQNR is
            below this are the first suspects of a failed check (they do not fail a check
            themselves). Healthy HYBRID GEMMs give about 28.5 dB (fprop, E4M3 x E4M3) and 24.5
            dB (dgrad, wgrad: E5M2 x E4M3) when the GEMM's products do not cancel; a wgrad whose
            sum over tokens cancels (an untrained model's) gives less: a tiny GPT-2 gave 14.5 dB
            in healthy training. 10 dB (a 30% RMS error) is below that and far above the 0 dB
            of a GEMM whose operand flushed to zero.
        max_fallback_replays: under ``"fallback"``, at most this many verification replays per
            failed check (each costs about a check): a move is kept only when a replay with it
            passes every threshold.
        fallback_blockwise: under ``"fallback"`` (and ``"raise"``, as a diagnosis), first try
            blockwise scaling (``FP8Linear.fp8_scaling = "blockwise"``: 1x128 activation and
            gradient tiles, 128x128 weight blocks) on every FP8 layer whose recipe scales per
            tensor, one replay; when it passes, halve the set while a half passes (within
            ``max_fallback_replays``) and keep the smallest: every GEMM stays in FP8 (outliers,
            the massive activations of a token or of a channel, break per-tensor scales, not
            FP8). When it fails, the high-precision moves follow as without it. On a GPU only
            where blockwise GEMMs are native. Default True.
        max_escalation_replays: under ``"fallback"`` (and ``"raise"``, as a diagnosis), when no
            candidate move restores the figures within ``max_fallback_replays``, at most this
            many steps of the escalation (:data:`ESCALATION_STEPS`, in order, each model-wide:
            dgrad in high precision, fprop in high precision, dgrad and wgrad in high
            precision, FP8 off), one replay each; the first that passes is kept. 0: no
            escalation.
        training_pass: take the due step's training forward and backward as the check's FP8
            side, instead of replaying the micro-batch in FP8, where the loop shows that they
            are the same computation (one forward in the step, the backward of its loss into
            empty ``.grad``, one process, whole parameters, no loss scaler:
            :mod:`~fp8_plugin.training.reference.training_pass`): the same figures for a third
            less work. False always replays (for a loop whose backward the check cannot see,
            such as a ``LightningModule.backward`` that scales the loss). Default True.
        output_loss: how the replay reads the loss from the model's output (Fabric and
            Accelerate replay the model's forward); default :func:`output_loss` (the output's
            ``loss``, its ``"loss"`` entry, or the output itself when it is a 0-dim tensor).
        log_layers: also log each layer's SQNR (``fp8_ref/sqnr_db/<layer>``), not only the worst.
        json_path: where to write every check's figures as JSON at the end of training.
        plot_path: where to write a PNG of FP8 against reference loss and per-layer SQNR over
            training at the end of training (needs matplotlib: ``pip install fp8-plugin[plot]``).

    Raises:
        ValueError: a setting out of its range or ``policy`` not one of :data:`POLICIES`.
        TypeError: a setting of the wrong type.
    """

    every: int = 200
    policy: str = "warn"
    min_sqnr_db: float = 20.0
    max_loss_rel_diff: float = 0.05
    min_grad_cosine: float = 0.7
    max_grad_rel_error: float = 1.0
    fallback_worst_k: int = 1
    min_gemm_sqnr_db: float = 10.0
    max_fallback_replays: int = 6
    max_escalation_replays: int = 4
    fallback_blockwise: bool = True
    training_pass: bool = True
    output_loss: Optional[Callable[[Any], torch.Tensor]] = None
    log_layers: bool = True
    json_path: Optional[str] = None
    plot_path: Optional[str] = None

    def __post_init__(self) -> None:
        _check_int("every", self.every, 0)
        _check_int("fallback_worst_k", self.fallback_worst_k, 1)
        _check_int("max_fallback_replays", self.max_fallback_replays, 0)
        _check_int("max_escalation_replays", self.max_escalation_replays, 0)
        for name in ("fallback_blockwise", "training_pass"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ReferenceCheck({name}={getattr(self, name)!r}) must be a bool")
        if self.policy not in POLICIES:
            raise ValueError(f"ReferenceCheck(policy={self.policy!r}) is not valid; valid: {', '.join(POLICIES)}")
        for name, low, high in (("min_sqnr_db", -math.inf, math.inf), ("min_gemm_sqnr_db", -math.inf, math.inf),
                                ("max_loss_rel_diff", 0.0, math.inf),
                                ("min_grad_cosine", -1.0, 1.0), ("max_grad_rel_error", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"ReferenceCheck({name}={value!r}) must be a number")
            if not low <= value <= high:
                raise ValueError(f"ReferenceCheck({name}={value!r}) is out of range; valid: [{low}, {high}]")
        if self.output_loss is not None and not callable(self.output_loss):
            raise TypeError(f"ReferenceCheck(output_loss={self.output_loss!r}) must be callable")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ReferenceCheck({name}={value!r}) must be an int >= {low}")
    if value < low:
        raise ValueError(f"ReferenceCheck({name}={value!r}) is out of range; valid: an int >= {low}")


def resolve_reference_check(reference_every: Optional[int], reference_check: Optional[ReferenceCheck],
                            owner: str) -> Optional[ReferenceCheck]:
    """The checks an integration runs, from its ``reference_every`` and ``reference_check``
    arguments (None when off).

    Raises:
        TypeError: ``reference_check`` is not a :class:`ReferenceCheck`, or ``reference_every``
            not an int.
        ValueError: ``reference_every`` negative, or both given with different intervals.
    """
    if reference_check is not None and not isinstance(reference_check, ReferenceCheck):
        raise TypeError(f"{owner}(reference_check={reference_check!r}) must be a fp8_plugin.ReferenceCheck")
    if reference_every is not None:
        if isinstance(reference_every, bool) or not isinstance(reference_every, int) or reference_every < 0:
            raise ValueError(f"{owner}(reference_every={reference_every!r}) must be an int >= 0 (0: off)")
        if reference_check is None:
            reference_check = ReferenceCheck(every=reference_every)
        elif reference_every != reference_check.every:
            raise ValueError(
                f"{owner}(reference_every={reference_every}, reference_check=ReferenceCheck(every="
                f"{reference_check.every})) contradict each other; pass one"
            )
    return reference_check if reference_check is not None and reference_check.every > 0 else None
