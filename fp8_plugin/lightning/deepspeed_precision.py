"""``FP8DeepSpeedPrecision``: Lightning's ``DeepSpeedStrategy`` (ZeRO stages 1 to 3) with FP8.

A subclass of Lightning's ``DeepSpeedPrecision``, so DeepSpeed's own ``bf16`` / ``fp16``
settings run the non-FP8 ops and keep the FP32 master weights in its ZeRO optimizer. On top:

- ``convert_module`` swaps the linear layers for FP8 ones before the strategy hands the model
  to ``deepspeed.initialize`` (Lightning calls it right before);
- the first ``optimizer_step`` fits the FP8 training around the engine the strategy built
  (:func:`fp8_plugin.training.deepspeed_engine.attach_to_engine`; before it only the first
  micro-batch ran, with no amax reduction due yet): each ``engine.step()`` at an
  accumulation boundary, the one Lightning's ``optimizer_step`` calls,
  ends the FP8 training step with one amax reduction over DeepSpeed's data-parallel group;
  the FP8 state travels in DeepSpeed's checkpoints;
- every training forward runs under torch autocast in the compute dtype and the FP8 autocast.

Use it with ``Trainer(strategy=DeepSpeedStrategy(stage=...), plugins=[FP8DeepSpeedPrecision()])``,
or write ``Trainer(precision="fp8-hybrid", strategy="deepspeed_stage_2")``
(:mod:`fp8_plugin.lightning.precision_strings`). Per-layer FP8 statistics (``statistics=``) go
to the Trainer's loggers after each sampled optimizer step, and so do the figures of the BF16
reference checks (``reference_check=``), which run before ``engine.step()`` at the boundary on
the batch Lightning offered last (docs/reference_checks.md).

May import: :mod:`fp8_plugin.training` and below, Lightning.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..numerics.device_kind import device_kind
from ..numerics.recipes import Recipe
from ..training.core import FP8Training, Patterns, check_arguments
from ..training.deepspeed_engine import attach_to_engine, is_deepspeed_engine
from ..training.reference import ReferenceCheck, resolve_reference_check
from ..training.statistics import FP8Statistics, statistics_config
from .reference_capture import _attach_reference_capture, summarise_once

__all__ = ["FP8DeepSpeedPrecision"]

_COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_STATE_KEY = "fp8_state"


class FP8DeepSpeedPrecision(DeepSpeedPrecision):
    """Lightning's ``DeepSpeedPrecision`` with FP8 linear layers.

    Args:
        recipe: the FP8 :class:`~fp8_plugin.numerics.recipes.Recipe` (None: ``AutoRecipe()``, HYBRID).
        precision: DeepSpeed's precision of the non-FP8 ops: ``"bf16-mixed"`` (default) or
            ``"16-mixed"`` (fp16 with DeepSpeed's dynamic loss scaler).
        include, exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.
        statistics: per-layer FP8 statistics (:mod:`fp8_plugin.training.statistics`): an
            :class:`~fp8_plugin.training.statistics.FP8Statistics` or an interval in optimizer
            steps; logged on rank zero to the Trainer's loggers as ``fp8_stats/...`` at the
            sampled optimizer step (DeepSpeed's accumulated steps, 1-based). None: off.
        reference_every, reference_check: the periodic BF16 reference checks, as
            ``FP8Precision`` takes them (an interval in optimizer steps, 0 or None: off; or a
            :class:`~fp8_plugin.training.reference.ReferenceCheck`); their summary is printed
            at the end of fit.

    Attributes:
        fp8: the :class:`~fp8_plugin.training.core.FP8Training` of the model.

    Raises:
        ValueError: ``precision`` not one of ``"bf16-mixed"``, ``"16-mixed"``.
        ValueError: ``reference_every`` negative or contradicting ``reference_check``.
        TypeError: ``recipe`` not a Recipe, ``statistics`` none of the valid types, or
            ``reference_check`` not a ReferenceCheck.
    """

    def __init__(self, recipe: Optional[Recipe] = None, precision: str = "bf16-mixed", include: Patterns = None,
                 exclude: Patterns = None, statistics: Union[FP8Statistics, int, None] = None,
                 reference_every: Optional[int] = None, reference_check: Optional[ReferenceCheck] = None) -> None:
        if precision not in _COMPUTE:
            raise ValueError(f"FP8DeepSpeedPrecision(precision={precision!r}) is not supported; valid: "
                             f"{', '.join(repr(p) for p in _COMPUTE)}")
        super().__init__(precision)  # type: ignore[arg-type]
        compute_dtype = _COMPUTE[precision]
        reference_check = resolve_reference_check(reference_every, reference_check, "FP8DeepSpeedPrecision")
        self.fp8 = FP8Training(check_arguments("FP8DeepSpeedPrecision", recipe, compute_dtype), include, exclude,
                               compute_dtype, reference_check=reference_check,
                               statistics=statistics_config(statistics, "FP8DeepSpeedPrecision"))
        self._device_type = "cpu"
        self._summarised_steps = 0

    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        if self.fp8.convert(module):
            rank_zero_info(f"FP8 layers: {self.fp8.report.summary()}")
            # DeepSpeed's checkpoints carry the FP8 state beside the model's vanilla state_dict().
            self.fp8.exclude_state_from_state_dict()
            if self.fp8.reference is not None:
                _attach_reference_capture(module, self.fp8)
        return module

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> Any:
        param = next(model.parameters(), None)
        if param is not None:
            self._device_type = device_kind(param.device)
        return super().connect(model, optimizers, lr_schedulers)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        # Lightning's DeepSpeedPrecision steps the engine it finds as ``model.trainer.model``
        # (built after connect()): fitted around it before its first step (once).
        trainer = model.trainer
        engine = trainer.model
        if is_deepspeed_engine(engine):
            attach_to_engine(engine, [self.fp8], lambda runs: _log_metrics(trainer, runs))
        return super().optimizer_step(optimizer, model, closure, **kwargs)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.fp8.forward_context(self._device_type)

    def teardown(self) -> None:
        """End of fit: the reference checks' summary and report files (rank zero)."""
        self._summarised_steps = summarise_once(self.fp8, self._summarised_steps)
        super().teardown()

    def state_dict(self) -> dict[str, Any]:
        """The FP8 state (every rank calls it): settled between optimizer steps, as it stands
        between accumulated micro-batches (:meth:`~fp8_plugin.training.core.FP8Training.state_dict`)."""
        return {_STATE_KEY: self.fp8.state_dict()} if self.fp8.module is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _STATE_KEY in state_dict:
            self.fp8.load_state_dict(state_dict[_STATE_KEY], type(self).__name__)


def _log_metrics(trainer: Any, runs: list[FP8Training]) -> None:
    # After an FP8 step (engine.step() at a boundary): the sampled statistics, reduced on every
    # rank, go to the loggers on rank zero under the FP8 step's number. Where no logger takes
    # them they stay on the device: no host read in the step.
    if not (trainer.is_global_zero and trainer.loggers):
        return
    for run in runs:
        metrics = run.pop_metrics()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=run.optimizer_steps)
