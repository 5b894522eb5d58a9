"""``Trainer(precision="fp8-hybrid")``: FP8 precision strings for Lightning.

Lightning has no registry for precision strings: its accelerator connector accepts a fixed list.
This module extends it in one place: ``_AcceleratorConnector._check_config_and_set_final_flags``
is wrapped so that an ``"fp8-*"`` string becomes an :class:`FP8Precision` plugin (as if passed in
``plugins=[...]``) before Lightning validates the flag. The wrap is applied once, on
``import fp8_plugin``, and only to the Lightning versions it was written for.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Callable, Union

import torch
from packaging.version import Version

from ..formats import Format
from ..recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe
from .precision import FP8FSDPPrecision, FP8Precision

__all__ = ["PRECISION_STRINGS", "precision_plugin_from_string", "register_precision_strings", "SUPPORTED_LIGHTNING"]

# Lightning versions whose connector has the method and signature wrapped here.
SUPPORTED_LIGHTNING = (Version("2.4"), Version("3"))

# precision string -> (recipe, compute dtype of the non-FP8 ops). Float16 turns loss scaling on.
PRECISION_STRINGS: dict[str, tuple[Callable[[], Recipe], torch.dtype]] = {
    # The best native recipe for the device ("auto": MXFP8 on Blackwell, delayed scaling
    # elsewhere), E4M3 forward / E5M2 backward, BF16 for the non-FP8 ops.
    "fp8-hybrid": (lambda: AutoRecipe(fp8_format=Format.HYBRID), torch.bfloat16),
    # "auto" with E4M3 in both passes.
    "fp8-e4m3": (lambda: AutoRecipe(fp8_format=Format.E4M3), torch.bfloat16),
    # The same with FP16 for the non-FP8 ops and dynamic loss scaling (GPUs without BF16).
    "fp8-hybrid-float16": (lambda: AutoRecipe(fp8_format=Format.HYBRID), torch.float16),
    "fp8-e4m3-float16": (lambda: AutoRecipe(fp8_format=Format.E4M3), torch.float16),
    # Per-tensor delayed scaling (amax history), HYBRID, on every device.
    "fp8-delayed": (DelayedScaling, torch.bfloat16),
    # Per-tensor current scaling, HYBRID.
    "fp8-current": (Float8CurrentScaling, torch.bfloat16),
    # OCP MXFP8: E8M0 scale per 32 values, E4M3 (TE's default).
    "fp8-mxfp8": (MXFP8BlockScaling, torch.bfloat16),
    # DeepSeek-V3 style 1x128 / 128x128 blocks, FP32 power-of-two scales, E4M3.
    "fp8-blockwise": (Float8BlockScaling, torch.bfloat16),
}


def precision_plugin_from_string(
    precision: str, strategy: object = None, accelerator: object = None
) -> Union[FP8Precision, FP8FSDPPrecision]:
    """The plugin a precision string names, for the Trainer's ``strategy`` and ``accelerator``.

    ``FSDPStrategy`` (``"fsdp"`` or an instance) gets :class:`FP8FSDPPrecision`, every other
    strategy :class:`FP8Precision`.

    Raises:
        ValueError: unknown ``fp8-*`` string (the message lists the valid ones), or a DeepSpeed
            strategy (not supported: DeepSpeed owns mixed precision and the optimizer step).
    """
    entry = PRECISION_STRINGS.get(precision.lower())
    if entry is None:
        raise ValueError(
            f"precision={precision!r} is not a valid FP8 precision; valid: {', '.join(PRECISION_STRINGS)}"
        )
    name = strategy.lower() if isinstance(strategy, str) else type(strategy).__name__.lower()
    if "deepspeed" in name:
        raise ValueError(
            f"precision={precision!r} with strategy={strategy!r} is not supported: DeepSpeed runs its own "
            "mixed precision and loss scaling. Valid strategies: 'auto', 'ddp', 'fsdp', ModelParallelStrategy "
            "(FSDP2), or a single device"
        )
    make_recipe, compute_dtype = entry
    if name.startswith("fsdp"):
        return FP8FSDPPrecision(make_recipe(), compute_dtype=compute_dtype, precision=precision.lower())
    device = "cpu" if (accelerator == "cpu" or type(accelerator).__name__ == "CPUAccelerator") else None
    return FP8Precision(make_recipe(), compute_dtype=compute_dtype, precision=precision.lower(), device=device)


def _is_fp8_string(precision: object) -> bool:
    return isinstance(precision, str) and precision.lower().startswith("fp8")


def register_precision_strings() -> bool:
    """Teach ``lightning.pytorch.Trainer`` the ``"fp8-*"`` precision strings. Idempotent.

    Returns:
        True when the strings are registered; False (with a warning) on a Lightning version
        outside ``SUPPORTED_LIGHTNING``, where ``plugins=[FP8Precision()]`` still works.
    """
    import lightning
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    if getattr(_AcceleratorConnector, "_fp8_plugin_registered", False):
        return True
    low, high = SUPPORTED_LIGHTNING
    version = Version(lightning.__version__)
    if not low <= version < high:
        warnings.warn(
            f"fp8_plugin: lightning=={version} is outside the supported range [{low}, {high}); precision "
            "strings 'fp8-*' are not registered. Use Trainer(plugins=[fp8_plugin.FP8Precision()]).",
            stacklevel=2,
        )
        return False
    original = _AcceleratorConnector._check_config_and_set_final_flags

    @functools.wraps(original)
    def _check_config_and_set_final_flags(self, strategy, accelerator, precision, plugins, sync_batchnorm):
        if _is_fp8_string(precision):
            plugin = precision_plugin_from_string(precision, strategy, accelerator)
            if plugins is None:
                plugins = []
            elif not isinstance(plugins, Iterable) or isinstance(plugins, (str, torch.nn.Module)):
                plugins = [plugins]
            plugins = list(plugins)
            if any(isinstance(p, Precision) for p in plugins):
                raise ValueError(
                    f"Received both precision={precision!r} and a precision plugin in plugins={plugins}; choose one"
                )
            plugins.append(plugin)
            precision = None
        return original(self, strategy, accelerator, precision, plugins, sync_batchnorm)

    _AcceleratorConnector._check_config_and_set_final_flags = _check_config_and_set_final_flags
    _AcceleratorConnector._fp8_plugin_registered = True
    return True
