"""Bookkeeping: what FP8 training costs per step outside the GEMMs and casts, as a share of the step.

A Lightning ``FP8Precision`` run is timed with the project's per-step methods wrapped by timers
(device synchronised on entry and exit, a nested timed call counted once, in the inner one):

- the delayed-scaling scale updates, ``fp8_plugin.modules.scaling_group.ScalingGroup.update`` (its amax
  reduction excluded);
- the amax reduction, the reducer ``FP8Training`` gets from ``amax_reducer`` (an all-reduce; on
  one process there is none, so it costs nothing);
- the per-step fault check, ``fp8_plugin.training.faults.FaultMonitor.check``;
- the statistics, ``FP8Training.metrics``: called every step here (a logger with
  ``log_every_n_steps=1``), counted at Lightning's default logging interval (50 steps);
- the BF16 reference checks, run every ``check_every`` steps, their own timing
  (``ReferenceResult.seconds``, the checks after the first) projected at the default interval
  ``ReferenceCheck().every``: cost / (interval x step time).

Each share is of the mean step time of the timed steps that ran no check. The non-FP8 ops run in
BF16 where this device's BF16 matmuls are fast, and in FP32 where they are not (CPUs without
AVX512-BF16 or AMX run them ~100x slower than FP32): a step inflated by slow BF16 kernels would
make every share look smaller than it is.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.loggers.logger import DummyLogger
from torch.utils.data import DataLoader

import fp8_plugin
import fp8_plugin.training.core as fp8_training
from fp8_plugin.training.faults import FaultMonitor
from fp8_plugin.modules.scaling_group import ScalingGroup
from fp8_plugin.training.core import FP8Training

from . import models
from .common import ROOT, synchronize

METRICS_INTERVAL = 50  # Lightning's default log_every_n_steps
COMPONENTS = ("scale update", "amax reduction", "fault check", "metrics", "reference check")


class Timers:
    """Seconds spent inside wrapped callables, per name, the device synchronised around each call.

    A call made inside another timed call is counted in its own name only (exclusive times).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._nested: list[float] = []

    def wrap(self, fn: Callable, name: str) -> Callable:
        """``fn`` with its time (less its timed nested calls) added to ``name``."""
        def timed(*args, **kwargs):
            synchronize(self.device)
            start = time.perf_counter()
            self._nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(self.device)
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self._nested.pop()
                self.calls[name] += 1
                if self._nested:
                    self._nested[-1] += elapsed

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator["Timers"]:
        """The project's per-step methods wrapped while inside (restored on exit)."""
        make_reducer = fp8_training.amax_reducer

        def timed_reducer(group=None):
            reducer = make_reducer(group)
            return self.wrap(reducer, "amax reduction") if reducer is not None else None

        patches = [(ScalingGroup, "update", self.wrap(ScalingGroup.update, "scale update")),
                   (FaultMonitor, "check", self.wrap(FaultMonitor.check, "fault check")),
                   (FP8Training, "metrics", self.wrap(FP8Training.metrics, "metrics")),
                   (fp8_training, "amax_reducer", timed_reducer)]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


class _StepTimes(L.Callback):
    """Each step's wall time and the timers' seconds spent in it."""

    def __init__(self, timers: Timers) -> None:
        self.timers = timers
        self.seconds: list[float] = []
        self.components: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        synchronize(self.timers.device)
        self._start = (time.perf_counter(), self.timers.snapshot())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        synchronize(self.timers.device)
        start, before = self._start
        self.seconds.append(time.perf_counter() - start)
        after = self.timers.snapshot()
        self.components.append({k: after[k] - before.get(k, 0.0) for k in after})


