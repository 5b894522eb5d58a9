"""fp8_plugin.calibrate on two gloo ranks (tests/modules/calibration_worker.py, in the shared
launch): each rank calibrates on its own batches, and both end with the same scales and choices,
those of the union of their batches: the amaxes MAX-reduced, the SQNR sums SUM-reduced.

Only rank 1's batches hold a massive activation: without the reductions rank 0 would keep
per-tensor scaling for that layer and a smaller input scale than rank 1's.
"""

from calibration_worker import batches
from test_distributed import assert_identical


def test_two_ranks_end_with_the_scales_and_choices_of_their_batches_together(distributed_runs):
    runs = distributed_runs("calibration")
    r0, r1 = runs["calibration-rank0"], runs["calibration-rank1"]
    assert_identical(r0["states"], r1["states"], "states")
    assert r0["scaling"] == r1["scaling"] == {"outliers": "blockwise", "plain": "recipe"}
    assert r0["rows"] == r1["rows"]
    # Each calibration batch's input amax: the larger of the two ranks' (column 1 the newest).
    for index, name in ((0, "outliers"), (1, "plain")):
        want = [max(float(batches(rank)[b][index].abs().max()) for rank in (0, 1)) for b in (1, 0)]
        assert r0["states"][name]["amax_history"][0, 1:3].tolist() == want
    assert r0["states"]["outliers"]["amax_history"][0, 1] == 2.0**15
