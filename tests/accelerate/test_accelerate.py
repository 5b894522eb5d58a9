"""fp8_plugin.accelerate.Accelerator with real Accelerate: one process in this process, a config
file through ``accelerate launch``, two processes under torchrun (gloo), save/load state."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker
from accelerate.utils import TERecipeKwargs, set_seed
from torch import nn

import fp8_plugin as fp
from fp8_plugin.accelerate import Accelerator, FP8Kwargs
from fp8_plugin.modules.linear import FP8Linear
from reference import count_fp8_gemms

WORKER = Path(__file__).with_name("accelerate_worker.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
TIMEOUT_S = 240


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g) * 3, torch.randn(16, 16, generator=g)) for _ in range(n)]


def train(accelerator, model, optimizer, data) -> list[float]:
    losses = []
    for x, y in data:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerator_trains_every_linear_layer_in_fp8_one_process():
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    master = [p for p in model.parameters()]
    model, optimizer = accelerator.prepare(model, optimizer)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 3
    assert [p for p in model.parameters()] == master and all(p.dtype == torch.float32 for p in master)
    with count_fp8_gemms() as gemms:
        losses = train(accelerator, model, optimizer, batches(1) * 30)  # one batch, learnt
    # Forward + wgrad for the first layer (its input needs no grad), + dgrad for the two others.
    assert gemms.count == 30 * (2 + 3 + 3)
    assert set(gemms.dtypes) == {torch.float8_e4m3fn, torch.float8_e5m2}
    assert accelerator.fp8_metrics()["fp8/layers"] == 3.0
    # Same steps in float32 with plain Accelerate: FP8 is within a few E4M3 steps of it.
    AcceleratorState._reset_state(True)
    from accelerate import Accelerator as PlainAccelerator

    plain = PlainAccelerator(mixed_precision="no")
    ref_model = make_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref_model, ref_opt = plain.prepare(ref_model, ref_opt)
    ref_losses = train(plain, ref_model, ref_opt, batches(1) * 30)
    assert losses[-1] < 0.1 * losses[0]
    # Each FP8 GEMM rounds both operands (E4M3 relative step 2**-3, half of it per rounding), so
    # its product errs by at most ~2**-3 relative to the operands' magnitudes; the two loss
    # curves stay within that fraction of the loss's own scale at every step.
    assert all(abs(a - b) <= 2**-3 * ref_losses[0] for a, b in zip(losses, ref_losses))


def test_eval_runs_high_precision_unless_use_autocast_during_eval():
    for in_eval, expected in ((None, 0), (True, 3)):
        AcceleratorState._reset_state(True)
        handler = FP8Kwargs(use_autocast_during_eval=in_eval, compute_dtype="fp32")
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
        model = accelerator.prepare(make_model())
        model.eval()
        with torch.no_grad(), count_fp8_gemms() as gemms:
            model(torch.randn(4, 32))
        assert gemms.count == expected


def test_two_models_and_two_optimizers_in_one_prepare_any_order():
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    a, b = make_model(), make_model()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    opt_b, a, opt_a, b = accelerator.prepare(opt_b, a, opt_a, b)
    assert len(accelerator.fp8_runs) == 2
    x, y = batches(1)[0]
    with count_fp8_gemms() as gemms:
        loss = nn.functional.mse_loss(a(x), y) + nn.functional.mse_loss(b(x), y)
        accelerator.backward(loss)
    assert gemms.count == 2 * (2 + 3 + 3)
    history_before = [m.fp8_state.amax_history.clone() for m in b.modules() if isinstance(m, FP8Linear)]
    opt_a.step()  # settles model a only: b's amaxes stay pending until opt_b steps
    assert all(not m.fp8_state.pending for m in a.modules() if isinstance(m, FP8Linear))
    assert all(m.fp8_state.pending for m in b.modules() if isinstance(m, FP8Linear))
    opt_b.step()
    after = [m.fp8_state.amax_history for m in b.modules() if isinstance(m, FP8Linear)]
    assert all(not torch.equal(h0, h1) for h0, h1 in zip(history_before, after))


def test_gradient_accumulation_updates_scales_once_per_optimizer_step():
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32, gradient_accumulation_steps=3)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = next(m for m in model.modules() if isinstance(m, FP8Linear))
    data = batches(6)
    scales = []
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        scales.append(first.fp8_state.scale.clone())
    # The input scale changes only after micro-batches 3 and 6 (the optimizer steps), and then
    # comes from the max input amax of the three micro-batches (first step: that amax itself).
    amax = max(x.abs().max() for x, _ in data[:3])
    assert torch.equal(scales[0], scales[1])
    expected = torch.tensor(448.0) / amax.float()
    torch.testing.assert_close(scales[2][0], expected, rtol=0, atol=0)


def test_save_state_load_state_resumes_bit_for_bit(tmp_path):
    data = batches(6)

    def fresh(seed=0):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        set_seed(seed)
        accelerator = Accelerator(mixed_precision="fp8", fp8_recipe="fp8-delayed", fp8_compute_dtype=torch.float32)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        return accelerator, model, optimizer, scheduler

    def run(accelerator, model, optimizer, scheduler, steps):
        losses = []
        for x, y in steps:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    acc, model, opt, sched = fresh()
    full = run(acc, model, opt, sched, data)
    full_state = {k: v.clone() for k, v in model.state_dict().items()}
    full_fp8 = fp.modules.convert.fp8_state_dict(model)

    acc, model, opt, sched = fresh()
    first = run(acc, model, opt, sched, data[:3])
    acc.save_state(str(tmp_path / "ckpt"))
    acc, model, opt, sched = fresh(seed=123)  # other init RNG: load_state must restore everything
    acc.load_state(str(tmp_path / "ckpt"))
    rest = run(acc, model, opt, sched, data[3:])

    assert first + rest == full
    assert all(torch.equal(full_state[k], v) for k, v in model.state_dict().items())
    resumed_fp8 = fp.modules.convert.fp8_state_dict(model)
    for key, value in full_fp8.items():
        for name, tensor in value.items():
            assert torch.equal(resumed_fp8[key][name], tensor), (key, name)
    # The model's own state_dict stays vanilla: the FP8 state travels in its own checkpoint file.
    assert not any("fp8_state" in k for k in model.state_dict())
    assert (tmp_path / "ckpt" / "custom_checkpoint_0.pkl").exists()


def test_unwrapped_model_saves_a_vanilla_checkpoint(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3)
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    model = accelerator.prepare(BertForSequenceClassification(config))
    assert accelerator.fp8_reports[0].swapped
    accelerator.unwrap_model(model).save_pretrained(tmp_path)
    plain = BertForSequenceClassification.from_pretrained(tmp_path)
    assert not any(isinstance(m, FP8Linear) for m in plain.modules())
    assert set(plain.state_dict()) == set(BertForSequenceClassification(config).state_dict())


def test_te_recipe_kwargs_map_field_by_field(monkeypatch):
    # TERecipeKwargs checks that Transformer Engine is installed; migrating users have it.
    import accelerate.utils.dataclasses as accelerate_dataclasses

    monkeypatch.setattr(accelerate_dataclasses, "is_transformer_engine_available", lambda: True)
    handler = TERecipeKwargs(fp8_format="E4M3", margin=2, amax_history_len=8, amax_compute_algo="most_recent")
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
    assert accelerator.fp8_settings.recipe == fp.DelayedScaling(
        margin=2, fp8_format=fp.Format.E4M3, amax_history_len=8, amax_compute_algo="most_recent")
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="fp8",
                              kwargs_handlers=[TERecipeKwargs(override_linear_precision=(False, True, False))])
    assert accelerator.fp8_settings.recipe.override_linear_precision == (False, True, False)
    AcceleratorState._reset_state(True)
    with pytest.raises(ValueError, match="FP8Kwargs and TERecipeKwargs"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(recipe="fp8-current"), TERecipeKwargs()])


def test_bad_settings_fail_at_construction_naming_them(monkeypatch):
    with pytest.raises(ValueError, match="fp8-nope.*valid: fp8-hybrid"):
        Accelerator(mixed_precision="fp8", fp8_recipe="fp8-nope")
    with pytest.raises(ValueError, match="fp8_recipe given, but mixed_precision='bf16'"):
        Accelerator(mixed_precision="bf16", fp8_recipe="fp8-current")
    with pytest.raises(TypeError, match="NotAHandler is not a known kwargs handler; valid: "):
        from accelerate.utils import KwargsHandler

        class NotAHandler(KwargsHandler):
            pass

        Accelerator(mixed_precision="fp8", kwargs_handlers=[NotAHandler()])
    with pytest.raises(ValueError, match="needs a loss scaler"):
        Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float16)
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "16")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "32")
    both = "ACCELERATE_FP8_AMAX_HISTORY_LENGTH='16'.*ACCELERATE_FP8_AMAX_HISTORY_LEN='32'"
    with pytest.raises(ValueError, match=both):
        Accelerator(mixed_precision="fp8")


def test_higher_settings_override_lower_ones(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_RECIPE", "fp8-blockwise")
    monkeypatch.setenv("ACCELERATE_FP8_EXCLUDE", "a,b")
    accelerator = Accelerator(mixed_precision="fp8", fp8_recipe="fp8-current",
                              kwargs_handlers=[FP8Kwargs(exclude="c", compute_dtype="fp32")])
    settings = accelerator.fp8_settings
    assert settings.recipe == fp.Float8CurrentScaling()
    assert settings.exclude == "c" and settings.compute_dtype == torch.float32
    assert settings.sources == {"recipe": "Accelerator(fp8_recipe)", "exclude": "FP8Kwargs(exclude)",
                                "compute_dtype": "FP8Kwargs(compute_dtype)"}


# accelerate launch: one process on CPU (several need MPI there), so two processes run under torchrun below.

CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: 'NO'
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
{fp8_config}
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def launch(tmp_path: Path, fp8_config: str, *worker_args: str) -> tuple[subprocess.CompletedProcess, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(fp8_config=fp8_config))
    out = tmp_path / "out"
    proc = subprocess.run([str(ACCELERATE), "launch", "--config_file", str(config), str(WORKER), str(out),
                           *worker_args], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc, (torch.load(out / "rank0.pt", weights_only=False) if (out / "rank0.pt").exists() else None)


def test_accelerate_launch_config_file_honours_every_key(tmp_path):
    proc, result = launch(tmp_path, """  backend: TE
  fp8_format: E4M3
  amax_history_length: 16
  amax_compute_algorithm: most_recent
  margin: 1
  interval: 1
  override_linear_precision: [false, false, false]
  use_autocast_during_eval: true
  include: 0,2
  exclude: '2'
  compute_dtype: fp32""", "--grad-accum", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["recipe"] == repr(fp.DelayedScaling(margin=1, fp8_format=fp.Format.E4M3, amax_history_len=16,
                                                      amax_compute_algo="most_recent"))
    assert result["fp8_layers"] == ["0"] and result["history_len"] == {"0": 16}
    assert result["include"] == ["0", "2"] and result["exclude"] == ["2"]
    assert result["compute_dtype"] == "torch.float32" and result["mixed_precision"] == "no"
    assert result["eval_fp8_gemms"] == 1  # use_autocast_during_eval
    assert result["train_fp8_gemms"] == 8 * 2  # 8 micro-batches, forward + wgrad of layer 0


def test_accelerate_launch_mxfp8_key_and_own_recipe_key(tmp_path):
    proc, result = launch(tmp_path / "mx", "  use_mxfp8_block_scaling: true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["recipe"] == repr(fp.MXFP8BlockScaling())
    proc, result = launch(tmp_path / "cur", "  recipe: fp8-current")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["recipe"] == repr(fp.Float8CurrentScaling())


@pytest.mark.parametrize("fp8_config, names", [
    ("  recipe: fp8-current\n  amax_history_length: 16",
     ("ACCELERATE_FP8_RECIPE", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH")),
    ("  optimization_level: O1", ("ACCELERATE_FP8_OPTIMIZATION_LEVEL",)),
    ("  interval: 4", ("interval=",)),
])
def test_accelerate_launch_refuses_contradictory_or_unsupported_keys_before_any_step(tmp_path, fp8_config, names):
    proc, result = launch(tmp_path, fp8_config)
    assert proc.returncode != 0 and result is None
    assert all(name in proc.stderr for name in names), proc.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_end_with_identical_weights_and_scales_one_reduction_per_step(tmp_path):
    # What `accelerate launch` would set for two DDP processes, on CPU: torchrun starts them.
    # (FSDP cannot be tested here: on CPUs Accelerate runs DDP whatever ACCELERATE_USE_FSDP says.)
    env = {**_env(), "ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_USE_CPU": "true",
           "ACCELERATE_FP8_COMPUTE_DTYPE": "fp32"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(WORKER), str(tmp_path), "--grad-accum", "2"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["losses"] != r1["losses"]  # the ranks saw different data
    assert r0["fp8_layers"] == ["0", "2", "4"] and r0["train_fp8_gemms"] == 8 * (2 + 3 + 3)
    for name in r0["fp8_state"]:
        for key, value in r0["fp8_state"][name].items():
            assert torch.equal(value, r1["fp8_state"][name][key]), (name, key)
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    # 4 optimizer steps of 2 micro-batches: one MAX all-reduce each, of 3 layers x 3 roles.
    assert r0["max_all_reduces"] == [[9]] * 4 == r1["max_all_reduces"]


def test_before_step_hooks_run_once_per_optimizer_step_with_its_gradients_and_weights():
    # The hook point of the BF16 reference checks: complete gradients, weights not yet stepped.
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32, gradient_accumulation_steps=2)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []
    accelerator.fp8_runs[0].before_step_hooks.append(
        lambda run: seen.append([(p.detach().clone(), p.grad.clone()) for p in run.module.parameters()]))
    expected = []
    for x, y in batches(4):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                expected.append([(p.detach().clone(), p.grad.clone()) for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    assert len(seen) == len(expected) == 2
    for got, want in zip(seen, expected):
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want))


# BF16 reference checks (fp8_plugin.training.reference) through the Accelerator.


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # dropout 0.1 on embeddings, attention and residuals: the replays must redraw it
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def token_batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(n)]


def gpt2_run(seed: int = 0, **accelerator_kwargs):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    set_seed(seed)
    accelerator_kwargs.setdefault("fp8_compute_dtype", torch.float32)
    accelerator = Accelerator(mixed_precision="fp8", **accelerator_kwargs)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train_lm(accelerator, model, optimizer, data) -> list[float]:
    model.train()
    losses = []
    for ids in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def figures(result) -> dict:
    """A check's figures, without its wall time."""
    return {k: v for k, v in result.to_dict().items() if k != "seconds"}


