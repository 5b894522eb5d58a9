"""Amax reduction across ranks: every rank must scale with the same delayed-scaling amaxes.

Transformer Engine reduces all amaxes of a step with one all-reduce over a global buffer, in a
configurable group (``amax_reduction_group``). Here the step's amaxes are already gathered into
one flat float32 tensor by :func:`fp8_plugin.numerics.quantizers.update_delayed_scaling`; the reducer
built below all-reduces that tensor with MAX, once per step. On GPUs the collective is enqueued
on the stream like any other kernel: no host synchronisation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..modules.autocast import AmaxReducer

__all__ = ["amax_reducer"]


def amax_reducer(group: Optional["dist.ProcessGroup"] = None) -> Optional[AmaxReducer]:
    """An in-place MAX all-reduce over ``group`` for :func:`fp8_plugin.autocast`'s ``reduce_amax``.

    Args:
        group: process group of the ranks that must share scales; None means the default
            (world) group: every data-parallel (and, with FSDP, sharding) rank.

    Returns:
        A callable ``(amaxes: float32 [n]) -> None``, or None when ``torch.distributed`` is not
        initialized or the group has one rank (nothing to reduce).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None

    def reduce(amaxes: torch.Tensor) -> None:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)

    return reduce
