"""Layer level: one linear layer's forward + backward, FP8 against BF16, over LLM shapes.

Each variant runs a training iteration as the integrations run it: the forward under
``torch.autocast(bfloat16)`` (and, for ``FP8Linear``, :func:`fp8_plugin.autocast` with the
recipe nested inside it), the backward after it, the gradients dropped. FP32 master weights,
a BF16 input that needs its gradient, no bias (as in Llama). Every iteration is a training step of
its own: delayed scaling updates its scales at each, and ``FP8Linear``'s cached FP8 weight copies
are dropped as a training loop drops them before each optimizer step.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

import fp8_plugin
import fp8_plugin.numerics.gemm as fp8_gemm_module
from fp8_plugin.numerics.kernels import force_gemm_kernel

from .common import RECIPES, describe_error, peak_memory_bytes, release_memory, scaled_mm_too_slow, synchronize

# (M tokens, K in_features, N out_features)
Shape = tuple[int, int, int]

LLM_PAIRS = ((2048, 2048), (4096, 4096), (8192, 8192), (4096, 14336), (14336, 4096))
SHAPES: dict[str, list[Shape]] = {
    "cuda": [(m, k, n) for m in (4096, 8192, 16384) for k, n in LLM_PAIRS],
    # BF16 matmuls run at ~1 GFLOP/s on CPUs without AVX512-BF16 or AMX: small shapes.
    "cpu": [(m, k, n) for m in (256, 1024) for k, n in ((256, 256), (512, 512), (256, 1024), (1024, 256))],
}
QUICK_SHAPES: dict[str, list[Shape]] = {
    "cuda": [(4096, 4096, 4096), (16384, 8192, 8192)],
    "cpu": [(256, 256, 256), (256, 512, 512)],
}
# The GPU target's shape: FP8Linear fwd+bwd >= 1.7x BF16 there.
TARGET_SHAPE: Shape = (16384, 8192, 8192)
TARGET_SPEEDUP = 1.7
BASELINE = "bf16"
TORCHAO = "torchao"
# The per-tensor recipes again with the Triton GEMM (numerics/kernels/scaled_gemm.py) in place of
# torch._scaled_mm: eagerly, on a CUDA GPU.
TRITON_GEMM = {"delayed+triton": "delayed", "current+triton": "current"}
# BF16 first (the baseline), each recipe, the Triton GEMM's, then torchao's Float8Linear (where it imports).
VARIANTS = (BASELINE, *RECIPES, *TRITON_GEMM, TORCHAO)


@dataclass
class LayerResult:
    """One variant at one shape: ``ms`` per forward + backward (None when it could not run)."""

    m: int
    k: int
    n: int
    variant: str
    compiled: bool
    ms: Optional[float] = None
    speedup: Optional[float] = None  # BF16 ms / this ms, against the BF16 run of the same mode
    peak_bytes: Optional[int] = None
    gemm_path: Optional[str] = None  # FP8Linear in eager mode: "native", "emulated", "mixed (i/n native)"
    recompiles: Optional[int] = None  # compiled: graphs compiled during the timed iterations (0 expected)
    error: Optional[str] = None


def _torchao_layer(k: int, n: int, device: torch.device) -> nn.Module:
    # torchao's tensorwise Float8Linear (dynamic scaling, its default config).
    from torchao.float8 import convert_to_float8_training

    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device))
    convert_to_float8_training(model)
    return model


def _make_layer(variant: str, k: int, n: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if variant == BASELINE:
        return nn.Linear(k, n, bias=False, device=device)
    if variant == TORCHAO:
        return _torchao_layer(k, n, device)
    return fp8_plugin.FP8Linear(k, n, bias=False, device=device, recipe=RECIPES[TRITON_GEMM.get(variant, variant)]())


def _iteration(layer: nn.Module, run: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One training iteration of ``run`` (``layer`` itself or its compiled form); an FP8Linear
    runs inside ``fp8_plugin.autocast`` with its recipe."""
    device_type = x.device.type
    fp8 = isinstance(layer, fp8_plugin.FP8Linear)

    def step() -> None:
        context = fp8_plugin.autocast(recipe=layer.recipe) if fp8 else contextlib.nullcontext()
        with torch.autocast(device_type, dtype=torch.bfloat16), context:
            out = run(x)
        out.backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if fp8:
            layer.clear_weight_cache()

    return step


