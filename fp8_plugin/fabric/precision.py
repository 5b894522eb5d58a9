"""Lightning Fabric: ``Fabric(precision="fp8-hybrid")`` or ``Fabric(plugins=[FP8Precision()])``.

A thin adapter of :class:`~fp8_plugin.training.core.FP8Training` onto Fabric's precision hooks, built
on Fabric's ``MixedPrecision`` (its ``GradScaler`` steps for float16). ``fabric.setup(model)``
converts the model; each forward of the set-up model runs in torch autocast plus
:func:`fp8_plugin.autocast` (with the amax all-reduce when several ranks train);
``fabric.backward`` and the optimizer step are Fabric's, and each step's amaxes become scales
right after the step. FP8 state is part of the model's own ``state_dict()`` (each FP8 layer's
``fp8_state._extra_state``), so ``fabric.save(path, {"model": model, ...})`` and
``fabric.load`` carry it in the user's checkpoint dict, with nothing to add.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn
from typing_extensions import override

from ..modules.convert import ConversionReport
from ..numerics.recipes import Recipe
from ..training.core import FP8Training, check_arguments, check_calibration_steps, check_eval_in_fp8
from ..training.faults import resolve_fault_policy
from ..training.precision_strings import settings_for_loop
from ..training.reference import ReferenceCheck, output_loss, resolve_reference_check
from ..training.statistics import FP8Statistics, statistics_config

__all__ = ["FP8Precision", "precision_plugin_from_string"]

Patterns = Union[str, Sequence[str], None]


class FP8Precision(MixedPrecision):
    """FP8 training for ``lightning.fabric``.

    Args:
        recipe: scaling recipe of the FP8 layers; default ``AutoRecipe()`` (HYBRID), resolved
            when the model is set up (``self.report.recipe`` holds the one chosen).
        include, exclude: module-name glob patterns passed to :func:`fp8_plugin.convert_model`.
        compute_dtype: dtype of the non-FP8 ops: ``torch.bfloat16`` (default), ``torch.float16``
            (dynamic loss scaling with ``torch.amp.GradScaler``) or ``torch.float32`` (no autocast,
            inputs left as they are).
        precision: the name the plugin reports as its ``precision``.
        scaler: the ``torch.amp.GradScaler`` for float16; default one.
        amax_reduction_group: process group whose ranks share amaxes; None means the world.
        device: device type of autocast and the scaler; None means "cuda" when CUDA is
            available, else "cpu".
        reference_every: run a BF16 reference check every this many optimizer steps (0 or
            None: off): the last forward of the set-up model before ``optimizer.step()`` is
            replayed, its loss read by ``ReferenceCheck.output_loss``. Single device or DDP.
        reference_check: a :class:`~fp8_plugin.training.reference.ReferenceCheck` (interval,
            thresholds, policy, report files). Figures: :meth:`reference_metrics` after each
            step (for ``fabric.log_dict``), :meth:`reference_summary` at the end.
        nonfinite, max_consecutive_skips: what ``fabric.step``-time non-finite gradients do
            (``"skip"``: ``optimizer.step`` is not run; ``"raise"``) and how many skipped steps
            in a row stop the run; see :mod:`fp8_plugin.training.faults`.
        statistics: per-layer FP8 statistics (:mod:`fp8_plugin.training.statistics`): an
            :class:`~fp8_plugin.training.statistics.FP8Statistics` or an interval in optimizer steps;
            read them with :meth:`statistics_metrics` for ``fabric.log_dict``. None: off.
        calibration_steps: the first this many optimizer steps train in the reference precision
            and calibrate every FP8 layer's scales and scaling (:func:`fp8_plugin.calibrate`'s
            work, from the training batches); the report is ``plugin.fp8.calibration``. 0
            (default): off.
        eval_in_fp8: forwards under ``torch.no_grad()`` (evaluation) run the FP8 layers in FP8
            (True, default: the plugin's precision applies to every forward, as Fabric's
            ``"bf16-mixed"`` does) or in the reference precision (False).

    Raises:
        TypeError: ``recipe`` is not a Recipe, or ``reference_check`` not a ReferenceCheck.
        ValueError: ``compute_dtype`` is not bfloat16, float16 or float32, a ``scaler`` with
            another compute dtype than float16, ``reference_every`` negative or
            contradicting ``reference_check``, an unknown ``nonfinite``, a negative
            ``max_consecutive_skips`` or ``calibration_steps``, an ``eval_in_fp8`` that is not a bool.
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        precision: str = "fp8-hybrid",
        scaler: Optional["torch.amp.GradScaler"] = None,
        amax_reduction_group: Optional["dist.ProcessGroup"] = None,
        device: Optional[str] = None,
        reference_every: Optional[int] = None,
        reference_check: Optional[ReferenceCheck] = None,
        nonfinite: Optional[str] = None,
        max_consecutive_skips: Optional[int] = None,
        statistics: Union[FP8Statistics, int, None] = None,
        calibration_steps: int = 0,
        eval_in_fp8: bool = True,
    ) -> None:
        recipe = check_arguments("fabric.FP8Precision", recipe, compute_dtype)
        check_calibration_steps(calibration_steps, "fabric.FP8Precision")
        check_eval_in_fp8(eval_in_fp8, "fabric.FP8Precision")
        reference = resolve_reference_check(reference_every, reference_check, "fabric.FP8Precision")
        faults = resolve_fault_policy(nonfinite, max_consecutive_skips)
        if scaler is not None and compute_dtype != torch.float16:
            raise ValueError(f"fabric.FP8Precision(scaler=...) needs compute_dtype=torch.float16, got {compute_dtype}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__("16-mixed" if compute_dtype == torch.float16 else "bf16-mixed", device=device, scaler=scaler)
        self.fp8 = FP8Training(recipe, include, exclude, compute_dtype, amax_reduction_group, reference, faults,
                               statistics_config(statistics, "fabric.FP8Precision"),
                               calibration_steps=calibration_steps, eval_in_fp8=eval_in_fp8)
        self.precision = precision  # type: ignore[assignment]

    @property
    def report(self) -> Optional[ConversionReport]:
        """What the conversion swapped, and why not the rest (None before ``fabric.setup``)."""
        return self.fp8.report

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        self.fp8.convert(module)
        return module

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.fp8.forward_context(self.device)

    @override
    def convert_input(self, data: Any) -> Any:
        data = data if self.fp8.compute_dtype == torch.float32 else super().convert_input(data)
        module = self.fp8.module
        # Fabric converts the set-up module's forward inputs right before the forward: the
        # moment (and the RNG state) a reference check replays from.
        if (self.fp8.reference is not None and module is not None and module.training
                and isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], dict)):
            args, kwargs = data
            loss_of = self.fp8.reference.config.output_loss or output_loss
            self.fp8.capture_replay(lambda: loss_of(module(*args, **kwargs)))
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        data = super().convert_output(data)
        module = self.fp8.module
        if module is not None and module.training and torch.is_grad_enabled():
            self.fp8.training_output(data)  # a check may take this forward's backward as its FP8 side
        return data

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Optional[nn.Module]) -> Any:
        self.fp8.before_backward(tensor, loss_scaled=self.scaler is not None)
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: torch.Tensor, module: Optional[nn.Module]) -> Any:
        output = super().post_backward(tensor, module)
        self.fp8.after_backward()
        return output

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        scale = getattr(self.scaler, "_scale", None)
        before = scale.clone() if scale is not None else None
        output = None
        if not getattr(optimizer, "_fp8_released", False):
            # Fabric's setup(model, optimizer) converts after the optimizer was built: drop the
            # high-precision weights kept only in FP8 since, which it would keep alive.
            self.fp8.release_replaced_weights(optimizer)
            optimizer._fp8_released = True
        if self.fp8.before_optimizer_step(loss_scaled=self.scaler is not None):
            output = super().optimizer_step(optimizer, **kwargs)
        # else: non-finite gradients under nonfinite="skip": weights and optimizer state unchanged
        scale = getattr(self.scaler, "_scale", None)
        self.fp8.after_optimizer_step(scale < before if scale is not None and before is not None else None)
        return output

    def fp8_metrics(self) -> dict[str, float]:
        """FP8 figures of the set-up model (one host sync): see ``FP8Training.metrics``."""
        return self.fp8.metrics()

    def reference_metrics(self) -> dict[str, float]:
        """The figures (``fp8_ref/...``) of the reference check the last optimizer step ran,
        once; empty when none ran. For ``fabric.log_dict``."""
        return self.fp8.reference.pop_metrics() if self.fp8.reference is not None else {}

    def statistics_metrics(self) -> dict[str, float]:
        """The per-layer FP8 statistics (``fp8_stats/...``) of the last sampled step, once; empty
        when none was sampled since the last call. For ``fabric.log_dict``: the figures wait on
        the device until this call reads them (one host read)."""
        return self.fp8.statistics.pop_metrics() if self.fp8.statistics is not None else {}

    def reference_summary(self) -> str:
        """The reference checks' text summary, after writing the report files they ask for."""
        if self.fp8.reference is None:
            return "FP8 reference checks: off"
        return self.fp8.reference.finish()


def precision_plugin_from_string(precision: str, strategy: object = None, accelerator: object = None) -> FP8Precision:
    """The Fabric plugin an ``"fp8-*"`` string names.

    Raises:
        ValueError: unknown string (the valid ones are listed), or a DeepSpeed strategy (Fabric
            has no FP8 DeepSpeed plugin here; the Trainer and ``fp8_plugin.accelerate.Accelerator`` do).
    """
    settings = settings_for_loop(precision, strategy, accelerator, "'auto', 'ddp', or a single device",
                                 loop="Fabric")
    return FP8Precision(settings.make_recipe(), compute_dtype=settings.compute_dtype, precision=precision.lower(),
                        device=settings.device)
