"""Frozen weights kept only in FP8, model-wide.

:mod:`fp8_plugin.modules.frozen_weight` (layers) and :mod:`fp8_plugin.modules.frozen_experts`
(MoE experts) hold one module's frozen weights; this module walks a model:

- ``convert_model(frozen_weights="fp8")`` freezes the layers and experts it swaps whose weights
  do not train (:func:`keep_frozen_in_fp8`), refuses a recipe that cannot read a frozen layer's
  layout or a frozen weight that requires grad again (:func:`check_frozen_layout`), and takes over
  transformers' own FP8 layers as they are (:func:`take_over_transformers_fp8`);
- :func:`dequantize_frozen_weights` turns them all back into trainable master weights;
- :func:`release_replaced_weights` lets an optimizer built before the conversion drop the
  high-precision weights it replaced;
- state dicts and ``save_pretrained`` stay vanilla (:func:`dequantize_in_state_dict`,
  :func:`save_dequantized`), the FP8 bytes travelling with the FP8 state
  (:func:`frozen_weights_state`) for an exact resume.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..numerics.recipes import Recipe
from .frozen_weight import FrozenLayout, frozen_layout, layout_problem

__all__ = [
    "check_frozen_layout", "keep_frozen_in_fp8", "save_dequantized", "dequantize_frozen_weights", "release_replaced_weights",
    "frozen_weights_state", "dequantize_in_state_dict", "frozen_figures", "is_transformers_fp8_linear",
    "take_over_transformers_fp8", "master_dtype_of",
]


def _weight_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def frozen_figures(module: nn.Module) -> tuple[str, int, int]:
    """``(layout, bytes in the master dtype, bytes held)`` of a layer's weight kept only in FP8,
    or ``("", 0, 0)``: the report's frozen columns."""
    layout = getattr(module, "frozen_layout", None)
    if layout is None:
        return "", 0, 0
    return _held_figures(layout, module.weight, module.weight_scale_inv)


