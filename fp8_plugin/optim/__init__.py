"""Optimizers whose states are kept in FP8: ``FP8AdamW`` (first moment E4M3 per 128-element block,
second moment BF16), and the block format of that moment.

May import: :mod:`fp8_plugin.numerics`, :mod:`fp8_plugin._private`.
"""

from .fp8_adamw import FP8AdamW

__all__ = ["FP8AdamW"]
