"""What FP8 evaluation costs SmolLM2 and its MoE upcycle, and what calibration and outlier-aware
scaling recover: validation perplexity at step 0, per model, on the same blocks of real text.

Per model (SmolLM2-135M dense, its 4-expert upcycle from examples/finetune_moe.py):

- perplexity in float32 (the reference of the figures), in BF16 (torch autocast), in per-tensor
  FP8 with current scaling (each tensor scaled from its own amax: no history involved), in FP8
  with delayed scaling after ``fp8_plugin.calibrate(choose_scaling=False)`` (the scales from
  the calibration batches), and after ``fp8_plugin.calibrate`` with the scaling chosen per
  layer (per-tensor, 1x128 blockwise, or high precision; the default);
- the layers that decide: the calibration report's lowest fprop SQNRs (token-mean, dB) under
  the recipe and blockwise, and every layer moved off the recipe, with its measured SQNR;
- the FP8 share of the GEMMs after the choice.

The calibration batches are training blocks, never validation ones.

    python benchmarks/eval_fidelity.py [--val-blocks 128] [--calibration-batches 4] [--json out.json]

Prints a table (and writes JSON with ``--json``); docs/calibration.md records what it found.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.tools.quiet import quiet_foreign_output  # noqa: E402
from finetune_causal_lm import DEFAULT_MODEL_PATH, ensure_checkpoint, load_blocks, perplexity  # noqa: E402
from finetune_moe import load_dense, upcycle  # noqa: E402

CPU = torch.device("cpu")


def fp8_perplexity(model, recipe, val_blocks, batch_size: int, calibration=None, choose: bool = True):
    """Perplexity of a converted copy of ``model`` under ``recipe`` (every candidate layer in
    FP8), after ``fp8_plugin.calibrate`` on ``calibration`` when given; with its report."""
    fp8 = copy.deepcopy(model)
    fp.convert_model(fp8, recipe, skip_small=False)
    report = None
    if calibration is not None:
        report = fp.calibrate(fp8, calibration, choose_scaling=choose)
    # Grad off before the autocast: evaluation forwards, which record no amax and leave the
    # scales as calibrated (entered with grad on, the autocast would start a training step).
    with torch.no_grad(), fp.autocast(recipe=recipe):
        ppl = perplexity(fp8, val_blocks, batch_size, CPU)
    return ppl, report


def deciding_layers(report, lowest: int = 5) -> list[dict]:
    """The ``lowest`` layers by their figure under the recipe (the worse of fprop and input cast),
    and every layer not on the recipe."""
    measured = [r for r in report.layers if r.sqnr_recipe_db is not None]
    chosen = sorted(measured, key=lambda r: min(r.sqnr_recipe_db, r.input_sqnr_recipe_db))[:lowest]
    chosen += [r for r in measured if r.choice != "recipe" and r not in chosen]
    return [{"name": r.name, "input_amax": r.input_amax, "sqnr_recipe_db": r.sqnr_recipe_db,
             "sqnr_blockwise_db": r.sqnr_blockwise_db, "input_sqnr_recipe_db": r.input_sqnr_recipe_db,
             "input_sqnr_blockwise_db": r.input_sqnr_blockwise_db, "choice": r.choice} for r in chosen]


def measure(label: str, model, val_blocks, calibration, batch_size: int) -> dict:
    model = model.eval()
    ref = perplexity(model, val_blocks, batch_size, CPU)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = perplexity(model, val_blocks, batch_size, CPU)
    current, _ = fp8_perplexity(model, fp.Float8CurrentScaling(), val_blocks, batch_size)
    delayed, _ = fp8_perplexity(model, fp.DelayedScaling(), val_blocks, batch_size, calibration, choose=False)
    chosen, report = fp8_perplexity(model, fp.DelayedScaling(), val_blocks, batch_size, calibration)
    row = {"model": label, "float32": ref, "bf16": bf16, "fp8_current": current, "fp8_calibrated": delayed,
           "fp8_calibrated_outlier_aware": chosen,
           "choices": {c: report.count(c) for c in ("recipe", "blockwise", "high precision")},
           "deciding_layers": deciding_layers(report)}
    print(f"{label}: float32 {ref:.3f}; " + ", ".join(
        f"{name} {row[key]:.3f} ({row[key] / ref - 1:+.2%})" for name, key in (
            ("BF16", "bf16"), ("FP8 current", "fp8_current"), ("FP8 calibrated", "fp8_calibrated"),
            ("FP8 calibrated + outlier-aware", "fp8_calibrated_outlier_aware"))), flush=True)
    print("  layers: " + ", ".join(f"{n} {c}" for c, n in row["choices"].items()))
    print("  SQNR (dB), fprop / input cast:")
    for layer in row["deciding_layers"]:
        block = "-" if layer["sqnr_blockwise_db"] is None else (
            f"{layer['sqnr_blockwise_db']:.1f} / {layer['input_sqnr_blockwise_db']:.1f}")
        print(f"  {layer['name']:<36} input amax {layer['input_amax']:9.4g}  per-tensor "
              f"{layer['sqnr_recipe_db']:.1f} / {layer['input_sqnr_recipe_db']:.1f}, blockwise {block} -> {layer['choice']}")
    return row


def main(argv=None) -> list[dict]:
    quiet_foreign_output()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-blocks", type=int, default=128, help="validation blocks (default: %(default)s; fewer make "
                   "the FP8 figures noisy: 32 blocks move them by up to 0.7 points between runs that differ in 2 layers)")
    p.add_argument("--calibration-batches", type=int, default=4, help="batches of training blocks (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=0, help="decoder layers kept (0: all 30)")
    p.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    models = args.models.split(",")
    if set(models) - {"dense", "moe"}:
        p.error(f"--models {args.models!r}; valid: dense, moe, comma-separated")
    args.text_file, args.seed = None, 0
    model_path = ensure_checkpoint(args.model_path.expanduser())
    from transformers import AutoTokenizer

    train_blocks, val_blocks = load_blocks(args, AutoTokenizer.from_pretrained(model_path))
    held = train_blocks[:args.calibration_batches * args.batch_size]
    calibration = [{"input_ids": b} for b in held.split(args.batch_size)]
    dense = load_dense(model_path, args.num_layers)
    rows = []
    if "dense" in models:
        rows.append(measure("SmolLM2 dense", dense, val_blocks, calibration, args.batch_size))
    if "moe" in models:
        rows.append(measure("SmolLM2 4-expert upcycle", upcycle(dense), val_blocks, calibration, args.batch_size))
    if args.json is not None:
        args.json.write_text(json.dumps({"torch": torch.__version__, "val_blocks": args.val_blocks,
                                         "seq_len": args.seq_len, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
