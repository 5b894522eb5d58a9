"""The ``"fp8-*"`` precision strings, shared by every training loop that takes one.

Each names a recipe and the dtype of the non-FP8 ops; float16 turns dynamic loss scaling on.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..numerics.formats import Format
from ..numerics.recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe

__all__ = ["PRECISION_STRINGS", "parse_precision_string", "StringSettings", "is_deepspeed_strategy",
           "settings_for_loop"]

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


def parse_precision_string(precision: str) -> tuple[Callable[[], Recipe], torch.dtype]:
    """``(recipe factory, compute dtype)`` of an ``"fp8-*"`` string (case-insensitive).

    Raises:
        ValueError: unknown string; the message lists the valid ones.
    """
    entry = PRECISION_STRINGS.get(precision.lower())
    if entry is None:
        raise ValueError(
            f"precision={precision!r} is not a valid FP8 precision; valid: {', '.join(PRECISION_STRINGS)}"
        )
    return entry


class StringSettings(NamedTuple):
    """What an ``"fp8-*"`` string means for one loop: recipe factory, compute dtype, the
    strategy's name (lower case), the device type the plugin should target (None: default) and
    whether the strategy is a DeepSpeed one (its loop then builds a DeepSpeed FP8 plugin)."""

    make_recipe: Callable[[], Recipe]
    compute_dtype: torch.dtype
    strategy: str
    device: Optional[str]
    deepspeed: bool = False


def is_deepspeed_strategy(strategy: object) -> bool:
    """Whether a loop's ``strategy`` flag names DeepSpeed: a string such as ``"deepspeed"`` or
    ``"deepspeed_stage_3_offload"``, or an object of a class whose name (or a base's) says so
    (Lightning's ``DeepSpeedStrategy`` and its subclasses)."""
    if isinstance(strategy, str):
        return "deepspeed" in strategy.lower()
    return any("deepspeed" in cls.__name__.lower() for cls in type(strategy).__mro__)


def settings_for_loop(precision: str, strategy: object, accelerator: object, valid_strategies: str,
                      accepts_deepspeed: bool = False, loop: str = "this training loop") -> StringSettings:
    """Parse ``precision`` for a loop given its ``strategy`` and ``accelerator`` flags.

    Args:
        accepts_deepspeed: whether the loop has an FP8 plugin for DeepSpeed strategies (the
            Trainer's :class:`~fp8_plugin.lightning.deepspeed_precision.FP8DeepSpeedPrecision`);
            otherwise a DeepSpeed strategy is refused.
        loop: the loop's name, for the refusal.

    Raises:
        ValueError: unknown string (the valid ones are listed), or a DeepSpeed strategy in a loop
            that does not accept one; the message lists ``valid_strategies``.
    """
    make_recipe, compute_dtype = parse_precision_string(precision)
    name = strategy.lower() if isinstance(strategy, str) else type(strategy).__name__.lower()
    deepspeed = is_deepspeed_strategy(strategy)
    if deepspeed and not accepts_deepspeed:
        raise ValueError(
            f"precision={precision!r} with strategy={strategy!r} is not supported by {loop}: fp8-plugin has "
            f"no FP8 precision plugin for its DeepSpeed strategy (the Lightning Trainer and "
            f"fp8_plugin.accelerate.Accelerator have one). "
            f"Valid strategies: {valid_strategies}"
        )
    device = "cpu" if (accelerator == "cpu" or type(accelerator).__name__ == "CPUAccelerator") else None
    return StringSettings(make_recipe, compute_dtype, name, device, deepspeed)
