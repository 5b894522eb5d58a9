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

# Lightning integration: importing fp8_plugin registers Trainer(precision="fp8-*").
try:
    from .lightning import FP8Precision, register_precision_strings
except ImportError:  # Lightning is optional for the numerics and Accelerate users
    FP8Precision = None  # type: ignore[assignment,misc]
else:
    register_precision_strings()
    __all__.append("FP8Precision")
