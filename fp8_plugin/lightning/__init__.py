"""PyTorch Lightning's Trainer: the FP8 precision plugins and the ``"fp8-*"`` precision strings.

``import fp8_plugin`` installs :mod:`~fp8_plugin.lightning.import_hook`, which teaches the
Trainer's and Fabric's connectors the strings when Lightning is imported; the plugin classes (and
so Lightning) are imported on first use (PEP 562), so importing this package stays light.

May import: :mod:`fp8_plugin.fabric` (the import hook hands Fabric's connector Fabric's plugin),
:mod:`fp8_plugin.training` and below, Lightning (inside the modules that need it).
"""

from typing import Any

from .import_hook import SUPPORTED_LIGHTNING, register_precision_strings

__all__ = ["FP8Precision", "FP8FSDPPrecision", "PRECISION_STRINGS", "precision_plugin_from_string",
           "register_precision_strings", "SUPPORTED_LIGHTNING"]

_LAZY = {"FP8Precision": "precision", "FP8FSDPPrecision": "precision",
         "PRECISION_STRINGS": "precision_strings", "precision_plugin_from_string": "precision_strings"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
