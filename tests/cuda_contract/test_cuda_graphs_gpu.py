"""fp8_plugin.make_graphed_callables on a GPU: graphed training is eager training, bit for bit.

Runs where torch sees a CUDA GPU (the GPU run's contract step); the CPU tests of the same module
(tests/modules/test_cuda_graphs.py) cover what needs no capture.
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.autocast import new_step_id
from reference import count_fp8_gemms

CONTRACT_DEVICES = ("meta", "cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a CUDA GPU")


class Block(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.up, self.down, self.checkpointed = nn.Linear(256, 512), nn.Linear(512, 256), checkpointed

    def mlp(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        if self.checkpointed:
            return x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


def train(model, recipe, steps=3, micro_batches=2):
    gen = torch.Generator(device="cuda").manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = []
    for _ in range(steps):
        step = new_step_id()
        for _ in range(micro_batches):
            x = torch.randn(128, 256, device="cuda", generator=gen).requires_grad_()
            with torch.autocast("cuda", torch.bfloat16, cache_enabled=False), fp.autocast(recipe=recipe, step=step):
                y = model(x)
            y.float().square().mean().backward()
            record.append((y.detach().clone(), x.grad.clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return record


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_graphed_training_equals_eager_bit_for_bit(recipe, checkpointed):
    torch.manual_seed(0)
    eager = Block(checkpointed).cuda()
    fp.convert_model(eager, recipe, skip_small=False)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(128, 256, device="cuda").requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        fp.make_graphed_callables(graphed, (sample,), fp8_recipe=recipe)
    with count_fp8_gemms() as gemms:
        eager_run = train(eager, recipe)
    # 3 steps x 2 micro-batches x 2 layers x 3 GEMMs (fprop, dgrad, wgrad; checkpointing runs the
    # fprop again in the backward): FP8 ran.
    assert gemms.count == 3 * 2 * 2 * (4 if checkpointed else 3)
    for (y1, g1), (y2, g2) in zip(eager_run, train(graphed, recipe)):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    for layer, twin in ((eager.up, graphed.up), (eager.down, graphed.down)):
        for name, t in layer.fp8_state.tensors().items():
            assert torch.equal(t, twin.fp8_state.tensors()[name]), name


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_reduce_overhead_compiles_and_trains_an_fp8_block(recipe):
    # torch.compile's own CUDA graphs (cudagraph trees): the compiled FP8 block trains, and its
    # FP8 state follows the steps (update_pending_scales after each optimizer step, as the
    # integrations call it): the first layer's input and weight amaxes of the first step are the
    # eager block's exactly (a max of absolute values of the same tensors).
    torch.manual_seed(0)
    eager = Block().cuda()
    fp.convert_model(eager, recipe, skip_small=False)
    compiled_block = copy.deepcopy(eager)
    compiled = torch.compile(compiled_block, mode="reduce-overhead")
    opt = torch.optim.AdamW(compiled_block.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(4):
        x = torch.randn(128, 256, device="cuda", generator=gen).requires_grad_()
        with torch.autocast("cuda", torch.bfloat16), fp.autocast(recipe=recipe):
            y = compiled(x)
            if step == 0:
                y_eager = eager(x.detach())
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp.update_pending_scales(compiled_block)
        losses.append(loss.item())
        if step == 0:
            assert y.shape == y_eager.shape
            # (after the scale update, the delayed history has moved the step's amaxes to column 1)
            assert torch.equal(compiled_block.up.fp8_state.amax_history[:2, 1 if recipe.delayed() else 0],
                               eager.up.fp8_state.amax_history[:2, 0])
    assert all(torch.isfinite(torch.tensor(losses)))
    if recipe.delayed():
        assert compiled_block.up.fp8_state.initialized.all()
