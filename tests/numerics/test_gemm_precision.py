"""Per-GEMM precision and per-GEMM figures: each of an FP8 layer's three GEMMs (fprop, dgrad,
wgrad) can run in high precision (the recipes' ``override_linear_precision``, Transformer
Engine's field; ``FP8Linear.fp8_gemms``, saved in checkpoints), and every BF16 reference check
reports each GEMM's own SQNR (fp8_plugin/training/reference/, ``gemm_sqnr_db``).
Expected values come from float64 computations written here, from error bounds, and from the
OCP OFP8 formats' rounding noise."""

import dataclasses
import json
import math
import warnings

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.accelerate.settings import resolve_settings
from fp8_plugin.numerics.device import resolve_recipe
from fp8_plugin.numerics.gemm import fp8_gemm_in_bf16
from fp8_plugin.numerics.quantizers import STATE_VERSION
from fp8_plugin.training.reference import figures as reference_figures
from fp8_plugin.training.reference import policy as reference_policy
from fp8_plugin.training.reference import replay as reference_replay
from fp8_plugin.training.reference import ReferenceCheck, ReferenceChecker
from reference import E4M3_MAX, E5M2_MAX, count_fp8_gemms, cpu_scaled_mm_uses_onednn, fp8_operand

# Round-to-nearest noise of one operand, relative power E[err^2 / x^2] = 2^(-2m) / 12 * E[1/m^2]
# for m mantissa bits, mantissas log-uniform (E[1/m^2] = 0.541; see test_reference_check.py):
# E4M3 (m = 3) 7.05e-4, E5M2 (m = 2) 2.82e-3. A GEMM's two independent operand noises add.
_MANTISSA_NOISE = 0.5 * 0.75 / math.log(2) / 12
E4M3_NOISE, E5M2_NOISE = 2.0**-6 * _MANTISSA_NOISE, 2.0**-4 * _MANTISSA_NOISE
BAND = {  # expected dB of each GEMM of a healthy HYBRID layer (E4M3 x E4M3 forward, E5M2 x E4M3 backward)
    "fprop": -10 * math.log10(2 * E4M3_NOISE),
    "dgrad": -10 * math.log10(E5M2_NOISE + E4M3_NOISE),
    "wgrad": -10 * math.log10(E5M2_NOISE + E4M3_NOISE),
}
BAND_DB = 4.0  # a factor of 2.5 in noise power either way, as the forward band of test_reference_check.py

GEMMS = ("fprop", "dgrad", "wgrad")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.down(torch.relu(self.up(x)))).float(), y)


def _model(recipe):
    model = Net()
    fp.convert_model(model, recipe, exclude=["head"])
    return model


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def _loss(model, batch):
    return model(*batch)


# ---------------------------------------------------------------------------------------------
# The setting


def test_recipes_take_transformer_engines_override_and_check_it():
    for make in (fp.DelayedScaling, fp.Float8CurrentScaling, fp.MXFP8BlockScaling, fp.Float8BlockScaling, fp.AutoRecipe):
        assert make().override_linear_precision == (False, False, False)
        recipe = make(override_linear_precision=[False, False, True])  # a list from a config file
        assert recipe.override_linear_precision == (False, False, True)
        assert recipe.override_linear_precision.wgrad is True
        hash(recipe)  # recipes stay hashable (torch.compile passes them as constants)
        with pytest.raises(ValueError, match=r"override_linear_precision=\(1, 0, 0\)\) is invalid; valid: three bools"):
            make(override_linear_precision=(1, 0, 0))
        with pytest.raises(ValueError, match="override_linear_precision=True"):
            make(override_linear_precision=True)
    resolved = resolve_recipe(fp.AutoRecipe(override_linear_precision=(True, False, False)), "cpu")
    assert type(resolved) is not fp.AutoRecipe and resolved.override_linear_precision == (True, False, False)


