"""The memory of one training step, every byte accounted for: ``estimate_memory`` and ``compare_memory``.

For a Hugging Face model (a checkpoint folder or a config), a precision, an optimizer, a batch
size and a sequence length, :func:`estimate_memory` runs two real training steps (forward with
the loss, backward, optimizer step, the FP8 scale update) and gives the peak of the second, the
steady one, broken down by :class:`~fp8_plugin.tools.memory_trace.MemoryTrace`: parameters and
master weights, FP8 weight copies (rowwise and columnwise), gradients, optimizer states,
activations saved for backward by kind, transients and the largest of them. A full fine-tune, or
with ``lora_rank`` a LoRA fine-tune over frozen base weights (kept only in FP8 under the FP8
precisions, as the loops keep them).

Where it runs:

- ``device="meta"`` (default, any machine): the model is built on ``meta`` tensors presented as a
  GPU of compute ``capability`` (:func:`~fp8_plugin.numerics.device_kind.meta_as_cuda`, with the
  GPU's native FP8 GEMMs taken without their probe, ``force_path("native")``): the CUDA
  code paths run (fused casts, ``torch._scaled_mm``'s operand layouts, flash attention), with CUDA
  autocast's dtype policy (:mod:`fp8_plugin.tools.autocast_on_meta`), without allocating a byte;
  an 8B model's step traces in seconds.
- ``device="cuda"``: the same step on the GPU, with torch autocast; the estimate then also gives
  ``torch.cuda.max_memory_allocated`` over the second step (``measured_peak_bytes``), against which
  the trace is checked.

What the step does is what the project's loops do (``fp8_plugin/training/core.py``): FP32
parameters (master weights) converted with ``convert_model``, the forward under torch autocast in
BF16 and :func:`fp8_plugin.autocast`, the FP8 weight caches cleared before the optimizer step,
``zero_grad(set_to_none=True)`` after it, then the pending scales settled. torch's AdamW and SGD
run their ``foreach`` implementation, their default on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..modules.autocast import autocast, new_step_id
from ..modules.convert import convert_model
from ..modules.freezing import keep_frozen_in_fp8
from ..modules.linear import FP8Linear
from ..modules.scaling_group import update_pending_scales
from ..modules.weight_cache import clear_weight_caches
from ..numerics.device_kind import meta_as_cuda
from ..numerics.gemm import clear_plans, force_path
from ..numerics.recipes import Recipe
from ..optim import FP8AdamW
from ..training.precision_strings import PRECISION_STRINGS
from .autocast_on_meta import cuda_autocast_on_meta
from .grouped_mm_on_meta import grouped_mm_on_meta
from .hf_models import model_class
from .memory_trace import CATEGORIES, MemoryTrace, Peak

__all__ = ["estimate_memory", "compare_memory", "MemoryEstimate", "PRECISIONS", "OPTIMIZERS"]

# precision -> (parameter dtype, autocast dtype or None, the FP8 recipe's factory or None). The FP8
# strings with FP16 compute need a loss scaler, whose step reads the gradients' finiteness on the
# host: not here.
PRECISIONS: dict[str, tuple[torch.dtype, Optional[torch.dtype], Optional[Callable[[], Recipe]]]] = {
    "32-true": (torch.float32, None, None),
    "bf16-true": (torch.bfloat16, None, None),
    "bf16-mixed": (torch.float32, torch.bfloat16, None),
    **{name: (torch.float32, dtype, recipe) for name, (recipe, dtype) in PRECISION_STRINGS.items()
       if dtype == torch.bfloat16},
}
OPTIMIZERS = ("adamw", "fp8-adamw", "sgd")
# The aten ops of FP8 GEMMs (each allocates its output once per call).
SCALED_GEMMS = frozenset({"_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm"})


@dataclass
class MemoryEstimate:
    """One training step's memory.

    Attributes:
        model: the model's name (its folder, or its config's class).
        precision, optimizer, batch_size, seq_len: the step traced.
        device: what ran it ("meta as sm90", or the GPU's name).
        parameters, trainable_parameters: counts.
        recipe: the FP8 layers' recipe class, as ``convert_model`` resolved the precision's for the
            device (``"fp8-hybrid"``: DelayedScaling on sm90, MXFP8BlockScaling on sm100); None
            without FP8.
        fp8_layers: FP8 linear layers after conversion (0 without FP8).
        fp8_gemms: FP8 GEMMs the second step ran (``torch._scaled_mm`` and its kin): 3 per FP8 layer
            (fprop, dgrad, wgrad) when every layer ran in FP8.
        peak: the breakdown at the peak of the second step (bytes).
        after_forward: the breakdown when the second step's forward has ended: everything saved
            for backward is held then.
        resident_bytes: bytes held between steps (parameters, states, buffers).
        measured_peak_bytes: ``torch.cuda.max_memory_allocated`` over the second step (GPU only).
        lora_rank, lora_targets: the LoRA fine-tune traced (None: a full fine-tune).
    """

    model: str
    precision: str
    optimizer: str
    batch_size: int
    seq_len: int
    device: str
    parameters: int
    trainable_parameters: int
    recipe: Optional[str]
    fp8_layers: int
    fp8_gemms: int
    peak: Peak
    after_forward: Peak
    resident_bytes: int
    measured_peak_bytes: Optional[int] = None
    lora_rank: Optional[int] = None
    lora_targets: Optional[Union[str, list[str]]] = None

    def to_dict(self) -> dict[str, Any]:
        """The estimate as JSON-ready values (bytes as ints)."""
        largest = self.peak.largest_transient
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("peak", "after_forward")}
        out["peak"] = {
            "bytes": self.peak.bytes, "phase": self.peak.phase, "categories": self.peak.categories,
            "saved_by_kind": self.peak.saved_by_kind,
            "largest_transient": None if largest is None else {
                "bytes": largest.nbytes, "op": largest.op, "shape": list(largest.shape),
                "dtype": str(largest.dtype).replace("torch.", ""), "phase": largest.phase},
        }
        out["after_forward"] = {"bytes": self.after_forward.bytes, "categories": self.after_forward.categories,
                                "saved_by_kind": self.after_forward.saved_by_kind}
        return out


def estimate_memory(model: Union[str, Path, Any], precision: str = "fp8-hybrid", optimizer: str = "adamw", *,
                    batch_size: int = 8, seq_len: int = 1024, device: str = "meta",
                    capability: tuple[int, int] = (9, 0), skip_small: Union[str, bool] = "auto",
                    lora_rank: Optional[int] = None,
                    lora_targets: Union[str, list[str]] = "all-linear") -> MemoryEstimate:
    """Trace two training steps of ``model`` and break the second one's peak down.

    Args:
        model: a Hugging Face checkpoint folder (its ``config.json`` is read; no weights are
            loaded) or a ``transformers.PretrainedConfig``. The class is the one
            ``config.architectures`` names (``AutoModelForCausalLM`` when it names none); it must
            take ``labels`` and return a loss: causal and masked LMs get the tokens as labels,
            sequence classifiers class 0.
        precision: one of :data:`PRECISIONS` (``"bf16-mixed"``, ``"fp8-hybrid"``, ...).
        optimizer: ``"adamw"`` (``torch.optim.AdamW``), ``"fp8-adamw"``
            (:class:`fp8_plugin.optim.FP8AdamW`) or ``"sgd"`` (momentum 0.9).
        batch_size, seq_len: the batch, in sequences of ``seq_len`` tokens.
        device: ``"meta"`` (a traced step, no memory used) or ``"cuda"`` (the current GPU).
        capability: the compute capability meta tensors present (``(9, 0)``: H100 / H200).
        skip_small: ``convert_model``'s: ``"auto"`` keeps in BF16 the layers FP8 would not make
            faster on the GPU (as the loops do), False converts every layer but the heads.
        lora_rank: None for a full fine-tune; a rank for a LoRA fine-tune: PEFT's
            ``get_peft_model`` with ``LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
            target_modules=lora_targets)`` over base weights loaded in BF16 (FP32 under
            ``"32-true"``), as LoRA fine-tunes load them, with FP32 adapters (PEFT's
            ``autocast_adapter_dtype``). Under the FP8 precisions ``convert_model`` keeps the
            converted layers' frozen base weights only in FP8 (docs/lora.md): 1 byte per value.
        lora_targets: PEFT's ``target_modules``: ``"all-linear"`` (default) or module names.

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        ValueError: an unknown precision, optimizer or device, a batch size, sequence length or
            LoRA rank below 1, LoRA targets the model does not have, a folder without a readable
            ``config.json``, or a model class without a loss.
    """
    param_dtype, autocast_dtype, recipe = _check(precision, optimizer, batch_size, seq_len, device)
    if lora_rank is not None:
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
            raise ValueError(f"lora_rank={lora_rank!r} is not a rank; valid: None (a full fine-tune) or an int >= 1")
        if param_dtype != torch.float32 or autocast_dtype is not None:  # all but 32-true: a BF16 base
            param_dtype = torch.bfloat16
    fp8 = recipe is not None
    config, name = _config(model)
    with contextlib.ExitStack() as presented:
        if device == "meta":
            # The GEMM decisions cached for the meta device belong to the GPU presented: cleared
            # before and after, as another call may present another GPU.
            clear_plans()
            presented.callback(clear_plans)
            presented.enter_context(meta_as_cuda(capability))
            # The GPU's own kernels, block-scaled ones included, without the probe GEMM that
            # checks them against the emulation (it reads its result, which meta tensors lack).
            presented.enter_context(force_path("native"))
            # transformers' float32 experts (grouped_mm), which the GPU runs and meta refuses.
            presented.enter_context(grouped_mm_on_meta())
        net = _build(config, param_dtype, device)
        if lora_rank is not None:
            net = _with_lora(net, lora_rank, lora_targets)
        report = convert_model(net, recipe(), skip_small=skip_small) if fp8 else None
        if report is not None and device == "meta":
            # convert_model leaves meta weights unfrozen (they have no values to cast yet); the
            # trace needs the layout a loop gives real ones: frozen weights only in FP8.
            keep_frozen_in_fp8(net, report.layers, {id(m) for m in net.modules()}, include_meta=True)
        params = list(net.parameters())
        opt = _optimizer(optimizer, [p for p in params if p.requires_grad])
        batch = _batch(net, batch_size, seq_len, device)
        trace = MemoryTrace(device)
        _register(trace, net, batch)
        hooks = trace.watch_gradients(params)
        measured = None
        try:
            with trace:
                _step(net, opt, batch, trace, device, autocast_dtype, fp8)
                resident = trace.live_bytes
                trace.reset_peak()
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                second = len(trace.allocations)
                after_forward = _step(net, opt, batch, trace, device, autocast_dtype, fp8)
                if device == "cuda":
                    measured = torch.cuda.max_memory_allocated()
        finally:
            for hook in hooks:
                hook.remove()
    fp8_layers = len(report.swapped) if report is not None else 0
    layer = next((m for m in net.modules() if isinstance(m, FP8Linear)), None)
    recipe_name = type(layer.recipe).__name__ if layer is not None else None
    fp8_gemms = sum(1 for record in trace.allocations[second:] if record.op in SCALED_GEMMS)
    label = f"meta as sm{capability[0]}{capability[1]}" if device == "meta" else torch.cuda.get_device_name()
    return MemoryEstimate(name, precision, optimizer, batch_size, seq_len, label, sum(p.numel() for p in params),
                          sum(p.numel() for p in params if p.requires_grad), recipe_name, fp8_layers, fp8_gemms,
                          trace.peak(), after_forward, resident, measured, lora_rank,
                          lora_targets if lora_rank is not None else None)


def compare_memory(model: Union[str, Path, Any], precisions: tuple[str, ...] = ("bf16-mixed", "fp8-hybrid"),
                   optimizers: Union[str, tuple[str, ...]] = "adamw", **kwargs: Any) -> list[MemoryEstimate]:
    """:func:`estimate_memory` for each precision (with the optimizer of the same position, or the
    one ``optimizers`` names for all), the same model and batch: the columns of ``fp8-plugin memory``."""
    if isinstance(optimizers, str):
        optimizers = (optimizers,) * len(precisions)
    if len(optimizers) != len(precisions):
        raise ValueError(f"compare_memory: {len(optimizers)} optimizers for {len(precisions)} precisions; "
                         "valid: one optimizer, or one per precision")
    return [estimate_memory(model, p, o, **kwargs) for p, o in zip(precisions, optimizers)]


def _check(precision: str, optimizer: str, batch_size: int, seq_len: int, device: str):
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one the memory tool traces; valid: {', '.join(PRECISIONS)} "
                         "(the FP16 ones need a loss scaler, which reads the gradients on the host)")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known; valid: {', '.join(OPTIMIZERS)}")
    for setting, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{setting}={value!r} is not a size; valid: an int >= 1")
    if device not in ("meta", "cuda"):
        raise ValueError(f"device={device!r} is not one the memory tool runs on; valid: 'meta' (traced, any "
                         "machine), 'cuda' (the current GPU)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; valid here: 'meta'")
    return PRECISIONS[precision]


def _config(model: Any) -> tuple[Any, str]:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model, type(model).__name__
    path = Path(model)
    if path.name == "config.json":  # a checkpoint folder's: read as the folder, named after it
        path = path.parent
    try:
        if path.is_file() and path.suffix == ".json":  # a config.json of its own
            values = json.loads(path.read_text())
            return AutoConfig.for_model(values.pop("model_type"), **values), path.stem
        if (path / "config.json").is_file():
            return AutoConfig.from_pretrained(path, local_files_only=True), path.name
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"model={str(path)!r}: transformers cannot read its config ({type(err).__name__}: "
                         f"{err}); valid: a config.json written by save_pretrained()") from None
    raise ValueError(f"model={str(path)!r} is neither a folder with a config.json nor a .json file; valid: a "
                     "Hugging Face checkpoint folder, its config.json, or a transformers PretrainedConfig")


def _build(config: Any, dtype: torch.dtype, device: str) -> nn.Module:
    import transformers

    cls = model_class(config) if getattr(config, "architectures", None) else transformers.AutoModelForCausalLM
    if not any(task in cls.__name__ for task in ("CausalLM", "MaskedLM", "SequenceClassification")):
        raise ValueError(f"{cls.__name__} has no training loss the memory tool can drive; valid: a config whose "
                         "architectures name a *ForCausalLM, *ForMaskedLM or *ForSequenceClassification class")
    with torch.device(device):
        net = cls.from_config(config, dtype=dtype) if hasattr(cls, "from_config") else cls(config).to(dtype)
    net.train()
    return net


def _with_lora(net: nn.Module, rank: int, targets: Union[str, list[str]]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    try:
        with warnings.catch_warnings():  # PEFT's own call of a transformers method deprecated in v5, not the user's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
            return get_peft_model(net, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    except ValueError as err:  # PEFT's: target modules not found
        raise ValueError(f"lora_targets={targets!r}: {err}; valid: 'all-linear' or names of the model's linear "
                         "layers") from None


def _batch(net: nn.Module, batch_size: int, seq_len: int, device: str) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    base = net.get_base_model() if hasattr(net, "get_base_model") else net  # under a PEFT wrapper
    if "SequenceClassification" in type(base).__name__:
        return {"input_ids": ids, "labels": torch.zeros(batch_size, dtype=torch.long, device=device)}
    return {"input_ids": ids, "labels": ids}


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    return FP8AdamW(params, lr=1e-5)


def _register(trace: MemoryTrace, net: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    for param in net.parameters():
        trace.register(param, "parameters" if param.requires_grad else "frozen weights")
    for module in net.modules():
        for buffer in module.buffers(recurse=False):
            # A frozen weight kept only in FP8 may be a buffer (its E4M3 bytes); masks and scales are not.
            frozen = buffer.dtype.is_floating_point and buffer.dtype.itemsize == 1
            trace.register(buffer, "frozen weights" if frozen else "buffers")
        state = getattr(module, "fp8_state", None)
        for value in (vars(state).values() if state is not None else ()):
            if isinstance(value, torch.Tensor):
                trace.register(value, "FP8 scaling state")
    for tensor in batch.values():
        trace.register(tensor, "batch")


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], trace: MemoryTrace,
          device: str, autocast_dtype: Optional[torch.dtype], fp8: bool) -> Peak:
    # One training step, as the loops run it; returns the breakdown when its forward has ended.
    if autocast_dtype is None:
        torch_autocast: Any = contextlib.nullcontext()
    elif device == "meta":
        torch_autocast = cuda_autocast_on_meta(autocast_dtype)
    else:
        torch_autocast = torch.autocast("cuda", dtype=autocast_dtype)
    fp8_autocast = autocast(step=new_step_id()) if fp8 else contextlib.nullcontext()
    with trace.phase("forward"), trace.saving(), torch_autocast, fp8_autocast:
        loss = net(**batch).loss
    after_forward = trace.snapshot()
    with trace.phase("backward"):
        loss.backward()
    del loss
    with trace.phase("optimizer step"):
        clear_weight_caches(net)  # as FP8Training.before_optimizer_step: the stale FP8 copies go
        optimizer.step()
        trace.mark_optimizer_states(optimizer)
        optimizer.zero_grad(set_to_none=True)
    with trace.phase("scale update"):
        if fp8:
            update_pending_scales(net)
    return after_forward


def category_table(estimates: list[MemoryEstimate]) -> list[tuple[str, list[int]]]:
    """Rows ``(category, bytes per estimate)`` at each estimate's peak, the empty categories left out."""
    return [(name, [e.peak.categories[name] for e in estimates]) for name in CATEGORIES
            if any(e.peak.categories[name] for e in estimates)]
