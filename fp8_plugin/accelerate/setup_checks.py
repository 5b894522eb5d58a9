"""What the FP8 ``Accelerator`` refuses when it is built or a model is prepared, before any step:
reference checks where their replay cannot run (FSDP1, XLA, Megatron-LM), and what FP8 cannot
do under DeepSpeed.
"""

from __future__ import annotations

from accelerate.utils import DistributedType
from torch import nn

from ..training.deepspeed_engine import REFUSED, check_deepspeed_config
from .settings import FP8Settings


def _reference_given(settings: FP8Settings) -> str:
    config = settings.reference_check
    if "reference_every" in settings.sources:
        return f"{settings.sources['reference_every']}={config.every!r}"
    return f"{settings.sources.get('reference_policy', 'reference_policy')}={config.policy!r}"


_REFERENCE_SETUPS = ("Valid set-ups: one process, DDP (multi-CPU / multi-GPU), FSDP2 (fsdp_version: 2), DeepSpeed "
                     "ZeRO 0-3; set reference_every to 0 to train otherwise")


def _check_reference_setup(settings: FP8Settings, distributed_type: DistributedType, fsdp2: bool = False) -> None:
    """Reference checks run on one process, under DDP (Accelerate's MULTI_* types), under
    FSDP2 (``distributed_type=FSDP`` with ``fsdp_version: 2``, ``fsdp2=True``) and under
    DeepSpeed ZeRO 0-3.

    Raises:
        ValueError: any other distributed type (FSDP1, XLA, Megatron-LM).
    """
    if distributed_type == DistributedType.NO or str(distributed_type.value).startswith("MULTI_"):
        return
    if distributed_type == DistributedType.FSDP and fsdp2 or distributed_type == DistributedType.DEEPSPEED:
        return
    what = "FSDP1 (fsdp_version: 1)" if distributed_type == DistributedType.FSDP else distributed_type.value
    raise ValueError(
        f"FP8 reference checks ({_reference_given(settings)}) are not supported with distributed_type="
        f"{distributed_type.value}: the check's replay reads FSDP2's sharded gradients (DTensors), which "
        f"{what} does not make. {_REFERENCE_SETUPS}"
    )


def _check_deepspeed_setup(settings: FP8Settings, config: dict) -> None:
    """What FP8 cannot do under DeepSpeed, refused before any step (the reasons are in
    :data:`fp8_plugin.training.deepspeed_engine.REFUSED`).

    Raises:
        ValueError: a ``nonfinite`` policy given, DeepSpeed tensor parallelism, or an invalid
            ZeRO stage.
    """
    if "nonfinite" in settings.sources:
        raise ValueError(f"{settings.sources['nonfinite']}={settings.fault_policy.nonfinite!r} is not supported with "
                         f"distributed_type=DEEPSPEED: {REFUSED['nonfinite']}")
    check_deepspeed_config(config, "Accelerator")


def _check_not_sharded(settings: FP8Settings, module: nn.Module) -> None:
    """A model already wrapped in FSDP1 (``FullyShardedDataParallel``) refuses reference checks as
    FSDP1 set-ups do. (A model sharded by FSDP2's ``fully_shard`` before ``prepare()`` is refused
    by the conversion itself: convert first, then shard.)

    Raises:
        ValueError: ``module`` or one of its submodules is wrapped in FSDP1.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without distributed support: nothing can be sharded
        return
    sharded = next((m for m in module.modules() if isinstance(m, FullyShardedDataParallel)), None)
    if sharded is not None:
        raise ValueError(
            f"FP8 reference checks ({_reference_given(settings)}) are not supported on a model wrapped in FSDP1 "
            f"(found {type(sharded).__name__}): the check's replay reads FSDP2's sharded gradients (DTensors), "
            f"not FSDP1's flat parameters. {_REFERENCE_SETUPS}"
        )
