"""FP8 scaling state in checkpoints: versioned, checked before it is used, never silent garbage.

A corrupted or truncated state is refused with the key and the fault, before anything is
loaded; a state from another recipe or a newer format is not used (scales start afresh, with a
warning); a state from the previous format loads; a converted model's checkpoint loads into the
unconverted model and back; the files this project writes are replaced atomically.
"""

import copy
import os
import stat

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin as fp
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.numerics.quantizers import INPUT, STATE_VERSION
from fp8_plugin.training.files import atomic_write
from fp8_plugin.training.core import FP8Training
from lightning_modules import CountingMLP
from reference import assert_state_dicts_equal

KEY = "0.fp8_state._extra_state"


def trained(recipe=None, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    fp.convert_model(model, recipe or fp.DelayedScaling(amax_history_len=8))
    for step in range(steps):
        with fp.autocast():
            model(torch.randn(8, 32) * (step + 1)).square().mean().backward()
    fp.update_pending_scales(model)
    return model


def fresh(recipe=None):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    fp.convert_model(model, recipe or fp.DelayedScaling(amax_history_len=8))
    return model


def corrupt(state, how):
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    if how == "nan scale":
        state["scale"][INPUT] = float("nan")
    elif how == "zero scale":
        state["scale"][1] = 0.0
    elif how == "negative amax":
        state["amax_history"][0, 0] = -1.0
    elif how == "truncated history":
        state["amax_history"] = state["amax_history"][:2]
    elif how == "missing entry":
        del state["scale"]
    elif how == "unknown entry":
        state["scales"] = state["scale"]
    elif how == "negative count":
        state["nonfinite_amax_count"][0] = -3
    elif how == "not a dict":
        return [state["scale"]]
    return state


@pytest.mark.parametrize("how", ["nan scale", "zero scale", "negative amax", "truncated history", "missing entry",
                                 "unknown entry", "negative count", "not a dict"])
def test_corrupted_state_is_refused_with_its_key_and_nothing_is_loaded(how):
    saved = trained().state_dict()
    bad = dict(saved)
    bad["2.fp8_state._extra_state"] = corrupt(saved["2.fp8_state._extra_state"], how)
    target = fresh()
    before = copy.deepcopy(target.state_dict())
    run = FP8Training(fp.DelayedScaling(amax_history_len=8))
    run.convert(target)  # already converted: counts as the run's module
    run.module = target
    fp8_part = {k: v for k, v in bad.items() if "fp8_state" in k}
    with pytest.raises(RuntimeError, match=r"2\.fp8_state\._extra_state: the FP8 scaling state in the checkpoint is "
                                           r"corrupted .*nothing of it was loaded"):
        run.load_state_dict(fp8_part, "FP8Precision")
    after = target.state_dict()
    assert_state_dicts_equal(before, after)  # layer 0, checked before layer 2, was not loaded either


def test_corrupted_state_in_a_lightning_checkpoint_stops_resume_before_any_step(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(32, 32)), batch_size=8)
    common = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(plugins=[FP8Precision(fp.DelayedScaling(amax_history_len=4), compute_dtype=torch.float32)],
                        max_epochs=1, default_root_dir=tmp_path, **common)
    trainer.fit(CountingMLP(), data)
    path = tmp_path / "ckpt.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    plugin_key = next(k for k in checkpoint if "FP8Precision" in k or k == "precision_plugin")
    state = checkpoint[plugin_key]["fp8_state"]
    state["net.0.fp8_state._extra_state"]["scale"][0] = float("inf")
    torch.save(checkpoint, path)
    raw = path.read_bytes()

    module = CountingMLP()
    resumed = L.Trainer(plugins=[FP8Precision(fp.DelayedScaling(amax_history_len=4), compute_dtype=torch.float32)],
                        max_epochs=2, default_root_dir=tmp_path, **common)
    with pytest.raises(RuntimeError, match=r"net\.0\.fp8_state\._extra_state: .*corrupted \(scale .* is not all finite"):
        resumed.fit(module, data, ckpt_path=path)
    assert module.steps == 0 and path.read_bytes() == raw  # no step ran, the file is as it was

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(raw[: len(raw) // 2])
    module = CountingMLP()
    again = L.Trainer(plugins=[FP8Precision(fp.DelayedScaling(amax_history_len=4), compute_dtype=torch.float32)],
                      max_epochs=2, default_root_dir=tmp_path, **common)
    # torch.load refuses the file (the error is torch's: an OSError or a RuntimeError from zip reading).
    with pytest.raises((OSError, RuntimeError)):
        again.fit(module, data, ckpt_path=truncated)
    assert module.steps == 0


def test_lightning_checkpoint_without_fp8_state_resumes_with_a_warning(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(32, 32)), batch_size=8)
    common = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=tmp_path)
    plain = L.Trainer(max_epochs=1, **common)  # a float32 run, no FP8 state in its checkpoint
    plain.fit(CountingMLP(), data)
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = L.Trainer(plugins=[FP8Precision(fp.DelayedScaling(amax_history_len=4), compute_dtype=torch.float32)],
                        max_epochs=2, **common)
    with pytest.warns(UserWarning, match="holds no FP8 state .* FP8 scales start afresh"):
        resumed.fit(CountingMLP(), data, ckpt_path=tmp_path / "plain.ckpt")


