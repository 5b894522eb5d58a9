"""Frozen weights kept only in FP8, model-wide: at conversion, and back to master weights.

:mod:`fp8_plugin.modules.frozen_weight` holds one layer's frozen weight; this module walks a
model: ``convert_model(frozen_weights="fp8")`` freezes the layers it swaps whose weights do not
train, and :func:`dequantize_frozen_weights` turns them all back into trainable weights.
"""

from __future__ import annotations

import types
import weakref
from collections import Counter
from typing import Any, Optional

import torch
from torch import nn

from ..numerics.recipes import Recipe
from .frozen_weight import layout_problem

__all__ = [
    "check_frozen_layout", "keep_frozen_in_fp8", "save_dequantized", "dequantize_frozen_weights", "release_replaced_weights",
    "frozen_weights_state", "dequantize_in_state_dict",
]


def _weight_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def keep_frozen_in_fp8(model: nn.Module, decisions: list, new_layers: set[int]) -> dict[int, weakref.ref]:
    """``convert_model(frozen_weights="fp8")``: the FP8 layers ``new_layers`` (ids) whose weights do not
    require grad keep them only in FP8; their ``decisions`` (``LayerDecision``) record it.

    Returns:
        The high-precision weights replaced, as ``{id: weakref}``: an optimizer built before the
        conversion still holds them (:func:`release_replaced_weights`).
    """
    replaced: dict[int, weakref.ref] = {}
    # Every layer swapped now whose weight does not train keeps it only in FP8 (frozen_weights=
    # "fp8"); layers converted earlier keep what their conversion chose. A weight shared with
    # another module (tied) stays: the other module reads it in high precision.
    by_name = {d.name: d for d in decisions}
    shared = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    for name, module in model.named_modules():
        if id(module) not in new_layers or getattr(module, "frozen_layout", True) is not None:
            continue
        weight = module.weight
        if weight.requires_grad or module.weight_transposed or shared[id(weight)] > 1 or weight.device.type == "meta":
            continue
        before = _weight_bytes(weight)
        replaced[id(weight)] = weakref.ref(weight)
        module.freeze_weight()
        decision = by_name.get(name)
        if decision is not None:
            decision.frozen = module.frozen_layout.describe()
            decision.weight_bytes_before = before
            decision.weight_bytes_after = _weight_bytes(module.weight, module.weight_scale_inv)
    return replaced