def test_fp8_gemms_switch_is_checked():
    layer = fp.FP8Linear(32, 16)
    assert layer.fp8_gemms == (True, True, True)
    layer.fp8_gemms = [True, False, True]
    assert layer.fp8_gemms == (True, False, True) and "fp8_gemms=(True, False, True)" in repr(layer)
    for bad in ((True, False), (1, 1, 1), "fpd"):
        with pytest.raises(ValueError, match="fp8_gemms = .* is invalid; valid: three bools"):
            layer.fp8_gemms = bad


def _float32_bound(a, b):
    # |fl32(a @ b.T) - a @ b.T| <= gamma_K sum_k |a_ik b_jk| + u |result| (Higham 3.1), float64 a, b.
    k, u = a.shape[1], 2.0**-24
    return k * u / (1 - k * u) * (a.abs() @ b.abs().t()) + u * (a @ b.t()).abs()


@pytest.mark.parametrize("high", [(True, False, False), (False, True, False), (False, False, True),
                                  (True, True, False), (False, True, True)],
                         ids=["fprop", "dgrad", "wgrad", "fprop+dgrad", "dgrad+wgrad"])
@pytest.mark.parametrize("how", ["recipe", "layer"])
def test_a_gemm_in_high_precision_runs_unquantised_and_the_others_stay_fp8(high, how):
    torch.manual_seed(0)
    layer = fp.FP8Linear(64, 48, bias=False)
    recipe = fp.Float8CurrentScaling(override_linear_precision=high if how == "recipe" else (False,) * 3)
    if how == "layer":
        layer.fp8_gemms = tuple(not h for h in high)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    with count_fp8_gemms() as gemms, fp.autocast(recipe=recipe):
        y = layer(x)
    with count_fp8_gemms() as backward_gemms:
        y.backward(dy)
    assert gemms.count + backward_gemms.count == 3 - sum(high)  # a high-precision GEMM is no FP8 GEMM
    x64, w64, dy64 = x.detach().double(), layer.weight.detach().double(), dy.double()
    # (got, operands a and b of got = a @ b.T in float64)
    results = {"fprop": (y, x64, w64), "dgrad": (x.grad, dy64, w64.t()), "wgrad": (layer.weight.grad, dy64.t(), x64.t())}
    for gemm, is_high in zip(GEMMS, high):
        got, a, b = results[gemm]
        error = (got.double() - a @ b.t()).abs()
        if is_high:  # the float32 GEMM on the unquantised operands
            assert bool((error <= _float32_bound(a, b)).all()), gemm
        else:  # the FP8 GEMM: far beyond float32 rounding (E4M3 / E5M2 steps are 2^-3 / 2^-2 relative)
            assert error.max() > 1e3 * _float32_bound(a, b).max(), gemm


def test_all_gemms_in_high_precision_compute_as_the_layer_it_replaced():
    torch.manual_seed(0)
    layer = fp.FP8Linear(64, 48)
    plain = nn.Linear(64, 48)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "fp8_state" not in k})
    layer.fp8_gemms = (False, False, False)
    x = torch.randn(8, 64)
    with count_fp8_gemms() as gemms, torch.autocast("cpu", torch.bfloat16):
        with warnings.catch_warnings():  # (once per process) "no FP8 layer ran": true here
            warnings.simplefilter("ignore")
            with fp.autocast(recipe=fp.DelayedScaling()):
                got = layer(x)
        expected = plain(x)
    assert gemms.count == 0 and got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_override_on_a_converted_model_counts_fp8_gemms_per_step():
    model = _model(fp.DelayedScaling(override_linear_precision=(False, False, True)))
    with count_fp8_gemms() as gemms:
        for seed in range(3):
            with fp.autocast():
                loss = _loss(model, _batch(seed))
            loss.backward()
    # up: fprop only (its input needs no gradient, its wgrad is high precision); down: fprop, dgrad.
    assert gemms.count == 3 * (1 + 2)


