"""When an FP8 layer keeps its weight's FP8 casts for the next forward (``cache_fp8_weights``), and
the entry it keeps them in (:class:`WeightCache`).

An FP8 layer's weight casts (rowwise for fprop, columnwise for dgrad: 2 bytes per weight element
in E4M3, plus their scales) can be kept while the weight, its scale and the recipe are unchanged,
so that the next forward skips the cast. That pays where forwards repeat on the same weights:
evaluation batches, and the micro-batches of gradient accumulation (Transformer Engine keeps them
when told ``is_first_microbatch``). In a training step without accumulation it only costs
memory: the rowwise copy would stay through the backward, which never reads it, and every
columnwise copy until the optimizer step, after the layer's dgrad has read it.

``cache_fp8_weights`` (on ``FP8Linear`` and the FP8 MoE experts):

- ``"auto"`` (default): evaluation forwards (grad off) keep their casts; training forwards keep
  them once the layer has seen two forwards in one training step (gradient accumulation: the
  loops share one step id across a step's micro-batches); until then each training forward casts
  afresh and frees the rowwise copy after fprop, the columnwise one after dgrad. The first
  accumulated step thus casts each weight once more.
- ``True``: every forward keeps its casts (micro-batches from the first step on).
- ``False``: none does.

A training forward that does not keep its casts drops what an earlier forward kept.

A kept cast is keyed on the weight's identity, storage and version counter, and on the number of
optimizer steps taken in the process (:func:`optimizer_steps`): fused optimizers (torch's
``AdamW(fused=True)``, the transformers Trainer's default) write the weights without bumping
their version counters, and the loops' clearing before each optimizer step does not reach a
hand-written loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from torch import nn

    from ..numerics.quantizers import QuantizedTensor

__all__ = ["CACHE_CHOICES", "WeightCache", "keeps_weight_casts", "optimizer_steps", "weight_cast_key",
           "weight_cache_holders", "clear_weight_caches"]

CACHE_CHOICES = ("auto", True, False)
_steps_taken = [0]


def _count_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    _steps_taken[0] += 1


# Every torch optimizer's step (DeepSpeed's and FP8AdamW included: they are torch optimizers).
register_optimizer_step_post_hook(_count_step)


def optimizer_steps() -> int:
    """Optimizer steps taken in this process by any ``torch.optim.Optimizer`` (counted by a
    global post-step hook): part of each weight cast's cache key (module docstring)."""
    return _steps_taken[0]


def keeps_weight_casts(module: Any, step: Optional[int]) -> bool:
    """Whether this forward of ``module`` keeps its weight casts (module docstring).

    Args:
        module: an FP8 layer with a ``cache_fp8_weights`` attribute.
        step: the training step of a recording (training) forward; None for any other forward.
    """
    setting = module.cache_fp8_weights
    if setting != "auto":
        return bool(setting)
    if step is None:
        # Evaluation keeps them; a forward with grad that records nothing (a replay, a
        # checkpoint's recomputation) casts afresh, as the training forward it repeats did.
        return not torch.is_grad_enabled() or module.__dict__.get("_micro_batches", False)
    state = module.__dict__
    if state.get("_last_step") == step:
        state["_micro_batches"] = True  # a second forward in one step: gradient accumulation
    state["_last_step"] = step
    return state.get("_micro_batches", False)


def weight_cast_key(weight: torch.Tensor, recipe: Any, states: Any, step: Optional[int]) -> tuple:
    """Everything a weight cast depends on, for :meth:`WeightCache.matches`: the weight (object,
    storage, in-place version), the optimizer steps taken (fused optimizers do not count in the
    version), the recipe, under delayed scaling each of ``states``' scale (object and version:
    every scale update writes it in place; current and block scales come from the weight itself),
    inference mode (its tensors cannot be saved for backward), and last ``step``, the training
    step of a recording cast (None for one that records nothing)."""
    scales = tuple(t for st in states for t in (st.scale, st.scale._version, st.initialized, st.initialized._version)
                   ) if recipe.delayed() else ()
    return (weight, weight._version, weight.data_ptr(), weight.device, optimizer_steps(), recipe, *scales,
            torch.is_inference_mode_enabled(), step)


def weight_cache_holders(model: "nn.Module") -> list["nn.Module"]:
    """The modules of ``model`` (itself included) that keep FP8 weight casts: those with a
    ``clear_weight_cache`` method (``FP8Linear``, the FP8 MoE experts)."""
    return [m for m in model.modules() if callable(getattr(m, "clear_weight_cache", None))]


def clear_weight_caches(model: "nn.Module") -> None:
    """Drop every FP8 weight cast the layers of ``model`` keep: before an optimizer step changes
    the weights, after new weights or scales are loaded."""
    for module in weight_cache_holders(model):
        module.clear_weight_cache()


class WeightCache:
    """A layer's cached weight casts (rowwise ``[out, in]``, columnwise ``[in, out]`` or None; for
    an FP8 experts projection, rowwise is its stack's ``(data, scale_inv)`` cast) and the key they
    were cast from (:func:`weight_cast_key`); ``recorded``: the cast recorded its amax."""
    __slots__ = ("key", "recorded", "rowwise", "columnwise")

    def __init__(self, key: tuple, recorded: bool, rowwise: "QuantizedTensor",
                 columnwise: Optional["QuantizedTensor"]) -> None:
        self.key, self.recorded, self.rowwise, self.columnwise = key, recorded, rowwise, columnwise

    def matches(self, key: tuple, record: bool) -> bool:
        """Whether the entry serves a cast with ``key`` (``record``: a cast that records)."""
        # A recording cast needs an entry that recorded in the same step; any entry serves a
        # cast that records nothing. Tensors in the key compare by identity, not value.
        if record and not self.recorded:
            return False
        if len(key) != len(self.key):
            return False
        for a, b in zip(self.key[:-1], key[:-1]):
            if a is not b and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b):
                return False
        return not record or self.key[-1] == key[-1]
