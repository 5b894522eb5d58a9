"""One run of the model table: a Llama-style model trained in a plain loop, in this process.

The loop is the one an Accelerate or Lightning user's step runs, written out with the public API:

- ``bf16-mixed``: the forward under ``torch.autocast(device, bfloat16)``;
- ``fp8-hybrid``: ``fp8_plugin.convert_model`` with the ``"fp8-hybrid"`` recipe (``AutoRecipe``,
  HYBRID: delayed scaling on Hopper), the forward under torch autocast and
  ``fp8_plugin.autocast()``; before the optimizer step each ``FP8Linear`` drops its cached FP8
  weight copies (the step makes them stale), after it ``fp8_plugin.update_pending_scales`` turns
  the step's amaxes into scales (compiled and graphed forwards leave that to the loop), as
  ``fp8_plugin.training.core.FP8Training`` does for Lightning and Accelerate;
- ``torchao-tensorwise``: torchao's tensorwise ``Float8Linear`` (``convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name("tensorwise")``) on the same layers (every
  ``nn.Linear`` but ``lm_head``), under torch autocast.

Modes: ``eager``; ``compiled`` (``torch.compile(model)``, defaults); ``graphs`` (the decoder
layers captured as CUDA graphs by ``fp8_plugin.make_graphed_callables``: :mod:`.cuda_graphs`).
AdamW over FP32 master weights, one fixed batch of random tokens. The first ``warmup`` steps are
not timed (compilation, graph capture, the first casts); the step time is the median of the
others, each from the start of the step to its end, optimizer step included, the device
synchronised; the peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from transformers import LlamaForCausalLM

import fp8_plugin
from fp8_plugin.modules.speed_rule import gpu_rates
from fp8_plugin.numerics.kernels import force_gemm_kernel

from . import cuda_graphs
from .common import RECIPES, describe_error, graph_break_reasons, peak_memory_bytes, release_memory, synchronize, timed
from . import models
from .models import LR, MODEL_SIZES, random_batch

# name -> LlamaConfig fields: the suite's sizes and one block of an 8B model (Llama 3 8B's
# hidden and MLP sizes and heads, one layer, a small vocabulary: the GEMMs of an 8B model at a
# fraction of its memory).
SIZES: dict[str, dict[str, int]] = {
    **MODEL_SIZES,
    "8b-block": dict(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=32000),
}
PRECISIONS = ("bf16-mixed", "fp8-hybrid", "torchao-tensorwise")
# "eager-triton": eager, the per-tensor GEMMs on the Triton GEMM (numerics/kernels/scaled_gemm.py).
MODES = ("eager", "compiled", "graphs", "eager-triton")
# The (precision, mode) pairs of each model, in the table's order; the first is the baseline.
KINDS: tuple[tuple[str, str], ...] = (
    ("bf16-mixed", "eager"), ("bf16-mixed", "compiled"),
    ("fp8-hybrid", "eager"), ("fp8-hybrid", "eager-triton"), ("fp8-hybrid", "graphs"), ("fp8-hybrid", "compiled"),
    ("torchao-tensorwise", "compiled"), ("torchao-tensorwise", "eager"),
)
BASELINE = KINDS[0]


@dataclass(frozen=True)
class RunSpec:
    """What to run: a model size, a precision and a mode, at ``batch`` x ``seq_len`` tokens."""

    model: str
    precision: str
    mode: str
    batch: int
    seq_len: int
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    device: str  # "cuda" or "cpu"


@dataclass
class RunResult:
    """One row of the model table. ``status``: "ran", "failed", "timed out" or "not run";
    ``error`` says why for every status but "ran"."""

    model: str
    precision: str
    mode: str
    batch: int
    seq_len: int
    status: str = "not run"
    fp8_recipe: Optional[str] = None  # fp8-hybrid: the recipe it resolved to ("delayed" on an H100)
    parameters: Optional[int] = None
    linear_layers: Optional[int] = None  # nn.Linear layers of the model before any conversion
    fp8_layers: Optional[int] = None  # of those, run in FP8 (ConversionReport.swapped, or torchao's)
    step_ms: Optional[float] = None  # median of the timed steps, milliseconds
    tokens_per_s: Optional[float] = None
    peak_bytes: Optional[int] = None  # over the timed steps (None on CPU)
    speedup: Optional[float] = None  # tokens/s over the same model's bf16-mixed eager run
    memory_ratio: Optional[float] = None  # peak bytes over the same model's bf16-mixed eager run
    seconds: Optional[float] = None  # wall time of the whole run: set-up, compilation, every step
    error: Optional[str] = None
    graph_breaks: Optional[str] = None  # compiled: the most frequent graph-break reasons ("" if none)
    step_seconds: list[float] = field(default_factory=list, repr=False)  # every timed step

    @classmethod
    def of(cls, spec: RunSpec, status: str = "not run", error: Optional[str] = None) -> "RunResult":
        return cls(spec.model, spec.precision, spec.mode, spec.batch, spec.seq_len, status=status, error=error)


def build_model(size: str, device: torch.device, seq_len: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of ``SIZES[size]``, FP32, on ``device``, in training mode."""
    return models.build_model(size, device, seq_len, SIZES)


