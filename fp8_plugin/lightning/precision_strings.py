"""``Trainer(precision="fp8-hybrid")``: FP8 precision strings for Lightning.

Lightning has no registry for precision strings: its accelerator connector accepts a fixed list.
:mod:`fp8_plugin.lightning.import_hook` extends it in one place, when Lightning's connector is imported:
an ``"fp8-*"`` string becomes the plugin :func:`precision_plugin_from_string` builds (as if
passed in ``plugins=[...]``) before Lightning validates the flag, and only on the Lightning
versions the wrap was written for.

As Lightning picks its ``DeepSpeedPrecision`` for a DeepSpeed strategy, a DeepSpeed strategy
(``"deepspeed_stage_2"``, a ``DeepSpeedStrategy(stage=3)`` object) with an ``"fp8-*"`` string
gets :class:`~fp8_plugin.lightning.deepspeed_precision.FP8DeepSpeedPrecision`: the string's recipe,
and DeepSpeed's ``bf16`` (``"bf16-mixed"``) or, for the ``"-float16"`` strings, ``fp16`` with its
dynamic loss scaler (``"16-mixed"``) for the non-FP8 ops.
"""

from __future__ import annotations

from typing import Union

import torch

from ..training.precision_strings import PRECISION_STRINGS, settings_for_loop
from .deepspeed_precision import FP8DeepSpeedPrecision
from .precision import FP8FSDPPrecision, FP8Precision

__all__ = ["PRECISION_STRINGS", "precision_plugin_from_string"]

# Compute dtype of a string -> DeepSpeed's precision setting (Lightning's DeepSpeedPrecision names).
_DEEPSPEED_PRECISION = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


def precision_plugin_from_string(
    precision: str, strategy: object = None, accelerator: object = None
) -> Union[FP8Precision, FP8FSDPPrecision, FP8DeepSpeedPrecision]:
    """The plugin a precision string names, for the Trainer's ``strategy`` and ``accelerator``.

    ``FSDPStrategy`` (``"fsdp"`` or an instance) gets :class:`FP8FSDPPrecision`, a DeepSpeed
    strategy (``"deepspeed"``, ``"deepspeed_stage_1"`` to ``"deepspeed_stage_3_offload_nvme"``,
    or a ``DeepSpeedStrategy`` instance) :class:`FP8DeepSpeedPrecision` (DeepSpeed's ``bf16``, or
    ``fp16`` for the ``"-float16"`` strings), every other strategy :class:`FP8Precision`.

    Raises:
        ValueError: unknown ``fp8-*`` string (the message lists the valid ones).
    """
    settings = settings_for_loop(precision, strategy, accelerator,
                                 "'auto', 'ddp', 'fsdp', ModelParallelStrategy (FSDP2), 'deepspeed*' "
                                 "(DeepSpeedStrategy), or a single device", accepts_deepspeed=True)
    recipe, name = settings.make_recipe(), precision.lower()
    if settings.deepspeed:
        return FP8DeepSpeedPrecision(recipe, precision=_DEEPSPEED_PRECISION[settings.compute_dtype])
    if settings.strategy.startswith("fsdp"):
        return FP8FSDPPrecision(recipe, compute_dtype=settings.compute_dtype, precision=name)
    return FP8Precision(recipe, compute_dtype=settings.compute_dtype, precision=name, device=settings.device)
