"""Every FP8 GEMM variant fp8-plugin can call on a device, native kernel against the emulation, one line each.

    python3 benchmarks/gpu_probe.py                    # the current GPU (a few seconds)
    python3 benchmarks/gpu_probe.py --device cpu       # what runs on this CPU (the rehearsal)
    python3 benchmarks/gpu_probe.py --output probe.txt --timeout 30
    python3 benchmarks/gpu_probe.py --only grouped     # the variants whose name contains "grouped"

What it runs (each a "variant"), in order:

- ``decision <kind>``: the project's own verdict for each GEMM kind on the device
  (:func:`fp8_plugin.numerics.gemm.native_gemm`, which runs the block kinds' probe of every
  operand pairing and output dtype), printed as it is;
- ``tensorwise A x B -> out [+bias]``: ``torch._scaled_mm`` with per-tensor scales, for every
  format pairing (E4M3 / E5M2, E5M2 x E5M2 included: CUDA refuses it, the project emulates it),
  output dtype (float32, bfloat16, float16), with and without bias;
- ``blockwise 1x128 x 128x128|1x128 A x B -> out`` (sm90) and ``mxfp8 1x32 x 1x32 A x B -> out``
  (sm100+): ``torch.nn.functional.scaled_mm`` for the pairings the HYBRID and E4M3 recipes send
  (E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2) and every output dtype;
- ``fp8_gemm <kind> MxKxN``: the project's GEMM on shapes no kernel takes as they are (padded);
- ``grouped ...`` (sm90, sm100): ``torch._scaled_grouped_mm`` and bfloat16 ``torch._grouped_mm``
  with group starts at unaligned rows (5 and 42: float32 row scales 20 and 168 bytes in) and an
  empty group, as the MoE experts call them;
- ``cast kernel ...``: the fused per-tensor cast kernels (Triton) against the torch ops on the
  same device, byte for byte (every BF16 bit pattern; current scaling's amax, scale and both
  copies); on CPU only under ``TRITON_INTERPRET=1``.

Each result is one line: ``PASS`` (``bit-for-bit``, or ``within bound`` with the worst error as
a share of the bound), ``FAIL`` (beyond the bound), ``REFUSED`` (the kernel raised; its first
line follows; ``expected`` where the project never sends it there), ``SKIP`` (not on this
device, with why), ``CRASH`` (the process died or hung in it), then a count of each.

The bound of a comparison: both results sum the same exact products (FP8 values times
power-of-two scales) in float32, in possibly different orders and blocks, so each is within
``gamma_K * S`` of the exact sum (Higham, "Accuracy and Stability of Numerical Algorithms",
eq. 3.5; ``gamma_K = K u / (1 - K u)``, ``u = 2^-24``, ``S = |A| |B|^T`` in float64), plus one
rounding per block scale applied to a partial sum (``u S`` per block); then each is rounded once
to the output dtype (``u_out`` = 2^-8 bfloat16, 2^-11 float16). So
``|native - emulated| <= 2 (gamma_K + blocks u) S + 2 u_out (|emulated| + that)``.

A GPU's FP8 tensor cores do not sum in float32: Hopper's FP8 MMA keeps about 14 bits of its
partial sums (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.3.2),
and without fast accumulation cuBLAS and CUTLASS promote them to float32 after each MMA
instruction's K (32 for FP8 on sm90, ``wgmma.m64nNk32``). So a native result on CUDA carries up
to ``gamma_32(2^-13) S`` more (``TENSOR_CORE_UNIT_ROUNDOFF``, truncation's 2^-13 for 14 bits),
added to the accumulation term. The first H100 run measured its float32 outputs at up to 1.4
times the float32-only bound, well inside this one.

A fault that could kill the process (a misaligned address in a CUTLASS kernel, an illegal memory
access) must not take the other variants with it: the variants run in a child process that prints
each result as it finishes; if it dies or hangs (``--timeout`` seconds per variant), the variant
it was in is reported ``CRASH`` with the exit status and the last lines of its stderr, and a new
child goes on from the next variant. After a CUDA error (which can poison the CUDA context) the
child exits on purpose and a fresh one takes the rest.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8_plugin from this checkout

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# FP8 tensor-core accumulation (module docstring): ~14 bits kept, promoted every 32 products.
TENSOR_CORE_UNIT_ROUNDOFF, TENSOR_CORE_CHUNK = 2.0**-13, 32
BLOCK_PAIRINGS = ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))
RESULT = "RESULT\t"
STARTUP_S = 120.0  # seconds a child may take to import torch and fp8_plugin and reach its first variant
# Child exit status after a CUDA error: the rest runs in a fresh process.
POISONED = 3
CUDA_ERRORS = ("CUDA error", "illegal memory access", "misaligned address", "device-side assert", "CUBLAS_STATUS_EXECUTION")


def fmt(dtype: torch.dtype) -> str:
    return {E4M3: "E4M3", E5M2: "E5M2"}.get(dtype, str(dtype).replace("torch.", ""))


class Refused(Exception):
    """The kernel raised: the variant's result is REFUSED."""


