"""FP8 GEMM: a native scaled GEMM where the device and torch have one, an exact emulation elsewhere.

Three kinds of scaling reach the GEMM, each with its own native kernel:

- ``tensorwise`` (delayed and current scaling): ``torch._scaled_mm`` with one float32 scale_inv
  per operand; on CPU and on CUDA GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell), where
  every dim must be a multiple of 16 and E5M2 x E5M2 has no kernel.
- ``blockwise`` (Float8BlockScaling): ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128``
  for the first operand and ``BlockWise1x128`` or ``BlockWise128x128`` for the second (cuBLAS,
  Hopper sm90 only); the contraction dim and 128x128-scaled dims must be multiples of 128.
- ``mxfp8`` (MXFP8BlockScaling): ``scaled_mm`` with ``BlockWise1x32`` and swizzled E8M0 scales
  (cuBLAS, Blackwell sm100+); the contraction dim must be a multiple of 32.

On a CUDA GPU in eager code the ``tensorwise`` kind can run as a Triton kernel instead of
``torch._scaled_mm`` (:func:`~fp8_plugin.numerics.kernels.gemm_kernel`,
:mod:`~fp8_plugin.numerics.kernels.scaled_gemm`: a few microseconds of CPU per call, any shape
without padding).

On CUDA, operands whose dims the kernel refuses are zero-padded to its multiples
(:func:`~fp8_plugin.numerics.gemm_kernels.pad_to_alignment`; most often the token count, which
is M of the forward and dgrad and K of wgrad) and the output cut back: exact, and far faster
than the emulation.

Whether a kind is native on a device is decided once per device and cached: from the device,
the installed torch, and for the block kinds a one-off probe on that device of every operand
pairing (E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2) and output dtype, whose results must match the
emulation (:mod:`~fp8_plugin.numerics.gemm_support`): a kernel that is missing, refuses the
layout, or disagrees is not used, and a pairing it refuses runs in the emulation alone. On CPU,
where no FP8 hardware exists, the tensorwise path is decided once per operand pairing
(:func:`tensorwise_choice`) so that it cannot change between runs on one machine: torch
hands CPU FP8 GEMMs to oneDNN on CPUs with AMX (where some pairings get a reference kernel
hundreds of times slower) and elsewhere computes them itself exactly as the emulation does. A
bit-for-bit check tells which: where ``torch._scaled_mm`` gives the emulation's bits, the two
are one computation, the choice cannot change a result, and the emulation is used without
timing; only a kernel that computes otherwise is timed, and used where clearly faster.

The emulation dequantizes both operands to float32 (``data * scale_inv``, one rounding per
element, none for power-of-two scales) and runs one float32 GEMM, with the second operand laid
out as torch's CPU ``_scaled_mm`` lays it out: where torch computes ``_scaled_mm`` itself (no
AMX), the two paths agree bit for bit for any scales, biases and shapes. oneDNN applies the
scales to the accumulator and sums in its own order: there the paths agree bit for bit where
float32 accumulation is exact with power-of-two scales, and otherwise within the float32
accumulation error bound. Native kernels run outside torch autocast (under it, CPU
``_scaled_mm`` takes a path about 40x slower). :func:`force_path` pins one path, for tests.

On CPUs whose BF16 GEMMs are fast (AVX512-BF16, AMX), per-tensor operands are emulated instead
as one BF16 GEMM of their FP8 values, one bfloat16 rounding of each output away from the float32
emulation: :mod:`~fp8_plugin.numerics.cpu_emulation` says which emulation a process runs, and why.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn.functional as F

from .._private.compile_marks import assume_constant_result
from .device_kind import cuda_capability, device_kind, presented_device
from .cpu_emulation import cpu_emulation
from .formats import is_fnuz
from .gemm_kernels import emulated as _emulated
from .gemm_kernels import emulated_bf16 as _emulated_bf16
from .gemm_kernels import fp8_gemm_in_bf16, fp8_values_in_bf16  # noqa: F401  (public here too)
from .gemm_kernels import alignment, pad_to_alignment  # noqa: F401  (pad_to_alignment: public here too)
from .gemm_kernels import kernel_bias as _kernel_bias
from .gemm_kernels import outside_autocast as _outside_autocast
from .gemm_kernels import row_major as _row_major
from .gemm_kernels import scaled_mm_native as _native
from .gemm_kernels import scaled_mm_tensorwise as _scaled_mm_tensorwise
from .gemm_support import KERNEL_OUT_DTYPES as _KERNEL_OUT_DTYPES
from .gemm_support import NativeGemm, format_name, probe_block_kind
from .kernels import gemm_kernel
from .kernels.ops import traced
from .quantizers import QuantizedTensor

__all__ = [
    "fp8_gemm", "gemm_route", "gemm_kind", "native_gemm", "NativeGemm", "GEMM_KINDS", "scaled_mm_supported", "normalize_device",
    "tensorwise_choice", "TensorwiseChoice", "choose_native", "force_path", "forced_path", "emulates_in_bf16",
    "pad_to_alignment",
    "fp8_gemm_in_bf16", "fp8_values_in_bf16",
]

GEMM_KINDS = ("tensorwise", "blockwise", "mxfp8")
# Compute capabilities (major) whose tensor cores run each block kind through cuBLAS.
_BLOCK_KIND_MAJORS = {"blockwise": (9,), "mxfp8": (10, 11, 12)}

_warned: set[str] = set()


# Under torch.compile this runs in Python while tracing (a traced warning would break the graph).
@assume_constant_result
def _warn_once(reason: str) -> bool:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"FP8 GEMM emulated in float32 ({reason}); numerics match, speed does not.", stacklevel=3)
    return True


def gemm_kind(a: QuantizedTensor, b: QuantizedTensor) -> str:
    """The GEMM kind of ``a @ b.T``: "tensorwise", "blockwise", "mxfp8" or "unsupported-blocks"."""
    if a.block is None and b.block is None:
        return "tensorwise"
    if a.block == b.block == (1, 32):
        return "mxfp8"
    if a.block == (1, 128) and b.block in ((1, 128), (128, 128)):
        return "blockwise"
    return "unsupported-blocks"


def normalize_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch device, ``"cuda"`` pinned to the current CUDA device's index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def native_gemm(kind: str, device: torch.device) -> NativeGemm:
    """Whether GEMMs of ``kind`` run natively on ``device``; decided once per device, then cached.

    Inside ``force_path("native")`` a block kind is decided without its probe GEMM.

    Args:
        kind: one of ``GEMM_KINDS``.
        device: a torch device (``"cuda"`` means the current CUDA device).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in GEMM_KINDS:
        raise ValueError(f"kind={kind!r} is not a GEMM kind; valid: {', '.join(GEMM_KINDS)}")
    return _native_gemm(kind, normalize_device(device), _forced != "native")


