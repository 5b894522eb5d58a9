"""BF16 reference checks (fp8_plugin/training/reference/): figures, policies, and that a check
changes nothing in the run it checks. Plain PyTorch, real Lightning Trainers and Fabric, CPU."""

import json
import math
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin as fp
from fp8_plugin.modules.convert import fp8_state_dict
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.training.reference import ReferenceCheck, capture_rng_state, output_loss, resolve_reference_check

# Expected output SQNR of a healthy E4M3 x E4M3 GEMM. Round-to-nearest with 3 mantissa bits
# errs uniformly within half an ulp, ulp = 2^(e-3) for |x| in [2^e, 2^(e+1)); for mantissas
# m = |x| / 2^e spread log-uniformly (Benford), E[err^2 / x^2] = 2^-6 / 12 * E[1/m^2] with
# E[1/m^2] = (1/ln 2) * (1/2) * (1 - 1/4) = 0.541: 7.05e-4 per operand, 31.5 dB. Both operands'
# independent errors add in the product: 1.41e-3, 28.5 dB. The band allows a factor of 2.5 in
# noise power either way (4 dB) for inputs far from log-uniform (ReLU zeros, Gaussian tails).
HEALTHY_SQNR_DB = 10 * math.log10(1 / (2 * 2**-6 / 12 * (1 / math.log(2)) * 0.5 * 0.75))
SQNR_BAND_DB = 4.0


