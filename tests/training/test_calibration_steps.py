"""Calibration steps and the evaluation-precision switch in every loop: a real Lightning Trainer,
Fabric, Accelerate's Accelerator and FP8Trainer.

The calibration steps train in the reference precision (their losses are the plain model's;
their only FP8 GEMMs are the forward-only measurements of the scaling choice, counted), then
every FP8 layer casts with scales from the amaxes of those steps' batches (TE's formula,
computed here from the data) and the run goes on in FP8.
"""

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT, INPUT
from reference import E4M3_MAX, E5M2_MAX, count_fp8_gemms

BATCHES = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(4)]


def _expected_input_scale(batches) -> torch.Tensor:
    amax = max(float(b.abs().max()) for b in batches)
    return torch.tensor(E4M3_MAX, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _plain_losses(batches) -> list[float]:
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    for batch in batches:
        loss = net(batch).square().mean()
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_lightning_calibration_steps_then_fp8_and_evaluation_in_either_precision():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).square().mean()
            losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val", self.net(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    per_step, scales, losses = [], [], []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            per_step.append(gemms.count - sum(per_step))
            scales.append(module.net[0].fp8_state.scale[INPUT].clone())

    data = DataLoader(TensorDataset(torch.cat(BATCHES)), batch_size=8)
    for eval_in_fp8 in (False, True):
        per_step.clear()
        scales.clear()
        losses.clear()
        plugin = fp.FP8Precision(fp.DelayedScaling(), compute_dtype=torch.float32, calibration_steps=2,
                                 eval_in_fp8=eval_in_fp8)
        trainer = L.Trainer(plugins=[plugin], max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()])
        module = Module()
        with count_fp8_gemms() as gemms:
            trainer.fit(module, data)
        # Steps 1-2 train in high precision, as the plain model does, and calibrate: their 4 FP8
        # GEMMs are the measurements (2 layers, fprop per-tensor and blockwise). Steps 3-4 train
        # in FP8: 5 GEMMs each (the first layer's input needs no dgrad).
        assert per_step == [4, 4, 5, 5]
        assert losses[:2] == _plain_losses(BATCHES[:2])
        report = plugin.fp8.calibration
        assert report is not None and report.batches == 2 and {r.name for r in report.layers} == {"net.0", "net.2"}
        assert torch.equal(scales[1], _expected_input_scale(BATCHES[:2]))
        with count_fp8_gemms() as eval_gemms:
            trainer.validate(module, DataLoader(TensorDataset(BATCHES[0]), batch_size=8), verbose=False)
        assert (eval_gemms.count > 0) == eval_in_fp8


def test_fabric_calibration_steps_and_evaluation_precision():
    from lightning.fabric import Fabric

    plugin = fp.fabric.FP8Precision(fp.DelayedScaling(), compute_dtype=torch.float32, calibration_steps=1,
                                    eval_in_fp8=False)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    counts, scales = [], []
    for batch in BATCHES[:3]:
        with count_fp8_gemms() as gemms:
            fabric.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        counts.append(gemms.count)
        scales.append(plugin.fp8.module[0].fp8_state.scale[INPUT].clone())
    # Step 1 calibrates in high precision (its 4 FP8 GEMMs: the fprop measurements); step 2's
    # FP8 casts start from its batch's scale.
    assert counts == [4, 5, 5]
    assert plugin.fp8.calibration.batches == 1
    assert torch.equal(scales[0], _expected_input_scale(BATCHES[:1]))
    assert bool(plugin.fp8.module[0].fp8_state.initialized[INPUT])
    with torch.no_grad(), count_fp8_gemms() as gemms:
        model(BATCHES[0])
    assert gemms.count == 0


