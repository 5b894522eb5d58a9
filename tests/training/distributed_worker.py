"""One rank of the multi-process tests (tests/training/test_distributed.py), started by torchrun.

Trains a small MLP with a real Lightning Trainer on CPU (gloo) and writes what the test compares
to ``<out>/<run>-rank<r>.pt``: FP8 scaling state, full weights, losses, loss scales, and the MAX
all-reduces issued at each step.

    python -m torch.distributed.run --nproc_per_node 2 tests/training/distributed_worker.py SCENARIO[,SCENARIO...] OUT

Several scenarios run one after the other in the same launch, each into ``OUT/<scenario>`` (a
launch's start is most of such a small run's time); ``reference-fsdp2``, ``statistics*``,
``experts-*`` and ``fsdp-fp8-*`` are the other two-rank workers' (:func:`run_other`).
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import fp8_plugin  # noqa: E402,F401  (registers the precision strings)
from amax_reductions import MAX_ALL_REDUCES  # noqa: E402  (counts every amax all-reduce)
from fp8_plugin import FP8Linear  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

STEPS = 6  # two epochs of three steps: checkpoints at an epoch end resume exactly
GLOBAL_BATCH = 16



class MLP(L.LightningModule):
    def __init__(self, fsdp2: bool = False, inf_grad_step: int = -1, fp8_adamw: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        self.fsdp2 = fsdp2
        self.inf_grad_step = inf_grad_step
        self.fp8_adamw = fp8_adamw

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            # Convert before sharding: FSDP2 hooks belong to the module objects it shards.
            self.trainer.precision_plugin.convert_module(self)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def on_after_backward(self):
        # An overflow on one rank only: every rank must skip this step.
        if self.global_step == self.inf_grad_step and self.global_rank == 1:
            grad = self.net[2].weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 0] = float("inf")

    def configure_optimizers(self):
        if self.fp8_adamw:
            return fp8_plugin.optim.FP8AdamW(self.parameters(), lr=1e-2)
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(Callback):
    """Per step: loss, MAX all-reduces issued, loss scale, and (full) weights after the step."""

    def __init__(self) -> None:
        self.losses, self.max_all_reduces, self.loss_scales, self.weights = [], [], [], []
        self._seen = len(MAX_ALL_REDUCES)  # this fit's own, whatever ran before in the process

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.max_all_reduces.append(MAX_ALL_REDUCES[self._seen:])
        self._seen = len(MAX_ALL_REDUCES)
        scaler = trainer.precision_plugin.scaler
        self.loss_scales.append(float(scaler.get_scale()) if scaler is not None else None)
        self.weights.append(_full(module.net[2].weight).clone())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def loader(world, rank_factor: float = 1.0):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS // 2 * GLOBAL_BATCH, 32, generator=gen) * 3
    if rank_factor != 1.0 and int(os.environ.get("RANK", "0")) == 1:
        x = x * rank_factor
    y = torch.randint(0, 4, (STEPS // 2 * GLOBAL_BATCH,), generator=gen)
    data = TensorDataset(x, y)
    # Rank r gets samples r, r + world, ... in order, every epoch: the ranks together see the
    # same global batches as one rank with the whole batch, and a resumed run the same order.
    rank = int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    if rank_factor != 1.0:
        sampler = None  # every rank the same samples, rank 1's scaled
    return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def fit(out: Path, run: str, precision, fsdp2: bool, inf_grad_step: int = -1, ckpt_path=None,
        save: bool = False, rank_factor: float = 1.0, predict: bool = False, fp8_adamw: bool = False) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if fsdp2 else (
        "ddp" if world > 1 else "auto")
    record = Record()
    callbacks = [record]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=out / f"{run}-ckpt", save_top_k=-1, filename="{epoch}"))
    plugin = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, **plugin, max_epochs=STEPS // 3,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=save,
        callbacks=callbacks, use_distributed_sampler=False,
    )
    model = MLP(fsdp2=fsdp2, inf_grad_step=inf_grad_step, fp8_adamw=fp8_adamw)
    trainer.fit(model, loader(world, rank_factor), ckpt_path=ckpt_path)
    # The state as fit left it: no settling call here, it must be settled and rank-independent.
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            state[name] = {k: v.clone() for k, v in module.fp8_state.tensors().items()}
            state[name]["pending"] = torch.tensor(sorted(module.fp8_state.pending))
    result = {
        "fp8_state": state,
        "weights": {k: _full(v).clone() for k, v in model.state_dict().items() if ".fp8_state." not in k},
        "losses": record.losses,
        "max_all_reduces": record.max_all_reduces,
        "loss_scales": record.loss_scales,
        "weight_per_step": record.weights,
        "skipped_steps": trainer.precision_plugin.skipped_steps,
        "recipe": repr(trainer.precision_plugin.report.recipe),
        "optimizer_state": {pid: {k: v.clone() for k, v in st.items()}
                            for pid, st in trainer.optimizers[0].state_dict()["state"].items()},
    }
    if fsdp2:  # FP8AdamW refuses parameters FSDP2 sharded, at construction
        try:
            fp8_plugin.optim.FP8AdamW(model.parameters())
            result["fp8_adamw_refusal"] = None
        except TypeError as err:
            result["fp8_adamw_refusal"] = str(err)
    if predict:
        # Uneven split: rank 0 predicts 3 batches, rank 1 one. Nothing may wait on a collective.
        before = len(MAX_ALL_REDUCES)
        data = TensorDataset(torch.randn(8 * (3 if trainer.global_rank == 0 else 1), 32))
        result["predictions"] = len(trainer.predict(model, DataLoader(data, batch_size=8)))
        result["predict_max_all_reduces"] = len(MAX_ALL_REDUCES) - before
    torch.save(result, out / f"{run}-rank{trainer.global_rank}.pt")


def fit_fabric(out: Path) -> None:
    """Fabric DDP: each rank its own half of every global batch, as with the Trainer."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", precision="fp8-hybrid")
    fabric.launch()
    model = MLP().net
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    losses, reduces = [], []
    for _ in range(STEPS // 3):
        for x, y in loader(world):
            seen = len(MAX_ALL_REDUCES)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            reduces.append(MAX_ALL_REDUCES[seen:])
    state = {name: {k: v.clone() for k, v in m.fp8_state.tensors().items()}
             for name, m in model.module.named_modules() if isinstance(m, FP8Linear)}
    result = {"fp8_state": state, "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()
                                              if ".fp8_state." not in k},
              "losses": losses, "max_all_reduces": reduces}
    torch.save(result, out / f"fabric-rank{fabric.global_rank}.pt")


