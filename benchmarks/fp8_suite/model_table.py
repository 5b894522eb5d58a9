"""The model table: which runs, in which order, each in a process of its own, within a budget.

Every (model, precision, mode) of :mod:`.training_runs` is one run. On a GPU each runs in a
fresh Python process (``benchmarks/model_table.py --child``) under its own time limit, so that one
run's compiled state, CUDA graphs, torchao's process-wide Inductor patch or an out-of-memory
error cannot touch the next, and a run that hangs costs its limit only. A run that would start
with less than its minimum left of the budget is recorded "not run (budget)"; runs that cannot
run here (torchao not installed, CUDA graphs or compilation on a CPU)
are recorded as not run with the reason, without starting a process.

The GPU order puts the figures still missing first (``GPU_PHASES``): the 8B-shaped block eagerly
and with CUDA graphs, then 1B compiled and against torchao, then 125M, then the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable, Optional

from .common import ROOT, set_ratios
from .training_runs import BASELINE, KINDS, RunResult, RunSpec

SCRIPT = ROOT / "benchmarks" / "model_table.py"
Kind = tuple[str, str]  # (precision, mode)

# GPU: phases of (models, kinds), most valuable first; each model's first phase starts with its
# bf16-mixed eager baseline, which every ratio needs. The H100 run of 2026-11-27 measured 125M
# and 1B eagerly and with CUDA graphs: the 8B-shaped block (the largest expected gain) comes
# first, then the Triton GEMM's eager runs (its host time against torch._scaled_mm's), then the
# compiled and torchao rows of 1B.
_BF16, _FP8, _AO = "bf16-mixed", "fp8-hybrid", "torchao-tensorwise"
GPU_PHASES: tuple[tuple[tuple[str, ...], tuple[Kind, ...]], ...] = (
    (("8b-block",), ((_BF16, "eager"), (_FP8, "eager"), (_FP8, "graphs"), (_FP8, "eager-triton"))),
    (("125m",), ((_BF16, "eager"), (_FP8, "eager-triton"))),
    (("1b",), ((_BF16, "eager"), (_FP8, "eager-triton"), (_AO, "compiled"), (_BF16, "compiled"), (_FP8, "compiled"),
               (_FP8, "graphs"))),
    (("125m",), ((_FP8, "eager"), (_FP8, "graphs"), (_BF16, "compiled"), (_FP8, "compiled"), (_AO, "compiled"))),
    (("1b",), ((_FP8, "eager"), (_AO, "eager"))),
    (("125m",), ((_AO, "eager"),)),
    (("8b-block",), ((_BF16, "compiled"), (_FP8, "compiled"), (_AO, "compiled"), (_AO, "eager"))),
)
CPU_MODELS = ("tiny",)
# Per model: the batch at sequence 2048 on an 80 GB GPU with AdamW (FP32 master weights and
# moments: 16 bytes per parameter before activations); CPU sizes are the suite's.
BATCH = {"125m": 4, "1b": 2, "8b-block": 2, "tiny": 2}
SEQ_LEN = {"cuda": 2048, "cpu": 64}
STEPS = {"cuda": (5, 3), "cpu": (2, 1)}  # (timed, warm-up) steps
# Per mode, seconds: a run's own limit, and the least budget left for it to start (process start,
# model build and a few steps; compilation of a whole model takes tens of seconds on a GPU).
RUN_LIMIT = {"eager": 45, "eager-triton": 45, "graphs": 60, "compiled": 90}
MIN_START = {"eager": 15, "eager-triton": 15, "graphs": 20, "compiled": 40}
CPU_REASONS = {"compiled": "compile rehearsed on GPU only", "graphs": "CUDA graphs need a CUDA device",
               "eager-triton": "the Triton GEMM runs on CUDA GPUs"}


def plan(device: str, models: Optional[Iterable[str]] = None, kinds: Optional[Iterable[Kind]] = None,
         batch: Optional[int] = None, seq_len: Optional[int] = None, steps: Optional[int] = None,
         warmup: Optional[int] = None) -> list[RunSpec]:
    """The runs in order: the GPU phases, or every kind of the CPU's tiny model; ``models`` and
    ``kinds`` keep only those (in this order), the others override the defaults."""
    phases = GPU_PHASES if device == "cuda" else ((CPU_MODELS, KINDS),)
    wanted_models, wanted_kinds = set(models or ()), set(kinds or ())
    default_steps, default_warmup = STEPS[device]
    specs = []
    for names, phase_kinds in phases:
        for name in names:
            if wanted_models and name not in wanted_models:
                continue
            for precision, mode in phase_kinds:
                if wanted_kinds and (precision, mode) not in wanted_kinds:
                    continue
                specs.append(RunSpec(name, precision, mode, batch or BATCH[name], seq_len or SEQ_LEN[device],
                                     steps or default_steps, default_warmup if warmup is None else warmup, device))
    if models:  # models the phases do not name (a CPU model on the GPU, say): every kind
        for name in [m for m in models if m not in {s.model for s in specs}]:
            specs += [RunSpec(name, p, m, batch or BATCH.get(name, 2), seq_len or SEQ_LEN[device],
                              steps or default_steps, default_warmup if warmup is None else warmup, device)
                      for p, m in KINDS if not wanted_kinds or (p, m) in wanted_kinds]
    return specs


def torchao_installed() -> bool:
    """Whether torchao can be imported (found, not imported: it patches torch when it is)."""
    return importlib.util.find_spec("torchao") is not None


def skip_reason(spec: RunSpec) -> Optional[str]:
    """Why ``spec`` cannot run here (decided without starting it), or None."""
    if spec.precision.startswith("torchao") and not torchao_installed():
        return "torchao not installed"
    if spec.device == "cpu":
        return CPU_REASONS.get(spec.mode)
    return None


class _Child:
    """The run in flight, so that a SIGTERM (gpu_run.sh's step limit) can end its process group."""

    process: Optional[subprocess.Popen] = None

    @classmethod
    def kill(cls) -> None:
        if cls.process is not None and cls.process.poll() is None:
            try:
                os.killpg(cls.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            cls.process.wait()


def run_isolated(spec: RunSpec, limit_s: float) -> RunResult:
    """Run ``spec`` in a fresh process (its own process group) for at most ``limit_s`` seconds."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        row = Path(tmp) / "row.json"
        command = [sys.executable, str(SCRIPT), "--child", json.dumps(asdict(spec)), "--row-out", str(row)]
        _Child.process = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
        try:
            status = _Child.process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _Child.kill()
            status = None
        finally:
            _Child.process = None
        if row.exists():
            result = RunResult(**json.loads(row.read_text()))
        elif status is None:
            result = RunResult.of(spec, "timed out", f"after {limit_s:.0f} s")
        else:  # killed by a signal (the kernel's OOM killer: -9) or died in a kernel
            result = RunResult.of(spec, "failed", f"the run's process ended with exit status {status} and no result")
    result.seconds = time.perf_counter() - began
    return result


def add_ratios(results: list[RunResult]) -> None:
    """Speed-up and memory ratio of each run against its model's bf16-mixed eager run."""
    set_ratios(results, lambda r: r.model, lambda r: (r.precision, r.mode) == BASELINE and r.status == "ran")


def run_table(specs: list[RunSpec], budget_s: Optional[float], isolate: bool, log: Callable[[str], None],
              saved: Callable[[list[RunResult]], None], measure: Optional[Callable[[RunSpec], RunResult]] = None
              ) -> list[RunResult]:
    """Every run of ``specs`` in order; ``saved(results)`` after each, so that a cut-off table
    keeps what it measured. ``budget_s`` None: no budget (each isolated run still has its limit).
    ``measure``: how a run runs in this process (``isolate`` False)."""
    start = time.perf_counter()
    results: list[RunResult] = []
    previous = signal.signal(signal.SIGTERM, _end_on_sigterm)
    try:
        for spec in specs:
            left = None if budget_s is None else budget_s - (time.perf_counter() - start)
            reason = skip_reason(spec)
            if reason is not None:
                result = RunResult.of(spec, "not run", reason)
            elif left is not None and left < MIN_START[spec.mode]:
                result = RunResult.of(spec, "not run", f"budget: {max(left, 0):.0f} s of {budget_s:.0f} s left")
            else:
                try:
                    limit = min(RUN_LIMIT[spec.mode], left if left is not None else float("inf"))
                    result = run_isolated(spec, limit) if isolate else measure(spec)
                except SystemExit:  # SIGTERM: the caller's own limit ended the table in this run
                    results.append(RunResult.of(spec, "timed out", "the table's process was ended during this run"))
                    saved(results)
                    raise
            results.append(result)
            add_ratios(results)
            saved(results)
            log(describe(result))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results


def _end_on_sigterm(signum, frame) -> None:
    _Child.kill()
    raise SystemExit(124)  # as `timeout` reports a command it ended


def describe(r: RunResult) -> str:
    """One log line for a run."""
    head = f"{r.model} {r.precision} {r.mode}"
    if r.status != "ran":
        return f"{head}: {r.status} ({r.error})"
    ratio = f", {r.speedup:.2f}x bf16 eager" if r.speedup else ""
    fp8 = f", {r.fp8_layers}/{r.linear_layers} layers FP8" if r.fp8_layers is not None else ""
    breaks = f", graph breaks: {r.graph_breaks}" if r.graph_breaks else ""
    return f"{head}: {r.step_ms:.1f} ms/step, {r.tokens_per_s:,.0f} tokens/s{ratio}{fp8}, {r.seconds:.0f} s in all{breaks}"
