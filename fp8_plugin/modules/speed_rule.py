"""Which linear layers FP8 makes faster on a GPU: the GEMM time a layer saves against the host time it adds.

An FP8 layer's training step runs three FP8 GEMMs (fprop, dgrad, wgrad) in place of three BF16
ones, plus three casts, and costs the host more than ``nn.Linear`` does (more launches and more
Python per step). Where a model's step waits on the host, as the models people fine-tune do in
eager mode (their layers' GEMMs take tens of microseconds), that host time adds to the step as
it is; so a layer runs in FP8 only where the GPU time it saves exceeds the host time it adds:

- **GPU time saved** per step at ``tokens`` tokens (M), ``in_features`` (K), ``out_features`` (N):
  ``6 M K N`` FLOPs at the device's achieved BF16 rate, less the same at its achieved FP8 rate,
  less the casts' bytes at its memory bandwidth (input, weight and grad_output read once, their
  FP8 copies written twice; the weight's BF16 copy, which BF16 autocast makes too, not counted).
  The rates are datasheet peaks (:data:`GPU_RATES`, dense, without sparsity) times the achieved
  fractions :data:`ACHIEVED_BF16` and :data:`ACHIEVED_FP8`: the H200 measurement of this project
  (FP8Linear 16384 x 8192 x 8192, delayed scaling, 1.60x BF16 eagerly, docs/benchmarks.md, run 3)
  with BF16 GEMMs at 70% of peak gives FP8 GEMMs at 60% of theirs.
- **Host time added** per layer step: measured once per process, device and recipe kind
  (:func:`measured_host_overhead_us`), as a model pays it: the step of a chain of FP8 layers (each
  reading the previous one's output, one autocast, one backward, one scale update) less that of
  the same chain of ``nn.Linear`` under BF16 autocast, per layer, on shapes small enough that the
  GPU waits for the host. A one-layer step would charge one layer with the step's fixed costs and
  the whole scale update.
  Zero where the layers run in CUDA graphs (``host_overhead_us=0``): a graph's replay costs the
  host one launch for the whole of it.

The rule assumes the step is host-bound, which is where FP8 made training slower; where the GPU
is the bottleneck it keeps some layers in BF16 that would have gained. ``convert_model(skip_small=
"auto")`` applies it on GPUs and says, per layer kept in BF16, the two figures that decided.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..numerics.device import recipe_gemm_kind
from ..numerics.device_kind import cuda_capability, device_kind
from ..numerics.kernels import gemm_kernel
from ..numerics.recipes import DelayedScaling, Recipe

__all__ = ["size_rule", "too_small_for_fp8", "GPU_RATES", "ACHIEVED_BF16", "ACHIEVED_FP8", "DEFAULT_TOKENS", "GpuRates", "SpeedRule", "gpu_rates",
           "measured_host_overhead_us", "CHAIN_LAYERS", "chain_steps"]

# Tokens per training step a layer is judged at when the caller gives none: a micro-batch of 4
# sequences of 2048 (convert_model(tokens_per_step=...) to judge at the run's own).
DEFAULT_TOKENS = 8192
ACHIEVED_BF16 = 0.70
ACHIEVED_FP8 = 0.60


@dataclass(frozen=True)
class GpuRates:
    """Datasheet peaks of one GPU: dense BF16 and FP8 tensor-core TFLOP/s, HBM GB/s."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float


# NVIDIA's datasheets, dense (the "with sparsity" figures halved). Matched by a substring of
# torch.cuda.get_device_name, first match wins.
GPU_RATES = (
    GpuRates("H200", 989.5, 1979.0, 4800.0),
    GpuRates("H100 PCIe", 756.0, 1513.0, 2000.0),
    GpuRates("H100 NVL", 835.0, 1671.0, 3900.0),
    GpuRates("H100", 989.5, 1979.0, 3350.0),
    GpuRates("H20", 148.0, 296.0, 4000.0),
    GpuRates("GB200", 2500.0, 5000.0, 8000.0),
    GpuRates("B200", 2250.0, 4500.0, 7700.0),
    GpuRates("L40S", 362.0, 733.0, 864.0),
    GpuRates("L4", 121.0, 242.5, 300.0),
)
# By compute capability where the name is unknown: the family's data-centre part.
_BY_CAPABILITY = {(9, 0): "H100", (10, 0): "B200", (8, 9): "L40S"}


def gpu_rates(device: torch.device, name: Optional[str] = None) -> Optional[GpuRates]:
    """The rates of ``device`` (a CUDA device, or meta presented as one), by ``name`` (default
    ``torch.cuda.get_device_name``; a meta device has none) or else by compute capability; None
    for a GPU without FP8 tensor cores or an unknown one."""
    if name is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    for rates in GPU_RATES:
        if name and rates.name in name:
            return rates
    family = _BY_CAPABILITY.get(cuda_capability(device))
    return next((r for r in GPU_RATES if r.name == family), None)


