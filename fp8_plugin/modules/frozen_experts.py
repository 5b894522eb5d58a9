"""Frozen MoE expert weights kept only in FP8: each projection's E4M3 stack and its scales.

The experts counterpart of :mod:`fp8_plugin.modules.frozen_weight`. An FP8 experts module
(:mod:`fp8_plugin.modules.experts`) whose projection weights do not require grad (a LoRA base,
a frozen MoE) keeps each of them as the cast its grouped GEMMs read: ``<proj>`` an E4M3
``nn.Parameter`` ``[E, N, K]`` (``requires_grad=False``) and the buffer ``<proj>_scale_inv``, float32
``[E]`` (one scale per expert, the weight's current scale ``(448 / amax) / 2**margin``, as the
experts' per-tensor recipes cast weights), about 1 byte per value. fprop and dgrad read them
as they are (dgrad's transposed copy is made in the backward, as for trained experts; no
wgrad). Where the experts run in high precision (outside the autocast, ``use_fp8 = False``, a
reference replay) the module's own forward reads the dequantized weights, made for that call.

Only experts stored ``[E, N, K]`` (``is_transposed`` False) are kept in FP8; transposed ones
keep their weights in high precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..numerics.formats import is_fp8
from ..numerics.quantizers import ScalingState
from ..numerics.recipes import Recipe
from ..numerics.scaling import dequantize
from .expert_casts import cast_expert_weights

__all__ = ["FrozenExpertsMixin", "FrozenExperts"]


@dataclasses.dataclass(frozen=True)
class FrozenExperts:
    """How one frozen expert projection is stored: ``dtype`` (E4M3), one scale per expert, and
    ``master_dtype``, the dtype it had (its dequantization's)."""

    dtype: torch.dtype
    master_dtype: torch.dtype

    def describe(self) -> str:
        return "E4M3, one scale per expert" if self.dtype == torch.float8_e4m3fn else f"{self.dtype}, one scale per expert"


class FrozenExpertsMixin:
    """What an FP8 experts module does with projection weights kept only in FP8.

    Expects ``fp8_scaling`` (its projections' names), ``recipe`` and ``is_transposed``.
    """

    _frozen_experts: Optional[dict[str, FrozenExperts]] = None

    def frozen_projections(self) -> dict[str, FrozenExperts]:
        """``{projection: layout}`` of the projections kept only in FP8 (empty when none)."""
        return self._frozen_experts or {}

    def freeze_weights(self, recipe: Optional[Recipe] = None) -> list[str]:
        """Keep each projection whose weight does not require grad only in FP8 (cast once with
        ``recipe``, default the module's). Returns the projections frozen now.

        Raises:
            ValueError: a block-scaled recipe (experts scale per expert and tensor).
        """
        recipe = recipe or self.recipe
        frozen = []
        for proj in self.fp8_scaling:
            weight = getattr(self, proj)
            if weight.requires_grad or proj in self.frozen_projections() or self.is_transposed:
                continue
            states = [ScalingState(1, device=weight.device) for _ in range(weight.shape[0])]
            data, scale_inv = cast_expert_weights(weight, states, recipe, record=False)
            self._set_frozen(proj, data, scale_inv, FrozenExperts(data.dtype, weight.dtype))
            frozen.append(proj)
        return frozen

    def _set_frozen(self, proj: str, data: torch.Tensor, scale_inv: torch.Tensor, layout: FrozenExperts) -> None:
        self._fp8_weight_cache.pop(proj, None)
        setattr(self, proj, nn.Parameter(data, requires_grad=False))
        self.register_buffer(f"{proj}_scale_inv", scale_inv)
        self._frozen_experts = {**self.frozen_projections(), proj: layout}

    def dequantize_weights(self, dtype: Optional[torch.dtype] = None) -> list[str]:
        """Turn every frozen projection back into a trainable high-precision weight (``data *
        scale_inv`` per expert, in ``dtype`` or its master dtype). Returns their names."""
        names = list(self.frozen_projections())
        for proj in names:
            dense = self.dense_projection(proj, dtype).detach().clone()
            delattr(self, f"{proj}_scale_inv")
            setattr(self, proj, nn.Parameter(dense, requires_grad=True))
        self._frozen_experts = None
        return names

    def dense_projection(self, proj: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A projection's weight in high precision (a new tensor for a frozen one)."""
        layout = self.frozen_projections().get(proj)
        weight = getattr(self, proj)
        if layout is None:
            return weight if dtype is None else weight.to(dtype)
        scale_inv = getattr(self, f"{proj}_scale_inv").view(-1, 1, 1)
        return dequantize(weight, scale_inv, dtype or layout.master_dtype)

    def frozen_cast(self, proj: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(data [E, N, K], scale_inv [E])`` of a frozen projection, for its grouped GEMMs; None
        for a trained one.

        Raises:
            RuntimeError: the frozen weight now requires grad (see :func:`fp8_plugin.dequantize_frozen_weights`).
        """
        if proj not in self.frozen_projections():
            return None
        data = getattr(self, proj)
        if data.requires_grad:
            raise RuntimeError(f"FP8 experts: {proj} is kept only in FP8 (frozen) but now requires grad; an FP8 weight "
                               "cannot train. Call fp8_plugin.dequantize_frozen_weights(model) before building the "
                               "optimizer")
        return data, getattr(self, f"{proj}_scale_inv")

    @contextlib.contextmanager
    def dequantized(self) -> Iterator[None]:
        """The frozen projections dequantized for the duration (the module's own high-precision
        forward reads them), then their FP8 data again."""
        frozen = self.frozen_projections()
        if not frozen:
            yield
            return
        held = {proj: self._parameters[proj] for proj in frozen}
        try:
            for proj in frozen:
                self._parameters[proj] = nn.Parameter(self.dense_projection(proj), requires_grad=False)
            yield
        finally:
            self._parameters.update(held)

    def _apply(self, fn, recurse=True):
        # As FrozenWeightMixin._apply: model.to(dtype) moves the FP8 stacks, never converts them.
        frozen = self.frozen_projections()
        if not frozen:
            return super()._apply(fn, recurse)
        held = {p: (self._parameters.pop(p), self._buffers.pop(f"{p}_scale_inv")) for p in frozen}
        try:
            super()._apply(fn, recurse)
        finally:
            for proj, (data, scale_inv) in held.items():
                probe = fn(torch.empty(0, dtype=frozen[proj].master_dtype, device=data.device))
                self._parameters[proj] = nn.Parameter(data.data.to(probe.device), requires_grad=False)
                self._buffers[f"{proj}_scale_inv"] = scale_inv.to(probe.device)
                if probe.dtype.is_floating_point:
                    frozen[proj] = dataclasses.replace(frozen[proj], master_dtype=probe.dtype)
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # As FrozenWeightMixin: a high-precision stack into a frozen projection is cast again;
        # a frozen stack (FP8 data and its scales) into a trained one is dequantized.
        for proj in getattr(self, "fp8_scaling", {}):
            key, scale_key = f"{prefix}{proj}", f"{prefix}{proj}_scale_inv"
            incoming = state_dict.get(key)
            if not isinstance(incoming, torch.Tensor) or incoming.dim() != 3:
                continue
            fp8 = is_fp8(incoming.dtype)
            if proj in self.frozen_projections() and not fp8:
                states = [ScalingState(1, device=incoming.device) for _ in range(incoming.shape[0])]
                state_dict[key], state_dict[scale_key] = cast_expert_weights(incoming, states, self.recipe, record=False)
            elif proj not in self.frozen_projections() and fp8 and scale_key in state_dict:
                scale_inv = state_dict.pop(scale_key).view(-1, 1, 1)
                state_dict[key] = dequantize(incoming, scale_inv.float(), getattr(self, proj).dtype)
        super()._load_from_state_dict(state_dict, prefix, *args)