def test_reference_checks_run_on_the_due_steps_replaying_their_last_micro_batch():
    accelerator, model, optimizer = gpt2_run(fp8_reference_check=fp.ReferenceCheck(every=2, policy="log"),
                                             gradient_accumulation_steps=2)
    data = token_batches(12)  # 6 optimizer steps of 2 micro-batches
    losses, logged = [], []
    for ids in data:
        losses += train_lm(accelerator, model, optimizer, [ids])
        logged.append(accelerator.fp8_reference_metrics())
    checker = accelerator.fp8_runs[0].reference
    assert checker.steps == 6
    assert [r.step for r in checker.results] == [1, 3, 5]  # checks of optimizer steps 2, 4, 6
    # Figures come once, right after the optimizer step that checked: micro-batches 4, 8, 12.
    assert [i for i, metrics in enumerate(logged) if metrics] == [3, 7, 11]
    for result, metrics in zip(checker.results, [logged[3], logged[7], logged[11]]):
        assert metrics == result.metrics()
        assert result.passed and set(result.layer_sqnr_db) == {
            name for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    # The FP8 replay is the step's last micro-batch with its training forward's dropout masks,
    # scales and weights: the same loss to the bit (float32 compute, one process).
    assert [r.loss_fp8 for r in checker.results] == [losses[3], losses[7], losses[11]]
    assert all(r.loss_reference != r.loss_fp8 for r in checker.results)  # the reference ran without FP8


def test_training_with_reference_checks_equals_training_without_bit_for_bit():
    data = token_batches(8)

    def run(every):
        # BF16 compute: Accelerate's autocast wrapper and the replays' own autocast are exercised.
        accelerator, model, optimizer = gpt2_run(fp8_recipe="fp8-delayed", fp8_compute_dtype=torch.bfloat16,
                                                 fp8_reference_every=every, gradient_accumulation_steps=2,
                                                 kwargs_handlers=[FP8Kwargs(reference_policy="log")])
        losses = train_lm(accelerator, model, optimizer, data)
        unwrapped = accelerator.unwrap_model(model)
        return (losses, {k: v.clone() for k, v in unwrapped.state_dict().items()}, optimizer.state_dict(),
                fp.modules.convert.fp8_state_dict(unwrapped), torch.rand(16), accelerator.fp8_runs[0].reference)

    checked, plain = run(1), run(0)
    assert len(checked[5].results) == 4 and plain[5] is None
    assert checked[0] == plain[0]
    assert checked[1].keys() == plain[1].keys()
    assert all(torch.equal(v, plain[1][k]) for k, v in checked[1].items())
    opt_checked, opt_plain = checked[2]["state"], plain[2]["state"]
    assert opt_checked.keys() == opt_plain.keys()
    for index, state in opt_checked.items():
        assert all(torch.equal(v, opt_plain[index][k]) for k, v in state.items()), index
    assert checked[3].keys() == plain[3].keys()
    for key, value in checked[3].items():
        assert all(torch.equal(t, plain[3][key][name]) for name, t in value.items()), key
    assert torch.equal(checked[4], plain[4])  # the RNG stream goes on where it would have


class ListTracker(GeneralTracker):
    """An Accelerate tracker that keeps what it is given."""

    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[Optional[int], dict]] = []
        self.finished = False

    @property
    def tracker(self):
        return self.logged

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished = True


