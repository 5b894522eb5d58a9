"""transformers' ``Trainer`` with FP8: ``FP8Trainer`` is a drop-in for ``Trainer``.

It runs the Trainer on :class:`fp8_plugin.accelerate.Accelerator` with ``mixed_precision="fp8"``;
the Trainer's own precision setting becomes the dtype of the non-FP8 ops (``bf16=True``: BF16;
``fp16=True``: FP16 with Accelerate's loss scaler; neither: float32). Everything else is the
Trainer's: the model is converted when the Trainer prepares it, each optimizer step ends an FP8
training step (one amax reduction per step across processes, however many accumulated
micro-batches), evaluation runs in high precision, ``save_model`` writes a vanilla checkpoint.
``accelerate launch`` with a config file saying ``mixed_precision: fp8`` works too: the
``fp8_config`` keys apply as in :mod:`fp8_plugin.accelerate.settings`.

With ``fp8_reference_every`` (or ``fp8_reference_check``, or the config file's
``reference_every``) the BF16 reference checks of :mod:`fp8_plugin.training.reference` run on the
Trainer's micro-batches: each optimizer step that ran a check is logged (``control.should_log``)
with its ``fp8_ref/...`` figures merged into the Trainer's log, so they reach
``trainer.state.log_history`` and the ``report_to`` integrations; ``train()`` ends by printing
the checks' summary on the main process and writing the report files.

Checkpoints: the Trainer saves the model through its vanilla ``state_dict()``, so the FP8 state
(scales, amax histories, layers moved to high precision, reference-check history) goes beside it,
into ``fp8_state.pt`` of each checkpoint folder (written atomically, by the main process), and
``train(resume_from_checkpoint=...)`` restores it when the Trainer prepares the model: the
resumed run continues with the scales it stopped with. A checkpoint without that file (written
by the plain ``Trainer``) resumes with a warning, its scales starting afresh.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional, Union

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import IntervalStrategy, get_last_checkpoint

from .._private.transformers_api import trainer_accelerator_class
from ..accelerate import Accelerator
from ..accelerate.settings import BASE_PRECISION
from ..numerics.recipes import Recipe
from ..training.core import Patterns
from ..training.files import atomic_write
from ..training.reference import METRIC_PREFIX as REFERENCE_PREFIX
from ..training.reference import ReferenceCheck
from ..training.statistics import METRIC_PREFIX as STATS_PREFIX
from ..training.statistics import FP8Statistics

__all__ = ["FP8Trainer", "FP8_STATE_NAME"]

# The file of each checkpoint folder that holds the FP8 state.
FP8_STATE_NAME = "fp8_state.pt"

_COMPUTE_DTYPES = {precision: dtype for dtype, precision in BASE_PRECISION.items()}


class FP8Trainer(Trainer):
    """``transformers.Trainer`` whose linear layers train in FP8.

    Args:
        *args, **kwargs: those of ``transformers.Trainer``.
        fp8_recipe: a :class:`~fp8_plugin.numerics.recipes.Recipe` or an ``"fp8-*"`` precision string;
            default: the config file's, else ``AutoRecipe()`` (HYBRID).
        fp8_include, fp8_exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.
        fp8_reference_every: run a BF16 reference check every this many optimizer steps (0:
            off); the model's output must hold the loss (the Trainer's default ``compute_loss``
            with labels in the batch), else pass ``ReferenceCheck(output_loss=...)``. One
            process or DDP.
        fp8_reference_check: a :class:`~fp8_plugin.training.reference.ReferenceCheck` (interval,
            policy, thresholds, report files).
        fp8_nonfinite, fp8_max_consecutive_skips: what an optimizer step with non-finite
            gradients does (``"skip"``, the default: not taken, and the Trainer's scheduler
            does not step either; ``"raise"``) and how many skipped steps in a row stop the run;
            see :mod:`fp8_plugin.training.faults`.
        fp8_statistics: per-layer FP8 statistics (:mod:`fp8_plugin.training.statistics`): an
            :class:`~fp8_plugin.training.statistics.FP8Statistics` or an interval in optimizer steps;
            merged into the Trainer's logs as ``fp8_stats/...``. None: off.
        fp8_calibration_steps: the first this many optimizer steps train in the reference
            precision and calibrate every FP8 layer's scales and scaling
            (:func:`fp8_plugin.calibrate`'s work, from the training batches); the report is
            ``trainer.accelerator.fp8_runs[0].calibration``. None or 0: off. Evaluation
            (``trainer.evaluate``) runs in the reference precision unless Accelerate's
            ``use_autocast_during_eval`` is set in the config file.
        peft_config: a PEFT config (``peft.LoraConfig``...): the model is wrapped by
            ``peft.get_peft_model(model, peft_config)`` before the Trainer sees it, as TRL's
            ``SFTTrainer`` does; the base layers' frozen weights are then kept only in FP8 when
            the Trainer prepares the model (:func:`fp8_plugin.convert_model`'s ``frozen_weights``).
            A PEFT model handed in as ``model`` works the same.
        fp8_print_figures: also print the FP8 figures (``fp8_stats/...``, ``fp8_ref/...``) on
            the console with the Trainer's other logs. Default False: they reach
            ``trainer.state.log_history`` and the ``report_to`` integrations only (a 12-layer
            model has hundreds of statistics per sampled step).

    Attributes:
        accelerator: a :class:`fp8_plugin.accelerate.Accelerator`; ``accelerator.fp8_reports``
            says which layers run in FP8 once training started.

    Raises:
        ValueError: as :class:`fp8_plugin.accelerate.Accelerator` (bad or contradictory FP8
            settings, reference checks under FSDP1), when the Trainer is built.
            ``TrainingArguments(deepspeed=...)`` runs DeepSpeed ZeRO 1-3 (docs/deepspeed.md).
        TypeError: ``fp8_reference_check`` not a ReferenceCheck.
        RuntimeError: a transformers version that builds its Accelerator differently.
    """

    def __init__(self, *args: Any, fp8_recipe: Union[Recipe, str, None] = None, fp8_include: Patterns = None,
                 fp8_exclude: Patterns = None, fp8_reference_every: Optional[int] = None,
                 fp8_reference_check: Optional[ReferenceCheck] = None, fp8_nonfinite: Optional[str] = None,
                 fp8_max_consecutive_skips: Optional[int] = None,
                 fp8_statistics: Union[FP8Statistics, int, None] = None, fp8_print_figures: bool = False,
                 fp8_calibration_steps: Optional[int] = None, peft_config: Any = None, **kwargs: Any) -> None:
        self._fp8_arguments = {"fp8_recipe": fp8_recipe, "fp8_include": fp8_include, "fp8_exclude": fp8_exclude,
                               "fp8_reference_every": fp8_reference_every,
                               "fp8_reference_check": fp8_reference_check, "fp8_nonfinite": fp8_nonfinite,
                               "fp8_max_consecutive_skips": fp8_max_consecutive_skips,
                               "fp8_statistics": fp8_statistics, "fp8_calibration_steps": fp8_calibration_steps}
        if peft_config is not None:
            args, kwargs = _with_peft(args, kwargs, peft_config)
        super().__init__(*args, **kwargs)
        settings = self.accelerator.fp8_settings
        if settings is not None and settings.reference_check is not None:
            self.add_callback(_LogReferenceChecks(self.accelerator))
        if not fp8_print_figures:
            for console, quiet in _QUIET_CONSOLE.items():
                if self.callback_handler.pop_callback(console) is not None:
                    self.add_callback(quiet)

    def create_accelerator_and_postprocess(self) -> None:
        factory = functools.partial(_fp8_accelerator, **self._fp8_arguments)
        with trainer_accelerator_class(factory):
            super().create_accelerator_and_postprocess()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with the figures of the reference checks run since the last
        log (``fp8_ref/...``) merged in."""
        accelerator = getattr(self, "accelerator", None)
        metrics = accelerator.fp8_reference_metrics() if isinstance(accelerator, Accelerator) else {}
        super().log({**logs, **metrics} if metrics else logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; resuming, it also restores the checkpoint's FP8 state
        (``fp8_state.pt``); at the end, with reference checks on, their summary is printed on
        the main process and their report files written (``ReferenceCheck.json_path``,
        ``plot_path``).

        Raises:
            RuntimeError: the checkpoint's FP8 state is corrupted (named; nothing of it loaded).
        """
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # as the Trainer resolves it
        if isinstance(path, (str, os.PathLike)) and self.accelerator.fp8_settings is not None:
            file = os.path.join(path, FP8_STATE_NAME)
            if os.path.isfile(file):
                self.accelerator.load_fp8_state_dict(torch.load(file, map_location="cpu", weights_only=True))
            else:
                warnings.warn(f"{path} holds no {FP8_STATE_NAME}: the FP8 scales start afresh", stacklevel=2)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.accelerator.print_fp8_reference_summary()
        return output

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (a vanilla checkpoint), plus the FP8 state in
        ``fp8_state.pt`` beside it once a model was prepared. Called on every process, as the
        Trainer does; only the main process writes."""
        super().save_model(output_dir, _internal_call=_internal_call)
        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, Accelerator) and accelerator.fp8_runs:
            state = accelerator.fp8_state_dict()  # on every process: it may reduce pending amaxes
            if self.args.should_save:
                path = os.path.join(output_dir if output_dir is not None else self.args.output_dir, FP8_STATE_NAME)
                atomic_write(path, lambda f: torch.save(state, f), mode="wb")


class _LogReferenceChecks(TrainerCallback):
    """Log the step of each reference check: its figures then reach the Trainer's log at their
    own step, whatever ``logging_steps`` (not under ``logging_strategy="no"``)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.accelerator._fp8_reference_pending and args.logging_strategy != IntervalStrategy.NO:
            control.should_log = True
        return control


def _without_fp8_figures(logs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not logs:
        return logs
    return {key: value for key, value in logs.items() if not key.startswith((STATS_PREFIX, REFERENCE_PREFIX))}


class _QuietProgressCallback(ProgressCallback):
    """The Trainer's progress bar, printing its logs without the FP8 figures."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> Any:
        return super().on_log(args, state, control, logs=_without_fp8_figures(logs), **kwargs)


class _QuietPrinterCallback(PrinterCallback):
    """The Trainer's log printer (``disable_tqdm=True``), without the FP8 figures."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> Any:
        return super().on_log(args, state, control, logs=_without_fp8_figures(logs), **kwargs)


# The Trainer's console callbacks and their quiet twins: only these print the logs; the
# report_to integrations and log_history still get every figure.
_QUIET_CONSOLE = {ProgressCallback: _QuietProgressCallback, PrinterCallback: _QuietPrinterCallback}


def _fp8_accelerator(mixed_precision: Optional[str] = None, **kwargs: Any) -> Accelerator:
    # The Trainer's precision ("bf16", "fp16", "no", or "fp8" from accelerate launch) picks the
    # dtype of the non-FP8 ops; "fp8" leaves it to the config file and the defaults.
    compute_dtype = _COMPUTE_DTYPES.get(str(mixed_precision).lower())
    return Accelerator(mixed_precision="fp8", fp8_compute_dtype=compute_dtype, **kwargs)


def _with_peft(args: tuple, kwargs: dict, peft_config: Any) -> tuple[tuple, dict]:
    # The Trainer's model (its first argument, or model=) wrapped in PEFT's adapters.
    from peft import get_peft_model

    if "model" in kwargs:
        kwargs = {**kwargs, "model": get_peft_model(kwargs["model"], peft_config)}
    elif args:
        args = (get_peft_model(args[0], peft_config), *args[1:])
    else:
        raise ValueError("FP8Trainer: peft_config needs a model to wrap; valid: pass model=...")
    return args, kwargs

