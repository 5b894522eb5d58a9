"""A check's FP8 side taken from the training pass itself (training/reference/training_pass.py):
the same figures as replaying it, one FP8 forward and backward fewer, and the replay wherever the
training pass is not that computation. Real Lightning Trainers, Fabric and Accelerators, CPU.

The expectation is the replay: a check that replays its FP8 side (``training_pass=False``, or a
set-up the training pass does not serve) reruns the training forward bit for bit (the tests of
test_reference_check.py), so both must give every figure identically. The FP8 replay is seen in
the FP8 layer forwards counted over the run: each training step runs one per FP8 layer, and a
replayed FP8 side as many again (the figures' FP8 GEMMs are not layer forwards).
"""

import dataclasses

import lightning as L
import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.modules.autocast import fp8_forward_count
from fp8_plugin.training.reference import ReferenceCheck
from test_reference_check import Net, _batch, _loader, _trainer, LitNet

FP8_LAYERS = 2  # Net's up and down; its head stays in high precision
STEPS = 4

# Every figure of a check; seconds and the verdict text are not figures.
FIGURES = ("loss_fp8", "loss_reference", "loss_rel_diff", "grad_cosine", "grad_rel_error", "param_figures",
           "layer_sqnr_db", "gemm_sqnr_db")


def _figures(results):
    return [{name: getattr(r, name) for name in FIGURES} for r in results]


def _lightning(training_pass: bool, accumulate: int = 1):
    torch.manual_seed(3)
    module = LitNet()
    plugin = FP8Precision(fp.DelayedScaling(), exclude=["*head"],
                          reference_check=ReferenceCheck(every=1, policy="log", training_pass=training_pass))
    before = fp8_forward_count()
    _trainer(plugin, accumulate_grad_batches=accumulate, max_steps=STEPS).fit(module, _loader(STEPS * accumulate))
    return plugin.fp8.reference.results, fp8_forward_count() - before, module


def test_lightning_checks_take_the_training_pass_with_the_figures_of_a_replay():
    taken, forwards, trained = _lightning(training_pass=True)
    replayed, replay_forwards, trained_replayed = _lightning(training_pass=False)
    assert len(taken) == STEPS
    assert _figures(taken) == _figures(replayed)
    assert forwards == STEPS * FP8_LAYERS  # training's forwards alone: no FP8 replay
    assert replay_forwards == 2 * STEPS * FP8_LAYERS
    for (name, a), b in zip(trained.named_parameters(), trained_replayed.parameters()):
        assert torch.equal(a, b), name  # neither way of checking changes the run


def test_lightning_with_accumulation_replays_the_last_micro_batch():
    # Two forwards per step: .grad holds both micro-batches, not the checked one's alone.
    results, forwards, _ = _lightning(training_pass=True, accumulate=2)
    assert len(results) == STEPS
    assert forwards == STEPS * 2 * FP8_LAYERS + STEPS * FP8_LAYERS


def _fabric(training_pass: bool):
    from fp8_plugin.fabric import FP8Precision as FabricFP8Precision

    plugin = FabricFP8Precision(fp.DelayedScaling(), exclude=["head"],
                                reference_check=ReferenceCheck(every=1, policy="log", training_pass=training_pass))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(*_model_and_optimizer())
    before, losses = fp8_forward_count(), []
    for step in range(STEPS):
        loss = model(*_batch(seed=step))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return plugin.fp8.reference.results, fp8_forward_count() - before, losses


def _model_and_optimizer():
    torch.manual_seed(4)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), 1e-3)


def test_fabric_checks_take_the_training_pass_with_the_figures_of_a_replay():
    taken, forwards, losses = _fabric(training_pass=True)
    replayed, replay_forwards, _ = _fabric(training_pass=False)
    assert _figures(taken) == _figures(replayed)
    assert [r.loss_fp8 for r in taken] == pytest.approx(losses, rel=0, abs=0)  # the training loss itself
    assert forwards == STEPS * FP8_LAYERS
    assert replay_forwards == 2 * STEPS * FP8_LAYERS


class _LossModel(nn.Module):
    """Net's loss as a transformers model returns it: ``output.loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.net = Net()

    def forward(self, x, y):
        return {"loss": self.net(x, y)}


def _accelerate(check: ReferenceCheck, backward=lambda loss: loss, zero_grad=True, accumulate=1):
    from accelerate.state import AcceleratorState, GradientState
    from fp8_plugin.accelerate import Accelerator

    AcceleratorState._reset_state(True)  # each run its own Accelerator settings, as in a new process
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.bfloat16, fp8_reference_check=check,
                              gradient_accumulation_steps=accumulate, fp8_exclude=["*head"])
    model = accelerator.prepare(_LossModel())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), 1e-3))
    model.train()
    before, losses = fp8_forward_count(), []
    for step in range(STEPS * accumulate):
        with accelerator.accumulate(model):
            loss = model(*_batch(seed=step))["loss"]
            accelerator.backward(backward(loss))
            if not accelerator.sync_gradients:  # an accumulating micro-batch: no gradient copy taken
                assert accelerator.fp8_runs[0].reference.training_pass.taken is None
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.fp8_runs[0].reference.results, fp8_forward_count() - before, losses


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_checks_take_the_training_pass_only_where_it_is_the_replayed_computation():
    check = ReferenceCheck(every=1, policy="log")
    taken, forwards, losses = _accelerate(check)
    replayed, replay_forwards, _ = _accelerate(dataclasses.replace(check, training_pass=False))
    assert _figures(taken) == _figures(replayed)
    assert [r.loss_fp8 for r in taken] == losses
    assert forwards == STEPS * FP8_LAYERS and replay_forwards == 2 * STEPS * FP8_LAYERS
    # A backward of another tensor than the forward's loss (here the same values, but the check
    # cannot know): the replay.
    other, other_forwards, _ = _accelerate(check, backward=lambda loss: loss * 1.0)
    assert _figures(other) == _figures(replayed) and other_forwards == replay_forwards


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_replays_where_grad_holds_more_than_the_checked_micro_batch():
    check = ReferenceCheck(every=1, policy="log")
    # .grad never emptied: from the second step on it holds earlier steps' gradients too.
    _, forwards, _ = _accelerate(check, zero_grad=False)
    assert forwards == STEPS * FP8_LAYERS + (STEPS - 1) * FP8_LAYERS
    # Two micro-batches per step: the check replays the last one.
    _, forwards, _ = _accelerate(check, accumulate=2)
    assert forwards == STEPS * 2 * FP8_LAYERS + STEPS * FP8_LAYERS


def test_the_setting_is_checked():
    with pytest.raises(TypeError, match=r"ReferenceCheck\(training_pass='yes'\) must be a bool"):
        ReferenceCheck(training_pass="yes")
