"""FP8Trainer: a real transformers Trainer fine-tunes a tiny GPT-2 (Conv1D layers) in FP8."""


import pytest
import torch

import fp8_plugin as fp
from fp8_plugin.hf_trainer import FP8Trainer
from fp8_plugin.modules.linear import FP8Linear
from reference import count_fp8_gemms


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def test_fp8_trainer_fine_tunes_in_fp8_and_saves_a_vanilla_checkpoint(tmp_path):
    from transformers import GPT2LMHeadModel, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = FP8Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32), eval_dataset=Tokens(8),
                         fp8_recipe="fp8-delayed")
    assert isinstance(trainer.accelerator, fp.accelerate.Accelerator)
    assert trainer.accelerator.fp8_settings.compute_dtype == torch.float32  # neither bf16 nor fp16 asked for
    with count_fp8_gemms() as gemms:
        result = trainer.train()
    layers = [m for m in trainer.model.modules() if isinstance(m, FP8Linear)]
    # GPT-2's Conv1D layers: 4 per block (c_attn, c_proj, c_fc, mlp c_proj); the LM head stays high precision.
    assert len(layers) == 8
    # 4 optimizer steps x 2 micro-batches x 3 GEMMs (forward, dgrad, wgrad) per FP8 layer.
    assert gemms.count == 4 * 2 * 3 * len(layers)
    assert all(m.recipe == fp.DelayedScaling() for m in layers)
    assert result.training_loss > 0
    with count_fp8_gemms() as eval_gemms:
        metrics = trainer.evaluate()
    assert eval_gemms.count == 0 and metrics["eval_loss"] > 0  # evaluation in high precision

    trainer.save_model(str(tmp_path / "saved"))
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert not any(isinstance(m, FP8Linear) for m in plain.modules())
    assert set(plain.state_dict()) == set(tiny_gpt2().state_dict())


def test_fp8_trainer_settings_errors_come_at_construction(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="fp8-nope"):
        FP8Trainer(model=tiny_gpt2(), args=args, fp8_recipe="fp8-nope")


def test_transformers_still_builds_the_trainer_accelerator_from_the_patched_name():
    # fp8_plugin/_private/transformers_api.py relies on this; a transformers release that changes it fails here.
    import accelerate
    import transformers.trainer

    assert transformers.trainer.Accelerator is accelerate.Accelerator
    import inspect

    assert "Accelerator(**args)" in inspect.getsource(transformers.trainer.Trainer.create_accelerator_and_postprocess)


def test_fp8_trainer_logs_reference_figures_at_their_steps_and_prints_the_summary(tmp_path, capsys):
    import json

    from transformers import TrainerCallback, TrainingArguments

    class Seen(TrainerCallback):  # what the report_to integrations receive: on_log
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append((state.global_step, dict(logs)))

    seen = Seen()
    report = tmp_path / "fp8_ref.json"
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=3, disable_tqdm=True)
    trainer = FP8Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32), callbacks=[seen],
                         fp8_reference_every=2,
                         fp8_reference_check=fp.ReferenceCheck(every=2, policy="log", json_path=str(report)))
    capsys.readouterr()
    trainer.train()
    results = trainer.accelerator.fp8_runs[0].reference.results
    assert [r.step for r in results] == [1, 3]  # optimizer steps 2 and 4
    # Steps 2 and 4 are logged for their checks (logging_steps=3 logs step 3), each with its figures.
    training_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in training_logs] == [2, 3, 4]
    for entry, result in zip([training_logs[0], training_logs[2]], results):
        assert {k: v for k, v in entry.items() if k.startswith("fp8_ref/")} == result.metrics()
        assert "fp8_ref/grad_cosine" in entry and "fp8_ref/sqnr_db/transformer.h.0.mlp.c_fc" in entry
    assert not any(k.startswith("fp8_ref/") for k in training_logs[1])
    assert [(step, logs["fp8_ref/grad_cosine"]) for step, logs in seen.logs if "fp8_ref/grad_cosine" in logs] == [
        (2, results[0].grad_cosine), (4, results[1].grad_cosine)]
    out = capsys.readouterr().out
    assert trainer.accelerator.fp8_reference_summary() in out
    assert "FP8 reference checks: 2 run (every 2 steps, policy 'log'), 0 failed" in out
    assert f"written: {report}" in out and len(json.loads(report.read_text())["checks"]) == 2


