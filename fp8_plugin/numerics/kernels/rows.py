"""One role's rows of a scaling state, as the fused casts take them, and the count of changes to
any state's tensors that the kernels' caches check (no triton import)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["StateRows", "rows_changed", "tensors_epoch"]


class StateRows(NamedTuple):
    """One role's rows of a :class:`~fp8_plugin.numerics.quantizers.ScalingState`'s tensors, as
    views: what a fused cast reads and writes (:mod:`~fp8_plugin.numerics.kernels.tensorwise`).
    Made once per state and role (``ScalingState.kernel_rows``)."""

    scale: torch.Tensor  # float32 0-dim
    initialized: torch.Tensor  # bool 0-dim
    amax_history: torch.Tensor  # float32 [L]
    nonfinite_amax_count: torch.Tensor  # int64 0-dim
    workspace: torch.Tensor  # int32 [2]


# Counts, over every ScalingState of the process, the replacements of state tensors and what the
# host forgets of their initialized flags (rows_changed, tensors_epoch).
_epoch = [0]


def rows_changed() -> None:
    """Called by a :class:`~fp8_plugin.numerics.quantizers.ScalingState` that replaces a state
    tensor or forgets what it knew of its ``initialized`` flags."""
    _epoch[0] += 1


def tensors_epoch() -> int:
    """A count that changes whenever any scaling state of this process has a state tensor replaced
    (its ``generation`` counts up) or forgets what it knew of its ``initialized`` flags
    (``ScalingState.initialized_known`` may then answer False again): what a cache of many
    states' addresses and flags checks, in one comparison, against all of them."""
    return _epoch[0]
