"""FP8 MoE experts under DDP and FSDP2: 2 ranks on CPU (gloo, a real Lightning Trainer), bounded in time.

tests/modules/experts_worker.py trains a tiny Mixtral on each rank's own samples; the experts' FP8
scaling state of their weights must end identical on both ranks (the amax reduction, not a
broadcast, makes it so), with one MAX all-reduce per optimizer step that carries the experts'
weight amaxes with the linear layers'. The experts' token rows are scaled by each rank's own
amax at the cast (token_scaling="current", as current scaling is under data parallelism): their
stored amax and scale are each rank's, and no reduction carries them.
"""

import pytest
import torch


pytest.importorskip("transformers")

# Amaxes per step: 8 attention projections x 3 roles less k's and v's inputs in each layer (they
# take q's cast of the same tensor: one amax), and 2 layers x 2 expert projections x 4 experts x
# their weight (the token rows' own-amax scales are not reduced).
AMAXES_PER_STEP = 8 * 3 - 2 * 2 + 2 * 2 * 4 * 1
TOKEN_ROLES, WEIGHT = [0, 2], 1


def assert_weight_scaling_identical(a: dict, b: dict) -> None:
    # Every field of every expert's state, the token roles' stored amax and scale (each rank's
    # own cast) left out of the comparison.
    assert a.keys() == b.keys()
    for name in a:
        for key, t in a[name].items():
            u = b[name][key]
            if key in ("amax_history", "scale"):
                t, u = t[WEIGHT], u[WEIGHT]
            assert torch.equal(t, u), f"{name}.{key} differs"
        assert not a[name]["initialized"][TOKEN_ROLES].any()  # no delayed update of the token rows


@pytest.fixture(scope="module")
def moe(distributed_runs):
    return distributed_runs("experts-ddp")  # tests/modules/experts_worker.py, in the shared launch


def test_ddp_experts_fp8_state_identical_on_both_ranks(moe):
    r0, r1 = moe["ddp-rank0"], moe["ddp-rank1"]
    assert r0["losses"] != r1["losses"]  # different samples: without the reduction the amaxes would differ
    assert len(r0["experts_state"]) == 2 * 2 * 4
    assert_weight_scaling_identical(r0["experts_state"], r1["experts_state"])
    for state in r0["experts_state"].values():
        assert state["pending"].numel() == 0  # settled after the last optimizer step
        assert bool(state["initialized"][1])  # every expert's weight scale came from its own amax


def test_ddp_one_amax_all_reduce_per_step_carries_the_experts(moe):
    for rank in (0, 1):
        run = moe[f"ddp-rank{rank}"]
        assert run["max_all_reduces"] == [[AMAXES_PER_STEP]] * 4
        # Every step's experts ran in FP8: 2 layers x 2 projections, forward and both gradients.
        assert run["gemms"] == [{"fprop": 4, "dgrad": 4, "wgrad": 4}] * 4
        assert "MixtralExperts" in run["report"]


@pytest.fixture(scope="module")
def moe_fsdp2(distributed_runs):
    return distributed_runs("experts-fsdp2")


def test_fsdp2_experts_train_like_ddp_with_identical_ranks_and_one_reduction(moe_fsdp2, moe):
    r0, r1 = moe_fsdp2["fsdp2-rank0"], moe_fsdp2["fsdp2-rank1"]
    assert_weight_scaling_identical(r0["experts_state"], r1["experts_state"])
    for rank in (0, 1):
        run = moe_fsdp2[f"fsdp2-rank{rank}"]
        assert run["max_all_reduces"] == [[AMAXES_PER_STEP]] * 4
        assert run["gemms"] == [{"fprop": 4, "dgrad": 4, "wgrad": 4}] * 4
        # Same global batches, same FP8 casts of the all-gathered weights: DDP's loss curve
        # (the gradient reductions sum in another order).
        for a, b in zip(run["losses"], moe[f"ddp-rank{rank}"]["losses"]):
            assert abs(a - b) / b < 1e-3