@dataclass(frozen=True)
class SpeedRule:
    """Whether FP8 makes a linear layer's training step faster (module docstring).

    Args:
        rates: the GPU's peaks.
        host_overhead_us: host time an FP8 layer step adds over a BF16 one, µs (0 in CUDA graphs).
        tokens: tokens per step (M) the layers are judged at.
        source: where ``host_overhead_us`` comes from, for the report ("measured on cuda:0").

    Call it with ``(in_features, out_features)``: ``""`` where FP8 is faster, else why not.
    """

    rates: GpuRates
    host_overhead_us: float
    tokens: int = DEFAULT_TOKENS
    source: str = "measured"

    def gpu_saving_us(self, in_features: int, out_features: int) -> float:
        """GPU time FP8 saves on one training step of a layer, µs (negative: it costs)."""
        m, k, n = self.tokens, in_features, out_features
        flops = 6.0 * m * k * n
        bf16_us = flops / (self.rates.bf16_tflops * ACHIEVED_BF16 * 1e6)
        fp8_us = flops / (self.rates.fp8_tflops * ACHIEVED_FP8 * 1e6)
        # Input (BF16) and grad_output (BF16) read once, each written as two FP8 copies; the FP32
        # weight read once, written as two FP8 copies (BF16 autocast reads it and writes a BF16
        # copy: those 6 bytes per value it pays too).
        cast_bytes = (m * k * (2 + 2) + m * n * (2 + 2) + k * n * (4 + 2)) - k * n * (4 + 2)
        return bf16_us - fp8_us - cast_bytes / (self.rates.hbm_gbps * 1e3)

    def __call__(self, in_features: int, out_features: int) -> str:
        saving = self.gpu_saving_us(in_features, out_features)
        if saving > self.host_overhead_us:
            return ""
        return (f"FP8 would save {saving:.0f} µs of GPU time per step at {self.tokens} tokens ({self.rates.name}, "
                f"projected), less than the {self.host_overhead_us:.0f} µs of host time it adds ({self.source})")


def measured_host_overhead_us(device: torch.device, recipe: Optional[Recipe] = None) -> float:
    """Host time one ``FP8Linear`` adds to a model's training step over an ``nn.Linear`` under
    BF16 autocast, µs.

    Measured once per process, device, GEMM kind of ``recipe`` (default delayed scaling) and GEMM
    kernel (:func:`~fp8_plugin.numerics.kernels.gemm_kernel`) on a chain of :data:`CHAIN_LAYERS`
    layers, 512 tokens x 256 -> 384 -> 256 ... (GPU kernels of a few microseconds: the GPU waits
    for the host), each layer reading the previous one's output, the FP8 layers in one scaling
    group (one scale update per step, as a converted model has): the two chains' step times'
    difference over the layer count, each the fastest of 3 runs of 20 steps after 5 untimed ones,
    each run ended by one synchronisation.
    If ``torch.distributed`` is initialized, the ranks' figures are reduced to their maximum (one
    collective), so that every rank decides alike.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    if device_kind(device) != "cuda" or device.type != "cuda":
        raise ValueError(f"measured_host_overhead_us(device={device}) measures a CUDA GPU; valid: a cuda device")
    recipe = recipe if recipe is not None else DelayedScaling()
    key = (device, recipe_gemm_kind(recipe), gemm_kernel())  # the Triton GEMM's host time is its own
    if key not in _measured:
        _measured[key] = _measure(device, recipe)
    overhead = _measured[key]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # On the device for NCCL, on the host for the CPU backends (gloo).
        on = device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        figure = torch.tensor([overhead], device=on)
        torch.distributed.all_reduce(figure, op=torch.distributed.ReduceOp.MAX)
        overhead = float(figure.item())
    return overhead


# Host overheads measured in this process, by (device, GEMM kind of the recipe, GEMM kernel).
_measured: dict[tuple[torch.device, str, str], float] = {}


# Layers in the chain the host overhead is measured on (an even count: 256 -> 384, 384 -> 256).
CHAIN_LAYERS = 8


def _measure(device: torch.device, recipe: Recipe) -> float:
    fp8_step, bf16_step = chain_steps(device, recipe)
    return max(0.0, (_step_us(fp8_step, device) - _step_us(bf16_step, device)) / CHAIN_LAYERS)


def chain_steps(device: torch.device, recipe: Recipe, *, layers: int = CHAIN_LAYERS, tokens: int = 512,
                features: tuple[int, int] = (256, 384), mixed: bool = True
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Training steps of a chain of FP8 layers and of the same chain of ``nn.Linear``, as a model's
    blocks run them: each layer reads the previous one's output (``features[0] -> features[1] ->
    features[0]`` ...), one FP8 autocast, one backward, the gradients reset; the FP8 layers in one
    scaling group (one scale update per step, as a converted model has). What the host time a
    layer adds to a model's step is measured on (here and in ``benchmarks/host_profile.py``).

    Args:
        device: where the layers and the BF16 input ``[tokens, features[0]]`` live.
        recipe: the FP8 layers' recipe.
        layers: how many layers each chain has.
        mixed: FP32 weights under BF16 torch autocast (bf16-mixed, default); False: BF16 weights
            and no torch autocast.

    Returns:
        ``(fp8_step, bf16_step)``, callables of no argument.
    """
    from .autocast import autocast
    from .linear import FP8Linear
    from .scaling_group import ScalingGroup

    k, n = features
    dtype = torch.float32 if mixed else torch.bfloat16
    widths = [(k, n) if i % 2 == 0 else (n, k) for i in range(layers)]
    fp8 = nn.Sequential(*[FP8Linear(a, b, bias=False, device=device, dtype=dtype, recipe=recipe) for a, b in widths])
    group = ScalingGroup()
    for layer in fp8:
        group.add(layer)
    bf16 = nn.Sequential(*[nn.Linear(a, b, bias=False, device=device, dtype=dtype) for a, b in widths])
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, widths[-1][1], device=device, dtype=torch.bfloat16)
    kind = device_kind(device)

    def step(model: nn.Module, fp8_context: bool) -> Callable[[], None]:
        weights = list(model.parameters())  # listed once: a walk of the modules is no layer's work

        def run() -> None:
            with (torch.autocast(kind, dtype=torch.bfloat16) if mixed else nullcontext()), \
                    (autocast(recipe=recipe) if fp8_context else nullcontext()):
                out = model(x)
            out.backward(grad)
            for weight in weights:
                weight.grad = None
            x.grad = None
        return run

    return step(fp8, True), step(bf16, False)


