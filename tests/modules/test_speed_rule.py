"""fp8_plugin/modules/speed_rule.py: FP8 only where the GEMM time it saves exceeds the host time it adds."""

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.speed_rule import DEFAULT_TOKENS, GPU_RATES, SpeedRule, gpu_rates, measured_host_overhead_us
from fp8_plugin.numerics.device_kind import meta_as_cuda

H100 = next(r for r in GPU_RATES if r.name == "H100")
H200 = next(r for r in GPU_RATES if r.name == "H200")


def test_the_projection_gives_the_measured_speed_up_of_a_large_layer():
    # docs/benchmarks.md, H200 run 3: FP8Linear 16384 x 8192 x 8192, delayed scaling, eagerly:
    # 1.60x BF16. The rule's achieved rates are calibrated on it; its projection must give it back.
    rule = SpeedRule(H200, host_overhead_us=0.0, tokens=16384)
    bf16_us = 6 * 16384 * 8192 * 8192 / (989.5e12 * 0.70) * 1e6  # BF16 GEMMs at 70% of the datasheet peak
    speed_up = bf16_us / (bf16_us - rule.gpu_saving_us(8192, 8192))
    assert speed_up == pytest.approx(1.60, rel=0.03)


def test_a_layer_stays_in_bf16_where_the_host_time_fp8_adds_exceeds_the_gemm_time_it_saves():
    # The H100 run's host figures (docs/benchmarks.md): an FP8 layer step 1.5 ms against 0.25 ms.
    rule = SpeedRule(H100, host_overhead_us=1250.0, tokens=8192, source="measured on cuda:0")
    reason = rule(768, 768)  # a 125M model's attention projection
    assert reason.startswith("FP8 would save ") and "less than the 1250 µs of host time it adds (measured on cuda:0)" in reason
    assert rule(4096, 14336) == ""  # an 8B model's MLP projection saves more than that
    # CUDA graphs: no host time per layer, so any layer whose GEMMs FP8 makes faster runs in FP8.
    assert SpeedRule(H100, host_overhead_us=0.0, tokens=8192)(768, 768) == ""


def test_more_tokens_save_more_gemm_time():
    savings = [SpeedRule(H100, 0.0, tokens=t).gpu_saving_us(2048, 2048) for t in (512, 2048, 8192, 32768)]
    assert savings == sorted(savings) and savings[-1] > 0


def test_gpu_rates_by_name_and_by_the_presented_capability():
    assert gpu_rates(torch.device("meta"), name="NVIDIA H100 80GB HBM3") is H100
    assert gpu_rates(torch.device("meta"), name="NVIDIA H100 PCIe").name == "H100 PCIe"
    assert gpu_rates(torch.device("meta"), name="NVIDIA H200").name == "H200"
    with meta_as_cuda((9, 0)):
        assert gpu_rates(torch.device("meta")) is H100
    with meta_as_cuda((8, 0)):  # an A100: no FP8 tensor cores
        assert gpu_rates(torch.device("meta")) is None


def test_the_host_overhead_is_measured_on_a_cuda_gpu_only():
    with pytest.raises(ValueError, match=r"measures a CUDA GPU; valid: a cuda device"):
        measured_host_overhead_us(torch.device("cpu"))


def test_the_host_overhead_is_measured_per_layer_on_a_chain_as_a_model_runs_it(monkeypatch):
    # The chain (on CPU here, for its mechanics): every layer reads the previous one's output,
    # each FP8 layer runs its three GEMMs in FP8, and all are in one scaling group (one update
    # per step, as in a converted model).
    from reference import count_fp8_gemms

    from fp8_plugin.modules import speed_rule

    fp8_step, bf16_step = speed_rule.chain_steps(torch.device("cpu"), fp.DelayedScaling())
    chain = next(c.cell_contents for c in fp8_step.__closure__ if isinstance(c.cell_contents, nn.Module))
    with count_fp8_gemms() as gemms:
        fp8_step()
    bf16_step()
    assert gemms.count == 3 * speed_rule.CHAIN_LAYERS == 3 * len(chain)
    assert len({id(layer.scaling_group) for layer in chain}) == 1
    # The figure: the two chains' step times' difference over the layer count (never below 0).
    times = {}
    monkeypatch.setattr(speed_rule, "_step_us", lambda step, device: times[step is fp8_step])
    monkeypatch.setattr(speed_rule, "chain_steps", lambda device, recipe: (fp8_step, bf16_step))
    times.update({True: 1000.0, False: 200.0})
    assert speed_rule._measure(torch.device("cpu"), fp.DelayedScaling()) == (1000.0 - 200.0) / speed_rule.CHAIN_LAYERS
    times.update({True: 100.0, False: 200.0})
    assert speed_rule._measure(torch.device("cpu"), fp.DelayedScaling()) == 0.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(768, 768)
        self.large = nn.Linear(4096, 14336)


def test_convert_model_takes_a_speed_rule_and_reports_its_figures():
    rule = SpeedRule(H100, host_overhead_us=1250.0, source="measured on cuda:0")
    with torch.device("meta"):
        model = Block()
    report = fp.convert_model(model, skip_small=rule, device="cpu")
    decisions = {d.name: d for d in report.layers}
    assert decisions["large"].swapped and not decisions["small"].swapped
    assert decisions["small"].reason == rule(768, 768)
    assert isinstance(model.large, fp.FP8Linear) and type(model.small) is nn.Linear
    assert rule.tokens == DEFAULT_TOKENS


@pytest.mark.parametrize("tokens", [0, -4, 2.5, True, "8192"])
def test_a_wrong_token_count_is_refused_before_any_layer_is_swapped(tokens):
    model = Block()
    with pytest.raises(ValueError, match=r"tokens_per_step=.* is not valid; valid: None or a positive int"):
        fp.convert_model(model, tokens_per_step=tokens, device="cpu")
    assert type(model.small) is nn.Linear