def test_reference_figures_reach_accelerate_trackers_and_end_training_reports(tmp_path, capsys):
    tracker = ListTracker()
    report = tmp_path / "reports" / "fp8_ref.json"
    accelerator, model, optimizer = gpt2_run(log_with=[tracker], fp8_reference_check=fp.ReferenceCheck(
        every=2, policy="log", json_path=str(report), log_layers=False))
    accelerator.init_trackers("fp8-reference")
    train_lm(accelerator, model, optimizer, token_batches(5))
    results = accelerator.fp8_runs[0].reference.results
    assert [step for step, _ in tracker.logged] == [2, 4]
    assert [values for _, values in tracker.logged] == [r.metrics(layers=False) for r in results]
    assert {"fp8_ref/grad_cosine", "fp8_ref/loss_rel_diff", "fp8_ref/sqnr_min_db"} <= set(tracker.logged[0][1])
    summary = accelerator.fp8_reference_summary()
    assert summary.startswith("FP8 reference checks: 2 run (every 2 steps, policy 'log'), 0 failed")
    capsys.readouterr()
    accelerator.end_training()
    out = capsys.readouterr().out
    assert summary in out and f"written: {report}" in out
    assert tracker.finished
    data = json.loads(report.read_text())
    assert data["steps"] == 5 and [c["step"] for c in data["checks"]] == [1, 3]


