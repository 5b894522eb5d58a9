"""FP8 under DeepSpeed ZeRO (stages 1, 2, 3), for every loop that hands its model to a
``deepspeed.DeepSpeedEngine`` (Accelerate, the transformers Trainer, Lightning's DeepSpeedStrategy).

DeepSpeed owns the optimizer step (``engine.step()``: gradient reduction at the accumulation
boundary, clipping, the ZeRO optimizer's update of its FP32 master partitions, loss scaling),
the mixed precision of the non-FP8 ops (its ``bf16`` / ``fp16`` settings) and its checkpoints.
:func:`attach_to_engine` fits the FP8 work of :class:`~fp8_plugin.training.core.FP8Training`
around that, without importing deepspeed (the engine is duck-typed):

- ``engine.step()`` at a gradient-accumulation boundary ends the FP8 training step:
  ``before_optimizer_step`` right before it, ``after_optimizer_step`` (the step's one amax
  reduction, a MAX all-reduce over the data-parallel group DeepSpeed uses) right after. Steps
  between boundaries do nothing FP8: the micro-batches share one scale update. The per-layer
  FP8 statistics (:mod:`fp8_plugin.training.statistics`) of a sampled step are reduced there
  too, and the loop's ``after_step`` callback (its logging) runs once the step is over.
- Non-finite gradients are DeepSpeed's: under ``fp16`` its dynamic loss scaler skips the step
  (``engine.was_step_applied()`` is False), which is counted as a loss-scaler skip; ZeRO keeps
  the gradients in its own partitions (``param.grad`` is None), where this project's own check
  cannot see them.
- Under ZeRO-3 a layer's weight is gathered for each forward into a fresh buffer (whose address
  the allocator may reuse) and DeepSpeed updates the partitions (``param.ds_tensor``) outside
  the parameter, so neither the weight's version counter nor its address tells a changed
  weight: the FP8 weight cache is turned off there (each gathered weight is cast afresh).
- ``engine.save_checkpoint`` / ``load_checkpoint`` carry the FP8 state in DeepSpeed's
  ``client_state`` (key :data:`CLIENT_STATE_KEY`), and the reference checks' schedule and
  history (:data:`REFERENCE_STATE_KEY`); the model's own ``state_dict()`` stays vanilla.
- Reference checks run in ``engine.step()`` at the boundary, before DeepSpeed's step: the
  replays take their gradients with ``torch.autograd.grad``, which runs none of ZeRO's gradient
  hooks (they sit on the parameters' gradient accumulation), so DeepSpeed's partitions are not
  touched; under ZeRO-3 the replays' forwards and backwards gather the parameters as training's
  do, and each gradient is reduce-scattered as it is formed, a rank keeping its part
  (:mod:`fp8_plugin.training.reference.gradients`).

May import: :mod:`fp8_plugin.training` and below.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from ..modules.weight_cache import weight_cache_holders
from .core import FP8Training

__all__ = ["attach_to_engine", "check_deepspeed_config", "check_frozen_fp8_partitioning", "is_deepspeed_engine",
           "zero_stage",
           "CLIENT_STATE_KEY", "REFERENCE_STATE_KEY", "REFUSED"]

# The keys of the FP8 state, and of the reference checks' history, in a DeepSpeed checkpoint's
# client_state.
CLIENT_STATE_KEY = "fp8_plugin_state"
REFERENCE_STATE_KEY = "fp8_plugin_reference_checks"

# What cannot run under DeepSpeed, and why (each loop refuses it at start-up with this reason).
REFUSED = {
    "nonfinite": "DeepSpeed owns the optimizer step and keeps the gradients in its ZeRO partitions: a step "
                 "with non-finite gradients is skipped by DeepSpeed's fp16 dynamic loss scaler, not by "
                 "fp8-plugin's nonfinite policy; leave nonfinite unset under DeepSpeed",
    "tensor_parallel": "DeepSpeed's tensor parallelism (autotp_size > 1) shards weights across ranks whose "
                       "weight amaxes then differ; valid here: ZeRO stages 0-3 with data parallelism only",
    "frozen_zero3_gloo": "gloo has no float8 collectives for ZeRO-3's all-gathers. Valid set-ups: ZeRO stage 0, 1 "
                         "or 2; FSDP2 (its all-gather moves the FP8 bytes); or keep frozen weights in high "
                         "precision: fp8_plugin.convert_model(model, frozen_weights='keep') before prepare()",
}


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (checked by class name, so that
    deepspeed is imported only by code that uses it)."""
    return any(cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed.")
               for cls in type(obj).__mro__)


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0 to 3)."""
    return int(engine.zero_optimization_stage())


def check_deepspeed_config(config: dict, owner: str) -> None:
    """Refuse, at start-up, a DeepSpeed config that FP8 cannot run with.

    Args:
        config: the DeepSpeed config (a dict, as loops hold it).
        owner: who reads it, for the message (``"Accelerator"``, ``"FP8Trainer"``, ...).

    Raises:
        ValueError: ``tensor_parallel.autotp_size`` > 1 (:data:`REFUSED`), or a ZeRO stage
            outside 0-3 (named, with the valid ones).
    """
    autotp = (config.get("tensor_parallel") or {}).get("autotp_size", 0)
    if isinstance(autotp, int) and autotp > 1:
        raise ValueError(f"{owner}: FP8 with DeepSpeed tensor_parallel.autotp_size={autotp} is not supported: "
                         f"{REFUSED['tensor_parallel']}")
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(stage, int) and stage not in (0, 1, 2, 3):
        raise ValueError(f"{owner}: DeepSpeed zero_optimization.stage={stage} is not valid; valid: 0, 1, 2, 3")


def check_frozen_fp8_partitioning(report: Any, config: dict) -> None:
    """Refuse weights kept only in FP8 where DeepSpeed ZeRO-3 would partition them over gloo.

    ZeRO-3 all-gathers each partitioned parameter for each forward in the parameter's dtype;
    weights kept only in FP8 (frozen: LoRA base layers, a published FP8 checkpoint) are float8
    parameters, and gloo has no float8 collectives (the first forward fails with "Invalid scalar
    type"). ZeRO 0-2 keep every parameter whole on each rank and are not affected.

    Args:
        report: the model's ``ConversionReport`` (its ``frozen`` decisions).
        config: the DeepSpeed config (a dict).

    Raises:
        ValueError: ZeRO stage 3 on a gloo process group and ``report`` has frozen FP8 layers
            (:data:`REFUSED`).
    """
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage != 3 or not report.frozen or not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    names = ", ".join(d.name for d in report.frozen[:3]) + (", ..." if len(report.frozen) > 3 else "")
    raise ValueError(f"DeepSpeed ZeRO-3 on the gloo backend cannot partition weights kept only in FP8 "
                     f"({len(report.frozen)} frozen layers: {names}): {REFUSED['frozen_zero3_gloo']}")


def attach_to_engine(engine: Any, runs: list[FP8Training],
                     after_step: Optional[Callable[[list[FP8Training]], None]] = None) -> None:
    """Fit the FP8 training of ``runs`` (models converted before ``deepspeed.initialize``)
    around ``engine``; call once, right after the engine is built and before the first forward.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` wrapping the converted model(s).
        runs: the :class:`FP8Training` of each converted model inside the engine (a list the
            caller may extend later: it is read at each step).
        after_step: called with ``runs`` after each ``engine.step()`` that ended an FP8 training
            step (the loop logs the step's reference and statistics figures there); None: nothing.
    """
    if getattr(engine, "_fp8_attached", False):
        return
    # The ranks that see different data and must share scales: data parallel (with DeepSpeed's
    # sequence parallelism, the sequence-and-data-parallel group).
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    for run in runs:
        run.amax_reduction_group = group
        run._reducer_ready = False  # rebuilt for this group at the next use
    if zero_stage(engine) == 3:
        for run in runs:
            for layer in _fp8_layers(run.module):
                layer.cache_fp8_weights = False
                layer.clear_weight_cache()
    _wrap_step(engine, runs, after_step)
    _wrap_checkpoints(engine, runs)
    engine._fp8_attached = True


def _fp8_layers(module: Optional[nn.Module]) -> list[nn.Module]:
    # The modules with an FP8 weight cache: linear layers and MoE experts.
    return weight_cache_holders(module) if module is not None else []


def _at_boundary(engine: Any) -> bool:
    # A step() that will update the weights: at the accumulation boundary, or any step() when the
    # caller owns the boundary (managed_gradient_accumulation false).
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is not None and not managed():
        return True
    return bool(engine.is_gradient_accumulation_boundary())


def _wrap_step(engine: Any, runs: list[FP8Training],
               after_step: Optional[Callable[[list[FP8Training]], None]]) -> None:
    original = engine.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        if not _at_boundary(engine):
            return original(*args, **kwargs)
        loss_scaled = bool(engine.fp16_enabled())
        for run in runs:
            # DeepSpeed checks (fp16) or takes (bf16) the step itself: see REFUSED["nonfinite"].
            run.before_optimizer_step(loss_scaled=True)
        output = original(*args, **kwargs)
        skipped = (not engine.was_step_applied()) if loss_scaled else None  # a host bool: DeepSpeed read it
        for run in runs:
            run.after_optimizer_step(skipped)  # the step's amax reduction, and its statistics' (sampled steps)
        if after_step is not None:
            after_step(runs)
        return output

    engine.step = step


def _wrap_checkpoints(engine: Any, runs: list[FP8Training]) -> None:
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir: Any, tag: Any = None, client_state: Optional[dict] = None, *args: Any,
                        **kwargs: Any) -> Any:
        state = dict(client_state or {})
        # Between steps every rank settles its pending amaxes (one reduction) before rank 0 writes.
        state[CLIENT_STATE_KEY] = [run.state_dict() for run in runs]
        state[REFERENCE_STATE_KEY] = [run.reference.state_dict() if run.reference is not None else None
                                      for run in runs]
        return save(save_dir, tag, state, *args, **kwargs)

    @functools.wraps(load)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        path, client_state = load(*args, **kwargs)
        saved = client_state.pop(CLIENT_STATE_KEY, None) if isinstance(client_state, dict) else None
        checks = client_state.pop(REFERENCE_STATE_KEY, None) if isinstance(client_state, dict) else None
        if path is not None and saved is not None:
            if len(saved) != len(runs):
                raise RuntimeError(
                    f"The DeepSpeed checkpoint {path} holds FP8 state for {len(saved)} model(s), this engine "
                    f"runs {len(runs)}: convert the same models before load_checkpoint"
                )
            for index, (run, state) in enumerate(zip(runs, saved)):
                run.load_state_dict(state, "DeepSpeedEngine.load_checkpoint")
                if run.reference is not None and checks and checks[index] is not None:
                    run.reference.load_state_dict(checks[index])  # the checks' schedule and history
                for layer in _fp8_layers(run.module):
                    layer.clear_weight_cache()  # the loaded weights replace the ones cast
        return path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
