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
from typing import Callable

import torch
from packaging.version import Version

from ..formats import Format
from ..recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from .precision import FP8Precision

__all__ = ["PRECISION_STRINGS", "precision_plugin_from_string", "register_precision_strings", "SUPPORTED_LIGHTNING"]

# Lightning versions whose connector has the method and signature wrapped here.
SUPPORTED_LIGHTNING = (Version("2.4"), Version("3"))

PRECISION_STRINGS: dict[str, Callable[[], FP8Precision]] = {
    # The best native recipe for the device ("auto": MXFP8 on Blackwell, delayed scaling
    # elsewhere), E4M3 forward / E5M2 backward, BF16 for the non-FP8 ops.
    "fp8-hybrid": lambda: FP8Precision(AutoRecipe(fp8_format=Format.HYBRID), precision="fp8-hybrid"),
    # "auto" with E4M3 in both passes.
    "fp8-e4m3": lambda: FP8Precision(AutoRecipe(fp8_format=Format.E4M3), precision="fp8-e4m3"),
    # Per-tensor delayed scaling (amax history), HYBRID, on every device.
    "fp8-delayed": lambda: FP8Precision(DelayedScaling(), precision="fp8-delayed"),
    # Per-tensor current scaling, HYBRID.
    "fp8-current": lambda: FP8Precision(Float8CurrentScaling(), precision="fp8-current"),
    # OCP MXFP8: E8M0 scale per 32 values, E4M3 (TE's default).
    "fp8-mxfp8": lambda: FP8Precision(MXFP8BlockScaling(), precision="fp8-mxfp8"),
    # DeepSeek-V3 style 1x128 / 128x128 blocks, FP32 power-of-two scales, E4M3.
    "fp8-blockwise": lambda: FP8Precision(Float8BlockScaling(), precision="fp8-blockwise"),
}


def precision_plugin_from_string(precision: str) -> FP8Precision:
    """The :class:`FP8Precision` plugin a precision string names.

    Raises:
        ValueError: unknown ``fp8-*`` string; the message lists the valid ones.
    """
    factory = PRECISION_STRINGS.get(precision.lower())
    if factory is None:
        raise ValueError(
            f"precision={precision!r} is not a valid FP8 precision; valid: {', '.join(PRECISION_STRINGS)}"
        )
    return factory()


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
            plugin = precision_plugin_from_string(precision)
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
