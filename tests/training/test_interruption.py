"""A 2-rank FP8 run killed mid-training resumes from its last checkpoint to the same result as an
uninterrupted run, bit for bit (CPU, gloo DDP, real Lightning Trainers, bounded in time).

Each test starts tests/training/interruption_worker.py under torchrun: an uninterrupted run of 4 epochs x
3 steps; the same run with rank 1 SIGKILLed in the middle of the third epoch; a fresh run that
resumes from the killed run's ``last.ckpt``; and the same run with rank 0 SIGKILLed halfway
through writing a checkpoint. The tests compare what the ranks and the checkpoints hold.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from interruption_worker import COLLECTIVE_TIMEOUT, EPOCHS, KILL_STEP, KILL_WHILE_WRITING, STEPS_PER_EPOCH

WORKER = Path(__file__).with_name("interruption_worker.py")
TIMEOUT_S = 180  # per launch: a hang fails the test instead of stalling the suite
STEPS = EPOCHS * STEPS_PER_EPOCH
PLUGIN_KEY = "FP8Precision"  # the precision plugin's entry in a Lightning checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run the worker on 2 ranks; returns the finished launch and the time it ended."""
    # Lightning writes a checkpoint to a temporary file in TMPDIR and moves it into place: an
    # atomic rename on the checkpoints' filesystem, a copy that a kill can truncate across two.
    tmp = out / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(WORKER), run, str(out), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers (they run in sessions of their own).
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), time.time()


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-3000:] + proc.stderr[-6000:]


def results(out: Path, run: str) -> dict:
    return {rank: torch.load(out / f"{run}-rank{rank}.pt", weights_only=False) for rank in (0, 1)}


