"""fp8-plugin's benchmark suite: FP8 against BF16 in one run, at four levels.

1. layer: ``FP8Linear`` forward + backward against ``nn.Linear`` under BF16 autocast, per
   recipe, over LLM shapes; torchao's tensorwise ``Float8Linear`` beside them; time, speed-up,
   peak GPU memory, whether the FP8 GEMMs ran natively; ``--compile`` adds the
   ``torch.compile(fullgraph=True)`` variants at the largest shape.
2. model: a training step of Llama-style models (random weights from a ``LlamaConfig``, AdamW)
   through Lightning (``precision="fp8-hybrid"`` against ``"bf16-mixed"``, and torchao under
   ``"bf16-mixed"``) and Accelerate (``mixed_precision="fp8"`` against ``"bf16"``): tokens/s and
   peak memory.
3. bookkeeping: the per-step cost of the FP8 state outside the GEMMs and casts (scale updates,
   amax reduction, fault check, metrics, BF16 reference checks at their default interval) as a
   share of the step time, for the MiniLM fine-tune of ``examples/finetune_classifier.py`` (its
   real checkpoint and BBC News, the ``data`` extra; skipped where not installed) and each model.
4. memory: bytes the FP8 layers save for backward against the same layers under BF16.

Every figure is a ratio against the BF16 run of the same invocation. Writes JSON and a markdown
table (device, torch, commit, date, command line, targets), and prints the table.

    OMP_NUM_THREADS=2 python benchmarks/suite.py --device cpu       # CPU sizes, a few minutes
    python benchmarks/suite.py                                      # GPU sizes, one H100: < 10 min
    python benchmarks/suite.py --quick --sections layer,memory
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8_plugin from this checkout

import torch  # noqa: E402
import transformers  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_suite import bookkeeping, layers, models, report, saved_bytes  # noqa: E402  (benchmarks/)
from fp8_suite.common import RECIPES, environment, write_report  # noqa: E402

SECTIONS = ("layer", "model", "bookkeeping", "memory")
# Per device type: timed layer iterations and model steps, untimed ones before them, the
# bookkeeping runs' timed steps and their reference-check interval.
DEFAULTS = {
    "cuda": dict(steps=10, warmup=3, bookkeeping_steps=30, check_every=10),
    "cpu": dict(steps=4, warmup=1, bookkeeping_steps=30, check_every=10),
}
QUICK = dict(steps=3, warmup=1, bookkeeping_steps=10, check_every=5)


def _shape(text: str) -> layers.Shape:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MxKxN, e.g. 4096x8192x8192") from None
    return m, k, n


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda when available")
    p.add_argument("--sections", type=_list, default=list(SECTIONS),
                   help=f"comma-separated, of: {','.join(SECTIONS)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="two layer shapes, the smallest model, fewer steps: a check that everything runs")
    p.add_argument("--steps", type=int, help="timed layer iterations and model steps (GPU 10, CPU 4, quick 3)")
    p.add_argument("--warmup", type=int, help="untimed iterations / steps before them (GPU 3, CPU 1, quick 1)")
    p.add_argument("--shapes", type=lambda t: [_shape(s) for s in _list(t)],
                   help="layer shapes MxKxN, comma-separated (default: the device's LLM shapes)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile(fullgraph=True) variants, at the largest layer shape")
    p.add_argument("--compile-variants", type=_list,
                   help=f"the layer variants compiled with --compile, of: {','.join(layers.VARIANTS)} (default: all; "
                        "each compiles for up to a minute on a GPU)")
    p.add_argument("--models", type=_list, help=f"model sizes, of: {','.join(models.MODEL_SIZES)} "
                                                "(default: GPU 125m,1b; CPU tiny)")
    p.add_argument("--batch-size", type=int, help="model batch (default: GPU 8, CPU 2)")
    p.add_argument("--seq-len", type=int, help="model sequence length (default: GPU 2048, CPU 64)")
    p.add_argument("--bookkeeping-steps", type=int, help="timed steps of each bookkeeping run (default 30, quick 10)")
    p.add_argument("--check-every", type=int, help="reference-check interval in the bookkeeping runs (default 10, "
                                                   "quick 5); projected to the default interval")
    p.add_argument("--output", type=Path, default=Path("runs/benchmarks/suite.json"),
                   help="JSON file to write; the markdown goes next to it as .md (default runs/benchmarks/suite.json)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.compile_variants or ()) - set(layers.VARIANTS))
    if unknown:
        p.error(f"--compile-variants {','.join(unknown)}: not a layer variant; valid: {','.join(layers.VARIANTS)}")
    unknown = set(args.sections) - set(SECTIONS) or set(args.models or ()) - set(models.MODEL_SIZES)
    if unknown:
        p.error(f"unknown section or model size: {', '.join(sorted(unknown))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    _fill_defaults(args)
    if min(args.steps, args.bookkeeping_steps, args.check_every) < 1 or args.warmup < 0:
        p.error("--steps, --bookkeeping-steps and --check-every must be >= 1, --warmup >= 0")
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """Every setting left unset takes the device's default (the quick one with ``--quick``)."""
    kind = args.device
    for name, value in {**DEFAULTS[kind], **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.shapes is None:
        args.shapes = (layers.QUICK_SHAPES if args.quick else layers.SHAPES)[kind]
    if args.models is None:
        args.models = models.DEFAULT_MODELS[kind][:1] if args.quick else models.DEFAULT_MODELS[kind]
    batch, seq_len = models.DEFAULT_BATCH[kind]
    args.batch_size = args.batch_size or batch
    args.seq_len = args.seq_len or seq_len


def quiet() -> None:
    """Messages that the tables already say (emulated GEMMs) or that this set-up causes on
    purpose (compiled layers look like no FP8 layer ran), and transformers' loading chatter."""
    warnings.filterwarnings("ignore", message="FP8 GEMM emulated in float32")
    warnings.filterwarnings("ignore", message=r"fp8_plugin.autocast\(\) was entered for a training step in which no")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def auto_variant(device: torch.device) -> str:
    """The name in ``RECIPES`` of the recipe ``"fp8-hybrid"`` resolves to on ``device``."""
    recipe = fp8_plugin.auto_recipe(device=device)
    return next(name for name, make in RECIPES.items() if isinstance(recipe, make))


def run_sections(args: argparse.Namespace, device: torch.device, env: dict, log) -> dict:
    """Each section asked for, in order; their results by section name."""
    results = {}
    if "layer" in args.sections:
        compile_shapes = [max(args.shapes, key=math.prod)] if args.compile else []
        results["layer"] = layers.run(args.shapes, args.steps, args.warmup, device, compile_shapes, log,
                                      compile_variants=args.compile_variants)
    batch = (args.batch_size, args.seq_len)
    if "model" in args.sections:
        results["model"] = models.run(args.models, *batch, args.steps, args.warmup, device, log)
    if "bookkeeping" in args.sections:
        results["bookkeeping"] = bookkeeping.run(args.models, batch, saved_bytes.MINILM_BATCH, args.bookkeeping_steps,
                                                 args.warmup, args.check_every, device, env["bf16_matmul_fast"], log)
    if "memory" in args.sections:
        results["memory"] = saved_bytes.run(args.models[0], batch, device, log)
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet()
    device = torch.device(args.device)
    start, load_start = time.perf_counter(), os.getloadavg()[0]

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", flush=True)

    env = environment(device)
    log(f"{env['device']}; torch {env['torch']}; commit {env['commit']}; sections {','.join(args.sections)}")
    results = run_sections(args, device, env, log)
    env.update(load_average=[load_start, os.getloadavg()[0]], elapsed_s=time.perf_counter() - start)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    out = {"environment": env, "settings": settings, **results}
    out["targets"] = report.targets(out, auto_variant(device))
    write_report(args.output, out, report.markdown(out))
    return out


if __name__ == "__main__":
    main()