def _step_us(step, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        step()
    runs = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for _ in range(20):
            step()
        sync()
        runs.append((time.perf_counter() - start) / 20 * 1e6)
    return min(runs)


# Below these sizes an FP8 linear layer's forward and backward are slower than BF16 on an H100:
# the casts cost more than the faster GEMMs save. torchao's measurements on H100 (the tables of
# torchao/float8/README.md, "Performance", behind its _auto_filter_for_recipe): with one scale
# per tensor FP8 loses when K <= 4096 and N <= 1024; with finer scales (rowwise there; MXFP8 and
# 128-blockwise here, whose casts cost at least as much) when N <= 2048, K <= 1024, or
# N <= 4096 and K <= 2048. benchmarks/suite.py measures this project's layers on the GPU at hand.
def too_small_for_fp8(in_features: int, out_features: int, recipe: Optional[Recipe] = None) -> bool:
    """Whether a linear layer of ``in_features`` (K) x ``out_features`` (N) is too small for FP8
    to beat BF16 on an H100-class GPU under ``recipe`` (default ``DelayedScaling()``).

    Source: torchao's H100 measurements (see the comment above this function in
    ``fp8_plugin/modules/convert.py``). Token count is not a criterion: it varies per batch, and the
    layers of a model keep one precision.
    """
    k, n = in_features, out_features
    if recipe is None or recipe_gemm_kind(recipe) == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def size_rule(skip_small: Any, recipe: Recipe, target: torch.device,
              tokens_per_step: Optional[int]) -> Optional[Callable[[int, int], str]]:
    """``convert_model``'s ``skip_small`` and ``tokens_per_step`` for ``recipe`` on ``target`` as a
    rule ``(in_features, out_features) -> ""`` (swap it) or the reason the layer stays high
    precision; None: no rule. The values: :func:`~fp8_plugin.modules.convert.convert_model`.

    Raises:
        TypeError: ``skip_small`` is none of "auto", a bool, a callable.
        ValueError: ``tokens_per_step`` is not None or a positive int.
    """
    if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int)
                                        or tokens_per_step < 1):
        raise ValueError(f"convert_model: tokens_per_step={tokens_per_step!r} is not valid; valid: None or a "
                         "positive int (the tokens of one training step's micro-batch)")
    table_reason = f"too small for FP8 to be faster on {target.type} (skip_small)"
    if callable(skip_small):
        def rule(k: int, n: int) -> str:
            verdict = skip_small(k, n)
            return verdict if isinstance(verdict, str) else (table_reason if verdict else "")
        return rule
    if isinstance(skip_small, bool) or skip_small == "auto":
        if skip_small is False or (skip_small == "auto" and device_kind(target) == "cpu"):
            return None
        rates = gpu_rates(target) if skip_small == "auto" and target.type == "cuda" else None
        if rates is not None:  # a real GPU: its GEMM time saved against the host time FP8 adds, measured
            return SpeedRule(rates, measured_host_overhead_us(target, recipe), tokens_per_step or DEFAULT_TOKENS,
                             f"measured on {target}")
        return lambda k, n: table_reason if too_small_for_fp8(k, n, recipe) else ""
    raise TypeError(
        f"convert_model: skip_small={skip_small!r} is not valid; valid: 'auto', True, False, or a callable "
        "(in_features, out_features) -> bool or reason (a SpeedRule)"
    )
