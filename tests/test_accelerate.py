"""fp8_plugin.accelerate.Accelerator with real Accelerate: one process in this process, a config
file through ``accelerate launch``, two processes under torchrun (gloo), save/load state."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import TERecipeKwargs, set_seed
from torch import nn

import fp8_plugin as fp
from fp8_plugin.accelerate import Accelerator, FP8Kwargs
from fp8_plugin.linear import FP8Linear
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
    full_fp8 = fp.convert.fp8_state_dict(model)

    acc, model, opt, sched = fresh()
    first = run(acc, model, opt, sched, data[:3])
    acc.save_state(str(tmp_path / "ckpt"))
    acc, model, opt, sched = fresh(seed=123)  # other init RNG: load_state must restore everything
    acc.load_state(str(tmp_path / "ckpt"))
    rest = run(acc, model, opt, sched, data[3:])

    assert first + rest == full
    assert all(torch.equal(full_state[k], v) for k, v in model.state_dict().items())
    resumed_fp8 = fp.convert.fp8_state_dict(model)
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
    with pytest.raises(ValueError, match="override_linear_precision"):
        Accelerator(mixed_precision="fp8",
                    kwargs_handlers=[TERecipeKwargs(override_linear_precision=(False, True, False))])
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_end_with_identical_weights_and_scales_one_reduction_per_step(tmp_path, strategy):
    # What `accelerate launch` would set for two processes, on CPU: torchrun starts them.
    env = {**_env(), "ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_USE_CPU": "true",
           "ACCELERATE_FP8_COMPUTE_DTYPE": "fp32"}
    if strategy == "fsdp2":  # converted in prepare(), before Accelerate's fully_shard
        env.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
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
