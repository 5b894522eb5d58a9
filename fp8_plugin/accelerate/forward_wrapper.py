"""The prepared model's forward in the FP8 context: :func:`wrap_forward`, which the FP8
``Accelerator`` applies to every model it prepares (training forwards, evaluation ones where
``use_autocast_during_eval``), offering training forwards to the reference checks.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

from ..modules.autocast import in_replay
from ..training.core import FP8Training
from ..training.reference import output_loss

__all__ = ["wrap_forward"]


def wrap_forward(module: nn.Module, run: FP8Training, device_type: str, in_eval: bool) -> None:
    """Run ``module``'s forward in the FP8 context (in training; in evaluation too if ``in_eval``).

    With reference checks on, a training forward (``module.training``, grad enabled) is first
    offered to them (``FP8Training.capture_replay``, kept on due steps only, with the RNG state of
    this moment): the replay calls the unwrapped forward with the same arguments (a module FSDP2 or
    ZeRO-3 shards: the module itself, their hooks included, this wrapper passing straight through)
    and reads the loss with ``ReferenceCheck.output_loss`` (default
    :func:`~fp8_plugin.training.reference.output_loss`). Its output goes to them too
    (``FP8Training.training_output``): a check may take the training pass as its FP8 side.

    The wrapper is a method with ``__wrapped__``, as Accelerate's own autocast wrapper is, so
    ``unwrap_model(model, keep_fp32_wrapper=False)`` removes it with Accelerate's.
    """
    original = module.forward
    function = original.__func__ if isinstance(original, MethodType) else None

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs) if function is not None else original(*args, **kwargs)

    def replayed(self: nn.Module, args: tuple, kwargs: dict) -> Any:
        # FSDP2 or ZeRO-3 shards the module's own parameters: their hooks (all-gathers, and what
        # the backward queues) run only through __call__, which reaches this wrapper again.
        return self(*args, **kwargs) if _is_sharded(self) else call(self, *args, **kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if in_replay() or not (self.training or in_eval):  # a reference check's replay sets FP8 itself
            return call(self, *args, **kwargs)
        if self.training and run.reference is not None and torch.is_grad_enabled():
            loss_of = run.reference.config.output_loss or output_loss
            run.capture_replay(lambda: loss_of(replayed(self, args, kwargs)))
        with run.forward_context(device_type):
            output = call(self, *args, **kwargs)
        if self.training and torch.is_grad_enabled():
            run.training_output(output)
        return output

    forward.__wrapped__ = function if function is not None else original  # type: ignore[attr-defined]
    module.forward = MethodType(forward, module)


def _is_sharded(module: nn.Module) -> bool:
    # FSDP2 (fully_shard made the module an FSDPModule) or DeepSpeed ZeRO-3 (its partitioned
    # parameters carry their part as ds_tensor).
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return False
    return isinstance(module, FSDPModule) or any(hasattr(p, "ds_tensor") for p in module.parameters())