def assert_equal(a, b, what: str) -> None:
    """Exact equality, down to every tensor's bits (torch.equal) and dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_equal(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{what} differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def assert_same_end(a: dict, b: dict, what: str) -> None:
    for key in ("weights", "optimizer", "plugin_state", "global_step", "current_epoch"):
        assert_equal(a[key], b[key], f"{what}.{key}")


def assert_same_checkpoint(a: dict, b: dict, what: str) -> None:
    # Everything that training resumes from (the callbacks' entries name their directories).
    for key in ("state_dict", "optimizer_states", PLUGIN_KEY, "loops", "epoch", "global_step"):
        assert_equal(a[key], b[key], f"{what}[{key!r}]")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("interruption")
    full, _ = launch("full", out)
    assert full.returncode == 0, output(full)
    killed, killed_end = launch("killed", out)
    last = out / "killed-ckpt" / "last.ckpt"
    resumed, _ = launch("resumed", out, "--ckpt", str(last))
    assert resumed.returncode == 0, output(resumed)
    return {"out": out, "killed": killed, "killed_end": killed_end, "last": last,
            "full": results(out, "full"), "resumed": results(out, "resumed")}


def test_uninterrupted_run_trains_in_fp8_with_ranks_in_agreement(runs):
    full = runs["full"]
    for rank in (0, 1):
        run = full[rank]
        assert "DelayedScaling" in run["recipe"]
        assert run["fp8_layers"] == ["net.0", "net.2"] and run["high_precision_layers"] == ["net.4"]
        assert run["global_step"] == STEPS and sorted(run["losses"]) == list(range(STEPS))
        assert run["fp8_gemms"] > 0 and run["fp8_gemms"] % STEPS == 0
        layers = run["plugin_state"]["fp8_state"]
        assert sorted(layers) == ["net.0.fp8_state._extra_state", "net.2.fp8_state._extra_state"]
        for name, state in layers.items():
            # Scales computed from real amaxes: every role initialised, none left at 1.
            assert state["initialized"].all() and torch.isfinite(state["scale"]).all(), name
            assert (state["scale"] != 1).all() and (state["amax_history"].amax(dim=1) > 0).all(), name
        assert run["losses"][STEPS - 1] < run["losses"][0] - 0.5  # it learned
    assert_same_end(full[0], full[1], "uninterrupted rank 0 vs rank 1")
    # Different samples per rank: the agreement comes from DDP and the amax reduction.
    assert full[0]["losses"] != full[1]["losses"]


def test_killing_one_rank_mid_epoch_ends_the_launch_promptly_with_a_failure(runs):
    out, killed = runs["out"], runs["killed"]
    marker = out / "killed-rank1.marker"
    assert marker.exists(), "rank 1 was never killed:\n" + output(killed)
    epoch, batch_idx, step = map(int, marker.read_text().split())
    assert (epoch, batch_idx, step) == (2, 1, KILL_STEP)  # the middle of the third epoch
    assert killed.returncode != 0, output(killed)
    # Rank 0 learns of the death from the closed connection at its next collective; the DDP
    # timeout bounds the wait even if it did not.
    assert runs["killed_end"] - marker.stat().st_mtime < COLLECTIVE_TIMEOUT.total_seconds() + 30, output(killed)
    assert not list(out.glob("killed-rank*.pt")), "a rank finished training"


def test_killed_run_leaves_its_last_epoch_checkpoint_complete_and_loadable(runs):
    out = runs["out"]
    ckpts = sorted(p.name for p in (out / "killed-ckpt").iterdir())
    assert ckpts == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    last = torch.load(runs["last"], weights_only=True)
    assert last["epoch"] == 1 and last["global_step"] == 2 * STEPS_PER_EPOCH
    # It is the uninterrupted run's checkpoint of the same step, bit for bit.
    reference = torch.load(out / "full-ckpt" / "epoch=1-step=6.ckpt", weights_only=True)
    assert_same_checkpoint(last, reference, "killed last.ckpt vs uninterrupted epoch=1-step=6.ckpt")
    assert last[PLUGIN_KEY]["fp8_state"], "no FP8 state in the checkpoint"


def test_resumed_run_ends_bit_for_bit_where_the_uninterrupted_run_ends(runs):
    full, resumed = runs["full"], runs["resumed"]
    start = 2 * STEPS_PER_EPOCH  # the killed run's last checkpoint
    for rank in (0, 1):
        # The same losses at the same steps: the same batches in the same order, the same scales.
        assert resumed[rank]["losses"] == {s: full[rank]["losses"][s] for s in range(start, STEPS)}
        paths = f"(GEMM paths: {full[rank]['gemm_paths']} then {resumed[rank]['gemm_paths']})"
        assert_same_end(resumed[rank], full[rank], f"rank {rank} resumed vs uninterrupted {paths}")
        # It trained its steps in FP8, at the uninterrupted run's GEMMs per step.
        assert resumed[rank]["fp8_gemms"] * STEPS == full[rank]["fp8_gemms"] * (STEPS - start)
    assert_same_end(resumed[0], resumed[1], "resumed rank 0 vs rank 1")


def test_kill_while_writing_a_checkpoint_leaves_the_previous_one_intact(runs):
    out = runs["out"]
    killed, _ = launch("killed-saving", out)
    marker = out / "killed-saving-rank0.marker"
    assert marker.exists(), "rank 0 was never killed while writing:\n" + output(killed)
    assert killed.returncode != 0, output(killed)
    half_written, size = marker.read_text().split()
    ckpt_dir = out / "killed-saving-ckpt"
    # Half of the checkpoint reached the disk, but not under a checkpoint's name (Lightning
    # writes a temporary file and renames it): no partial .ckpt, and last.ckpt is still the
    # whole first-epoch checkpoint.
    assert Path(half_written) != ckpt_dir / KILL_WHILE_WRITING and int(size) > 0
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    reference = torch.load(out / "full-ckpt" / "epoch=0-step=3.ckpt", weights_only=True)
    assert_same_checkpoint(last, reference, "last.ckpt after a kill mid-write vs uninterrupted epoch=0-step=3.ckpt")
