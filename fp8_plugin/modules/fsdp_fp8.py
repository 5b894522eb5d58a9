"""FP8 all-gather of FSDP2-sharded weights: each rank casts its shard, FSDP gathers FP8 bytes.

Without this, FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers each FP8 layer's weight
in its own dtype (4 bytes per value for FP32 master weights, 2 under a bf16
``MixedPrecisionPolicy``) and the layer then casts the gathered weight. With it the gather moves
1 byte per value and the layer skips its weight cast: each rank casts its own shard with a
scale every rank shares, and FSDP gathers the FP8 data.

The mechanism is FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the sharded parameter's local tensor), as torchao's
``enable_fsdp_float8_all_gather`` uses it:

- :class:`FP8AllGatherWeight` wraps the high-precision local shard; every op on it (optimizer
  updates, state dicts) runs on the wrapped tensor. Before a gather it casts the shard to the
  recipe's forward format (E4M3 under HYBRID) with the scale ``FP8_MAX / amax / 2**margin`` of the
  *whole* weight: the shards' amaxes are all-reduced (MAX) across the shard group first, one
  0-dim all-reduce per layer per gather.
- The gathered weight is an :class:`FP8GatheredWeight`: FP8 data plus its scale_inv, seen by
  FSDP and autograd as the unsharded weight of its high-precision dtype. ``FP8Linear`` uses its
  FP8 data as the GEMM operand directly; its gradient is an ordinary high-precision tensor,
  which FSDP reduce-scatters as usual.

The weight is therefore scaled by its current amax under every per-tensor recipe (as torchao's
FP8 all-gather scales it), where ``DelayedScaling`` without FSDP would scale it from its amax
history; inputs and gradients follow the recipe either way. The gathered weight's amax and
scale are recorded in the layer's scaling state for statistics. Block-scaled recipes (MXFP8,
128-blockwise) are not supported: their scales are per block, and a block may span two shards.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..numerics.decode import decode_fp8
from ..numerics.device_kind import fp8_family
from ..numerics.formats import fp8_dtype, fp8_max
from ..numerics.quantizers import WEIGHT, QuantizedTensor
from ..numerics.recipes import Float8BlockScaling, MXFP8BlockScaling, Recipe
from ..numerics.scaling import amax as tensor_amax
from ..numerics.scaling import divide, quantize, scale_from_amax
from .autocast import current_context
from .linear import FP8Linear

__all__ = ["enable_fp8_all_gather", "FP8AllGatherWeight", "FP8GatheredWeight"]

# Ops FSDP2 and optimizers apply to a sharded weight whose result is still that weight (views,
# copies, moves): the result stays wrapped so that the next gather is FP8 again.
_PRESERVE = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}  # fmt: skip


def _wrapper(cls: type, like: torch.Tensor, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(
        cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=dtype,
        layout=like.layout, device=like.device, requires_grad=requires_grad,
    )  # fmt: skip


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight shard (any shape and floating dtype) whose FSDP2 all-gather is FP8.

    Every op runs on the wrapped tensor; views and copies stay wrapped. Built by
    :func:`enable_fp8_all_gather`, not by hand.
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> "FP8AllGatherWeight":
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner_tensors["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Cast this shard ``[rows, cols]`` to FP8 with the whole weight's scale (FSDP2 hook).

        Returns ``((data,), (scale_inv,))``: ``data`` FP8 ``[ceil(outer_rows / world), cols]``
        (FSDP's padded shard size; padding rows are zeros), ``scale_inv`` float32 0-dim.
        """
        layer = _fp8_layer(module)
        recipe = _recipe(layer)
        dtype = fp8_dtype(recipe.fp8_format, backward=False, family=fp8_family(self._tensor.device))
        shard = self._tensor
        amax = tensor_amax(shard) if shard.numel() else torch.zeros((), dtype=torch.float32, device=shard.device)
        group = mesh.get_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        one = torch.ones((), dtype=torch.float32, device=shard.device)
        scale = scale_from_amax(amax, fp8_max(dtype), recipe.margin, one)
        with torch.no_grad():
            data = quantize(shard, scale, dtype)
        rows = -(-outer_size[0] // mesh.size())  # FSDP pads uneven shards to this many rows
        if data.shape[0] != rows:
            padded = data.new_zeros(rows, *data.shape[1:])
            padded[: data.shape[0]].copy_(data)
            data = padded
        context = current_context()
        if context.enabled and context.training and torch.is_grad_enabled():
            layer.fp8_state.observe_current(WEIGHT, amax, scale)  # statistics of a training gather
        return (data,), (divide(1.0, scale),)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None):
        """Wrap the gathered FP8 data as the unsharded weight (FSDP2 hook)."""
        (data,), (scale_inv,) = outputs, metadata
        if out is not None:  # FSDP reuses the unsharded weight: new data is already in place
            out._scale_inv = scale_inv
            return None
        return FP8GatheredWeight(data, scale_inv, param_dtype), (data,)