def test_fp8_gemms_survive_a_checkpoint_and_older_states_load_as_all_fp8():
    model = _model(fp.DelayedScaling())
    model.down.fp8_gemms = (True, False, True)
    with fp.autocast():
        _loss(model, _batch()).backward()
    saved = model.state_dict()
    key = "down.fp8_state._extra_state"
    assert STATE_VERSION == 5 and saved[key]["fp8_gemms"].tolist() == [True, False, True]
    target = _model(fp.DelayedScaling())
    target.load_state_dict(saved)
    assert target.down.fp8_gemms == (True, False, True) and target.up.fp8_gemms == (True, True, True)
    # A state of format version 2 (no per-GEMM switch) loads with every GEMM in FP8.
    older = {k: v for k, v in saved[key].items() if k not in ("fp8_gemms", "family", "scaling")}
    older["version"] = torch.tensor(2)
    target.down.fp8_gemms = (False, False, False)
    target.load_state_dict({**saved, key: older})
    assert target.down.fp8_gemms == (True, True, True)
    assert torch.equal(target.down.fp8_state.scale, saved[key]["scale"])
    with pytest.raises(RuntimeError, match="corrupted .*entries"):  # version 3 requires it
        target.load_state_dict({**saved, key: {**older, "version": torch.tensor(3)}})


def test_accelerate_takes_the_override_from_te_kwargs_and_the_launch_environment():
    env = {"ACCELERATE_FP8_OVERRIDE_WGRAD": "True", "ACCELERATE_FP8_OVERRIDE_FPROP": "False"}
    settings = resolve_settings(env=env)
    assert settings.recipe.override_linear_precision == (False, False, True)
    settings = resolve_settings(env={**env, "ACCELERATE_FP8_AMAX_HISTORY_LEN": "16"})
    assert settings.recipe == fp.DelayedScaling(amax_history_len=16, override_linear_precision=(False, False, True))
    settings = resolve_settings(recipe="fp8-current", env=env)  # the code's recipe wins, with its own override
    assert settings.recipe == fp.Float8CurrentScaling()


# ---------------------------------------------------------------------------------------------
# Per-GEMM figures of the reference checks


def _float64_gemm_sqnr(model, batch, scales, bf16_backward=False):
    """Each FP8 layer's per-GEMM SQNR in float64, from operands captured here in a float32
    replay with FP8 off: FP8 operands by saturate / round / unscale at the given scales
    (``scales[layer] = (input, weight, grad_output)``), against the float64 GEMM, plus for each
    figure the error bound that float32 GEMMs (the check's) may add to its noise and signal;
    ``bf16_backward``: the check's FP8 dgrad and wgrad are BF16 GEMMs of the FP8 values, whose
    output rounding adds at most bfloat16's unit roundoff, 2^-8, of each output."""
    captured = {}

    def forward_hook(name):
        def hook(layer, args, output):
            captured[name] = {"x": args[0].detach().double()}
            output.register_hook(lambda g: captured[name].__setitem__("dy", g.detach().double()))
        return hook

    handles = [getattr(model, n).register_forward_hook(forward_hook(n)) for n in scales]
    with fp.autocast(enabled=False):
        _loss(model, batch).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    figures = {}
    for name, (s_x, s_w, s_g) in scales.items():
        x, dy, w = captured[name]["x"], captured[name]["dy"], getattr(model, name).weight.detach().double()
        q = {"x": fp8_operand(x, s_x, torch.float8_e4m3fn), "w": fp8_operand(w, s_w, torch.float8_e4m3fn),
             "dy": fp8_operand(dy, s_g, torch.float8_e5m2)}
        operands = {"fprop": ((x, w), (q["x"], q["w"])), "dgrad": ((dy, w.t()), (q["dy"], q["w"].t())),
                    "wgrad": ((dy.t(), x.t()), (q["dy"].t(), q["x"].t()))}
        figures[name] = {}
        for gemm, ((a, b), (qa, qb)) in operands.items():
            exact, fp8 = a @ b.t(), qa @ qb.t()
            signal, noise = exact.square().sum(), (fp8 - exact).square().sum()
            # The check's float32 GEMMs err by at most these, elementwise (Higham 3.1); the FP8
            # GEMM's operand scaling adds 3 roundings per product (tests/support/reference.py). Its fprop
            # figure reads the layer's outputs, bias added and rounded (u each), less the bias.
            u = 2.0**-24
            slack = _float32_bound(a, b) + _float32_bound(qa, qb) + 3 * u * (qa.abs() @ qb.abs().t())
            signal_slack = _float32_bound(a, b)
            if bf16_backward and gemm != "fprop":
                slack = slack + 2.0**-8 * (qa @ qb.t()).abs()
            if gemm == "fprop":
                with_bias = (exact + getattr(model, name).bias.detach().double()).abs()
                slack, signal_slack = slack + 4 * u * with_bias, signal_slack + 2 * u * with_bias
            figures[name][gemm] = (signal.item(), noise.item(), slack.square().sum().sqrt().item(),
                                   signal_slack.square().sum().sqrt().item())
    return figures


