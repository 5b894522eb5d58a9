"""fp8_plugin.calibrate (fp8_plugin/modules/calibration.py) and the layers' scaling choice.

Expectations are computed here from the definitions: amaxes of the high-precision activations
(float64), Transformer Engine's scale formula, and the fprop SQNR of per-tensor and 1x128 /
128x128 blockwise casts (power-of-two block scales, TE's ``Float8BlockScaling`` defaults) from
float64 copies of the FP8 operands.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8_plugin as fp
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT, INPUT, WEIGHT
from calibration_worker import TwoBranches  # two FP8 layers, each on its own input
from reference import E4M3_MAX, count_fp8_gemms, fp8_operand, gemm_error_bound

E4M3 = torch.float8_e4m3fn


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))


def test_calibration_fills_histories_and_scales_from_high_precision_amaxes():
    model = _model()
    plain = copy.deepcopy(model)
    fp.convert_model(model, fp.DelayedScaling(amax_history_len=8, margin=1), skip_small=False)
    batches = [torch.randn(6, 32) * s for s in (1.0, 4.0, 2.0)]
    report = fp.calibrate(model, batches, choose_scaling=False)
    assert report.batches == 3 and [r.name for r in report.layers] == ["0", "2"]

    first, second = model[0], model[2]
    w0, b0 = plain[0].weight.detach().double(), plain[0].bias.detach().double()
    for layer, inputs in ((first, [b.double() for b in batches]),
                          (second, [F.relu(b.double() @ w0.t() + b0) for b in batches])):
        want = [float(x.abs().max()) for x in inputs]  # oldest first
        history = layer.fp8_state.amax_history
        # The second layer's input comes from a float32 GEMM: within its accumulation bound.
        bound = 0.0 if layer is first else max(float(gemm_error_bound(b.double(), w0, torch.float32, b0).max())
                                               for b in batches)
        assert history[INPUT, 0] == 0  # the first training step's own slot
        assert torch.allclose(history[INPUT, 1:4].double(), torch.tensor(want[::-1], dtype=torch.float64),
                              rtol=0, atol=bound + 1e-6 * max(want))
        assert bool((history[INPUT, 4:] == 0).all())
        w_amax = float(layer.weight.detach().abs().max())
        assert history[WEIGHT, 1:4].tolist() == [w_amax] * 3
        # TE's formula with margin 1: (448 / amax) / 2, from the largest amax of the history.
        want_scale = torch.tensor(E4M3_MAX / 2, dtype=torch.float32) / history[INPUT, 1:].max()
        assert layer.fp8_state.scale[INPUT] == want_scale
        assert layer.fp8_state.initialized.tolist() == [True, True, False]
        assert layer.fp8_state.scale[GRAD_OUTPUT] == 1.0 and not layer.fp8_state.pending

    # The first training step casts with the calibrated scales, not from its own batch.
    x = (torch.randn(5, 32) * 0.5).requires_grad_()
    with count_fp8_gemms() as gemms, fp.autocast():
        y = model(x)
        y.sum().backward()
    assert gemms.count == 6  # two layers, fprop, dgrad and wgrad each in FP8
    s_in, s_w = float(first.fp8_state.scale[INPUT]), float(first.fp8_state.scale[WEIGHT])
    x = x.detach()
    xq, wq = fp8_operand(x, s_in, E4M3), fp8_operand(first.weight.detach(), s_w, E4M3)
    with torch.no_grad(), fp.autocast():
        got = first(x)
    want = xq @ wq.t() + first.bias.detach().double()
    assert ((got.double() - want).abs() <= gemm_error_bound(xq, wq, torch.float32, first.bias.detach().double())).all()


def _block_values(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float64 values an FP8 GEMM sees for ``x`` cast in ``block`` tiles, each scaled by the
    power of two 2**floor(log2(448 / amax)) (TE's ``Float8BlockScaling``: power_2_scale)."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, (-cols) % block[1], 0, (-rows) % block[0]))
    tiles = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).double()
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))), torch.ones_like(amax))
    q = (tiles.double() * scale).clamp(-E4M3_MAX, E4M3_MAX).float().to(E4M3).double() / scale
    return q.reshape(padded.shape)[:rows, :cols]


def _token_mean_sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    ratio = (got - want).square().sum(1) / want.square().sum(1)
    return -10 * math.log10(float(ratio.mean()))


def _outlier_batches(n=2):
    torch.manual_seed(1)
    batches = []
    for _ in range(n):
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        x[3, 7] = 2.0**15  # a massive activation: one token, one channel
        batches.append((x, y))
    return batches


def test_calibration_chooses_blockwise_where_outliers_break_per_tensor_scaling(tmp_path):
    torch.manual_seed(0)
    model = TwoBranches()
    conversion = fp.convert_model(model, fp.DelayedScaling(), skip_small=False)
    batches = _outlier_batches()
    report = fp.calibrate(model, batches)
    rows = {r.name: r for r in report.layers}
    # The conversion report shows the choice and the SQNR that decided it.
    assert report.annotate(conversion) == 2
    decisions = {d.name: d for d in conversion.layers}
    assert (decisions["outliers"].scaling, decisions["plain"].scaling) == ("blockwise", "recipe")
    assert f"calibration chose blockwise: {rows['outliers'].reason}" in str(conversion)
    assert "dB >= per-tensor" in rows["outliers"].reason and "calibration chose" not in decisions["plain"].reason

    for name, index in (("outliers", 0), ("plain", 1)):
        layer = getattr(model, name)
        w = layer.weight.detach()
        amax = max(float(b[index].abs().max()) for b in batches)
        s_x = float(torch.tensor(E4M3_MAX, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32))
        s_w = float(torch.tensor(E4M3_MAX, dtype=torch.float32) / w.abs().max())
        wq, wb = fp8_operand(w, s_w, E4M3), _block_values(w, (128, 128))
        xs = torch.cat([b[index] for b in batches])
        want = xs.double() @ w.double().t()
        per_tensor = _token_mean_sqnr(fp8_operand(xs, s_x, E4M3) @ wq.t(), want)
        blockwise = _token_mean_sqnr(_block_values(xs, (1, 128)) @ wb.t(), want)
        assert rows[name].sqnr_recipe_db == pytest.approx(per_tensor, abs=0.05)
        assert rows[name].sqnr_blockwise_db == pytest.approx(blockwise, abs=0.05)
        expected = "blockwise" if blockwise >= per_tensor + report.outlier_margin_db else "recipe"
        assert rows[name].choice == expected == layer.fp8_scaling
    assert rows["outliers"].choice == "blockwise" and rows["plain"].choice == "recipe"
    assert report.count("blockwise") == 1 and "blockwise" in str(report)

    # Evaluation then casts the outlier layer's input in 1x128 tiles: its measured SQNR.
    x, y = batches[0]
    with torch.no_grad(), count_fp8_gemms() as gemms, fp.autocast():
        got, _ = model(x, y)
    assert gemms.count == 2
    want = x.double() @ model.outliers.weight.detach().double().t()
    assert _token_mean_sqnr(got.double() - model.outliers.bias.detach().double(), want) == pytest.approx(
        _token_mean_sqnr(_block_values(x, (1, 128)) @ _block_values(model.outliers.weight.detach(), (128, 128)).t(),
                         want), abs=0.05)

    # The choice is saved with the FP8 state; states from before it load as "recipe".
    saved = model.state_dict()
    twin = TwoBranches()
    fp.convert_model(twin, fp.DelayedScaling(), skip_small=False)
    twin.load_state_dict(saved)
    assert twin.outliers.fp8_scaling == "blockwise" and twin.plain.fp8_scaling == "recipe"
    key = "outliers.fp8_state._extra_state"
    older = {k: v for k, v in saved[key].items() if k != "scaling"}
    older["version"] = torch.tensor(4)
    twin.load_state_dict({**saved, key: older})
    assert twin.outliers.fp8_scaling == "recipe"
    bad = {**saved[key], "scaling": torch.tensor(list(b"rowwise"), dtype=torch.uint8)}
    with pytest.raises(RuntimeError, match="corrupted .*scaling 'rowwise'; valid: recipe, blockwise"):
        twin.load_state_dict({**saved, key: bad})


def test_calibration_moves_layers_below_min_sqnr_to_high_precision():
    torch.manual_seed(0)
    model = TwoBranches()
    plain = copy.deepcopy(model)
    fp.convert_model(model, fp.DelayedScaling(), skip_small=False)
    batches = _outlier_batches(1)
    report = fp.calibrate(model, batches, min_sqnr_db=60.0)  # above what E4M3 can give (about 30 dB)
    assert report.count("high precision") == 2
    assert not model.outliers.use_fp8 and not model.plain.use_fp8
    x, y = batches[0]
    with torch.no_grad(), count_fp8_gemms() as gemms, fp.autocast():
        got = model(x, y)
    assert gemms.count == 0
    with torch.no_grad():
        want = plain(x, y)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_calibration_gives_every_expert_its_module_input_amax():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=1, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(config)
    seen = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, a: seen.append((a[0].detach(), a[1].detach())))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    hidden, routing = seen[0]
    gate_up, down = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    # Mixtral's experts: act(x W_gate^T) * (x W_up^T), then W_down; gate_up_proj is [E, 2I, H].
    act = transformers.activations.ACT2FN[config.hidden_act]
    down_inputs = []
    for e in range(4):
        rows = hidden[(routing == e).any(-1)].double()
        gate, up = (rows @ gate_up[e].t()).chunk(2, dim=-1)
        down_inputs.append(float((act(gate) * up).abs().max()) if len(rows) else 0.0)
    fp.convert_model(model, fp.DelayedScaling(), skip_small=False)
    report = fp.calibrate(model, [{"input_ids": ids}], choose_scaling=False)
    assert [r.kind for r in report.layers if r.kind == "experts"] == ["experts"]
    converted = model.model.layers[0].mlp.experts
    for proj, want_input, weights in (("gate_up_proj", float(hidden.abs().max()), gate_up),
                                      ("down_proj", max(down_inputs), down)):
        for e, member in enumerate(converted.fp8_scaling[proj]):
            history = member.fp8_state.amax_history
            assert float(history[INPUT, 1]) == pytest.approx(want_input, rel=1e-5)  # float32 GEMMs upstream
            assert float(history[WEIGHT, 1]) == float(weights[e].abs().max())
            assert member.fp8_state.initialized.tolist() == [True, True, False]


def test_bad_calibration_input_is_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="no FP8 layer; call fp8_plugin.convert_model"):
        fp.calibrate(nn.Linear(4, 4), [torch.randn(2, 4)])
    model = _model()
    fp.convert_model(model, skip_small=False)
    with pytest.raises(ValueError, match=r"calibrate\(batches=...\) is empty"):
        fp.calibrate(model, [])
    with pytest.raises(ValueError, match=r"calibrate\(outlier_margin_db=-1.0\) is invalid; valid: a finite number >= 0"):
        fp.calibrate(model, [torch.randn(2, 32)], outlier_margin_db=-1.0)
    with pytest.raises(ValueError, match="fp8_scaling = 'rowwise' is invalid; valid: 'recipe', 'blockwise'"):
        model[0].fp8_scaling = "rowwise"


def test_a_layer_switched_back_from_blockwise_casts_from_its_own_amax_not_a_stale_scale():
    # Block casts keep statistics in the state (the block amax, scale 1): a layer moved back to
    # per-tensor scaling must not cast with that 1 (inputs near 4000 would saturate at 448).
    torch.manual_seed(0)
    layer = fp.FP8Linear(256, 64, recipe=fp.DelayedScaling())
    x = torch.randn(16, 256) * 1000
    for _ in range(2):  # per-tensor steps: the scales are initialized
        with fp.autocast():
            layer(x).sum().backward()
    layer.fp8_scaling = "blockwise"
    for _ in range(2):
        with fp.autocast():
            layer(x).sum().backward()
    layer.fp8_scaling = "recipe"
    with torch.no_grad(), fp.autocast():
        got = layer(x)
    w = layer.weight.detach()  # its scale from its own amax too: a new cast after the move
    s_x = float(torch.tensor(E4M3_MAX, dtype=torch.float32) / x.abs().max())
    s_w = float(torch.tensor(E4M3_MAX, dtype=torch.float32) / w.abs().max())
    xq, wq = fp8_operand(x, s_x, E4M3), fp8_operand(w, s_w, E4M3)
    bias = layer.bias.detach().double()
    want = xq @ wq.t() + bias
    assert ((got.double() - want).abs() <= gemm_error_bound(xq, wq, torch.float32, bias)).all()
