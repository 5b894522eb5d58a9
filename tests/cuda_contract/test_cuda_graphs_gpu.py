"""fp8_plugin.make_graphed_callables on a GPU: graphed training is eager training, bit for bit.

Runs where torch sees a CUDA GPU (the GPU run's contract step); the CPU tests of the same module
(tests/test_cuda_graphs.py) cover what needs no capture.
"""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.autocast import new_step_id

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
    for (y1, g1), (y2, g2) in zip(train(eager, recipe), train(graphed, recipe)):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    for layer, twin in ((eager.up, graphed.up), (eager.down, graphed.down)):
        for name, t in layer.fp8_state.tensors().items():
            assert torch.equal(t, twin.fp8_state.tensors()[name]), name
