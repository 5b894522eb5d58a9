"""Fault injection: non-finite values, amax outliers and forced scale overflows never reach the
scaling state or the FP32 master weights, and end in a skipped step, a clear error, or nothing.

The expectations are independent of the code under test: a step skipped for a non-finite value
must leave the weights and the optimizer state exactly as a snapshot taken before it; with
``amax_history_len=1`` a run whose bad batch was skipped must equal, bit for bit, a run that never
saw that batch (the derivation is in the test); outputs are compared with float64 products.
"""

import copy
import math
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin as fp
import fp8_plugin.fabric  # noqa: F401  (fp.fabric)
from fp8_plugin import FP8Linear
from fp8_plugin.training.faults import FaultPolicy, FP8NonFiniteError
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT, INPUT
from reference import count_fp8_gemms

TRAINER = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False)


class Net(L.LightningModule):
    """Two FP8 hidden layers and a high-precision head; ``fault`` plants a value in a place."""

    def __init__(self, fault=None, fault_batches=(), value=float("nan")):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)
        self.fault, self.fault_batches, self.value = fault, set(fault_batches), value
        self.batch = -1
        if fault == "gradient":  # net.2's weight gradient becomes `value` on the fault batches
            self.net[2].weight.register_hook(
                lambda g: torch.full_like(g, self.value) if self.batch in self.fault_batches else g)

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        if self.fault == "activation" and self.batch in self.fault_batches:
            h = h.clone()
            h[0, 0] = self.value  # a layer's output goes bad: the next FP8 layer sees it
        return self.head(self.net[3](self.net[2](h)))

    def training_step(self, batch, batch_idx):
        self.batch = batch_idx
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def batches(n=6, bad=(), value=float("nan")):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * 8, 32, generator=g)
    y = x[:, :4].argmax(1)
    for b in bad:
        x[b * 8 + 3, 5] = value
    return x, y


def loader(x, y):
    return DataLoader(TensorDataset(x, y), batch_size=8)