def _db_interval(signal, noise, noise_slack, signal_slack):
    # sqrt of an energy moves by at most the L2 norm of the elementwise perturbation.
    low = 20 * math.log10((math.sqrt(signal) - signal_slack) / (math.sqrt(noise) + noise_slack))
    high = 20 * math.log10((math.sqrt(signal) + signal_slack) / max(math.sqrt(noise) - noise_slack, 1e-300))
    return low, high


@pytest.mark.parametrize("bf16_backward", [False, True], ids=["float32-gemms", "bf16-gemms"])
def test_gemm_figures_match_an_independent_float64_computation_and_the_healthy_bands(monkeypatch, bf16_backward):
    # Current scaling: every scale is FP8_MAX / amax of the very tensor cast, known here. The
    # dgrad and wgrad figures' FP8 GEMMs run in float32 or, as on a CPU whose BF16 GEMMs are the
    # faster, as BF16 GEMMs of the FP8 values: both against the same float64 expectation.
    monkeypatch.setattr(reference_figures, "_cpu_bf16_is_faster", lambda: bf16_backward)
    bf16_gemms = []
    monkeypatch.setattr(reference_figures, "fp8_gemm_in_bf16",
                        lambda a, b: bf16_gemms.append(1) or fp8_gemm_in_bf16(a, b))
    model = _model(fp.Float8CurrentScaling())
    batch = _batch()
    result = fp.reference_check(model, batch, _loss, compute_dtype=torch.float32)
    if bf16_backward and cpu_scaled_mm_uses_onednn(torch.float8_e5m2, torch.float8_e4m3fn) and not bf16_gemms:
        pytest.skip("torch._scaled_mm (oneDNN) was timed faster than the emulation here: no BF16 figure GEMM")
    # up: wgrad; down: dgrad and wgrad. Each is one BF16 GEMM on that path, none on the other.
    assert len(bf16_gemms) == (3 if bf16_backward else 0)
    captured = {}

    def amax_hook(name):
        def hook(layer, args, output):
            captured[name] = [args[0].detach().abs().max().item(), layer.weight.detach().abs().max().item()]
            output.register_hook(lambda g: captured[name].append(g.abs().max().item()))
        return hook

    handles = [getattr(model, n).register_forward_hook(amax_hook(n)) for n in ("up", "down")]
    with fp.autocast(enabled=False):
        _loss(model, batch).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    scales = {n: (E4M3_MAX / a[0], E4M3_MAX / a[1], E5M2_MAX / a[2]) for n, a in captured.items()}
    expected = _float64_gemm_sqnr(model, batch, scales, bf16_backward)
    # up's input is the batch, which needs no gradient: training runs no dgrad there.
    assert {n: set(f) for n, f in result.gemm_sqnr_db.items()} == {"up": {"fprop", "wgrad"}, "down": set(GEMMS)}
    for name, figures in result.gemm_sqnr_db.items():
        for gemm, db in figures.items():
            low, high = _db_interval(*expected[name][gemm])
            assert low <= db <= high, (name, gemm, db, low, high)
            assert abs(db - BAND[gemm]) <= BAND_DB, (name, gemm, db, BAND[gemm])


