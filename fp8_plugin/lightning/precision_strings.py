"""``Trainer(precision="fp8-hybrid")``: FP8 precision strings for Lightning.

Lightning has no registry for precision strings: its accelerator connector accepts a fixed list.
:mod:`fp8_plugin.lightning_hook` extends it in one place, when Lightning's connector is imported:
an ``"fp8-*"`` string becomes the plugin :func:`precision_plugin_from_string` builds (as if
passed in ``plugins=[...]``) before Lightning validates the flag, and only on the Lightning
versions the wrap was written for.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from ..formats import Format
from ..recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe
from ..lightning_hook import SUPPORTED_LIGHTNING, register
from .precision import FP8FSDPPrecision, FP8Precision

__all__ = ["PRECISION_STRINGS", "precision_plugin_from_string", "register_precision_strings", "SUPPORTED_LIGHTNING"]


# precision string -> (recipe, compute dtype of the non-FP8 ops). Float16 turns loss scaling on.
PRECISION_STRINGS: dict[str, tuple[Callable[[], Recipe], torch.dtype]] = {
    # The best native recipe for the device ("auto": MXFP8 on Blackwell, delayed scaling
    # elsewhere), E4M3 forward / E5M2 backward, BF16 for the non-FP8 ops.
    "fp8-hybrid": (lambda: AutoRecipe(fp8_format=Format.HYBRID), torch.bfloat16),
    # "auto" with E4M3 in both passes.
    "fp8-e4m3": (lambda: AutoRecipe(fp8_format=Format.E4M3), torch.bfloat16),
    # The same with FP16 for the non-FP8 ops and dynamic loss scaling (GPUs without BF16).
    "fp8-hybrid-float16": (lambda: AutoRecipe(fp8_format=Format.HYBRID), torch.float16),
    "fp8-e4m3-float16": (lambda: AutoRecipe(fp8_format=Format.E4M3), torch.float16),
    # Per-tensor delayed scaling (amax history), HYBRID, on every device.
    "fp8-delayed": (DelayedScaling, torch.bfloat16),
    # Per-tensor current scaling, HYBRID.
    "fp8-current": (Float8CurrentScaling, torch.bfloat16),
    # OCP MXFP8: E8M0 scale per 32 values, E4M3 (TE's default).
    "fp8-mxfp8": (MXFP8BlockScaling, torch.bfloat16),
    # DeepSeek-V3 style 1x128 / 128x128 blocks, FP32 power-of-two scales, E4M3.
    "fp8-blockwise": (Float8BlockScaling, torch.bfloat16),
}


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
    entry = PRECISION_STRINGS.get(precision.lower())
    if entry is None:
        raise ValueError(
            f"precision={precision!r} is not a valid FP8 precision; valid: {', '.join(PRECISION_STRINGS)}"
        )
    name = strategy.lower() if isinstance(strategy, str) else type(strategy).__name__.lower()
    if "deepspeed" in name:
        raise ValueError(
            f"precision={precision!r} with strategy={strategy!r} is not supported: DeepSpeed runs its own "
            "mixed precision and loss scaling. Valid strategies: 'auto', 'ddp', 'fsdp', ModelParallelStrategy "
            "(FSDP2), or a single device"
        )
    make_recipe, compute_dtype = entry
    if name.startswith("fsdp"):
        return FP8FSDPPrecision(make_recipe(), compute_dtype=compute_dtype, precision=precision.lower())
    device = "cpu" if (accelerator == "cpu" or type(accelerator).__name__ == "CPUAccelerator") else None
    return FP8Precision(make_recipe(), compute_dtype=compute_dtype, precision=precision.lower(), device=device)


def register_precision_strings() -> bool:
    """Teach ``lightning.pytorch.Trainer`` the ``"fp8-*"`` precision strings now. Idempotent.

    ``import fp8_plugin`` already arranges this for when Lightning is imported
    (:mod:`fp8_plugin.lightning_hook`); calling it imports Lightning's accelerator connector.

    Returns:
        True when the strings are registered; False (with a warning) on a Lightning version
        outside ``SUPPORTED_LIGHTNING``, where ``plugins=[FP8Precision()]`` still works.
    """
    from lightning.pytorch.trainer.connectors import accelerator_connector

    return register(accelerator_connector)
