"""Multi-process FP8 training on CPU (gloo, 2 ranks, real Lightning Trainers), bounded in time.

The tests compare what the ranks of tests/training/distributed_worker.py wrote: every two-rank scenario
in one torchrun launch (the ``distributed_runs`` fixture of tests/conftest.py), the one-rank run
in its own process.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("distributed_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(scenario: str, out: Path, ranks: int = 2) -> dict:
    return run_worker_script(WORKER.name, [scenario], out, ranks)


def run_worker_script(script: str, args: list[str], out: Path, ranks: int = 2) -> dict:
    """Run ``tests/<script> *args out`` on ``ranks`` processes (torchrun, gloo) and load the
    ``.pt`` files it wrote to ``out``, by file stem."""
    worker = WORKER.with_name(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(worker), *args, str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={_free_port()}", str(worker), *args, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_identical(a[key], b[key], f"{what}.{key}")
        else:
            assert torch.equal(a[key], b[key]), f"{what}.{key} differs"


def assert_ranks_identical(runs: dict, run: str) -> None:
    r0, r1 = runs[f"{run}-rank0"], runs[f"{run}-rank1"]
    assert_identical(r0["fp8_state"], r1["fp8_state"], "fp8_state")
    assert_identical(r0["weights"], r1["weights"], "weights")


def assert_resume_exact(runs: dict) -> None:
    # The resumed runs start from the checkpoint after step 3 of the full runs.
    for rank in (0, 1):
        full, resumed = runs[f"full-rank{rank}"], runs[f"resumed-rank{rank}"]
        assert resumed["losses"] == full["losses"][3:]
        assert_identical(full["fp8_state"], resumed["fp8_state"], "fp8_state")
        assert_identical(full["weights"], resumed["weights"], "weights")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, distributed_runs):
    results = dict(distributed_runs("ddp"))
    results.update(run_worker("single", tmp_path_factory.mktemp("single"), ranks=1))
    return results


def test_ddp_ranks_hold_identical_scales_histories_and_weights(ddp):
    r0, r1 = ddp["full-rank0"], ddp["full-rank1"]
    assert "DelayedScaling" in r0["recipe"]
    assert_ranks_identical(ddp, "full")
    # The ranks saw different samples, so without the reduction their amaxes would differ.
    assert r0["losses"] != r1["losses"]


def test_ddp_issues_exactly_one_amax_all_reduce_per_step(ddp):
    # Each step reduces all 2 layers x 3 roles in one call, after its optimizer step.
    assert ddp["full-rank0"]["max_all_reduces"] == [[6]] * 6
    assert ddp["full-rank1"]["max_all_reduces"] == [[6]] * 6


def test_ddp_fit_ends_with_settled_state_and_uneven_predict_issues_no_collective(ddp):
    for rank, batches in ((0, 3), (1, 1)):
        run = ddp[f"full-rank{rank}"]
        assert all(layer["pending"].numel() == 0 for layer in run["fp8_state"].values())
        assert run["predictions"] == batches and run["predict_max_all_reduces"] == 0


def test_ddp_does_not_broadcast_scaling_state_ranks_keep_their_own_without_reduction(distributed_runs):
    # With reduce_amax=False each rank scales with its own amaxes. A DDP buffer broadcast from
    # rank 0 would overwrite rank 1's scales (and hide a missing reduction elsewhere).
    runs = distributed_runs("ddp-local")
    s0, s1 = runs["local-rank0"]["fp8_state"]["net.0"], runs["local-rank1"]["fp8_state"]["net.0"]
    # Input role: rank 1's inputs are exactly 11x rank 0's (same samples, x * 11).
    torch.testing.assert_close(s0["amax_history"][0] * 11, s1["amax_history"][0], rtol=2**-22, atol=0)
    torch.testing.assert_close(s0["scale"][0], s1["scale"][0] * 11, rtol=2**-21, atol=0)


def test_two_ranks_match_one_rank_on_the_same_global_batch(ddp):
    two, one = ddp["full-rank0"], ddp["single-rank0"]
    # Inputs do not depend on the weights: the reduced input amaxes must be the whole batch's.
    assert torch.equal(two["fp8_state"]["net.0"]["amax_history"][0], one["fp8_state"]["net.0"]["amax_history"][0])
    mean_two = [(a + b) / 2 for a, b in zip(ddp["full-rank0"]["losses"], ddp["full-rank1"]["losses"])]
    for a, b in zip(mean_two, one["losses"]):
        assert abs(a - b) / b < 0.02, (mean_two, one["losses"])
    for layer in ("net.0", "net.2"):
        two_scale, one_scale = two["fp8_state"][layer]["scale"], one["fp8_state"][layer]["scale"]
        torch.testing.assert_close(two_scale[:2], one_scale[:2], rtol=0.1, atol=0)  # input, weight
        # Each rank's loss is a mean over half the batch: its grad_output is twice as large.
        torch.testing.assert_close(two_scale[2] * 2, one_scale[2], rtol=0.1, atol=0)


def test_ddp_checkpoint_resume_is_exact_on_every_rank(ddp):
    assert_resume_exact(ddp)


def test_ddp_with_fp8_adamw_keeps_identical_fp8_moments_on_both_ranks_and_resumes_exactly(distributed_runs):
    runs = distributed_runs("ddp-fp8-adamw")
    assert_ranks_identical(runs, "full")
    assert_resume_exact(runs)
    states = [runs[f"{run}-rank{rank}"]["optimizer_state"] for run in ("full", "resumed") for rank in (0, 1)]
    assert states[0] and all(s["exp_avg"].dtype == torch.float8_e4m3fn for s in states[0].values())
    for other in states[1:]:  # DDP's averaged gradients: the same moments on every rank, resumed or not
        assert_identical(states[0], other, "optimizer_state")


@pytest.fixture(scope="module")
def fsdp2(distributed_runs):
    return distributed_runs("fsdp2")


def test_fp8_adamw_refuses_fsdp2_sharded_parameters_naming_the_reason(fsdp2):
    assert fsdp2["full-rank0"]["fp8_adamw_refusal"].startswith(
        "FP8AdamW: parameter 0 is a DTensor (sharded by FSDP2); FP8AdamW keeps whole-tensor block scales")


def test_fsdp2_trains_like_ddp_with_identical_ranks(fsdp2, ddp):
    r0 = fsdp2["full-rank0"]
    assert_ranks_identical(fsdp2, "full")
    assert r0["max_all_reduces"] == [[6]] * 6
    # Same global batches, same FP8 numerics: FSDP2 follows DDP's loss curve.
    for rank in (0, 1):
        for a, b in zip(fsdp2[f"full-rank{rank}"]["losses"], ddp[f"full-rank{rank}"]["losses"]):
            assert abs(a - b) / b < 1e-3
    assert r0["losses"][-1] < r0["losses"][0] - 0.3


def test_fsdp2_checkpoint_resume_is_exact_on_every_rank(fsdp2):
    assert_resume_exact(fsdp2)


def test_fsdp2_current_scaling_uses_the_whole_weights_amax(fsdp2):
    for rank in (0, 1):
        run = fsdp2[f"current-rank{rank}"]
        # The last step's forward cast net.2's weight as it was after the step before.
        whole = run["weight_per_step"][-2].abs().max()
        assert run["fp8_state"]["net.2"]["amax_history"][1, 0] == whole


@pytest.fixture(scope="module")
def fp16(distributed_runs):
    return distributed_runs("fp16")


def test_fp16_loss_scaling_skips_an_overflow_on_one_rank_on_every_rank(fp16):
    # Rank 1 alone gets an inf gradient at step 4 (global_step 3): found-inf must be agreed.
    for rank in (0, 1):
        run = fp16[f"fp16-rank{rank}"]
        weights = run["weight_per_step"]
        assert torch.equal(weights[3], weights[2]), "the skipped step changed the weights"
        assert not torch.equal(weights[4], weights[3])
        assert run["loss_scales"] == [2.0**16] * 3 + [2.0**15] * 3  # backoff 0.5, growth after 2000
        assert run["skipped_steps"] == 1
    assert_ranks_identical(fp16, "fp16")


def test_fabric_ddp_ranks_end_identical_with_one_amax_all_reduce_per_step(distributed_runs):
    runs = distributed_runs("fabric-ddp")
    assert_ranks_identical(runs, "fabric")
    r0, r1 = runs["fabric-rank0"], runs["fabric-rank1"]
    assert r0["losses"] != r1["losses"]  # different samples: the reduction made the scales agree
    # Step 1 reduces at its optimizer step (2 layers x 3 roles), and so does every later one.
    assert r0["max_all_reduces"] == r1["max_all_reduces"] == [[6]] * 6


def test_ddp_reference_checks_agree_across_ranks_and_fall_back_the_same_layer(distributed_runs):
    runs = distributed_runs("reference")
    r0, r1 = runs["checked-rank0"], runs["checked-rank1"]
    assert [r["step"] + 1 for r in r0["results"]] == [2, 4, 6]
    # Identical figures on both ranks, though only rank 1's first layer is faulty.
    assert r0["results"] == r1["results"]
    first = r0["results"][0]
    assert first["fallback_layers"] == ["net.0"] and first["layer_sqnr_db"]["net.0"] < 20.0
    assert r0["use_fp8"] == r1["use_fp8"] == {"net.0": False, "net.2": True}
    assert_identical(r0["weights"], r1["weights"], "weights")
    # Without checks, no fallback: the ranks' weights are those of a run that kept FP8 in net.0.
    assert runs["plain-rank0"]["use_fp8"]["net.0"] is True
