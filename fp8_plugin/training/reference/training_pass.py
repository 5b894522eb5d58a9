"""The training step's own FP8 pass in place of a check's FP8 replay, where it is the same computation.

A check compares one micro-batch run in FP8 with the same micro-batch in the reference precision.
Its FP8 side has been a replay: the micro-batch's forward and backward run again, FP8 on, into
gradient buffers of their own. On a due step whose training pass is that very computation, the
check takes the training pass's loss and gradients instead, and replays only the reference: one
forward and backward fewer, a third of a check's work (the reference replay runs the FP8 GEMMs
of its per-GEMM figures too).

The training pass stands in only where it computed what the FP8 replay would:

- one training forward in the step (no gradient accumulation), captured by the check, that ran
  FP8 GEMMs (not a calibration step, not compiled code, whose FP8 forwards are not counted);
- its backward is of that forward's loss: the loop passes the tensor it backpropagates, and it
  is the loss the forward returned (the same object), or the loop vouches for it (Lightning: the
  ``training_step`` loss the replay reruns, with ``accumulate_grad_batches=1``);
- the parameters' ``.grad`` were all None before that backward, so that afterwards they hold
  this micro-batch's gradients alone;
- one process (no other rank's gradients averaged in) with whole parameters (not FSDP2, not
  DeepSpeed), and no loss scaler (whose backward scales the gradients).

Elsewhere the check replays the FP8 side as before. The gradients are copied right after the
backward: loops clip them in place before the optimizer step, where the check runs. The copy
holds what the FP8 replay's gradients held, for a shorter time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...modules.autocast import fp8_forward_count
from .expert_layers import checked_layers
from .gradients import WHOLE, fp8_weights, gradient_layout, trainable_parameters


@dataclass(frozen=True)
class TrainingPass:
    """A due step's training forward and backward, as a check's FP8 side.

    Attributes:
        names: the trainable parameters' names, in ``named_parameters`` order.
        loss: the forward's loss, float32 0-dim, detached.
        grads: each parameter's gradient from that backward (a copy), or None where it got none.
        fp8_forwards: FP8 layer forwards the training forward ran (what the FP8 replay's guard
            counts).
    """

    names: tuple[str, ...]
    loss: torch.Tensor
    grads: list[Optional[torch.Tensor]]
    fp8_forwards: int

    def matches(self, names: Sequence[str]) -> bool:
        """Whether the gradients are of the parameters a check compares (``names``, in order)."""
        return tuple(names) == self.names


class TrainingPassRecorder:
    """What a due step's training pass shows the check (:class:`TrainingPass`), fed by the loops
    through :class:`~fp8_plugin.training.core.FP8Training`: the forward's start (with the
    check's capture), its output, the backward's start and end. Anything outside the conditions
    of the module docstring, or ``enabled=False``, leaves :attr:`taken` None, and the check replays."""

    def __init__(self, output_loss: Callable[[Any], torch.Tensor], enabled: bool = True) -> None:
        self._output_loss = output_loss
        self._enabled = enabled  # ReferenceCheck(training_pass=...)
        self.reset()

    def reset(self) -> None:
        """A new step: nothing seen."""
        self.taken: Optional[TrainingPass] = None
        self._forwards = 0
        self._count_at_start: Optional[int] = None
        # A weak reference: a forward whose backward never comes must not keep its graph alive.
        self._loss: Optional["weakref.ReferenceType[torch.Tensor]"] = None
        self._armed: Optional[torch.Tensor] = None

    def forward_started(self) -> None:
        """A training forward of the due step starts (the check captured it)."""
        self._forwards += 1
        self._count_at_start = fp8_forward_count()
        self._loss, self._armed, self.taken = None, None, None

    def forward_output(self, output: Any) -> None:
        """The output of the forward that started last; its loss is what the backward must be of."""
        if self._count_at_start is None or self._loss is not None:
            return
        try:
            self._loss = weakref.ref(self._output_loss(output))
        except (ValueError, TypeError):  # no scalar loss in the output: the loop computes it outside
            self._loss = None

    def backward_starts(self, model: nn.Module, loss: torch.Tensor, loss_scaled: bool, vouched: bool) -> None:
        """The loop backpropagates ``loss``; ``vouched``: the loop knows it is the captured forward's loss."""
        self._armed = None
        if not self._enabled or self._count_at_start is None or self._forwards != 1 or loss_scaled:
            return
        if not isinstance(loss, torch.Tensor) or not (vouched or (self._loss is not None and loss is self._loss())):
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return
        if any(p.grad is not None for p in model.parameters() if p.requires_grad):
            return
        self._armed = loss

    def backward_ended(self, model: nn.Module) -> None:
        """The backward started by :meth:`backward_starts` ended: copy its gradients, if armed."""
        loss, self._armed = self._armed, None
        if loss is None:
            return
        names, params = trainable_parameters(model)
        try:
            if gradient_layout(names, params, fp8_weights(checked_layers(model))) != WHOLE:
                return
        except ValueError:  # a set-up the check refuses: its replay says why
            return
        if all(p.grad is None for p in params):
            return  # DeepSpeed ZeRO 1 and 2 keep their gradients in their own buffers (ZeRO-3: not WHOLE)
        forwards = fp8_forward_count() - self._count_at_start
        if forwards == 0:  # high precision (a calibration step) or compiled: the replay decides
            return
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        self.taken = TrainingPass(tuple(names), loss.detach().float().reshape(()), grads, forwards)