def operand(rows: int, cols: int, dtype: torch.dtype, block, device: torch.device, gen: torch.Generator):
    from fp8_plugin.numerics.quantizers import QuantizedTensor

    # Values across the format's range up to 448, power-of-two scales 2^-7 to 2^-3 (block) or 2^-5
    # (tensorwise): every product exact, float16 outputs far from overflow.
    data = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(dtype)
    if block is None:
        scale_inv = torch.tensor(2.0**-5)
    else:
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale_inv = torch.exp2(torch.randint(-7, -2, grid, generator=gen).float())
    return QuantizedTensor(data.to(device), scale_inv.to(device), block)


def compare(got: torch.Tensor, expected: torch.Tensor, s: torch.Tensor, k: int, blocks: int, out_dtype) -> str:
    """``PASS ...`` or ``FAIL ...`` for ``got`` against ``expected`` under the module's bound."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"FAIL shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    if torch.equal(got, expected):
        return "PASS bit-for-bit"
    u = UNIT_ROUNDOFF[torch.float32]
    gamma = k * u / (1 - k * u)
    accumulation = 2 * (gamma + blocks * u) * s
    if got.device.type == "cuda":  # the native side ran on tensor cores
        c, u_tc = min(k, TENSOR_CORE_CHUNK), TENSOR_CORE_UNIT_ROUNDOFF
        accumulation = accumulation + c * u_tc / (1 - c * u_tc) * s
    e = expected.double()
    bound = accumulation + 2 * UNIT_ROUNDOFF.get(out_dtype, u) * (e.abs() + accumulation)
    error = (got.double() - e).abs()
    if not bool(torch.isfinite(got.double()).all()):
        return "FAIL non-finite output"
    worst = (error / bound.clamp_min(1e-300)).max().item()
    verdict = "PASS within bound" if worst <= 1 else "FAIL beyond bound"
    return f"{verdict} (worst error {worst:.3g} of the bound; max |error| {error.max().item():.3g})"


def magnitude(a, b) -> torch.Tensor:
    """``|A| @ |B|^T`` of the dequantized operands, float64, ``[M, N]``."""
    return a.dequantize(saturate=False).double().abs() @ b.dequantize(saturate=False).double().abs().t()


def run_kernel(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    try:
        out = fn()
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        return out
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        if any(marker in str(err) for marker in CUDA_ERRORS):
            raise
        raise Refused(str(err).splitlines()[0] if str(err) else type(err).__name__) from err


def variants(device: torch.device) -> Iterator[tuple[str, Callable[[], str]]]:
    """``(name, run)`` for every variant on ``device``; ``run()`` returns the result's words."""
    from fp8_plugin.numerics import gemm, gemm_kernels
    from fp8_plugin.numerics.device_kind import cuda_capability, device_kind

    kind_of = device_kind(device)
    major = cuda_capability(device)[0] if kind_of == "cuda" else None

    for kind in gemm.GEMM_KINDS:
        def decision(kind=kind):
            support = gemm.native_gemm(kind, device)
            if not support.native:
                return f"INFO not native: {support.reason}"
            if support.pairings is None:
                return f"INFO native, writes {', '.join(fmt(d) for d in support.out_dtypes)}"
            parts = [f"{fmt(a)} x {fmt(b)}: {', '.join(fmt(d) for d in outs) or 'emulated (' + why + ')'}"
                     for a, b, outs, why in support.pairings]
            return "INFO native; " + "; ".join(parts)
        yield f"decision {kind}", decision

    # On CPU (the rehearsal) a smaller product: CPUs with AMX hand E4M3 x E4M3 to a oneDNN
    # reference kernel of about 200 ns per multiply-accumulate, 8 s per GEMM at the GPU's size.
    m, k, n = (256, 512, 384) if kind_of == "cuda" else (64, 128, 96)
    for fa in (E4M3, E5M2):
        for fb in (E4M3, E5M2):
            for out_dtype in OUT_DTYPES:
                for with_bias in (False, True):
                    def tensorwise(fa=fa, fb=fb, out_dtype=out_dtype, with_bias=with_bias):
                        gen = torch.Generator().manual_seed(1)
                        a, b = operand(m, k, fa, None, device, gen), operand(n, k, fb, None, device, gen)
                        bias = (torch.randn(n, generator=gen) * 4).to(device) if with_bias else None
                        expected = gemm_kernels.emulated(a, b, out_dtype, bias)
                        try:
                            got = run_kernel(lambda: gemm_kernels.scaled_mm_tensorwise(a, b, out_dtype, bias))
                        except Refused as why:
                            expected_refusal = kind_of == "cuda" and fa == fb == E5M2
                            return f"REFUSED{' (expected: the project emulates E5M2 x E5M2)' if expected_refusal else ''}: {why}"
                        s = magnitude(a, b) + (bias.double().abs() if bias is not None else 0)
                        return compare(got, expected, s, k, 1, out_dtype)
                    yield (f"tensorwise {fmt(fa)} x {fmt(fb)} -> {fmt(out_dtype)}{' +bias' if with_bias else ''} "
                           f"{m}x{k}x{n}", tensorwise)

    block_majors = {"blockwise": (9,), "mxfp8": (10, 11, 12)}
    layouts = {"blockwise": (((1, 128), (128, 128)), ((1, 128), (1, 128))), "mxfp8": (((1, 32), (1, 32)),)}
    for kind in ("blockwise", "mxfp8"):
        # On CPU they run too (torch refuses them there): the rehearsal exercises every line.
        runs_here = major in block_majors[kind] or kind_of == "cpu"
        why_not = (f"{kind} kernels are for sm{'/sm'.join(str(x) + 'x' for x in block_majors[kind])}, "
                   f"this device is {kind_of if major is None else f'sm{major}x'}")
        for block_a, block_b in layouts[kind]:
            for fa, fb in BLOCK_PAIRINGS:
                for out_dtype in OUT_DTYPES:
                    def block_gemm(kind=kind, block_a=block_a, block_b=block_b, fa=fa, fb=fb, out_dtype=out_dtype,
                                   runs_here=runs_here, why_not=why_not):
                        if not runs_here:
                            return f"SKIP {why_not}"
                        gen = torch.Generator().manual_seed(2)
                        a, b = operand(256, 512, fa, block_a, device, gen), operand(256, 512, fb, block_b, device, gen)
                        expected = gemm_kernels.emulated(a, b, out_dtype)
                        try:
                            got = run_kernel(lambda: gemm_kernels.scaled_mm_blocks(kind, a, b, out_dtype))
                        except Refused as why:
                            return f"REFUSED: {why}"
                        return compare(got, expected, magnitude(a, b), 512, 512 // block_a[1], out_dtype)
                    name_b = f"{block_b[0]}x{block_b[1]}"
                    yield (f"{kind} {block_a[0]}x{block_a[1]} x {name_b} {fmt(fa)} x {fmt(fb)} -> {fmt(out_dtype)} "
                           f"256x512x256", block_gemm)

    # The project's GEMM where no kernel takes the shapes as they are: padded on CUDA.
    for kind, block_a, block_b, fb in (("tensorwise", None, None, E4M3), ("blockwise", (1, 128), (128, 128), E4M3),
                                       ("mxfp8", (1, 32), (1, 32), E4M3)):
        def padded(kind=kind, block_a=block_a, block_b=block_b, fb=fb):
            if kind != "tensorwise" and major not in block_majors[kind] and kind_of != "cpu":
                return f"SKIP {kind} is not native here"
            gen = torch.Generator().manual_seed(3)
            a, b = operand(120, 200, E5M2, block_a, device, gen), operand(72, 200, fb, block_b, device, gen)
            expected = gemm_kernels.emulated(a, b, torch.bfloat16)
            got = run_kernel(lambda: gemm.fp8_gemm(a, b, torch.bfloat16))
            blocks = 1 if block_a is None else -(-200 // block_a[1])
            return compare(got, expected, magnitude(a, b), 200, blocks, torch.bfloat16)
        yield f"fp8_gemm {kind} E5M2 x E4M3 -> bfloat16 120x200x72 (padded)", padded

    yield from grouped_variants(device, major, kind_of)
    yield from cast_kernel_variants(device, kind_of)


def cast_kernel_variants(device: torch.device, kind_of: str) -> Iterator[tuple[str, Callable[[], str]]]:
    """The fused per-tensor cast kernels (fp8_plugin/numerics/kernels/tensorwise.py) against the
    torch ops on the same device, byte for byte: every BF16 bit pattern, and current scaling."""
    # On CPU tensors Triton runs only under its interpreter: the reason, or "" where the kernels run.
    cannot_run = ("SKIP the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1"
                  if kind_of == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" else "")
    for fmt_dtype in (E4M3, E5M2):
        for scale in (1.0, 1 / 3):
            def cast(fmt_dtype=fmt_dtype, scale=scale):
                if cannot_run:
                    return cannot_run
                from fp8_plugin.numerics.kernels import tensorwise

                x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
                x = x.reshape(256, 256).to(device)
                s = torch.tensor(scale, device=device)
                amax = torch.zeros(1, device=device)
                data, data_t = tensorwise.cast_transpose(x, s, fmt_dtype, transpose=True, amax_out=amax)
                ref, ref_t, ref_amax = tensorwise.reference_cast(x, s, fmt_dtype, True)
                wrong = int((data.view(torch.uint8) != ref.view(torch.uint8)).sum())
                wrong_t = int((data_t.view(torch.uint8) != ref_t.view(torch.uint8)).sum())
                same_amax = bool(amax.isnan().item()) == bool(ref_amax.isnan().item())
                if wrong or wrong_t or not same_amax:
                    return f"FAIL {wrong} rowwise and {wrong_t} transposed bytes differ from torch's; amax NaN alike: {same_amax}"
                return "PASS bit-for-bit (65,536 values, both copies, amax)"
            yield f"cast kernel bf16 patterns -> {fmt(fmt_dtype)} x {scale:.4g} cast-transpose-amax", cast

        for recipe_name in ("current", "delayed", "blockwise", "mxfp8"):
            for initialized in ((False, True) if recipe_name == "delayed" else (False,)):
                def quantizer(fmt_dtype=fmt_dtype, recipe_name=recipe_name, initialized=initialized):
                    return cannot_run or quantizer_against_torch(device, fmt_dtype, recipe_name, initialized)
                when = "" if recipe_name != "delayed" else f" ({'steady state' if initialized else 'first cast'})"
                yield f"cast kernel {recipe_name} scaling bf16 {_cast_rows(device)}x300 -> {fmt(fmt_dtype)}{when}", quantizer


def _cast_rows(device: torch.device) -> int:
    # Rows of the cast checks: 1000 on a GPU; 130 under Triton's interpreter on CPU (a rehearsal),
    # still more than one tile and not a multiple of one.
    return 1000 if device.type == "cuda" else 130


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Equal, a NaN equal to a NaN (an MXFP8 block with an infinity has a NaN scale).
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def quantizer_against_torch(device: torch.device, fmt_dtype: torch.dtype, recipe_name: str, initialized: bool) -> str:
    """A layer's cast through the fused kernels against the torch ops: the FP8 copies, scale_inv
    and the scaling state afterwards (amax history, scale, counters), byte for byte."""
    import fp8_plugin
    from fp8_plugin.numerics.kernels import force_kernels
    from fp8_plugin.numerics.quantizers import ScalingState, make_quantizer

    # HYBRID: E4M3 for the input (role 0), E5M2 for grad_output (role 2).
    role = 0 if fmt_dtype == E4M3 else 2
    recipe = {"current": lambda: fp8_plugin.Float8CurrentScaling(fp8_format="HYBRID"),
              "delayed": lambda: fp8_plugin.DelayedScaling(fp8_format="HYBRID", amax_history_len=4),
              "blockwise": lambda: fp8_plugin.Float8BlockScaling(fp8_format="HYBRID"),
              "mxfp8": lambda: fp8_plugin.MXFP8BlockScaling(fp8_format="HYBRID")}[recipe_name]()
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(_cast_rows(device), 300, generator=gen) * 7).to(torch.bfloat16).to(device)
    results = []
    for path in ("triton", "torch"):
        state = ScalingState(4, device=device)
        state.scale[role], state.initialized[role], state.amax_history[role, 0] = 3.7, initialized, 2.0
        with force_kernels(path):
            row, col = make_quantizer(recipe, role, state).quantize_pair(x, columnwise=True)
        results.append({"data": row.data.view(torch.uint8), "data_t": col.data.view(torch.uint8),
                        "scale_inv": row.scale_inv, "scale_inv_t": col.scale_inv, **state.tensors()})
    bad = [name for name in results[0] if not _same(results[0][name], results[1][name])]
    return f"FAIL differs from torch's: {', '.join(bad)}" if bad else "PASS bit-for-bit (both copies, scale_inv, state)"


def grouped_variants(device: torch.device, major, kind_of: str) -> Iterator[tuple[str, Callable[[], str]]]:
    from fp8_plugin.numerics import grouped_gemm as gg

    for counts in ((5, 0, 37, 16), (16, 32, 0, 16)):
        def offsets_of(counts=counts):
            return torch.tensor(counts).cumsum(0).to(torch.int32).to(device)

        for name in ("_scaled_grouped_mm E4M3 x E4M3", "_grouped_mm bf16 E5M2 x E4M3", "_grouped_mm bf16 wgrad E5M2 x E4M3"):
            # offsets_of bound here: a closure would see the loop's last one (rows past the
            # operand's end: a device-side assertion in torch's kernel setup, not a kernel fault).
            def grouped(name=name, counts=counts, offsets_of=offsets_of):
                if major not in (9, 10) and kind_of != "cpu":
                    return "SKIP torch's grouped FP8 kernels are for sm90 / sm100"
                gen = torch.Generator().manual_seed(4)
                rows, groups = sum(counts), len(counts)
                fa = E4M3 if name.startswith("_scaled") else E5M2
                a = (torch.randn(rows, 64, generator=gen) * 64).clamp(-448, 448).to(fa).to(device)
                b = (torch.randn(groups, 32, 64, generator=gen) * 64).clamp(-448, 448).to(E4M3).to(device)
                x = (torch.randn(rows, 64, generator=gen) * 64).clamp(-448, 448).to(E4M3).to(device)
                sa = torch.exp2(torch.randint(-7, -2, (groups,), generator=gen).float()).to(device)
                sb = torch.exp2(torch.randint(-7, -2, (groups,), generator=gen).float()).to(device)
                offsets = offsets_of()
                with torch.autocast(kind_of, enabled=False):
                    if "wgrad" in name:
                        g = a[:, :32].contiguous()
                        expected = gg._emulated_wgrad(g, sa, x, sb, offsets, torch.float32)
                        call = lambda: gg._bf16_grouped_wgrad(g, sa, x, sb, offsets, torch.float32)  # noqa: E731
                        s = _grouped_wgrad_magnitude(g, sa, x, sb, counts)
                        k = max(counts)
                    else:
                        native = gg._native if fa == E4M3 else gg._bf16_grouped
                        expected = gg._emulated(a, sa, b, sb, offsets, torch.float32)
                        call = lambda: native(a, sa, b, sb, offsets, torch.float32)  # noqa: E731
                        s = _grouped_magnitude(a, sa, b, sb, counts)
                        k = 64
                    try:
                        got = run_kernel(call)
                    except Refused as why:
                        return f"REFUSED: {why}"
                # Both write bfloat16 before the float32 scales (module docstring of grouped_gemm).
                return compare(got, expected, s, k, 1, torch.bfloat16)
            starts = ", ".join(str(s) for s in (0, *torch.tensor(counts).cumsum(0).tolist()[:-1]))
            yield f"grouped {name} groups {list(counts)} (starts {starts})", grouped


def _grouped_magnitude(a, sa, b, sb, counts) -> torch.Tensor:
    rows = []
    start = 0
    for g, c in enumerate(counts):
        rows.append((a[start:start + c].double().abs() * sa[g].item()) @ (b[g].double().abs() * sb[g].item()).t())
        start += c
    return torch.cat(rows).to(a.device)


def _grouped_wgrad_magnitude(g, sg, x, sx, counts) -> torch.Tensor:
    out = []
    start = 0
    for i, c in enumerate(counts):
        out.append((g[start:start + c].double().abs() * sg[i].item()).t() @ (x[start:start + c].double().abs() * sx[i].item()))
        start += c
    return torch.stack(out).to(g.device)


def child(device_name: str, start: int, crash_in: str = "", only: str = "") -> int:
    """Run the variants from index ``start``, one ``RESULT`` line each; exit POISONED after a CUDA error.

    ``crash_in``: comma-separated texts; the process aborts in the variants whose name contains
    one ("hang:" first: it sleeps instead), so that the rehearsal shows a fatal fault costs one
    line, not the rest.
    """
    import warnings

    warnings.simplefilter("ignore")  # "FP8 GEMM emulated ...": the lines say what ran
    device = torch.device(device_name)
    chosen = [(name, run) for name, run in variants(device) if only in name]
    for index, (name, run) in enumerate(chosen):
        if index < start:
            continue
        print(f"START\t{index}\t{name}", flush=True)
        for fault in filter(None, crash_in.split(",")):
            if fault.removeprefix("hang:") in name:
                time.sleep(3600) if fault.startswith("hang:") else os.abort()
        try:
            words = run()
        except Exception as err:  # noqa: BLE001 - every failure is a result line
            words = f"FAIL {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if any(marker in str(err) for marker in CUDA_ERRORS):
                print(f"{RESULT}{index}\t{name}\t{words}", flush=True)
                return POISONED
        print(f"{RESULT}{index}\t{name}\t{words}", flush=True)
    print("DONE", flush=True)
    return 0


def _assertions(stderr: list[str]) -> str:
    """The distinct device-side assertion messages in a child's stderr (one per kernel and
    condition, not one per thread), as a suffix for its result line; empty if none."""
    seen: dict[str, None] = {}
    for line in stderr:
        if "Assertion" in line:
            seen[re.sub(r"(block|thread): \[[0-9,]*\],? ?", "", line).strip()] = None
    return ("; device-side: " + " | ".join(list(seen)[:3])) if seen else ""


def parent(device_name: str, timeout: float, output, crash_in: str = "", only: str = "") -> int:
    """Run children until every variant has a result line; write and print them; exit 1 on FAIL or CRASH."""
    lines: list[str] = []
    start, total_start = 0, time.time()
    while True:
        current, done, printed = None, False, []
        # stderr to a file: a chatty child must not block on a full pipe.
        stderr_file = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, __file__, "--child", "--device", device_name, "--start", str(start),
                                 "--crash-in", crash_in, "--only", only],
                                stdout=subprocess.PIPE, stderr=stderr_file, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines_of_child: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines_of_child.put(x) for x in iter(proc.stdout.readline, "")]
                                  + [lines_of_child.put(None)], daemon=True)
        reader.start()
        # The first deadline leaves time for the child's imports (torch, CUDA initialisation).
        deadline = time.time() + max(timeout, STARTUP_S)
        while True:
            try:
                line = lines_of_child.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                proc.kill()
                break  # hung in ``current``
            if line is None:
                break  # exited
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "START":
                current, deadline = (int(fields[1]), fields[2]), time.time() + timeout
            elif fields[0] == "RESULT":
                index, name, words = int(fields[1]), fields[2], fields[3]
                status, _, detail = words.partition(" ")
                lines.append(f"{status.rstrip(':'):8s} {name}: {detail}")
                print(lines[-1], flush=True)
                current, start = None, index + 1
            elif fields[0] == "DONE":
                done = True
            else:
                printed.append(line)  # device-side assertions are printed on stdout
        proc.wait()
        stderr_file.seek(0)
        stderr = stderr_file.read().strip().splitlines()
        stderr_file.close()
        if done:
            break
        if proc.returncode == POISONED and lines:
            # The device-side assertion that poisoned the process: the line says which kernel.
            lines[-1] += _assertions(printed + stderr)
            print(f"         {_assertions(printed + stderr)}", flush=True)
        if current is not None:
            hung = proc.returncode == -9
            tail = " | ".join(stderr[-3:])
            lines.append(f"{'CRASH':8s} {current[1]}: {'hung past ' + str(timeout) + ' s' if hung else 'exit status ' + str(proc.returncode)}"
                         f"{'; stderr: ' + tail if tail else ''}")
            print(lines[-1], flush=True)
            start = current[0] + 1
        elif proc.returncode != POISONED:
            lines.append(f"{'CRASH':8s} (before the first variant): exit status {proc.returncode}; stderr: {' | '.join(stderr[-5:])}")
            print(lines[-1], flush=True)
            break
    counts = {}
    for line in lines:
        counts[line.split()[0]] = counts.get(line.split()[0], 0) + 1
    summary = (f"{len(lines)} variants on {device_name} in {time.time() - total_start:.1f} s: "
               + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    lines.append(summary)
    print(summary, flush=True)
    if output:
        Path(output).write_text("\n".join(lines) + "\n")
    return 1 if counts.get("FAIL") or counts.get("CRASH") else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (the current GPU) or cpu; default: cuda when available")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one variant may take before it counts as hung")
    p.add_argument("--output", type=Path, help="also write the lines to this file")
    p.add_argument("--only", default="", help="run only the variants whose name contains this text (e.g. 'blockwise')")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--crash-in", default="", help=argparse.SUPPRESS)  # the rehearsal's planted fault
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        p.error(f"--device {args.device!r}: valid: cuda, cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; valid here: --device cpu")
    if args.child:
        return child(args.device, args.start, args.crash_in, args.only)
    return parent(args.device, args.timeout, args.output, args.crash_in, args.only)


if __name__ == "__main__":
    sys.exit(main())
