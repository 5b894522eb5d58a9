"""Lightning precision plugins for FP8 GEMMs with FP32 master weights.

- :class:`FP8Precision` for single-device, DDP and FSDP2 (``ModelParallelStrategy``) training,
  built on Lightning's ``MixedPrecision`` (its loss-scaling steps, its scaler checkpointing).
- :class:`FP8FSDPPrecision` for ``FSDPStrategy``, which accepts ``FSDPPrecision`` plugins only;
  built on Lightning's ``FSDPPrecision`` (``ShardedGradScaler``).

Both map Lightning's hooks onto the loop-neutral :class:`~fp8_plugin.training.core.FP8Training`
(:class:`_FP8Behaviour`): ``convert_module`` swaps the linear layers; ``forward_context`` enters
torch autocast (BF16 or FP16 for the non-FP8 ops) and :func:`fp8_plugin.autocast` with a MAX
all-reduce of the step's amaxes when several ranks train; the amaxes are settled after each
optimizer step; FP8 state (and the loss scaler's) travels in checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from .._private.lightning_api import spawns_workers
from ..modules.autocast import AmaxReducer
from ..modules.convert import ConversionReport
from ..numerics.device_kind import device_kind
from ..numerics.recipes import Recipe
from ..training.core import COMPUTE_DTYPES, FP8Training, check_arguments, check_calibration_steps, check_eval_in_fp8
from ..training.faults import FaultPolicy, resolve_fault_policy
from ..training.graphing import check_cuda_graphs
from ..training.reference import ReferenceCheck, resolve_reference_check
from ..training.statistics import FP8Statistics, statistics_config
from .reference_capture import _attach_reference_capture, summarise_once

__all__ = ["FP8Precision", "FP8FSDPPrecision", "COMPUTE_DTYPES"]

_STATE_KEY = "fp8_state"
_SCALER_KEY = "loss_scaler"
_REFERENCE_KEY = "reference_checks"
_PLUGIN_NAMES = ("FP8Precision", "FP8FSDPPrecision")  # the names Lightning files their states under
Patterns = Union[str, Sequence[str], None]


class _FP8Behaviour:
    """The Lightning half of both plugins' FP8 work; the work itself is :class:`FP8Training`, the
    other half (scaler, FSDP config) is Lightning's."""

    fp8: FP8Training
    scaler: Optional["torch.amp.GradScaler"]

    def _init_fp8(self, recipe: Recipe, include: Patterns, exclude: Patterns, compute_dtype: torch.dtype,
                  amax_reduction_group: Optional["dist.ProcessGroup"], precision: str,
                  reference_check: Optional[ReferenceCheck] = None,
                  fault_policy: Optional[FaultPolicy] = None,
                  statistics: Optional[FP8Statistics] = None,
                  cuda_graphs: Patterns = None, calibration_steps: int = 0, eval_in_fp8: bool = True) -> None:
        self.fp8 = FP8Training(recipe, include, exclude, compute_dtype, amax_reduction_group, reference_check,
                               fault_policy, statistics, cuda_graphs, calibration_steps=calibration_steps,
                               eval_in_fp8=eval_in_fp8)
        self._take_step = True
        self._summarised_steps = 0
        self.precision = precision  # type: ignore[assignment]
        self._device_type = "cpu"
        self._scale_before_step: Optional[torch.Tensor] = None
        self._skipped_steps: Optional[torch.Tensor] = None

    @property
    def recipe(self) -> Recipe:
        return self.fp8.recipe

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fp8.compute_dtype

    @property
    def report(self) -> Optional[ConversionReport]:
        return self.fp8.report

    @property
    def _module(self) -> Optional[nn.Module]:
        return self.fp8.module

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.fp8.convert(module):  # fit then test/validate/predict: converted once
            # Quiet by default: the counts on the console, the table (a row per layer: hundreds
            # in a MoE model) at debug level and in `trainer.precision_plugin.report`.
            rank_zero_info(f"FP8 layers: {self.report.summary()}\n(the layer table: trainer.precision_plugin.report)")
            rank_zero_debug(f"FP8 layers:\n{self.report}")
            # Every checkpoint Lightning writes takes the module's state from module.state_dict(),
            # weights-only ones too (which skip on_save_checkpoint): keep it vanilla, so that
            # load_from_checkpoint into a plain module works; FP8 state travels under this plugin's
            # key (state_dict below), settled and identical on every rank.
            self.fp8.exclude_state_from_state_dict()
            if self.fp8.reference is not None:
                _attach_reference_capture(module, self.fp8)
            _warn_if_spawned(module)
        return module

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> Any:
        # Called after the model is on its device: that is the device torch autocast must target.
        param = next(model.parameters(), None)
        if param is not None:
            self._device_type = device_kind(param.device)
        return super().connect(model, optimizers, lr_schedulers)  # type: ignore[misc]

    def amax_reducer(self) -> Optional[AmaxReducer]:
        """The MAX all-reduce of each step's amaxes (None on one rank)."""
        return self.fp8.amax_reducer()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.fp8.forward_context(self._device_type)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        # Without accumulation the loss backpropagated is the training_step loss a check's replay
        # reruns: the check may take this backward as its FP8 side (training/reference/training_pass.py).
        trainer = getattr(module, "_trainer", None)
        vouched = trainer is not None and trainer.accumulate_grad_batches == 1
        self.fp8.before_backward(tensor, loss_scaled=self.scaler is not None, vouched=vouched)
        return super().pre_backward(tensor, module)  # type: ignore[misc]

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        output = super().post_backward(tensor, module)  # type: ignore[misc]
        self.fp8.after_backward()
        return output

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # The scale the backward used, kept on device: a lower scale after update() means the
        # step was skipped for inf/NaN gradients (GradScaler only backs off then). No sync.
        scale = getattr(self.scaler, "_scale", None)
        self._scale_before_step = scale.clone() if scale is not None else None
        self._take_step = self.fp8.before_optimizer_step(loss_scaled=self.scaler is not None)
        super()._after_closure(model, optimizer)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            output = self._step_unless_nonfinite(optimizer, model, closure, **kwargs)
        else:  # the loss scaler skips steps with non-finite gradients itself
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        scale = getattr(self.scaler, "_scale", None)
        scaler_skipped = None
        if scale is not None and self._scale_before_step is not None:
            scaler_skipped = scale < self._scale_before_step
            skipped = scaler_skipped.to(torch.int64)
            self._skipped_steps = skipped if self._skipped_steps is None else self._skipped_steps + skipped
            self._scale_before_step = None
        self.fp8.after_optimizer_step(scaler_skipped)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.loggers:
            metrics = self.fp8_metrics() if trainer.global_step % trainer.log_every_n_steps == 0 else {}
            metrics.update(self.fp8.pop_metrics())  # every check and sample, whatever the interval
            if metrics and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        return output

    def _step_unless_nonfinite(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        # Lightning's Precision.optimizer_step hands the closure to optimizer.step(), which
        # could not then be skipped: run the closure (forward, backward, the before-step hooks
        # and gradient clipping, through _after_closure) first, then step unless the FP8 fault
        # policy says the gradients are not finite. MixedPrecision does the same with a scaler.
        if isinstance(optimizer, torch.optim.LBFGS):
            # LBFGS re-evaluates the closure inside step(): it keeps Lightning's path, checked but
            # not skippable (nonfinite="raise" still stops it).
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        closure_result = closure()
        self._after_closure(model, optimizer)
        if not self._take_step or (closure_result is None and getattr(model, "automatic_optimization", True)):
            return closure_result  # skipped: non-finite gradients, or training_step returned None
        return optimizer.step(**kwargs)

    def teardown(self) -> None:
        """End of fit (or validate / test): the reference checks' summary and report files."""
        self._summarised_steps = summarise_once(self.fp8, self._summarised_steps)
        super().teardown()  # type: ignore[misc]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped by the loss scaler for inf/NaN gradients (one host sync)."""
        return 0 if self._skipped_steps is None else int(self._skipped_steps.item())

    def fp8_metrics(self) -> dict[str, float]:
        """FP8 figures of the converted module: layer count, min/max scale, non-finite amaxes;
        with loss scaling also the loss scale and the skipped steps so far.

        One host-device synchronisation; called at ``log_every_n_steps`` only.
        """
        metrics = self.fp8.metrics()
        if not metrics:
            return {}
        if self.scaler is not None:
            metrics["fp8/loss_scale"] = float(self.scaler.get_scale())
            metrics["fp8/skipped_steps"] = float(self.skipped_steps)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.scaler is not None:
            state[_SCALER_KEY] = self.scaler.state_dict()
        if self._module is not None:
            # Lightning builds checkpoints on every rank: anything still pending (a save outside
            # the optimizer step) is applied with the same reduction the next forward would use.
            state[_STATE_KEY] = self.fp8.state_dict()
        if self.fp8.reference is not None:
            state[_REFERENCE_KEY] = self.fp8.reference.state_dict()
        return state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores a plugin's state only from the entry under its own class name: a
        # checkpoint of the other FP8 plugin (FP8Precision <-> FP8FSDPPrecision) is read here,
        # and one with no FP8 state at all is said to start afresh rather than silently.
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        if self._module is None or type(self).__qualname__ in checkpoint:
            return
        other = next((name for name in _PLUGIN_NAMES if name in checkpoint), None)
        if other is not None:
            self.load_state_dict(checkpoint[other])
        else:
            rank_zero_warn(
                "The checkpoint holds no FP8 state (written without fp8-plugin, or weights only): the model's weights "
                "are restored, and its FP8 scales start afresh (they settle within the first training step)"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and _SCALER_KEY in state_dict:
            self.scaler.load_state_dict(state_dict[_SCALER_KEY])
        self.fp8.load_state_dict(state_dict.get(_STATE_KEY), type(self).__name__)
        if self.fp8.reference is not None and _REFERENCE_KEY in state_dict:
            self.fp8.reference.load_state_dict(state_dict[_REFERENCE_KEY])
            self._summarised_steps = self.fp8.reference.steps


def _warn_if_spawned(module: nn.Module) -> None:
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and spawns_workers(trainer.strategy):
        rank_zero_warn(
            "FP8 training under a spawned strategy (ddp_spawn, ddp_fork, ddp_notebook): after fit, the model in the "
            "main process has the trained weights in its original high-precision layers, but not the FP8 scaling "
            "state, which stays with the worker processes and the checkpoints this run writes. To continue FP8 "
            "training, resume from a checkpoint (trainer.fit(..., ckpt_path=...)), or use strategy='ddp' to keep "
            "the converted model in this process"
        )


class FP8Precision(_FP8Behaviour, MixedPrecision):
    """FP8 training for ``lightning.pytorch``: ``Trainer(plugins=[FP8Precision()])``.

    After ``import fp8_plugin``, ``Trainer(precision="fp8-hybrid")`` builds this plugin too (or
    :class:`FP8FSDPPrecision` under ``FSDPStrategy``). Works with single-device, DDP and FSDP2
    (``ModelParallelStrategy``) training.

    Args:
        recipe: scaling recipe of the FP8 layers; default ``AutoRecipe()`` (HYBRID): the best
            recipe the training device runs natively, resolved when the model is converted
            (``self.report.recipe`` holds the one chosen).
        include, exclude: module-name glob patterns passed to :func:`fp8_plugin.convert_model`.
        compute_dtype: dtype of the non-FP8 ops (attention, norms, heads) under torch autocast:
            ``torch.bfloat16`` (default), ``torch.float16`` (dynamic loss scaling on) or
            ``torch.float32`` (no autocast).
        precision: the name Lightning reports as ``trainer.precision``.
        loss_scaling: dynamic loss scaling with ``torch.amp.GradScaler``; None (default) turns
            it on for float16 only. Under several ranks the scaler becomes a
            ``ShardedGradScaler`` with the same settings, so that every rank agrees on
            inf/NaN gradients and skips the same steps.
        scaler: the ``torch.amp.GradScaler`` to use (its ``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``); implies ``loss_scaling=True``.
        amax_reduction_group: process group whose ranks share delayed-scaling amaxes (one MAX
            all-reduce per step); None means the world group.
        device: device type of the loss scaler; None means "cuda" when CUDA is available, else
            "cpu".
        reference_every: run a BF16 reference check every this many optimizer steps (0 or
            None: off); see :mod:`fp8_plugin.training.reference`. Needs automatic optimization;
            single device or DDP.
        reference_check: a :class:`~fp8_plugin.training.reference.ReferenceCheck` with the
            interval, thresholds, policy and report files.
        nonfinite: without loss scaling, what a step with non-finite gradients does:
            ``"skip"`` (default: no optimizer step, a warning naming the first FP8 layer that
            saw a non-finite value) or ``"raise"`` (stop before the step); see
            :mod:`fp8_plugin.training.faults`.
        max_consecutive_skips: stop when more than this many optimizer steps in a row were
            skipped (by ``nonfinite="skip"`` or the loss scaler); 0: no limit; default 25.
        statistics: per-layer FP8 statistics (:mod:`fp8_plugin.training.statistics`): an
            :class:`~fp8_plugin.training.statistics.FP8Statistics` or an interval in optimizer steps;
            logged to the Trainer's loggers as ``fp8_stats/...``. None: off.
        cuda_graphs: module-name glob patterns (``"*.layers.*"``: a transformers model's decoder
            layers) of the blocks to run as CUDA graphs from the second training step on, with
            the first step's shapes (:mod:`fp8_plugin.training.graphing`). None (default): off.
        calibration_steps: the first this many optimizer steps train in the reference precision
            and calibrate every FP8 layer's scales and scaling (:func:`fp8_plugin.calibrate`'s
            work, from the training batches: no batch runs twice); the report is
            ``plugin.fp8.calibration``. 0 (default): off. A resumed run does not calibrate again.
        eval_in_fp8: validation, test and prediction run the FP8 layers in FP8 (True, default:
            the Trainer's ``precision`` applies to every loop, as ``"bf16-mixed"`` does) or in
            the reference precision (False: the figure of the model as its saved checkpoint
            runs in BF16).

    Raises:
        TypeError: ``recipe`` is not a Recipe, ``reference_check`` not a ReferenceCheck,
            ``statistics`` or ``cuda_graphs`` none of the valid types.
        ValueError: ``compute_dtype`` is not one of the valid ones, ``loss_scaling=False``
            with ``scaler``, ``reference_every`` negative or contradicting ``reference_check``,
            an unknown ``nonfinite``, a negative ``max_consecutive_skips`` or
            ``calibration_steps``, an ``eval_in_fp8`` that is not a bool.

    .. note::
        FP8 scaling state travels in Lightning checkpoints under this plugin's key, not in
        ``checkpoint["state_dict"]``, so ``LightningModule.load_from_checkpoint`` gives the plain
        (unconverted) module with trained weights, and ``trainer.fit(ckpt_path=...)`` resumes
        with identical scales and loss scale.
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        precision: str = "fp8-hybrid",
        loss_scaling: Optional[bool] = None,
        scaler: Optional["torch.amp.GradScaler"] = None,
        amax_reduction_group: Optional["dist.ProcessGroup"] = None,
        device: Optional[str] = None,
        reference_every: Optional[int] = None,
        reference_check: Optional[ReferenceCheck] = None,
        nonfinite: Optional[str] = None,
        max_consecutive_skips: Optional[int] = None,
        statistics: Union[FP8Statistics, int, None] = None,
        cuda_graphs: Patterns = None,
        calibration_steps: int = 0,
        eval_in_fp8: bool = True,
    ) -> None:
        recipe = check_arguments("FP8Precision", recipe, compute_dtype)
        check_cuda_graphs(cuda_graphs, "FP8Precision")
        check_calibration_steps(calibration_steps, "FP8Precision")
        check_eval_in_fp8(eval_in_fp8, "FP8Precision")
        stats = statistics_config(statistics, "FP8Precision")
        reference = resolve_reference_check(reference_every, reference_check, "FP8Precision")
        faults = resolve_fault_policy(nonfinite, max_consecutive_skips)
        if loss_scaling is False and scaler is not None:
            raise ValueError("FP8Precision(loss_scaling=False, scaler=...) contradict each other; pass one")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is None and (loss_scaling or (loss_scaling is None and compute_dtype == torch.float16)):
            scaler = torch.amp.GradScaler(device=device)
        # Lightning's MixedPrecision runs the scaler ("16-mixed") or nothing ("bf16-mixed").
        super().__init__("16-mixed" if scaler is not None else "bf16-mixed", device=device, scaler=scaler)
        self._init_fp8(recipe, include, exclude, compute_dtype, amax_reduction_group, precision, reference, faults,
                       stats, cuda_graphs, calibration_steps, eval_in_fp8)

    @override
    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> Any:
        if self.scaler is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.scaler = _sharded(self.scaler)
        return super().connect(model, optimizers, lr_schedulers)



def _sharded(scaler: "torch.amp.GradScaler") -> "torch.amp.GradScaler":
    # ShardedGradScaler all-reduces found-inf over the ranks before step(): all skip or none.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(scaler, ShardedGradScaler):
        return scaler
    sharded = ShardedGradScaler(
        device=getattr(scaler, "_device", "cuda"),
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )
    if scaler.is_enabled():
        sharded.load_state_dict(scaler.state_dict())
    return sharded


class FP8FSDPPrecision(_FP8Behaviour, FSDPPrecision):
    """FP8 training under Lightning's ``FSDPStrategy`` (which requires an ``FSDPPrecision``).

    Chosen automatically for ``Trainer(strategy="fsdp", precision="fp8-*")``. FSDP all-gathers
    parameters in ``compute_dtype``, reduces gradients in float32, keeps FP32 sharded master
    weights, and never casts buffers (the FP8 scaling state stays float32). Float16 uses
    ``ShardedGradScaler``.

    Args:
        recipe, include, exclude, compute_dtype, precision, amax_reduction_group, nonfinite, max_consecutive_skips: as
            :class:`FP8Precision` (``compute_dtype`` float32 means no autocast).
        scaler: a ``ShardedGradScaler``; default one for float16, none otherwise.

    Raises:
        TypeError: ``recipe`` is not a Recipe.
        ValueError: ``compute_dtype`` is not one of the valid ones, or float16 without an
            enabled loss scaler (Lightning's default one is disabled without CUDA).
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        precision: str = "fp8-hybrid",
        scaler: Optional[Any] = None,
        amax_reduction_group: Optional["dist.ProcessGroup"] = None,
        nonfinite: Optional[str] = None,
        max_consecutive_skips: Optional[int] = None,
    ) -> None:
        recipe = check_arguments("FP8FSDPPrecision", recipe, compute_dtype)
        faults = resolve_fault_policy(nonfinite, max_consecutive_skips)
        base = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}[compute_dtype]
        super().__init__(base, scaler=scaler)
        if compute_dtype == torch.float16 and (self.scaler is None or not self.scaler.is_enabled()):
            # Lightning's default ShardedGradScaler targets CUDA and disables itself without it:
            # float16 would then train with no loss scaling at all.
            raise ValueError(
                "FP8FSDPPrecision(compute_dtype=torch.float16) needs an enabled loss scaler, and the "
                "ShardedGradScaler here is disabled (no CUDA device); valid here: torch.bfloat16, torch.float32, "
                "or pass scaler=ShardedGradScaler(device=...) for a device that has one"
            )
        self._init_fp8(recipe, include, exclude, compute_dtype, amax_reduction_group, precision, fault_policy=faults)

    @property
    @override
    def mixed_precision_config(self) -> Any:
        from torch.distributed.fsdp.fully_sharded_data_parallel import MixedPrecision as TorchMixedPrecision

        return TorchMixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=torch.float32, buffer_dtype=None)