class FP8GatheredWeight(torch.Tensor):
    """An all-gathered weight held in FP8: ``data`` (FP8, the weight's shape) and ``scale_inv``
    (float32 0-dim), seen as a tensor of ``dtype``. ``FP8Linear`` reads the FP8 data directly;
    any other op sees the dequantized weight ``data * scale_inv`` in ``dtype``."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> "FP8GatheredWeight":
        return _wrapper(cls, data, dtype, False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale_inv = data, scale_inv

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, data dtype={self._data.dtype}, dtype={self.dtype})"

    def fp8_operand(self, transposed: bool) -> QuantizedTensor:
        """The weight as a GEMM operand ``[out_features, in_features]`` (``transposed``: the
        stored layout is ``[in, out]``, as GPT-2's Conv1D keeps it)."""
        data = self._data.t().contiguous() if transposed else self._data
        return QuantizedTensor(data, self._scale_inv)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, cls) and func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default,
                                               torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                                               torch.ops.aten.t.default):
            # Views keep the FP8 payload: FSDP views the gathered weight at its unpadded size.
            return cls(func(first._data, *args[1:], **kwargs), first._scale_inv, first.dtype)
        dequantized_args, dequantized_kwargs = pytree.tree_map_only(
            cls, lambda t: (decode_fp8(t._data) * t._scale_inv).to(t.dtype), (args, kwargs)
        )
        return func(*dequantized_args, **dequantized_kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return FP8GatheredWeight(inner_tensors["_data"], inner_tensors["_scale_inv"], dtype)


def _fp8_layer(module: nn.Module) -> FP8Linear:
    if not isinstance(module, FP8Linear):
        raise TypeError(f"FP8 all-gather serves FP8Linear weights; the weight belongs to a {type(module).__name__}")
    return module


def _recipe(layer: FP8Linear) -> Recipe:
    context = current_context()
    recipe = layer.layer_recipe((context.recipe if context.enabled else None) or layer.recipe)
    if isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling)):
        raise ValueError(
            f"FP8 all-gather of FSDP2 weights needs a per-tensor recipe, not {type(recipe).__name__} (the layer's "
            f"fp8_scaling is {layer.fp8_scaling!r}); valid: DelayedScaling, Float8CurrentScaling with fp8_scaling "
            "'recipe' (block scales may span two shards)"
        )
    return recipe


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Make FSDP2 all-gather the weights of ``model``'s FP8 layers in FP8. Call it after
    :func:`fp8_plugin.convert_model` and before ``fully_shard`` and before building the
    optimizer (the weights become new Parameters, of the same values).

    Args:
        model: a converted model; each ``FP8Linear`` must be sharded by ``fully_shard`` (on
            itself or on a parent) for its weight's gather to be FP8.

    Returns:
        The number of weights enabled.

    Layers whose ``fp8_scaling`` is ``"blockwise"`` (:func:`fp8_plugin.calibrate`'s choice for
    activation outliers) are left out: their weights are gathered in high precision and cast
    in 128x128 blocks after the gather.

    Raises:
        ValueError: an FP8 layer's recipe is block-scaled (MXFP8, 128-blockwise).
        RuntimeError: a weight is already sharded (``fully_shard`` ran first).
    """
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, FP8Linear) or isinstance(layer.weight.data, FP8AllGatherWeight):
            continue
        if layer.frozen_layout is not None:  # kept only in FP8: FSDP2 gathers its FP8 bytes as they are
            continue
        if layer.fp8_scaling == "blockwise":  # block scales may span two shards: gathered in high precision
            continue
        if isinstance(layer.recipe, (MXFP8BlockScaling, Float8BlockScaling)):
            raise ValueError(
                f"enable_fp8_all_gather: layer {name!r} uses {type(layer.recipe).__name__}; valid recipes: "
                "DelayedScaling, Float8CurrentScaling"
            )
        if type(layer.weight).__name__ == "DTensor":
            raise RuntimeError(f"enable_fp8_all_gather: layer {name!r} is already sharded; call it before fully_shard")
        weight = layer.weight
        layer.weight = nn.Parameter(FP8AllGatherWeight(weight.data), requires_grad=weight.requires_grad)
        count += 1
    return count
