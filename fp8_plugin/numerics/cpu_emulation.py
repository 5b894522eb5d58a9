"""Which emulation a CPU's tensorwise FP8 GEMMs run: float32 GEMMs, or BF16 GEMMs where this CPU's are fast.

CPUs have no FP8 GEMMs; the emulation multiplies the operands' FP8 values in a wider dtype.

- ``"float32"``: the dequantized operands (``data * scale_inv``, float32) in one float32 GEMM,
  cast once to the output dtype: the exact computation of torch's CPU ``_scaled_mm``.
- ``"bfloat16"``: the FP8 values themselves, exact in bfloat16 (3 or 2 mantissa bits of its 7),
  in one BF16 GEMM. Their products are exact in float32, and torch's BF16 GEMMs (oneDNN's)
  accumulate in float32. A bfloat16 output gets the scales' product and the bias inside the GEMM
  (``torch.addmm``'s alpha and addend, applied to the float32 sums) and is rounded once, as a
  GPU's scaled GEMM rounds. Any other output is each sum rounded once to bfloat16, the scales'
  product applied in float32, and the result cast to the output dtype: it differs from
  ``"float32"``'s by that one bfloat16 rounding (relative 2^-8 of each output), the rounding
  bf16-mixed applies to every GEMM output, 8 and 16 times finer than the unit roundoff of E4M3
  and E5M2 that quantized the operands. torch's CPU GEMMs have no BF16-in, float32-out form, or
  this rounding would not be there.

On CPUs with AVX512-BF16 or AMX a BF16 GEMM runs 1.6x to 2.3x faster than a float32 one
(measured on a 2-core AMD EPYC with AVX512-BF16 at MiniLM's shapes), and the FP8 step of a
model is mostly GEMMs. Without them a BF16 GEMM runs tens of times slower. So ``"auto"`` (the
default) times one matmul per dtype, once per process, and takes ``"bfloat16"`` only where BF16
is at least ``BF16_EMULATION_SPEEDUP_REQUIRED`` times faster: the two kinds of CPU are far
apart on either side of it.

The environment variable ``FP8_PLUGIN_CPU_EMULATION`` (``auto``, ``float32``, ``bfloat16``)
pins the choice: ``float32`` for results that do not depend on the machine's BF16 speed (the
test suite pins it), ``bfloat16`` for the speed. Block-scaled operands (MXFP8, blockwise) are
always emulated in float32: their scales vary along the sum.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

__all__ = ["EMULATIONS", "ENV_VAR", "BF16_EMULATION_SPEEDUP_REQUIRED", "CpuEmulation", "cpu_emulation",
           "bf16_matmul_speedup"]

EMULATIONS = ("float32", "bfloat16")
ENV_VAR = "FP8_PLUGIN_CPU_EMULATION"
_SETTINGS = ("auto", *EMULATIONS)
# "auto" takes BF16 GEMMs only when they are clearly faster: the speed-up NATIVE_SPEEDUP_REQUIRED
# asks of a native kernel.
BF16_EMULATION_SPEEDUP_REQUIRED = 1.25


@dataclass(frozen=True)
class CpuEmulation:
    """The CPU emulation chosen for this process.

    Attributes:
        dtype_name: ``"float32"`` or ``"bfloat16"``.
        why: how it was chosen (the setting, or the timings of ``"auto"``).
    """

    dtype_name: str
    why: str

    @property
    def bf16(self) -> bool:
        return self.dtype_name == "bfloat16"


def _setting() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _SETTINGS:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a CPU FP8 emulation; valid: {', '.join(_SETTINGS)}")
    return value


def cpu_emulation() -> CpuEmulation:
    """The emulation this process's CPU FP8 GEMMs run, decided on the first call and kept.

    Raises:
        ValueError: ``FP8_PLUGIN_CPU_EMULATION`` names no emulation (the message lists the valid ones).
    """
    return _decide(_setting())


@functools.lru_cache(maxsize=None)
def _decide(setting: str) -> CpuEmulation:
    if setting != "auto":
        return CpuEmulation(setting, f"{ENV_VAR}={setting}")
    speedup, why = bf16_matmul_speedup("cpu")
    fast = speedup >= BF16_EMULATION_SPEEDUP_REQUIRED
    verdict = "at least" if fast else "less than"
    return CpuEmulation("bfloat16" if fast else "float32",
                        f"auto: {why}, {verdict} {BF16_EMULATION_SPEEDUP_REQUIRED}x faster")


def bf16_matmul_speedup(device_type: str = "cpu", k: int = 384) -> tuple[float, str]:
    """How many times faster a BF16 matmul runs than a float32 one on ``device_type``, and why.

    One ``[256, k] x [k, 1536]`` matmul per dtype (about 1.2 GFLOP), timed as the mean of 3
    after a warm-up, on a generator of its own (the caller's random stream is left as it was).
    Above 1 on CPUs with AVX512-BF16 or AMX (measured 1.6 to 2.3 on an AMD EPYC with
    AVX512-BF16 at MiniLM's GEMM shapes), far below it on CPUs without (tens of times slower).
    Timed once per process and kept, so that its callers (the CPU emulation, the reference
    checks' figures, the examples' reference precision) agree.

    Returns:
        ``(float32 seconds / BF16 seconds, why)``, ``why`` a sentence with the timings.
    """
    # Cached on the arguments' values: functools.lru_cache keys on their spelling, and timed
    # once for ("cpu"), again for ("cpu", 384), and again for each spelling with keywords.
    return _timed_speedup(str(device_type), int(k))


@functools.lru_cache(maxsize=None)
def _timed_speedup(device_type: str, k: int) -> tuple[float, str]:
    cuda = device_type == "cuda" and torch.cuda.is_available()  # any other device type: timed on CPU
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, k, generator=gen), torch.randn(k, 1536, generator=gen)
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to("cuda" if cuda else "cpu", dtype), b.to("cuda" if cuda else "cpu", dtype)
        x @ y  # warm-up, never timed: a first BF16 call also builds oneDNN's kernel (one took 78 ms here)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            x @ y
        if cuda:
            torch.cuda.synchronize()
        timings[dtype] = (time.perf_counter() - start) / 3
    bf16_ms, fp32_ms = timings[torch.bfloat16] * 1e3, timings[torch.float32] * 1e3
    why = f"BF16 matmul {bf16_ms:.1f} ms vs float32 {fp32_ms:.1f} ms on this {'GPU' if cuda else 'CPU'}"
    return timings[torch.float32] / timings[torch.bfloat16], why


bf16_matmul_speedup.cache_clear = _timed_speedup.cache_clear  # forget the timing (tests)
