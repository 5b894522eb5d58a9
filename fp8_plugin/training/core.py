"""The FP8 work of a training loop, written once for every loop.

Lightning's Trainer and Fabric plugins (and later Accelerate and the transformers Trainer) are
thin adapters over :class:`FP8Training`: convert the model once, enter the forward context
(torch autocast for the non-FP8 ops plus :func:`fp8_plugin.autocast` with the amax reducer),
settle each step's amaxes after the optimizer step, save and restore FP8 state, report figures.
Loss scaling stays with each loop's own mixed-precision machinery (torch's ``GradScaler``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..modules.autocast import AmaxReducer, autocast, in_replay, new_step_id
from ..modules.calibration import CalibrationReport, Calibrator
from ..modules.convert import ConversionReport, convert_model, fp8_state_dict
from ..modules.experts import FP8ExpertsMixin
from ..modules.freezing import dequantize_in_state_dict, frozen_weights_state, release_replaced_weights
from ..modules.linear import FP8Linear
from ..modules.scaling_group import update_pending_scales
from ..numerics.device_kind import device_kind
from ..numerics.quantizers import check_saved_state, is_scaling_state_key
from ..numerics.recipes import AutoRecipe, Recipe, check_recipe
from .distributed import amax_reducer
from .faults import FaultMonitor, FaultPolicy
from .graphing import GraphedBlocks, check_cuda_graphs
from .reference import ReferenceCheck, ReferenceChecker, reference_gemm_dtype
from .statistics import FP8Statistics, StatisticsCollector

__all__ = ["FP8Training", "COMPUTE_DTYPES", "check_arguments", "check_calibration_steps", "check_eval_in_fp8"]

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Patterns = Union[str, Sequence[str], None]


def check_arguments(owner: str, recipe: Optional[Recipe], compute_dtype: torch.dtype) -> Recipe:
    """The recipe to use (``AutoRecipe()`` for None), after checking both settings.

    Raises:
        TypeError: ``recipe`` is not a Recipe.
        ValueError: ``compute_dtype`` is not one of ``COMPUTE_DTYPES``.
    """
    check_recipe(recipe, owner)
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"{owner}(compute_dtype={compute_dtype}) is not supported; valid: "
            f"{', '.join(str(d) for d in COMPUTE_DTYPES)}"
        )
    return recipe if recipe is not None else AutoRecipe()


def check_calibration_steps(value: Any, owner: str, name: str = "calibration_steps") -> int:
    """``value`` (an int >= 0) after checking it.

    Raises:
        ValueError: anything else, naming ``owner`` and ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}({name}={value!r}) is invalid; valid: an int >= 0 (0: no calibration steps)")
    return value