def dequantize_frozen_weights(model: nn.Module, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Turn every weight kept only in FP8 back into a trainable high-precision (master) weight.

    For full fine-tuning of a model whose weights were frozen in FP8 (a published FP8
    checkpoint, a LoRA base), and before merging LoRA adapters into the base weights (PEFT's
    ``merge_and_unload`` adds to the weight in place). Each frozen layer's weight becomes
    ``data * scale_inv`` in ``dtype`` (default: the dtype the weight had, its ``master_dtype``)
    with ``requires_grad=True``: new Parameters, so build the optimizer afterwards. The model's
    bytes grow accordingly; nothing else changes.

    Returns:
        The names of the layers dequantized.
    """
    names = []
    for name, module in model.named_modules():
        if getattr(module, "frozen_layout", None) is not None:
            module.dequantize_weight(dtype)
            names.append(name)
    return names


def release_replaced_weights(optimizer: Any, replaced: dict[int, weakref.ref]) -> int:
    """Remove from ``optimizer`` the high-precision weights that conversion replaced by FP8-only
    frozen weights (``ConversionReport.replaced_weights``), so that it does not keep them alive.

    An optimizer built from ``model.parameters()`` before the model was converted (Accelerate's
    ``prepare(model, optimizer)``, Fabric's ``setup(model, optimizer)``) holds them; they never get
    a gradient, so no step reads them. Their optimizer state, if any, goes too.

    Returns:
        How many parameters were removed.
    """
    removed = 0
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            ref = replaced.get(id(p))
            if ref is not None and ref() is p:
                optimizer.state.pop(p, None)
                removed += 1
            else:
                kept.append(p)
        group["params"] = kept
    return removed


# The recipes (and precision strings) whose GEMMs read each frozen layout as stored.
_RECIPES_FOR_LAYOUT = {
    "tensorwise": 'DelayedScaling() or Float8CurrentScaling() (precision "fp8-hybrid", "fp8-delayed", "fp8-current")',
    "blockwise": 'Float8BlockScaling() (precision "fp8-blockwise")',
    "mxfp8": 'MXFP8BlockScaling() (precision "fp8-mxfp8")',
}


def check_frozen_layout(name: str, module: nn.Module, recipe: Recipe, target: torch.device) -> None:
    """Raise ValueError when ``module``'s frozen FP8 weight now requires grad, or ``recipe``
    cannot read it as stored (both at start-up, before anything is swapped)."""
    # A frozen weight kept only in FP8 is read as stored; a recipe that casts weights otherwise
    # would re-cast it from a dequantized copy at every forward. Refused at start-up instead.
    layout = getattr(module, "frozen_layout", None)
    if layout is None:
        return
    if module.weight.requires_grad:
        raise ValueError(
            f"convert_model: layer {name!r} holds a frozen weight kept only in FP8, and it now requires grad; an "
            "FP8 weight cannot train. Valid: fp8_plugin.dequantize_frozen_weights(model) (one dequantization into "
            "high-precision master weights) before the optimizer is built, or requires_grad_(False)")
    problem = layout_problem(layout, recipe, target)
    if problem:
        raise ValueError(f"convert_model: layer {name!r} holds a frozen weight kept only in FP8 and {problem}; "
                         f"valid recipes for it: {_RECIPES_FOR_LAYOUT[layout.kind]}")


def save_dequantized(model: nn.Module) -> None:
    """Make ``save_pretrained`` of every transformers model in ``model``'s tree write the weights
    kept only in FP8 dequantized (a vanilla checkpoint, in each weight's master dtype, without
    ``weight_scale_inv``), as it writes every other FP8 layer: without this it would write FP8
    codes that a vanilla ``from_pretrained`` reads as numbers, without their scales.

    Done by passing ``state_dict=`` (save_pretrained's own argument) when the caller passes none;
    the model's bytes are not touched. ``fp8_plugin.export(model, path, "hf-fp8")`` writes them as
    they are instead.
    """
    for module in model.modules():
        save = getattr(module, "save_pretrained", None)
        if save is None or not hasattr(module, "_keys_to_ignore_on_save") or getattr(save, "_fp8_dequantizes", False):
            continue
        module.save_pretrained = types.MethodType(_save_pretrained_dequantized, module)


def _save_pretrained_dequantized(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    frozen = any(getattr(m, "frozen_layout", None) is not None for m in self.modules())
    if frozen and kwargs.get("state_dict") is None:
        state = self.state_dict()
        dequantize_in_state_dict(self, state)
        kwargs["state_dict"] = state
    return type(self).save_pretrained(self, *args, **kwargs)


_save_pretrained_dequantized._fp8_dequantizes = True  # type: ignore[attr-defined]


def frozen_weights_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 data and scales of every weight kept only in FP8, under ``model.state_dict()``
    keys (``<layer>.weight``, ``<layer>.weight_scale_inv``): what an exact resume restores after
    a checkpoint stored the weights dequantized (:func:`dequantize_in_state_dict`)."""
    state = {}
    for name, module in model.named_modules():
        if getattr(module, "frozen_layout", None) is not None:
            prefix = f"{name}." if name else ""
            state[f"{prefix}weight"] = module.weight.detach()
            state[f"{prefix}weight_scale_inv"] = module.weight_scale_inv
    return state


def dequantize_in_state_dict(model: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> None:
    """In ``model``'s ``state_dict`` (keys under ``prefix``): each weight kept only in FP8 as its
    dequantized weight in its master dtype, without ``weight_scale_inv``: a vanilla state dict,
    which the unconverted model loads. Dequantized one layer at a time, so the high-precision
    copies stand only in the returned dict."""
    for name, module in model.named_modules():
        if getattr(module, "frozen_layout", None) is None:
            continue
        key = f"{prefix}{name}.weight" if name else f"{prefix}weight"
        if key in state_dict:
            state_dict[key] = module.dense_weight().detach()
            state_dict.pop(f"{key}_scale_inv", None)

