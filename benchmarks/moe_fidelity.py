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

Then, per model (``--sections``):

- ``eval``: validation perplexity at step 0 in float32 and in FP8 (``Float8CurrentScaling``, so
  that no amax history is involved), the dense model and the upcycle on the same 16 blocks: what
  FP8 inference alone costs, before any training;
- ``blocks``: per decoder layer, the SQNR of the MLP block's FP8 output against its float32
  output on the same input (the dense ``mlp``: gate, up and down projections in FP8; the
  upcycle's MoE block: router in high precision, experts in FP8, so the routing is the same),
  both models on the same batch: the step-0 target compares the two;
- ``steps``: ``--steps`` optimizer steps of FP8 training (``DelayedScaling``, AdamW as the MoE
  example) with a reference check before each, and per step the median and minimum per-GEMM
  SQNR (fprop, dgrad, wgrad) of the MLP projections (dense: gate, up, down; upcycle: each
  expert's ``gate_up_proj`` and ``down_proj``) and of the attention projections; the experts'
  token rows scaled as ``--token-scaling`` says (their own amax by default, or their per-expert
  delayed histories).

    python benchmarks/moe_fidelity.py [--model-path DIR] [--seq-len 128] [--batch-size 4]
    python benchmarks/moe_fidelity.py --sections eval,blocks,steps --steps 4
    python benchmarks/moe_fidelity.py --sections steps --steps 4 --calibrate 4
    python benchmarks/moe_fidelity.py --sections steps --token-scaling recipe   # the experts' A/B

Prints tables and writes nothing; docs/moe.md records what it found.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fp8_plugin as fp  # noqa: E402
from finetune_causal_lm import DEFAULT_MODEL_PATH, ensure_checkpoint, load_blocks, perplexity  # noqa: E402
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


def step0_perplexity(model, val_blocks, batch_size: int) -> tuple[float, float]:
    """Validation perplexity in float32 and in FP8 (current scaling), model as given."""
    fp8 = copy.deepcopy(model)
    fp.convert_model(fp8, fp.Float8CurrentScaling())
    device = torch.device("cpu")
    with torch.no_grad(), fp.autocast():
        in_fp8 = perplexity(fp8, val_blocks, batch_size, device)
    return perplexity(model, val_blocks, batch_size, device), in_fp8


def block_sqnr(model, batch) -> list[float]:
    """Per decoder layer: SQNR (dB) of the MLP block's FP8 output against its float32 output on the
    input the float32 model gives it (``Float8CurrentScaling``, evaluation casts)."""
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=batch)
    for h in hooks:
        h.remove()
    fp8 = copy.deepcopy(model)
    fp.convert_model(fp8, fp.Float8CurrentScaling())
    out = []
    with torch.no_grad():
        for i, (ref_layer, fp8_layer) in enumerate(zip(model.model.layers, fp8.model.layers)):
            want = ref_layer.mlp(inputs[i]).double()
            with fp.autocast():
                got = fp8_layer.mlp(inputs[i]).double()
            out.append(10 * math.log10(want.square().sum().item() / (got - want).square().sum().item()))
    return out


def gemm_group(name: str) -> str:
    if ".self_attn." in name:
        return "attention"
    if ".experts[" in name:
        return "experts " + name.rpartition(".")[2]  # gate_up_proj / down_proj
    return "MLP " + name.rpartition(".")[2]  # gate_proj / up_proj / down_proj


def first_steps(model, train_blocks, batch_size: int, steps: int, lr: float, calibrate: int = 0,
                token_scaling: str = "current") -> list[dict]:
    """FP8 training steps (delayed scaling) with a reference check before each optimizer step;
    per step and per GEMM group, the median and minimum SQNR of fprop, dgrad and wgrad. With
    ``calibrate`` > 0, ``fp8_plugin.calibrate`` first runs that many batches of other training
    blocks (the last ones) in high precision. ``token_scaling``: the experts modules' (their
    token rows scaled by their own amax, or as the recipe says)."""
    fp.convert_model(model, fp.DelayedScaling())
    for m in model.modules():
        if isinstance(m, fp.modules.experts.FP8ExpertsMixin):
            m.token_scaling = token_scaling
    if calibrate:
        held = train_blocks[-calibrate * batch_size:]
        report = fp.calibrate(model, [{"input_ids": b} for b in held.split(batch_size)])
        print(f"  calibrated on {calibrate} batches: " + ", ".join(f"{report.count(c)} {c}" for c in
                                                                  ("recipe", "blockwise", "high precision")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rows = []
    for step in range(steps):
        batch = train_blocks[step * batch_size:(step + 1) * batch_size]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fp.reference_check(model, batch, lambda m, b: m(input_ids=b, labels=b).loss,
                                        compute_dtype=torch.float32, step=step)
        figures: dict[tuple[str, str], list[float]] = {}
        for name, per_gemm in result.gemm_sqnr_db.items():
            for gemm, db in per_gemm.items():
                if math.isfinite(db):
                    figures.setdefault((gemm_group(name), gemm), []).append(db)
        rows.append({"step": step, "grad_cosine": result.grad_cosine,
                     "figures": {k: (statistics.median(v), min(v)) for k, v in figures.items()}})
        with fp.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        fp.update_pending_scales(model)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=0, help="decoder layers kept (0: all 30)")
    p.add_argument("--sections", default="checks", help="comma-separated: checks, eval, blocks, steps "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="FP8 training steps of the steps section")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the steps section")
    p.add_argument("--token-scaling", default="current", choices=["current", "recipe"],
                   help="steps section: the experts' token scaling (default: %(default)s)")
    p.add_argument("--calibrate", type=int, default=0,
                   help="steps section: fp8_plugin.calibrate on this many batches first (default: %(default)s, none)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    unknown = sections - {"checks", "eval", "blocks", "steps"}
    if unknown:
        p.error(f"--sections {sorted(unknown)} unknown; valid: checks, eval, blocks, steps")
    args.text_file, args.val_blocks, args.seed = None, 16, 0
    model_path = ensure_checkpoint(args.model_path.expanduser())
    from transformers import AutoTokenizer

    train_blocks, val_blocks = load_blocks(args, AutoTokenizer.from_pretrained(model_path))
    batch = train_blocks[:args.batch_size]
    rows = []
    dense = load_dense(model_path, args.num_layers).train()
    moe = upcycle(dense).train()
    if "eval" in sections:
        for label, model in (("dense SmolLM2", dense), ("upcycled", moe)):
            f32, f8 = step0_perplexity(model.eval(), val_blocks, args.batch_size)
            print(f"step-0 validation perplexity, {label}: float32 {f32:.3f}, FP8 {f8:.3f} ({f8 / f32 - 1:+.2%})",
                  flush=True)
    if "blocks" in sections:
        dense_db, moe_db = block_sqnr(dense.eval(), batch), block_sqnr(moe.eval(), batch)
        print("step-0 MLP block output SQNR (dB) per layer, dense / MoE block:")
        print("  " + " ".join(f"{d:.1f}/{m:.1f}" for d, m in zip(dense_db, moe_db)))
        diffs = [m - d for d, m in zip(dense_db, moe_db)]
        print(f"  median dense {statistics.median(dense_db):.2f} dB, MoE {statistics.median(moe_db):.2f} dB; "
              f"MoE minus dense: median {statistics.median(diffs):+.2f} dB, worst {min(diffs):+.2f} dB", flush=True)
    if "steps" in sections:
        for label, model in (("dense SmolLM2", copy.deepcopy(dense).train()),
                             ("upcycled", copy.deepcopy(moe).train())):
            for row in first_steps(model, train_blocks, args.batch_size, args.steps, args.lr, args.calibrate,
                                   args.token_scaling):
                parts = ", ".join(f"{group} {gemm} {med:.1f}/{low:.1f}"
                                  for (group, gemm), (med, low) in sorted(row["figures"].items()))
                print(f"{label} step {row['step']}: grad cosine {row['grad_cosine']:.4f}; per-GEMM SQNR "
                      f"median/min dB: {parts}", flush=True)
            del model
    if "checks" not in sections:
        return rows
    dense.train(), moe.train()
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
