"""PEFT LoRA over frozen FP8-only base weights in every loop: Lightning's Trainer, Fabric,
Accelerate and FP8Trainer (its peft_config). Each run counts the FP8 GEMMs (fprop and dgrad of
each frozen layer, no wgrad), and checks that the base's FP8 bytes did not move, the adapters
trained, and no high-precision copy of a frozen weight is left in the optimizer."""

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model

import fp8_plugin as fp
from fp8_plugin import FP8Linear
from reference import count_fp8_gemms
from test_frozen_fp8 import llama

LORA = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
IDS = torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(1))
# Per step, one micro-batch: 7 frozen FP8 layers' fprops, and the dgrads of the 4 whose input
# requires grad (not q, k, v: the normed embeddings before them are frozen). No wgrad.
GEMMS_PER_STEP = 7 + 4


def frozen_bytes(model):
    return {n: m.weight.view(torch.uint8).clone() for n, m in model.named_modules()
            if isinstance(m, FP8Linear) and m.frozen_layout is not None}


def scales(model):
    return {n: m.weight_scale_inv for n, m in model.named_modules()
            if isinstance(m, FP8Linear) and m.frozen_layout is not None}


def check_run(model, before, gemms, steps, optimizer=None):
    after = frozen_bytes(model)
    assert len(after) == 7 and gemms.count == steps * GEMMS_PER_STEP
    assert all(torch.equal(before[n], after[n]) for n in before) if before else True
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    if optimizer is not None:  # no high-precision copy of a frozen weight held by the optimizer
        shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, FP8Linear)}
        held = [p for g in optimizer.param_groups for p in g["params"]]
        assert not [p for p in held if p.dtype == torch.float32 and not p.requires_grad and tuple(p.shape) in shapes]
        assert any(p.requires_grad for p in held)


class LoraModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = get_peft_model(llama(), LORA)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_trainer_lora_over_frozen_fp8_base():
    module = LoraModule()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS), batch_size=4)
    with count_fp8_gemms() as gemms:
        trainer.fit(module, loader)
    check_run(module.model, None, gemms, 2, trainer.optimizers[0])


def test_fabric_lora_over_frozen_fp8_base():
    fabric = L.Fabric(precision="fp8-hybrid", accelerator="cpu", devices=1)
    model = get_peft_model(llama(), LORA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen weights included, as users write it
    model, optimizer = fabric.setup(model, optimizer)
    before = frozen_bytes(model)
    with count_fp8_gemms() as gemms:
        for i in range(2):
            loss = model(input_ids=IDS[4 * i:4 * i + 4], labels=IDS[4 * i:4 * i + 4]).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    check_run(model, before, gemms, 2, optimizer.optimizer)


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_lora_over_frozen_fp8_base():
    from fp8_plugin.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp8", cpu=True)
    model = get_peft_model(llama(), LORA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = frozen_bytes(model)
    with count_fp8_gemms() as gemms:
        for i in range(2):
            with accelerator.autocast():
                loss = model(input_ids=IDS[4 * i:4 * i + 4], labels=IDS[4 * i:4 * i + 4]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    check_run(model, before, gemms, 2, optimizer.optimizer)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": IDS[i]}


@pytest.mark.usefixtures("fresh_accelerate")
def test_fp8_trainer_peft_config_over_frozen_fp8_base(tmp_path):
    from transformers import TrainingArguments

    from fp8_plugin.hf_trainer import FP8Trainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True)
    trainer = FP8Trainer(model=llama(), args=args, train_dataset=Tokens(), peft_config=LORA)
    with count_fp8_gemms() as gemms:
        trainer.train()
    check_run(trainer.model, None, gemms, 2, trainer.optimizer.optimizer)
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_lightning_lora_over_frozen_fp8_base_resumes_exactly(tmp_path):
    # Checkpoints keep the model's state_dict vanilla (frozen weights dequantized) and carry the
    # FP8 bytes and scales under the plugin's key: resumed from step 2, the run ends on the same
    # adapters, frozen bytes, scales and optimizer state as the uninterrupted one, bit for bit.
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(folder, ckpt_path=None):
        module = LoraModule()
        saver = ModelCheckpoint(dirpath=tmp_path / folder, save_top_k=-1, every_n_train_steps=1, filename="{step}")
        trainer = L.Trainer(precision="fp8-hybrid", max_steps=4, accelerator="cpu", logger=False, callbacks=[saver],
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS), batch_size=4),
                    ckpt_path=ckpt_path)
        return module, trainer

    straight, _ = fit("full")
    resumed, _ = fit("resumed", tmp_path / "full" / "step=2.ckpt")
    saved = torch.load(tmp_path / "full" / "step=2.ckpt", weights_only=False)["state_dict"]
    assert not any(k.endswith("weight_scale_inv") for k in saved)  # vanilla: weights dequantized
    for want, got in ((straight.model.state_dict(), resumed.model.state_dict()),
                      (frozen_bytes(straight.model), frozen_bytes(resumed.model)),
                      (scales(straight.model), scales(resumed.model)),
                      (fp.modules.convert.fp8_state_dict(straight), fp.modules.convert.fp8_state_dict(resumed))):
        assert want.keys() == got.keys() and want
        for key in want:
            a, b = want[key], got[key]
            if isinstance(a, dict):  # a layer's scaling state
                assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)), key
            else:
                assert torch.equal(a, b), key
    assert len(frozen_bytes(resumed.model)) == 7


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_lora_over_frozen_fp8_base_resumes_exactly_from_save_state(tmp_path):
    # save_state writes the model's vanilla state_dict (frozen weights dequantized) and the FP8
    # state with the frozen bytes and scales; load_state into a model whose frozen weights were
    # cast from other values (another seed) restores them exactly, and the run ends as the
    # uninterrupted one, bit for bit.
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    from fp8_plugin.accelerate import Accelerator

    def fresh(seed):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(mixed_precision="fp8", cpu=True)
        torch.manual_seed(seed)
        base = llama()
        if seed:  # other base weights: only load_state can make them the run's again
            with torch.no_grad():
                for p in base.parameters():
                    p.mul_(1.5)
        set_seed(0)
        model = get_peft_model(base, LORA)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return (accelerator, *accelerator.prepare(model, optimizer))

    def run(accelerator, model, optimizer, steps):
        for i in steps:
            loss = model(input_ids=IDS[2 * i:2 * i + 2], labels=IDS[2 * i:2 * i + 2]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    acc, model, opt = fresh(0)
    run(acc, model, opt, range(4))
    want = (model.state_dict(), frozen_bytes(model), scales(model))
    acc, model, opt = fresh(0)
    run(acc, model, opt, range(2))
    acc.save_state(str(tmp_path / "ckpt"))
    acc, model, opt = fresh(1)
    acc.load_state(str(tmp_path / "ckpt"))
    run(acc, model, opt, range(2, 4))
    got = (model.state_dict(), frozen_bytes(model), scales(model))
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
