"""How the Lightning plugins run the reference checks: a callback at ``on_train_batch_start``
keeps a replay of ``training_step`` on that batch (single device, DDP, FSDP2's
``ModelParallelStrategy``, ``DeepSpeedStrategy``), and the summary at the end of fit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..training.core import FP8Training
from ..training.reference import output_loss


class _ReferenceCapture(Callback):
    """Offers each training batch to the reference checks at ``on_train_batch_start`` (the
    batch is on its device, the RNG state is the training step's): the replay reruns
    ``training_step`` on it with logging silenced and reads its loss as Lightning does."""

    def __init__(self, fp8: FP8Training) -> None:
        self.fp8 = fp8

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.fp8.capture_replay(lambda: _replay_training_step(pl_module, batch, batch_idx))


def _attach_reference_capture(module: nn.Module, fp8: FP8Training) -> None:
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return
    if not getattr(module, "automatic_optimization", True):
        raise ValueError(
            "FP8 reference checks (reference_every / reference_check) need automatic optimization; this LightningModule "
            "sets automatic_optimization=False: call fp8_plugin.reference_check(...) in its training_step instead"
        )
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

    valid = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)
    # DeepSpeedStrategy subclasses DDPStrategy; FSDPStrategy (FSDP1) does not, and is refused.
    if not isinstance(trainer.strategy, valid):
        raise ValueError(
            f"FP8 reference checks (reference_every / reference_check) with strategy {type(trainer.strategy).__name__} "
            "are not supported: the replay reads FSDP2's sharded gradients (DTensors), not FSDP1's flat parameters. "
            "Valid strategies: a single device, DDP, ModelParallelStrategy (FSDP2), DeepSpeedStrategy"
        )
    trainer.callbacks.append(_ReferenceCapture(fp8))


def _replay_training_step(module: Any, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
    import inspect

    takes_index = len(inspect.signature(module.training_step).parameters) >= 2
    # The replay's self.log calls would log reference figures under the user's keys: silence them.
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        output = module.training_step(batch, batch_idx) if takes_index else module.training_step(batch)
    finally:
        del module.log, module.log_dict
    return None if output is None else output_loss(output)  # None: Lightning skips this batch


def summarise_once(fp8: FP8Training, summarised: int) -> int:
    """At the end of fit (a plugin's ``teardown``): print the checks' summary and write their
    report files on rank zero, if steps ran since the last summary (``summarised`` steps);
    returns the steps now summarised."""
    checker = fp8.reference
    if checker is None or checker.steps <= summarised:
        return summarised
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        rank_zero_info(checker.finish())
    return checker.steps
