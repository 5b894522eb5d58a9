"""Reference checks on FSDP2-sharded models (``fully_shard``; Lightning's ``ModelParallelStrategy``).

Two ranks of tests/training/reference_fsdp_worker.py (gloo, CPU; run in the shared launch of
tests/training/distributed_worker.py) feed every test here. The
replay runs FSDP's own backward into the sharded ``.grad`` and the figures are summed from each
rank's shard, so a sharded check must give the unsharded model's figures, up to the order of the
float64 sums.
"""

import math

import pytest


U64 = 2.0**-53  # unit roundoff of float64
U32 = 2.0**-24  # unit roundoff of float32


def gamma(n: int, u: float) -> float:
    # Higham's gamma_n = n u / (1 - n u): the relative error bound of a sum of n terms of one
    # sign, or of sum |t_i| for any signs, in any order (Higham, "Accuracy and Stability of
    # Numerical Algorithms", 4.2).
    return n * u / (1 - n * u)


@pytest.fixture(scope="module")
def runs(distributed_runs):
    return distributed_runs("reference-fsdp2")  # tests/training/reference_fsdp_worker.py, in the shared launch


def test_a_sharded_check_gives_the_unsharded_figures_and_leaves_training_gradients_alone(runs):
    for rank in (0, 1):
        sharded, unsharded = runs[f"sharded-rank{rank}"], runs[f"unsharded-rank{rank}"]
        got, expected = sharded["result"], unsharded["result"]
        assert got == runs["sharded-rank0"]["result"]  # every rank the same figures
        # The gradient figures: float64 sums of exact float32 products (and of float64-rounded
        # differences), the shards' sums then the ranks': any two orders differ by at most
        # 2 gamma_n of sum |t_i| <= sqrt(|g8|^2 |gr|^2) (Cauchy-Schwarz), so the cosine by 4 gamma_n
        # and the relative error (a square root of a ratio of two such sums) by 2 gamma_n relative.
        n = sharded["numel"] + 2
        assert got["grad_cosine"] == pytest.approx(expected["grad_cosine"], rel=0, abs=4 * gamma(n, U64))
        assert got["grad_rel_error"] == pytest.approx(expected["grad_rel_error"], rel=2 * gamma(n, U64))
        assert got["param_figures"].keys() == expected["param_figures"].keys()
        for name, (cosine, rel_error) in got["param_figures"].items():
            assert cosine == pytest.approx(expected["param_figures"][name][0], rel=0, abs=4 * gamma(n, U64)), name
            assert rel_error == pytest.approx(expected["param_figures"][name][1], rel=2 * gamma(n, U64)), name
        # Losses and the SQNR figures come from the same local tensors either way, their energies
        # summed in float32 (pairwise, at most 512 terms: 9 u32 relative each) then in float64;
        # a ratio of two: 18 u32 relative, 10 / ln 10 * 18 u32 dB.
        db = 10 / math.log(10) * 2 * gamma(9, U32)
        assert got["loss_fp8"] == expected["loss_fp8"] and got["loss_reference"] == expected["loss_reference"]
        assert got["layer_sqnr_db"].keys() == expected["layer_sqnr_db"].keys() == {"0", "2"}
        for name, value in got["layer_sqnr_db"].items():
            assert value == pytest.approx(expected["layer_sqnr_db"][name], rel=0, abs=db), name
        assert got["gemm_sqnr_db"].keys() == expected["gemm_sqnr_db"].keys()
        for name, gemms in got["gemm_sqnr_db"].items():
            # The first layer's input needs no gradient: no dgrad; wgrad read on the gathered weight.
            assert set(gemms) == ({"fprop", "wgrad"} if name == "0" else {"fprop", "dgrad", "wgrad"})
            for gemm, value in gemms.items():
                assert value == pytest.approx(expected["gemm_sqnr_db"][name][gemm], rel=0, abs=db), (name, gemm)
        # The planted outlier flushes layer 0's other inputs to zero in FP8: named, and failed.
        assert got["layer_sqnr_db"]["0"] < 5 < 20 < got["layer_sqnr_db"]["2"]
        assert any("0 " in failure and "min_sqnr_db" in failure for failure in got["failures"])
        # Training's sharded gradients are those it had before the check, bit for bit.
        for name, grad in sharded["grads_before"].items():
            assert grad.equal(sharded["grads_after"][name]), name


def test_lightning_fsdp2_checks_name_the_planted_layer_on_both_ranks_and_fall_it_back(runs):
    r0, r1 = runs["planted-rank0"], runs["planted-rank1"]
    assert [r["step"] + 1 for r in r0["results"]] == [2, 4]
    assert r0["results"] == r1["results"]  # identical figures and moves on both ranks
    first = r0["results"][0]
    assert first["layer_sqnr_db"]["net.0"] < 5 and first["fallback_layers"] == ["net.0"]
    assert first["fallback_tried"][-1]["passed"] and first["fallback_tried"][-1]["kept"]
    assert r0["results"][1]["failures"] == []  # net.0 in high precision from then on
    assert r0["use_fp8"] == r1["use_fp8"] == {"0": False, "2": True}


def test_lightning_fsdp2_checks_on_a_healthy_twin_pass_and_leave_training_bit_for_bit(runs):
    for rank in (0, 1):
        checked, plain = runs[f"healthy-rank{rank}"], runs[f"healthy-plain-rank{rank}"]
        assert len(checked["results"]) == 2 and all(r["failures"] == [] for r in checked["results"])
        assert checked["use_fp8"] == {"0": True, "2": True}
        assert checked["weights"].keys() == plain["weights"].keys()
        for name, weight in checked["weights"].items():
            assert weight.equal(plain["weights"][name]), name
    assert runs["healthy-rank0"]["results"] == runs["healthy-rank1"]["results"]