class Snapshots(Callback):
    """Weights and optimizer state before and after every optimizer step (batch index)."""

    def __init__(self):
        self.before, self.after = {}, {}

    def _state(self, trainer, module):
        return copy.deepcopy({"weights": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()})

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before[batch_idx] = self._state(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after[batch_idx] = self._state(trainer, module)


def fit(module, data, plugin=None, callbacks=(), **kwargs):
    plugin = plugin or FP8Precision(fp.DelayedScaling(amax_history_len=1), compute_dtype=torch.float32, **kwargs)
    trainer = L.Trainer(plugins=[plugin], max_epochs=1, callbacks=list(callbacks), **TRAINER)
    trainer.fit(module, loader(*data))
    return trainer


def assert_same(a, b, what=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, list):
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{what}[{i}]")
    else:
        assert a == b, what


def final_state(trainer, module):
    return {"weights": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}


# --- non-finite values without loss scaling ------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_bad_input_batch_is_skipped_and_the_run_equals_one_without_that_batch(value):
    # Under current scaling every cast is scaled from its own tensor, so a skipped step leaves
    # nothing behind: skipping batch 3 must give exactly the run over the other five batches
    # (weights, and the optimizer state with Adam's step count).
    x, y = batches(bad=[3], value=value)
    faulty, snaps = Net(), Snapshots()
    plugin = FP8Precision(fp.Float8CurrentScaling(), compute_dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"non-finite gradients at optimizer step 4; first seen by FP8 layer "
                                         r"'net.0' \(input\).*skipped"):
        trainer = fit(faulty, (x, y), plugin=plugin, callbacks=[snaps])
    keep = [i for i in range(len(x)) if not 24 <= i < 32]
    clean = Net()
    clean_trainer = fit(clean, (x[keep], y[keep]), plugin=FP8Precision(fp.Float8CurrentScaling(),
                                                                       compute_dtype=torch.float32))
    assert_same(final_state(trainer, faulty), final_state(clean_trainer, clean))
    assert_same(snaps.before[3], snaps.after[3])  # the skipped step changed nothing
    assert trainer.precision_plugin.fp8.faults.skipped_steps == 1
    assert faulty.net[0].fp8_state.nonfinite_amax_count[INPUT] == 1


def test_bad_input_batch_leaves_delayed_scaling_state_finite_and_unchanged():
    # Delayed scaling: the bad step's non-finite amaxes are not recorded, so the next update
    # keeps the input and grad_output scales the step before left (amax_history_len=1: an
    # empty slot means "keep"); the weights did not move, so the weight scale is theirs.
    x, y = batches(bad=[3])
    faulty = Net()
    seen = {}

    class Scales(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen[batch_idx] = {n: m.fp8_state.scale.clone() for n, m in module.named_modules()
                               if isinstance(m, FP8Linear)}

    with pytest.warns(UserWarning, match="skipped"):
        fit(faulty, (x, y), callbacks=[Scales()])
    for name in seen[3]:
        assert torch.equal(seen[4][name][[INPUT, GRAD_OUTPUT]], seen[3][name][[INPUT, GRAD_OUTPUT]]), name
    for layer in (faulty.net[0], faulty.net[2]):
        assert torch.isfinite(layer.fp8_state.amax_history).all() and torch.isfinite(layer.fp8_state.scale).all()
        assert (layer.fp8_state.scale > 0).all()


def test_bad_activation_is_named_by_the_next_fp8_layer_and_the_step_skipped():
    faulty, snaps = Net(fault="activation", fault_batches=[2]), Snapshots()
    with pytest.warns(UserWarning, match=r"step 3; first seen by FP8 layer 'net.2' \(input\)"):
        fit(faulty, batches(), callbacks=[snaps])
    assert_same(snaps.before[2], snaps.after[2])
    assert all(torch.isfinite(p).all() for p in faulty.parameters())


def test_bad_gradient_is_skipped_without_touching_weights_or_optimizer_state():
    # The forward was finite; the gradient of net.2's weight is replaced by NaN in backward.
    faulty, snaps = Net(fault="gradient", fault_batches=[1]), Snapshots()
    with pytest.warns(UserWarning, match=r"step 2; first non-finite gradient in parameter 'net.2.weight'"):
        trainer = fit(faulty, batches(), callbacks=[snaps])
    assert_same(snaps.before[1], snaps.after[1])
    assert trainer.precision_plugin.fp8_metrics()["fp8/nonfinite_skipped_steps"] == 1.0
    assert all(torch.isfinite(p).all() for p in faulty.parameters())


def test_raise_policy_stops_before_the_step_naming_the_layer():
    x, y = batches(bad=[3])
    faulty = Net()
    with pytest.raises(FP8NonFiniteError, match=r"step 4; first seen by FP8 layer 'net.0' \(input\).*stopped before"):
        fit(faulty, (x, y), nonfinite="raise")
    clean = Net()
    clean_trainer = fit(clean, (x[:24], y[:24]))  # the three good steps before it
    assert_same(faulty.state_dict(), clean.state_dict())
    del clean_trainer


@pytest.mark.parametrize("fault, where", [
    ("activation", r"first seen by FP8 layer 'net.2' \(input\)"),
    ("gradient", r"first non-finite gradient in parameter 'net.2.weight'"),
])
def test_raise_policy_stops_on_a_bad_activation_or_gradient_with_the_weights_of_the_step_before(fault, where):
    faulty, snaps = Net(fault=fault, fault_batches=[2]), Snapshots()
    with pytest.raises(FP8NonFiniteError, match=rf"step 3; {where}.*stopped before the step"):
        fit(faulty, batches(), callbacks=[snaps], nonfinite="raise")
    assert_same(snaps.before[2]["weights"], faulty.state_dict())


def test_consecutive_skips_beyond_the_limit_stop_the_run():
    x, y = batches(n=8, bad=[2, 3, 4, 5, 6, 7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FP8NonFiniteError, match=r"4 optimizer steps in a row were skipped.*max_consecutive_skips=3"):
            fit(Net(), (x, y), max_consecutive_skips=3)


def test_loss_scaler_skips_overflowing_steps_itself_and_the_streak_limit_still_holds():
    # FP16 with dynamic loss scaling: the scaler skips a step with inf gradients and halves its
    # scale; fp8-plugin does not warn for that, but a streak beyond the limit stops the run.
    x, y = batches(n=8, bad=[2], value=float("inf"))
    module, snaps = Net(), Snapshots()
    plugin = FP8Precision(fp.DelayedScaling(amax_history_len=1), compute_dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=r"(?!FP8: non-finite)")
        trainer = fit(module, (x, y), plugin=plugin, callbacks=[snaps])
    assert plugin.skipped_steps >= 1
    assert_same(snaps.before[2]["weights"], snaps.after[2]["weights"])
    del trainer
    x, y = batches(n=8, bad=range(1, 8), value=float("inf"))
    plugin = FP8Precision(fp.DelayedScaling(amax_history_len=1), compute_dtype=torch.float16, max_consecutive_skips=2)
    with pytest.raises(FP8NonFiniteError, match="in a row"):
        fit(Net(), (x, y), plugin=plugin)


def test_loss_scaler_skips_known_on_the_host_count_the_same_streak():
    # Accelerate (and DeepSpeed) know on the host whether their scaler skipped a step: they hand
    # the monitor a bool, and the streak and its limit are those of a device tensor's.
    from fp8_plugin.training.faults import FaultMonitor

    model = nn.Linear(4, 4)
    for skipped in (torch.tensor(True), True):
        monitor = FaultMonitor(FaultPolicy(max_consecutive_skips=2))
        streak = []
        for flag in (True, False, True, True):
            monitor.scaler_step(torch.tensor(flag) if isinstance(skipped, torch.Tensor) else flag)
            monitor.check(model, step=len(streak) + 2, loss_scaled=True)
            streak.append(monitor.consecutive_skips)
        assert streak == [1, 0, 1, 2]
        monitor.scaler_step(skipped)
        with pytest.raises(FP8NonFiniteError, match="3 optimizer steps in a row"):
            monitor.check(model, step=6, loss_scaled=True)


def test_fault_policy_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match=r"nonfinite='ignore' is invalid; valid: 'skip', 'raise'"):
        FP8Precision(nonfinite="ignore")
    with pytest.raises(ValueError, match=r"max_consecutive_skips=-1 is invalid"):
        fp.fabric.FP8Precision(max_consecutive_skips=-1) if hasattr(fp, "fabric") else FaultPolicy(max_consecutive_skips=-1)


# --- amax outliers under delayed scaling -----------------------------------------------------------

def _outlier_run(policy, outlier_at=5, steps=40, factor=1e6, omit=-1):
    """Relative output error of an FP8Linear at every step, one input batch ``factor`` times
    larger (``omit``: a step whose batch is drawn but never run)."""
    torch.manual_seed(0)
    layer = FP8Linear(64, 64, recipe=fp.DelayedScaling(amax_history_len=1024, amax_outlier_policy=policy))
    g = torch.Generator().manual_seed(2)
    errors, outputs = [], []
    for step in range(steps):
        x = torch.randn(32, 64, generator=g)
        if step == outlier_at:
            x = x * factor
        if step == omit:
            errors.append(None)
            outputs.append(None)
            continue
        with fp.autocast():
            y = layer(x)
        y.sum().backward()
        exact = x.double() @ layer.weight.double().t() + layer.bias.double()
        errors.append(((y.double() - exact).norm() / exact.norm()).item())
        outputs.append(y.detach())
    return layer, errors, outputs


def test_keep_policy_lets_one_outlier_batch_flush_the_following_steps():
    # Transformer Engine's behaviour, reproduced: the 1e6 amax rules the "max" history, the input
    # scale drops a millionfold and normal inputs flush to zero on every following step.
    _, errors, _ = _outlier_run("keep")
    assert min(errors[6:]) > 0.9


def test_clip_policy_bounds_the_damage_of_one_outlier_batch():
    # Clipped to 100x the amax the scale came from, normal inputs of amax ~4 are cast with
    # amax ~400: their largest values stay above 448/100 = 4.5 and their RMS ~1 near 1.1 after
    # scaling, far inside E4M3's normal range (>= 2**-6), so the error stays that of a healthy
    # E4M3 GEMM: per operand half an ulp, 2**-4 relative, at most 2**-3 for the product.
    layer, errors, _ = _outlier_run("clip")
    assert max(errors[6:]) < 2 ** -3
    assert layer.fp8_state.outlier_count[INPUT] == 1
    # The ratio is to the amax the scale came from: the max over the five batches before.
    g = torch.Generator().manual_seed(2)
    amaxes = [torch.randn(32, 64, generator=g).abs().max().item() for _ in range(6)]
    expected = 1e6 * amaxes[5] / max(amaxes[:5])
    assert layer.fp8_state.outlier_ratio[INPUT].item() == pytest.approx(expected, rel=1e-5)


def test_skip_policy_leaves_the_following_steps_as_if_the_outlier_never_came():
    layer, errors, outputs = _outlier_run("skip")
    _, _, clean = _outlier_run("skip", outlier_at=-1, omit=5)
    for step in range(6, 40):
        assert torch.equal(outputs[step], clean[step]), step
    assert layer.fp8_state.outlier_count[INPUT] == 1


def test_outlier_is_reported_with_layer_role_and_factor_in_a_lightning_run():
    x, y = batches(n=6)
    x[32:40] *= 1e4  # batch 4
    with pytest.warns(UserWarning, match=r"amax outlier in layer 'net.0' \(input\) before optimizer step 6: ") as w:
        trainer = fit(Net(), (x, y))
    assert trainer.precision_plugin.fp8_metrics()["fp8/amax_outliers"] >= 1
    message = next(str(m.message) for m in w if "outlier" in str(m.message))
    ratio = float(re.search(r"step 6: ([0-9.e+]+) times", message).group(1))
    # 1e4 times the batch's own amax, over the largest amax of the batches before.
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(48, 32, generator=g)
    expected = 1e4 * x0[32:40].abs().max().item() / x0[:32].abs().max().item()
    assert ratio == pytest.approx(expected, rel=1e-2)


def test_forced_scale_overflow_saturates_and_recovers_at_the_next_update():
    # A scale so large that x * scale overflows float32: values saturate to +-448 (finite), no
    # NaN reaches the output or the gradient, and the next update recomputes the scale from the
    # recorded amax, after which the error is that of a healthy E4M3 GEMM again.
    torch.manual_seed(0)
    layer = FP8Linear(64, 64, recipe=fp.DelayedScaling(amax_history_len=4))
    x = torch.randn(32, 64)
    with fp.autocast():
        layer(x).sum().backward()
    layer.fp8_state.scale[INPUT] = torch.finfo(torch.float32).max
    with fp.autocast(), count_fp8_gemms() as gemms:
        y = layer(x)
        y.sum().backward()
    assert gemms.count == 2 and torch.isfinite(y).all()  # forward and wgrad (x needs no grad) and torch.isfinite(layer.weight.grad).all()
    with fp.autocast():
        y = layer(x)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert ((y.double() - exact).norm() / exact.norm()).item() < 2 ** -3
    assert layer.fp8_state.scale[INPUT].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)


def test_nonfinite_amax_never_enters_history_or_scale():
    layer = FP8Linear(16, 16, recipe=fp.DelayedScaling(amax_history_len=4))
    for value in (float("nan"), float("inf"), 1.0):
        x = torch.ones(4, 16) * value
        with fp.autocast():
            y = layer(x)
        y.backward(torch.full_like(y, value))  # grad_output as bad as the input
        assert torch.isfinite(layer.fp8_state.amax_history).all()
        assert torch.isfinite(layer.fp8_state.scale).all() and (layer.fp8_state.scale > 0).all()
    assert layer.fp8_state.nonfinite_amax_count[INPUT] == 2
    assert layer.fp8_state.nonfinite_amax_count[GRAD_OUTPUT] == 2
    assert not math.isnan(layer.fp8_state.scale[INPUT].item())


# --- the other loops: Accelerate and Fabric skip (or stop) the same way --------------------------

def test_accelerate_skips_the_step_and_its_scheduler_on_non_finite_gradients(fresh_accelerate):
    from fp8_plugin.accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp8", fp8_recipe=fp.DelayedScaling(amax_history_len=4),
                      fp8_compute_dtype=torch.float32)
    model = Net().net
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    x, _ = batches(n=4, bad=[2])
    for step in range(4):
        before = copy.deepcopy({"weights": model.state_dict(), "optimizer": optimizer.state_dict()})
        lr = optimizer.param_groups[0]["lr"]
        out = model(x[step * 8:(step + 1) * 8])
        acc.backward(out.square().mean())
        if step == 2:
            with pytest.warns(UserWarning, match=r"step 3; first seen by FP8 layer '0' \(input\)"):
                optimizer.step()
            assert acc.optimizer_step_was_skipped
        else:
            optimizer.step()
            assert not acc.optimizer_step_was_skipped
        scheduler.step()
        optimizer.zero_grad()
        if step == 2:
            assert_same(before, {"weights": model.state_dict(), "optimizer": optimizer.state_dict()})
            assert optimizer.param_groups[0]["lr"] == lr  # Accelerate's scheduler skips with the step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_accelerate_raise_policy_from_the_config_key(fresh_accelerate, monkeypatch):
    from fp8_plugin.accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_FP8_NONFINITE", "raise")
    acc = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    model = Net().net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x, _ = batches(n=1, bad=[0])
    acc.backward(model(x).square().mean())
    with pytest.raises(FP8NonFiniteError, match=r"step 1; first seen by FP8 layer '0' \(input\)"):
        optimizer.step()


