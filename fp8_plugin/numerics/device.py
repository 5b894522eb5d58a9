"""Which FP8 recipes run natively on a device, and the recipe that "auto" picks there.

``python -m fp8_plugin`` prints :func:`describe_device` for this machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .cpu_emulation import bf16_matmul_speedup, cpu_emulation
from .device_kind import cuda_capability, device_kind, fp8_family
from .formats import Format, parse_format
from . import gemm as _gemm
from .gemm import NATIVE_SPEEDUP_REQUIRED, native_gemm, normalize_device
from .kernels import fused_casts
from .recipes import AutoRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe

__all__ = ["describe_device", "DeviceReport", "RecipeSupport", "GemmPairing", "auto_recipe", "resolve_recipe",
           "recipe_gemm_kind", "default_device", "bf16_matmul_is_fast",
           "bf16_matmul_speedup"]

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
    scales cost nothing extra (NVIDIA Transformer Engine docs, "FP8 recipes"). MXFP8 keeps
    ``fp8_format`` where the probe of the device's block kernel
    (:func:`fp8_plugin.numerics.gemm_support.probe_block_kind`) found every pairing of that
    format native; for ``Format.HYBRID`` on a GPU whose MXFP8 kernel refuses E5M2 x E4M3, it is
    ``MXFP8BlockScaling(fp8_format=Format.E4M3)``, Transformer Engine's default for MXFP8.

    Args:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        device: the training device; None as in :func:`default_device`.
    """
    target = default_device(device)
    mxfp8 = native_gemm("mxfp8", target)
    if mxfp8.native:
        fp8_format = parse_format(fp8_format)
        if fp8_format is Format.HYBRID and not mxfp8.pairing_out_dtypes(torch.float8_e5m2, torch.float8_e4m3fn):
            # The probe found no native E5M2 x E4M3 block GEMM: HYBRID's dgrad and wgrad would run
            # emulated. E4M3 everywhere is TE's default for MXFP8 (its 32-element blocks give
            # gradients the range E5M2 gives per-tensor scales).
            return MXFP8BlockScaling(fp8_format=Format.E4M3)
        return MXFP8BlockScaling(fp8_format=fp8_format)
    return DelayedScaling(fp8_format=fp8_format)


def resolve_recipe(recipe: Optional[Recipe], device: Device = None) -> Optional[Recipe]:
    """``recipe`` itself, or for an :class:`AutoRecipe` the concrete recipe for ``device``."""
    if isinstance(recipe, AutoRecipe):
        # The GEMMs asked to run in high precision stay so in the concrete recipe.
        return dataclasses.replace(auto_recipe(recipe.fp8_format, device),
                                   override_linear_precision=recipe.override_linear_precision)
    return recipe


@dataclass
class RecipeSupport:
    """One recipe on one device: its GEMM kind, and whether that GEMM is native (else why not).

    Attributes:
        native: every GEMM of the recipe runs a native kernel (on CPU: every operand pairing of
            :attr:`DeviceReport.pairings` chose ``torch._scaled_mm``).
        reason: why not, where ``native`` is False.
        native_pairings: where some pairings run natively and others not (the table says
            "partly"), those that do, as in :attr:`GemmPairing.operands`; empty otherwise.
    """

    recipe: str
    granularity: str
    gemm: str
    native: bool
    reason: str
    native_pairings: list[str] = field(default_factory=list)

    def column(self) -> str:
        """The table's "native" cell: ``yes``, ``partly: ...`` naming the native pairings, or ``no: reason``."""
        if self.native:
            return "yes"
        if self.native_pairings:
            return f"partly: torch._scaled_mm for {', '.join(self.native_pairings)}; float32 emulation for the others"
        return f"no: {self.reason}"


@dataclass
class GemmPairing:
    """The tensorwise GEMM path of one operand pairing on a CPU: the path ``fp8_gemm`` takes for it.

    Attributes:
        operands: e.g. ``"E5M2 x E4M3 -> bfloat16"`` (first operand, second operand, output dtype).
        role: which GEMMs of a training step have these operands.
        native: True if ``torch._scaled_mm`` runs them, False for the float32 emulation.
        detail: how it was decided (:meth:`fp8_plugin.numerics.gemm.TensorwiseChoice.describe`).
    """

    operands: str
    role: str
    native: bool
    detail: str


@dataclass
class DeviceReport:
    """What :func:`describe_device` found. ``str()`` is a table."""

    device: str
    name: str
    torch_version: str
    recipes: list[RecipeSupport] = field(default_factory=list)
    auto: Optional[Recipe] = None
    # CPU: the tensorwise GEMM path of each operand pairing a training step uses, and the same as
    # lines, e.g. "E5M2 x E4M3 -> bfloat16 (HYBRID dgrad of BF16 inputs): torch._scaled_mm
    # (64x128x128: _scaled_mm 0.12 ms, emulation 0.31 ms)".
    pairings: list[GemmPairing] = field(default_factory=list)
    gemm_paths: list[str] = field(default_factory=list)
    # How per-tensor FP8 casts run (delayed and current scaling): the fused Triton kernels, or
    # the torch ops and why (fp8_plugin.numerics.kernels.fused_casts).
    casts: str = ""
    # The FP8 formats the recipes' names stand for here (device_kind.fp8_family).
    formats: str = ""
    # CPU: the emulation tensorwise GEMMs run where they are emulated (numerics/cpu_emulation.py).
    emulation: str = ""

    def __str__(self) -> str:
        header = ("recipe", "scaling", "GEMM", "native")
        rows = [(r.recipe, r.granularity, r.gemm, r.column()) for r in self.recipes]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"{self.name} ({self.device}), torch {self.torch_version}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        lines.insert(2, "  ".join("-" * w for w in widths))
        if self.auto is not None:
            fmt = getattr(self.auto, "fp8_format", None)
            lines.append(f'recipe "auto" (precision strings fp8-hybrid / fp8-e4m3): {type(self.auto).__name__}'
                         + (f" ({fmt.name} for fp8-hybrid)" if fmt is not None else ""))
        if self.formats:
            lines.append(f"FP8 formats: {self.formats}")
        if self.casts:
            lines.append(f"per-tensor FP8 casts: {self.casts}")
        if self.gemm_paths:
            lines.append("tensorwise GEMM path per operand pairing (what training runs here):")
            lines += [f"  {p}" for p in self.gemm_paths]
        if self.emulation:
            lines.append(f"tensorwise emulation: {self.emulation}")
        return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    if device_kind(device) == "cuda":
        major, minor = cuda_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return device.type.upper()


