"""Which FP8 recipes run natively on a device, and the recipe that "auto" picks there.

``python -m fp8_plugin`` prints :func:`describe_device` for this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .formats import Format
from .gemm import NATIVE_SPEEDUP_REQUIRED, native_gemm, normalize_device, tensorwise_choice
from .recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe

__all__ = ["describe_device", "DeviceReport", "RecipeSupport", "auto_recipe", "resolve_recipe", "recipe_gemm_kind",
           "default_device", "bf16_matmul_is_fast"]

Device = Union[str, torch.device, None]

# Recipe class -> (GEMM kind, scaling granularity), in the order the report lists them.
_RECIPES = {
    DelayedScaling: ("tensorwise", "per tensor, scale from an amax history"),
    Float8CurrentScaling: ("tensorwise", "per tensor, scale from the tensor itself"),
    Float8BlockScaling: ("blockwise", "1x128 / 128x128 blocks, FP32 scales"),
    MXFP8BlockScaling: ("mxfp8", "1x32 blocks, E8M0 scales"),
}


def recipe_gemm_kind(recipe: Recipe) -> str:
    """GEMM kind (``fp8_plugin.numerics.gemm.GEMM_KINDS``) a concrete recipe's layers run.

    Raises:
        TypeError: an :class:`AutoRecipe` (resolve it first) or an unknown recipe class.
    """
    for cls, (kind, _) in _RECIPES.items():
        if isinstance(recipe, cls):
            return kind
    raise TypeError(f"recipe={recipe!r} has no GEMM kind; valid: {', '.join(c.__name__ for c in _RECIPES)}")


def recipe_name(recipe: Recipe) -> str:
    """Short name for logs and reports, e.g. ``"DelayedScaling(HYBRID)"``."""
    return f"{type(recipe).__name__}({recipe.fp8_format.name})"


def default_device(device: Device = None) -> torch.device:
    """``device`` as a torch device (``"cuda"``: the current CUDA device); None means the current
    CUDA device if CUDA is available, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return normalize_device(device)


def auto_recipe(fp8_format: Union[Format, str] = Format.HYBRID, device: Device = None) -> Recipe:
    """The recipe "auto" means on ``device``: MXFP8 where its GEMMs are native, else delayed scaling.

    Per-tensor delayed scaling is the fastest recipe on Hopper and Ada (one scale per tensor,
    no extra pass over the data) and native on CPU; on Blackwell MXFP8 is native and its finer
    scales cost nothing extra (NVIDIA Transformer Engine docs, "FP8 recipes").

    Args:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        device: the training device; None as in :func:`default_device`.
    """
    target = default_device(device)
    if native_gemm("mxfp8", target).native:
        return MXFP8BlockScaling(fp8_format=fp8_format)
    return DelayedScaling(fp8_format=fp8_format)


def resolve_recipe(recipe: Optional[Recipe], device: Device = None) -> Optional[Recipe]:
    """``recipe`` itself, or for an :class:`AutoRecipe` the concrete recipe for ``device``."""
    if isinstance(recipe, AutoRecipe):
        return auto_recipe(recipe.fp8_format, device)
    return recipe


@dataclass
class RecipeSupport:
    """One recipe on one device: its GEMM kind, and whether that GEMM is native (else why not)."""

    recipe: str
    granularity: str
    gemm: str
    native: bool
    reason: str


@dataclass
class DeviceReport:
    """What :func:`describe_device` found. ``str()`` is a table."""

    device: str
    name: str
    torch_version: str
    recipes: list[RecipeSupport] = field(default_factory=list)
    auto: Optional[Recipe] = None
    # CPU: the timed choice of tensorwise GEMM path per operand pairing, e.g. "E4M3 x E4M3 ->
    # bfloat16 (forward): float32 emulation (64x128x128: _scaled_mm 0.20 ms, emulation 0.19 ms)".
    gemm_paths: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        header = ("recipe", "scaling", "GEMM", "native")
        rows = [(r.recipe, r.granularity, r.gemm, "yes" if r.native else f"no: {r.reason}") for r in self.recipes]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"{self.name} ({self.device}), torch {self.torch_version}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        lines.insert(2, "  ".join("-" * w for w in widths))
        if self.auto is not None:
            lines.append(f'recipe "auto" (precision strings fp8-hybrid / fp8-e4m3): {type(self.auto).__name__}')
        if self.gemm_paths:
            lines.append("tensorwise GEMM path per operand pairing (timed once per process):")
            lines += [f"  {p}" for p in self.gemm_paths]
        return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return device.type.upper()