def recipe_name(recipe: fp8_plugin.Recipe) -> str:
    """The suite's name of ``recipe`` (``"delayed"``, ``"mxfp8"``...), else its class name."""
    return next((name for name, make in RECIPES.items() if isinstance(recipe, make)), type(recipe).__name__)


def _not_lm_head(module: nn.Module, name: str) -> bool:
    return name.split(".")[-1] != "lm_head"


def _torchao_convert(model: nn.Module) -> int:
    # convert_to_float8_training also patches Inductor for the whole process (a Triton FP8 store
    # workaround): the table runs each (model, mode) in a process of its own.
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=_not_lm_head,
                               config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def _convert(result: RunResult, model: nn.Module, device: torch.device) -> Optional[fp8_plugin.Recipe]:
    """Convert ``model`` for ``result.precision`` and count its FP8 layers; returns the recipe
    fp8-plugin's layers resolved to (None for the other precisions)."""
    result.linear_layers = sum(isinstance(m, nn.Linear) for m in model.modules())
    if result.precision == "torchao-tensorwise":
        result.fp8_layers = _torchao_convert(model)
    elif result.precision == "fp8-hybrid":
        recipe = fp8_plugin.AutoRecipe(fp8_format=fp8_plugin.Format.HYBRID)  # what "fp8-hybrid" means
        tokens = result.batch * result.seq_len
        # Eager: skip_small="auto", as users run it (FP8 where the GEMM time saved exceeds the host
        # time added). Graphs and compiled: no host time per layer to speak of, so FP8 where the
        # GEMMs gain on this GPU (a SpeedRule without host overhead); on a CPU every layer.
        skip_small = "auto"
        rates = gpu_rates(device) if device.type == "cuda" else None
        if result.mode in ("graphs", "compiled") and rates is not None:
            skip_small = fp8_plugin.SpeedRule(rates, host_overhead_us=0.0, tokens=tokens, source="no host time per layer")
        report = fp8_plugin.convert_model(model, recipe, device=device, skip_small=skip_small, tokens_per_step=tokens)
        result.fp8_recipe = recipe_name(report.recipe)
        result.fp8_layers = len(report.swapped)
        return report.recipe
    return None


def make_step(spec: RunSpec, result: RunResult, device: torch.device) -> Callable[[], None]:
    """Build, convert (and compile or graph) the model; return one training step of it."""
    model = build_model(spec.model, device, spec.seq_len)
    result.parameters = sum(p.numel() for p in model.parameters())
    recipe = _convert(result, model, device)
    fp8 = recipe is not None
    fp8_layers = [m for m in model.modules() if isinstance(m, fp8_plugin.FP8Linear)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = random_batch(SIZES[spec.model]["vocab_size"], spec.batch, spec.seq_len, device)
    # CUDA graphs replay what was captured: no autocast cache of casts made outside the capture.
    graphs = spec.mode == "graphs"

    def contexts() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not graphs))
        if fp8:
            stack.enter_context(fp8_plugin.autocast())
        return stack

    if graphs:
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            loss_of = cuda_graphs.graphed_loss(model, batch, recipe)
    else:
        run = torch.compile(model) if spec.mode == "compiled" else model

        def loss_of() -> torch.Tensor:
            return run(**batch).loss

    def step() -> None:
        with contexts():
            loss = loss_of()
        loss.backward()
        for layer in fp8_layers:  # the optimizer step makes the cached FP8 weight copies stale
            layer.clear_weight_cache()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8:
            fp8_plugin.update_pending_scales(model)

    return step


def _reset_peak(device: torch.device) -> None:
    # Not release_memory(): emptying the cache would make the first timed step allocate afresh.
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def measure(spec: RunSpec) -> RunResult:
    """Run ``spec`` here; an error (out of memory, a missing API) is recorded, not raised."""
    device = torch.device(spec.device)
    result = RunResult.of(spec)
    began = time.perf_counter()
    release_memory(device)
    try:
        with force_gemm_kernel("triton" if spec.mode == "eager-triton" else "torch"):
            _run_steps(spec, result, device)
    except Exception as err:  # noqa: BLE001  (reported in the table; the other runs go on)
        result.status, result.error = "failed", describe_error(err)
    result.seconds = time.perf_counter() - began
    release_memory(device)
    return result


def _run_steps(spec: RunSpec, result: RunResult, device: torch.device) -> None:
    # measure()'s steps of one run into ``result``; raises what the run raises.
    step = make_step(spec, result, device)
    for _ in range(spec.warmup):
        step()
    _reset_peak(device)
    result.step_seconds = [timed(step, device) for _ in range(spec.steps)]
    result.step_ms = statistics.median(result.step_seconds) * 1e3
    result.tokens_per_s = spec.batch * spec.seq_len / (result.step_ms / 1e3)
    result.peak_bytes = peak_memory_bytes(device)
    result.status, result.error = "ran", None
    if spec.mode == "compiled":
        result.graph_breaks = graph_break_reasons()
