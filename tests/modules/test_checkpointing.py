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


def _fit_accumulating(tmp_path, max_steps, ckpt_path=None, callbacks=()):
    import lightning as L
    from test_lightning import TinyClassifier, loader

    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = L.Trainer(
        precision="fp8-hybrid", max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", devices=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        default_root_dir=tmp_path, enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, loader(n=64), ckpt_path=ckpt_path)  # 2 optimizer steps an epoch
    return model


def test_a_checkpoint_saved_between_accumulated_micro_batches_changes_no_scale(tmp_path):
    # Resumed from step 2 (the end of epoch 0), Lightning's ModelCheckpoint(every_n_train_steps=1)
    # saves again at the first micro-batch (global_step is still 2, and the resumed callback has saved no step yet):
    # in the middle of an accumulated step. That save must leave the step's pending amaxes
    # pending, so that the resumed run casts its second micro-batch with the scales the
    # uninterrupted run used, and ends on the same weights and FP8 state bit for bit.
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp8_plugin.modules.convert import fp8_state_dict

    def checkpoints(folder):
        return ModelCheckpoint(dirpath=tmp_path / folder, save_top_k=-1, every_n_train_steps=1, filename="{step}")

    full = _fit_accumulating(tmp_path, 4, callbacks=[checkpoints("full")])
    resumed = _fit_accumulating(tmp_path, 4, ckpt_path=tmp_path / "full" / "step=2.ckpt",
                                callbacks=[checkpoints("resumed")])
    # The save in the middle of the resumed run's first accumulated step did happen.
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["step=2.ckpt", "step=3.ckpt", "step=4.ckpt"]
    for key, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    full_fp8, resumed_fp8 = fp8_state_dict(full), fp8_state_dict(resumed)
    for key in full_fp8:
        for name in full_fp8[key]:
            assert torch.equal(full_fp8[key][name], resumed_fp8[key][name]), (key, name)