def fit_reference(out: Path, run: str, checks: bool) -> None:
    """DDP with a fault on rank 1 only: its inputs carry an outlier channel whose weight column
    is zero (and kept zero), and amaxes are not reduced, so only rank 1's first layer flushes
    its inputs to zero. The checks' sums are all-reduced: both ranks must see the same figures
    and move the same layer to high precision."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    recipe = fp8_plugin.Float8CurrentScaling()
    reference = fp8_plugin.ReferenceCheck(every=2, policy="fallback") if checks else None
    plugin = fp8_plugin.FP8Precision(recipe, reference_check=reference)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", plugins=[plugin], max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, use_distributed_sampler=False)
    model = MLP()
    with torch.no_grad():
        model.net[0].weight[:, 0] = 0
    model.net[0].weight.register_hook(lambda grad: grad.index_fill(1, torch.tensor([0]), 0.0))
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(STEPS * GLOBAL_BATCH // world, 32, generator=gen)
    if rank == 1:
        x[:, 0] = 1e6
    y = torch.randint(0, 4, (len(x),), generator=gen)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world))
    checker = plugin.fp8.reference
    result = {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items() if ".fp8_state." not in k},
        "use_fp8": {n: m.use_fp8 for n, m in model.named_modules() if isinstance(m, FP8Linear)},
        "results": [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in checker.results]
        if checker else [],
    }
    torch.save(result, out / f"{run}-rank{rank}.pt")


def run(scenario: str, out: Path) -> None:
    fsdp2 = scenario == "fsdp2"
    if scenario == "reference":
        fit_reference(out, "checked", True)
        fit_reference(out, "plain", False)
    elif scenario == "fabric-ddp":
        fit_fabric(out)
    elif scenario == "fp16":
        fit(out, "fp16", "fp8-hybrid-float16", False, inf_grad_step=3)
    elif scenario == "ddp-fp8-adamw":
        fit(out, "full", "fp8-hybrid", False, save=True, fp8_adamw=True)
        fit(out, "resumed", "fp8-hybrid", False, ckpt_path=out / "full-ckpt" / "epoch=0.ckpt", fp8_adamw=True)
    elif scenario == "single":
        fit(out, "single", "fp8-hybrid", False)
    elif scenario == "ddp-local":
        # No amax reduction and rank 1's inputs 11x rank 0's: each rank keeps its own scales.
        local = fp8_plugin.FP8Precision(fp8_plugin.DelayedScaling(reduce_amax=False, amax_history_len=16))
        fit(out, "local", local, False, rank_factor=11.0)
    else:
        fit(out, "full", "fp8-hybrid", fsdp2, save=True, predict=not fsdp2)
        fit(out, "resumed", "fp8-hybrid", fsdp2, ckpt_path=out / "full-ckpt" / "epoch=0.ckpt")
        if fsdp2:  # current scaling casts the all-gathered weight: its amax is the whole weight's
            fit(out, "current", "fp8-current", fsdp2)


SCENARIOS = ("ddp", "ddp-fp8-adamw", "ddp-local", "single", "fp16", "fsdp2", "fabric-ddp", "reference", "reference-fsdp2",
             "statistics", "statistics-fsdp2", "experts-ddp", "experts-fsdp2", "fsdp-fp8-current", "calibration",
             "frozen-lora-fsdp2")


def run_other(scenario: str, out: Path) -> bool:
    """The scenarios of the other two-rank workers, run in this launch; False for this file's own."""
    if scenario == "reference-fsdp2":
        import reference_fsdp_worker

        reference_fsdp_worker.run(out)
    elif scenario.startswith("statistics"):
        import statistics_worker

        statistics_worker.main(out, scenario == "statistics-fsdp2")
    elif scenario.startswith("experts-"):
        import experts_worker

        experts_worker.run(scenario.split("-", 1)[1], out)
    elif scenario == "calibration":
        import calibration_worker

        calibration_worker.run(out)
    elif scenario == "frozen-lora-fsdp2":
        import frozen_fsdp_worker

        frozen_fsdp_worker.run(out)
    elif scenario.startswith("fsdp-fp8-"):
        import fsdp_fp8_worker

        fsdp_fp8_worker.run(scenario.rsplit("-", 1)[1], out)
    else:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", help=f"one of {', '.join(SCENARIOS)}, or several joined by ',' (run one after "
                                          "the other in this launch, each into OUT/<scenario>)")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    if any(s not in SCENARIOS for s in scenarios):
        parser.error(f"scenarios {args.scenarios!r}: valid: {', '.join(SCENARIOS)}, joined by ','")
    for scenario in scenarios:
        out = args.out / scenario if len(scenarios) > 1 else args.out
        out.mkdir(parents=True, exist_ok=True)
        if not run_other(scenario, out):
            run(scenario, out)
    tear_down_process_group()


if __name__ == "__main__":
    main()
