"""Lightning Fabric: ``L.Fabric(precision="fp8-hybrid")`` or ``plugins=[fp8_plugin.fabric.FP8Precision()]``.

A loop adapter of :class:`fp8_plugin.training.core.FP8Training`; see docs/fabric.md.

May import: :mod:`fp8_plugin.training` and below, Lightning Fabric (inside the methods that need it).
"""

from .precision import FP8Precision, precision_plugin_from_string

__all__ = ["FP8Precision", "precision_plugin_from_string"]