def test_fp8_trainer_reference_settings_errors_come_at_construction(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="fp8_reference_every.*=-2 .*valid: an int >= 0"):
        FP8Trainer(model=tiny_gpt2(), args=args, fp8_reference_every=-2)


def test_fp8_trainer_checkpoints_carry_the_fp8_state_and_resume_exactly(tmp_path):
    # The Trainer's checkpoint holds a vanilla model: the FP8 state (scales, histories) travels in
    # fp8_state.pt beside it, so a resumed run continues with the scales it stopped with and ends
    # where the uninterrupted run ends, bit for bit.
    from transformers import TrainingArguments

    def trainer(run, max_steps):
        args = TrainingArguments(output_dir=str(tmp_path / run), max_steps=max_steps, per_device_train_batch_size=4,
                                 learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="steps",
                                 save_steps=3, logging_steps=1, disable_tqdm=True, seed=0)
        return FP8Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32),
                          fp8_recipe=fp.DelayedScaling(amax_history_len=4))

    full = trainer("full", 6)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "fp8_state.pt").is_file()
    saved = torch.load(checkpoint / "fp8_state.pt", weights_only=True)["fp8_state"][0]
    assert any(bool(v["initialized"].all()) for v in saved.values())  # real, settled scales

    resumed = trainer("full", 6)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    full_fp8, resumed_fp8 = fp.modules.convert.fp8_state_dict(full.model), fp.modules.convert.fp8_state_dict(resumed.model)
    for key, value in full_fp8.items():
        for entry, tensor in value.items():
            assert torch.equal(tensor, resumed_fp8[key][entry]), (key, entry)

    plain = trainer("plain", 6)
    (checkpoint / "fp8_state.pt").unlink()
    with pytest.warns(UserWarning, match="holds no fp8_state.pt: the FP8 scales start afresh"):
        plain.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_fp8_figures_reach_the_log_history_but_not_the_console_unless_asked(tmp_path, capsys, disable_tqdm):
    # The Trainer prints every log on the console (PrinterCallback, or ProgressCallback's bar):
    # the per-layer statistics of a 12-layer model are hundreds of keys per sampled step.
    from transformers import TrainingArguments

    printed = {}
    for print_figures in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / str(print_figures)), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                                 disable_tqdm=disable_tqdm)
        trainer = FP8Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(16), fp8_statistics=1,
                             fp8_print_figures=print_figures)
        capsys.readouterr()
        trainer.train()
        printed[print_figures] = capsys.readouterr()
        logged = [key for entry in trainer.state.log_history for key in entry if key.startswith("fp8_stats/")]
        assert logged, "the statistics must still reach log_history (and so the report_to integrations)"
    quiet, loud = (printed[False].out + printed[False].err), (printed[True].out + printed[True].err)
    assert "'loss'" in quiet and "fp8_stats/" not in quiet
    assert "fp8_stats/" in loud


def test_fp8_trainer_with_fp8_adamw_trains_the_converted_layers_and_resumes_exactly(tmp_path):
    # optimizers=(FP8AdamW(...), None) built on the model before FP8Trainer converts it: the
    # optimizer must update the parameters the FP8 layers compute with, and resume bit for bit.
    from transformers import TrainingArguments

    from fp8_plugin.optim import FP8AdamW

    def trainer(run, max_steps):
        model = tiny_gpt2()
        args = TrainingArguments(output_dir=str(tmp_path / run), max_steps=max_steps, per_device_train_batch_size=4,
                                 use_cpu=True, report_to=[], save_strategy="steps", save_steps=3, logging_steps=1,
                                 disable_tqdm=True, seed=0)
        return FP8Trainer(model=model, args=args, train_dataset=Tokens(32), fp8_recipe="fp8-delayed",
                          optimizers=(FP8AdamW(model.parameters(), lr=1e-3), None))

    full = trainer("full", 6)
    before = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    with count_fp8_gemms() as gemms:
        full.train()
    layers = [m for m in full.model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 8 and gemms.count == 6 * 3 * len(layers)
    optimizer = full.optimizer.optimizer if hasattr(full.optimizer, "optimizer") else full.optimizer
    assert isinstance(optimizer, FP8AdamW)
    for layer in layers:  # the FP8 layers' own weights moved, and their moments are E4M3
        assert optimizer.state[layer.weight]["exp_avg"].dtype == torch.float8_e4m3fn
    moved = [n for n, p in full.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    resumed = trainer("full", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
