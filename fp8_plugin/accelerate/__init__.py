"""Hugging Face Accelerate: ``from fp8_plugin.accelerate import Accelerator``.

``Accelerator(mixed_precision="fp8")``, or ``accelerate launch`` with a config file whose
``mixed_precision`` is ``fp8``, trains with fp8-plugin's FP8 on any machine; see
:class:`~fp8_plugin.accelerate.accelerator.Accelerator` and docs/accelerate.md.
``ReferenceCheck`` (the BF16 reference checks' settings) is re-exported here for
``Accelerator(fp8_reference_check=...)`` and ``FP8Kwargs(reference_check=...)``.

May import: :mod:`fp8_plugin.training` and below, Accelerate.
"""

from ..training.reference import ReferenceCheck
from .accelerator import Accelerator
from .settings import FP8Kwargs, FP8Settings, resolve_settings

__all__ = ["Accelerator", "FP8Kwargs", "FP8Settings", "ReferenceCheck", "resolve_settings"]