@pytest.mark.parametrize("role, faulty", [(0, {"fprop", "wgrad"}), (1, {"fprop", "dgrad"}), (2, {"dgrad", "wgrad"})],
                         ids=["input", "weight", "grad_output"])
def test_a_planted_too_small_scale_shows_in_the_gemms_that_read_that_operand_of_that_layer_only(role, faulty):
    # A delayed scale 2^40 times too small: every value of that operand flushes to zero in FP8
    # (448 * 2^-40 and 57344 * 2^-40 lie far below the smallest subnormals, 2^-9 and 2^-16), so
    # the GEMMs that read it give 0: noise equals signal, 0 dB. The others keep their bands.
    model = _model(fp.DelayedScaling())
    batch = _batch()
    with fp.autocast():
        _loss(model, batch).backward()
    fp.update_pending_scales(model)
    model.zero_grad()
    model.down.fp8_state.scale[role] *= 2.0**-40
    result = fp.reference_check(model, batch, _loss, compute_dtype=torch.float32)
    for gemm, db in result.gemm_sqnr_db["down"].items():
        if gemm in faulty:
            assert abs(db) <= 1e-6, (gemm, db)
        else:
            assert abs(db - BAND[gemm]) <= BAND_DB, (gemm, db)
    for gemm, db in result.gemm_sqnr_db["up"].items():
        assert abs(db - BAND[gemm]) <= BAND_DB, ("up", gemm, db)


def test_a_hook_on_the_weight_changes_no_wgrad_figure():
    # A user's tensor hook on a weight (here: halving its gradient) changes what reaches .grad,
    # not the layer's GEMM: the wgrad figure compares the FP8 GEMM with the high-precision GEMM
    # on the same operands, so it must read as without the hook. Both runs quantise the same
    # operands with the same scales; only float32 summation order may differ (far below 0.01 dB).
    batch = _batch()
    plain = fp.reference_check(_model(fp.Float8CurrentScaling()), batch, _loss, compute_dtype=torch.float32)
    model = _model(fp.Float8CurrentScaling())
    model.down.weight.register_hook(lambda g: g * 0.5)
    model.up.weight.register_hook(lambda g: torch.zeros_like(g))
    hooked = fp.reference_check(model, batch, _loss, compute_dtype=torch.float32)
    for name in ("up", "down"):
        assert abs(hooked.gemm_sqnr_db[name]["wgrad"] - plain.gemm_sqnr_db[name]["wgrad"]) <= 0.01, \
            (name, hooked.gemm_sqnr_db[name], plain.gemm_sqnr_db[name])


def test_gemms_in_high_precision_have_no_quantisation_error_and_fp8_free_layers_no_figures():
    model = _model(fp.DelayedScaling(override_linear_precision=(False, True, False)))
    model.down.fp8_gemms = (True, True, False)
    model.up.use_fp8 = False
    result = fp.reference_check(model, _batch(), _loss, compute_dtype=torch.float32)
    assert set(result.gemm_sqnr_db) == {"down"}
    figures = result.gemm_sqnr_db["down"]
    assert figures["dgrad"] == math.inf and figures["wgrad"] == math.inf
    assert abs(figures["fprop"] - BAND["fprop"]) <= BAND_DB