def plant_input_underflow(layer: FP8Linear) -> None:
    # Delayed scaling, "max" over a 1024-step history: an amax of 1e30 recorded in every slot
    # keeps the input scale at 448 / 1e30 for the next 1023 updates, so every input of this
    # layer flushes to zero in E4M3 (GPT-2's biases start at zero: its FP8 output is 0, SQNR 0 dB).
    state = layer.fp8_state
    state.amax_history[0].fill_(1e30)
    state.scale[0] = 448.0 / 1e30
    state.initialized[0] = True


def test_fallback_decision_and_check_history_survive_save_state_load_state(tmp_path):
    data = token_batches(4)
    faulty = "transformer.h.0.mlp.c_fc"
    recipe = fp.DelayedScaling(amax_history_len=1024, amax_compute_algo="max")

    def fresh(seed=0):
        accelerator, model, optimizer = gpt2_run(seed, fp8_recipe=recipe, fp8_reference_every=1,
                                                 kwargs_handlers=[FP8Kwargs(reference_policy="fallback")])
        return accelerator, model, optimizer, dict(model.named_modules())[faulty]

    accelerator, model, optimizer, layer = fresh()
    plant_input_underflow(layer)
    # The verified fallback's first try, blockwise scaling, does not read the poisoned history:
    # its replay passes, halving keeps the faulty layer alone, and its GEMMs stay in FP8.
    with pytest.warns(UserWarning, match=f"moved to blockwise scaling \\(GEMMs still FP8\\): {faulty}$"):
        full_losses = train_lm(accelerator, model, optimizer, data)
    full_results = [figures(r) for r in accelerator.fp8_runs[0].reference.results]
    full_weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    assert full_results[0]["fallback_blockwise"] == [faulty] and full_results[0]["layer_sqnr_db"][faulty] < 20
    assert full_results[0]["fallback_layers"] == full_results[0]["fallback_gemms"] == []
    assert not any(r["failures"] for r in full_results[1:])  # the other layers pass once it is blockwise
    assert layer.fp8_scaling == "blockwise" and layer.use_fp8 is True

    accelerator, model, optimizer, layer = fresh()
    plant_input_underflow(layer)
    with pytest.warns(UserWarning, match=f"moved to blockwise scaling \\(GEMMs still FP8\\): {faulty}$"):
        first = train_lm(accelerator, model, optimizer, data[:2])
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, model, optimizer, layer = fresh(seed=123)  # no fault planted, per-tensor: load_state restores
    assert layer.fp8_scaling == "recipe"
    accelerator.load_state(str(tmp_path / "ckpt"))
    checker = accelerator.fp8_runs[0].reference
    assert layer.fp8_scaling == "blockwise" and checker.steps == 2
    assert [figures(r) for r in checker.results] == full_results[:2]
    rest = train_lm(accelerator, model, optimizer, data[2:])
    assert first + rest == full_losses
    assert [figures(r) for r in checker.results] == full_results
    assert all(torch.equal(full_weights[k], v) for k, v in accelerator.unwrap_model(model).state_dict().items())