def test_calibration_steps_calibrate_grad_output_from_their_backwards():
    # The plain model's steps, with the gradients of both layers' outputs taken by autograd at
    # the output tensors themselves: the last layer's is 2 y / numel (loss = mean(y^2)).
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    grad_amax = {0: 0.0, 2: 0.0}
    for batch in BATCHES[:2]:
        h = net[0](batch)
        y = net[2](net[1](h))
        loss = y.square().mean()
        g_h, g_y = torch.autograd.grad(loss, (h, y), retain_graph=True)
        assert torch.allclose(g_y, 2 * y / y.numel())
        grad_amax[0] = max(grad_amax[0], float(g_h.abs().max()))
        grad_amax[2] = max(grad_amax[2], float(g_y.abs().max()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    from lightning.fabric import Fabric

    plugin = fp.fabric.FP8Precision(fp.DelayedScaling(), compute_dtype=torch.float32, calibration_steps=2)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _net()
    model, fabric_optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for batch in BATCHES[:2]:
        fabric.backward(model(batch).square().mean())
        fabric_optimizer.step()
        fabric_optimizer.zero_grad()
    report = {layer.name: layer for layer in plugin.fp8.calibration.layers}
    for index in (0, 2):
        state = plugin.fp8.module[index].fp8_state
        # HYBRID: grad_output in E5M2, scale = E5M2_MAX / amax (margin 0, the max of the history).
        want = torch.tensor(E5M2_MAX, dtype=torch.float32) / torch.tensor(grad_amax[index], dtype=torch.float32)
        assert torch.equal(state.scale[GRAD_OUTPUT], want), index
        assert bool(state.initialized[GRAD_OUTPUT])
        assert report[f"{index}"].grad_output_amax == pytest.approx(grad_amax[index], rel=0, abs=0)


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_calibration_steps():
    accelerator = fp.accelerate.Accelerator(mixed_precision="fp8", fp8_recipe=fp.DelayedScaling(),
                                            fp8_compute_dtype="fp32", fp8_calibration_steps=1, cpu=True)
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    layer = accelerator.unwrap_model(model)[0]
    counts, scales = [], []
    for batch in BATCHES[:3]:
        with count_fp8_gemms() as gemms:
            accelerator.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        counts.append(gemms.count)
        scales.append(layer.fp8_state.scale[INPUT].clone())
    assert counts == [4, 5, 5]
    assert accelerator.fp8_runs[0].calibration.batches == 1
    assert torch.equal(scales[0], _expected_input_scale(BATCHES[:1]))


@pytest.mark.usefixtures("fresh_accelerate")
def test_fp8_trainer_calibration_steps(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from fp8_plugin.hf_trainer import FP8Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = FP8Trainer(model=model, args=args, train_dataset=data, fp8_recipe="fp8-delayed", fp8_calibration_steps=1)
    with count_fp8_gemms() as gemms:
        trainer.train()
    # 8 Conv1D layers: step 1 measures each fprop per-tensor and blockwise (16 GEMMs, forward
    # only), step 2 trains in FP8 (forward, dgrad and wgrad: 24).
    assert gemms.count == 8 * 2 + 8 * 3
    report = trainer.accelerator.fp8_runs[0].calibration
    assert report.batches == 1 and len(report.layers) == 8


def test_calibration_step_settings_are_checked_when_built():
    with pytest.raises(ValueError, match=r"FP8Precision\(calibration_steps=-1\) is invalid; valid: an int >= 0"):
        fp.FP8Precision(calibration_steps=-1)
    with pytest.raises(ValueError, match=r"FP8Precision\(eval_in_fp8='no'\) is invalid; valid: True"):
        fp.fabric.FP8Precision(eval_in_fp8="no")


def test_the_loops_conversion_report_shows_the_scaling_the_calibration_steps_chose():
    # Two layers, one fed a massive activation (one token, one channel): after the calibration
    # step the core's conversion report names the blockwise choice and the SQNR behind it.
    from calibration_worker import TwoBranches

    from fp8_plugin.training.core import FP8Training

    torch.manual_seed(0)
    model = TwoBranches()
    run = FP8Training(fp.DelayedScaling(), compute_dtype=torch.float32, calibration_steps=1)
    run.convert(model)
    # Converted before any step: every decision on the recipe.
    assert {d.name: d.scaling for d in run.report.swapped} == {"outliers": "recipe", "plain": "recipe"}
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    x[3, 7] = 2.0**15
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with run.forward_context("cpu"):
        a, b = model(x, y)
    (a.square().mean() + b.square().mean()).backward()
    optimizer.step()
    run.after_optimizer_step()
    rows = {r.name: r for r in run.calibration.layers}
    assert rows["outliers"].choice == "blockwise" and rows["plain"].choice == "recipe"
    decisions = {d.name: d for d in run.report.swapped}
    assert (decisions["outliers"].scaling, decisions["plain"].scaling) == ("blockwise", "recipe")
    assert f"calibration chose blockwise: {rows['outliers'].reason}" in str(run.report)
