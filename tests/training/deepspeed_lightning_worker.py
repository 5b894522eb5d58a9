"""Lightning's DeepSpeedStrategy on CPU (gloo), started by tests/training/test_deepspeed.py under torchrun
with two processes: ``plugins=[FP8DeepSpeedPrecision()]`` (``--precision fp8``), Lightning's
own ``precision="bf16-mixed"`` (``--precision bf16``, the reference), or the one-word change
``Trainer(precision="fp8-hybrid", strategy="deepspeed_stage_<S>")`` (``--precision fp8-string``:
the strategy name is resolved by Lightning's StrategyRegistry, into which this worker registers
the CPU shim under that name; no resumed fit).

4 optimizer steps of 2 accumulated batches (2 epochs), checkpoints after steps 2 and 4 (DeepSpeed's
save_checkpoint); the FP8 run then fits a second Trainer from the step-2 checkpoint to step 4.
The plugin's FP8 run samples the per-layer statistics every 2 optimizer steps, logged to a
recording logger, and runs a BF16 reference check every 2 optimizer steps.
Writes what it saw to ``<out>/rank<R>.pt``.

    python deepspeed_lightning_worker.py <out> --runs 2:bf16,2:fp8,2:fp8-string,3:bf16,3:fp8

The runs fit one after the other in the same launch, each into ``<out>/<stage>/<run>`` (a
launch's start is most of such a small run's time).
"""

import argparse
import sys
from pathlib import Path

import deepspeed_worker  # noqa: F401  (DS_ACCELERATOR=cpu, the FP8 GEMM counter)
import lightning.pytorch as L
import torch
from amax_reductions import MAX_ALL_REDUCES
from deepspeed_worker import CHECK_GEMMS, FP8_GEMMS, fp8_state, full_fp32_weights, parse_runs
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from torch import nn

from fp8_plugin import ReferenceCheck
from fp8_plugin.lightning.deepspeed_precision import FP8DeepSpeedPrecision
from dist_teardown import tear_down_process_group  # noqa: E402

STEPS, GRAD_ACCUM, BATCH = 4, 2, 16


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, without its CUDA-only start-up checks (DeepSpeed itself runs
    on CPUs with DS_ACCELERATOR=cpu and gloo): a shim of this GPU-less test machine."""

    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        # As Lightning's, less its check of CUDA device indices (CPU devices have none).
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        # As Lightning's, with the local rank for DeepSpeed's device_rank (a CPU device has no index).
        import argparse

        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, deepspeed_optimizer


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class RecordingLogger(Logger):
    """Keeps what the Trainer logs: ``(step, metrics)`` per call (rank zero only logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "record"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.inputs: list[float] = []  # a fingerprint of each batch (its sum)
        self.input_amaxes: list[float] = []  # the largest magnitude in each batch's inputs
        self.weight_amaxes: list[dict[str, float]] = []  # per optimizer step: max |FP32 master weight|
        self.reduces: list[list[int]] = []
        self.seen = len(MAX_ALL_REDUCES)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % GRAD_ACCUM == 0:  # the weights this optimizer step's forwards use (every rank gathers)
            weights = full_fp32_weights(trainer.strategy.model)
            self.weight_amaxes.append({name.rsplit(".", 1)[0].split("net.", 1)[1]: float(w.abs().max())
                                       for name, w in weights.items() if name.endswith("weight")})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.inputs.append(float(batch[0].double().sum()))
        self.input_amaxes.append(float(batch[0].abs().max()))
        if (batch_idx + 1) % GRAD_ACCUM == 0:
            self.reduces.append(MAX_ALL_REDUCES[self.seen:])
            self.seen = len(MAX_ALL_REDUCES)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    # Two optimizer steps per epoch on each rank: the step-2 checkpoint ends the first epoch, so
    # the resumed fit starts the second one at its first batch, as the uninterrupted fit did.
    n = BATCH * GRAD_ACCUM * 2 * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 32, generator=g) * 3, torch.randn(n, 16, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def fit(out: Path, stage: int, precision: str, ckpt_path=None) -> tuple[L.Trainer, Net, Record]:
    strategy = CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo", logging_batch_size_per_gpu=BATCH)
    record = Record()
    # The plugin's FP8 run also runs a reference check every 2 optimizer steps (policy "log").
    plugin = FP8DeepSpeedPrecision(statistics=2, reference_check=ReferenceCheck(every=2, policy="log"))
    kwargs = {"plugins": [plugin]} if precision == "fp8" else {"precision": "bf16-mixed"}
    if precision == "fp8-string":
        # Lightning's own name, resolved to the CPU shim of the same class (what the user writes).
        strategy = f"deepspeed_stage_{stage}"
        StrategyRegistry.register(strategy, CPUDeepSpeedStrategy, description="CPU shim", override=True, stage=stage,
                                  process_group_backend="gloo", logging_batch_size_per_gpu=BATCH)
        kwargs = {"precision": "fp8-hybrid"}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                        accumulate_grad_batches=GRAD_ACCUM, logger=RecordingLogger(), enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out), num_sanity_val_steps=0,
                        callbacks=[record, ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=2,
                                                           save_top_k=-1, filename="{step}")], **kwargs)
    model = Net()
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model, record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", required=True,
                        help="'STAGE:RUN,...' (RUN: fp8, bf16, fp8-string), one after the other in this launch, "
                             "each into <out>/<STAGE>/<RUN>")
    args = parser.parse_args()
    runs = parse_runs(parser, args.runs, ("fp8", "bf16", "fp8-string"))
    for stage, name in runs:
        run(args.out / stage / name, int(stage), name)
    tear_down_process_group()


def run(out: Path, stage: int, precision: str) -> None:
    gemms_before, checks_before = FP8_GEMMS[0], CHECK_GEMMS[0]
    trainer, model, record = fit(out, stage, precision)
    engine = trainer.strategy.model
    check_gemms = CHECK_GEMMS[0] - checks_before
    result = {
        "world_size": trainer.world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "bf16_enabled": engine.bfloat16_enabled(),
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "recipe_format": (trainer.precision_plugin.fp8.report.recipe.fp8_format.name
                          if isinstance(trainer.precision_plugin, FP8DeepSpeedPrecision) else None),
        "losses": record.losses,
        "inputs": record.inputs,
        "input_amaxes": record.input_amaxes,
        "weight_amaxes": record.weight_amaxes,
        "logged": trainer.logger.logged,
        "max_all_reduces": record.reduces,
        "train_fp8_gemms": FP8_GEMMS[0] - gemms_before - check_gemms,
        "check_fp8_gemms": check_gemms,
        "fp8_state": fp8_state(engine),
        "weights": full_fp32_weights(engine),
    }
    if precision == "fp8":
        result["reference_results"] = [{k: v for k, v in r.to_dict().items() if k != "seconds"}
                                       for r in trainer.precision_plugin.fp8.reference.results]
        resumed, _, resumed_record = fit(out / "resumed", stage, precision,
                                         ckpt_path=str(out / "ckpt" / "step=2.ckpt"))
        result["resumed_losses"] = resumed_record.losses
        result["resumed_inputs"] = resumed_record.inputs
        result["resumed_fp8_state"] = fp8_state(resumed.strategy.model)
        result["resumed_weights"] = full_fp32_weights(resumed.strategy.model)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    sys.exit(main())
