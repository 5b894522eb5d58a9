"""``fp8-plugin memory``: the peak of one training step, every byte accounted for, precisions side by side.

The command of :func:`fp8_plugin.tools.memory.compare_memory`; ``tools/cli.py`` registers it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .cli_options import SkipSmall, skip_small_value

__all__ = ["memory", "memory_text"]

_MIB = 2**20


def memory(
    model: Path = typer.Argument(..., metavar="MODEL", show_default=False,
                                 help="Hugging Face checkpoint folder (its config.json is read, no weights) or a "
                                 "config.json file."),
    precision: Optional[list[str]] = typer.Option(
        None, "--precision", "-p", help="A precision to trace (a column): bf16-mixed, fp8-hybrid, fp8-delayed, "
        "fp8-current, fp8-mxfp8, fp8-blockwise, bf16-true, 32-true. Repeatable; default: bf16-mixed and fp8-hybrid."),
    optimizer: Optional[list[str]] = typer.Option(
        None, "--optimizer", "-o", help="adamw (torch), fp8-adamw (fp8_plugin.optim.FP8AdamW) or sgd: one for "
        "every column, or one per --precision. Default: adamw."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Sequences per step."),
    seq_len: int = typer.Option(1024, "--seq-len", "-s", help="Tokens per sequence."),
    device: str = typer.Option("meta", "--device", help="meta: a traced step on tensors without data, presented "
                               "as a GPU of --capability (any machine); cuda: the current GPU, its measured peak "
                               "beside the trace."),
    capability: str = typer.Option("9.0", "--capability", help="Compute capability meta tensors present: 9.0 "
                                   "(H100, H200), 8.9 (L4, L40S), 10.0 (B200)."),
    skip_small: SkipSmall = typer.Option(
        SkipSmall.auto, "--skip-small", case_sensitive=False, help="auto: layers FP8 would not make faster on the "
        "GPU stay in BF16, as in training; false: every layer but the heads in FP8; true: torchao's size rule."),
    lora_rank: Optional[int] = typer.Option(
        None, "--lora-rank", "-r", help="Trace a LoRA fine-tune of this rank (PEFT, lora_alpha twice the rank) over "
        "base weights loaded in BF16, kept only in FP8 under the FP8 precisions. Default: a full fine-tune."),
    lora_targets: Optional[list[str]] = typer.Option(
        None, "--lora-targets", help="With --lora-rank: the modules LoRA adapts (PEFT's target_modules). "
        "Repeatable; default: all-linear."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    """The peak memory of one steady training step of MODEL, broken down: parameters (FP32 master
    weights), FP8 weight copies rowwise and columnwise, gradients, optimizer states, activations
    saved for backward by kind, transients and the largest of them; one column per precision. A full
    fine-tune, or with --lora-rank a LoRA fine-tune."""
    from .memory import compare_memory

    precisions = tuple(precision or ("bf16-mixed", "fp8-hybrid"))
    optimizers = tuple(optimizer or ("adamw",))
    if len(optimizers) == 1:
        optimizers *= len(precisions)
    if len(optimizers) != len(precisions):
        raise typer.BadParameter(f"{len(optimizers)} --optimizer values for {len(precisions)} --precision values; "
                                 "valid: one, or one per --precision", param_hint="--optimizer")
    cap = _capability(capability)
    try:
        estimates = compare_memory(model, precisions, optimizers, batch_size=batch_size, seq_len=seq_len,
                                   device=device, capability=cap, skip_small=skip_small_value(skip_small),
                                   lora_rank=lora_rank, lora_targets=list(lora_targets or ()) or "all-linear")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if as_json:
        typer.echo(json.dumps({"estimates": [e.to_dict() for e in estimates]}, indent=2))
    else:
        typer.echo(memory_text(estimates))


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a compute capability; valid: MAJOR.MINOR, e.g. 9.0",
                                 param_hint="--capability") from None
    return major, minor


def memory_text(estimates: list) -> str:
    """The table ``fp8-plugin memory`` prints: MiB per category at each estimate's peak."""
    from .memory import category_table

    names = [f"{e.precision} + {e.optimizer}" for e in estimates]
    width = max(14, *(len(n) for n in names))
    first = estimates[0]
    tune = "" if first.lora_rank is None else (
        f" (LoRA r={first.lora_rank} on {first.lora_targets}: {first.trainable_parameters / 1e6:.1f}M trainable)")
    lines = [f"{first.model}: one training step, batch {first.batch_size} x {first.seq_len} tokens, "
             f"{first.parameters / 1e6:.1f}M parameters{tune}, on {first.device}",
             "", f"{'MiB at the peak':<34}" + "".join(f"{n:>{width + 2}}" for n in names)]
    for category, values in category_table(estimates):
        lines.append(f"  {category:<32}" + "".join(f"{v / _MIB:>{width + 2}.1f}" for v in values))
    lines.append(f"{'peak':<34}" + "".join(f"{e.peak.bytes / _MIB:>{width + 2}.1f}" for e in estimates))
    base = estimates[0].peak.bytes
    lines.append(f"{'  x ' + names[0]:<34}" + "".join(f"{e.peak.bytes / base:>{width + 2}.3f}" for e in estimates))
    lines.append(f"{'  reached in':<34}" + "".join(f"{e.peak.phase:>{width + 2}}" for e in estimates))
    lines.append(f"{'held when the backward starts':<34}" + "".join(f"{e.after_forward.bytes / _MIB:>{width + 2}.1f}"
                                                                  for e in estimates))
    lines.append(f"{'held between steps':<34}" + "".join(f"{e.resident_bytes / _MIB:>{width + 2}.1f}"
                                                       for e in estimates))
    if any(e.measured_peak_bytes is not None for e in estimates):
        lines.append(f"{'measured (max_memory_allocated)':<34}" + "".join(
            f"{(e.measured_peak_bytes or 0) / _MIB:>{width + 2}.1f}" for e in estimates))
    lines.append(f"{'FP8 recipe':<34}" + "".join(f"{e.recipe or '-':>{width + 2}}" for e in estimates))
    lines.append(f"{'FP8 linear layers':<34}" + "".join(f"{e.fp8_layers:>{width + 2}}" for e in estimates))
    lines.append(f"{'FP8 GEMMs in the step':<34}" + "".join(f"{e.fp8_gemms:>{width + 2}}" for e in estimates))
    for name, estimate in zip(names, estimates):
        lines += ["", f"{name}: activations saved for backward, by the op that made them (MiB)"]
        lines += [f"  {kind:<48}{size / _MIB:>10.1f}" for kind, size in list(estimate.peak.saved_by_kind.items())[:8]
                  if size >= _MIB / 10]
        largest = estimate.peak.largest_transient
        if largest is not None:
            lines.append(f"  largest transient: {largest.op} {list(largest.shape)} "
                         f"{str(largest.dtype).replace('torch.', '')}, {largest.nbytes / _MIB:.1f} MiB, in the "
                         f"{largest.phase}")
    return "\n".join(lines)