@dataclass
class BookkeepingResult:
    """One run's step time and each component's cost: ms per step (per call for metrics and the
    reference check) and share of the step time at the component's default frequency."""

    run: str
    precision: str
    steps_timed: int = 0
    step_ms: Optional[float] = None
    ms: dict[str, Optional[float]] = field(default_factory=dict)
    share: dict[str, Optional[float]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    total_share: Optional[float] = None
    reference_check_every: Optional[int] = None
    reference_default_every: int = 0
    error: Optional[str] = None


def compute_dtype(bf16_fast: bool) -> torch.dtype:
    """BF16 for the non-FP8 ops where BF16 matmuls are fast on the device, else FP32."""
    return torch.bfloat16 if bf16_fast else torch.float32


def _plugin(device: torch.device, dtype: torch.dtype, check_every: int):
    from fp8_plugin.lightning import FP8Precision

    return FP8Precision(fp8_plugin.AutoRecipe(), compute_dtype=dtype, precision="fp8-hybrid", device=device.type,
                        reference_every=check_every)


def _train(module: L.LightningModule, loader, steps: int, device: torch.device, dtype: torch.dtype,
           check_every: int) -> tuple[_StepTimes, Timers, list]:
    timers = Timers(device)
    clock = _StepTimes(timers)
    plugin = _plugin(device, dtype, check_every)
    trainer = models.lightning_trainer(device, steps, [clock], plugins=[plugin], logger=DummyLogger(),
                                       log_every_n_steps=1)
    with timers.installed():
        trainer.fit(module, loader)
    return clock, timers, plugin.fp8.reference.results


def _figures(result: BookkeepingResult, clock: _StepTimes, checks: list, warmup: int) -> None:
    checked = {c.step for c in checks}  # 0-based index of each step that ran a check
    timed = [i for i in range(warmup, len(clock.seconds)) if i not in checked]
    step = statistics.mean(clock.seconds[i] for i in timed)
    result.steps_timed, result.step_ms = len(timed), step * 1e3
    for name in COMPONENTS[:3]:
        per_step = statistics.mean(clock.components[i].get(name, 0.0) for i in timed)
        result.ms[name], result.share[name] = per_step * 1e3, per_step / step
    metrics = statistics.mean(clock.components[i].get("metrics", 0.0) for i in timed)  # one call per step
    result.ms["metrics"], result.share["metrics"] = metrics * 1e3, metrics / (METRICS_INTERVAL * step)
    seconds = [c.seconds for c in checks]
    if seconds:
        cost = statistics.median(seconds[1:] or seconds)  # the first check pays one-time costs
        result.ms["reference check"] = cost * 1e3
        result.share["reference check"] = cost / (result.reference_default_every * step)
    result.total_share = sum(v for v in result.share.values() if v is not None)


def _measure(run: str, precision: str, make: Callable[[], tuple[L.LightningModule, object]], steps: int,
             warmup: int, check_every: int, device: torch.device, dtype: torch.dtype) -> BookkeepingResult:
    result = BookkeepingResult(run, precision, reference_check_every=check_every,
                               reference_default_every=fp8_plugin.ReferenceCheck().every)
    try:
        module, loader = make()
        clock, timers, checks = _train(module, loader, warmup + steps, device, dtype, check_every)
        result.calls = dict(timers.calls)
        _figures(result, clock, checks, warmup)
    except Exception as err:  # noqa: BLE001  (reported; the other runs go on)
        result.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return result


def _minilm(batch_size: int, seq_len: int, steps: int):
    """The MiniLM classifier and BBC News loader of ``examples/finetune_classifier.py``."""
    sys.path.insert(0, str(ROOT / "examples"))
    from finetune_classifier import Classifier, make_loaders  # examples/
    from transformers import AutoTokenizer

    from fp8_plugin.tools.data import bbc_news_path, minilm_path

    args = argparse.Namespace(data_path=bbc_news_path(), seed=0, test_fraction=0.2, seq_len=seq_len,
                              batch_size=batch_size)
    model_path = minilm_path()
    train_loader, _, classes, _, _ = make_loaders(args, AutoTokenizer.from_pretrained(model_path))
    L.seed_everything(0, verbose=False)
    return Classifier(str(model_path), len(classes), 1e-4, steps), train_loader


def minilm_available() -> Optional[str]:
    """None when the MiniLM checkpoint and BBC News are installed (the ``data`` extra), else why not."""
    from fp8_plugin.tools.data import bbc_news_path, minilm_path

    try:
        minilm_path(), bbc_news_path()
    except FileNotFoundError as err:
        return str(err)
    return None


def run(model_sizes: list[str], model_batch: tuple[int, int], minilm_batch: tuple[int, int], steps: int,
        warmup: int, check_every: int, device: torch.device, bf16_fast: bool, log: Callable[[str], None]) -> dict:
    """The MiniLM fine-tune (when its data is installed), then each Llama model."""
    models.quiet_lightning()
    dtype = compute_dtype(bf16_fast)
    precision = f"fp8-hybrid, non-FP8 ops in {str(dtype).replace('torch.', '')}"
    results, skipped = [], minilm_available()
    if skipped is None:
        b, s = minilm_batch
        results.append(_measure(f"MiniLM-L6 / BBC News, {b} x {s} tokens", precision,
                                lambda: _minilm(b, s, warmup + steps), steps, warmup, check_every, device, dtype))
    else:
        log(f"bookkeeping: MiniLM run skipped ({skipped})")
    for size in model_sizes:
        b, s = model_batch

        def make(size=size, b=b, s=s):
            model = models.build_model(size, device, s)
            batch = models.random_batch(models.MODEL_SIZES[size]["vocab_size"], b, s, device)
            return models.CausalLM(model), DataLoader([batch] * (warmup + steps), batch_size=None)

        results.append(_measure(f"Llama {size}, {b} x {s} tokens", precision, make, steps, warmup, check_every,
                                device, dtype))
    for r in results:
        log(f"bookkeeping {r.run}: " + (f"total {r.total_share:.2%} of {r.step_ms:.1f} ms/step" if r.step_ms
                                        else f"failed ({r.error})"))
    return {"compute_dtype": str(dtype), "steps": steps, "warmup": warmup, "check_every": check_every,
            "metrics_interval": METRICS_INTERVAL, "minilm_skipped": skipped,
            "results": [asdict(r) for r in results]}