def test_state_of_the_previous_format_loads_with_outlier_counters_at_zero():
    saved = trained().state_dict()
    old = {k: v for k, v in saved[KEY].items() if k not in ("version", "recipe", "outlier_count", "outlier_ratio")}
    target = fresh()
    target.load_state_dict({**saved, KEY: old})
    state = target[0].fp8_state
    assert torch.equal(state.scale, saved[KEY]["scale"]) and torch.equal(state.amax_history, saved[KEY]["amax_history"])
    assert state.outlier_count.tolist() == [0, 0, 0]


def test_state_of_a_newer_format_is_not_used_and_says_so():
    saved = trained().state_dict()
    newer = {**saved[KEY], "version": torch.tensor(STATE_VERSION + 1), "future": torch.zeros(3)}
    target = fresh()
    with pytest.warns(UserWarning, match=rf"0\.fp8_state\._extra_state: FP8 scaling state of format version "
                                         rf"{STATE_VERSION + 1}, written by a newer fp8-plugin"):
        target.load_state_dict({**saved, KEY: newer})
    assert target[0].fp8_state.initialized.tolist() == [False, False, False]
    assert torch.equal(target[0].weight, saved["0.weight"])  # the weights still load


@pytest.mark.parametrize("other", [fp.DelayedScaling(fp8_format=fp.Format.E4M3, amax_history_len=8),
                                   fp.DelayedScaling(margin=1, amax_history_len=8), fp.Float8CurrentScaling()],
                         ids=["format", "margin", "method"])
def test_state_of_another_recipe_is_not_used_and_scales_start_afresh(other):
    # The recipe in force is known at the first cast (an autocast may override the layer's): the
    # saved scales are dropped there, and the step then computes exactly as a model that never
    # loaded them.
    source = trained()
    source[0].use_fp8 = False  # a layer moved to high precision stays there
    saved = source.state_dict()
    target, never_loaded = fresh(other), fresh(other)
    never_loaded[0].use_fp8 = False
    target.load_state_dict(saved)
    never_loaded.load_state_dict({k: v for k, v in saved.items() if "fp8_state" not in k})
    assert target[0].use_fp8 is False
    x = torch.randn(8, 32)
    with pytest.warns(UserWarning, match=r"2\.fp8_state\._extra_state: the checkpoint's FP8 scales belong to "
                                         r"DelayedScaling\(HYBRID, margin=0\), this layer now runs"):
        with fp.autocast():
            y = target(x)
    with fp.autocast():
        expected = never_loaded(x)
    assert torch.equal(y, expected)
    for name, tensor in target[2].fp8_state.tensors().items():
        assert torch.equal(tensor, never_loaded[2].fp8_state.tensors()[name]), name


def test_state_saved_under_an_autocast_recipe_resumes_under_it():
    # Layers built with margin 0, trained under autocast(recipe=margin 1): the saved scales are
    # margin 1's, and resuming under the same autocast keeps them (no warning).
    recipe = fp.DelayedScaling(margin=1, amax_history_len=8)
    source = fresh()
    with fp.autocast(recipe=recipe):
        source(torch.randn(8, 32)).sum().backward()
    fp.update_pending_scales(source)
    target = fresh()
    target.load_state_dict(source.state_dict())
    x = torch.randn(8, 32)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), fp.autocast(recipe=recipe):
            assert torch.equal(target(x), source(x))


def test_same_recipe_with_another_history_length_loads_as_saved():
    saved = trained().state_dict()
    target = fresh(fp.DelayedScaling(amax_history_len=1024))
    target.load_state_dict(saved)
    assert torch.equal(target[0].fp8_state.amax_history, saved[KEY]["amax_history"])


def test_converted_checkpoint_loads_into_the_unconverted_model_and_back():
    source = trained()
    vanilla, fp8_part = fp.split_fp8_state(source.state_dict())
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plain.load_state_dict(vanilla, strict=True)
    x = torch.randn(8, 32)
    assert torch.equal(plain(x), source(x))  # outside the autocast the FP8 model computes as the original

    fp.convert_model(plain, fp.DelayedScaling(amax_history_len=8))
    plain.load_state_dict({**vanilla, **fp8_part}, strict=True)
    with torch.no_grad(), fp.autocast():
        assert torch.equal(plain(x), source(x))  # same scales: the same FP8 numerics


def test_report_files_are_replaced_atomically_with_the_usual_mode(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("previous")

    def fail(f):
        f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(str(path), fail)
    assert path.read_text() == "previous" and sorted(os.listdir(tmp_path)) == ["report.json"]
    atomic_write(str(path), lambda f: f.write("new"))
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
