"""How a replay takes the gradients it compares, per set-up (:func:`gradient_layout`), and the four
sums a figure is formed from (:func:`grad_stats`).

- ``"whole"`` (one process, DDP, DeepSpeed ZeRO-1 and 2): ``torch.autograd.grad`` on the
  parameters, each rank its own micro-batch's gradients, none of DDP's or ZeRO's gradient hooks
  run (they sit on ``.grad`` accumulation). The ranks' sums are added: the figures describe the
  ranks' micro-batch gradients together.
- ``"fsdp2"`` (``fully_shard``, the parameters DTensors): FSDP's own backward into the sharded
  ``.grad`` (its all-gathers, its reduce-scatter averaging over the ranks), taken and cleared;
  training's ``.grad`` waits aside (:func:`compare <fp8_plugin.training.reference.replay.compare>`).
- ``"zero3"`` (DeepSpeed ZeRO-3, partitioned parameters): ``torch.autograd.grad`` as for whole
  parameters, but a hook on each parameter reduce-scatters its gradient over the ranks as it is
  formed (averaging, as FSDP does) and keeps this rank's ``1 / world`` of it; autograd hands
  back a zero-strided view, so no rank holds a whole gradient beyond one parameter's at a time.

Under ``"fsdp2"`` and ``"zero3"`` each rank's sums are over its part of the averaged gradient:
the ranks' sums are the whole averaged gradient's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

WHOLE, FSDP2, ZERO3 = "whole", "fsdp2", "zero3"


def trainable_parameters(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and the tensors of ``model``'s trainable parameters, in ``named_parameters``
    order: the gradients a check compares."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in trainable], [p for _, p in trainable]


def gradient_layout(names: Sequence[str], params: Sequence[torch.Tensor], fp8_weights: dict[str, torch.Tensor]) -> str:
    """``"whole"``, ``"fsdp2"`` or ``"zero3"`` for the trainable ``params`` (named ``names``);
    ``fp8_weights``: the FP8 layers' weights by layer name.

    Raises:
        ValueError: some parameters are FSDP2-sharded and others not (a model partly under
            ``fully_shard``), or an FP8 layer's weight is all-gathered in FP8
            (:func:`~fp8_plugin.enable_fp8_all_gather`): the reference would compute with it.
    """
    is_dtensor = [type(p).__name__ == "DTensor" for p in params]
    if any(is_dtensor):
        if not all(is_dtensor):
            plain = next(n for n, d in zip(names, is_dtensor) if not d)
            raise ValueError(
                f"Reference checks need every trainable parameter sharded by FSDP2 or none; {plain!r} is not "
                "sharded while others are: apply fully_shard to the root module too (valid set-ups: one process, "
                "DDP, FSDP2, DeepSpeed ZeRO 0-3)")
        for name, weight in fp8_weights.items():
            local = weight.to_local() if type(weight).__name__ == "DTensor" else weight
            if type(local).__name__ == "FP8AllGatherWeight":
                raise ValueError(
                    f"Reference checks do not support FP8 all-gather of FSDP2 weights (layer {name!r}): the "
                    "reference replay would compute with the FP8-gathered weight; train without "
                    "enable_fp8_all_gather, or set reference_every to 0")
        return FSDP2
    if any(hasattr(p, "ds_tensor") for p in params):  # DeepSpeed ZeRO-3's partitioned parameters
        return ZERO3
    return WHOLE


def take_gradients(loss: torch.Tensor, params: Sequence[torch.Tensor], layout: str,
                   group: Optional["dist.ProcessGroup"] = None) -> list[Optional[torch.Tensor]]:
    """The gradients of ``loss`` with respect to ``params``, as ``layout`` takes them (module
    docstring); ``group``: the ranks ``"zero3"`` averages over (None: the world)."""
    if layout == FSDP2:
        for param in params:
            param.grad = None
        torch.autograd.backward(loss)
        grads = [param.grad for param in params]
        for param in params:
            param.grad = None
        return grads
    if layout == ZERO3:
        return _reduce_scattered_gradients(loss, params, group)
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def _reduce_scattered_gradients(loss: torch.Tensor, params: Sequence[torch.Tensor],
                                group: Optional["dist.ProcessGroup"]) -> list[Optional[torch.Tensor]]:
    # Every rank runs the same graph, so the hooks' collectives come in the same order on all.
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    parts: list[Optional[torch.Tensor]] = [None] * len(params)

    def hook_for(index: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            flat = grad.detach().reshape(-1)
            size = -(-flat.numel() // world)  # this rank's part; the last ones padded with zeros
            if world > 1:
                padded = flat.new_zeros(size * world)
                padded[:flat.numel()] = flat
                part = flat.new_empty(size)
                dist.reduce_scatter_tensor(part, padded, group=group)
                parts[index] = part.div_(world)
            else:
                parts[index] = flat.clone()
            return grad.new_zeros(()).expand_as(grad)  # what autograd hands back: no whole copy
        return hook

    handles = [param.register_hook(hook_for(i)) for i, param in enumerate(params)]
    try:
        torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return parts


def grad_stats(g8: Optional[torch.Tensor], gr: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``<g8, gr>``, ``|g8|^2``, ``|gr|^2``, ``|g8 - gr|^2`` in float64 ``[4]`` over this rank's
    gradients or part of them (an FSDP2 DTensor's local shard); a missing gradient is zero."""
    if g8 is None and gr is None:
        return torch.zeros(4, dtype=torch.float64, device=device)
    g8, gr = _local(g8), _local(gr)
    a = g8.detach().reshape(-1).to(torch.float64) if g8 is not None else None
    b = gr.detach().reshape(-1).to(torch.float64) if gr is not None else None
    a = a if a is not None else torch.zeros_like(b)
    b = b if b is not None else torch.zeros_like(a)
    d = a - b
    # Dot products: the sums without a full-size temporary each (half the time of the
    # elementwise products on a CPU, for a 12M-parameter embedding).
    return torch.stack([torch.dot(a, b), torch.dot(a, a), torch.dot(b, b), torch.dot(d, d)])


def _local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor


def fp8_weights(layers: Sequence[tuple[str, nn.Module]]) -> dict[str, torch.Tensor]:
    """``{layer name: its weight}`` of FP8 layers that have one (what :func:`gradient_layout` reads)."""
    return {name: layer.weight for name, layer in layers if isinstance(getattr(layer, "weight", None), torch.Tensor)}