def _held_figures(layout: Any, data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[str, int, int]:
    # The report's frozen columns of FP8 data and its scales, against the data in its master dtype.
    before = data.numel() * torch.empty((), dtype=layout.master_dtype).element_size()
    return layout.describe(), before, _weight_bytes(data, scale_inv)


def _frozen_parts(module: nn.Module) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    # (attribute, its dequantization) of each weight a module keeps only in FP8: an FP8 layer's
    # "weight", an FP8 experts module's frozen projections.
    if getattr(module, "frozen_layout", None) is not None:
        return [("weight", module.dense_weight)]
    projections = getattr(module, "frozen_projections", None)
    if projections is None:
        return []
    return [(proj, functools.partial(module.dense_projection, proj)) for proj in projections()]


def _expert_figures(module: nn.Module, proj: str) -> tuple[str, int, int]:
    return _held_figures(module.frozen_projections()[proj], getattr(module, proj), getattr(module, f"{proj}_scale_inv"))


def keep_frozen_in_fp8(model: nn.Module, decisions: list, new_layers: set[int],
                       include_meta: bool = False) -> dict[int, weakref.ref]:
    """``convert_model(frozen_weights="fp8")``: the FP8 layers ``new_layers`` (ids) whose weights do not
    require grad keep them only in FP8; their ``decisions`` (``LayerDecision``) record it. Weights on
    the meta device stay (a model built empty gets its values later, and a cast made now would
    fix scales without them) unless ``include_meta``: the memory tool's traced step, which needs
    the layout alone.

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
        if id(module) in new_layers and hasattr(module, "freeze_weights"):  # FP8 experts: each frozen projection
            held = {proj: getattr(module, proj) for proj in module.fp8_scaling}
            held = {p: w for p, w in held.items() if shared[id(w)] == 1 and (include_meta or w.device.type != "meta")}
            for proj in module.freeze_weights() if len(held) == len(module.fp8_scaling) else []:
                replaced[id(held[proj])] = weakref.ref(held[proj])
                decision = by_name.get(f"{name}.{proj}")
                if decision is not None:
                    decision.frozen, decision.weight_bytes_before, decision.weight_bytes_after = \
                        _expert_figures(module, proj)
            continue
        if id(module) not in new_layers or getattr(module, "frozen_layout", True) is not None:
            continue
        weight = module.weight
        if (weight.requires_grad or module.weight_transposed or shared[id(weight)] > 1
                or (weight.device.type == "meta" and not include_meta)):
            continue
        replaced[id(weight)] = weakref.ref(weight)
        module.freeze_weight()
        decision = by_name.get(name)
        if decision is not None:
            decision.frozen, decision.weight_bytes_before, decision.weight_bytes_after = frozen_figures(module)
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
        elif getattr(module, "frozen_projections", None) is not None and module.frozen_projections():
            names += [f"{name}.{proj}" for proj in module.dequantize_weights(dtype)]
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
        module.save_pretrained = _DequantizingSave(module)


def _save_pretrained_dequantized(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    frozen = any(_frozen_parts(m) for m in self.modules())
    if frozen and kwargs.get("state_dict") is None:
        state = self.state_dict()
        dequantize_in_state_dict(self, state)
        kwargs["state_dict"] = state
    return type(self).save_pretrained(self, *args, **kwargs)


class _DequantizingSave:
    # The instance's save_pretrained: a plain object holding its module (not a bound method of a
    # function the module lacks), so that torch.save of the whole model and deepcopy keep it.
    _fp8_dequantizes = True

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _save_pretrained_dequantized(self.module, *args, **kwargs)


def frozen_weights_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 data and scales of every weight kept only in FP8, under ``model.state_dict()``
    keys (``<layer>.weight``, ``<layer>.weight_scale_inv``): what an exact resume restores after
    a checkpoint stored the weights dequantized (:func:`dequantize_in_state_dict`)."""
    state = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, _ in _frozen_parts(module):
            state[f"{prefix}{attr}"] = getattr(module, attr).detach()
            state[f"{prefix}{attr}_scale_inv"] = getattr(module, f"{attr}_scale_inv")
    return state


def dequantize_in_state_dict(model: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> None:
    """In ``model``'s ``state_dict`` (keys under ``prefix``): each weight kept only in FP8 as its
    dequantized weight in its master dtype, without ``weight_scale_inv``: a vanilla state dict,
    which the unconverted model loads. Dequantized one layer at a time, so the high-precision
    copies stand only in the returned dict."""
    for name, module in model.named_modules():
        for attr, dense in _frozen_parts(module):
            key = f"{prefix}{name}.{attr}" if name else f"{prefix}{attr}"
            if key in state_dict:
                state_dict[key] = dense().detach()
                state_dict.pop(f"{key}_scale_inv", None)


def master_dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first high-precision floating parameter (the default dtype if none):
    what a weight taken over in FP8 computes in."""
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.dtype
    return torch.get_default_dtype()


def is_transformers_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' inference FP8 layer (``integrations.finegrained_fp8.FP8Linear``,
    built by ``from_pretrained`` of a fine-grained FP8 checkpoint on a GPU) holding E4M3 weights."""
    cls = type(module)
    return (cls.__name__ == "FP8Linear" and cls.__module__.startswith("transformers.integrations.finegrained_fp8")
            and getattr(module, "weight", None) is not None and module.weight.dtype == torch.float8_e4m3fn)


def take_over_transformers_fp8(name: str, module: nn.Module, recipe: Recipe, master_dtype: torch.dtype) -> nn.Module:
    """An :class:`~fp8_plugin.modules.linear.FP8Linear` holding the E4M3 weight and scales of
    transformers' FP8 layer ``module`` as they are (frozen, kept only in FP8), its bias shared.

    Raises:
        ValueError: static activation scales, or a ``recipe`` that cannot read the layer's
            weight layout (named, with the recipes that can).
    """
    from .linear import FP8Linear

    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"convert_model: {name!r} (transformers FP8Linear) uses activation_scheme="
                         f"{module.activation_scheme!r}; valid for training: 'dynamic' (static activation scales are "
                         "an inference calibration)")
    block = getattr(module, "block_size", None)
    held = FrozenLayout("blockwise" if block else "tensorwise", tuple(block) if block else None, torch.float8_e4m3fn,
                        master_dtype)
    problem = layout_problem(held, recipe, module.weight.device)
    if problem:
        raise ValueError(f"convert_model: layer {name!r} (transformers FP8Linear) holds its weight in FP8 and {problem}; "
                         f"valid recipes for it: {_RECIPES_FOR_LAYOUT[held.kind]}")
    new = FP8Linear.from_module(module, recipe)  # an nn.Linear: its Parameters, state on its device
    scale_inv = module.weight_scale_inv.detach().to(torch.float32)  # E8M0 scales widen exactly
    new.set_frozen_weight(module.weight.detach(), scale_inv.reshape(()) if block is None else scale_inv,
                          frozen_layout(recipe, module.weight.device, master_dtype))
    return new
