"""``Trainer(precision="fp8-hybrid")``: FP8 precision strings for Lightning.

Lightning has no registry for precision strings: its accelerator connector accepts a fixed list.
:mod:`fp8_plugin.lightning.import_hook` extends it in one place, when Lightning's connector is imported:
an ``"fp8-*"`` string becomes the plugin :func:`precision_plugin_from_string` builds (as if
passed in ``plugins=[...]``) before Lightning validates the flag, and only on the Lightning
versions the wrap was written for.
"""

from __future__ import annotations

from typing import Union

from ..training.precision_strings import PRECISION_STRINGS, settings_for_loop
from .precision import FP8FSDPPrecision, FP8Precision

__all__ = ["PRECISION_STRINGS", "precision_plugin_from_string"]


def precision_plugin_from_string(
    precision: str, strategy: object = None, accelerator: object = None
) -> Union[FP8Precision, FP8FSDPPrecision]:
    """The plugin a precision string names, for the Trainer's ``strategy`` and ``accelerator``.

    ``FSDPStrategy`` (``"fsdp"`` or an instance) gets :class:`FP8FSDPPrecision`, every other
    strategy :class:`FP8Precision`.

    Raises:
        ValueError: unknown ``fp8-*`` string (the message lists the valid ones), or a DeepSpeed
            strategy (not supported: DeepSpeed owns mixed precision and the optimizer step).
    """
    settings = settings_for_loop(precision, strategy, accelerator,
                                 "'auto', 'ddp', 'fsdp', ModelParallelStrategy (FSDP2), or a single device")
    recipe, name = settings.make_recipe(), precision.lower()
    if settings.strategy.startswith("fsdp"):
        return FP8FSDPPrecision(recipe, compute_dtype=settings.compute_dtype, precision=name)
    return FP8Precision(recipe, compute_dtype=settings.compute_dtype, precision=name, device=settings.device)
