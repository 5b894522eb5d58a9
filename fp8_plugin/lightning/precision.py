"""Lightning precision plugins for FP8 GEMMs with FP32 master weights.

- :class:`FP8Precision` for single-device, DDP and FSDP2 (``ModelParallelStrategy``) training,
  built on Lightning's ``MixedPrecision`` (its loss-scaling steps, its scaler checkpointing).
- :class:`FP8FSDPPrecision` for ``FSDPStrategy``, which accepts ``FSDPPrecision`` plugins only;
  built on Lightning's ``FSDPPrecision`` (``ShardedGradScaler``).

Both add the same FP8 behaviour (:class:`_FP8Behaviour`): ``convert_module`` swaps the linear
layers with :func:`fp8_plugin.convert_model`; ``forward_context`` enters torch autocast (BF16 or
FP16 for the non-FP8 ops) and :func:`fp8_plugin.autocast` with a MAX all-reduce of the step's
amaxes when several ranks train; FP8 state (and the loss scaler's) travels in checkpoints.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ..autocast import AmaxReducer, autocast
from ..convert import ConversionReport, convert_model, fp8_state_dict
from ..distributed import amax_reducer
from ..linear import FP8Linear
from ..quantizers import is_scaling_state_key
from ..scaling_group import update_pending_scales
from ..recipes import AutoRecipe, Recipe, check_recipe

__all__ = ["FP8Precision", "FP8FSDPPrecision", "COMPUTE_DTYPES"]

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STATE_KEY = "fp8_state"
_SCALER_KEY = "loss_scaler"
Patterns = Union[str, Sequence[str], None]


def _check_arguments(plugin: str, recipe: Optional[Recipe], compute_dtype: torch.dtype) -> Recipe:
    check_recipe(recipe, plugin)
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"{plugin}(compute_dtype={compute_dtype}) is not supported; valid: "
            f"{', '.join(str(d) for d in COMPUTE_DTYPES)}"
        )
    return recipe if recipe is not None else AutoRecipe()


class _FP8Behaviour:
    """The FP8 half of both plugins; the other half (scaler, FSDP config) is Lightning's."""

    recipe: Recipe
    include: Patterns
    exclude: Patterns
    compute_dtype: torch.dtype
    amax_reduction_group: Optional["dist.ProcessGroup"]
    scaler: Optional["torch.amp.GradScaler"]

    def _init_fp8(self, recipe: Recipe, include: Patterns, exclude: Patterns, compute_dtype: torch.dtype,
                  amax_reduction_group: Optional["dist.ProcessGroup"], precision: str) -> None:
        self.recipe = recipe
        self.include = include
        self.exclude = exclude
        self.compute_dtype = compute_dtype
        self.amax_reduction_group = amax_reduction_group
        self.precision = precision  # type: ignore[assignment]
        self.report: Optional[ConversionReport] = None
        self._module: Optional[nn.Module] = None
        self._device_type = "cpu"
        self._reducer: Optional[AmaxReducer] = None
        self._reducer_ready = False
        self._scale_before_step: Optional[torch.Tensor] = None
        self._skipped_steps: Optional[torch.Tensor] = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        if module is self._module:  # fit then test/validate/predict: converted already
            return module
        self.report = convert_model(module, self.recipe, include=self.include, exclude=self.exclude)
        self._module = module
        # Every checkpoint Lightning writes takes the module's state from module.state_dict(),
        # weights-only ones too (which skip on_save_checkpoint): keep it vanilla, so that
        # load_from_checkpoint into a plain module works; FP8 state travels under this plugin's
        # key (state_dict below), settled and identical on every rank.
        module.register_state_dict_post_hook(_drop_fp8_state)
        rank_zero_info(f"FP8 layers:\n{self.report}")
        return module

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> Any:
        # Called after the model is on its device: that is the device torch autocast must target.
        param = next(model.parameters(), None)
        if param is not None:
            self._device_type = param.device.type
        return super().connect(model, optimizers, lr_schedulers)  # type: ignore[misc]

    def amax_reducer(self) -> Optional[AmaxReducer]:
        """The MAX all-reduce of each step's amaxes (None on one rank); built once, when first
        needed, because the process group exists only after the strategy set it up."""
        if not self._reducer_ready:
            self._reducer = amax_reducer(self.amax_reduction_group)
            self._reducer_ready = True
        return self._reducer

    def forward_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.compute_dtype != torch.float32:
            stack.enter_context(torch.autocast(self._device_type, dtype=self.compute_dtype))
        stack.enter_context(autocast(enabled=True, reduce_amax=self.amax_reducer()))
        return stack

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # The scale the backward used, kept on device: a lower scale after update() means the
        # step was skipped for inf/NaN gradients (GradScaler only backs off then). No sync.
        scale = getattr(self.scaler, "_scale", None)
        self._scale_before_step = scale.clone() if scale is not None else None
        super()._after_closure(model, optimizer)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        # The step's amaxes become scales now, with the reduction: between steps (checkpoints,
        # validation, the end of fit) the FP8 state is settled and the same on every rank. The
        # next forward then finds nothing pending: still one amax reduction per step.
        if self._module is not None:
            update_pending_scales(self._module, self.amax_reducer())
        scale = getattr(self.scaler, "_scale", None)
        if scale is not None and self._scale_before_step is not None:
            skipped = (scale < self._scale_before_step).to(torch.int64)
            self._skipped_steps = skipped if self._skipped_steps is None else self._skipped_steps + skipped
            self._scale_before_step = None
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.loggers and trainer.global_step % trainer.log_every_n_steps == 0:
            metrics = self.fp8_metrics()
            if metrics and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        return output

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped by the loss scaler for inf/NaN gradients (one host sync)."""
        return 0 if self._skipped_steps is None else int(self._skipped_steps.item())

    def fp8_metrics(self) -> dict[str, float]:
        """FP8 figures of the converted module: layer count, min/max scale, non-finite amaxes;
        with loss scaling also the loss scale and the skipped steps so far.

        One host-device synchronisation; called at ``log_every_n_steps`` only.
        """
        layers = [m for m in (self._module.modules() if self._module else ()) if isinstance(m, FP8Linear)]
        if not layers:
            return {}
        scales = torch.stack([m.fp8_state.scale for m in layers])
        nonfinite = torch.stack([m.fp8_state.nonfinite_amax_count for m in layers]).sum()
        values = torch.stack([scales.min(), scales.max(), nonfinite.to(scales.dtype)]).tolist()
        metrics = {
            "fp8/layers": float(len(layers)),
            "fp8/scale_min": values[0],
            "fp8/scale_max": values[1],
            "fp8/nonfinite_amax": values[2],
        }
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
            update_pending_scales(self._module, self.amax_reducer())
            state[_STATE_KEY] = fp8_state_dict(self._module)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and _SCALER_KEY in state_dict:
            self.scaler.load_state_dict(state_dict[_SCALER_KEY])
        saved = state_dict.get(_STATE_KEY)
        if not saved:
            return
        if self._module is None:
            raise RuntimeError(f"{type(self).__name__}.load_state_dict called before convert_module: no module to restore into")
        result = self._module.load_state_dict(saved, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(
                "The checkpoint holds FP8 state for layers this model does not run in FP8: "
                f"{result.unexpected_keys[:5]}; convert the same layers (include/exclude) as when it was saved"
            )


def _drop_fp8_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and is_scaling_state_key(k)]:
        del state_dict[key]


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

    Raises:
        TypeError: ``recipe`` is not a Recipe.
        ValueError: ``compute_dtype`` is not one of the valid ones, or ``loss_scaling=False``
            with ``scaler``.

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
    ) -> None:
        recipe = _check_arguments("FP8Precision", recipe, compute_dtype)
        if loss_scaling is False and scaler is not None:
            raise ValueError("FP8Precision(loss_scaling=False, scaler=...) contradict each other; pass one")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is None and (loss_scaling or (loss_scaling is None and compute_dtype == torch.float16)):
            scaler = torch.amp.GradScaler(device=device)
        # Lightning's MixedPrecision runs the scaler ("16-mixed") or nothing ("bf16-mixed").
        super().__init__("16-mixed" if scaler is not None else "bf16-mixed", device=device, scaler=scaler)
        self._init_fp8(recipe, include, exclude, compute_dtype, amax_reduction_group, precision)

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
        recipe, include, exclude, compute_dtype, precision, amax_reduction_group: as
            :class:`FP8Precision` (``compute_dtype`` float32 means no autocast).
        scaler: a ``ShardedGradScaler``; default one for float16, none otherwise.

    Raises:
        TypeError: ``recipe`` is not a Recipe.
        ValueError: ``compute_dtype`` is not one of the valid ones.
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
    ) -> None:
        recipe = _check_arguments("FP8FSDPPrecision", recipe, compute_dtype)
        base = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}[compute_dtype]
        super().__init__(base, scaler=scaler)
        self._init_fp8(recipe, include, exclude, compute_dtype, amax_reduction_group, precision)

    @property
    @override
    def mixed_precision_config(self) -> Any:
        from torch.distributed.fsdp.fully_sharded_data_parallel import MixedPrecision as TorchMixedPrecision

        return TorchMixedPrecision(param_dtype=self.compute_dtype, reduce_dtype=torch.float32, buffer_dtype=None)
