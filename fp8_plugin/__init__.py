"""fp8-plugin: FP8 mixed-precision training for Hugging Face models in Lightning and Accelerate."""

from .autocast import autocast, is_fp8_enabled, update_pending_scales
from .convert import ConversionReport, convert_model
from .formats import Format
from .linear import FP8Linear
from .recipes import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "FP8Linear",
    "autocast",
    "convert_model",
    "ConversionReport",
    "is_fp8_enabled",
    "update_pending_scales",
]
__version__ = "0.1.0"