def describe_device(device: Device = None) -> DeviceReport:
    """Which recipes run their GEMMs natively on ``device`` and which are emulated, and why.

    The block-scaled kinds are probed once per device with a small GEMM (see
    :func:`fp8_plugin.numerics.gemm.native_gemm`), so the first call on a GPU takes a moment. On CPU
    the tensorwise GEMM path of each operand pairing a training step uses comes from
    :func:`fp8_plugin.numerics.gemm.tensorwise_choice`, the function ``fp8_gemm`` asks (cached
    for the process, so the report names the paths training takes in it, and stable across
    processes: see its docstring). A tensorwise recipe is native ("yes") when every pairing
    runs ``torch._scaled_mm``, "partly" (naming them) when some do.

    Args:
        device: as in :func:`default_device`.

    Returns:
        A :class:`DeviceReport`; ``print()`` it for a table.
    """
    target = default_device(device)
    report = DeviceReport(str(target), _device_name(target), torch.__version__)
    per_pairing = device_kind(target) == "cpu" and native_gemm("tensorwise", target).native
    choices = []
    if per_pairing:
        for (a, b, out, role) in _CPU_PAIRINGS:
            choice = _gemm.tensorwise_choice(target, a, b, out)
            choices.append(choice)
            pairing = GemmPairing(f"{_short(a)} x {_short(b)} -> {str(out).replace('torch.', '')}", role, choice.native,
                                  choice.describe())
            report.pairings.append(pairing)
            report.gemm_paths.append(f"{pairing.operands} ({role}): {pairing.detail}")
    for cls, (kind, granularity) in _RECIPES.items():
        support = native_gemm(kind, target)
        row = RecipeSupport(cls.__name__, granularity, kind, support.native, "" if support.native else support.reason)
        if kind == "tensorwise" and per_pairing and not all(c.native for c in choices):
            row.native, row.reason = False, _emulated_reason(choices)
            row.native_pairings = [p.operands for p in report.pairings if p.native]
        report.recipes.append(row)
    report.auto = auto_recipe(Format.HYBRID, target)
    if device_kind(target) == "cpu" and target.type == "cpu":
        choice = cpu_emulation()
        report.emulation = (f"{'BF16 GEMMs of the FP8 values' if choice.bf16 else 'float32 GEMMs of the dequantized operands'}"
                            f" ({choice.why})")
    fused, why = fused_casts(target)
    report.casts = ("fused Triton kernels (cast-transpose with the amax folded in; current scaling: an amax pass "
                    "first)" if fused else f"torch ops ({why})")
    if fp8_family(target) == "fnuz":
        report.formats = "FNUZ (E4M3FNUZ, max 240; E5M2FNUZ): an AMD MI300"
        for row in report.recipes:
            if row.gemm != "tensorwise":
                row.native, row.reason = False, "MI300 has no block-scaled FP8 GEMMs (FNUZ formats): refused at the first cast"
        report.casts = "torch ops (the fused kernels encode the OCP formats, not FNUZ)"
    else:
        report.formats = "OCP (E4M3, max 448; E5M2)"
    return report


def _emulated_reason(choices: list[_gemm.TensorwiseChoice]) -> str:
    # Why a tensorwise recipe is not (all) native on this CPU, from its pairings' choices.
    if all(c.same_computation for c in choices):
        return "torch._scaled_mm is the emulation's own float32 computation on this CPU (same bits)"
    if not any(c.same_computation for c in choices):
        return (f"torch._scaled_mm measured less than {NATIVE_SPEEDUP_REQUIRED}x faster than the exact "
                "float32 emulation here (timings below)")
    return "the exact float32 emulation runs every operand pairing here (why: below)"


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The operand pairings of FP8Linear's GEMMs (HYBRID and E4M3): forward in the autocast dtype or
# the input's, dgrad in the input's dtype (BF16 when a previous layer ran under BF16 autocast),
# wgrad in float32; the first operand E5M2 for HYBRID's gradients.
_CPU_PAIRINGS = (
    (_E4M3, _E4M3, torch.bfloat16, "forward under BF16 autocast, E4M3 dgrad of BF16 inputs"),
    (_E4M3, _E4M3, torch.float32, "forward in float32, E4M3 dgrad of float32 inputs, E4M3 wgrad"),
    (_E4M3, _E4M3, torch.float16, "forward under FP16 autocast, E4M3 dgrad of FP16 inputs"),
    (_E5M2, _E4M3, torch.bfloat16, "HYBRID dgrad of BF16 inputs"),
    (_E5M2, _E4M3, torch.float32, "HYBRID dgrad of float32 inputs, HYBRID wgrad"),
    (_E5M2, _E4M3, torch.float16, "HYBRID dgrad of FP16 inputs"),
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
    speedup, why = bf16_matmul_speedup(device_type, k)
    return speedup >= 0.5, why
