"""Where the MoE fine-tune's FP8 error enters, at step 0: SmolLM2 dense against its 4-expert upcycle.

At step 0 every expert is a copy of SmolLM2's MLP and the routing weights of a token sum to 1, so
the upcycled model computes what SmolLM2 computes; the dense model in FP8 is the control. One
reference check per model (``fp8_plugin.reference_check``, float32 compute: the FP8 replay
against the same replay with every FP8 layer in float32) on the same batch of real text (BBC
News) gives, per model:

- the loss difference and the gradient cosine of the whole model;
- the gradient cosine per parameter group (attention projections, MLP or experts, router,
  norms and embeddings): from each parameter's FP8 and reference gradients, the group's
  ``<g8, gr> / (|g8| |gr|)`` over all its parameters (float64), and ``|g8| / |gr|``;
- the output SQNR of each FP8 layer (the dense model's MLP down projections, the upcycled
  model's experts modules: the same place in the block) and of the attention projections.

    python benchmarks/moe_fidelity.py [--model-path DIR] [--seq-len 128] [--batch-size 4]

Prints a table and writes nothing; docs/moe.md records what it found.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fp8_plugin as fp  # noqa: E402
from finetune_causal_lm import DEFAULT_MODEL_PATH, ensure_checkpoint, load_blocks  # noqa: E402
from finetune_moe import load_dense, upcycle  # noqa: E402

GROUPS = (("router", (".mlp.gate.",)), ("experts", (".experts.",)), ("mlp", (".mlp.",)),
          ("attention", (".self_attn.",)), ("other", ("",)))


def group_of(name: str) -> str:
    return next(group for group, marks in GROUPS if any(m in name for m in marks))


def grad_groups(model, batch) -> dict[str, tuple[float, float]]:
    """Per parameter group: the gradient cosine, FP8 against the float32 reference, and the norm
    ratio |g_FP8| / |g_reference| (float64 sums)."""
    sums: dict[str, list[float]] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = {}
    for fp8 in (True, False):
        model.zero_grad()
        with fp.autocast(enabled=fp8):
            model(input_ids=batch, labels=batch).loss.backward()
        grads[fp8] = {n: p.grad.double().flatten() for n, p in params if p.grad is not None}
    model.zero_grad()
    for name in grads[True]:
        a, b = grads[True][name], grads[False][name]
        acc = sums.setdefault(group_of(name), [0.0, 0.0, 0.0])
        acc[0] += float(a @ b)
        acc[1] += float(a @ a)
        acc[2] += float(b @ b)
    return {g: (dot / math.sqrt(na * nb) if na and nb else math.nan, math.sqrt(na / nb) if nb else math.inf)
            for g, (dot, na, nb) in sums.items()}


def measure(label: str, model, batch) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.reference_check(model, batch, lambda m, b: m(input_ids=b, labels=b).loss,
                                    compute_dtype=torch.float32)
    sqnr = result.layer_sqnr_db
    mlp = [db for n, db in sqnr.items() if n.endswith(".mlp.down_proj") or ".mlp.experts[" in n]
    attention = [db for n, db in sqnr.items() if ".self_attn." in n]
    groups = grad_groups(model, batch)
    return {"label": label, "loss_rel_diff": result.loss_rel_diff, "grad_cosine": result.grad_cosine,
            "mlp_sqnr_median": statistics.median(mlp) if mlp else math.nan, "mlp_sqnr_min": min(mlp, default=math.nan),
            "attention_sqnr_median": statistics.median(attention), "groups": groups}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=0, help="decoder layers kept (0: all 30)")
    args = p.parse_args(argv)
    args.text_file, args.val_blocks, args.seed = None, 4, 0
    model_path = ensure_checkpoint(args.model_path.expanduser())
    from transformers import AutoTokenizer

    train_blocks, _ = load_blocks(args, AutoTokenizer.from_pretrained(model_path))
    batch = train_blocks[:args.batch_size]
    rows = []
    dense = load_dense(model_path, args.num_layers).train()
    moe = upcycle(dense).train()
    fp.convert_model(dense, fp.DelayedScaling())
    rows.append(measure("dense SmolLM2, FP8", dense, batch))
    del dense
    fp.convert_model(moe, fp.DelayedScaling())
    rows.append(measure("upcycled, FP8 everywhere", moe, batch))
    for m in moe.modules():
        if isinstance(m, fp.modules.experts.FP8ExpertsMixin):
            m.use_fp8 = False
    rows.append(measure("upcycled, experts in float32", moe, batch))
    print(f"{'model':<30} {'loss diff':>9} {'grad cos':>9} {'MLP/experts SQNR med/min':>25} {'attn SQNR':>9}  "
          "grad cosine per group (norm ratio FP8 / reference)")
    for r in rows:
        groups = ", ".join(f"{g} {c:.4f} (norm x{n:.2f})" for g, (c, n) in sorted(r["groups"].items()))
        print(f"{r['label']:<30} {r['loss_rel_diff']:>9.2e} {r['grad_cosine']:>9.4f} "
              f"{r['mlp_sqnr_median']:>12.1f} / {r['mlp_sqnr_min']:<10.1f} {r['attention_sqnr_median']:>9.1f}  {groups}")
    return rows


if __name__ == "__main__":
    main()