def _seconds_per_iteration(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """GPU: the mean over ``steps`` back-to-back iterations (CUDA events). CPU: the median of
    the iterations timed one by one, which other processes on the machine disturb least."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


@contextlib.contextmanager
def _counting_gemm_paths() -> Iterator[Optional[dict[str, int]]]:
    """Counts the FP8 GEMMs that took the native kernel and the float32 emulation, by wrapping
    the two private functions ``fp8_plugin.numerics.gemm.fp8_gemm`` dispatches to (None if they moved)."""
    names = {"native": "_native", "emulated": "_emulated"}
    if not all(hasattr(fp8_gemm_module, name) for name in names.values()):
        yield None
        return
    counts = dict.fromkeys(names, 0)
    originals = {path: getattr(fp8_gemm_module, name) for path, name in names.items()}

    def counting(path: str) -> Callable:
        def wrapper(*args, **kwargs):
            counts[path] += 1
            return originals[path](*args, **kwargs)
        return wrapper

    for path, name in names.items():
        setattr(fp8_gemm_module, name, counting(path))
    try:
        yield counts
    finally:
        for path, name in names.items():
            setattr(fp8_gemm_module, name, originals[path])


def _gemm_path(step: Callable[[], None]) -> Optional[str]:
    """Which path the FP8 GEMMs of one more iteration took."""
    with _counting_gemm_paths() as counts:
        step()
    if not counts:
        return None
    total = counts["native"] + counts["emulated"]
    if counts["emulated"] == 0:
        return "native"
    if counts["native"] == 0:
        return "emulated"
    return f"mixed ({counts['native']}/{total} native)"


def _compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure(shape: Shape, variant: str, compiled: bool, steps: int, warmup: int, device: torch.device) -> LayerResult:
    """Time one variant at one shape; an error (a variant this device cannot run) is recorded."""
    m, k, n = shape
    result = LayerResult(m, k, n, variant, compiled)
    if variant in TRITON_GEMM and (device.type != "cuda" or compiled):
        result.error = "the Triton GEMM runs eagerly on CUDA GPUs"
        return result
    release_memory(device)
    gemm_kernel = force_gemm_kernel("triton" if variant in TRITON_GEMM else "torch")
    try:
        with gemm_kernel:
            _measure_into(result, variant, compiled, steps, warmup, device)
    except Exception as err:  # noqa: BLE001  (a variant the device cannot run is reported, not fatal)
        result.error = describe_error(err)
    return result


def _measure_into(result: LayerResult, variant: str, compiled: bool, steps: int, warmup: int,
                  device: torch.device) -> None:
    # measure()'s timing of one variant into ``result``; raises what the variant raises.
    m, k, n = result.m, result.k, result.n
    layer = _make_layer(variant, k, n, device)
    run = layer
    if compiled:
        torch._dynamo.reset()  # each variant compiles afresh, with the whole recompile limit
        run = torch.compile(layer, fullgraph=True, dynamic=False)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
    step = _iteration(layer, run, x, grad)
    for _ in range(warmup):
        step()
    synchronize(device)
    release_memory(device)  # the peak of the timed iterations alone
    graphs = _compiled_graphs()
    result.ms = _seconds_per_iteration(step, steps, device) * 1e3
    result.peak_bytes = peak_memory_bytes(device)
    if compiled:
        result.recompiles = _compiled_graphs() - graphs
    if variant in TRITON_GEMM:
        result.gemm_path = "triton"
    elif variant in RECIPES and not compiled:
        result.gemm_path = _gemm_path(step)


def torchao_status() -> Optional[str]:
    """None when ``torchao.float8`` imports, else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as err:  # noqa: BLE001  (any import failure means: skipped)
        return f"torchao not usable: {type(err).__name__}: {err}"
    return None


def run(shapes: list[Shape], steps: int, warmup: int, device: torch.device, compile_shapes: list[Shape],
        log: Callable[[str], None], compile_variants: Optional[list[str]] = None) -> dict:
    """Every variant at every shape (and compiled at ``compile_shapes``: ``compile_variants``, or
    all), with speed-ups."""
    torchao_skip = torchao_status() or scaled_mm_too_slow(device)
    results: list[LayerResult] = []
    plan = [(shape, False) for shape in shapes] + [(shape, True) for shape in compile_shapes]
    for shape, compiled in plan:
        baseline = None
        for variant in VARIANTS:
            if compiled and compile_variants is not None and variant not in compile_variants:
                continue
            if variant == TORCHAO and torchao_skip:
                results.append(LayerResult(*shape, variant, compiled, error=torchao_skip))
                continue
            result = measure(shape, variant, compiled, steps, warmup, device)
            if variant == BASELINE:
                baseline = result.ms
            elif baseline and result.ms:
                result.speedup = baseline / result.ms
            results.append(result)
            log(f"layer {'x'.join(map(str, shape))} {variant}{' compiled' if compiled else ''}: "
                + (f"{result.ms:.3f} ms" if result.ms else f"skipped ({result.error})"))
    support = fp8_plugin.describe_device(device)
    return {
        "shapes": [list(s) for s in shapes],
        "compile_shapes": [list(s) for s in compile_shapes],
        "steps": steps,
        "warmup": warmup,
        "recipe_support": [asdict(r) for r in support.recipes],
        "gemm_paths_cpu": support.gemm_paths,
        "results": [asdict(r) for r in results],
    }
