"""Model level: training steps of Llama-style models, FP8 against BF16, through each loop.

Models are built from ``transformers.LlamaConfig`` with random weights (nothing downloaded) in
FP32 (the master weights), trained with AdamW on one fixed batch of random tokens. Per model:

- Lightning: ``Trainer(precision="fp8-hybrid")`` against ``precision="bf16-mixed"``, and
  torchao's tensorwise ``Float8Linear`` (``convert_to_float8_training``, the same layers as
  fp8-plugin converts) under ``bf16-mixed``;
- Accelerate: ``fp8_plugin.accelerate.Accelerator(mixed_precision="fp8")`` against
  ``mixed_precision="bf16"``.

The first ``warmup`` steps are not timed; the step time is the median of the others, each timed
from the start of the step to its end (optimizer step included), the device synchronised.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from .common import describe_error, peak_memory_bytes, release_memory, scaled_mm_too_slow, set_ratios, synchronize

# name -> LlamaConfig fields
MODEL_SIZES: dict[str, dict[str, int]] = {
    # ~7M parameters: BF16 matmuls are ~100x slower than FP32 on CPUs without AVX512-BF16 / AMX.
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=8192),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, vocab_size=32000),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32000),
}
DEFAULT_MODELS = {"cuda": ["125m", "1b"], "cpu": ["tiny"]}
# (batch, sequence length) per device type
DEFAULT_BATCH = {"cuda": (8, 2048), "cpu": (2, 64)}
LR = 1e-4

# The runs of each model: (loop, precision); ratios are taken within a loop.
LIGHTNING_RUNS = (("lightning", "bf16-mixed"), ("lightning", "fp8-hybrid"), ("lightning", "torchao"))
ACCELERATE_RUNS = (("accelerate", "bf16"), ("accelerate", "fp8"))
BASELINES = {"lightning": "bf16-mixed", "accelerate": "bf16"}


@dataclass
class ModelResult:
    """One training run: its median step time, throughput and peak memory."""

    model: str
    parameters: int
    loop: str
    precision: str
    batch: int
    seq_len: int
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_bytes: Optional[int] = None
    fp8_layers: Optional[int] = None  # layers running in FP8 (fp8-plugin's or torchao's)
    speedup: Optional[float] = None  # tokens/s over the same loop's BF16 run
    memory_ratio: Optional[float] = None  # peak memory over the same loop's BF16 run
    error: Optional[str] = None


def build_model(size: str, device: torch.device, seq_len: int,
                sizes: Optional[dict[str, dict[str, int]]] = None) -> LlamaForCausalLM:
    """A randomly initialised Llama of ``(sizes or MODEL_SIZES)[size]``, FP32, on ``device``, in training mode."""
    torch.manual_seed(0)
    config = LlamaConfig(**(sizes or MODEL_SIZES)[size], max_position_embeddings=max(2048, seq_len))
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.train()


def parameter_count(size: str) -> int:
    """Parameters of a model of ``size`` (built on the meta device: no memory, no time)."""
    return sum(p.numel() for p in build_model(size, torch.device("meta"), 2048).parameters())


def random_batch(vocab: int, batch: int, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens, their own labels (the model shifts them)."""
    ids = torch.randint(vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}


def torchao_convert(model: nn.Module) -> int:
    """torchao's tensorwise ``Float8Linear`` for the layers fp8-plugin converts by default (every
    ``nn.Linear`` but the output head), in place; returns how many were converted."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda module, name: name.split(".")[-1] != "lm_head")
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


class CausalLM(L.LightningModule):
    """A causal language model trained on its own labels with AdamW."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


