"""fp8-plugin: FP8 mixed-precision training for Hugging Face models in Lightning and Accelerate.

Importing the package also registers the Lightning precision strings ``"fp8-hybrid"`` and
``"fp8-e4m3"`` and the recipe strings (see :mod:`fp8_plugin.lightning.precision_strings`).
"""

from .autocast import autocast, is_fp8_enabled, update_pending_scales
from .convert import ConversionReport, convert_model
from .device import DeviceReport, auto_recipe, describe_device
from .formats import Format
from .distributed import amax_reducer
from .lightning import FP8FSDPPrecision, FP8Precision, register_precision_strings
from .linear import FP8Linear
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
    "autocast",
    "convert_model",
    "ConversionReport",
    "is_fp8_enabled",
    "update_pending_scales",
]
__version__ = "0.1.0"

register_precision_strings()
