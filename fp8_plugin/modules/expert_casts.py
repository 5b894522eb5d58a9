"""The experts' FP8 casts: token rows and weight stacks, one scale per expert per role.

The fused per-expert kernels (:mod:`fp8_plugin.numerics.kernels.grouped`) where they run (a
CUDA GPU, outside compiled code), else the torch ops: each expert's amax (``group_amax``), its
scale from its :class:`~fp8_plugin.numerics.quantizers.ScalingState` (delayed: the history's
once initialized, else its own; current: its own, TE's ``fp8_max / amax / 2**margin``), the
saturating cast. Both record each expert's amax into its state alike, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics.device_kind import fp8_family
from ..numerics.formats import fp8_dtype, fp8_max
from ..numerics.grouped_gemm import group_amax, quantize_groups
from ..numerics.kernels import fusable, ops
from ..numerics.quantizers import WEIGHT, ScalingState
from ..numerics.recipes import Recipe
from ..numerics.scaling import divide, quantize, scale_from_amax

__all__ = ["cast_rows", "cast_expert_weights"]


def _scales(recipe: Recipe, role: int, states: list[ScalingState], amax: torch.Tensor, dtype: torch.dtype,
            record: bool, own_scale: bool = False) -> torch.Tensor:
    # One scale per expert: delayed (its history, or its own amax before it has one) or current;
    # ``own_scale``: current whatever the recipe.
    with torch.no_grad():
        one = torch.ones((), dtype=torch.float32, device=amax.device)
        current = scale_from_amax(amax, fp8_max(dtype), recipe.margin, one)
        if recipe.delayed() and not own_scale:
            initialized = torch.stack([s.initialized[role] for s in states])
            scale = torch.where(initialized, torch.stack([s.scale[role] for s in states]), current)
            if record:
                for g, s in enumerate(states):
                    s.record_amax(role, amax[g])
        else:
            scale = current
            if record:
                for g, s in enumerate(states):
                    s.observe_current(role, amax[g], scale[g], versioned=not own_scale)
    return scale


def _fused(x: torch.Tensor, dtype: torch.dtype) -> bool:
    # The fused per-expert casts (numerics/kernels/grouped.py) where the kernels run, outside
    # compiled code (they write the experts' states through an address table no graph sees).
    return fusable(x, dtype) and not torch.compiler.is_compiling()


def cast_rows(x: torch.Tensor, group_of_row: torch.Tensor, states: list[ScalingState], role: int, recipe: Recipe,
              dtype: torch.dtype, record: bool, tables: Optional[dict], *, own_scale: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast of token rows ``x`` ``[S, K]`` sorted by expert (``group_of_row`` int64 ``[S]``),
    one scale per expert of ``states`` for ``role``; ``record`` their amaxes; ``tables`` the
    fused kernels' address cache (``fp8_grouped_linear``'s); ``own_scale``: each expert's rows
    scaled by their own amax and recorded as current scaling does (``observe_current``), even
    under delayed scaling. Returns ``(FP8 rows [S, K], scale_inv float32 [E])``."""
    if _fused(x, dtype):
        return ops.cast_groups(x, group_of_row, states, role, recipe, dtype, record=record, tables=tables,
                               own_scale=own_scale)
    scale = _scales(recipe, role, states, group_amax(x, group_of_row, len(states)), dtype, record, own_scale)
    return quantize_groups(x, scale, group_of_row, dtype), divide(1.0, scale)


def cast_expert_weights(weight: torch.Tensor, states: list[ScalingState], recipe: Recipe, record: bool,
                        transposed: bool = False, tables: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 cast of a stack of expert weights, one scale per expert.

    Args:
        weight: ``[E, N, K]`` (``[E, K, N]`` with ``transposed``), any floating dtype.
        states, recipe: as in :func:`fp8_grouped_linear`.
        record: record each expert's weight amax (a training cast).
        tables: as in :func:`fp8_grouped_linear`.

    Returns:
        ``(data, scale_inv)``: ``[E, N, K]`` FP8 in the recipe's forward format (contiguous) and
        float32 ``[E]``.
    """
    dtype = fp8_dtype(recipe.fp8_format, backward=False, family=fp8_family(weight.device))
    with torch.no_grad():
        w = weight.detach().transpose(1, 2) if transposed else weight.detach()
        if _fused(w, dtype):
            return ops.cast_groups(w, None, states, WEIGHT, recipe, dtype, record=record, tables=tables)
        experts = w.shape[0]
        amax = w.abs().amax(dim=(1, 2)).to(torch.float32) if w.numel() else w.new_zeros(experts, dtype=torch.float32)
        sw = _scales(recipe, WEIGHT, states, amax, dtype, record)
        return quantize(w, sw.view(-1, 1, 1), dtype).contiguous(), divide(1.0, sw)