class Net(nn.Module):
    """Three linear layers (two FP8, a head kept high precision by name), dropout, loss inside."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 4)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, y):
        h = self.down(self.drop(torch.relu(self.up(x))))
        return nn.functional.cross_entropy(self.head(h).float(), y)


def _converted(recipe=None, dropout=0.1):
    model = Net(dropout)
    fp.convert_model(model, recipe or fp.DelayedScaling(), exclude=["head"])
    return model


def _batch(seed=1, outlier=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen)
    if outlier is not None:
        x[:, 0] = outlier
    return x, torch.randint(0, 4, (32,), generator=gen)


def _loss(model, batch):
    return model(*batch)


def _train_step(model, batch, opt=None):
    with torch.autocast("cpu", torch.bfloat16), fp.autocast():
        loss = model(*batch)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def _plant_outlier_fault(model):
    # An input channel a million times the others, whose weight column is zero: the FP8 input
    # scale follows the outlier (amax 1e6), the other channels (|x| ~ 1, scaled by 448 / 1e6)
    # fall below E4M3's smallest subnormal 2^-9 and flush to zero, while the exact output never
    # sees the outlier (zero weights). The layer's FP8 output is then ~0: SQNR ~0 dB. The
    # column's gradient is zeroed too, so that training keeps it zero.
    with torch.no_grad():
        model.up.weight[:, 0] = 0
    model.up.weight.register_hook(lambda grad: grad.index_fill(1, torch.tensor([0]), 0.0))


def test_with_fp8_disabled_everywhere_the_check_reports_zero_difference():
    model = _converted()
    for module in model.modules():
        if isinstance(module, fp.FP8Linear):
            module.use_fp8 = False
    result = fp.reference_check(model, _batch(), _loss)
    assert result.loss_fp8 == result.loss_reference
    assert result.loss_rel_diff == 0.0
    assert result.grad_rel_error == 0.0
    assert abs(result.grad_cosine - 1.0) <= 1e-12  # dot / sqrt(|a|^2 |a|^2), float64 rounding
    assert all(rel == 0.0 for _, rel in result.param_figures.values())
    assert result.layer_sqnr_db == {}  # no layer ran in FP8
    assert result.passed


def test_healthy_model_figures_are_small_and_stable():
    model = _converted()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    history = []
    for step in range(5):
        batch = _batch(seed=step)
        rng = capture_rng_state(torch.device("cpu"))
        _train_step(model, batch)
        history.append(fp.reference_check(model, batch, _loss, rng_state=rng, step=step))
        opt.step()
        opt.zero_grad()
    for result in history:
        assert set(result.layer_sqnr_db) == {"up", "down"}
        for name, db in result.layer_sqnr_db.items():
            assert abs(db - HEALTHY_SQNR_DB) <= SQNR_BAND_DB, (name, db)
        # Well inside the default thresholds, which a healthy run must never trip.
        assert result.passed, result.describe()
        assert result.loss_rel_diff < ReferenceCheck().max_loss_rel_diff / 5
        assert result.grad_cosine > 0.98 and result.grad_rel_error < ReferenceCheck().max_grad_rel_error / 2
    for name in ("up", "down"):  # stable from step to step: within the band's width
        values = [r.layer_sqnr_db[name] for r in history]
        assert max(values) - min(values) <= SQNR_BAND_DB, values


def test_fp8_replay_repeats_the_training_forward_exactly():
    # From the RNG state of the training forward (same dropout masks) and the same scales, the
    # FP8 replay's loss is the training loss, bit for bit.
    model = _converted()
    _train_step(model, _batch(seed=7))  # delayed scaling: the next step uses updated scales
    batch = _batch(seed=8)
    rng = capture_rng_state(torch.device("cpu"))
    loss = _train_step(model, batch)
    result = fp.reference_check(model, batch, _loss, rng_state=rng)
    assert result.loss_fp8 == loss.item()


@pytest.mark.parametrize("fault", ["outlier_channel", "bad_scale"])
def test_planted_fault_is_detected_named_and_fallback_shrinks_the_loss_difference(fault):
    model = _converted(fp.Float8CurrentScaling() if fault == "outlier_channel" else fp.DelayedScaling())
    outlier = None
    if fault == "outlier_channel":
        _plant_outlier_fault(model)
        outlier = 1e6
    batch = _batch(outlier=outlier)
    if fault == "bad_scale":
        # A forced scale a million times too small: every input of "up" underflows to zero.
        _train_step(model, batch)
        model.up.fp8_state.scale[0] = 448.0 / 4.0 * 1e-6
        model.up.fp8_state.initialized[0] = True
    config = ReferenceCheck(policy="fallback")
    states = {n: {k: t.clone() for k, t in m.fp8_state.tensors().items()} for n, m in model.named_modules()
              if isinstance(m, fp.FP8Linear)}
    with pytest.warns(UserWarning, match="up"):
        failed = fp.reference_check(model, batch, _loss, config=config)
    # The replays, blockwise trials included, record nothing: every scaling state as it was.
    for name, tensors in states.items():
        for key, tensor in tensors.items():
            assert torch.equal(getattr(model, name).fp8_state.tensors()[key], tensor), (name, key)
    assert failed.layer_sqnr_db["up"] < 3.0  # output mostly flushed to zero: ~0 dB
    assert failed.layer_sqnr_db["down"] > config.min_sqnr_db
    assert not failed.passed and "min_sqnr_db" in " ".join(failed.failures)
    after = fp.reference_check(model, batch, _loss, config=config)
    if fault == "bad_scale":
        # Blockwise scaling, tried first, reads no delayed scale: its replay passes and "up"
        # keeps its GEMMs in FP8, cast in blocks.
        assert failed.fallback_blockwise == ["up"] and failed.fallback_layers == []
        assert model.up.fp8_scaling == "blockwise" and model.up.use_fp8 and model.down.fp8_scaling == "recipe"
        assert after.layer_sqnr_db["up"] > config.min_sqnr_db
    else:
        # A 1e6 channel crushes its whole 1x128 tile too: blockwise fails its replay, and the
        # layer under min_sqnr_db moves to high precision.
        assert [t["stage"] for t in failed.fallback_tried][:1] == ["blockwise"] and not failed.fallback_tried[0]["passed"]
        assert failed.fallback_layers == ["up"] and failed.fallback_blockwise == []
        assert model.up.use_fp8 is False and model.down.use_fp8 is True
        assert "up" not in after.layer_sqnr_db  # runs in high precision now
    assert after.loss_rel_diff < failed.loss_rel_diff / 10
    assert after.passed, after.describe()


def test_check_leaves_grads_optimizer_scaling_state_and_rng_stream_untouched():
    model = _converted()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    _train_step(model, _batch(seed=3), opt)
    batch = _batch(seed=4)
    _train_step(model, batch)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaling = fp8_state_dict(model)
    pending = {n: dict(m.fp8_state.pending) for n, m in model.named_modules() if isinstance(m, fp.FP8Linear)}
    optimizer_state = [(i, k, v.clone()) for i, s in enumerate(opt.state.values()) for k, v in s.items()]
    rng = torch.get_rng_state()
    fp.reference_check(model, batch, _loss)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    for key, value in fp8_state_dict(model).items():
        for name, tensor in value.items():
            assert torch.equal(tensor, scaling[key][name]), (key, name)
    assert pending == {n: dict(m.fp8_state.pending) for n, m in model.named_modules()
                       if isinstance(m, fp.FP8Linear)}
    after = [(i, k, v) for i, s in enumerate(opt.state.values()) for k, v in s.items()]
    assert len(after) == len(optimizer_state) > 0
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(after, optimizer_state))


def test_settings_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match=r"policy='panic'.*log, warn, fallback, raise"):
        ReferenceCheck(policy="panic")
    with pytest.raises(ValueError, match=r"every=-1"):
        ReferenceCheck(every=-1)
    with pytest.raises(TypeError, match=r"every=2.5"):
        ReferenceCheck(every=2.5)
    with pytest.raises(ValueError, match=r"min_grad_cosine=2"):
        ReferenceCheck(min_grad_cosine=2)
    with pytest.raises(ValueError, match="contradict"):
        resolve_reference_check(5, ReferenceCheck(every=10), "FP8Precision")
    with pytest.raises(ValueError, match=r"reference_every=-3"):
        FP8Precision(reference_every=-3)
    assert resolve_reference_check(0, None, "x") is None
    assert resolve_reference_check(None, ReferenceCheck(every=7), "x").every == 7
    with pytest.raises(ValueError, match="no scalar loss"):
        output_loss(torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# Lightning Trainer


class LitNet(L.LightningModule):
    def __init__(self, fault: bool = False, manual: bool = False):
        super().__init__()
        self.net = Net()
        if fault:
            _plant_outlier_fault(self.net)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(steps=6, outlier=None, batch_size=16):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(steps * batch_size, 64, generator=gen)
    if outlier is not None:
        x[:, 0] = outlier
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (steps * batch_size,), generator=gen)),
                      batch_size=batch_size)


def _trainer(plugin, tmp_path=None, **kwargs):
    kwargs = {"max_steps": 6, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False, **kwargs}
    return L.Trainer(plugins=[plugin], default_root_dir=tmp_path, **kwargs)


def _run_lightning(reference, accumulate=1, steps=6):
    module = LitNet()
    trainer = _trainer(FP8Precision(fp.DelayedScaling(), exclude=["*head"], reference_check=reference),
                       accumulate_grad_batches=accumulate, max_steps=steps)
    trainer.fit(module, _loader(steps * accumulate))
    return module, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_run_with_checks_is_bit_for_bit_the_run_without(accumulate):
    torch.manual_seed(11)
    plain, plain_trainer = _run_lightning(None, accumulate)
    plain_rng = torch.rand(4)
    torch.manual_seed(11)
    checked, checked_trainer = _run_lightning(ReferenceCheck(every=1, policy="log"), accumulate)
    checked_rng = torch.rand(4)
    assert len(checked_trainer.precision_plugin.fp8.reference.results) == 6
    assert torch.equal(plain_rng, checked_rng)
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(plain_trainer.optimizers[0].state.values(), checked_trainer.optimizers[0].state.values()):
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    plain_state, checked_state = fp8_state_dict(plain), fp8_state_dict(checked)
    assert plain_state.keys() == checked_state.keys()
    for key in plain_state:
        for name in plain_state[key]:
            assert torch.equal(plain_state[key][name], checked_state[key][name]), (key, name)


def test_lightning_checks_run_on_due_steps_and_reach_the_logger(tmp_path):
    module = LitNet()
    plugin = FP8Precision(fp.DelayedScaling(), exclude=["*head"], reference_every=2)
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    trainer = _trainer(plugin, logger=logger, log_every_n_steps=50)
    trainer.fit(module, _loader())
    results = plugin.fp8.reference.results
    assert [r.step + 1 for r in results] == [2, 4, 6]
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, row.split(","))) for row in rows[1:]]
    cosines = [float(r["fp8_ref/grad_cosine"]) for r in logged if r.get("fp8_ref/grad_cosine")]
    assert cosines == pytest.approx([r.grad_cosine for r in results], rel=1e-6)
    assert "fp8_ref/sqnr_db/net.up" in header and "fp8_ref/sqnr_db/net.down" in header


def test_lightning_summary_json_and_plot_at_the_end_of_fit(tmp_path, caplog):
    json_path, plot_path = tmp_path / "checks.json", tmp_path / "checks.png"
    plugin = FP8Precision(fp.DelayedScaling(), exclude=["*head"], reference_check=ReferenceCheck(
        every=3, json_path=str(json_path), plot_path=str(plot_path)))
    with caplog.at_level("INFO"):
        _trainer(plugin).fit(LitNet(), _loader())
    assert "FP8 reference checks: 2 run (every 3 steps, policy 'warn'), 0 failed" in caplog.text
    assert "overhead" in caplog.text
    data = json.loads(json_path.read_text())
    results = plugin.fp8.reference.results
    assert [c["step"] for c in data["checks"]] == [2, 5]
    assert data["checks"][1]["grad_cosine"] == results[1].grad_cosine
    assert data["checks"][1]["layer_sqnr_db"] == results[1].layer_sqnr_db
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lightning_raise_policy_stops_before_the_step_and_a_checkpoint_can_be_written(tmp_path):
    module = LitNet(fault=True)
    plugin = FP8Precision(fp.Float8CurrentScaling(), exclude=["*head"],
                          reference_check=ReferenceCheck(every=2, policy="raise"))
    trainer = _trainer(plugin, tmp_path)
    snapshot = {}

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshot.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    trainer.callbacks.append(Snapshot())
    with pytest.raises(fp.FP8ReferenceCheckError, match=r"net\.up .*dB") as raised:
        trainer.fit(module, _loader(outlier=1e6))
    assert raised.value.result.step == 1 and "net.up" in raised.value.result.layer_sqnr_db
    # Stopped before the optimizer step of step 2: the weights are the ones the check judged.
    for name, param in module.named_parameters():
        assert torch.equal(param, snapshot[name]), name
    path = tmp_path / "after-error.ckpt"
    trainer.save_checkpoint(path)
    restored = LitNet.load_from_checkpoint(path)  # a plain module: the checkpoint stays vanilla
    for (name, a), b in zip(module.named_parameters(), restored.parameters()):
        assert torch.equal(a, b), name


def test_lightning_fallback_survives_checkpoint_resume(tmp_path):
    config = ReferenceCheck(every=2, policy="fallback")
    plugin = FP8Precision(fp.Float8CurrentScaling(), exclude=["*head"], reference_check=config)
    trainer = _trainer(plugin, tmp_path, max_steps=2)
    with pytest.warns(UserWarning, match="moved to high precision: net.up"):
        trainer.fit(LitNet(fault=True), _loader(outlier=1e6))
    path = tmp_path / "fallback.ckpt"
    trainer.save_checkpoint(path)

    resumed_plugin = FP8Precision(fp.Float8CurrentScaling(), exclude=["*head"], reference_check=config)
    resumed = LitNet(fault=True)
    gemms = []

    class CountFP8Layers(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            gemms.append({n for n, m in pl_module.named_modules() if isinstance(m, fp.FP8Linear) and m.use_fp8})

    _trainer(resumed_plugin, tmp_path, max_steps=4, callbacks=[CountFP8Layers()]).fit(
        resumed, _loader(outlier=1e6), ckpt_path=path)
    assert gemms and all(layers == {"net.down"} for layers in gemms)  # from the first resumed step
    checker = resumed_plugin.fp8.reference
    assert checker.fallback_layers() == [(2, "net.up")]  # the decision and when, restored
    assert [r.step + 1 for r in checker.results] == [2, 4] and checker.results[1].passed


def test_lightning_manual_optimization_is_refused_at_start():
    plugin = FP8Precision(reference_every=1)
    with pytest.raises(ValueError, match="automatic optimization"):
        _trainer(plugin).fit(LitNet(manual=True), _loader())


# ---------------------------------------------------------------------------------------------
# Fabric


def test_fabric_checks_replay_the_last_forward_and_report():
    from fp8_plugin.fabric import FP8Precision as FabricFP8Precision

    plugin = FabricFP8Precision(fp.DelayedScaling(), exclude=["head"], reference_every=2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    model, opt = fabric.setup(model, opt)
    logged, losses = [], []
    for step in range(4):
        loss = model(*_batch(seed=step))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logged.append(plugin.reference_metrics())
    assert [bool(m) for m in logged] == [False, True, False, True]
    # The replay reran the training forward: same dropout, same scales, same loss.
    assert logged[1]["fp8_ref/loss_fp8"] == losses[1] and logged[3]["fp8_ref/loss_fp8"] == losses[3]
    assert "2 run" in plugin.reference_summary()


def test_frozen_model_reports_loss_and_layers_only():
    # A model with no trainable parameter (all frozen, e.g. a feature extractor): no gradient
    # figures, but loss and per-layer SQNR are still compared.
    model = _converted()
    for p in model.parameters():
        p.requires_grad_(False)
    result = fp.reference_check(model, _batch(), _loss)
    assert result.param_figures == {} and set(result.layer_sqnr_db) == {"up", "down"}
    assert result.grad_cosine == 1.0 and result.grad_rel_error == 0.0


def test_replay_leaves_buffers_such_as_running_statistics_alone():
    model = _converted()
    model.norm = nn.BatchNorm1d(64)
    forward = model.forward
    model.forward = lambda x, y: forward(model.norm(x), y)
    batch = _batch()
    _train_step(model, batch)
    running = model.norm.running_mean.clone(), model.norm.running_var.clone(), model.norm.num_batches_tracked.clone()
    fp.reference_check(model, batch, _loss)
    assert all(torch.equal(a, b) for a, b in zip(running, (model.norm.running_mean, model.norm.running_var,
                                                            model.norm.num_batches_tracked)))


def test_a_float32_reference_runs_the_fp8_layers_gemms_in_float32_and_hands_on_the_autocast_dtype():
    # Where BF16 matmuls are slow (CPUs without AVX512-BF16 / AMX) the checks' reference runs the

    # bf16's unit roundoff (2^-8, relative: 8 significant bits) of the float64 product plus float32 accumulation over
    # K terms; bf16 operands would be off by far more on a product with cancellation.
    from fp8_plugin.modules.autocast import replay

    torch.manual_seed(0)
    layer = fp.FP8Linear(256, 128)
    x = torch.randn(64, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16), replay(False, reference_dtype=torch.float32):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    magnitude = x.double().abs() @ layer.weight.double().abs().t() + layer.bias.double().abs()
    bound = 2.0**-8 * exact.abs() + 256 * 2.0**-24 * magnitude
    assert bool(((out.double() - exact).abs() <= bound).all())
    with torch.autocast("cpu", dtype=torch.bfloat16), replay(False):
        in_bf16 = layer(x)  # as nn.Linear under autocast: bf16 operands
    assert not bool(((in_bf16.double() - exact).abs() <= bound).all())


def test_a_weight_tied_between_two_layers_gets_the_per_call_wgrad_figure_of_the_same_layers_untied():
    # The wgrad figure reads each layer's reference from its weight's gradient in the reference
    # replay; a weight two layers share holds both layers' shares there, so its reference is a
    # GEMM recomputed per call instead. The same two layers with equal but separate weights
    # take the first path: their figures must agree. Both references are float32 GEMMs of the
    # same operands (K = 32 tokens), differing only in summation order: elementwise by at most
    # 2 gamma_32 sum |dy| |x| (Higham 3.1), about 4e-6 relatively; in the noise energy, 25 to
    # 35 dB below the signal, that is at most a few 1e-4 relatively, 1e-3 dB. Had the shared
    # gradient been read, the other layer's share would count as noise: near 0 dB.
    def model(tied):
        torch.manual_seed(0)
        first, second = nn.Linear(64, 64), nn.Linear(64, 64)
        if tied:
            second.weight = first.weight
        else:
            with torch.no_grad():
                second.weight.copy_(first.weight)
        net = nn.Sequential(first, nn.ReLU(), second)
        fp.convert_model(net, fp.Float8CurrentScaling())
        return net

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    figures = {}
    for tied in (True, False):
        net = model(tied)
        assert (net[0].weight is net[2].weight) == tied
        result = fp.reference_check(net, x, lambda m, x: m(x).square().mean(), compute_dtype=torch.float32)
        figures[tied] = {name: f["wgrad"] for name, f in result.gemm_sqnr_db.items()}
    assert figures[True].keys() == figures[False].keys() == {"0", "2"}
    for name in ("0", "2"):
        assert abs(figures[True][name] - figures[False][name]) <= 1e-2, figures
        assert figures[True][name] > 20.0, figures  # a healthy figure, not the other share's 0 dB


def test_a_loss_fn_that_enters_fp8_autocast_itself_is_refused_naming_the_cause():
    # Before the guard, the reference replay ran in FP8 too: the check compared FP8 with FP8
    # (cosine 1, every SQNR infinite) and passed whatever the model did.
    model = _converted()
    batch = _batch(outlier=1e6)
    _plant_outlier_fault(model)

    def loss_fn_with_autocast(m, b):
        with fp.autocast():
            return m(*b)

    with pytest.raises(RuntimeError, match=r"reference replay ran 2 FP8 forwards.*fp8_plugin.autocast\(\) inside"):
        fp.reference_check(model, batch, loss_fn_with_autocast)
    # The documented loss_fn (no autocast inside) finds the planted fault.
    assert not fp.reference_check(model, batch, _loss).passed


def test_an_fp8_replay_that_runs_no_fp8_forward_is_refused():
    model = _converted()

    def loss_fn_fp8_off(m, b):
        with fp.autocast(enabled=False):
            return m(*b)

    with pytest.raises(RuntimeError, match=r"FP8 replay ran no FP8 forward.*2 FP8 layers"):
        fp.reference_check(model, _batch(), loss_fn_fp8_off)


def test_a_moves_verification_replay_runs_no_per_gemm_figure_and_is_judged_on_the_same_figures(monkeypatch):
    # A move's verification replay is judged on the loss, gradient and layer figures alone
    # (apply_policy): without per-GEMM figures its reference backward runs none of their FP8
    # GEMMs (a dgrad and a wgrad per FP8 layer), and what it is judged on is unchanged.
    import fp8_plugin.training.reference.figures as figures
    from fp8_plugin.training.reference.replay import compare

    figure_gemms = []
    original = figures._figure_gemm
    monkeypatch.setattr(figures, "_figure_gemm", lambda a, b: figure_gemms.append(1) or original(a, b))
    model = _converted(dropout=0.0)
    batch = _batch(seed=3)
    rng = capture_rng_state(torch.device("cpu"))
    full = compare(model, lambda: _loss(model, batch), rng_state=rng)
    # "down": dgrad and wgrad; "up": wgrad alone (its input, the batch, takes no gradient).
    assert len(figure_gemms) == 3
    quick = compare(model, lambda: _loss(model, batch), rng_state=rng, gemm_figures=False)
    assert len(figure_gemms) == 3
    assert {n: set(f) for n, f in full.gemm_sqnr_db.items()} == {"up": {"fprop", "wgrad"},
                                                                 "down": {"fprop", "dgrad", "wgrad"}}
    assert quick.gemm_sqnr_db == {name: {"fprop": f["fprop"]} for name, f in full.gemm_sqnr_db.items()}
    judged = ("loss_fp8", "loss_reference", "grad_cosine", "grad_rel_error", "layer_sqnr_db", "param_figures")
    assert [getattr(quick, k) for k in judged] == [getattr(full, k) for k in judged]


def test_a_moves_verification_replay_takes_the_checks_reference_and_runs_no_reference_backward():
    # With FP8 off every FP8 layer computes in the reference dtype whatever a move switched, so
    # the check's reference loss and gradients are the verification's too: its reference runs
    # the forward alone (the layer figures), and every judged figure is that of a whole replay.
    from fp8_plugin.training.reference import ReferenceSide
    from fp8_plugin.training.reference.replay import compare

    model = _converted()
    batch = _batch(seed=4)
    rng = capture_rng_state(torch.device("cpu"))
    backwards = []  # the backward passes that reach the head: one per replay that takes gradients
    model.head.register_full_backward_hook(lambda *args: backwards.append(1))
    replay = lambda: _loss(model, batch)  # noqa: E731
    kept = ReferenceSide()
    check = compare(model, replay, rng_state=rng, reference=kept)
    assert len(backwards) == 2 and kept.names == [n for n, p in model.named_parameters() if p.requires_grad]
    judged = ("loss_fp8", "loss_reference", "grad_cosine", "grad_rel_error", "layer_sqnr_db", "param_figures")
    for move in (lambda: None, lambda: setattr(model.up, "use_fp8", False),
                 lambda: setattr(model.down, "fp8_scaling", "blockwise")):
        move()
        del backwards[:]
        verified = compare(model, replay, rng_state=rng, gemm_figures=False, reference=kept)
        assert len(backwards) == 1  # the FP8 replay's alone
        whole = compare(model, replay, rng_state=rng, gemm_figures=False)
        assert [getattr(verified, k) for k in judged] == [getattr(whole, k) for k in judged]
    assert check.loss_reference == verified.loss_reference and "up" not in verified.layer_sqnr_db
    assert verified.layer_sqnr_db["down"] != check.layer_sqnr_db["down"]  # blockwise: the forward ran
    # The dgrad and wgrad figures need the reference backward; other parameters, other gradients.
    with pytest.raises(ValueError, match=r"kept reference cannot be taken \(gemm_figures=True"):
        compare(model, replay, rng_state=rng, reference=kept)
    model.up.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"kept reference cannot be taken \(its gradients are of other"):
        compare(model, replay, rng_state=rng, gemm_figures=False, reference=kept)


def test_gradient_figures_are_the_float64_sums_of_their_products():
    from fp8_plugin.training.reference.gradients import grad_stats

    gen = torch.Generator().manual_seed(5)
    g8, gr = torch.randn(6, 7, generator=gen), torch.randn(6, 7, generator=gen).to(torch.bfloat16)
    a, b = g8.flatten().tolist(), gr.float().flatten().tolist()
    # The terms: products of float32 values, exact in float64, and squares of their differences
    # (exact in float64 too: these values lie within 2^29 of each other), rounded once each.
    terms = [[x * y for x, y in zip(a, b)], [x * x for x in a], [y * y for y in b],
             [(x - y) ** 2 for x, y in zip(a, b)]]
    expected = [math.fsum(t) for t in terms]  # each sum rounded once
    # 42 terms, each rounded at most once, summed in float64 in any order: an error of at most
    # 43 * 2^-53 times the sum of the terms' magnitudes (Higham, Accuracy and Stability, 4.2).
    bounds = [43 * 2**-53 * math.fsum(abs(v) for v in t) for t in terms]
    got = grad_stats(g8.t(), gr.t(), torch.device("cpu")).tolist()  # any layout: transposed views
    assert all(abs(g - e) <= bound for g, e, bound in zip(got, expected, bounds)), (got, expected)
    missing = grad_stats(None, gr, torch.device("cpu")).tolist()
    assert missing[:2] == [0.0, 0.0] and all(abs(g - expected[2]) <= bounds[2] for g in missing[2:]), missing
    assert grad_stats(None, None, torch.device("cpu")).tolist() == [0.0] * 4