def test_reference_settings_from_arguments_fp8kwargs_and_config_keys(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_EVERY", "8")
    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_POLICY", "Fallback")
    settings = Accelerator(mixed_precision="fp8").fp8_settings
    assert settings.reference_check == fp.ReferenceCheck(every=8, policy="fallback")
    assert settings.sources["reference_every"] == "ACCELERATE_FP8_REFERENCE_EVERY"
    assert settings.sources["reference_policy"] == "ACCELERATE_FP8_REFERENCE_POLICY"
    # Each of every and policy from the highest level giving it; the rest from the ReferenceCheck.
    AcceleratorState._reset_state(True)
    check = fp.ReferenceCheck(every=3, policy="raise", min_sqnr_db=15.0)
    settings = Accelerator(mixed_precision="fp8", fp8_reference_every=2,
                           kwargs_handlers=[FP8Kwargs(reference_check=check)]).fp8_settings
    assert settings.reference_check == fp.ReferenceCheck(every=2, policy="raise", min_sqnr_db=15.0)
    assert settings.sources["reference_every"] == "Accelerator(fp8_reference_every)"
    assert settings.sources["reference_policy"] == "FP8Kwargs(reference_check).policy"
    AcceleratorState._reset_state(True)
    settings = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(reference_policy="log")]).fp8_settings
    assert settings.reference_check == fp.ReferenceCheck(every=8, policy="log")
    # 0 turns them off, whatever the lower levels say.
    AcceleratorState._reset_state(True)
    assert Accelerator(mixed_precision="fp8", fp8_reference_every=0).fp8_settings.reference_check is None
    monkeypatch.delenv("ACCELERATE_FP8_REFERENCE_EVERY")
    monkeypatch.delenv("ACCELERATE_FP8_REFERENCE_POLICY")
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="fp8")
    assert accelerator.fp8_settings.reference_check is None
    assert accelerator.fp8_reference_summary() == "FP8 reference checks: off"