def test_gemm_figures_reach_the_metrics_the_json_report_and_the_plot(tmp_path):
    model = _model(fp.DelayedScaling(override_linear_precision=(False, True, False)))
    result = fp.reference_check(model, _batch(), _loss)
    metrics = result.metrics()
    for name, figures in result.gemm_sqnr_db.items():
        for gemm, db in figures.items():
            assert metrics[f"fp8_ref/{gemm}_sqnr_db/{name}"] == db
    assert metrics["fp8_ref/wgrad_sqnr_min_db"] == min(f["wgrad"] for f in result.gemm_sqnr_db.values())
    assert metrics["fp8_ref/dgrad_sqnr_min_db"] == math.inf  # every dgrad in high precision
    assert "lowest GEMM SQNR" in result.describe()
    checker = ReferenceChecker(dataclasses.replace(ReferenceCheck(), json_path=str(tmp_path / "c.json"),
                                                   plot_path=str(tmp_path / "c.png")))
    checker.results.append(result)
    assert "lowest GEMM SQNR: fprop" in checker.summary()
    checker.write_reports()
    saved = json.loads((tmp_path / "c.json").read_text())["checks"][0]["gemm_sqnr_db"]
    assert saved["down"]["dgrad"] is None  # inf, as JSON null
    assert saved["down"]["wgrad"] == result.gemm_sqnr_db["down"]["wgrad"]
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    restored = ReferenceChecker(ReferenceCheck())
    restored.load_state_dict(checker.state_dict())
    assert restored.results[0].gemm_sqnr_db == result.gemm_sqnr_db
    older = {k: v for k, v in result.to_dict().items() if k != "gemm_sqnr_db"}  # saved before the figures
    assert type(result).from_dict(older).gemm_sqnr_db == {}


class _Checkpointed(nn.Module):
    # Runs a layer under a non-reentrant activation checkpoint, through its __call__, so that its
    # hooks run again in the recomputation (as transformers' gradient checkpointing runs layers).
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def test_activation_checkpointing_changes_no_gemm_figure():
    # The recomputed forward runs in the backward: each GEMM must still be measured once.
    plain = _model(fp.DelayedScaling())
    checkpointed = _model(fp.DelayedScaling())
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.up, checkpointed.down = _Checkpointed(checkpointed.up), _Checkpointed(checkpointed.down)
    expected = fp.reference_check(plain, _batch(), _loss, compute_dtype=torch.float32)
    got = fp.reference_check(checkpointed, _batch(), _loss, compute_dtype=torch.float32)
    assert {n.removesuffix(".layer"): f for n, f in got.gemm_sqnr_db.items()} == expected.gemm_sqnr_db
    assert {n.removesuffix(".layer"): f for n, f in got.layer_sqnr_db.items()} == expected.layer_sqnr_db


