"""Bad settings fail at start-up, before any training step, with an error that names the setting,
the value and the valid choices; likely mistakes are warned about."""

import sys
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin as fp
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.numerics.recipes import MAX_AMAX_HISTORY_LEN, MAX_MARGIN
from lightning_modules import CountingMLP


@pytest.mark.parametrize("kwargs, match", [
    (dict(margin=20), r"margin=20\) is invalid; valid: an integer from 0 to 7"),
    (dict(margin=200), r"margin=200\) is invalid"),
    (dict(margin=-1), r"margin=-1\) is invalid"),
    (dict(margin=1.0), r"margin=1.0\) is invalid"),
    (dict(amax_history_len=0), r"amax_history_len=0\) is invalid; valid: an integer from 1 to 65536"),
    (dict(amax_history_len=MAX_AMAX_HISTORY_LEN + 1), r"amax_history_len=65537\) is invalid"),
    (dict(amax_compute_algo="mean"), r"amax_compute_algo='mean'\) is invalid; valid: 'max', 'most_recent'"),
    (dict(amax_outlier_factor=1.0), r"amax_outlier_factor=1.0\) is invalid; valid: a finite number > 1"),
    (dict(amax_outlier_factor=float("inf")), r"amax_outlier_factor=inf\) is invalid"),
    (dict(amax_outlier_policy="drop"), r"amax_outlier_policy='drop'\) is invalid; valid: 'clip', 'keep', 'skip'"),
])
def test_delayed_scaling_fields_out_of_bounds_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp.DelayedScaling(**kwargs)


def test_largest_valid_margin_still_leaves_normal_e4m3_values():
    # The bound's reason: at MAX_MARGIN the largest value is cast to 448 / 2**7 = 3.5, seven
    # binades above E4M3's smallest normal 2**-6; one more margin step would leave six.
    assert 448 / 2**MAX_MARGIN >= 2.0**-6 * 2**7
    assert fp.DelayedScaling(margin=MAX_MARGIN).margin == MAX_MARGIN


@pytest.mark.parametrize("make, error, match", [
    (lambda: fp.QParams(amax_epsilon=float("nan")), ValueError, r"amax_epsilon=nan\) is invalid; valid: a float from 0 to the float32 max"),
    (lambda: fp.QParams(amax_epsilon=float("inf")), ValueError, r"amax_epsilon=inf\) is invalid"),
    (lambda: fp.QParams(power_2_scale="yes"), TypeError, r"power_2_scale='yes'\) is invalid; valid: True, False"),
    (lambda: fp.Float8BlockScaling(x_block_scaling_dim=True), ValueError, r"x_block_scaling_dim=True\) is invalid"),
    (lambda: fp.Float8BlockScaling(fp8_quant_fwd_inp=0.0), TypeError, r"fp8_quant_fwd_inp=0.0\) is invalid"),
    (lambda: fp.DelayedScaling(reduce_amax="no"), TypeError, r"reduce_amax='no'\) is invalid; valid: True, False"),
])
def test_block_and_delayed_recipe_argument_types_are_checked(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def test_include_of_the_wrong_type_names_the_setting():
    with pytest.raises(TypeError, match=r"include=5 is invalid; valid: a glob pattern over module names or a list"):
        fp.convert_model(_mlp(), include=5)


@pytest.mark.parametrize("setting", ["include", "exclude"])
def test_pattern_that_matches_no_layer_is_an_error_listing_the_layers(setting):
    model = _mlp()
    with pytest.raises(ValueError, match=rf"{setting} pattern '\*\.attention\.\*' matches no linear layer of this "
                                         r"model; valid: .*'0', '2'"):
        fp.convert_model(model, **{setting: ["0", "*.attention.*"][-1:]})
    assert not any(isinstance(m, fp.FP8Linear) for m in model.modules())  # nothing swapped before the error


def test_pattern_error_reaches_a_lightning_run_before_any_step():
    module = CountingMLP()
    trainer = L.Trainer(plugins=[FP8Precision(exclude="*.atention.*")], accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"exclude pattern '\*\.atention\.\*' matches no linear layer"):
        trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 32)), batch_size=8))
    assert module.steps == 0