def check_eval_in_fp8(value: Any, owner: str, name: str = "eval_in_fp8") -> bool:
    """``value`` (a bool) after checking it.

    Raises:
        ValueError: anything else, naming ``owner`` and ``name``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{owner}({name}={value!r}) is invalid; valid: True (evaluation forwards in FP8), False "
                         "(in the reference precision)")
    return value


class FP8Training:
    """FP8 training of one model, independent of the training loop.

    Args:
        recipe: scaling recipe of the FP8 layers (an ``AutoRecipe`` is resolved at conversion).
        include, exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.
        compute_dtype: dtype of the non-FP8 ops under torch autocast; float32 means no autocast.
        amax_reduction_group: process group whose ranks share amaxes (and sum the reference
            checks' figures); None means the world.
        reference_check: the periodic BF16 reference checks (None: off).
        fault_policy: what a step with non-finite gradients does, and how many skipped steps
            in a row stop the run (None: ``FaultPolicy()``, skip with a warning, at most 25).
        statistics: the per-layer FP8 statistics to sample (:mod:`fp8_plugin.training.statistics`;
            None: off).
        cuda_graphs: module-name glob patterns of the blocks to run as CUDA graphs from the second
            training step on (:mod:`fp8_plugin.training.graphing`; None: off); with calibration
            steps, from the first step after them.
        calibration_steps: the first this many optimizer steps train in the reference
            precision (FP8 off, torch autocast in ``compute_dtype``) and calibrate
            (:class:`~fp8_plugin.modules.calibration.Calibrator`, online): after the last, every
            FP8 layer's scales come from their amaxes (input and weight from the forwards,
            grad_output from the backwards) and each layer's scaling is chosen by its
            measured SQNR (fprop and input cast); the report is :attr:`calibration`. 0
            (default): off. A run that loads FP8 state (a resume) does not calibrate again.
        eval_in_fp8: evaluation forwards (grad off: validation, test, prediction) run the FP8
            layers in FP8 (True, default) or in the reference precision (False).

    Attributes:
        module: the converted model (None before :meth:`convert`).
        report: its :class:`~fp8_plugin.modules.convert.ConversionReport`.
        reference: the :class:`~fp8_plugin.training.reference.ReferenceChecker` (None when off).
        faults: the :class:`~fp8_plugin.training.faults.FaultMonitor` (skipped steps, outliers reported).
        statistics: the :class:`~fp8_plugin.training.statistics.StatisticsCollector` (None when off).
        calibration: the :class:`~fp8_plugin.modules.calibration.CalibrationReport` of the
            calibration steps (None until they end, or without them).

    Raises:
        ValueError: ``calibration_steps`` not an int >= 0, ``eval_in_fp8`` not a bool.
    """

    def __init__(self, recipe: Recipe, include: Patterns = None, exclude: Patterns = None,
                 compute_dtype: torch.dtype = torch.bfloat16,
                 amax_reduction_group: Optional["dist.ProcessGroup"] = None,
                 reference_check: Optional[ReferenceCheck] = None,
                 fault_policy: Optional[FaultPolicy] = None,
                 statistics: Optional[FP8Statistics] = None,
                 cuda_graphs: Patterns = None, *, calibration_steps: int = 0, eval_in_fp8: bool = True) -> None:
        self.calibration_steps = check_calibration_steps(calibration_steps, "FP8Training")
        self.eval_in_fp8 = check_eval_in_fp8(eval_in_fp8, "FP8Training")
        self.calibration: Optional[CalibrationReport] = None
        self._calibrator: Optional[Calibrator] = None
        self.recipe = recipe
        self.include = include
        self.exclude = exclude
        self.compute_dtype = compute_dtype
        self.amax_reduction_group = amax_reduction_group
        self.module: Optional[nn.Module] = None
        self.report: Optional[ConversionReport] = None
        self._reducer: Optional[AmaxReducer] = None
        self._reducer_ready = False
        # The training step the next forwards belong to: every micro-batch until the optimizer
        # step shares it, so gradient accumulation makes one scale update per optimizer step.
        self._step: Optional[int] = None
        self.before_step_hooks: list[Callable[["FP8Training"], None]] = []
        self._layers: list[FP8Linear] = []
        self._experts: list[FP8ExpertsMixin] = []
        self._layers_of: Optional[nn.Module] = None
        self.reference = ReferenceChecker(reference_check) if reference_check is not None else None
        self.faults = FaultMonitor(fault_policy if fault_policy is not None else FaultPolicy())
        self.statistics = StatisticsCollector(statistics) if statistics is not None else None
        self.optimizer_steps = 0  # optimizer steps attempted, skipped ones included
        self._high_precision: Optional[tuple[Optional[torch.dtype]]] = None  # (dtype,) once decided
        patterns = check_cuda_graphs(cuda_graphs, "FP8Training")
        self.graphs = GraphedBlocks(patterns, "cuda_graphs") if patterns is not None else None

    def convert(self, module: nn.Module) -> bool:
        """Swap ``module``'s linear layers for FP8 ones, once. Returns False if already done."""
        if module is self.module:
            return False
        self.report = convert_model(module, self.recipe, include=self.include, exclude=self.exclude)
        self.module = module
        if self.graphs is not None:
            self.graphs.select(module)
        return True

    def release_replaced_weights(self, optimizer: torch.optim.Optimizer) -> int:
        """Drop from ``optimizer`` (built before the conversion) the high-precision weights the
        conversion replaced by frozen FP8-only ones, so that it does not keep them alive; once per
        optimizer. Returns how many were dropped."""
        if self.report is None or not self.report.replaced_weights:
            return 0
        return release_replaced_weights(optimizer, self.report.replaced_weights)

    def exclude_state_from_state_dict(self) -> None:
        """Keep the FP8 state out of the converted module's own ``state_dict()`` from now on.

        For loops whose checkpoints take the model from ``state_dict()`` and must stay vanilla
        (loadable into the unconverted model, writable as safetensors): they carry the FP8 state
        separately, from :meth:`state_dict`, which reads it directly. Weights kept only in FP8
        appear there dequantized, in their master dtype; :meth:`state_dict` holds their bytes.
        """
        if self.module is not None:
            self.module.register_state_dict_post_hook(_drop_fp8_state)

    def amax_reducer(self) -> Optional[AmaxReducer]:
        """The MAX all-reduce of each step's amaxes (None on one rank); built once, when first
        needed, because the process group exists only after the loop set it up."""
        if not self._reducer_ready:
            self._reducer = amax_reducer(self.amax_reduction_group)
            self._reducer_ready = True
        return self._reducer

    def forward_context(self, device_type: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Torch autocast in ``compute_dtype`` for the non-FP8 ops, and the FP8 autocast.

        Args:
            device_type: the autocast device; None means the converted module's device.
        """
        if in_replay():
            # A reference check replaying this forward (its loss_fn calls the wrapped model): the
            # check sets FP8 on or off and the autocast dtype itself, and no training step starts.
            return contextlib.nullcontext()
        if torch.compiler.is_compiling():
            # Traced (a forward wrapped in this context, then compiled): no per-step value may
            # enter the graph, or it recompiles every step. Scales are settled after each
            # optimizer step; statistics are sampled where the context is entered eagerly.
            return self._contexts(device_type, None)
        if self._high_precision is None:  # decided once, eagerly (a timed matmul on a CPU)
            self._high_precision = (reference_gemm_dtype(self.compute_dtype, device_type or self._device_type()),)
        if not torch.is_grad_enabled() and not self.eval_in_fp8:
            return self._contexts(device_type, None, fp8=False)
        if torch.is_grad_enabled() and self.module is not None and self.optimizer_steps < self.calibration_steps:
            return self._calibrating(device_type)
        if torch.is_grad_enabled() and self._step is None:
            self._step = new_step_id()
        if torch.is_grad_enabled() and self.statistics is not None and self.module is not None:
            self.statistics.start_step(self.module, self.optimizer_steps + 1)
        if torch.is_grad_enabled() and self.graphs is not None and not self.graphs.captured:
            self.graphs.record(self._device())  # the first step's calls: the capture's samples
        return self._contexts(device_type, self._step)

    @contextlib.contextmanager
    def _calibrating(self, device_type: Optional[str]) -> Iterator[None]:
        # A calibration step's forward: the reference precision, its amaxes (and the layers'
        # SQNR) recorded.
        if self._calibrator is None:
            self._calibrator = Calibrator(self.module, online=True)
        with self._contexts(device_type, None, fp8=False), self._calibrator.recording():
            yield

    @contextlib.contextmanager
    def _contexts(self, device_type: Optional[str], step: Optional[int], cache: bool = True,
                  fp8: bool = True) -> Iterator[None]:
        # Plain ``with`` statements, not an ExitStack: torch.compile traces these (a forward
        # wrapped in this context, as Accelerate wraps it, then compiles without a graph break).
        # ``cache``: torch autocast's cast cache (a CUDA graph capture refuses it).
        if self.compute_dtype == torch.float32:
            torch_autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            torch_autocast = torch.autocast(device_type or self._device_type(), dtype=self.compute_dtype,
                                            cache_enabled=cache)
        # The GEMMs FP8 layers run in high precision (a reference check's fallback, override_linear_
        # precision) in the dtype the reference checks compute in: what a check verifies is what runs.
        high_precision = self._high_precision[0] if self._high_precision is not None else None
        with torch_autocast, autocast(enabled=fp8, reduce_amax=self.amax_reducer(), step=step,
                                      high_precision_dtype=high_precision):
            yield

    def _device(self) -> torch.device:
        param = next(self.module.parameters(), None) if self.module is not None else None
        return param.device if param is not None else torch.device("cpu")

    def _device_type(self) -> str:
        return device_kind(self._device())

    def capture_replay(self, run_replay: Callable[[], torch.Tensor]) -> None:
        """Offer a training forward to the reference checks, right before it runs.

        Args:
            run_replay: runs the same forward again (same inputs, the unwrapped module) and
                returns its scalar loss; kept, with the RNG state of this moment, only when a
                check is due on this step. Nothing happens when checks are off or grad is off.
        """
        if self.reference is not None and torch.is_grad_enabled():
            self.reference.capture(run_replay, self._device())

    # The three calls below let a due step's training pass be its check's FP8 side instead of a
    # replay (training/reference/training_pass.py: where that is the same computation).
    def training_output(self, output: Any) -> None:
        """The output of a training forward offered by :meth:`capture_replay`, right after it ran."""
        if self.reference is not None:
            self.reference.training_pass.forward_output(output)

    def before_backward(self, loss: torch.Tensor, loss_scaled: bool = False, vouched: bool = False) -> None:
        """The loop is about to backpropagate ``loss``.

        Args:
            loss: the tensor backpropagated.
            loss_scaled: a loss scaler scales it.
            vouched: the loop knows ``loss`` is the loss of the forward :meth:`capture_replay`
                offered (its replay computes exactly it), which need not be the same object.
        """
        if self.reference is not None and self.module is not None:
            self.reference.training_pass.backward_starts(self.module, loss, loss_scaled, vouched)

    def after_backward(self) -> None:
        """The backward :meth:`before_backward` announced has ended."""
        if self.reference is not None and self.module is not None:
            self.reference.training_pass.backward_ended(self.module)

    def before_optimizer_step(self, loss_scaled: bool = False) -> bool:
        """Check the step for non-finite gradients and amax outliers (:mod:`fp8_plugin.training.faults`),
        run the reference check due on this step, then ``before_step_hooks`` (each called with
        this object): the point where a step's gradients are complete and the weights are still
        the ones its forwards used. Loops call it right before the optimizer step.

        Args:
            loss_scaled: a loss scaler (FP16) checks the gradients and skips the step itself.

        Returns:
            False when the loop must skip the optimizer step (non-finite gradients under
            ``nonfinite="skip"``), else True. Always True with ``loss_scaled``.

        Raises:
            FP8NonFiniteError: non-finite gradients under ``nonfinite="raise"``, or too many
                skipped steps in a row.
            FP8ReferenceCheckError: a failed check under ``policy="raise"``.
        """
        take = True
        if self.module is not None:
            take = self.faults.check(self.module, self.optimizer_steps + 1, loss_scaled, self.amax_reduction_group)
        if take and self.reference is not None and self.module is not None:
            self.reference.run(self.module, self.compute_dtype, self.amax_reduction_group)
        for hook in self.before_step_hooks:
            hook(self)
        if take and self.module is not None:
            # The step changes the weights: their cached FP8 copies would only hold memory.
            for layer in self._fp8_layers():
                layer.clear_weight_cache()
            for experts in self._experts:  # MoE experts keep cached weight casts too
                experts.clear_weight_cache()
        return take

    def _fp8_layers(self) -> list[FP8Linear]:
        if self._layers_of is not self.module:
            self._layers = [m for m in self.module.modules() if isinstance(m, FP8Linear)]
            self._experts = [m for m in self.module.modules() if isinstance(m, FP8ExpertsMixin)]
            self._layers_of = self.module
        return self._layers

    def after_optimizer_step(self, scaler_skipped: Union[torch.Tensor, bool, None] = None) -> None:
        """Apply the step's amaxes now, with the reduction: between steps (checkpoints,
        validation, the end of training) the FP8 state is settled and the same on every rank.
        The next forward starts a new training step and finds nothing pending: one amax
        reduction per optimizer step, however many micro-batches it accumulated. Call it for
        every optimizer step the loop attempts, including one a loss scaler skips.

        Args:
            scaler_skipped: with a loss scaler, whether it skipped this step, so that skipped
                steps in a row are counted: a bool tensor (read later, with the fault check's
                figures), or a bool where the loop already knows it on the host.
        """
        self._step = None
        self.optimizer_steps += 1
        if scaler_skipped is not None:
            self.faults.scaler_step(scaler_skipped)
        if self._calibrator is not None and self.optimizer_steps >= self.calibration_steps:
            self.calibration = self._calibrator.finish(self.amax_reduction_group)
            self._calibrator = None
            if self.report is not None:  # the conversion report shows each layer's scaling from now on
                self.calibration.annotate(self.report)
        if self.module is not None:
            update_pending_scales(self.module, self.amax_reducer())
            if self.graphs is not None and not self.graphs.captured and self.optimizer_steps >= self.calibration_steps:
                # After the first step: its calls are the samples; the next step replays.
                self.graphs.capture(self._contexts(None, None, cache=False))
        if self.reference is not None:
            self.reference.end_step()
        if self.statistics is not None:
            self.statistics.end_step(self.amax_reduction_group)

    def pop_metrics(self) -> dict[str, float]:
        """The figures of the reference checks (``fp8_ref/...``) and the sampled statistics
        (``fp8_stats/...``) formed since the last call, once; empty when none were. The
        statistics wait on the device until this call reads them (one host read): call it when
        a logger takes them."""
        metrics = self.reference.pop_metrics() if self.reference is not None else {}
        if self.statistics is not None:
            metrics.update(self.statistics.pop_metrics())
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The FP8 state of the module (every rank must call it: it may reduce).

        Between optimizer steps: settled, the last step's amaxes reduced and turned into scales.
        In the middle of one (a save between accumulated micro-batches, as Lightning's
        ``ModelCheckpoint(every_n_train_steps=...)`` makes after a resume): as it stands, the
        step's amaxes still pending, so that saving never changes the scales its remaining
        micro-batches cast with (a resumed run applies them under the recipe in force).
        """
        if self.module is None:
            return {}
        if self._step is None:
            update_pending_scales(self.module, self.amax_reducer())
        # Frozen weights kept only in FP8 go here too: the module's own state_dict() carries them
        # dequantized (vanilla), and a resume restores their exact bytes and scales from here.
        return {**fp8_state_dict(self.module), **frozen_weights_state(self.module)}

    def load_state_dict(self, saved: dict[str, Any], owner: str) -> None:
        """Restore what :meth:`state_dict` returned into the converted module.

        Raises:
            RuntimeError: no module converted yet, state for layers that are not FP8 here, or a
                corrupted state (named; nothing is loaded then).
        """
        if not saved:
            return
        if self.module is None:
            raise RuntimeError(f"{owner}.load_state_dict called before convert_module: no module to restore into")
        # Every layer's state is checked before any is loaded: a corrupted one is never half-applied.
        for key, value in saved.items():
            if is_scaling_state_key(key):
                check_saved_state(value, key)
        result = self.module.load_state_dict(saved, strict=False)
        # The checkpoint's scales (and scaling choices) stand: no calibration steps again.
        self.calibration_steps = min(self.calibration_steps, self.optimizer_steps)
        self._calibrator = None
        if result.unexpected_keys:
            raise RuntimeError(
                "The checkpoint holds FP8 state for layers this model does not run in FP8: "
                f"{result.unexpected_keys[:5]}; convert the same layers (include/exclude) as when it was saved"
            )
        self.faults.restart_counts()

    def metrics(self) -> dict[str, float]:
        """Figures of the FP8 layers and FP8 MoE experts modules, from their scaling state (one
        host sync); empty when the module has neither.

        - ``fp8/layers``: the number of ``FP8Linear`` layers;
        - ``fp8/scale_min``, ``fp8/scale_max``: the smallest and largest scale (float32, the
          factor applied before an FP8 cast) over every role (input, weight, grad_output) of every
          FP8 layer and of every expert's projection;
        - ``fp8/nonfinite_amax``: casts whose amax was inf or NaN, and ``fp8/amax_outliers``:
          delayed-scaling updates whose amax was an outlier, summed over the same states;
        - ``fp8/nonfinite_skipped_steps``: optimizer steps skipped for non-finite gradients.

        With FP8 experts modules (``fp8_plugin.modules.experts``) also:

        - ``fp8/experts``: the number of experts modules, ``fp8/expert_projections``: the
          per-expert scaling states they hold (experts x 2 projections per module);
        - ``fp8/experts_scale_min``, ``fp8/experts_scale_max``: the scale range over those
          states alone (one scale per expert per projection per role).
        """
        layers = self._fp8_layers() if self.module is not None else []
        experts = self._experts if self.module is not None else []
        states = [m.fp8_state for m in layers]
        expert_states = [g.fp8_state for m in experts for proj in m.fp8_scaling.values() for g in proj]
        if not states and not expert_states:
            return {}
        every = states + expert_states
        scales = torch.stack([s.scale for s in every])
        nonfinite = torch.stack([s.nonfinite_amax_count for s in every]).sum()
        outliers = torch.stack([s.outlier_count for s in every]).sum()
        figures = [scales.min(), scales.max(), nonfinite.to(scales.dtype), outliers.to(scales.dtype)]
        if expert_states:
            expert_scales = scales[len(states):]
            figures += [expert_scales.min(), expert_scales.max()]
        values = torch.stack(figures).tolist()
        metrics = {
            "fp8/layers": float(len(layers)),
            "fp8/scale_min": values[0],
            "fp8/scale_max": values[1],
            "fp8/nonfinite_amax": values[2],
            "fp8/amax_outliers": values[3],
            "fp8/nonfinite_skipped_steps": float(self.faults.skipped_steps),
        }
        if expert_states:
            metrics.update({
                "fp8/experts": float(len(experts)),
                "fp8/expert_projections": float(len(expert_states)),
                "fp8/experts_scale_min": values[4],
                "fp8/experts_scale_max": values[5],
            })
        return metrics


def _drop_fp8_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and is_scaling_state_key(k)]:
        del state_dict[key]
    dequantize_in_state_dict(module, state_dict, prefix)
