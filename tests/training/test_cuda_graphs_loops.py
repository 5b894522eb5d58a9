"""The loops' ``cuda_graphs`` switch (training/graphing.py): blocks recorded in the first step,
captured after it, replayed from the second on; Lightning's FP8Precision and Accelerate's FP8Kwargs.

Without a GPU the capture is the CPU stand-in of tests/modules/test_cuda_graphs.py (torch's capture as
the FP8 code sees it); the real one runs in the contract suite on a GPU.
"""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import fp8_plugin as fp
from fp8_plugin.lightning import FP8Precision
from fp8_plugin.modules import cuda_graphs
from fp8_plugin.training import graphing
from reference import count_fp8_gemms
from test_cuda_graphs import emulated_capture


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, hidden, attention_mask=None, position_embeddings=None):
        cos, sin = position_embeddings
        return hidden + self.down(torch.nn.functional.gelu(self.up(hidden * cos + sin)))


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.rope = (torch.linspace(0.5, 1.5, 32), torch.linspace(-0.1, 0.1, 32))
        self.outputs = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x, attention_mask=None, position_embeddings=self.rope)
        return x

    def training_step(self, batch, batch_idx):
        out = self(batch)
        self.outputs.append(out.detach().clone())
        return out.float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, steps=4, **precision):
    data = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(steps * 2)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[FP8Precision(fp.DelayedScaling(amax_history_len=4), compute_dtype=torch.float32,
                                              **precision)])
    trainer.fit(module, DataLoader(data, batch_size=None))
    return module


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_capture", emulated_capture)
    monkeypatch.setattr(cuda_graphs, "_check_cuda", lambda devices: None)
    monkeypatch.setattr(graphing, "_require_cuda", lambda device, owner: None)


def test_lightning_graphs_the_named_blocks_after_the_first_step_and_trains_as_eager(emulated):
    with count_fp8_gemms() as gemms:
        eager = fit(Tiny())
    with count_fp8_gemms() as graphed_gemms:
        graphed = fit(Tiny(), cuda_graphs="blocks.*")
    # 4 steps x 2 micro-batches x (2 blocks x 2 layers x (fprop, dgrad, wgrad), less the first
    # layer's dgrad: the batch needs no gradient); the graphed run also warms up and captures.
    assert gemms.count == 4 * 2 * 11 and graphed_gemms.count >= gemms.count
    assert all(isinstance(b.forward, cuda_graphs._GraphedFP8) for b in graphed.blocks)
    assert len(eager.outputs) == len(graphed.outputs) == 8
    for a, b in zip(eager.outputs, graphed.outputs):
        assert torch.equal(a, b)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name
    for block, twin in zip(eager.blocks, graphed.blocks):
        for name, t in block.up.fp8_state.tensors().items():
            assert torch.equal(t, twin.up.fp8_state.tensors()[name]), name


def test_a_batch_of_another_shape_after_the_capture_is_refused_by_name(emulated):
    class Shrinking(Tiny):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch[: 8 - 2 * (batch_idx >= 2)], batch_idx)  # a short batch at step 2

    with pytest.raises(ValueError, match=r"argument #0 is \[6, 32\] .* but the graph was captured for \[8, 32\]"):
        fit(Shrinking(), cuda_graphs="blocks.*")


def test_without_a_gpu_the_switch_stops_the_first_step():
    with pytest.raises(RuntimeError, match=r"CUDA graphs run on a CUDA GPU; the model is on cpu"):
        fit(Tiny(), steps=1, cuda_graphs="blocks.*")


@pytest.mark.parametrize("value, error, message", [
    (3, TypeError, r"cuda_graphs=3\) is not valid; valid: None, or module-name glob patterns"),
    ("", ValueError, r"holds an empty pattern"),
])
def test_a_wrong_setting_is_refused_when_the_plugin_is_built(value, error, message):
    with pytest.raises(error, match=message):
        FP8Precision(cuda_graphs=value)


def test_a_pattern_that_names_no_module_is_refused_at_conversion():
    with pytest.raises(ValueError, match=r"cuda_graphs=\['layers.\*'\]\) matches no module of the model; its modules "
                                         r"are named like blocks, blocks.0"):
        fit(Tiny(), steps=1, cuda_graphs="layers.*")


def accelerate_run(**fp8):
    from accelerate.state import AcceleratorState, GradientState

    from fp8_plugin.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp8", cpu=True, fp8_recipe=fp.DelayedScaling(amax_history_len=4),
                              fp8_compute_dtype=torch.float32, **fp8)
    try:
        model = Tiny()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        outputs = []
        for i in range(4):
            out = model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i)))
            outputs.append(out.detach().clone())
            accelerator.backward(out.float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
        return accelerator.unwrap_model(model), outputs
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_accelerate_graphs_the_named_blocks_and_trains_as_eager(emulated):
    with count_fp8_gemms() as gemms:
        eager, eager_outputs = accelerate_run()
    with count_fp8_gemms() as graphed_gemms:
        graphed, graphed_outputs = accelerate_run(fp8_cuda_graphs=["blocks.*"])
    assert gemms.count == 4 * 11 and graphed_gemms.count >= gemms.count  # 4 steps, as in the Lightning test
    assert all(isinstance(b.forward, cuda_graphs._GraphedFP8) for b in graphed.blocks)
    for a, b in zip(eager_outputs, graphed_outputs):
        assert torch.equal(a, b)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name


def test_accelerate_refuses_a_wrong_setting_when_built():
    from fp8_plugin.accelerate import Accelerator

    with pytest.raises(TypeError, match=r"Accelerator\(fp8_cuda_graphs=7\) is not valid"):
        Accelerator(mixed_precision="fp8", cpu=True, fp8_cuda_graphs=7)
