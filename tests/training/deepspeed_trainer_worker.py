"""The transformers Trainer under DeepSpeed ZeRO on CPU (gloo), started by tests/training/test_deepspeed.py
under torchrun with two processes: ``FP8Trainer`` (``--precision fp8``) or the plain ``Trainer``
(``--precision bf16``, the reference), both with ``TrainingArguments(deepspeed=<dict>, bf16=True)``.

The run trains 4 optimizer steps of 2 accumulated micro-batches, checkpointing every 2; the FP8
run then trains again from ``checkpoint-2`` (``train(resume_from_checkpoint=...)``, DeepSpeed's
``load_checkpoint``) to step 4. Writes what it saw to ``<out>/rank<R>.pt``.

    python deepspeed_trainer_worker.py <out> --runs 2:bf16,2:fp8,3:bf16,3:fp8

The runs train one after the other in the same launch, each into ``<out>/<stage>/<run>``.
"""

import argparse
import sys
from pathlib import Path

import deepspeed_worker  # noqa: F401  (its CPU shims for Accelerate and DeepSpeed, the FP8 GEMM counter)
import torch
from amax_reductions import MAX_ALL_REDUCES
from deepspeed_worker import CHECK_GEMMS, FP8_GEMMS, ds_config, fp8_state, full_fp32_weights, parse_runs
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

STEPS, GRAD_ACCUM, BATCH = 4, 2, 16

# The Trainer allows bf16 without use_cpu only where a GPU runs it, and use_cpu would turn
# DeepSpeed off: on this GPU-less machine its check answers yes (a shim of the test, like the
# Accelerate one in deepspeed_worker).
import transformers.training_args  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True


class Net(nn.Sequential):
    """The tests' three-layer model; returns ``{"loss"}`` as a transformers model does."""

    def forward(self, x, labels=None):
        out = super().forward(x)
        return {"loss": nn.functional.mse_loss(out.float(), labels)}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = (torch.randn(n, 32, generator=g) * 3).to(torch.bfloat16)
        self.y = torch.randn(n, 16, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Record(TrainerCallback):
    """Per optimizer step: the MAX all-reduces made since the last step."""

    def __init__(self) -> None:
        self.reduces: list[list[int]] = []
        self.seen = len(MAX_ALL_REDUCES)

    def on_step_end(self, args, state, control, **kwargs):
        self.reduces.append(MAX_ALL_REDUCES[self.seen:])
        self.seen = len(MAX_ALL_REDUCES)


def trainer_for(out: Path, stage: int, precision: str, record: Record) -> Trainer:
    config = ds_config(stage, "auto")
    config["train_micro_batch_size_per_gpu"] = "auto"
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        bf16=True, deepspeed=config, save_strategy="steps", save_steps=2, logging_steps=1, report_to=[],
        disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        save_only_model=False,
    )
    cls, fp8 = Trainer, {}
    if precision == "fp8":
        from fp8_plugin.hf_trainer import FP8Trainer

        # The per-layer statistics every 2 optimizer steps, merged into the Trainer's logs, and a
        # BF16 reference check every 2 optimizer steps.
        cls, fp8 = FP8Trainer, {"fp8_statistics": 2, "fp8_reference_every": 2}
    return cls(model=make_model(), args=args, train_dataset=Data(BATCH * GRAD_ACCUM * STEPS * 2), callbacks=[record],
               **fp8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", required=True,
                        help="'STAGE:RUN,...' (RUN: fp8, bf16), one after the other in this launch, each into "
                             "<out>/<STAGE>/<RUN>")
    args = parser.parse_args()
    runs = parse_runs(parser, args.runs, ("fp8", "bf16"))
    for stage, name in runs:
        run(args.out / stage / name, int(stage), name)
    tear_down_process_group()


def run(out: Path, stage: int, precision: str) -> None:
    gemms_before, checks_before = FP8_GEMMS[0], CHECK_GEMMS[0]
    args = argparse.Namespace(out=out, stage=stage, precision=precision)
    record = Record()
    trainer = trainer_for(args.out, args.stage, args.precision, record)
    trainer.train()
    engine = trainer.model_wrapped
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "world_size": trainer.args.world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "losses": losses,
        "max_all_reduces": record.reduces,
        "statistics": [(h["step"], {k: v for k, v in h.items() if k.startswith("fp8_stats/")})
                       for h in trainer.state.log_history if any(k.startswith("fp8_stats/") for k in h)],
        "train_fp8_gemms": FP8_GEMMS[0] - gemms_before - (CHECK_GEMMS[0] - checks_before),
        "check_fp8_gemms": CHECK_GEMMS[0] - checks_before,
        "reference": [(h["step"], h["fp8_ref/grad_cosine"]) for h in trainer.state.log_history
                      if "fp8_ref/grad_cosine" in h],
        "reference_results": [{k: v for k, v in r.to_dict().items() if k != "seconds"}
                              for r in trainer.accelerator.fp8_runs[0].reference.results]
        if args.precision == "fp8" else [],
        "fp8_state": fp8_state(engine),
        "weights": full_fp32_weights(engine),
    }
    if trainer.args.process_index == 0:
        # The checkpoint's model file (under ZeRO-3 consolidated from the partitions) is vanilla:
        # it loads strictly into the unconverted model and holds the bf16 copies of the masters.
        from safetensors.torch import load_file

        saved = load_file(str(args.out / "checkpoint-4" / "model.safetensors"))
        plain = make_model()
        plain.load_state_dict({k: v.float() for k, v in saved.items()}, strict=True)
        result["saved_model_matches_master"] = all(
            torch.equal(p, result["weights"][name].to(torch.bfloat16).float()) for name, p in plain.named_parameters())
    if args.precision == "fp8":
        resumed_record = Record()
        resumed = trainer_for(args.out, args.stage, args.precision, resumed_record)
        resumed.train(resume_from_checkpoint=str(args.out / "checkpoint-2"))
        result["resumed_losses"] = [h["loss"] for h in resumed.state.log_history if "loss" in h]
        result["resumed_fp8_state"] = fp8_state(resumed.model_wrapped)
        result["resumed_weights"] = full_fp32_weights(resumed.model_wrapped)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{trainer.args.process_index}.pt")


if __name__ == "__main__":
    sys.exit(main())
