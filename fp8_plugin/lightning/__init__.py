"""PyTorch Lightning integration: the FP8 precision plugin and the ``"fp8-*"`` precision strings."""

from .precision import FP8FSDPPrecision, FP8Precision
from .precision_strings import PRECISION_STRINGS, precision_plugin_from_string, register_precision_strings

__all__ = ["FP8Precision", "FP8FSDPPrecision", "PRECISION_STRINGS", "precision_plugin_from_string", "register_precision_strings"]