@lru_cache(maxsize=None)
def _native_gemm(kind: str, device: torch.device, probe: bool = True) -> NativeGemm:
    # probe=False (force_path("native")): the block kinds' probe GEMM is skipped; it reads its
    # result on the host, which a device without data (meta) cannot give.
    kind_of = device_kind(device)
    if kind_of not in ("cpu", "cuda"):
        return NativeGemm(False, f"no FP8 GEMM on device type {device.type!r}")
    if kind == "tensorwise":
        if kind_of == "cpu":
            return NativeGemm(hasattr(torch, "_scaled_mm"), "torch._scaled_mm missing in this torch build")
        major, minor = cuda_capability(device)
        if (major, minor) < (8, 9):
            return NativeGemm(False, f"GPU compute capability {major}.{minor} < 8.9 has no FP8 tensor cores")
        return NativeGemm(True)
    if kind_of == "cpu":
        return NativeGemm(False, f"torch has no {kind} GEMM on CPU (tensorwise and rowwise only)")
    if not hasattr(F, "scaled_mm"):
        return NativeGemm(False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    major, minor = cuda_capability(device)
    if major not in _BLOCK_KIND_MAJORS[kind]:
        majors = "/".join(f"sm{m}x" for m in _BLOCK_KIND_MAJORS[kind])
        return NativeGemm(False, f"{kind} GEMMs are native on {majors}, not sm{major}{minor}")
    return probe_block_kind(kind, device) if probe else NativeGemm(True)


# The two host-side decisions of a GEMM's path, as constants: under torch.compile they run once
# while tracing (their probes and timings cannot be traced) and the graph keeps the answer.
@assume_constant_result
def _native_support(kind: str, device: torch.device, probe: bool = True) -> tuple:
    # NativeGemm's fields as a tuple of constants (dtypes, strings, nested tuples).
    support = _native_gemm(kind, device, probe)
    return support.native, support.reason, support.out_dtypes, support.pairings


@assume_constant_result
def _tensorwise_native(device: torch.device, dtype_a: torch.dtype, dtype_b: torch.dtype, out_dtype: torch.dtype) -> bool:
    return tensorwise_choice(device, dtype_a, dtype_b, out_dtype).native


def _plan(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> tuple[str, Optional[NativeGemm], str]:
    # (kind, its native support if this call can use it, else None, and why not).
    kind = gemm_kind(a, b)
    if kind not in GEMM_KINDS:
        return kind, None, f"no native GEMM for {a.block} x {b.block} blocks"
    if _forced in ("emulated", "emulated-bf16"):
        return kind, None, ""
    # A tensor's device carries its index.
    support = NativeGemm(*_native_support(kind, a.data.device, _forced != "native"))
    if not support.native:
        return kind, None, support.reason
    if device_kind(a.data.device) != "cuda":
        if kind == "tensorwise" and _forced != "native":
            if not _tensorwise_native(a.data.device, a.data.dtype, b.data.dtype, out_dtype):
                return kind, None, ""  # measured: the emulation is the faster exact path here
        return kind, support, ""
    if kind == "tensorwise" and a.data.dtype == b.data.dtype and a.data.dtype in (torch.float8_e5m2,
                                                                                 torch.float8_e5m2fnuz):
        return kind, None, "E5M2 x E5M2 has no CUDA kernel"
    if not support.pairing_out_dtypes(a.data.dtype, b.data.dtype):
        # A pairing this GPU's block kernel refused in its probe: this GEMM alone is emulated.
        pairing = f"{format_name(a.data.dtype)} x {format_name(b.data.dtype)}"
        return kind, None, f"{kind} GEMM of {pairing} operands: {support.pairing_reason(a.data.dtype, b.data.dtype)}"
    return kind, support, ""


# _plan's answers by what they depend on: the operands' blocks and dtypes, the output dtype, the
# device (and what a meta device presents), the forced path and GEMM kernel. A training step asks
# three times. The last field: an eager call of this plan launches the Triton GEMM.
_plans: dict[tuple, tuple[str, Optional[NativeGemm], str, bool]] = {}


def _cached_plan(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype
                 ) -> tuple[str, Optional[NativeGemm], str, bool]:
    # Traced code decides once anyway (a cache would be guarded on); a CPU's tensorwise choice is
    # a measurement that tests redo (tensorwise_choice.cache_clear).
    data = a.data
    if torch.compiler.is_compiling() or data.is_cpu:
        return (*_plan(a, b, out_dtype), False)
    kernel = gemm_kernel()
    # A GPU or meta device as (is meta, index): no torch.device made and hashed per call.
    device = (data.is_meta, data.get_device()) if data.is_cuda or data.is_meta else data.device
    key = (a.block, b.block, data.dtype, b.data.dtype, out_dtype, device, _forced, kernel, presented_device())
    plan = _plans.get(key)
    if plan is None:
        kind, support, reason = _plan(a, b, out_dtype)
        # The Triton GEMM (numerics/kernels/scaled_gemm.py) takes OCP per-tensor operands (its
        # tl.dot reads E4M3 and E5M2; an AMD MI300's FNUZ formats keep torch._scaled_mm).
        triton = (support is not None and kind == "tensorwise" and kernel == "triton"
                  and device_kind(a.data.device) == "cuda" and not (is_fnuz(a.data.dtype) or is_fnuz(b.data.dtype)))
        plan = _plans[key] = (kind, support, reason, triton)
    return plan


def clear_plans() -> None:
    """Forget every decision cached per device (the native support of each GEMM kind, the
    per-call plans): for tests that present the meta device as another GPU."""
    _plans.clear()
    _native_gemm.cache_clear()


def scaled_mm_supported(a: QuantizedTensor, b: QuantizedTensor) -> tuple[bool, str]:
    """Whether ``a @ b.T`` runs natively on this device, and if not, why.

    Decided from dtypes, blocks and the (cached) device support alone: no host-device
    synchronisation. Shapes do not matter: on CUDA unaligned operands are padded.
    """
    _, support, reason = _plan(a, b)
    return support is not None, reason


_forced: Optional[str] = None
_PATHS = ("auto", "native", "emulated", "emulated-bf16")


@assume_constant_result
def _cpu_bf16_emulation() -> bool:
    # The process's CPU emulation (a timing on first use): a constant for torch.compile.
    return cpu_emulation().bf16


def emulates_in_bf16(device: torch.device) -> bool:
    """Whether an emulated per-tensor FP8 GEMM on ``device`` multiplies the FP8 values in BF16
    GEMMs (a CPU whose process chose them, :mod:`~fp8_plugin.numerics.cpu_emulation`, or
    :func:`force_path` ``("emulated-bf16")``) rather than in the float32 emulation. The experts'
    grouped GEMMs follow it too."""
    return device.type == "cpu" and (_forced == "emulated-bf16" or (_forced != "emulated" and _cpu_bf16_emulation()))


def _emulate(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    # The emulation of this call: BF16 GEMMs for per-tensor operands where emulates_in_bf16 says
    # so; float32 otherwise.
    if a.block is None and b.block is None and emulates_in_bf16(a.data.device):
        return _emulated_bf16(a, b, out_dtype, bias)
    return _emulated(a, b, out_dtype, bias)


@contextlib.contextmanager
def force_path(path: str) -> Iterator[None]:
    """Force every FP8 GEMM in the context onto one path, for tests and comparisons.

    Args:
        path: ``"native"`` (the native kernel wherever the device and shape allow one, even if
            the timed probe found it slower; a block kind's kernel is taken from the device's
            compute capability alone, without its probe GEMM, and assumed to write float32,
            bfloat16 and float16), ``"emulated"`` (always the float32 emulation),
            ``"emulated-bf16"`` (the BF16 emulation for per-tensor operands on CPU, the float32
            one elsewhere; :mod:`~fp8_plugin.numerics.cpu_emulation`) or ``"auto"`` (the
            default: the native kernel where it is faster, else the CPU's chosen emulation).

    Raises:
        ValueError: unknown ``path``.
    """
    global _forced
    if path not in _PATHS:
        raise ValueError(f"force_path(path={path!r}) is not a GEMM path; valid: {', '.join(_PATHS)}")
    previous, _forced = _forced, (None if path == "auto" else path)
    try:
        yield
    finally:
        _forced = previous


def forced_path() -> Optional[str]:
    """The path :func:`force_path` pins now: ``"native"``, ``"emulated"``, or None (``"auto"``)."""
    return _forced


@dataclass(frozen=True)
class TensorwiseChoice:
    """The choice between ``torch._scaled_mm`` and the emulation for one operand pairing on CPU.

    Attributes:
        native: True if ``torch._scaled_mm`` is used.
        native_s, emulated_s: seconds per probe GEMM of each path (``native_s`` is the one early
            call when that call alone was far slower than the emulation); NaN where not timed.
        shape: ``(M, K, N)`` of the probe the times were measured on (of the bit-for-bit check
            where not timed).
        same_computation: ``torch._scaled_mm`` gave the emulation's bits (torch's own float32
            computation, no oneDNN): the paths are one computation, so the emulation is used
            and nothing is timed.
        refused: the error ``torch._scaled_mm`` raised for this pairing ("" where it ran):
            oneDNN, which takes CPU FP8 GEMMs on CPUs with AMX, refuses the FNUZ formats.
    """

    native: bool
    native_s: float
    emulated_s: float
    shape: tuple[int, int, int]
    same_computation: bool = False
    refused: str = ""

    def describe(self) -> str:
        m, k, n = self.shape
        emulation = "BF16 emulation" if cpu_emulation().bf16 else "float32 emulation"
        if self.refused:
            return f"{emulation} (torch._scaled_mm refuses this pairing: {self.refused})"
        if self.same_computation:
            if emulation == "float32 emulation":
                return f"{emulation} (same bits as torch._scaled_mm on a {m}x{k}x{n} check: not timed)"
            return f"{emulation} (torch._scaled_mm gave the float32 emulation's bits on a {m}x{k}x{n} check: not timed)"
        path = "torch._scaled_mm" if self.native else emulation
        return (f"{path} ({m}x{k}x{n}: _scaled_mm {self.native_s * 1e3:.2f} ms, "
                f"emulation {self.emulated_s * 1e3:.2f} ms)")


# Probe sizes (M, K, N). A tiny product first: the bit-for-bit check of the two paths (which is
# also their warm-up), then, for a kernel that computes otherwise, the scout of the timing:
# 131k multiply-accumulates, 0.03 s per call at the ~200 ns per multiply-accumulate of a
# reference kernel, and a kernel that slow against the emulation is not timed further. Only a
# kernel within _ABORT_RATIO of the emulation there is timed on the 1M multiply-accumulates that
# decide.
_SCOUT_SHAPE = (32, 64, 64)
_PROBE_SHAPE = (64, 128, 128)
_PROBE_REPEATS = 5
# Native calls this many times slower than the emulation stop the timing (after two of them).
_ABORT_RATIO = 8.0
# A kernel that computes otherwise is used only when clearly faster: a tie goes to the
# emulation, whose speed follows the float32 GEMM of the machine.
NATIVE_SPEEDUP_REQUIRED = 1.25


def choose_native(native_s: float, emulated_s: float) -> bool:
    """Whether measured times (seconds per GEMM) favour the native kernel.

    True only if ``torch._scaled_mm`` is at least ``NATIVE_SPEEDUP_REQUIRED`` times faster than
    the emulation: a tie, or a kernel of unknown speed (``inf``), goes to the emulation.
    """
    return native_s * NATIVE_SPEEDUP_REQUIRED <= emulated_s


def _time_gemm(path: str, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> float:
    # Seconds one GEMM of ``path`` ("native" or "emulated") takes: the one clock of
    # tensorwise_choice, so that a test can script the timings it sees.
    start = time.perf_counter()
    if path == "native":
        _scaled_mm_tensorwise(a, b, out_dtype, None)
    else:
        _emulate(a, b, out_dtype)
    if a.data.device.type == "cuda":
        torch.cuda.synchronize(a.data.device)
    return time.perf_counter() - start


def _same_computation(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor) -> bool:
    # Whether torch._scaled_mm gives the emulation's bits, in float32 (where a kernel that scales
    # the accumulator, as oneDNN does, or sums in another order differs in the last bits of
    # almost every output: the scales are not powers of two) and in out_dtype with a bias (the
    # epilogue). Torch picks its kernel from the operand formats and the CPU alone
    # (aten/src/ATen/native/Blas.cpp, _scaled_mm_out_cpu), so one check stands for every shape.
    for dtype in dict.fromkeys((torch.float32, out_dtype)):
        with_bias = bias if dtype == out_dtype else None
        if not torch.equal(_scaled_mm_tensorwise(a, b, dtype, with_bias), _emulated(a, b, dtype, with_bias)):
            return False
    return True


@lru_cache(maxsize=None)
def tensorwise_choice(device: torch.device, dtype_a: torch.dtype, dtype_b: torch.dtype, out_dtype: torch.dtype) -> TensorwiseChoice:
    """Which path one tensorwise operand pairing takes on ``device`` (CPU), decided once per process.

    The decision cannot change between runs on one machine. It starts with a check that needs
    no clock: one small GEMM on both paths, compared bit for bit. Where torch computes
    ``_scaled_mm`` itself (every CPU without AMX, and any CPU with oneDNN disabled) it
    dequantizes and multiplies in float32, as the emulation does; the paths give the same bits
    and run at the same speed up to a few small ops, so the choice matters to nothing and is
    fixed: the emulation, which ``torch.compile`` can fuse. Timing them instead would put a
    ratio near 1 against ``NATIVE_SPEEDUP_REQUIRED`` and decide by noise.

    A pairing the kernel refuses (it raises: oneDNN and the FNUZ formats) takes the emulation.
    Only where the kernel computes otherwise (oneDNN, on CPUs with AMX: AMX-INT8 for equal
    formats, AMX-FP16 for mixed ones) is it timed against the emulation, and used only if at
    least ``NATIVE_SPEEDUP_REQUIRED`` times faster. There the speeds are far apart: E4M3 x E4M3
    has been seen to fall to a reference kernel about 600 times slower than the float32 GEMM of
    the dequantised operands (7.7 s against 12 ms for 256x384x384), which the probe abandons
    after two calls on its scout shape. Cost: one or two 32x64x64 GEMMs on each path per pairing
    without AMX (under a millisecond); a few milliseconds per timed pairing, under 0.1 s where
    the kernel is a reference one.

    Args:
        device: the device (CPU; CUDA GPUs use their tensor cores without a probe).
        dtype_a, dtype_b: FP8 dtypes of the operands.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        The choice, with the seconds per probe GEMM of each path where timed.
    """
    gen = torch.Generator().manual_seed(0)

    def operands(m: int, k: int, n: int, scale_a: float = 1.0, scale_b: float = 1.0) -> tuple[QuantizedTensor, QuantizedTensor]:
        a = (torch.randn(m, k, generator=gen) * 8).to(dtype_a).to(device)
        b = (torch.randn(n, k, generator=gen) * 8).to(dtype_b).to(device)
        return (QuantizedTensor(a, torch.tensor(scale_a, device=device)),
                QuantizedTensor(b, torch.tensor(scale_b, device=device)))

    def native_seconds(a: QuantizedTensor, b: QuantizedTensor, emulated_s: float, calls: int) -> float:
        # Best of ``calls``, stopping after the second call far slower than the emulation (one
        # such call may be noise): a reference kernel runs at most twice per timed shape.
        best, slow = math.inf, 0
        for _ in range(calls):
            s = _time_gemm("native", a, b, out_dtype)
            best, slow = min(best, s), slow + (s > _ABORT_RATIO * emulated_s)
            if slow == 2:
                break
        return best

    with torch.autocast(device.type, enabled=False):
        # Scales 1/3 and 1/5: no power of two, so each path's roundings show.
        a, b = operands(*_SCOUT_SHAPE, 1 / 3, 1 / 5)
        bias = torch.randn(_SCOUT_SHAPE[2], generator=gen).to(device)
        try:
            same = _same_computation(a, b, out_dtype, bias)  # also the warm-up of both paths (oneDNN primitives)
        except RuntimeError as err:  # a pairing the kernel refuses (oneDNN: the FNUZ formats)
            return TensorwiseChoice(False, math.inf, math.nan, _SCOUT_SHAPE, refused=str(err).splitlines()[0])
        if same:
            return TensorwiseChoice(False, math.nan, math.nan, _SCOUT_SHAPE, same_computation=True)
        emulated_s = min(_time_gemm("emulated", a, b, out_dtype) for _ in range(_PROBE_REPEATS))
        native_s = native_seconds(a, b, emulated_s, 2)
        if native_s > _ABORT_RATIO * emulated_s:
            return TensorwiseChoice(False, native_s, emulated_s, _SCOUT_SHAPE)
        a, b = operands(*_PROBE_SHAPE)
        _time_gemm("emulated", a, b, out_dtype), _time_gemm("native", a, b, out_dtype)  # warm-up at this shape
        emulated_s = min(_time_gemm("emulated", a, b, out_dtype) for _ in range(_PROBE_REPEATS))
        native_s = native_seconds(a, b, emulated_s, _PROBE_REPEATS)
    return TensorwiseChoice(choose_native(native_s, emulated_s), native_s, emulated_s, _PROBE_SHAPE)


def fp8_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_split_accumulator: bool = True,
    route: Optional[Callable[..., torch.Tensor]] = None,
) -> torch.Tensor:
    """``(a.data * a.scale_inv) @ (b.data * b.scale_inv).T + bias`` with FP32 accumulation.

    The path (native kernel or float32 emulation) is chosen per call from the device, the
    shapes and, for tensorwise operands on CPU, the per-pairing choice of :func:`tensorwise_choice`;
    see the module docstring for what each path guarantees.

    Args:
        a: ``[M, K]`` FP8 data, row-major; per-tensor (0-dim) or block ``scale_inv`` with blocks
            along K.
        b: ``[N, K]`` FP8 data, row-major (the "NT" layout: ``b.data.t()`` is column-major, as
            the kernels want their second operand); per-tensor or block ``scale_inv``.
        out_dtype: dtype of the result. float32, bfloat16 and float16 are written by the kernels;
            any other (float64 for a float64 model) is computed as a float32 GEMM, bias
            included, and cast.
        bias: optional ``[N]`` tensor of any floating dtype. One rule on every path, bit for bit:
            the bias is rounded to ``out_dtype`` when that is bfloat16 / float16 (to float32
            otherwise), added in float32 to the FP32 accumulator, and the sum rounded once to
            ``out_dtype``. This is the bias epilogue of cuBLASLt for low-precision outputs, what
            oneDNN does with a bias of the output dtype, and what torch's CPU ``_scaled_mm``
            does (it adds the bias it is given to its float32 result before the cast).
        use_split_accumulator: for a native per-tensor GEMM on a GPU, False asks for fast
            accumulation (``torch._scaled_mm(use_fast_accum=True)``, the partial sums in the
            tensor cores' own precision; :class:`~fp8_plugin.numerics.recipes.MMParams`); the
            emulation and the block kernels accumulate in float32 whatever it says.
        route: :func:`gemm_route`'s answer for operands like these, kept by the caller (a layer's
            step plan): run with no decision made again. None decides here.

    Returns:
        ``[M, N]`` tensor in ``out_dtype``, a new tensor (never a view).

    Raises:
        RuntimeError: from the kernel, for operands it refuses (shapes that do not multiply).

    Warns:
        UserWarning: once per reason, when a GEMM is emulated because no native kernel can run it
            (not when :func:`tensorwise_choice` prefers the emulation).
    """
    if route is not None:
        return route(a, b, None if bias is None else _kernel_bias(bias, out_dtype))
    if out_dtype not in _KERNEL_OUT_DTYPES:
        # No kernel writes it (oneDNN refuses float64 views): a float32 GEMM, then the cast.
        return fp8_gemm(a, b, torch.float32, bias, use_split_accumulator).to(out_dtype)
    kind, support, reason, triton = _cached_plan(a, b, out_dtype)
    if triton and not traced(a.data):  # a plain eager launch (not compiled, traced or faked)
        # The Triton GEMM (numerics/kernels/scaled_gemm.py): any shape, no padding, no autocast.
        return _triton_gemm()(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype,
                              None if bias is None else _kernel_bias(bias, out_dtype), not use_split_accumulator)
    if support is None:
        if reason:
            _warn_once(reason)
        return _emulate(a, b, out_dtype, bias)
    m, n = a.data.shape[0], b.data.shape[0]
    device_type = device_kind(a.data.device)
    if device_type == "cuda":
        # Shapes the kernel refuses (often the token count, the K of wgrad) are padded with
        # zeros rather than emulated: one copy of each operand against a far slower GEMM.
        a, b = pad_to_alignment(a, b, alignment(kind, b))
        if bias is not None and b.data.shape[0] != n:
            bias = torch.cat([bias, bias.new_zeros(b.data.shape[0] - n)])
    fast = not use_split_accumulator and device_type == "cuda"
    if device_type == "cpu":  # a columnwise copy may be a transposed view (quantizers/casts.py)
        a, b = _row_major(a), _row_major(b)
    out = _outside_autocast(device_type, _native, kind, support, a, b, out_dtype, bias, fast)
    if out.shape != (m, n):
        out = out[:m, :n].clone()  # a tensor of its own: the caller may modify it in place
    return out


def gemm_route(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, has_bias: bool,
               use_split_accumulator: bool = True) -> Optional[Callable[..., torch.Tensor]]:
    """What :func:`fp8_gemm` runs for operands of ``a``'s and ``b``'s shapes, dtypes, scaling and
    device, with this output dtype, bias presence and accumulation, in the eager code and GEMM
    settings of now, decided once: the Triton GEMM's launch
    (:class:`~fp8_plugin.numerics.kernels.scaled_gemm.GemmLaunch`), or on a GPU the native GEMM
    of its kind (``torch._scaled_mm``, block-scaled ``scaled_mm``) for operands that need no
    padding; None for every other path (decided per call). A caller that keeps it for such
    operands passes it as ``fp8_gemm``'s ``route`` while those settings hold. Called as
    ``route(a, b, bias)`` with the bias as the kernels take it (``kernel_bias``).

    Raises:
        ValueError: operands that do not multiply (``scaled_gemm``'s).
    """
    if out_dtype not in _KERNEL_OUT_DTYPES or traced(a.data):
        return None
    kind, support, _, triton = _cached_plan(a, b, out_dtype)
    if triton:
        from .kernels.scaled_gemm import gemm_launch

        return gemm_launch(a.data, b.data, out_dtype, has_bias, not use_split_accumulator)
    (m, k), n = a.data.shape, b.data.shape[0]
    if (support is None or device_kind(a.data.device) != "cuda"
            or any(d % multiple for d, multiple in zip((m, k, n), alignment(kind, b)))):
        return None
    if kind == "tensorwise":
        return partial(_scaled_mm_route, out_dtype, not use_split_accumulator)
    return partial(_block_route, kind, support, out_dtype)


def _scaled_mm_route(out_dtype: torch.dtype, fast_accum: bool, a: QuantizedTensor, b: QuantizedTensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    # fp8_gemm's native tensorwise call on a GPU, for operands that need no padding (gemm_route).
    return _outside_autocast("cuda", _scaled_mm_tensorwise, a, b, out_dtype, bias, fast_accum)


def _block_route(kind: str, support: NativeGemm, out_dtype: torch.dtype, a: QuantizedTensor, b: QuantizedTensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    # fp8_gemm's native block-scaled call on a GPU, for operands that need no padding (gemm_route).
    return _outside_autocast("cuda", _native, kind, support, a, b, out_dtype, bias)


@lru_cache(maxsize=None)
def _triton_gemm():
    # kernels.scaled_gemm.scaled_gemm, imported at its first use (it imports Triton), then kept:
    # an import statement per GEMM costs about a microsecond of CPU.
    from .kernels.scaled_gemm import scaled_gemm

    return scaled_gemm
