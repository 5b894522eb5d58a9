"""Scheduling across the steps of a training run: :class:`ReferenceChecker`, which the loops feed
(capture at each training forward, run before the optimizer step, end the step after it).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...numerics.device_kind import device_kind
from ..reference_report import summary_text, with_written, write_reports
from .config import ReferenceCheck
from .policy import apply_policy
from .replay import ReferenceSide, _RNGState, capture_rng_state, compare, output_loss, reference_gemm_dtype
from .result import FP8ReferenceCheckError, ReferenceResult, judge
from .training_pass import TrainingPassRecorder

# How close (relative) a failed check's figures must be to the last "not FP8" check's for its
# replays not to be repeated.
_SAME_FIGURES = 0.25


class ReferenceChecker:
    """Runs the checks of one training run: when, on which micro-batch, and what they found.

    Loops feed it through :class:`~fp8_plugin.training.core.FP8Training`: ``capture`` at each
    training forward (kept only on a step that is due), ``run`` before the optimizer step,
    ``end_step`` after it. Loops that also report the forward's output and the backward's start
    and end (:attr:`training_pass`) let a check take the training pass as its FP8 side where it
    is the same computation (:mod:`.training_pass`), instead of replaying it.

    Attributes:
        config: the :class:`ReferenceCheck`.
        steps: optimizer steps ended so far (restored on resume).
        results: every check's :class:`ReferenceResult`, in order.
        check_seconds, train_seconds: time spent in checks, and in training between the first
            and the last optimizer step seen (checks included).
    """

    def __init__(self, config: ReferenceCheck) -> None:
        self.config = config
        self.steps = 0
        self.results: list[ReferenceResult] = []
        self.check_seconds = 0.0
        self.train_seconds = 0.0
        self._capture: Optional[tuple[Callable[[], torch.Tensor], _RNGState]] = None
        self._new_result: Optional[ReferenceResult] = None
        self._last_step_end: Optional[float] = None
        # The last check whose verdict was "not FP8": later checks failing the same way skip the
        # replays that could not pass then.
        self._not_fp8: Optional[ReferenceResult] = None
        self.training_pass = TrainingPassRecorder(config.output_loss or output_loss, enabled=config.training_pass)

    def due(self) -> bool:
        """Whether the step in progress is one a check runs on."""
        return (self.steps + 1) % self.config.every == 0

    def capture(self, run_replay: Callable[[], torch.Tensor], device: torch.device) -> None:
        """Keep ``run_replay`` (the micro-batch's forward returning its loss) and the RNG state
        now, at the start of its training forward, if this step is due: the last micro-batch
        of the step is the one replayed."""
        if self.due():
            self._capture = (run_replay, capture_rng_state(device))
            self.training_pass.forward_started()

    def run(self, model: nn.Module, compute_dtype: torch.dtype, group: Optional["dist.ProcessGroup"]) -> None:
        """Check the captured micro-batch, if any, and apply the policy.

        Raises:
            FP8ReferenceCheckError: a failed check under ``policy="raise"``.
        """
        if self._capture is None:
            return
        run_replay, rng_state = self._capture
        self._capture = None
        training_pass, self.training_pass.taken = self.training_pass.taken, None
        device_type = device_kind(rng_state.device) if rng_state.device is not None else "cpu"
        reference_side = ReferenceSide()  # the check's reference loss and gradients, for its verification replays

        def check(fp8_pass=None, gemm_figures=True) -> Optional[ReferenceResult]:
            return compare(model, run_replay, rng_state=rng_state, compute_dtype=compute_dtype,
                           device_type=device_type, step=self.steps, group=group,
                           reference_dtype=reference_gemm_dtype(compute_dtype, device_type), fp8_pass=fp8_pass,
                           gemm_figures=gemm_figures, reference=reference_side)

        # The verification replays of a move (apply_policy) replay the FP8 side: the moves change
        # it. They run no per-GEMM figure (the check's own figures rank the candidates) and take
        # the check's reference, running its forward alone for the layer figures.
        result = check(training_pass)
        if result is None:
            return
        self.results.append(result)
        self._new_result = result
        start = time.perf_counter()
        try:
            if self._as_before(result):
                result.verdict = (f"not FP8, as at step {self._not_fp8.step + 1} (the same failures, figures within "
                                  f"{_SAME_FIGURES:.0%}): its replays not repeated; nothing moved")
                if self.config.policy == "raise":
                    raise FP8ReferenceCheckError(result)
            else:
                apply_policy(model, result, self.config, verify=lambda: check(gemm_figures=False))
                if result.verdict:
                    self._not_fp8 = result
        finally:  # the verification replays of a failed check count as the check's time
            result.seconds += time.perf_counter() - start
            self.check_seconds += result.seconds

    def _as_before(self, result: ReferenceResult) -> bool:
        # A failure like the last "not FP8" one: the same kinds of failure, and the check's figures
        # within _SAME_FIGURES of its (relative; the cosine's distance from 1).
        before = self._not_fp8
        if before is None or self.config.policy not in ("fallback", "raise"):
            return False
        judge(result, self.config)
        if not result.failures or _kinds(result) != _kinds(before):
            return False
        pairs = ((1 - result.grad_cosine, 1 - before.grad_cosine), (result.loss_rel_diff, before.loss_rel_diff),
                 (result.grad_rel_error, before.grad_rel_error))
        return all(abs(a - b) <= _SAME_FIGURES * max(abs(a), abs(b)) for a, b in pairs)

    def end_step(self) -> None:
        """The optimizer step ended (or was skipped by the loss scaler)."""
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.train_seconds += now - self._last_step_end
        self._last_step_end = now
        self.steps += 1
        self._capture = None
        self.training_pass.reset()

    def pop_metrics(self) -> dict[str, float]:
        """The figures of the check the last step ran, once (empty when none ran)."""
        result, self._new_result = self._new_result, None
        return result.metrics(self.config.log_layers) if result is not None else {}

    def fallback_layers(self) -> list[tuple[int, str]]:
        """``(step, layer)`` of every layer the checks moved to high precision."""
        return [(r.step + 1, name) for r in self.results for name in r.fallback_layers]

    def summary(self) -> str:
        """A short text: checks run and failed, worst layers, fallbacks, overhead."""
        return summary_text(self)

    def finish(self) -> str:
        """Write the report files, then return the summary with a line per file written."""
        return with_written(self.summary(), self.write_reports())

    def write_reports(self) -> list[str]:
        """Write the JSON and PNG files the config asks for; returns their paths."""
        return write_reports(self)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "results": [r.to_dict() for r in self.results],
                "check_seconds": self.check_seconds, "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.results = [ReferenceResult.from_dict(r) for r in state["results"]]
        self.check_seconds = float(state["check_seconds"])
        self.train_seconds = float(state["train_seconds"])


def _kinds(result: ReferenceResult) -> list[str]:
    # The thresholds a check's failures name (max_loss_rel_diff, min_grad_cosine, ...), in order.
    return [re.search(r"(?:max|min)_\w+", f).group(0) for f in result.failures]

