"""What every section of the suite shares: the device, clocks, peak memory, the environment."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import fp8_plugin

ROOT = Path(__file__).resolve().parents[2]

# The recipes measured side by side, by the names the tables use.
RECIPES: dict[str, Callable[[], fp8_plugin.Recipe]] = {
    "delayed": fp8_plugin.DelayedScaling,
    "current": fp8_plugin.Float8CurrentScaling,
    "mxfp8": fp8_plugin.MXFP8BlockScaling,
    "blockwise": fp8_plugin.Float8BlockScaling,
}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Free what the last measurement left behind and restart the peak-memory counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """The most memory torch held on the GPU since :func:`release_memory` (None on CPU: torch
    counts no allocations there)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model (``lscpu``) with its core count and torch's threads."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def git_commit() -> str:
    """The checkout's short commit, with ``-dirty`` when tracked files differ from it;
    ``unknown`` outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def write_report(output: Path, data: dict, table: str) -> None:
    """Write ``data`` as JSON to ``output`` and ``table`` (markdown) next to it as ``.md``, and
    print the table and where both went."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=1, default=str))
    output.with_suffix(".md").write_text(table)
    print(table)
    print(f"written: {output} and {output.with_suffix('.md')}")


def environment(device: torch.device) -> dict:
    """Device, versions, commit, date and command line of this run."""
    from fp8_plugin.numerics.device import bf16_matmul_is_fast

    bf16_fast, bf16_why = bf16_matmul_is_fast(device.type)
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "bf16_matmul_fast": bf16_fast,
        "bf16_matmul": bf16_why,
    }


def set_ratios(results: list, baseline_key: Callable[[Any], Any], is_baseline: Callable[[Any], bool]) -> None:
    """Each result's ``speedup`` (tokens/s) and ``memory_ratio`` (peak bytes) against the baseline
    result of its ``baseline_key`` (results of the model table and of the suite's model section)."""
    base = {baseline_key(r): r for r in results if is_baseline(r)}
    for r in results:
        b = base.get(baseline_key(r))
        if b is None or r is b:
            continue
        if r.tokens_per_s and b.tokens_per_s:
            r.speedup = r.tokens_per_s / b.tokens_per_s
        if r.peak_bytes and b.peak_bytes:
            r.memory_ratio = r.peak_bytes / b.peak_bytes


def describe_error(err: BaseException) -> str:
    """One line for a run that failed: the error's type and first line, and for a graph break of
    ``torch.compile`` (``torch._dynamo.exc.Unsupported``, whose first line names only the kind)
    its developer context and the innermost line of user code it broke at."""
    text = str(err)
    line = f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"
    context = re.search(r"Developer debug context: (.*)", text)
    if context:
        line += f"; {context.group(1).strip()[:200]}"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text.split("from user code:")[-1])
    if "from user code:" in text and frames:
        path, number, function = frames[-1]
        line += f" (at {'/'.join(Path(path).parts[-2:])}:{number}, in {function})"
    return line


def graph_break_reasons(limit: int = 3) -> str:
    """The ``limit`` most frequent graph-break reasons torch.compile has counted in this process
    (``torch._dynamo.utils.counters["graph_break"]``), with their counts; "" if none."""
    from torch._dynamo.utils import counters

    breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])[:limit]
    return "; ".join(f"{count}x {reason.splitlines()[0][:160]}" for reason, count in breaks)


def scaled_mm_too_slow(device: torch.device) -> Optional[str]:
    """Why torchao's rows are not run on this CPU, or None: torchao's ``Float8Linear`` calls
    ``torch._scaled_mm`` whatever it costs, and on CPUs with AMX oneDNN runs E4M3 x E4M3 in a
    reference kernel (about 200 ns per multiply-accumulate: minutes per step of the tiny model).
    Judged by fp8-plugin's own per-pairing measurement (``tensorwise_choice``): a kernel it timed
    at more than 8 times the emulation. GPUs, and CPUs where torch computes ``_scaled_mm``
    itself, run them."""
    if device.type != "cpu":
        return None
    from fp8_plugin.numerics.gemm import tensorwise_choice

    e4m3 = torch.float8_e4m3fn
    choice = tensorwise_choice(device, e4m3, e4m3, torch.bfloat16)
    if choice.native or choice.same_computation or not choice.native_s > 8 * choice.emulated_s:
        return None
    return (f"not run on this CPU: torch._scaled_mm, which torchao calls, is slow here for E4M3 x E4M3 "
            f"({choice.describe()})")
