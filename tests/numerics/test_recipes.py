"""fp8_plugin/numerics/recipes.py: argument checks and delayed scaling against a hand-computed history."""

import pytest
import torch

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8CurrentScaling, Format
from fp8_plugin.numerics.quantizers import INPUT


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"margin": -1}, r"margin=-1.*integer from 0 to 7"),
        ({"amax_history_len": 0}, r"amax_history_len=0.*integer from 1 to 65536"),
        ({"amax_compute_algo": "mean"}, r"amax_compute_algo='mean'.*'max', 'most_recent'"),
        ({"fp8_format": "E6M1"}, r"fp8_format='E6M1'.*Format.E4M3, Format.E5M2, Format.HYBRID"),
        ({"fp8_format": Format.E5M2}, r"E5M2 cannot be the forward format.*Format.HYBRID"),
    ],
)
def test_bad_delayed_scaling_arguments_name_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(**kwargs)


def test_current_scaling_refuses_e5m2_forward():
    with pytest.raises(ValueError, match="E5M2"):
        Float8CurrentScaling(fp8_format="e5m2")


def test_te_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0, Format.HYBRID, 1024, "max", True,
    )


def _run_steps(layer, recipe, amaxes):
    """One forward per step with inputs whose amax is given; returns the scale used per step."""
    used = []
    for a in amaxes:
        x = torch.full((16, 16), a / 4)
        x[0, 0] = a
        with fp.autocast(recipe=recipe):
            layer(x)
            # A step's first forward applies the previous step's amaxes, then casts.
            used.append(_input_scale_in_use(layer))
    return used


def _input_scale_in_use(layer):
    s = layer.fp8_state
    return s.scale[INPUT].item() if s.initialized[INPUT] else None


@pytest.mark.parametrize(
    "algo, expected_amax",
    [
        # history length 3; step amaxes 2, 8, 1, 0.5, 0.25, 4
        ("max", [None, 2, 8, 8, 8, 1]),
        ("most_recent", [None, 2, 8, 1, 0.5, 0.25]),
        (lambda h: h.sum(0) / 2, [None, 1, 5, 5.5, 4.75, 0.875]),
    ],
)
def test_delayed_scaling_follows_hand_computed_history(algo, expected_amax):
    recipe = DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo=algo)
    layer = fp.FP8Linear(16, 16, recipe=recipe)
    used = _run_steps(layer, recipe, [2, 8, 1, 0.5, 0.25, 4])
    expected = [None if a is None else 448.0 / a / 2 for a in expected_amax]
    assert used == pytest.approx(expected)
    fp.update_pending_scales(layer)
    assert layer.fp8_state.amax_history[INPUT].tolist() == [0.0, 4.0, 0.25]


def test_zero_amax_keeps_previous_scale_and_nonfinite_is_counted_not_recorded():
    recipe = DelayedScaling(amax_history_len=1)
    layer = fp.FP8Linear(16, 16, recipe=recipe)
    _run_steps(layer, recipe, [4.0])
    fp.update_pending_scales(layer)
    assert layer.fp8_state.scale[INPUT].item() == pytest.approx(112.0)
    _run_steps(layer, recipe, [0.0])
    fp.update_pending_scales(layer)
    assert layer.fp8_state.scale[INPUT].item() == pytest.approx(112.0)
    x = torch.ones(16, 16)
    x[3, 3] = float("inf")
    with fp.autocast(recipe=recipe):
        layer(x)
    fp.update_pending_scales(layer)
    assert layer.fp8_state.nonfinite_amax_count[INPUT].item() == 1
    assert layer.fp8_state.scale[INPUT].item() == pytest.approx(112.0)


def test_zero_amax_at_start_gives_scale_one():
    recipe = DelayedScaling(amax_history_len=4)
    layer = fp.FP8Linear(16, 16, recipe=recipe)
    _run_steps(layer, recipe, [0.0, 0.0])
    fp.update_pending_scales(layer)
    assert layer.fp8_state.scale[INPUT].item() == 1.0
    assert not layer.fp8_state.initialized[INPUT]


def test_gemm_accumulation_defaults_are_transformer_engines_and_bad_values_name_the_field():
    # TE: fp8_gemm_fprop MMParams(use_split_accumulator=False), dgrad and wgrad True.
    for recipe in (fp.DelayedScaling(), fp.Float8CurrentScaling()):
        assert (recipe.fp8_gemm_fprop, recipe.fp8_gemm_dgrad, recipe.fp8_gemm_wgrad) == (
            fp.MMParams(False), fp.MMParams(True), fp.MMParams(True))
    with pytest.raises(TypeError, match=r"DelayedScaling\(fp8_gemm_wgrad=False\) is invalid; valid: MMParams"):
        fp.DelayedScaling(fp8_gemm_wgrad=False)
    with pytest.raises(TypeError, match=r"Float8CurrentScaling\(fp8_gemm_fprop=MMParams\(use_split_accumulator=1\)\) "
                                        r"is invalid; valid: MMParams\(use_split_accumulator=True or False\)"):
        fp.Float8CurrentScaling(fp8_gemm_fprop=fp.MMParams(use_split_accumulator=1))
