"""Issue 46's memory figures from the memory tool (fp8_plugin/tools/memory.py).

    python benchmarks/memory_fit.py fit [--budget-gib 79.1] [--batch-size 1] [--seq-len 2048] [--lora-rank R]
    python benchmarks/memory_fit.py check --device cuda|meta [--output memory.json]

``fit`` (any machine; traced on meta tensors presented as an H100): the peak of a full fine-tune
of Llama 3.2 1B, 3B and Llama 3.1 8B shapes under bf16-mixed + AdamW, fp8-hybrid + AdamW and
fp8-hybrid + FP8AdamW, and the largest Llama-shaped model (Llama 3.1 8B's width, its number of
layers varied) whose step fits in ``--budget-gib`` under each, as markdown. With ``--lora-rank``, a
LoRA fine-tune of that rank on every linear layer (BF16 base weights, kept only in FP8 under
fp8-hybrid) under bf16-mixed and fp8-hybrid, with torch's AdamW (the adapters' states are small).

``check`` (benchmarks/gpu_run.sh): the 125M and 1B models of the benchmark suite at batch 4 x 1024,
each precision and optimizer, traced on meta tensors and run on the GPU: the trace's peak against
``torch.cuda.max_memory_allocated`` of the same step (issue 46: within 10%). With ``--device meta``
(the CPU rehearsal) only the traces run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_plugin.tools.memory import estimate_memory  # noqa: E402
from fp8_suite.models import MODEL_SIZES  # noqa: E402  (benchmarks/fp8_suite: the suite's model sizes)

GIB = 2**30
RUNS = (("bf16-mixed", "adamw"), ("fp8-hybrid", "adamw"), ("fp8-hybrid", "fp8-adamw"))
# Llama 3.2 1B / 3B and Llama 3.1 8B (their config.json), and the benchmark suite's 125M and 1B.
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "suite-125m": MODEL_SIZES["125m"],
    "suite-1b": MODEL_SIZES["1b"],
}


def llama(name: str, **changes: int):
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SHAPES[name], **changes}, max_position_embeddings=8192)
    config.architectures = ["LlamaForCausalLM"]
    return config


def fit(budget_gib: float, batch_size: int, seq_len: int, lora_rank: int | None = None) -> str:
    runs = RUNS if lora_rank is None else RUNS[:2]
    tune = "" if lora_rank is None else f", LoRA r={lora_rank} on every linear layer"
    lines = [f"Peak of one training step, batch {batch_size} x {seq_len} tokens{tune}, traced on meta tensors "
             "presented as an H100 (sm90), GiB:", "",
             "| model | parameters | " + " | ".join(f"{p} + {o}" for p, o in runs) + " |",
             "| --- | ---: |" + " ---: |" * len(runs)]
    for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"):
        estimates = [estimate_memory(llama(name), p, o, batch_size=batch_size, seq_len=seq_len, lora_rank=lora_rank)
                     for p, o in runs]
        base = estimates[0].peak.bytes
        cells = [f"{e.peak.bytes / GIB:.1f} ({e.peak.bytes / base:.2f}x)" for e in estimates]
        lines.append(f"| {name} | {estimates[0].parameters / 1e9:.2f}B | " + " | ".join(cells) + " |")
    lines += ["", f"The largest Llama 3.1 8B-shaped model (its width, fewer or more layers) whose step fits in "
              f"{budget_gib} GiB:", "", "| precision + optimizer | layers | parameters | peak, GiB |",
              "| --- | ---: | ---: | ---: |"]
    for precision, optimizer in runs:
        best = None
        low, high = 1, 96 if lora_rank is None else 192  # the peak grows with the layers: bisect for the last that fits
        while low <= high:
            layers = (low + high) // 2
            e = estimate_memory(llama("llama-3.1-8b", num_hidden_layers=layers), precision, optimizer,
                                batch_size=batch_size, seq_len=seq_len, lora_rank=lora_rank)
            if e.peak.bytes <= budget_gib * GIB:
                best, low = (layers, e), layers + 1
            else:
                high = layers - 1
        if best is None:
            lines.append(f"| {precision} + {optimizer} | none fits | | |")
        else:
            layers, e = best
            lines.append(f"| {precision} + {optimizer} | {layers} | {e.parameters / 1e9:.2f}B | "
                         f"{e.peak.bytes / GIB:.1f} |")
    return "\n".join(lines)


def check(device: str, names: list[str]) -> dict:
    rows = []
    for name in names:
        for precision, optimizer in RUNS:
            row = {"model": name, "precision": precision, "optimizer": optimizer, "batch": [4, 1024]}
            capability = torch.cuda.get_device_capability() if device == "cuda" else (9, 0)
            traced = estimate_memory(llama(name), precision, optimizer, batch_size=4, seq_len=1024,
                                     capability=capability)
            row["traced_peak_bytes"] = traced.peak.bytes
            if device == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                run = estimate_memory(llama(name), precision, optimizer, batch_size=4, seq_len=1024, device="cuda")
                row.update(gpu=run.device, gpu_trace_peak_bytes=run.peak.bytes, measured_peak_bytes=run.measured_peak_bytes,
                           traced_over_measured=traced.peak.bytes / run.measured_peak_bytes)
                del run
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="the peaks of Llama shapes, and the largest that fits")
    f.add_argument("--budget-gib", type=float, default=79.1, help="GPU memory torch may allocate (H100 80GB: 79.1)")
    f.add_argument("--batch-size", type=int, default=1)
    f.add_argument("--seq-len", type=int, default=2048)
    f.add_argument("--lora-rank", type=int, default=None, help="trace LoRA fine-tunes of this rank")
    c = sub.add_parser("check", help="traced peaks against the GPU's measured ones")
    c.add_argument("--device", choices=("cuda", "meta"), default="cuda")
    c.add_argument("--models", type=lambda text: text.split(","), default=["suite-125m", "suite-1b"],
                   help="comma-separated, of: suite-125m, suite-1b (default both)")
    c.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    if args.command == "fit":
        print(fit(args.budget_gib, args.batch_size, args.seq_len, args.lora_rank))
    else:
        result = check(args.device, args.models)
        if args.output:
            args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
