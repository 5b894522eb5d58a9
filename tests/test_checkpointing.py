"""Activation checkpointing: a recomputed forward runs as the original FP8 forward did."""

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8CurrentScaling
from reference import count_fp8_gemms


class Blocks(nn.Module):
    def __init__(self, checkpoint: str = "none"):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
                                    for _ in range(2))
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint == "none":
                x = x + block(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return x


def _step(model, x, recipe):
    with fp.autocast(recipe=recipe):
        loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointed_steps_equal_the_same_fp8_steps_without_checkpointing(mode, recipe):
    torch.manual_seed(0)
    plain = Blocks()
    fp.convert_model(plain, recipe)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint = mode
    # Requires grad: a reentrant checkpoint gives no parameter gradients otherwise.
    x = torch.randn(4, 16, 32, requires_grad=True)
    for step in range(3):
        losses, grads = [], []
        for model in (plain, ckpt):
            torch.manual_seed(step)  # same dropout masks in both runs
            with count_fp8_gemms() as gemms:
                losses.append(_step(model, x * (step + 1), recipe))
            # 4 layers: forward, dgrad and wgrad each, plus the 4 recomputed forwards.
            assert gemms.count == (12 if model is plain else 16), (mode, gemms.count)
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        assert torch.equal(losses[0], losses[1])
        for a, b in zip(*grads):
            assert torch.equal(a, b)
        for (name, a), b in zip(fp.modules.convert.fp8_state_dict(plain).items(), fp.modules.convert.fp8_state_dict(ckpt).values()):
            for key in a:
                assert torch.equal(a[key], b[key]), (name, key)


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.mark.parametrize("use_reentrant", [None, True, False], ids=["default", "reentrant", "non-reentrant"])
def test_transformers_gradient_checkpointing_matches_the_run_without(use_reentrant):
    torch.manual_seed(0)
    plain = _llama()
    fp.convert_model(plain, DelayedScaling(amax_history_len=4))
    ckpt = copy.deepcopy(plain)
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    plain.train(), ckpt.train()
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        grads = []
        for model in (plain, ckpt):
            with count_fp8_gemms() as gemms:
                with fp.autocast():
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            assert gemms.count >= 3 * 14  # 14 FP8 layers: forward, dgrad, wgrad at least
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        for name in grads[0]:
            assert torch.equal(grads[0][name], grads[1][name]), name