def describe_device(device: Device = None) -> DeviceReport:
    """Which recipes run their GEMMs natively on ``device`` and which are emulated, and why.

    The block-scaled kinds are probed once per device with a small GEMM (see
    :func:`fp8_plugin.numerics.gemm.native_gemm`), so the first call on a GPU takes a moment. On CPU the
    tensorwise GEMM path is timed per operand pairing of a training step
    (:func:`fp8_plugin.numerics.gemm.tensorwise_choice`, a few milliseconds each, cached for the process),
    and the report lists both times and the path chosen; a tensorwise recipe counts as native
    when at least one pairing runs ``torch._scaled_mm``.

    Args:
        device: as in :func:`default_device`.

    Returns:
        A :class:`DeviceReport`; ``print()`` it for a table.
    """
    target = default_device(device)
    report = DeviceReport(str(target), _device_name(target), torch.__version__)
    timed = target.type == "cpu" and native_gemm("tensorwise", target).native
    chosen_native = []
    if timed:
        for (a, b, out, role) in _CPU_PAIRINGS:
            choice = tensorwise_choice(target, a, b, out)
            chosen_native.append(choice.native)
            report.gemm_paths.append(f"{_short(a)} x {_short(b)} -> {str(out).replace('torch.', '')} ({role}): {choice.describe()}")
    for cls, (kind, granularity) in _RECIPES.items():
        support = native_gemm(kind, target)
        native, reason = support.native, support.reason
        if kind == "tensorwise" and timed and not all(chosen_native):
            native = any(chosen_native)
            reason = (f"torch._scaled_mm measured less than {NATIVE_SPEEDUP_REQUIRED}x faster than the exact "
                      "float32 emulation here (timings below)")
        report.recipes.append(RecipeSupport(cls.__name__, granularity, kind, native, "" if native else reason))
    report.auto = auto_recipe(Format.HYBRID, target)
    return report


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The operand pairings of a training step (HYBRID and E4M3): forward under BF16 autocast and in
# float32, dgrad / wgrad with E5M2 or E4M3 gradients.
_CPU_PAIRINGS = (
    (_E4M3, _E4M3, torch.bfloat16, "forward"),
    (_E4M3, _E4M3, torch.float32, "forward fp32, E4M3 wgrad"),
    (_E5M2, _E4M3, torch.bfloat16, "HYBRID dgrad"),
    (_E5M2, _E4M3, torch.float32, "HYBRID wgrad"),
)


def _short(dtype: torch.dtype) -> str:
    return "E4M3" if dtype == _E4M3 else "E5M2"



def bf16_matmul_is_fast(device_type: str = "cpu", k: int = 384) -> tuple[bool, str]:
    """Whether BF16 matmuls on ``device_type`` are at most 2x slower than float32, and why.

    CPUs without AVX512-BF16 or AMX run BF16 matmuls through kernels tens of times slower than
    float32, so a BF16 reference run (or BF16 for the non-FP8 ops) is only sensible where this is
    True. CUDA: True without timing. Elsewhere one ``[256, k] x [k, 1536]`` matmul per dtype is
    timed (mean of 3, after a warm-up): about 1.2 GFLOP, a fraction of a second on any CPU.

    Returns:
        ``(fast, why)``, ``why`` a sentence with the timings.
    """
    if device_type == "cuda" and torch.cuda.is_available():
        return True, "CUDA GPU"
    gen = torch.Generator().manual_seed(0)  # its own stream: the caller's random numbers stay as they were
    a, b = torch.randn(256, k, generator=gen), torch.randn(k, 1536, generator=gen)
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            x @ y
        timings[dtype] = (time.perf_counter() - start) / 3
    bf16_ms, fp32_ms = timings[torch.bfloat16] * 1e3, timings[torch.float32] * 1e3
    why = f"BF16 matmul {bf16_ms:.1f} ms vs float32 {fp32_ms:.1f} ms on this CPU"
    return timings[torch.bfloat16] <= 2.0 * timings[torch.float32], why