class StepClock(L.Callback):
    """Wall time of each training step (forward, backward, optimizer step), device synchronised."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        synchronize(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self._start)


def quiet_lightning() -> None:
    """Keep Lightning's start-up messages and its warnings about this synthetic set-up (one
    fixed batch, no loader workers, no logger) out of the output."""
    for name in ("lightning.pytorch", "lightning.fabric", "fp8_plugin"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in ("The '?train_dataloader'? does not have many workers", ".*smaller than the logging interval",
                    ".*`max_epochs` was not set"):
        warnings.filterwarnings("ignore", message=message)


def lightning_trainer(device: torch.device, steps: int, callbacks: list, **flags) -> L.Trainer:
    """A Trainer for ``steps`` steps on one device, without checkpoints, logger or progress bar
    unless ``flags`` say otherwise."""
    settings = dict(logger=False, enable_checkpointing=False, enable_model_summary=False,
                    enable_progress_bar=False, num_sanity_val_steps=0)
    settings.update(flags)
    return L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=steps,
                     callbacks=callbacks, **settings)


def _lightning(result: ModelResult, precision: str, batch: dict, steps: int, device: torch.device) -> list[float]:
    model = build_model(result.model, device, result.seq_len)
    if precision == "torchao":
        result.fp8_layers = torchao_convert(model)
    clock = StepClock(device)
    trainer = lightning_trainer(device, steps, [clock],
                                precision="bf16-mixed" if precision == "torchao" else precision)
    trainer.fit(CausalLM(model), DataLoader([batch] * steps, batch_size=None))
    report = getattr(trainer.precision_plugin, "report", None)
    if report is not None:
        result.fp8_layers = len(report.swapped)
    return clock.seconds


def _accelerate(result: ModelResult, precision: str, batch: dict, steps: int, device: torch.device) -> list[float]:
    from accelerate.state import AcceleratorState, GradientState

    from fp8_plugin.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
    try:
        model = build_model(result.model, device, result.seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
        if accelerator.fp8_reports:
            result.fp8_layers = len(accelerator.fp8_reports[0].swapped)
        seconds = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        accelerator.free_memory()
        # Accelerate keeps one process-wide state; the next run starts its own.
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


RUNNERS: dict[str, Callable[..., list[float]]] = {"lightning": _lightning, "accelerate": _accelerate}


def measure(size: str, loop: str, precision: str, batch_size: int, seq_len: int, steps: int, warmup: int,
            device: torch.device) -> ModelResult:
    """One training run; an error (out of memory, torchao missing) is recorded, not raised."""
    result = ModelResult(size, parameter_count(size), loop, precision, batch_size, seq_len)
    release_memory(device)
    try:
        batch = random_batch(MODEL_SIZES[size]["vocab_size"], batch_size, seq_len, device)
        seconds = RUNNERS[loop](result, precision, batch, warmup + steps, device)[warmup:]
        result.step_ms = statistics.median(seconds) * 1e3
        result.tokens_per_s = batch_size * seq_len / (result.step_ms / 1e3)
        result.peak_bytes = peak_memory_bytes(device)
    except Exception as err:  # noqa: BLE001  (reported in the table; the other runs go on)
        result.error = describe_error(err)
    release_memory(device)
    return result


def _ratios(results: list[ModelResult]) -> None:
    set_ratios(results, lambda r: (r.model, r.loop), lambda r: r.precision == BASELINES[r.loop])


def run(sizes: list[str], batch_size: int, seq_len: int, steps: int, warmup: int, device: torch.device,
        log: Callable[[str], None]) -> dict:
    """Every run of every model size, with ratios against the same loop's BF16 run."""
    quiet_lightning()
    results = []
    torchao_skip = scaled_mm_too_slow(device)
    for size in sizes:
        for loop, precision in LIGHTNING_RUNS + ACCELERATE_RUNS:
            if precision == "torchao" and torchao_skip:
                result = ModelResult(size, parameter_count(size), loop, precision, batch_size, seq_len,
                                     error=torchao_skip)
            else:
                result = measure(size, loop, precision, batch_size, seq_len, steps, warmup, device)
            results.append(result)
            log(f"model {size} {loop} {precision}: "
                + (f"{result.step_ms:.1f} ms/step" if result.step_ms else f"failed ({result.error})"))
    _ratios(results)
    return {"sizes": {s: MODEL_SIZES[s] for s in sizes}, "batch": batch_size, "seq_len": seq_len, "steps": steps,
            "warmup": warmup, "results": [asdict(r) for r in results]}