def test_reference_settings_errors_name_the_setting_and_the_valid_values(monkeypatch):
    policies = "valid: log, warn, fallback, raise"
    with pytest.raises(ValueError, match=f"FP8Kwargs\\(reference_policy\\)='ignore' .*{policies}"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(reference_policy="ignore")])
    with pytest.raises(ValueError, match="Accelerator\\(fp8_reference_every\\)=-1 .*valid: an int >= 0"):
        Accelerator(mixed_precision="fp8", fp8_reference_every=-1)
    with pytest.raises(ValueError, match="Accelerator\\(fp8_reference_check\\).every=4 and "
                                         "Accelerator\\(fp8_reference_every\\)=2"):
        Accelerator(mixed_precision="fp8", fp8_reference_every=2, fp8_reference_check=fp.ReferenceCheck(every=4))
    with pytest.raises(TypeError, match="fp8_reference_check=.*must be a fp8_plugin.ReferenceCheck"):
        Accelerator(mixed_precision="fp8", fp8_reference_check={"every": 4})
    with pytest.raises(ValueError, match="fp8_reference_every given, but mixed_precision='bf16'"):
        Accelerator(mixed_precision="bf16", fp8_reference_every=4)
    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_EVERY", "often")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_REFERENCE_EVERY='often' .*valid: an int >= 0"):
        Accelerator(mixed_precision="fp8")
    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_EVERY", "4")
    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_POLICY", "abort")
    with pytest.raises(ValueError, match=f"ACCELERATE_FP8_REFERENCE_POLICY='abort' .*{policies}"):
        Accelerator(mixed_precision="fp8")