def test_compiled_layer_with_high_precision_gemms_matches_eager():
    # torch.compile(fullgraph=True) traces the layer whole, a varying set of saved tensors included.
    torch.manual_seed(0)
    layer = fp.FP8Linear(64, 32)
    layer.fp8_gemms = (True, False, False)
    x = torch.randn(16, 64, requires_grad=True)

    def run(x):
        with fp.autocast(recipe=fp.Float8CurrentScaling()):
            return layer(x)

    results = []
    for fn in (torch.compile(run, fullgraph=True), run):
        x.grad = layer.weight.grad = None
        y = fn(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, layer.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------------------------------
# Verified fallback: a move is kept only when a replay with it passes


def _grad_output_fault(model, layer="down"):
    # A delayed grad_output scale 2^40 times too small: that layer's dy flushes to zero in its
    # dgrad and wgrad (forward healthy), and the gradients of every layer before it with it.
    with fp.autocast():
        _loss(model, _batch()).backward()
    fp.update_pending_scales(model)
    model.zero_grad()
    getattr(model, layer).fp8_state.scale[2] *= 2.0**-40


def test_a_bad_gradient_scale_moves_exactly_the_gemms_that_read_it_and_the_next_check_passes():
    model = _model(fp.DelayedScaling())
    _grad_output_fault(model)
    config = ReferenceCheck(policy="fallback", fallback_blockwise=False)  # the high-precision moves
    with pytest.warns(UserWarning, match=r"moved to high precision: down\.dgrad, down\.wgrad"):
        failed = fp.reference_check(model, _batch(), _loss, config=config, compute_dtype=torch.float32)
    # The forward is healthy: only the gradients tell, and the per-GEMM figures name the cause.
    assert any("grad cosine" in f for f in failed.failures), failed.failures
    assert failed.layer_sqnr_db["down"] > config.min_sqnr_db
    assert failed.gemm_sqnr_db["down"]["dgrad"] < 1 and failed.gemm_sqnr_db["down"]["wgrad"] < 1
    assert failed.fallback_gemms == ["down.dgrad", "down.wgrad"] and failed.fallback_layers == []
    assert [t["moves"] for t in failed.fallback_tried] == [["down.dgrad", "down.wgrad"]]
    assert failed.fallback_tried[0]["passed"] and failed.fallback_tried[0]["kept"]
    assert model.down.use_fp8 and model.down.fp8_gemms == (True, False, False)
    assert model.up.use_fp8 and model.up.fp8_gemms == (True, True, True)
    after = fp.reference_check(model, _batch(), _loss, config=config, compute_dtype=torch.float32)
    assert after.passed and after.fallback_tried == [], after.describe()
    with count_fp8_gemms() as gemms, fp.autocast():
        _loss(model, _batch(2)).backward()
    assert gemms.count == 2 + 1  # up: fprop, wgrad (its input needs no gradient); down: fprop


def _dgrad_fault(layer):
    # The weight's columnwise (transposed) FP8 copy, which dgrad alone reads, dequantizes 2^40
    # too small: dgrad gives ~0 (noise = signal, 0 dB); fprop (rowwise copy) and wgrad (no
    # weight) stay healthy.
    original = layer._weight_casts

    def faulty(recipe, record, columnwise, **reads):
        rowwise, col = original(recipe, record, columnwise, **reads)
        return rowwise, (None if col is None else dataclasses.replace(col, scale_inv=col.scale_inv * 2.0**-40))

    layer._weight_casts = faulty


def test_a_fault_in_one_layers_dgrad_alone_moves_that_gemm_alone_and_the_next_check_passes():
    model = _model(fp.Float8CurrentScaling())
    _dgrad_fault(model.down)
    # The fault zeroes the gradient reaching `up` alone, a small share of this net's gradient
    # energy: the cosine drops to about 0.93, above the default 0.7 (made for deep models, where
    # healthy FP8 cosines sit lower); a healthy check of this net gives above 0.99.
    config = ReferenceCheck(policy="fallback", min_grad_cosine=0.98, fallback_blockwise=False)
    with pytest.warns(UserWarning, match=r"moved to high precision: down\.dgrad\b"):
        failed = fp.reference_check(model, _batch(), _loss, config=config, compute_dtype=torch.float32)
    assert any("grad cosine" in f for f in failed.failures), failed.failures
    figures = failed.gemm_sqnr_db["down"]
    assert abs(figures["dgrad"]) < 1, figures
    assert abs(figures["fprop"] - BAND["fprop"]) <= BAND_DB and abs(figures["wgrad"] - BAND["wgrad"]) <= BAND_DB
    assert failed.fallback_gemms == ["down.dgrad"] and failed.fallback_layers == [], failed.fallback_gemms
    assert model.down.fp8_gemms == (True, False, True) and model.up.fp8_gemms == (True, True, True)
    assert all(t["passed"] == t["kept"] for t in failed.fallback_tried)
    following = fp.reference_check(model, _batch(seed=2), _loss, config=config, compute_dtype=torch.float32)
    assert following.passed, following.failures
    assert "dgrad" not in following.gemm_sqnr_db["down"] or following.gemm_sqnr_db["down"]["dgrad"] > 10


def test_a_failure_no_move_restores_keeps_nothing_and_says_what_was_tried():
    model = _model(fp.DelayedScaling())
    # No FP8 layer reaches this gradient cosine: only all-high-precision would, which no half does.
    config = ReferenceCheck(policy="fallback", min_grad_cosine=0.999999, max_escalation_replays=0,
                            fallback_blockwise=False)
    with pytest.warns(UserWarning, match=r"no move of the 3 tried restored the figures: none kept"):
        result = fp.reference_check(model, _batch(), _loss, config=config, compute_dtype=torch.float32)
    assert [t["moves"] for t in result.fallback_tried] == [["down.dgrad"], ["up"], ["down"]]
    assert not any(t["passed"] or t["kept"] for t in result.fallback_tried)
    assert result.fallback_layers == result.fallback_gemms == []
    for layer in (model.up, model.down):
        assert layer.use_fp8 and layer.fp8_gemms == (True, True, True)
    with pytest.warns(UserWarning, match=r"no move of the 1 tried"):
        capped = fp.reference_check(model, _batch(), _loss, config=dataclasses.replace(config, max_fallback_replays=1),
                                    compute_dtype=torch.float32)
    assert len(capped.fallback_tried) == 1


def test_bisection_localises_a_layer_in_log_n_replays():
    # Eight FP8 layers; the replay passes only while layer "5" runs in high precision (a stand-in
    # for drift that no single GEMM's figure explains). Each step moves half of the remaining
    # layers and keeps the half whose replay passed.
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    fp.convert_model(model, fp.DelayedScaling())
    result = fp.reference_check(model, torch.randn(4, 32), lambda m, x: m(x).square().mean(),
                                compute_dtype=torch.float32)
    result.grad_cosine = 0.0  # failed
    replays = []

    def verify():
        replays.append(sorted(n for n, m in model.named_children() if not m.use_fp8))
        return dataclasses.replace(result, grad_cosine=1.0 if not model[5].use_fp8 else 0.0, failures=[])

    config = ReferenceCheck(policy="fallback", max_fallback_replays=10, fallback_blockwise=False)
    with pytest.warns(UserWarning, match="moved to high precision: 5"):
        reference_policy.apply_policy(model, result, config, verify=verify)
    worst = result.worst_gemms(1)[0]  # first the GEMM furthest below its band, alone
    assert replays[0] == [] and [t["moves"] for t in result.fallback_tried][0] == [f"{worst[0]}.{worst[1]}"]
    assert replays[1:] == [["0", "1", "2", "3"], ["4", "5", "6", "7"], ["4", "5"], ["4"], ["5"]]
    assert result.fallback_layers == ["5"] and result.fallback_gemms == []
    assert [n for n, m in model.named_children() if not m.use_fp8] == ["5"]


def test_a_healthy_run_under_fallback_moves_nothing_and_trains_bit_for_bit_as_without_checks():
    def train(check):
        model = _model(fp.DelayedScaling())
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        results = []
        for step in range(4):
            batch = _batch(seed=step)
            rng = reference_replay.capture_rng_state(torch.device("cpu"))
            with torch.autocast("cpu", torch.bfloat16), fp.autocast():
                loss = _loss(model, batch)
            loss.backward()
            if check:
                results.append(fp.reference_check(model, batch, _loss, rng_state=rng, step=step,
                                                  config=ReferenceCheck(policy="fallback")))
            opt.step()
            opt.zero_grad()
        return model, results

    plain, _ = train(False)
    checked, results = train(True)
    assert all(r.passed and not r.fallback_tried and not r.fallback_layers + r.fallback_gemms for r in results)
    for r in results:  # every GEMM in its healthy band
        for name, figures in r.gemm_sqnr_db.items():
            assert all(abs(db - BAND[g]) <= BAND_DB for g, db in figures.items()), (name, figures)
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        assert torch.equal(a, b), name
