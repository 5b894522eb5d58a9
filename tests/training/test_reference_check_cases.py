"""The worked examples of docs/reference_check_examples.md (examples/reference_check_cases.py), run
in-process on the real MiniLM checkpoint: each case's check of step 2 fails on the planted fault,
the verified fallback moves what was planted there and nothing else (blockwise scaling first,
which keeps its GEMMs in FP8; that layer or that GEMM to high precision where blockwise does not
pass), the check of step 4 passes, and the model then runs every GEMM left in FP8 (counted).

The expectations come from where each fault was planted, not from the figures a run printed."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import fp8_plugin as fp
from reference import count_fp8_gemms

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("reference_check_cases", ROOT / "examples" / "reference_check_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases  # dataclasses resolve their module by name
_spec.loader.exec_module(cases)

# 6 encoder blocks x (query, key, value, attention output, FFN in, FFN out); the head stays high precision.
FP8_LAYERS = 36
# A GEMM whose FP8 operand flushed to zero outputs 0: noise energy equals signal energy, 0 dB.
# 3 dB (noise at half the signal) leaves room for the few values that survive the flush.
FLUSHED_DB = 3.0
# Under the outlier's input scale, 448 / 1e6, the values that survive E4M3's smallest subnormal
# (2^-9) are those above 2^-9 * 1e6 / 448 = 4.4, a few tails of the LayerNorm output: the bulk
# of the signal flushes. 10 dB (a 30% RMS error, min_gemm_sqnr_db) bounds that from above.
OUTLIER_FLUSHED_DB = 10.0


@pytest.fixture(scope="module")
def args():
    return cases.parse_args([])  # the documented defaults: the page's figures come from them


def _count_step(model, batch):
    # One training step after the run: every GEMM still in FP8 is counted, so a layer that
    # silently ran in high precision would fail the count.
    with count_fp8_gemms() as gemms, torch.autocast("cpu", torch.bfloat16), fp.autocast():
        model(**batch).backward()
    model.zero_grad()
    return gemms.count


def _checks(run):
    assert [r.step + 1 for r in run.results] == [2, 4]
    return run.results


def _assert_next_check_passes(after):
    assert after.passed, after.describe()
    assert after.fallback_tried == [] and after.fallback_layers == after.fallback_gemms == []


def test_a_bad_forward_gemm_moves_that_layer_and_nothing_else(args):
    run = cases.run_case("forward", args)
    failed, after = _checks(run)
    layer = cases.FORWARD_LAYER
    assert not failed.passed
    assert failed.layer_sqnr_db[layer] < OUTLIER_FLUSHED_DB
    assert failed.gemm_sqnr_db[layer]["fprop"] < OUTLIER_FLUSHED_DB
    config = cases.check_config(args)
    assert all(db > config.min_sqnr_db for n, db in failed.layer_sqnr_db.items() if n != layer)
    # Blockwise scaling of every layer first: the 1e6 channel crushes its own 1x128 tiles too, the
    # replay fails. Then the first candidate, the layer under min_sqnr_db, restores the figures.
    blockwise, *rest = failed.fallback_tried
    assert blockwise["stage"] == "blockwise" and len(blockwise["moves"]) == FP8_LAYERS and not blockwise["passed"]
    assert [t["moves"] for t in rest] == [[layer]] and rest[0]["kept"]
    assert failed.fallback_layers == [layer] and failed.fallback_gemms == failed.fallback_blockwise == []
    assert run.high_precision() == {layer: cases.GEMMS}
    _assert_next_check_passes(after)
    assert layer not in after.layer_sqnr_db
    assert _count_step(run.model, _batch(args)) == 3 * (FP8_LAYERS - 1)


def test_a_bad_backward_gemm_moves_that_layer_alone_to_blockwise_its_gemms_still_fp8(args):
    run = cases.run_case("backward", args)
    failed, after = _checks(run)
    layer = cases.BACKWARD_LAYER
    config = cases.check_config(args)
    assert not failed.passed and all("grad" in f for f in failed.failures), failed.failures
    # The forward is healthy: no layer under the threshold, the planted one's fprop in its band.
    assert all(db > config.min_sqnr_db for db in failed.layer_sqnr_db.values())
    assert failed.gemm_sqnr_db[layer]["dgrad"] < FLUSHED_DB and failed.gemm_sqnr_db[layer]["wgrad"] < FLUSHED_DB
    # Blockwise scaling reads no delayed scale: its replay passes for all 36 layers; then the layer
    # whose GEMMs the check named (dgrad and wgrad under min_gemm_sqnr_db) alone, in one replay,
    # which passes: its dgrad and wgrad in FP8 again, no halving needed.
    assert all(t["stage"] == "blockwise" for t in failed.fallback_tried) and failed.fallback_tried[0]["passed"]
    assert [t["moves"] for t in failed.fallback_tried[1:]] == [[f"{layer}.blockwise"]]
    assert failed.fallback_blockwise == [layer] and failed.fallback_gemms == failed.fallback_layers == []
    assert run.high_precision() == {} and _blockwise(run) == {layer}
    _assert_next_check_passes(after)
    assert after.gemm_sqnr_db[layer]["dgrad"] > config.min_gemm_sqnr_db
    assert after.gemm_sqnr_db[layer]["wgrad"] > config.min_gemm_sqnr_db
    assert _count_step(run.model, _batch(args)) == 3 * FP8_LAYERS


def test_drift_that_no_gemm_explains_is_localised_by_bisection_to_the_planted_blocks(args):
    run = cases.run_case("bisection", args)
    failed, after = _checks(run)
    config = cases.check_config(args)
    planted = {n for n, m in run.model.named_modules() if isinstance(m, fp.FP8Linear)
               and n.startswith(tuple(b + "." for b in cases.BISECTION_BLOCKS))}
    assert len(planted) == 18
    assert not failed.passed and all("grad" in f for f in failed.failures), failed.failures
    # No layer and no GEMM under its threshold: no first suspects, the drift is spread.
    assert all(db > config.min_sqnr_db for db in failed.layer_sqnr_db.values())
    assert all(db > config.min_gemm_sqnr_db for f in failed.gemm_sqnr_db.values() for db in f.values())
    # Blockwise scaling first: it reads no delayed scale, so it passes for all 36 layers; halving
    # goes on inside the half that passed, and what is kept lies where the drift was planted.
    assert all(t["stage"] == "blockwise" for t in failed.fallback_tried) and failed.fallback_tried[0]["passed"]
    assert any(len(t["moves"]) == FP8_LAYERS // 2 for t in failed.fallback_tried[1:])
    moved = failed.fallback_blockwise
    assert moved and set(moved) <= planted, moved
    assert failed.fallback_gemms == failed.fallback_layers == []
    assert run.high_precision() == {} and _blockwise(run) == set(moved)
    _assert_next_check_passes(after)
    assert _count_step(run.model, _batch(args)) == 3 * FP8_LAYERS  # every GEMM still in FP8


def _blockwise(run):
    return {n for n, m in run.model.named_modules() if isinstance(m, fp.FP8Linear) and m.fp8_scaling == "blockwise"}


def _batch(args):
    from transformers import AutoTokenizer

    return cases.make_batches(args, AutoTokenizer.from_pretrained(args.model_path), 5)[-1]