def test_accelerate_launch_reference_config_keys(tmp_path):
    proc, result = launch(tmp_path, "  reference_every: 2\n  reference_policy: log\n  compute_dtype: fp32")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["reference_check"] == repr(fp.ReferenceCheck(every=2, policy="log"))
    assert result["reference_sources"] == {"reference_every": "ACCELERATE_FP8_REFERENCE_EVERY",
                                           "reference_policy": "ACCELERATE_FP8_REFERENCE_POLICY"}
    assert [r["step"] for r in result["reference_results"]] == [1, 3]  # 4 optimizer steps
    assert "FP8 reference checks: 2 run (every 2 steps, policy 'log')" in proc.stdout


def torchrun(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(WORKER), str(tmp_path), "--grad-accum", "2"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_two_processes_ddp_reference_checks_agree_on_every_rank(tmp_path):
    env = {**_env(), "ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_USE_CPU": "true",
           "ACCELERATE_FP8_COMPUTE_DTYPE": "fp32", "ACCELERATE_FP8_REFERENCE_EVERY": "2",
           "ACCELERATE_FP8_REFERENCE_POLICY": "log"}
    proc = torchrun(tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["losses"] != r1["losses"]  # the ranks replayed different data
    # The figures are sums over both ranks' replays (one all-reduce): the same on both, to the bit.
    fig0 = [{k: v for k, v in r.items() if k != "seconds"} for r in r0["reference_results"]]
    fig1 = [{k: v for k, v in r.items() if k != "seconds"} for r in r1["reference_results"]]
    assert [r["step"] for r in fig0] == [1, 3] and fig0 == fig1
    # Replays record no amax: still one MAX all-reduce per optimizer step; weights still identical.
    assert r0["max_all_reduces"] == [[9]] * 4 == r1["max_all_reduces"]
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    assert proc.stdout.count("FP8 reference checks: 2 run") == 1  # the main process prints the summary


