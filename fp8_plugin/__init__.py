"""fp8-plugin: FP8 mixed-precision training for Hugging Face models in Lightning and Accelerate.

Importing the package does not import Lightning: it arranges for the Lightning precision strings
(``"fp8-hybrid"``, ``"fp8-e4m3"``, the recipe strings) to be registered when Lightning is
imported (see :mod:`fp8_plugin.lightning_hook`). ``fp8_plugin.FP8Precision`` and
``fp8_plugin.FP8FSDPPrecision`` import Lightning when first used.
"""

from typing import Any


from .autocast import autocast, is_fp8_enabled, update_pending_scales
from .convert import ConversionReport, convert_model, split_fp8_state, too_small_for_fp8
from .export import export
from .faults import FaultPolicy, FP8NonFiniteError
from .device import DeviceReport, auto_recipe, describe_device
from .formats import Format
from .fsdp_fp8 import enable_fp8_all_gather
from .distributed import amax_reducer
from .lightning_hook import install as _install_lightning_hook
from .linear import FP8Linear
from .reference_check import FP8ReferenceCheckError, ReferenceCheck, ReferenceResult, reference_check
from .statistics import FP8Statistics
from .recipes import (
    AutoRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    QParams,
    Recipe,
)

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "QParams",
    "AutoRecipe",
    "auto_recipe",
    "describe_device",
    "DeviceReport",
    "FP8Linear",
    "FP8Precision",
    "FP8FSDPPrecision",
    "amax_reducer",
    "enable_fp8_all_gather",
    "autocast",
    "convert_model",
    "ConversionReport",
    "split_fp8_state",
    "export",
    "too_small_for_fp8",
    "FaultPolicy",
    "FP8Statistics",
    "FP8NonFiniteError",
    "is_fp8_enabled",
    "ReferenceCheck",
    "ReferenceResult",
    "FP8ReferenceCheckError",
    "reference_check",
    "update_pending_scales",
    "register_precision_strings",
]
__version__ = "0.1.0"

# The Lightning names, imported on first use (PEP 562).
_LIGHTNING_NAMES = ("FP8Precision", "FP8FSDPPrecision", "register_precision_strings")


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        from . import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module 'fp8_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LIGHTNING_NAMES))


_install_lightning_hook()
