"""``fp8_plugin.accelerate.Accelerator``: Accelerate's ``Accelerator`` with this project's FP8.

A thin adapter of :class:`~fp8_plugin.training.core.FP8Training` onto Accelerate. With
``mixed_precision="fp8"`` (an argument, or ``accelerate launch`` with a config file that says
so) it starts Accelerate with the base precision of the non-FP8 ops instead (``"bf16"``,
``"fp16"`` or ``"no"``), so none of Accelerate's own FP8 backends (Transformer Engine, MS-AMP,
torchao) is asked for or run, and then:

- ``prepare()`` converts every model it is given before Accelerate wraps or shards it (DDP,
  FSDP2), keeping the Parameter objects (optimizers made before stay valid; FP32 master
  weights), and makes each forward run inside the FP8 context (torch autocast for the non-FP8
  ops and :func:`fp8_plugin.autocast` with the amax all-reduce across processes);
- every prepared optimizer tells the FP8 state of its models about each optimizer step, a step
  the loss scaler skips included: the micro-batches of ``accelerator.accumulate()`` share one
  scale update and one amax reduction;
- under DeepSpeed ZeRO (stages 1 to 3, a ``DeepSpeedPlugin`` or a config file), the model is
  converted before ``deepspeed.initialize``; the engine's ``step()`` (which ``backward()`` calls
  at the accumulation boundary) ends each FP8 training step, and its checkpoints carry the FP8
  state (:mod:`fp8_plugin.training.deepspeed_engine`); reference checks are refused there;
- ``save_state`` / ``load_state`` carry the FP8 state (a registered checkpoint object) next to
  the model, optimizer, scaler and RNG states; the model's ``state_dict()`` itself stays vanilla,
  so ``unwrap_model(model).save_pretrained()`` and safetensors checkpoints work unchanged;
- with ``fp8_reference_every`` (or a ``ReferenceCheck``, an ``FP8Kwargs`` field, the config
  file's ``reference_every`` / ``reference_policy``) the BF16 reference checks of
  :mod:`fp8_plugin.training.reference` run: each training forward of a prepared model is offered for
  replay, the check runs in the optimizer step (one process or DDP), its figures go to
  ``accelerator.log`` (the trackers), the summary and report files come with ``end_training()``,
  and the checks' history travels in ``save_state``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any, Optional, Union

import torch
from accelerate import Accelerator as _AccelerateAccelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import (
    AORecipeKwargs,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    DistributedType,
    FP8RecipeKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    MSAMPRecipeKwargs,
    ProfileKwargs,
    TERecipeKwargs,
)
from accelerate.utils.dataclasses import FP8BackendType
from torch import nn

from ..modules.convert import ConversionReport
from ..numerics.device_kind import device_kind
from ..numerics.recipes import Recipe
from ..training.core import FP8Training, Patterns, check_calibration_steps
from ..training.deepspeed_engine import attach_to_engine, check_frozen_fp8_partitioning
from ..training.graphing import check_cuda_graphs
from ..training.reference import METRIC_PREFIX, ReferenceCheck
from ..training.reference_report import with_written
from ..training.statistics import METRIC_PREFIX as STATS_PREFIX
from ..training.statistics import FP8Statistics, statistics_config
from .forward_wrapper import wrap_forward
from .settings import BASE_PRECISION, FP8Kwargs, FP8Settings, resolve_settings
from .setup_checks import _check_deepspeed_setup, _check_not_sharded, _check_reference_setup

__all__ = ["Accelerator"]

log = logging.getLogger(__name__)

# The kwargs handlers Accelerate 1.x maps by exact class (anything else is a bare KeyError there).
_ACCELERATE_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs,
                        ProfileKwargs)
_FP8_HANDLERS = (FP8Kwargs, TERecipeKwargs, FP8RecipeKwargs)


class Accelerator(_AccelerateAccelerator):
    """``accelerate.Accelerator`` whose ``mixed_precision="fp8"`` is fp8-plugin's FP8, on any machine.

    Changing ``from accelerate import Accelerator`` to ``from fp8_plugin.accelerate import
    Accelerator`` is the whole migration. Every argument of Accelerate's ``Accelerator`` is
    accepted (by keyword), plus:

    Args:
        mixed_precision: as in Accelerate; ``"fp8"`` turns FP8 on. None reads
            ``ACCELERATE_MIXED_PRECISION`` (set by ``accelerate launch``), as Accelerate does.
        fp8_recipe: a :class:`~fp8_plugin.numerics.recipes.Recipe` or an ``"fp8-*"`` precision string
            (``"fp8-hybrid"``, ``"fp8-current"``, ``"fp8-mxfp8"``, ...). Default: from the kwargs
            handler or the config file, else ``AutoRecipe()`` (HYBRID).
        fp8_include, fp8_exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.
        fp8_compute_dtype: dtype of the non-FP8 ops: ``torch.bfloat16`` (default),
            ``torch.float16`` (dynamic loss scaling through Accelerate's own ``GradScaler``) or
            ``torch.float32`` (no autocast). It sets Accelerate's base mixed precision.
        fp8_reference_every: run a BF16 reference check every this many optimizer steps (0:
            off); see :mod:`fp8_plugin.training.reference`. The model's output must hold its loss
            (``output.loss``, ``output["loss"]`` or a 0-dim tensor), else pass
            ``ReferenceCheck(output_loss=...)``. One process, DDP, FSDP2 or DeepSpeed ZeRO 0-3 (refused
            under FSDP1).
        fp8_reference_check: a :class:`~fp8_plugin.training.reference.ReferenceCheck` (interval,
            policy, thresholds, report files); its ``every`` and ``policy`` count as given here.
            Both also come from :class:`FP8Kwargs` or the config file's ``fp8_config``
            (``reference_every``, ``reference_policy``).
        fp8_nonfinite: what an optimizer step with non-finite gradients does without loss
            scaling: ``"skip"`` (default: ``optimizer.step()`` does nothing and
            ``accelerator.optimizer_step_was_skipped`` is True, so prepared schedulers do not
            step either; a warning names the first FP8 layer that saw a non-finite value) or
            ``"raise"`` (:class:`~fp8_plugin.training.faults.FP8NonFiniteError` before the step). Also
            ``FP8Kwargs(nonfinite=...)`` or the config key ``nonfinite``.
        fp8_max_consecutive_skips: stop when more than this many optimizer steps in a row were
            skipped (by the above or the loss scaler); 0: no limit; default 25. Also
            ``FP8Kwargs`` or the config key ``max_consecutive_skips``.
        fp8_statistics: per-layer FP8 statistics (:mod:`fp8_plugin.training.statistics`): an
            :class:`~fp8_plugin.training.statistics.FP8Statistics` or an interval in optimizer steps;
            logged to the trackers (``accelerator.log``) as ``fp8_stats/...`` after each
            sampled step. None: off.
        fp8_cuda_graphs: module-name glob patterns (``"*.layers.*"``: a transformers model's
            decoder layers) of the blocks to run as CUDA graphs from the second training step on,
            with the first step's shapes (:mod:`fp8_plugin.training.graphing`). None: off.
        fp8_calibration_steps: the first this many optimizer steps train in the reference
            precision and calibrate every FP8 layer's scales and scaling
            (:func:`fp8_plugin.calibrate`'s work, from the training batches); the report is
            ``accelerator.fp8_runs[i].calibration``. None or 0: off. Evaluation in FP8 or not is
            Accelerate's ``use_autocast_during_eval`` (``FP8Kwargs`` or the config file).
        kwargs_handlers: Accelerate's handlers, plus at most one of :class:`FP8Kwargs`,
            Accelerate's ``TERecipeKwargs`` or ``FP8RecipeKwargs`` (mapped field by field).

    Attributes:
        fp8_settings: the resolved :class:`~fp8_plugin.accelerate.settings.FP8Settings`
            (None without FP8), with ``sources`` saying where each setting came from.
        fp8_runs: one :class:`~fp8_plugin.training.core.FP8Training` per prepared model (its
            ``reference`` holds the reference checks' results).

    Raises:
        ValueError: contradictory FP8 settings (the message names both sources), an unsupported
            option or value (named, with the valid ones), FP8 arguments without
            ``mixed_precision="fp8"``, reference checks under FSDP1 (or another set-up than one
            process, DDP, FSDP2 or DeepSpeed), a ``nonfinite`` policy or tensor parallelism under
            DeepSpeed, or ``AORecipeKwargs`` / ``MSAMPRecipeKwargs`` (other FP8 backends).
        RuntimeError: (at ``prepare``) DeepSpeed joined more processes than Accelerate counts
            (Accelerate on a machine without a GPU-type backend).
        TypeError: an unknown kwargs handler class (the valid ones are listed),
            ``mixed_precision`` passed by position, or ``fp8_reference_check`` not a
            ReferenceCheck.
    """

    def __init__(
        self,
        *args: Any,
        mixed_precision: Optional[str] = None,
        fp8_recipe: Union[Recipe, str, None] = None,
        fp8_include: Patterns = None,
        fp8_exclude: Patterns = None,
        fp8_compute_dtype: Union[torch.dtype, str, None] = None,
        fp8_reference_every: Optional[int] = None,
        fp8_reference_check: Optional[ReferenceCheck] = None,
        fp8_nonfinite: Optional[str] = None,
        fp8_max_consecutive_skips: Optional[int] = None,
        fp8_statistics: Union[FP8Statistics, int, None] = None,
        fp8_cuda_graphs: Patterns = None,
        fp8_calibration_steps: Optional[int] = None,
        kwargs_handlers: Optional[list] = None,
        **kwargs: Any,
    ) -> None:
        if len(args) > 2:
            raise TypeError("fp8_plugin.accelerate.Accelerator: pass mixed_precision and later arguments by keyword")
        handlers = list(kwargs_handlers or [])
        _check_handlers(handlers)
        fp8_handlers = [h for h in handlers if isinstance(h, _FP8_HANDLERS)]
        requested = mixed_precision if mixed_precision is not None else os.environ.get("ACCELERATE_MIXED_PRECISION")
        fp8_arguments = {name: value for name, value in (
            ("fp8_recipe", fp8_recipe), ("fp8_include", fp8_include), ("fp8_exclude", fp8_exclude),
            ("fp8_compute_dtype", fp8_compute_dtype), ("fp8_reference_every", fp8_reference_every),
            ("fp8_reference_check", fp8_reference_check), ("fp8_nonfinite", fp8_nonfinite),
            ("fp8_max_consecutive_skips", fp8_max_consecutive_skips), ("fp8_statistics", fp8_statistics),
            ("fp8_cuda_graphs", fp8_cuda_graphs), ("fp8_calibration_steps", fp8_calibration_steps))
            if value is not None}
        self.fp8_settings: Optional[FP8Settings] = None
        self._fp8_statistics = statistics_config(fp8_statistics, "Accelerator", "fp8_statistics")
        self._fp8_cuda_graphs = check_cuda_graphs(fp8_cuda_graphs, "Accelerator", "fp8_cuda_graphs")
        self._fp8_calibration_steps = check_calibration_steps(fp8_calibration_steps or 0, "Accelerator",
                                                              "fp8_calibration_steps")
        if str(requested).lower() == "fp8":
            self.fp8_settings = resolve_settings(fp8_recipe, fp8_include, fp8_exclude, fp8_compute_dtype,
                                                 fp8_handlers, os.environ, fp8_reference_every, fp8_reference_check,
                                                 fp8_nonfinite, fp8_max_consecutive_skips)
            mixed_precision = BASE_PRECISION[self.fp8_settings.compute_dtype]
        elif fp8_arguments or fp8_handlers:
            given = ", ".join([*fp8_arguments, *(type(h).__name__ for h in fp8_handlers)])
            where = "argument" if mixed_precision is not None else "ACCELERATE_MIXED_PRECISION"
            raise ValueError(
                f"{given} given, but mixed_precision={requested!r} (from the {where}); "
                "set mixed_precision='fp8' to train in FP8"
            )
        self.fp8_runs: list[FP8Training] = []
        self._fp8_reference_pending: dict[str, float] = {}
        self._fp8_state_to_load: Optional[dict[str, Any]] = None
        super().__init__(*args, mixed_precision=mixed_precision,
                         kwargs_handlers=[h for h in handlers if not isinstance(h, _FP8_HANDLERS)] or None, **kwargs)
        deepspeed = self.distributed_type == DistributedType.DEEPSPEED
        if self.fp8_settings is not None and deepspeed:
            _check_deepspeed_setup(self.fp8_settings, self.state.deepspeed_plugin.deepspeed_config)
        if self.fp8_settings is not None and self.fp8_settings.compute_dtype == torch.float16 and self.scaler is None \
                and not deepspeed:  # under DeepSpeed its fp16 dynamic loss scaler does it
            raise ValueError(
                f"fp8_compute_dtype=torch.float16 (from {self.fp8_settings.sources.get('compute_dtype')}) needs "
                f"a loss scaler, which Accelerate makes only on GPUs (device here: {self.device.type!r}); "
                "valid here: torch.bfloat16, torch.float32"
            )
        if self.fp8_settings is not None and self.fp8_settings.reference_check is not None:
            _check_reference_setup(self.fp8_settings, self.distributed_type, fsdp2=self.is_fsdp2)
        if self.fp8_settings is not None and not deepspeed:
            # Under DeepSpeed the engine's save_checkpoint / load_checkpoint (which save_state /
            # load_state call) carry the FP8 state in their client_state instead.
            self.register_for_checkpointing(_FP8Checkpoint(self.fp8_runs))

    @property
    def fp8_backend(self) -> FP8BackendType:
        """``NO`` under fp8-plugin's FP8: none of Accelerate's FP8 backends runs, whatever the
        config file's ``fp8_config.backend`` (``ACCELERATE_FP8_BACKEND``) says."""
        if getattr(self, "fp8_settings", None) is not None:
            return FP8BackendType.NO
        return super().fp8_backend

    @property
    def fp8_reports(self) -> list[ConversionReport]:
        """What the conversion of each prepared model swapped, and why not the rest."""
        return [run.report for run in self.fp8_runs if run.report is not None]

    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        """Accelerate's ``prepare``, after converting every model given (any number, any order).

        Conversion happens before Accelerate wraps the model in DDP or shards it with FSDP2.
        """
        for obj in args:
            self._convert(obj)
        prepared = super().prepare(*args, device_placement=device_placement)
        self._attach_deepspeed()
        return prepared

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Accelerate's ``prepare_model``, after converting ``model``."""
        self._convert(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """Accelerate's ``prepare_optimizer``; the optimizer also ends each FP8 training step.

        High-precision weights that the conversion kept only in FP8 (frozen ones) leave the
        optimizer first, so that it does not hold them."""
        for run in self.fp8_runs:
            run.release_replaced_weights(optimizer)
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self.fp8_settings is not None and type(prepared) is AcceleratedOptimizer:
            # A subclass that adds only the FP8 step notification; state and pickling unchanged.
            prepared.__class__ = _FP8StepOptimizer
            prepared.fp8_runs = self.fp8_runs
            prepared._fp8_accelerator = weakref.ref(self)
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``; on a step a reference check is due on, the check may take
        this backward's gradients as its FP8 side (:mod:`fp8_plugin.training.reference.training_pass`)."""
        # Not on a micro-batch that accumulates (the step has more forwards: the check replays).
        runs = [] if self.distributed_type == DistributedType.DEEPSPEED or not self.sync_gradients else self.fp8_runs
        for run in runs:
            run.before_backward(loss, loss_scaled=self.scaler is not None)
        super().backward(loss, **kwargs)
        for run in runs:
            run.after_backward()

    def _attach_deepspeed(self) -> None:
        # Under DeepSpeed, the engine prepare() built ends each FP8 training step at its step()
        # (which accelerator.backward() calls at the accumulation boundary) and carries the FP8
        # state in its checkpoints: fp8_plugin.training.deepspeed_engine.
        wrapped = getattr(self, "deepspeed_engine_wrapped", None)
        if self.fp8_settings is None or wrapped is None:
            return
        engine = wrapped.engine
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world != self.num_processes:
            # Accelerate starts DeepSpeed's process group only with an accelerator backend
            # (nccl, ...); without one it counts one process while DeepSpeed joins them all.
            raise RuntimeError(
                f"DeepSpeed runs {world} processes but Accelerate counts {self.num_processes} (no GPU-type backend "
                "here), so data would not be sharded; run DeepSpeed through Accelerate on GPUs"
            )
        runs = [run for run in self.fp8_runs if run.module is engine.module]
        if runs:
            # After each FP8 step: its statistics to the trackers, as _FP8StepOptimizer does
            # without DeepSpeed (a weak reference: the engine does not keep the Accelerator alive).
            accelerator = weakref.ref(self)

            def log_step(stepped: list[FP8Training]) -> None:
                owner = accelerator()
                if owner is not None:
                    owner._log_reference(stepped)

            attach_to_engine(engine, runs, log_step)

    def fp8_state_dict(self) -> dict[str, Any]:
        """The FP8 state of every prepared model (scales, amax histories, ``use_fp8`` flags) and
        their reference checks' histories: what ``save_state`` writes. Call it on every process
        (it may reduce pending amaxes)."""
        return _FP8Checkpoint(self.fp8_runs).state_dict()

    def load_fp8_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`fp8_state_dict` returned: now for the models already prepared, or
        for each model as ``prepare()`` converts it (the i-th prepared model gets the i-th state),
        for loops that load a checkpoint before preparing (the transformers Trainer).

        Raises:
            RuntimeError: a corrupted state (named; nothing loaded), or more models prepared
                than the state holds.
        """
        if self.fp8_runs:
            _FP8Checkpoint(self.fp8_runs).load_state_dict(state)
        else:
            self._fp8_state_to_load = state

    def fp8_metrics(self) -> dict[str, float]:
        """FP8 figures of every prepared model (``FP8Training.metrics``), one host sync each."""
        metrics: dict[str, float] = {}
        for index, run in enumerate(self.fp8_runs):
            prefix = "" if len(self.fp8_runs) == 1 else f"model{index}/"
            metrics.update({key.replace("fp8/", f"fp8/{prefix}", 1): value for key, value in run.metrics().items()})
        return metrics

    def fp8_reference_metrics(self) -> dict[str, float]:
        """The figures (``fp8_ref/...``; ``fp8_ref/model<i>/...`` with several models) of the
        reference checks run since the last call, and the sampled statistics (``fp8_stats/...``),
        once (the latest of each key); empty when none ran. They also go to ``accelerator.log``
        (the trackers) at each check's or sample's step. Reads the statistics on the host (one
        read per model sampled since the last call)."""
        metrics, self._fp8_reference_pending = self._fp8_reference_pending, {}
        for run in self.fp8_runs:
            if run.statistics is not None:  # sampled since the last call and not logged yet
                metrics.update(self._model_keys(run, run.statistics.pop_metrics()))
        return metrics

    def fp8_reference_summary(self) -> str:
        """The reference checks' text summary (checks run and failed, lowest layer SQNR,
        layers moved to high precision, overhead); one block per model with several."""
        checkers = [(index, run.reference) for index, run in enumerate(self.fp8_runs) if run.reference is not None]
        if not checkers:
            settings = getattr(self, "fp8_settings", None)
            if settings is not None and settings.reference_check is not None:
                return f"FP8 reference checks: every {settings.reference_check.every} steps; no model prepared"
            return "FP8 reference checks: off"
        if len(self.fp8_runs) == 1:
            return checkers[0][1].summary()
        return "\n".join(f"model{index}: {checker.summary()}" for index, checker in checkers)

    def write_fp8_reference_reports(self) -> list[str]:
        """Write the report files the ``ReferenceCheck`` asks for (``json_path``, ``plot_path``;
        a second model's get ``-model1`` before the extension, ...) on the main process; returns
        their paths (empty on the other processes)."""
        if not self.is_main_process:
            return []
        return [path for run in self.fp8_runs if run.reference is not None for path in run.reference.write_reports()]

    def print_fp8_reference_summary(self) -> str:
        """Write the reference checks' report files and print their summary (with the files
        written) on the main process; returns the text (on every process). Nothing is written
        or printed when the checks are off."""
        if not any(run.reference is not None for run in self.fp8_runs):
            return self.fp8_reference_summary()
        written = self.write_fp8_reference_reports()
        text = with_written(self.fp8_reference_summary(), written)
        if self.is_main_process:
            print(text, flush=True)
        return text

    def end_training(self) -> None:
        """Accelerate's ``end_training`` (trackers finished, process group destroyed), after
        :meth:`print_fp8_reference_summary` (when the reference checks are on)."""
        self.print_fp8_reference_summary()
        super().end_training()

    def _log_reference(self, runs: list[FP8Training]) -> None:
        # After an optimizer step of ``runs``: the figures of the checks it ran and of the
        # statistics it sampled, to the trackers (main process only) and to
        # fp8_reference_metrics(). Without a tracker the statistics stay on the device until
        # fp8_reference_metrics() reads them (the transformers Trainer at its logging steps):
        # no host read in the step.
        for run in runs:
            metrics = run.reference.pop_metrics() if run.reference is not None else {}
            if self.trackers and run.statistics is not None:
                metrics.update(run.statistics.pop_metrics())
            if not metrics:
                continue
            metrics = self._model_keys(run, metrics)
            self._fp8_reference_pending.update(metrics)
            self.log(metrics, step=run.optimizer_steps)

    def _model_keys(self, run: FP8Training, metrics: dict[str, float]) -> dict[str, float]:
        # "fp8_ref/..." -> "fp8_ref/model<i>/..." (and fp8_stats) when several models are prepared.
        if len(self.fp8_runs) <= 1:
            return metrics
        index = self.fp8_runs.index(run)
        return {_model_key(key, index): value for key, value in metrics.items()}

    def _convert(self, obj: Any) -> None:
        settings = self.fp8_settings
        if settings is None or not isinstance(obj, nn.Module) or getattr(obj, "_is_accelerate_prepared", False):
            return
        if any(run.module is obj for run in self.fp8_runs):
            return
        if settings.reference_check is not None:
            _check_not_sharded(settings, obj)
        run = FP8Training(settings.recipe, settings.include, settings.exclude, settings.compute_dtype,
                          reference_check=_indexed_reports(settings.reference_check, len(self.fp8_runs)),
                          fault_policy=settings.fault_policy, statistics=self._fp8_statistics,
                          cuda_graphs=self._fp8_cuda_graphs, calibration_steps=self._fp8_calibration_steps)
        run.convert(obj)
        if self.distributed_type == DistributedType.DEEPSPEED:
            check_frozen_fp8_partitioning(run.report, self.state.deepspeed_plugin.deepspeed_config)
        for prepared in self._optimizers:  # optimizers prepared before this model
            run.release_replaced_weights(prepared.optimizer)
        run.exclude_state_from_state_dict()
        self.fp8_runs.append(run)
        if self._fp8_state_to_load is not None:
            _load_one(run, self._fp8_state_to_load, len(self.fp8_runs) - 1)
        if self.is_main_process:
            log.info("FP8 layers:\n%s", run.report)
        wrap_forward(obj, run, device_kind(self.device), settings.use_autocast_during_eval)


def _model_key(key: str, index: int) -> str:
    # "fp8_ref/x" -> "fp8_ref/model<i>/x", "fp8_stats/x" -> "fp8_stats/model<i>/x" (several models).
    for prefix in (METRIC_PREFIX, STATS_PREFIX):
        if key.startswith(prefix):
            return f"{prefix}model{index}/{key[len(prefix):]}"
    return key


def _indexed_reports(config: Optional[ReferenceCheck], index: int) -> Optional[ReferenceCheck]:
    # The report files of the index-th model: the paths given for the first, "-model<i>" added
    # before the extension for the others (one file per model, none overwritten).
    if config is None or index == 0:
        return config

    def indexed(path: Optional[str]) -> Optional[str]:
        if not path:
            return path
        root, ext = os.path.splitext(path)
        return f"{root}-model{index}{ext}"

    return dataclasses.replace(config, json_path=indexed(config.json_path), plot_path=indexed(config.plot_path))


class _FP8StepOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` that ends the FP8 training step of its models at each
    optimizer step (``sync_gradients``), one the loss scaler skips included: the reference
    check due on the step runs before the step, and its figures go to the Accelerator
    (``_fp8_accelerator``, a weak reference: the optimizer does not keep it alive) after it."""

    fp8_runs: list[FP8Training]
    _fp8_accelerator: Optional["weakref.ReferenceType[Accelerator]"] = None

    def step(self, closure: Any = None) -> Any:
        runs = self._runs() if self.gradient_state.sync_gradients else []
        loss_scaled = self.scaler is not None
        # Every run checks (each may all-reduce its verdict); any non-finite gradient skips the step.
        take = all([run.before_optimizer_step(loss_scaled=loss_scaled) for run in runs])
        if take:
            output = super().step(closure)
            if not loss_scaled and runs:
                self._is_overflow = False  # Accelerate sets it only with a scaler
        else:
            # What Accelerate does for a step its GradScaler skips: optimizer_step_was_skipped
            # is True, and the schedulers it prepared do not step.
            output, self._is_overflow = None, True
        # Accelerate knows on the host whether its GradScaler skipped the step (GradScaler read it).
        scaler_skipped = bool(self._is_overflow) if loss_scaled else None
        for run in runs:
            run.after_optimizer_step(scaler_skipped)
        accelerator = self._fp8_accelerator() if self._fp8_accelerator is not None else None
        if accelerator is not None and runs:
            accelerator._log_reference(runs)
        return output

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_fp8_accelerator", None)  # a weak reference does not pickle
        return state

    def _runs(self) -> list[FP8Training]:
        # The FP8 models whose parameters this optimizer updates (looked up per step: models
        # and optimizers may be prepared in any order, and FSDP2 swaps in new parameters).
        params = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return [run for run in self.fp8_runs
                if run.module is not None and any(id(p) in params for p in run.module.parameters())]


class _FP8Checkpoint:
    """The FP8 state of every prepared model, as one object for ``register_for_checkpointing``
    (``save_state`` calls ``state_dict`` on every process: it may reduce pending amaxes), and the
    history of each model's reference checks (steps counted, results; None where off). The
    layers a check's fallback moved to high precision travel in the FP8 state (``use_fp8``)."""

    def __init__(self, runs: list[FP8Training]) -> None:
        self.runs = runs

    def state_dict(self) -> dict[str, Any]:
        return {"fp8_state": [run.state_dict() for run in self.runs],
                "reference_checks": [run.reference.state_dict() if run.reference is not None else None
                                     for run in self.runs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp8_state", [])
        if len(saved) != len(self.runs):
            raise RuntimeError(
                f"The checkpoint holds FP8 state for {len(saved)} model(s), this Accelerator prepared "
                f"{len(self.runs)}: prepare the same models before load_state"
            )
        for index, run in enumerate(self.runs):
            _load_one(run, state, index, "Accelerator.load_state")


def _load_one(run: FP8Training, state: dict[str, Any], index: int,
              owner: str = "Accelerator.load_fp8_state_dict") -> None:
    # The index-th model's part of an _FP8Checkpoint state (all of them at load_state, or each as
    # prepare() converts it).
    saved = state.get("fp8_state", [])
    if index >= len(saved):
        raise RuntimeError(
            f"The checkpoint holds FP8 state for {len(saved)} model(s); this Accelerator prepared a model more: "
            "prepare the same models as the run that saved it"
        )
    run.load_state_dict(saved[index], owner)
    # A checkpoint written without checks (or by an older version) leaves them counting afresh.
    references = state.get("reference_checks") or []
    if run.reference is not None and index < len(references) and references[index] is not None:
        run.reference.load_state_dict(references[index])


def _check_handlers(handlers: list) -> None:
    valid = (*_ACCELERATE_HANDLERS, *_FP8_HANDLERS)
    names = ", ".join(cls.__name__ for cls in valid)
    for handler in handlers:
        if isinstance(handler, (AORecipeKwargs, MSAMPRecipeKwargs)):
            raise ValueError(
                f"kwargs_handlers: {type(handler).__name__} configures another FP8 backend (torchao / MS-AMP); "
                f"fp8_plugin.accelerate.Accelerator runs its own FP8. Valid handlers: {names}"
            )
        if type(handler) not in valid:
            raise TypeError(f"kwargs_handlers: {type(handler).__name__} is not a known kwargs handler; valid: {names}")