def test_fabric_skips_the_step_on_non_finite_gradients():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[fp.fabric.FP8Precision(compute_dtype=torch.float32)])
    model = Net().net
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    x, _ = batches(n=3, bad=[1])
    for step in range(3):
        before = copy.deepcopy({"weights": dict(model.named_parameters()), "optimizer": optimizer.state_dict()})
        fabric.backward(model(x[step * 8:(step + 1) * 8]).square().mean())
        if step == 1:
            with pytest.warns(UserWarning, match="step 2; first seen by FP8 layer '0'"):
                optimizer.step()
            assert_same(before, {"weights": dict(model.named_parameters()), "optimizer": optimizer.state_dict()})
        else:
            optimizer.step()
        optimizer.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_finite_gradients_whose_sum_overflows_are_not_mistaken_for_bad_ones():
    # The per-step test sums each gradient (cheap); 4 x 1e38 overflows float32 although every
    # value is finite, so a flagged step is confirmed element by element before it is skipped.
    from fp8_plugin.training.faults import FaultMonitor

    model = nn.Sequential(nn.Linear(16, 16))
    fp.convert_model(model)
    monitor = FaultMonitor(FaultPolicy())
    model[0].weight.grad = torch.full((16, 16), 1e38)
    model[0].bias.grad = torch.zeros(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert monitor.check(model, step=1, loss_scaled=False) is True
    model[0].bias.grad[3] = float("nan")
    with pytest.warns(UserWarning, match="first non-finite gradient in parameter '0.bias'"):
        assert monitor.check(model, step=2, loss_scaled=False) is False
