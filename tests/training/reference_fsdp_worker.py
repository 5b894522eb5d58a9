"""One rank of the FSDP2 reference-check tests (tests/training/test_reference_fsdp.py), started by torchrun.

Three things, written to ``<out>/<run>-rank<r>.pt``:

- ``sharded`` / ``unsharded``: one ``fp8_plugin.reference_check`` on an MLP sharded by
  ``fully_shard`` (each linear layer and the root) and on the same MLP unsharded, every rank the
  same batch; a planted outlier (input channel 0 at 1e6, its weight column zero) flushes the
  first layer's other inputs to zero in FP8. The sharded model's ``.grad`` before and after.
- ``planted`` / ``healthy`` / ``healthy-plain``: a Lightning ``ModelParallelStrategy`` (FSDP2)
  fit with ``ReferenceCheck(every=2, policy="fallback")`` on the planted fault and on a healthy
  twin, and the twin without checks: the results, the layers in FP8, the full weights.

    python -m torch.distributed.run --nproc_per_node 2 tests/training/reference_fsdp_worker.py OUT

(The tests run it within tests/training/distributed_worker.py's launch, scenario ``reference-fsdp2``.)
"""

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin import FP8Linear  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

STEPS = 4
BATCH = 8


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 4))


def shard(model: nn.Module, mesh) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def data(planted: bool, seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 32, generator=gen), torch.randint(0, 4, (rows,), generator=gen)
    if planted:
        x[:, 0] = 1e6
    return x, y


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def one_check(out: Path, rank: int) -> None:
    """The same check on the sharded and the unsharded model, every rank the same batch."""
    model = mlp()
    with torch.no_grad():
        model[0].weight[:, 0] = 0
    fp8_plugin.convert_model(model, fp8_plugin.Float8CurrentScaling())
    unsharded = copy.deepcopy(model)
    shard(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    batch = data(True, 7, BATCH)
    # Training's gradients of the step: the check must leave them as they are.
    loss_fn(model, data(True, 8, BATCH)).backward()
    before = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
    results = {}
    for run, checked in (("sharded", model), ("unsharded", unsharded)):
        result = fp8_plugin.reference_check(checked, batch, loss_fn, compute_dtype=torch.float32)
        results[run] = {k: v for k, v in result.to_dict().items() if k != "seconds"}
    after = {n: _local(p.grad) for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in unsharded.parameters())
    for run, figures in results.items():
        torch.save({"result": figures, "grads_before": before, "grads_after": after, "numel": numel},
                   out / f"{run}-rank{rank}.pt")


class Planted(L.LightningModule):
    """The MLP sharded by FSDP2 in ``configure_model``; with ``planted`` its first layer's weight
    column 0 is zero and kept zero (its gradient zeroed before each step)."""

    def __init__(self, planted: bool) -> None:
        super().__init__()
        self.net = mlp()
        self.planted = planted
        if planted:
            with torch.no_grad():
                self.net[0].weight[:, 0] = 0

    def configure_model(self):
        self.trainer.precision_plugin.convert_module(self)
        shard(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return loss_fn(self.net, batch)

    def on_before_optimizer_step(self, optimizer):
        if self.planted:
            _local(self.net[0].weight.grad)[:, 0] = 0

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def fit(out: Path, run: str, planted: bool, checks: bool, rank: int) -> None:
    world = dist.get_world_size()
    plugin = fp8_plugin.FP8Precision(fp8_plugin.Float8CurrentScaling(), reference_check=fp8_plugin.ReferenceCheck(
        every=2, policy="fallback") if checks else None)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(
        data_parallel_size=world, tensor_parallel_size=1), plugins=[plugin], max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False)
    model = Planted(planted)
    x, y = data(planted, 1 + rank, STEPS * BATCH)  # each rank its own batches
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    checker = plugin.fp8.reference
    torch.save({
        "weights": {k: v.full_tensor().detach().clone() for k, v in model.net.state_dict().items()
                    if ".fp8_state." not in k},
        "use_fp8": {n: m.use_fp8 for n, m in model.net.named_modules() if isinstance(m, FP8Linear)},
        "results": [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in checker.results]
        if checker else [],
    }, out / f"{run}-rank{rank}.pt")


def run(out: Path) -> None:
    """Every run of this file, on the process group in place (or a new gloo one)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    one_check(out, rank)
    for run_name, planted, checks in (("planted", True, True), ("healthy", False, True),
                                      ("healthy-plain", False, False)):
        fit(out, run_name, planted, checks, rank)


if __name__ == "__main__":
    run(Path(sys.argv[-1]))
    tear_down_process_group()
