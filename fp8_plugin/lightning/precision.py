"""``FP8Precision``: a Lightning precision plugin for FP8 GEMMs with FP32 master weights.

Modelled on Lightning's own plugins (``MixedPrecision``, ``TransformerEnginePrecision``):
``convert_module`` swaps the linear layers with :func:`fp8_plugin.convert_model`,
``forward_context`` enters torch autocast (BF16 for the non-FP8 ops) and
:func:`fp8_plugin.autocast`, and parameters and optimizer states stay FP32.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ..autocast import autocast, update_pending_scales
from ..convert import ConversionReport, convert_model, fp8_state_dict, fp8_state_keys
from ..linear import FP8Linear
from ..recipes import AutoRecipe, Recipe

__all__ = ["FP8Precision"]

COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
_STATE_KEY = "fp8_state"


class FP8Precision(Precision):
    """FP8 training for ``lightning.pytorch``: ``Trainer(plugins=[FP8Precision()])``.

    After ``import fp8_plugin``, ``Trainer(precision="fp8-hybrid")`` builds this plugin too.

    Args:
        recipe: scaling recipe of the FP8 layers; default ``AutoRecipe()`` (HYBRID): the best
            recipe the training device runs natively, resolved when the model is converted
            (``self.report.recipe`` holds the one chosen).
        include, exclude: module-name glob patterns passed to :func:`fp8_plugin.convert_model`.
        compute_dtype: dtype of the non-FP8 ops (attention, norms, heads) under torch autocast:
            ``torch.bfloat16`` (default) or ``torch.float32`` (no autocast).
        precision: the name Lightning reports as ``trainer.precision``.

    Raises:
        ValueError: ``compute_dtype`` is not one of the valid ones.
        TypeError: ``recipe`` is not a Recipe.

    .. note::
        FP8 scaling state travels in Lightning checkpoints under this plugin's key, not in
        ``checkpoint["state_dict"]``, so ``LightningModule.load_from_checkpoint`` gives the plain
        (unconverted) module with trained weights, and ``trainer.fit(ckpt_path=...)`` resumes
        with identical scales.

    .. note::
        FP16 compute needs dynamic loss scaling, which this plugin does not provide yet.
    """

    def __init__(
        self,
        recipe: Optional[Recipe] = None,
        *,
        include: Union[str, Sequence[str], None] = None,
        exclude: Union[str, Sequence[str], None] = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        precision: str = "fp8-hybrid",
    ) -> None:
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"FP8Precision(recipe={recipe!r}) is not a recipe; valid: AutoRecipe(...), DelayedScaling(...), "
                "Float8CurrentScaling(...), Float8BlockScaling(...), MXFP8BlockScaling(...) or None"
            )
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"FP8Precision(compute_dtype={compute_dtype}) is not supported; valid: "
                f"{', '.join(str(d) for d in COMPUTE_DTYPES)} (float16 needs loss scaling, not available yet)"
            )
        self.recipe = recipe if recipe is not None else AutoRecipe()
        self.include = include
        self.exclude = exclude
        self.compute_dtype = compute_dtype
        self.precision = precision  # type: ignore[assignment]
        self.report: Optional[ConversionReport] = None
        self._module: Optional[nn.Module] = None
        self._device_type = "cpu"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if module is self._module:  # fit then test/validate/predict: converted already
            return module
        self.report = convert_model(module, self.recipe, include=self.include, exclude=self.exclude)
        self._module = module
        rank_zero_info(f"FP8 layers:\n{self.report}")
        return module

    @override
    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> Any:
        # Called after the model is on its device: that is the device torch autocast must target.
        param = next(model.parameters(), None)
        if param is not None:
            self._device_type = param.device.type
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.compute_dtype != torch.float32:
            stack.enter_context(torch.autocast(self._device_type, dtype=self.compute_dtype))
        stack.enter_context(autocast(enabled=True))
        return stack

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.loggers and trainer.global_step % trainer.log_every_n_steps == 0:
            metrics = self.fp8_metrics()
            if metrics and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        return output

    def fp8_metrics(self) -> dict[str, float]:
        """A few FP8 figures of the converted module: layer count, min/max scale, non-finite amaxes.

        One host-device synchronisation; called at ``log_every_n_steps`` only.
        """
        layers = [m for m in (self._module.modules() if self._module else ()) if isinstance(m, FP8Linear)]
        if not layers:
            return {}
        scales = torch.stack([m.fp8_state.scale for m in layers])
        nonfinite = torch.stack([m.fp8_state.nonfinite_amax_count for m in layers]).sum()
        values = torch.stack([scales.min(), scales.max(), nonfinite.to(scales.dtype)]).tolist()
        return {
            "fp8/layers": float(len(layers)),
            "fp8/scale_min": values[0],
            "fp8/scale_max": values[1],
            "fp8/nonfinite_amax": values[2],
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._module is None:
            return {}
        update_pending_scales()
        return {_STATE_KEY: {k: v.clone() for k, v in fp8_state_dict(self._module).items()}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The module is restored before convert_module runs on resume, and load_from_checkpoint
        # builds a plain module: keep checkpoint["state_dict"] vanilla, FP8 state lives above.
        if self._module is not None and "state_dict" in checkpoint:
            for key in fp8_state_keys(self._module):
                checkpoint["state_dict"].pop(key, None)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(_STATE_KEY)
        if not saved:
            return
        if self._module is None:
            raise RuntimeError("FP8Precision.load_state_dict called before convert_module: no module to restore into")
        result = self._module.load_state_dict(saved, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(
                "The checkpoint holds FP8 state for layers this model does not run in FP8: "
                f"{result.unexpected_keys[:5]}; convert the same layers (include/exclude) as when it was saved"
            )
