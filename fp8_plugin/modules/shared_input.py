"""One FP8 cast for an input that several FP8 layers read in a row.

A Hugging Face attention block calls ``q_proj``, ``k_proj`` and ``v_proj`` on one tensor, and an
MLP ``gate_proj`` and ``up_proj`` on one tensor (BERT: ``query``, ``key``, ``value``). Cast
separately, that tensor would be read three times, and its FP8 copy made, saved for wgrad and
launched three times; Transformer Engine avoids this only for a fused QKV layer. Here the first
layer's cast (the *leader*'s) is kept on this thread, and a layer that then receives the same
tensor, unchanged (the same object and ``_version``), under an equal recipe and the same recording
setting, takes it instead of casting: one cast, one saved FP8 copy, one amax.

The follower's cast is then the leader's, with the leader's input scale: under current and
block scaling the very bytes its own cast would give; under delayed scaling what its own history
would give, since both layers record the same tensors. So that this stays so, the follower stops
recording its input amaxes and reads the leader's input row
(:meth:`~fp8_plugin.numerics.quantizers.ScalingState.share_input_of`): its statistics, its
``state_dict`` and every cast it makes alone (an activation-checkpoint recomputation, compiled
code) use that row. A follower that later receives a tensor of its own takes the row back
(:meth:`~fp8_plugin.numerics.quantizers.ScalingState.stop_sharing_input`) and records again.

One cast is kept at a time, replaced by the next FP8 layer's: the memory held past its last use
is at most one FP8 copy between two FP8 layers. The input itself is held by a weak reference.
The kept cast is dropped when an :func:`fp8_plugin.autocast` or a reference replay exits, so no
cast outlives the forward that made it. Not under ``torch.compile`` (a kept Python object would be
guarded on) or inside a CUDA graph capture (the capture must contain each cast it replays).
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple, Optional

import torch

from ..numerics.quantizers import QuantizedTensor, ScalingState
from ..numerics.recipes import Recipe

__all__ = ["SharedCast", "find_shared_cast", "keep_cast", "drop_kept_cast"]


class SharedCast(NamedTuple):
    """A kept input cast: the tensor it was cast from (a weak reference) and its version, the
    recipe object and recording flag of the cast, its rowwise and (None when not made)
    columnwise FP8 copies, and the scaling state whose input row it used and recorded into."""

    source: "weakref.ref[torch.Tensor]"
    version: int
    recipe: Recipe
    record: bool
    rowwise: QuantizedTensor
    columnwise: Optional[QuantizedTensor]
    state: ScalingState


class _Kept(threading.local):
    def __init__(self) -> None:
        self.cast: Optional[SharedCast] = None


_kept = _Kept()


def find_shared_cast(x: torch.Tensor, recipe: Recipe, record: bool, columnwise: bool) -> Optional[SharedCast]:
    """The kept cast of ``x`` (same object, unchanged since) under ``recipe`` (or an equal one)
    and ``record``, with a columnwise copy where ``columnwise`` asks for one; else None."""
    kept = _kept.cast
    if (kept is None or kept.source() is not x or x.is_inference() or kept.version != x._version
            or kept.record != record or (columnwise and kept.columnwise is None)
            or not _same_recipe(kept.recipe, recipe)):
        return None
    return kept


def _same_recipe(a: Recipe, b: Recipe) -> bool:
    # Each converted layer holds its own recipe object: equal ones cast alike. A dataclass
    # comparison costs microseconds, so the answer is kept per pair (recipes are frozen).
    if a is b:
        return True
    key = (id(a), id(b))
    kept = _equal_recipes.get(key)
    if kept is None or kept[0] is not a or kept[1] is not b:
        if len(_equal_recipes) >= 256:  # recipes made anew for each step: keep the newest few
            _equal_recipes.clear()
        kept = _equal_recipes[key] = (a, b, a == b)
    return kept[2]


_equal_recipes: dict[tuple[int, int], tuple[Recipe, Recipe, bool]] = {}


def keep_cast(x: torch.Tensor, recipe: Recipe, record: bool, rowwise: QuantizedTensor,
              columnwise: Optional[QuantizedTensor], state: ScalingState) -> None:
    """Keep the input cast an FP8 layer just made of ``x``, in place of the one kept before; an
    inference tensor (``torch.inference_mode``) has no version counter to tell a change by, so
    its cast is not kept."""
    if x.is_inference():
        _kept.cast = None
        return
    _kept.cast = SharedCast(weakref.ref(x), x._version, recipe, record, rowwise, columnwise, state)


def drop_kept_cast() -> None:
    """Drop the kept cast (the end of a forward: an autocast's or a replay's exit)."""
    _kept.cast = None
