"""The model table: Llama-style models trained as users run them, every precision and mode side by side.

Models at sequence 2048 on a GPU: 125M, ~1B (hidden 2048, 16 layers) and one 8B-shaped block
(hidden 4096, intermediate 14336, 32 heads, 8 KV heads, one layer, vocabulary 32000). Per model:
``bf16-mixed`` eager and compiled; ``fp8-hybrid`` eager, eager with CUDA graphs and compiled;
torchao's tensorwise ``Float8Linear`` compiled and eager. A plain training loop (AdamW), as an
Accelerate or Lightning user's step runs it (``fp8_suite/training_runs.py``); tokens/s and peak
GPU memory, each against the same model's ``bf16-mixed`` eager run.

On a GPU each run is a process of its own under its own time limit, in a budget (``--budget``):
``fp8_suite/model_table.py`` says the order and the limits. On a CPU it is a rehearsal at CPU
sizes (the tiny model, sequence 64, two steps), compiled modes not run.

    python benchmarks/model_table.py --budget 230 --output runs/benchmarks/models.json   # one GPU
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/model_table.py --device cpu           # about 20 s
    python benchmarks/model_table.py --models 8b-block --runs fp8-hybrid:eager,bf16-mixed:eager

Writes the JSON (``--output``; rewritten after every run, so that a table cut short keeps what it
measured) and the markdown next to it (``.md``), and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8_plugin from this checkout

import torch  # noqa: E402
import transformers  # noqa: E402

from fp8_suite import model_table, results, training_runs  # noqa: E402  (benchmarks/)
from fp8_suite.common import device_name, git_commit  # noqa: E402


def _kinds(text: str) -> list[tuple[str, str]]:
    kinds = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        precision, _, mode = item.partition(":")
        if (precision, mode) not in training_runs.KINDS:
            valid = ",".join(f"{p}:{m}" for p, m in training_runs.KINDS)
            raise argparse.ArgumentTypeError(f"{item!r} is not a run kind; valid: {valid}")
        kinds.append((precision, mode))
    return kinds


def _models(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in training_runs.SIZES]
    if unknown:
        valid = ",".join(training_runs.SIZES)
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: not a model size; valid: {valid}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda when available")
    p.add_argument("--models", type=_models, help=f"of: {','.join(training_runs.SIZES)} (default: GPU 125m,1b,8b-block "
                                                  "in the table's order; CPU tiny)")
    p.add_argument("--runs", type=_kinds, help="precision:mode pairs to keep, comma-separated (default: all)")
    p.add_argument("--batch-size", type=int, help="every model's batch (default: 125m 4, 1b 2, 8b-block 2, tiny 2)")
    p.add_argument("--seq-len", type=int, help="default: GPU 2048, CPU 64")
    p.add_argument("--steps", type=int, help="timed steps per run (default: GPU 5, CPU 2)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default: GPU 3, CPU 1)")
    p.add_argument("--budget", type=float, help="seconds for the whole table: a run that would start with less "
                                                "than its minimum left is not run (default: none)")
    p.add_argument("--in-process", action="store_true",
                   help="every run in this process, without time limits (the CPU rehearsal's test)")
    p.add_argument("--output", type=Path, default=Path("runs/benchmarks/models.json"),
                   help="JSON to write; the markdown goes next to it as .md (default runs/benchmarks/models.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one run's RunSpec as JSON (model_table.run_isolated)
    p.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)  # where the child writes its RunResult
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    return args


def quiet() -> None:
    """Messages this synthetic set-up causes on purpose (emulated GEMMs on a CPU) and
    transformers' chatter."""
    warnings.filterwarnings("ignore", message="FP8 GEMM emulated in float32")
    transformers.logging.set_verbosity_error()


def environment(device: str) -> dict:
    """Device (as torch reports it), torch, commit, date and command line; no timed probe."""
    return {
        "device": device_name(torch.device(device)),
        "device_type": device,
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
    }


def child(spec_json: str, row_out: Path) -> None:
    """One run in this process (started by ``model_table.run_isolated``): its row to ``row_out``."""
    result = training_runs.measure(training_runs.RunSpec(**json.loads(spec_json)))
    row_out.write_text(json.dumps(asdict(result)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet()
    if args.child:
        child(args.child, args.row_out)
        return {}
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", flush=True)

    specs = model_table.plan(args.device, args.models, args.runs, args.batch_size, args.seq_len, args.steps,
                             args.warmup)
    env = environment(args.device)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "child", "row_out")}
    out = {"environment": env, "settings": settings, "results": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def saved(rows: list[training_runs.RunResult]) -> None:
        out["results"] = [asdict(r) for r in rows]
        out["environment"]["elapsed_s"] = time.perf_counter() - start
        args.output.write_text(json.dumps(out, indent=1, default=str))

    log(f"{env['device']}; torch {env['torch']}; commit {env['commit']}; {len(specs)} runs"
        + (f" in {args.budget:.0f} s" if args.budget else ""))
    saved([])
    model_table.run_table(specs, args.budget, not args.in_process, log, saved, training_runs.measure)
    table = results.render_markdown(results.model_rows(out))
    args.output.with_suffix(".md").write_text(table)
    print(table)
    print(f"written: {args.output} and {args.output.with_suffix('.md')}")
    return out


if __name__ == "__main__":
    main()
