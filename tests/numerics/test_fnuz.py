"""AMD MI300's FNUZ FP8 formats (issue 35): decoding, casts, the emulated GEMM and a layer's
training, on CPU with the device presented as a gfx942 (``present_rocm``).

Independent expectations: every bit pattern decoded by hand from the format's definition
(sign, exponent bias 8 for E4M3FNUZ and 16 for E5M2FNUZ, no infinity, no negative zero, 0x80
the one NaN); torch's own conversion after saturation; float64 products.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8_plugin as fp
from fp8_plugin.numerics.device_kind import fp8_family, present_rocm
from fp8_plugin.numerics.formats import Format, fp8_dtype, fp8_max
from fp8_plugin.numerics.quantizers import QuantizedTensor
from fp8_plugin.numerics.scaling import dequantize, quantize

E4M3FNUZ, E5M2FNUZ = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
FNUZ = pytest.mark.parametrize("dtype, exponent_bits, bias", [(E4M3FNUZ, 4, 8), (E5M2FNUZ, 5, 16)],
                               ids=["e4m3fnuz", "e5m2fnuz"])


def decode(code: int, exponent_bits: int, bias: int) -> float:
    """A FNUZ byte's value from the format's definition: 0x80 is NaN, every other pattern a
    finite number (no infinity, no negative zero); exponent 0 is subnormal."""
    if code == 0x80:
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    mantissa_bits = 7 - exponent_bits
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    if exponent == 0:
        return sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)


@FNUZ
def test_every_fnuz_pattern_reads_as_the_format_defines_it(dtype, exponent_bits, bias):
    got = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float64)
    for code in range(256):
        want = decode(code, exponent_bits, bias)
        assert (math.isnan(want) and math.isnan(got[code])) or got[code].item() == want, hex(code)
    finite = [decode(c, exponent_bits, bias) for c in range(256) if c != 0x80]
    assert fp8_max(dtype) == max(finite)  # 240 and 57344
    assert fp8_max(E4M3FNUZ) == 240.0 and fp8_max(E5M2FNUZ) == 57344.0


def test_formats_name_the_fnuz_pair_on_a_gfx942_and_the_ocp_pair_elsewhere():
    assert fp8_family("cpu") == "ocp"
    with present_rocm("gfx942"):
        assert fp8_family("cpu") == fp8_family("meta") == "fnuz"
        assert fp8_dtype(Format.HYBRID, backward=False, family=fp8_family("cpu")) == E4M3FNUZ
        assert fp8_dtype(Format.HYBRID, backward=True, family=fp8_family("cpu")) == E5M2FNUZ
    with present_rocm("gfx950"):  # MI350: the OCP formats
        assert fp8_family("cpu") == "ocp"
    with pytest.raises(ValueError, match=r"present_rocm\(arch='mi300'\) is not a ROCm architecture; valid: a gfx"):
        with present_rocm("mi300"):
            pass


@FNUZ
def test_every_bfloat16_pattern_casts_as_torch_after_saturation(dtype, exponent_bits, bias):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    scale = torch.tensor(1.0)
    got = quantize(x, scale, dtype)
    top = fp8_max(dtype)
    x64 = x.to(torch.float64)
    # Saturating conversion: finite values beyond the range become +-max, infinities and NaNs
    # become the format's NaN (FNUZ has no infinity); the rest rounds as torch's own cast.
    want = x64.clamp(-top, top).to(torch.float32).to(dtype).view(torch.uint8)
    want[torch.isinf(x64) | torch.isnan(x64)] = 0x80
    assert torch.equal(got.view(torch.uint8), want)


def test_the_emulated_gemm_of_fnuz_operands_matches_float64():
    gen = torch.Generator().manual_seed(0)
    a = QuantizedTensor((torch.randn(48, 96, generator=gen) * 20).clamp(-240, 240).to(E4M3FNUZ), torch.tensor(0.25))
    b = QuantizedTensor((torch.randn(40, 96, generator=gen) * 500).to(E5M2FNUZ), torch.tensor(2.0 ** -6))
    with fp.numerics.gemm.force_path("emulated"):
        got = fp.numerics.gemm.fp8_gemm(a, b, torch.float32)
    exact = (a.data.to(torch.float64) * 0.25) @ (b.data.to(torch.float64) * 2.0 ** -6).t()
    magnitude = (a.data.to(torch.float64).abs() * 0.25) @ (b.data.to(torch.float64).abs() * 2.0 ** -6).t()
    u, k = 2.0 ** -24, 96
    assert ((got.double() - exact).abs() <= k * u / (1 - k * u) * magnitude).all()  # Higham's gamma_K
    assert torch.equal(dequantize(a.data, a.scale_inv), a.data.float() * 0.25)


def test_a_layer_trains_in_fnuz_on_a_presented_gfx942_with_240_as_the_e4m3_bound(monkeypatch):
    import fp8_plugin.modules.linear_function as linear_module

    gemms = []
    real = linear_module.fp8_gemm

    def counting(a, b, *args, **kwargs):  # every FP8 GEMM of the layer, with its operand formats
        gemms.append((a.data.dtype, b.data.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(linear_module, "fp8_gemm", counting)
    torch.manual_seed(0)
    losses = []
    with present_rocm("gfx942"):
        layer = fp.FP8Linear(64, 32, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        x = (torch.randn(16, 64) * 3).requires_grad_()
        for _ in range(3):
            with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4)):
                loss = layer(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fp.update_pending_scales(layer)
    # fprop E4M3FNUZ x E4M3FNUZ, dgrad and wgrad E5M2FNUZ x E4M3FNUZ, every step.
    assert gemms == [(E4M3FNUZ, E4M3FNUZ), (E5M2FNUZ, E4M3FNUZ), (E5M2FNUZ, E4M3FNUZ)] * 3
    assert losses[-1] < losses[0]
    # Delayed scaling's scale from the history: 240 / amax for the input (E4M3FNUZ's max, not
    # E4M3's 448), 57344 / amax for grad_output (E5M2FNUZ), correctly rounded in float32.
    state = layer.fp8_state
    assert state.scale[0] == torch.tensor(240.0) / state.amax_history[0].max()
    assert state.scale[2] == torch.tensor(57344.0) / state.amax_history[2].max()


def test_block_recipes_are_refused_on_a_gfx942_naming_the_ones_that_run():
    with present_rocm("gfx942"):
        layer = fp.FP8Linear(64, 32, bias=False)
        with pytest.raises(ValueError, match=r"MXFP8BlockScaling on cpu \(an AMD MI300: FNUZ FP8 formats\) is not "
                                             r"supported: .* valid there: DelayedScaling, Float8CurrentScaling"):
            with fp.autocast(recipe=fp.MXFP8BlockScaling()):
                layer(torch.randn(4, 64))


def test_an_ocp_checkpoint_resumed_on_an_mi300_converts_its_scales_by_the_ratio_of_the_maxima():
    torch.manual_seed(0)
    layer = fp.FP8Linear(64, 32, bias=False)
    recipe = fp.DelayedScaling(amax_history_len=4)
    for _ in range(2):  # OCP scales: 448 / amax for the input and weight
        with fp.autocast(recipe=recipe):
            layer((torch.randn(16, 64) * 3).requires_grad_()).sum().backward()
    fp.update_pending_scales(layer)
    saved = layer.state_dict()
    assert bytes(saved["fp8_state._extra_state"]["family"].tolist()) == b"ocp"
    with present_rocm("gfx942"):
        twin = fp.FP8Linear(64, 32, bias=False)
        twin.load_state_dict(saved)
        with pytest.warns(UserWarning, match=r"made for the OCP formats, this device uses FNUZ: the scales were "
                                             r"converted by the ratio of the formats' maxima \(0.535714, 0.535714, 1"):
            with torch.no_grad(), fp.autocast(recipe=recipe):  # an evaluation forward: it records nothing
                twin(torch.randn(4, 64))
        state = twin.fp8_state
        want = saved["fp8_state._extra_state"]["scale"] * torch.tensor([240 / 448, 240 / 448, 1.0])
        assert torch.equal(state.scale, want)  # float32 products, as the conversion makes them
        assert torch.equal(state.amax_history, saved["fp8_state._extra_state"]["amax_history"])
        assert bytes(twin.state_dict()["fp8_state._extra_state"]["family"].tolist()) == b"fnuz"


def test_a_loaded_state_saved_again_before_any_cast_keeps_the_family_its_scales_were_made_for():
    saved = fp.FP8Linear(64, 32, bias=False).state_dict()
    with present_rocm("gfx942"):
        twin = fp.FP8Linear(64, 32, bias=False)
        twin.load_state_dict(saved)
        assert bytes(twin.state_dict()["fp8_state._extra_state"]["family"].tolist()) == b"ocp"


def test_the_device_report_names_the_formats_and_refuses_the_block_recipes_on_an_mi300():
    assert "FP8 formats: OCP (E4M3, max 448; E5M2)" in str(fp.describe_device("cpu"))
    with present_rocm("gfx942"):
        report = fp.describe_device("cpu")
    text = str(report)
    assert "FP8 formats: FNUZ (E4M3FNUZ, max 240; E5M2FNUZ): an AMD MI300" in text
    blocks = [r for r in report.recipes if r.gemm != "tensorwise"]
    assert len(blocks) == 2 and all(not r.native and "MI300 has no block-scaled FP8 GEMMs" in r.reason for r in blocks)
    assert type(report.auto).__name__ == "DelayedScaling"


def test_a_tiny_llama_trains_three_steps_in_fnuz_on_a_presented_gfx942(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import fp8_plugin.modules.linear_function as linear_module

    operand_dtypes = []
    real = linear_module.fp8_gemm

    def counting(a, b, *args, **kwargs):
        operand_dtypes.append(a.data.dtype)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(linear_module, "fp8_gemm", counting)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=96,
                                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    ids = torch.randint(1, 96, (4, 16))
    with present_rocm("gfx942"):
        fp.convert_model(model, fp.DelayedScaling(amax_history_len=4))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(3):
            with fp.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fp.update_pending_scales(model)
    n = sum(isinstance(m, fp.FP8Linear) for m in model.modules())
    assert n == 7  # q, k, v, o, gate, up, down (lm_head stays high precision)
    # Each FP8 layer: fprop with E4M3FNUZ, dgrad and wgrad with E5M2FNUZ, in each of 3 steps.
    assert operand_dtypes.count(E4M3FNUZ) == 3 * n and operand_dtypes.count(E5M2FNUZ) == 2 * 3 * n
    assert len(operand_dtypes) == 9 * n and losses[-1] < losses[0]
    for m in model.modules():
        if isinstance(m, fp.FP8Linear):
            s = m.fp8_state
            assert s.scale[1] == torch.tensor(240.0) / s.amax_history[1].max()  # the weight: E4M3FNUZ's 240


def test_convert_model_refuses_a_block_recipe_for_an_mi300_at_start_up():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with present_rocm("gfx942"):
        with pytest.raises(ValueError, match=r"convert_model: recipe Float8BlockScaling cannot run on cpu \(an AMD "
                                             r"MI300: FNUZ FP8 formats, .*valid there: DelayedScaling"):
            fp.convert_model(model, fp.Float8BlockScaling())
        assert isinstance(model[0], torch.nn.Linear)  # nothing swapped


def test_the_conversion_report_names_the_fnuz_formats_on_an_mi300():
    with present_rocm("gfx942"):
        report = fp.convert_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), fp.DelayedScaling())
    assert "formats: E4M3FNUZ (max 240) / E5M2FNUZ" in str(report)
    assert "FNUZ" not in str(fp.convert_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), fp.DelayedScaling()))


@pytest.mark.parametrize("arch, family", [("gfx942:sramecc+:xnack-", "fnuz"), ("gfx940", "fnuz"), ("gfx950", "ocp")])
def test_a_rocm_device_is_told_by_its_gcn_architecture(monkeypatch, arch, family):
    # No AMD GPU here: torch's ROCm build is presented by the two attributes it sets there
    # (torch.version.hip, and gcnArchName in the device properties, which torchao's is_MI300 reads).
    import types

    from fp8_plugin.numerics import device_kind

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(gcnArchName=arch))
    device_kind._rocm_arch.cache_clear()
    try:
        assert fp8_family(torch.device("cuda", 0)) == family
    finally:
        device_kind._rocm_arch.cache_clear()


def test_current_scaling_trains_in_fnuz_with_each_tensors_own_240_scale():
    torch.manual_seed(0)
    with present_rocm("gfx942"):
        layer = fp.FP8Linear(64, 32, bias=False)
        x = (torch.randn(16, 64) * 3).requires_grad_()
        with fp.autocast(recipe=fp.Float8CurrentScaling()):
            y = layer(x)
        y.square().mean().backward()
    # Current scaling records each tensor's amax and scale: 240 / amax(x) for the input.
    state = layer.fp8_state
    assert state.amax_history[0, 0] == x.detach().abs().max()
    assert state.scale[0] == torch.tensor(240.0) / x.detach().abs().max()
    assert x.grad is not None and torch.isfinite(x.grad).all()
