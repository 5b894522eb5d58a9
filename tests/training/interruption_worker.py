"""One rank of the interruption tests (tests/training/test_interruption.py), started by torchrun.

Trains a small MLP in FP8 with a real Lightning Trainer on CPU (gloo DDP) for 4 epochs of 3
steps, with a checkpoint at the end of every epoch (and ``last.ckpt``), and writes what the test
compares to ``<out>/<run>-rank<r>.pt``: final weights, optimizer state, the precision plugin's
state (FP8 scales and amax histories), losses and the FP8 GEMMs run.

    python -m torch.distributed.run --nproc_per_node 2 tests/training/interruption_worker.py full OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/training/interruption_worker.py killed OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/training/interruption_worker.py killed-saving OUT
    python -m torch.distributed.run --nproc_per_node 2 tests/training/interruption_worker.py resumed OUT --ckpt CKPT

``killed`` is ``full`` where rank 1 sends itself SIGKILL at the start of step ``KILL_STEP`` (the
middle of the third epoch); ``killed-saving`` is ``full`` where rank 0 sends itself SIGKILL
halfway through writing the bytes of the second epoch's checkpoint. Each writes
``<out>/<run>-rank<r>.marker`` first, so the test knows the kill happened.
"""

import argparse
import os
import signal
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import fp8_plugin  # noqa: E402,F401  (registers the precision strings)
import fp8_plugin.numerics.gemm  # noqa: E402
import fp8_plugin.modules.linear_function  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

EPOCHS = 4
STEPS_PER_EPOCH = 3
GLOBAL_BATCH = 16
KILL_STEP = 7  # global_step at the start of the second batch of the third epoch
KILL_WHILE_WRITING = "epoch=1-step=6.ckpt"  # the second epoch's checkpoint
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a rank waiting on a dead peer gives up after this

FP8_GEMMS = [0]  # every FP8 GEMM this process ran, once count_fp8_gemms() is called
# The CPU GEMM path timed for each operand pairing ("native" or "emulated"). Each process times
# its own; where the two paths sum in different orders (oneDNN on AMX CPUs) a different choice
# in the resumed run would change the last bits, so the test shows them when runs differ.
GEMM_PATHS: dict[str, str] = {}


def count_fp8_gemms() -> None:
    """Count the FP8 layers' GEMMs (forward, grad input, grad weight) and record the timed
    GEMM paths from now on."""
    fp8_gemm, choice = fp8_plugin.modules.linear_function.fp8_gemm, fp8_plugin.numerics.gemm.tensorwise_choice

    def counting_fp8_gemm(*args, **kwargs):
        FP8_GEMMS[0] += 1
        return fp8_gemm(*args, **kwargs)

    def recorded_choice(device, dtype_a, dtype_b, out_dtype):
        result = choice(device, dtype_a, dtype_b, out_dtype)
        GEMM_PATHS[f"{dtype_a} x {dtype_b} -> {out_dtype}"] = "native" if result.native else "emulated"
        return result

    fp8_plugin.modules.linear_function.fp8_gemm = counting_fp8_gemm
    fp8_plugin.numerics.gemm.tensorwise_choice = recorded_choice


class MLP(L.LightningModule):
    """No dropout, no randomness after init: a run is a function of its weights and batches.
    The two hidden layers (widths multiples of 16) run in FP8; the 4-wide head does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(Callback):
    """The loss of every step this process ran, by the global step it ran at."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # global_step has already advanced past the step that produced this loss.
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


def die(marker: Path, note: str) -> None:
    """SIGKILL this process: no Python cleanup, no exception, no checkpoint on the way out, as
    when the OOM killer or a lost node takes a worker. The marker is the test's proof that the
    launch failed because of this kill and nothing else."""
    with open(marker, "w") as f:
        f.write(note + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


class KillRank(Callback):
    """Kills one rank at the start of one training step."""

    def __init__(self, out: Path, rank: int, step: int) -> None:
        self.out, self.rank, self.step = out, rank, step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            note = f"{trainer.current_epoch} {batch_idx} {trainer.global_step}"
            die(self.out / f"killed-rank{self.rank}.marker", note)


def kill_while_writing(out: Path, run: str, filename: str) -> None:
    """Kill this process halfway through writing the bytes of checkpoint ``filename``.

    Lightning's writer (``TorchCheckpointIO``) serialises the whole checkpoint into memory, then
    writes it through an fsspec local file in one ``write``: half of it reaches the disk, then
    the process dies. The marker says which file the half went to.
    """
    from fsspec.implementations.local import LocalFileOpener

    write = LocalFileOpener.write

    def half_then_die(self, data, *args, **kwargs):
        if Path(self.path).name != filename:
            return write(self, data, *args, **kwargs)
        write(self, data[: len(data) // 2])
        self.flush()
        os.fsync(self.f.fileno())
        die(out / f"{run}-rank{os.environ['RANK']}.marker", f"{getattr(self, 'temp', self.path)} {len(data)}")

    LocalFileOpener.write = half_then_die


def loader(world: int, rank: int) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    n = STEPS_PER_EPOCH * GLOBAL_BATCH
    data = TensorDataset(torch.randn(n, 32, generator=gen) * 3, torch.randint(0, 4, (n,), generator=gen))
    # Rank r gets samples r, r + world, ... in the same order every epoch: a resumed run sees
    # exactly the batches the uninterrupted one saw in the same epochs.
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def fit(out: Path, run: str, ckpt_path=None) -> None:
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    record = Record()
    callbacks = [
        record,
        ModelCheckpoint(dirpath=out / f"{run}-ckpt", filename="{epoch}-{step}", save_top_k=-1, save_last=True),
    ]
    if run == "killed":
        callbacks.append(KillRank(out, rank=1, step=KILL_STEP))
    if run == "killed-saving" and rank == 0:  # rank 0 alone writes checkpoints under DDP
        kill_while_writing(out, run, KILL_WHILE_WRITING)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=DDPStrategy(timeout=COLLECTIVE_TIMEOUT), precision="fp8-hybrid",
        max_epochs=EPOCHS, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, use_distributed_sampler=False,
    )
    model = MLP()
    trainer.fit(model, loader(world, rank), ckpt_path=ckpt_path)
    plugin = trainer.precision_plugin
    result = {
        # Every rank calls state_dict(): it settles pending amaxes with a collective.
        "plugin_state": plugin.state_dict(),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "losses": record.losses,
        "fp8_gemms": FP8_GEMMS[0],
        "gemm_paths": dict(GEMM_PATHS),
        "fp8_layers": [d.name for d in plugin.report.swapped],
        "high_precision_layers": [d.name for d in plugin.report.skipped],
        "recipe": repr(plugin.report.recipe),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
    }
    torch.save(result, out / f"{run}-rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", choices=["full", "killed", "killed-saving", "resumed"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--ckpt", type=Path, default=None)
    args = parser.parse_args()
    count_fp8_gemms()
    fit(args.out, args.run, args.ckpt)
    tear_down_process_group()


if __name__ == "__main__":
    main()
