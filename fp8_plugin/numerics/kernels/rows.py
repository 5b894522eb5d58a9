"""One role's rows of a scaling state, as the fused casts take them (no triton import)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["StateRows"]


class StateRows(NamedTuple):
    """One role's rows of a :class:`~fp8_plugin.numerics.quantizers.ScalingState`'s tensors, as
    views: what a fused cast reads and writes (:mod:`~fp8_plugin.numerics.kernels.tensorwise`).
    Made once per state and role (``ScalingState.kernel_rows``)."""

    scale: torch.Tensor  # float32 0-dim
    initialized: torch.Tensor  # bool 0-dim
    amax_history: torch.Tensor  # float32 [L]
    nonfinite_amax_count: torch.Tensor  # int64 0-dim
    workspace: torch.Tensor  # int32 [2]
