"""The transformers Trainer: ``from fp8_plugin.hf_trainer import FP8Trainer`` in place of ``Trainer``.

The Trainer runs its loop on Accelerate, so this adapter builds on :mod:`fp8_plugin.accelerate`.

May import: :mod:`fp8_plugin.accelerate`, :mod:`fp8_plugin.training` and below, transformers.
"""

from .trainer import FP8_STATE_NAME, FP8Trainer

__all__ = ["FP8Trainer", "FP8_STATE_NAME"]
