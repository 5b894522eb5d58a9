"""benchmarks/host_profile.py: the steps it times are the training steps it names, and a setting
it cannot honour is refused before anything runs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import host_profile  # noqa: E402
from reference import count_fp8_gemms  # noqa: E402


def test_bf16_mixed_is_refused_on_meta_naming_the_valid_precision(capsys):
    with pytest.raises(SystemExit):
        host_profile.main(["--device", "meta", "--precision", "bf16-mixed", "--recipes", "current"])
    err = capsys.readouterr().err
    assert "--precision bf16-mixed needs --device cuda" in err and "valid on meta: bf16-true" in err


def test_bf16_mixed_steps_train_fp32_master_weights_under_autocast_with_three_fp8_gemms():
    # On CPU (torch autocast acts there): the FP8 step runs its three GEMMs in FP8 under the
    # BF16 autocast, the nn.Linear step runs in BF16, and both weights get float32 gradients.
    torch.manual_seed(0)
    fp8_step, bf16_step, _ = host_profile._layers((32, 64, 48), torch.device("cpu"), "current", "bf16-mixed")
    layers = {type(c.cell_contents).__name__: c.cell_contents for c in fp8_step.__closure__ + bf16_step.__closure__
              if isinstance(c.cell_contents, torch.nn.Module)}
    grads = []
    for layer in layers.values():
        layer.weight.register_hook(lambda g: grads.append(g.dtype) or g)
    with count_fp8_gemms() as gemms:
        fp8_step()
    bf16_step()
    assert gemms.count == 3 and set(gemms.dtypes) == {torch.float8_e4m3fn, torch.float8_e5m2}
    assert {layer.weight.dtype for layer in layers.values()} == {torch.float32} and grads == [torch.float32] * 2


def test_the_per_model_figure_times_the_scale_update_as_the_step_runs_it(monkeypatch):
    # A scale update made 2 ms slower must show as at least 2,000 µs of per-model work per step
    # (each step's first FP8 forward updates once), and the timer leaves the group as it was.
    import time

    from fp8_plugin.modules.scaling_group import ScalingGroup

    update = ScalingGroup.update

    def slow_update(self, *args, **kwargs):
        update(self, *args, **kwargs)
        time.sleep(0.002)

    monkeypatch.setattr(ScalingGroup, "update", slow_update)
    fp8_step, _, per_model_us = host_profile._layers((16, 32, 48), torch.device("cpu"), "delayed")
    layer = next(c.cell_contents for c in fp8_step.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
    assert 2000 <= per_model_us(3, 2) < 50_000
    assert "update" not in vars(layer.scaling_group)


def test_the_chain_runs_each_layer_on_the_previous_ones_output_in_fp8_with_one_scale_update():
    # Four layers K -> N -> K -> N -> K: every GEMM of each in FP8 (3 per layer), one scaling
    # group (one update per step), and the nn.Linear chain's output shape the same.
    torch.manual_seed(0)
    fp8_step, bf16_step = host_profile._chain((16, 32, 48), torch.device("cpu"), "delayed", 4)
    fp8_model = next(c.cell_contents for c in fp8_step.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
    with count_fp8_gemms() as gemms:
        fp8_step()
    bf16_step()
    assert gemms.count == 3 * 4
    assert len({id(layer.scaling_group) for layer in fp8_model}) == 1
    assert [(layer.in_features, layer.out_features) for layer in fp8_model] == [(32, 48), (48, 32)] * 2


def test_a_chains_per_layer_figure_is_its_own_time_less_its_own_meta_kernels_whatever_the_load(monkeypatch):
    # The chain is timed at another moment than the single layer; under a load that changes in
    # between (the suite's other worker) the single layer's meta-kernel time, subtracted from the
    # chain's, once made nn.Linear's chain figure negative (-5.3 µs/layer). Here the chain's steps
    # "run" in 1 µs (timings of 1 step: the chain's; the single layer's are of 4), far faster than
    # the single layer's: each per-layer figure must lie between 0 and the chain's 1/4 µs per layer.
    timed = host_profile._per_step_us
    monkeypatch.setattr(host_profile, "_per_step_us",
                        lambda step, steps, repeats, device: 1.0 if steps == 1 else timed(step, steps, repeats, device))
    figures = host_profile.profile_recipe("delayed", (64, 64, 64), torch.device("meta"), steps=4, repeats=1, top=3,
                                          chain=4)
    assert figures["meta_kernels_us"] > 1.0  # the single layer's meta kernels: more than the chain's whole step
    assert 0 <= figures["chain_fp8_us_per_layer"] <= 1 / 4 and 0 <= figures["chain_bf16_us_per_layer"] <= 1 / 4