def test_autocast_around_an_unconverted_model_warns_once():
    autocast_module = sys.modules["fp8_plugin.modules.autocast"]  # the attribute fp8_plugin.modules.autocast is the function
    autocast_module._warned_no_fp8 = False
    model = _mlp()
    with pytest.warns(UserWarning, match=r"no FP8 layer ran: the model runs in high precision\. Convert it first"):
        with fp.autocast():
            model(torch.randn(4, 32)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp.autocast():  # once is enough
            model(torch.randn(4, 32))
        fp.convert_model(model)
        with torch.no_grad(), fp.autocast():  # evaluation contexts are not watched
            nn.Linear(3, 3)(torch.randn(1, 3))


def test_autocast_arguments_are_checked():
    with pytest.raises(TypeError, match=r"autocast\(enabled='yes'\) is invalid; valid: True, False"):
        with fp.autocast(enabled="yes"):
            pass
    with pytest.raises(TypeError, match=r"autocast\(recipe='fp8-hybrid'\) is not a recipe"):
        with fp.autocast(recipe="fp8-hybrid"):
            pass


def test_input_dtype_other_than_the_weights_fails_alike_with_and_without_fp8():
    # nn.Linear refuses float16 input into a float32 layer; the FP8 layer must not quietly compute
    # in float16 instead while FP8 is on (and fail when it is off).
    model = _mlp()
    fp.convert_model(model)
    x = torch.randn(4, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"(?i)dtype"):
        model(x)
    with pytest.raises(RuntimeError, match=r"FP8Linear: input dtype torch.float16 differs from the weight's "
                                           r"torch.float32 outside torch autocast"):
        with fp.autocast():
            model(x)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compute_dtype=torch.int8), ValueError, r"compute_dtype=torch.int8\) is not supported; valid"),
    (dict(recipe="fp8-hybrid"), TypeError, r"recipe='fp8-hybrid'\) is not a recipe"),
    (dict(nonfinite="ignore"), ValueError, r"nonfinite='ignore' is invalid; valid: 'skip', 'raise'"),
    (dict(max_consecutive_skips=-2), ValueError, r"max_consecutive_skips=-2 is invalid; valid: an integer >= 0"),
    (dict(reference_every=-1), ValueError, r"reference_every"),
])
def test_lightning_plugin_arguments_are_checked_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8Precision(**kwargs)


def test_unknown_precision_string_lists_the_valid_ones():
    import fp8_plugin  # noqa: F401  (registers the strings)

    with pytest.raises(ValueError, match=r"fp8-hybird.*fp8-hybrid"):
        L.Trainer(precision="fp8-hybird", accelerator="cpu", logger=False)


def test_accelerate_fault_settings_from_arguments_handler_and_config_keys(fresh_accelerate, monkeypatch):
    from fp8_plugin.accelerate import Accelerator, FP8Kwargs

    acc = Accelerator(mixed_precision="fp8", fp8_nonfinite="raise", fp8_max_consecutive_skips=3)
    assert (acc.fp8_settings.fault_policy.nonfinite, acc.fp8_settings.fault_policy.max_consecutive_skips) == ("raise", 3)
    with pytest.raises(ValueError, match=r"FP8Kwargs\(nonfinite\)='halt' is not valid; valid: 'skip', 'raise'"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(nonfinite="halt")])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_NONFINITE", "raise")
    monkeypatch.setenv("ACCELERATE_FP8_MAX_CONSECUTIVE_SKIPS", "lots")
    with pytest.raises(ValueError, match=r"ACCELERATE_FP8_MAX_CONSECUTIVE_SKIPS='lots' is not valid; valid: an int"):
        Accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default ShardedGradScaler is enabled on CUDA")
def test_fsdp_plugin_refuses_float16_without_an_enabled_loss_scaler():
    from fp8_plugin.lightning import FP8FSDPPrecision

    with pytest.raises(ValueError, match=r"compute_dtype=torch.float16\) needs an enabled loss scaler.*valid here: "
                                         r"torch.bfloat16, torch.float32"):
        FP8FSDPPrecision(compute_dtype=torch.float16)
    assert FP8FSDPPrecision(compute_dtype=torch.bfloat16).scaler is None
