"""FP8 under DeepSpeed ZeRO 1, 2 and 3 through fp8_plugin.accelerate.Accelerator (and FP8Trainer,
Lightning's DeepSpeedStrategy with FP8DeepSpeedPrecision or an "fp8-*" string): two processes
on CPU (gloo) under torchrun (tests/training/deepspeed_worker.py), against a plain-Accelerate DeepSpeed
BF16 run of the same model and batches; and the set-ups refused at start-up."""

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("deepspeed_worker.py")
TIMEOUT_S = 300  # a launch runs several small trainings
# 3 FP8 layers x 3 roles (input, weight, grad_output): the element count of one amax reduction.
AMAX_ELEMENTS = 9
# The statistics of a sampled step: 3 layers x 3 roles x 3 extremes (amax, smallest and largest
# scale) in one MAX all-reduce (the counts and energies go in one SUM all-reduce).
STATS_EXTREMES = 27
# Every FP8 run samples the per-layer statistics every this many optimizer steps.
STATS_EVERY = 2
STEPS, GRAD_ACCUM = 4, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_statistics(logged: list, r0: dict, r1: dict, prefix: str) -> None:
    # logged: (optimizer step, fp8_stats/ figures) of the sampled steps; prefix: the layers' path.
    assert [step for step, _ in logged] == list(range(STATS_EVERY, STEPS + 1, STATS_EVERY))
    for step, metrics in logged:
        assert len(metrics) == 3 * 3 * 7 + 3  # layers x roles x figures, and each layer's scaling choice
        assert all(f"fp8_stats/{prefix}{layer}/{role}/sqnr_db" in metrics
                   for layer in "024" for role in ("input", "weight", "grad_output"))
        first = (step - 1) * GRAD_ACCUM  # the step's micro-batches, on each rank
        expected = max(r["input_amaxes"][i] for r in (r0, r1) for i in range(first, first + GRAD_ACCUM))
        assert metrics[f"fp8_stats/{prefix}0/input/amax"] == expected  # MAX-reduced across ranks


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[name].keys() == b[name].keys() and all(torch.equal(v, b[name][k]) for k, v in a[name].items()) for name in a)


def _ranks(out: Path) -> tuple[dict, dict]:
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))


# The runs of every ZeRO stage, in one launch: BF16 and FP8 under each; DeepSpeed's fp16 under
# ZeRO-2; the transformers model saved with save_pretrained under ZeRO-3; the reference checks
# and FP8 with fp8_plugin.optim.FP8AdamW under ZeRO-2 and 3.
ZERO_RUNS = {1: ("bf16", "fp8"), 2: ("bf16", "fp8", "fp16", "reference", "fp8-adamw", "frozen-lora"),
             3: ("bf16", "fp8", "llama", "reference", "fp8-adamw", "frozen-lora")}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """``zero_runs(stage)``: ``{run: (rank 0, rank 1), "dir": the stage's folder}`` for the runs
    of :data:`ZERO_RUNS`, from one launch of tests/training/deepspeed_worker.py made at the first call."""
    return _runs_of(tmp_path_factory.mktemp("zero"), WORKER, ZERO_RUNS)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_in_fp8_with_identical_state_one_reduction_per_step_and_resumes(zero_runs, stage):
    r0, r1 = zero_runs(stage)["fp8"]
    ref0, _ = zero_runs(stage)["bf16"]
    assert r0["distributed_type"] == "DistributedType.DEEPSPEED" and r0["zero_stage"] == stage
    assert r0["world_size"] == 2 and r0["losses"] != r1["losses"]  # the ranks saw different data
    assert r0["param_dtypes"] == ["torch.bfloat16"]  # DeepSpeed's bf16 holds the model (FP32 masters in ZeRO)
    # Every layer in FP8: forward + wgrad for the first (its input needs no grad), + dgrad for
    # the two others, per micro-batch; none under the BF16 reference.
    assert r0["fp8_layers"] == ["0", "2", "4"]
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3)
    assert ref0["train_fp8_gemms"] == 0
    # Identical FP8 state (scales, amax histories) and FP32 master weights on both ranks.
    assert _equal_states(r0["fp8_state"], r1["fp8_state"])
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    # One amax reduction (a MAX all-reduce of every layer's amaxes) per optimizer step, however
    # many micro-batches: the MAX all-reduces of each step are DeepSpeed's own (those of the
    # BF16 run, step by step: overflow checks, the checkpoint) plus exactly one of ours.
    # A step that samples the statistics adds their one MAX all-reduce.
    assert len(r0["max_all_reduces"]) == len(ref0["max_all_reduces"]) == STEPS + (STEPS - 2)
    numbers = list(range(1, STEPS + 1)) + list(range(3, STEPS + 1))  # the resumed run redoes steps 3, 4
    for number, fp8_step, bf16_step in zip(numbers, r0["max_all_reduces"], ref0["max_all_reduces"], strict=True):
        sampled = [STATS_EXTREMES] if number % STATS_EVERY == 0 else []
        assert sorted(fp8_step) == sorted(bf16_step + [AMAX_ELEMENTS] + sampled)
    # The per-layer statistics (Accelerator(fp8_statistics=2)), formed at steps 2 and 4 and read
    # with fp8_reference_metrics(): identical on both ranks, every layer and role, and the input
    # amax of the first layer is the largest magnitude of that step's bf16 inputs on both ranks.
    _check_statistics([(n, m) for n, m in zip(numbers[:STEPS], r0["statistics"]) if m], r0, r1, "")
    assert r0["statistics"] == r1["statistics"]
    # Losses within the FP8 bound of the DeepSpeed BF16 run: each FP8 GEMM rounds both operands
    # to E4M3/E5M2 (relative step 2**-3 for E4M3, half of it per rounding), so a product errs by
    # at most ~2**-3 of the operands' magnitudes; over these few steps the loss curves stay
    # within that fraction of the loss's own scale.
    bound = 2**-3 * ref0["losses"][0]
    assert len(r0["losses"]) == len(ref0["losses"]) == STEPS * GRAD_ACCUM
    assert all(abs(a - b) <= bound for a, b in zip(r0["losses"], ref0["losses"]))
    # save_state after 2 steps, load_state, the same last steps again: bit for bit (losses, FP8
    # state, FP32 master weights).
    for r in (r0, r1):
        assert r["resumed_losses"] == r["losses"][2 * GRAD_ACCUM:]
        assert _equal_states(r["resumed_fp8_state"], r["fp8_state"])
        assert all(torch.equal(v, r["resumed_weights"][k]) for k, v in r["weights"].items())
    # The consolidated model state (ZeRO-3: gathered from the partitions) is vanilla: it loads
    # strictly into the unconverted model, and holds the bf16 copies of the FP32 masters.
    assert r0["consolidated_matches_master"] is True
    if stage == 3:
        # ZeRO-3 re-gathers each weight for each forward: no FP8 copy is kept across gathers,
        # and a weight changed through DeepSpeed's partitions (doubled, no FP8 hook) reaches
        # the next forward (a stale cached copy would give back the same outputs).
        assert r0["weight_cache"] == [False, False, False]
        assert not torch.equal(r0["regathered_ratio"], torch.ones_like(r0["regathered_ratio"]))
    else:
        assert r0["weight_cache"] == ["auto", "auto", "auto"]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp8_adamw_under_zero_keeps_fp8_moments_identical_ranks_and_resumes_bit_for_bit(zero_runs, stage):
    # DeepSpeed's ZeRO optimizer owns the FP32 master partitions and hands them to the client
    # optimizer (zero_allow_untested_optimizer): FP8AdamW updates them and keeps its moments in E4M3.
    r0, r1 = zero_runs(stage)["fp8-adamw"]
    fp8, _ = zero_runs(stage)["fp8"]
    assert r0["zero_stage"] == stage and r0["base_optimizer"] == "FP8AdamW"
    assert r0["moment_dtypes"] == ["torch.float8_e4m3fn"]
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3)
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    for r in (r0, r1):
        assert r["resumed_losses"] == r["losses"][2 * GRAD_ACCUM:]
        assert all(torch.equal(v, r["resumed_weights"][k]) for k, v in r["weights"].items())
    # The same first optimizer step as torch's AdamW (both from zero moments: the stored rounding
    # matters from the second step on), so the same losses through the second step's
    # micro-batches; then close to it: FP8 moments change each step by at most half an E4M3 step
    # of m (2**-4 relative) and little of v, over 4 steps at lr 1e-3 (a factor 4 for |update| > 1).
    assert r0["losses"][:2 * GRAD_ACCUM] == fp8["losses"][:2 * GRAD_ACCUM]
    assert r0["losses"][2 * GRAD_ACCUM:] != fp8["losses"][2 * GRAD_ACCUM:]
    assert r0["weights"].keys() == fp8["weights"].keys()
    for k, v in r0["weights"].items():
        assert (v - fp8["weights"][k]).abs().max() <= STEPS * 1e-3 * 2**-4 * 4, k


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_over_frozen_fp8_weights_under_zero(zero_runs, stage):
    # PEFT LoRA (q, v, up, down) over a two-layer Llama whose base is frozen before prepare().
    r0, r1 = zero_runs(stage)["frozen-lora"]
    assert r0["zero_stage"] == stage
    # Per step: 14 fprops, and dgrads where the layer's input needs grad: layer 0's o, gate, up,
    # down (its q, k, v read the frozen embeddings), all 7 of layer 1: FP8 ran, 4 steps.
    assert r0["train_fp8_gemms"] == 4 * (14 + 4 + 7)
    for r in (r0, r1):
        assert r["resumed_losses"] == r["losses"][2:]
    if stage == 2:
        # ZeRO-2 keeps parameters whole: the base stays in FP8 only, its bytes never change.
        assert len(r0["frozen_layers"]) == 14 and r0["refusal"] is None
        for name, (data, scale_inv) in r0["frozen_before"].items():
            assert torch.equal(r0["frozen_after"][name][0], data) and torch.equal(r0["frozen_after"][name][1], scale_inv)
        assert all(torch.equal(v, r1["adapters"][k]) for k, v in r0["adapters"].items())
    else:
        # ZeRO-3 on gloo cannot all-gather float8 partitions: refused at prepare, naming the way
        # out, which trains (frozen weights kept in high precision, their GEMMs still FP8).
        assert r0["refusal"].startswith("DeepSpeed ZeRO-3 on the gloo backend cannot partition weights kept only in "
                                        "FP8 (14 frozen layers: base_model.model.model.layers.0.self_attn.q_proj")
        assert "frozen_weights='keep'" in r0["refusal"] and r0["frozen_layers"] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reference_checks_name_a_planted_layer_on_both_ranks_and_leave_training_alone(zero_runs, stage):
    # A fault on rank 1 only (tests/training/deepspeed_worker.py, reference_checks): the figures summed
    # over the ranks name net.0 on both, both move it to high precision, and the check at step 4
    # (net.0 then in high precision: it passes) changes no weight: step 4 run again from the
    # step-3 state without checks gives the same FP32 master weights, bit for bit.
    r0, r1 = zero_runs(stage)["reference"]
    assert r0["results"] == r1["results"]
    first, second = r0["results"]
    assert [first["step"] + 1, second["step"] + 1] == [2, 4]
    assert first["layer_sqnr_db"]["net.0"] < 10 < 20 < min(first["layer_sqnr_db"]["net.2"],
                                                          first["layer_sqnr_db"]["net.4"])
    assert first["fallback_layers"] == ["net.0"] and second["failures"] == []
    assert r0["use_fp8"] == r1["use_fp8"] == r0["unchecked_use_fp8"] == {"0": False, "2": True, "4": True}
    assert r0["loaded_checks"] == (3, 1)  # load_state restored the checks' schedule and history of step 3
    for r in (r0, r1):
        assert r["weights"].keys() == r["unchecked_weights"].keys()
        assert all(torch.equal(w, r["unchecked_weights"][k]) for k, w in r["weights"].items())


def test_zero3_reference_checks_give_the_figures_of_zero2(zero_runs):
    # ZeRO-3 gathers each partitioned parameter for the replays' forwards and backwards as for
    # training's; ZeRO-2 keeps them whole: the same computation. The layer and per-GEMM figures
    # (each rank's own sums, added) are the same exactly.
    zero2, zero3 = zero_runs(2)["reference"][0], zero_runs(3)["reference"][0]
    for ours, theirs in zip(zero3["results"], zero2["results"], strict=True):
        for key in ("loss_fp8", "loss_reference", "layer_sqnr_db", "gemm_sqnr_db", "failures", "fallback_layers"):
            assert ours[key] == theirs[key], key
    # The gradient figures: ZeRO-3's are the averaged gradient's, from each rank's reduce-scattered
    # part; ZeRO-2's the sums of each rank's whole gradients. With the same micro-batch on both
    # ranks the averaged gradient is each rank's (x + x, halved: exact), and the two differ only
    # by the order of their float64 sums: 4 gamma_n on a cosine, 2 gamma_n relative on a
    # relative error (tests/training/test_reference_fsdp.py derives them).
    ours, theirs = zero3["same_batch"], zero2["same_batch"]
    n = zero3["numel"] + 2
    gamma = n * 2.0**-53 / (1 - n * 2.0**-53)
    assert ours["layer_sqnr_db"] == theirs["layer_sqnr_db"] and ours["loss_fp8"] == theirs["loss_fp8"]
    assert ours["grad_cosine"] == pytest.approx(theirs["grad_cosine"], rel=0, abs=4 * gamma)
    assert ours["grad_rel_error"] == pytest.approx(theirs["grad_rel_error"], rel=2 * gamma)
    for name, (cosine, rel_error) in ours["param_figures"].items():
        assert cosine == pytest.approx(theirs["param_figures"][name][0], rel=0, abs=4 * gamma), name
        assert rel_error == pytest.approx(theirs["param_figures"][name][1], rel=2 * gamma), name


def test_zero3_fp8_trained_transformers_model_saved_pretrained_loads_into_plain_transformers(zero_runs):
    # A tiny LlamaForCausalLM trained 2 optimizer steps in FP8 under ZeRO-3 (every parameter
    # partitioned), saved as Accelerate documents: accelerator.get_state_dict(model) (gathered
    # from the partitions, stage3_gather_16bit_weights_on_model_save), then save_pretrained of
    # the unwrapped model with that state dict. It loads here, in a process without DeepSpeed
    # or fp8_plugin's conversion, with plain transformers.
    import safetensors.torch
    from transformers import LlamaForCausalLM

    from fp8_plugin.modules.linear import FP8Linear

    r0, r1 = zero_runs(3)["llama"]
    steps = r0["steps"]
    assert r0["zero_stage"] == 3 and steps == 2
    # It trained in FP8: the 7 projections of each of the 2 decoder layers (lm_head stays in
    # high precision) ran forward, dgrad and wgrad in FP8 for each micro-batch.
    projections = ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                   "self_attn.q_proj", "self_attn.v_proj")
    assert r0["fp8_layers"] == [f"model.layers.{i}.{p}" for i in (0, 1) for p in projections]
    assert r0["train_fp8_gemms"] == steps * 14 * 3
    masters = r0["weights"]
    assert all(torch.equal(v, r1["weights"][k]) for k, v in masters.items())
    assert all(not torch.equal(masters[k], v) for k, v in r0["initial_weights"].items())  # every weight trained
    # The saved file: the model's own keys only (no FP8 scales or amax histories), each the bf16
    # rounding of its FP32 master (DeepSpeed's bf16 model copy is the masters cast to bf16).
    saved = zero_runs(3)["dir"] / "llama" / "pretrained"
    tensors = safetensors.torch.load_file(saved / "model.safetensors")
    assert tensors.keys() == masters.keys()
    assert all(torch.equal(v, masters[k].to(torch.bfloat16)) for k, v in tensors.items())
    # Plain from_pretrained: strict (nothing missing, unexpected or mismatched), the saved bf16
    # weights as they are, and no FP8 module.
    plain, info = LlamaForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert type(plain) is LlamaForCausalLM
    assert {k: list(v) for k, v in info.items()} == {"missing_keys": [], "unexpected_keys": [],
                                                     "mismatched_keys": [], "error_msgs": []}
    assert not any(isinstance(m, FP8Linear) for m in plain.modules())
    loaded = dict(plain.named_parameters())
    assert loaded.keys() == masters.keys()
    assert all(torch.equal(p, masters[k].to(torch.bfloat16)) for k, p in loaded.items())


def test_deepspeed_refuses_what_cannot_work_at_start_up_naming_it():
    from fp8_plugin.accelerate.accelerator import _check_deepspeed_setup
    from fp8_plugin.accelerate.settings import resolve_settings
    from fp8_plugin.training.deepspeed_engine import check_deepspeed_config

    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    _check_deepspeed_setup(resolve_settings(), config)  # the plain FP8 set-up passes
    _check_deepspeed_setup(resolve_settings(reference_every=5), config)  # reference checks run under ZeRO 0-3
    with pytest.raises(ValueError, match="Accelerator\\(fp8_nonfinite\\)='raise' is not supported with "
                                         "distributed_type=DEEPSPEED: .*fp16 dynamic loss scaler"):
        _check_deepspeed_setup(resolve_settings(nonfinite="raise"), config)
    with pytest.raises(ValueError, match="autotp_size=2 is not supported.*ZeRO stages 0-3 with data parallelism"):
        check_deepspeed_config({"tensor_parallel": {"autotp_size": 2}}, "Accelerator")
    with pytest.raises(ValueError, match="zero_optimization.stage=4 is not valid; valid: 0, 1, 2, 3"):
        check_deepspeed_config({"zero_optimization": {"stage": 4}}, "Accelerator")
    from fp8_plugin.lightning.deepspeed_precision import FP8DeepSpeedPrecision

    with pytest.raises(ValueError, match="FP8DeepSpeedPrecision\\(precision='32-true'\\) is not supported; valid: "
                                         "'bf16-mixed', '16-mixed'"):
        FP8DeepSpeedPrecision(precision="32-true")
    with pytest.raises(ValueError, match="FP8DeepSpeedPrecision\\(reference_every=-1\\) must be an int >= 0"):
        FP8DeepSpeedPrecision(reference_every=-1)
    with pytest.raises(TypeError, match="FP8DeepSpeedPrecision\\(reference_check=3\\) must be a fp8_plugin.ReferenceCheck"):
        FP8DeepSpeedPrecision(reference_check=3)
    assert FP8DeepSpeedPrecision(reference_every=3).fp8.reference.config.every == 3
    assert FP8DeepSpeedPrecision().fp8.compute_dtype == torch.bfloat16
    assert FP8DeepSpeedPrecision(precision="16-mixed").fp8.compute_dtype == torch.float16


def test_accelerate_launch_with_the_example_config_trains_zero3_in_fp8(tmp_path):
    # `accelerate launch` with examples/accelerate_fp8_deepspeed.yaml (two processes, ZeRO-3,
    # mixed_precision fp8, an fp8_config): everything reaches the Accelerator through the
    # environment the launcher sets.
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
    out = tmp_path / "out"
    proc = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                           str(root / "examples" / "accelerate_fp8_deepspeed.yaml"),
                           "--main_process_port", str(_free_port()), str(WORKER), str(out), "--stage", "3",
                           "--from-env"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["distributed_type"] == "DistributedType.DEEPSPEED" and r0["zero_stage"] == 3
    assert r0["world_size"] == 2 and r0["losses"] != r1["losses"]
    # The config's gradient_accumulation_steps (2) and fp8_config amax_history_length (16).
    assert r0["train_fp8_gemms"] == STEPS * 2 * (2 + 3 + 3)
    assert all(state["amax_history"].shape[-1] == 16 for state in r0["fp8_state"].values())
    assert _equal_states(r0["fp8_state"], r1["fp8_state"])
    assert all(step.count(AMAX_ELEMENTS) == 1 for step in r0["max_all_reduces"])
    assert r0["resumed_losses"] == r0["losses"][2 * 2:]
    assert _equal_states(r0["resumed_fp8_state"], r0["fp8_state"])


def test_fp16_dynamic_loss_scaler_skips_a_step_with_non_finite_fp8_gradients(zero_runs):
    # DeepSpeed fp16 (ZeRO-2) with FP8: rank 0 feeds an inf in the last micro-batch of optimizer
    # step 2. Its FP8 casts see a non-finite amax, its gradients are non-finite, and DeepSpeed's
    # dynamic loss scaler (its overflow check spans the ranks) skips that step on both.
    r0, r1 = zero_runs(2)["fp16"]
    assert r0["param_dtypes"] == ["torch.float16"]  # DeepSpeed's fp16 holds the model
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3)
    for r in (r0, r1):
        assert r["applied"] == [True, False, True, True]
        # The FP32 master weights move at every step but the skipped one.
        w = r["weights"]
        moved = [not all(torch.equal(w[i][k], w[i + 1][k]) for k in w[i]) for i in range(STEPS)]
        assert moved == [True, False, True, True]
        # The skip reaches the FP8 step's count of loss-scaler skips in a row; each step, the
        # skipped one included, still makes its one amax reduction.
        assert r["scaler_skips"] == [0, 1, 0, 0] and r["optimizer_steps"] == STEPS
        assert all(step.count(AMAX_ELEMENTS) == 1 for step in r["max_all_reduces"])
    # Scales and amax histories agree on both ranks (the inf amax was reduced, then left out of
    # the scales); the count of non-finite casts is each rank's own: rank 0 cast the inf input
    # and its gradient (input and grad_output of every layer), rank 1 none.
    for name, state in r0["fp8_state"].items():
        other = r1["fp8_state"][name]
        for key in ("amax_history", "scale", "initialized"):
            assert torch.equal(state[key], other[key]), (name, key)
        assert state["scale"].isfinite().all()
        assert state["nonfinite_amax_count"].tolist() == [1, 0, 1]
        assert other["nonfinite_amax_count"].tolist() == [0, 0, 0]


TRAINER_WORKER = Path(__file__).with_name("deepspeed_trainer_worker.py")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """``trainer_runs(stage)``: the plain Trainer's and FP8Trainer's runs under ZeRO-2 and 3,
    ``{"bf16" | "fp8": (rank 0, rank 1)}``, from one launch made at the first call."""
    return _runs_of(tmp_path_factory.mktemp("trainer"), TRAINER_WORKER, {2: ("bf16", "fp8"), 3: ("bf16", "fp8")})


@pytest.mark.parametrize("stage", [2, 3])
def test_fp8_trainer_with_deepspeed_dict_trains_in_fp8_and_resumes_bit_for_bit(trainer_runs, stage):
    # FP8Trainer(args=TrainingArguments(deepspeed=<dict>, bf16=True)): 4 optimizer steps of 2
    # micro-batches, checkpoints every 2 (DeepSpeed's save_checkpoint), then a second Trainer
    # resumes from checkpoint-2 (its load_checkpoint); against the plain Trainer alike.
    r0, r1 = trainer_runs(stage)["fp8"]
    ref0, _ = trainer_runs(stage)["bf16"]
    assert r0["world_size"] == 2 and r0["zero_stage"] == stage
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3) and ref0["train_fp8_gemms"] == 0
    # FP8Trainer(fp8_reference_every=2): checks at steps 2 and 4, identical figures on both ranks,
    # each in the Trainer's log at its step.
    checks = r0["reference_results"]
    assert [c["step"] + 1 for c in checks] == [2, 4] and checks == r1["reference_results"]
    assert all(c["failures"] == [] for c in checks) and r0["check_fp8_gemms"] >= 2 * (2 + 3 + 3)
    assert r0["reference"] == [(2, checks[0]["grad_cosine"]), (4, checks[1]["grad_cosine"])]
    assert _equal_states(r0["fp8_state"], r1["fp8_state"])
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    # Each step's MAX all-reduces: DeepSpeed's own (those of the plain run) plus one amax
    # reduction, and on the steps that sample the statistics (fp8_statistics=2) their extremes.
    assert len(r0["max_all_reduces"]) == len(ref0["max_all_reduces"]) == STEPS
    for number, (fp8_step, bf16_step) in enumerate(zip(r0["max_all_reduces"], ref0["max_all_reduces"]), 1):
        sampled = [STATS_EXTREMES] if number % STATS_EVERY == 0 else []
        assert sorted(fp8_step) == sorted(bf16_step + [AMAX_ELEMENTS] + sampled)
    # The statistics in the Trainer's logs at steps 2 and 4, every layer and role, the same on
    # both ranks (reduced over DeepSpeed's data-parallel group).
    assert [step for step, _ in r0["statistics"]] == list(range(STATS_EVERY, STEPS + 1, STATS_EVERY))
    assert all(len(metrics) == 3 * 3 * 7 + 3 and all(f"fp8_stats/{layer}/{role}/amax" in metrics for layer in "024"
                                                 for role in ("input", "weight", "grad_output"))
               for _, metrics in r0["statistics"])
    assert r0["statistics"] == r1["statistics"]
    # The logged losses (mean over ranks) within the FP8 bound of the DeepSpeed BF16 run (as in
    # the Accelerate test: 2**-3, E4M3's relative step, of the loss's own scale).
    assert len(r0["losses"]) == len(ref0["losses"]) == STEPS
    assert all(abs(a - b) <= 2**-3 * ref0["losses"][0] for a, b in zip(r0["losses"], ref0["losses"]))
    # The model file the Trainer saved (ZeRO-3: consolidated) loads strictly into the plain model.
    assert r0["saved_model_matches_master"] is True
    # Resumed from checkpoint-2: steps 3 and 4 again, bit for bit (the first two entries of the
    # resumed log come from the checkpoint's trainer state).
    for r in (r0, r1):
        assert r["resumed_losses"][2:] == r["losses"][2:]
        assert _equal_states(r["resumed_fp8_state"], r["fp8_state"])
        assert all(torch.equal(v, r["resumed_weights"][k]) for k, v in r["weights"].items())


LIGHTNING_WORKER = Path(__file__).with_name("deepspeed_lightning_worker.py")


LIGHTNING_RUNS = {2: ("bf16", "fp8", "fp8-string"), 3: ("bf16", "fp8")}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """``lightning_runs(stage)``: ``{run: (rank 0, rank 1)}`` for the runs of :data:`LIGHTNING_RUNS`,
    from one launch made at the first call."""
    return _runs_of(tmp_path_factory.mktemp("lightning"), LIGHTNING_WORKER, LIGHTNING_RUNS)


def _runs_of(out: Path, worker: Path, runs: dict) -> Callable[[int], dict]:
    # One launch of ``worker`` with ``--runs`` (every stage's runs, each into out/<stage>/<run>:
    # a launch's start is most of such a small run's time), at the first call.
    loaded: dict[int, dict] = {}

    def get(stage: int) -> dict:
        if not loaded:
            env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
            env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
            specs = ",".join(f"{s}:{name}" for s, names in runs.items() for name in names)
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                   f"--master_port={_free_port()}", str(worker), str(out), "--runs", specs],
                                  env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            assert proc.returncode == 0, proc.stderr[-4000:]
            for s, names in runs.items():
                loaded[s] = {name: _ranks(out / str(s) / name) for name in names}
                loaded[s]["dir"] = out / str(s)
        return loaded[stage]

    return get


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_strategy_with_fp8_precision_plugin(lightning_runs, stage):
    # Trainer(strategy=DeepSpeedStrategy(stage), plugins=[FP8DeepSpeedPrecision()]) against
    # Lightning's own DeepSpeed precision="bf16-mixed" on the same model and batches.
    r0, r1 = lightning_runs(stage)["fp8"]
    ref0, _ = lightning_runs(stage)["bf16"]
    assert r0["world_size"] == 2 and r0["zero_stage"] == stage and r0["inputs"] != r1["inputs"]
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3) and ref0["train_fp8_gemms"] == 0
    assert _equal_states(r0["fp8_state"], r1["fp8_state"])
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    assert r0["inputs"] == ref0["inputs"]  # the same batches as the BF16 run
    for number, (fp8_step, bf16_step) in enumerate(zip(r0["max_all_reduces"], ref0["max_all_reduces"], strict=True), 1):
        sampled = [STATS_EXTREMES] if number % STATS_EVERY == 0 else []
        assert sorted(fp8_step) == sorted(bf16_step + [AMAX_ELEMENTS] + sampled)
    # FP8DeepSpeedPrecision(statistics=2): logged on rank zero at steps 2 and 4 (engine.step()
    # at the boundary ends the FP8 step). Besides the input amax (as above), each weight's amax
    # is that of the bf16 copy of the FP32 master weights the step's forwards ran on (under
    # ZeRO-3 the weight DeepSpeed gathered for the forward): rounding to nearest is monotonic,
    # so it is the bf16 rounding of the masters' largest magnitude.
    logged = [(step, {k: v for k, v in m.items() if k.startswith("fp8_stats/")})
              for step, m in r0["logged"] if any(k.startswith("fp8_stats/") for k in m)]
    _check_statistics(logged, r0, r1, "net.")
    # FP8DeepSpeedPrecision(reference_check=ReferenceCheck(every=2)): checks at steps 2 and 4 on
    # the healthy model, identical on both ranks (the figures summed over them), logged at their
    # step on rank zero; DeepSpeed's gradients untouched (the losses below and the resumed fit).
    checks = r0["reference_results"]
    assert [c["step"] + 1 for c in checks] == [2, 4] and checks == r1["reference_results"]
    assert all(c["failures"] == [] and set(c["layer_sqnr_db"]) == {"net.0", "net.2", "net.4"} for c in checks)
    assert [step for step, m in r0["logged"] if "fp8_ref/grad_cosine" in m] == [2, 4]
    assert r0["check_fp8_gemms"] >= 2 * (2 + 3 + 3)  # each check's FP8 replay ran in FP8
    assert r1["logged"] == []
    for step, metrics in logged:
        for layer, amax in r0["weight_amaxes"][step - 1].items():
            bf16 = float(torch.tensor(amax).to(torch.bfloat16))
            assert metrics[f"fp8_stats/net.{layer}/weight/amax"] == bf16, (step, layer)
    # Within the FP8 bound of the BF16 run (2**-3 of the loss's scale, as above).
    assert all(abs(a - b) <= 2**-3 * ref0["losses"][0] for a, b in zip(r0["losses"], ref0["losses"], strict=True))
    # fit(ckpt_path=<step-2 checkpoint>) through DeepSpeed's load_checkpoint: the same last two
    # steps again, bit for bit. (The resumed fit's ModelCheckpoint writes step=2.ckpt once more
    # after its first micro-batch, in the middle of an accumulation: that save must not settle
    # the step's amaxes early, or the second micro-batch casts with other scales.)
    for r in (r0, r1):
        assert r["resumed_inputs"] == r["inputs"][2 * GRAD_ACCUM:]
        assert r["resumed_losses"] == r["losses"][2 * GRAD_ACCUM:]
        assert _equal_states(r["resumed_fp8_state"], r["fp8_state"])
        assert all(torch.equal(v, r["resumed_weights"][k]) for k, v in r["weights"].items())


def test_lightning_trainer_fp8_string_with_deepspeed_stage_2_string_trains_in_fp8(lightning_runs):
    # Trainer(precision="fp8-hybrid", strategy="deepspeed_stage_2"), two processes: Lightning
    # resolves the strategy name, the string becomes FP8DeepSpeedPrecision on DeepSpeed's bf16.
    r0, r1 = lightning_runs(2)["fp8-string"]
    assert r0["precision_plugin"] == "FP8DeepSpeedPrecision" and r0["recipe_format"] == "HYBRID"
    assert r0["world_size"] == 2 and r0["zero_stage"] == 2 and r0["bf16_enabled"]
    # 3 forward + 2 dgrad + 3 wgrad FP8 GEMMs per micro-batch (the first layer's input needs no dgrad).
    assert r0["train_fp8_gemms"] == STEPS * GRAD_ACCUM * (2 + 3 + 3)
    assert _equal_states(r0["fp8_state"], r1["fp8_state"])
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    for step in r0["max_all_reduces"]:
        assert AMAX_ELEMENTS in step  # one amax reduction per optimizer step


def test_fp8_precision_strings_with_deepspeed_strategies_get_fp8_deepspeed_precision():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from fp8_plugin.lightning.deepspeed_precision import FP8DeepSpeedPrecision
    from fp8_plugin.numerics.formats import Format
    from fp8_plugin.numerics.recipes import AutoRecipe, DelayedScaling, Float8CurrentScaling

    flags = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    cases = [("fp8-hybrid", "deepspeed_stage_2", 2, AutoRecipe, Format.HYBRID, "bf16-mixed", torch.bfloat16),
             ("fp8-delayed", DeepSpeedStrategy(stage=3), 3, DelayedScaling, Format.HYBRID, "bf16-mixed",
              torch.bfloat16),
             ("FP8-Current", "deepspeed_stage_3_offload", 3, Float8CurrentScaling, Format.HYBRID, "bf16-mixed",
              torch.bfloat16),
             ("fp8-e4m3-float16", "deepspeed_stage_1", 1, AutoRecipe, Format.E4M3, "16-mixed", torch.float16)]
    for precision, strategy, stage, recipe_type, fmt, ds_precision, compute_dtype in cases:
        trainer = pl.Trainer(precision=precision, strategy=strategy, **flags)
        plugin = trainer.precision_plugin
        assert type(plugin) is FP8DeepSpeedPrecision, (precision, strategy)
        assert isinstance(trainer.strategy, DeepSpeedStrategy)
        assert trainer.strategy.config["zero_optimization"]["stage"] == stage
        assert type(plugin.fp8.recipe) is recipe_type and plugin.fp8.recipe.fp8_format is fmt
        assert plugin.precision == ds_precision and plugin.fp8.compute_dtype == compute_dtype

    with pytest.raises(ValueError, match=r"precision='fp8-e5m2' is not a valid FP8 precision; valid: fp8-hybrid, "
                                         r"fp8-e4m3, fp8-hybrid-float16, fp8-e4m3-float16, fp8-delayed"):
        pl.Trainer(precision="fp8-e5m2", strategy="deepspeed_stage_2", **flags)
    with pytest.raises(ValueError, match="choose one"):
        pl.Trainer(precision="fp8-hybrid", strategy="deepspeed_stage_2", plugins=[FP8DeepSpeedPrecision()], **flags)
    # Fabric has no FP8 DeepSpeed plugin: refused at construction, naming the loops that have one.
    import lightning as L

    with pytest.raises(ValueError, match="strategy='deepspeed_stage_3' is not supported by Fabric: .*the Lightning "
                                         "Trainer and fp8_plugin.accelerate.Accelerator have one.*Valid strategies"):
        L.Fabric(precision="fp8-hybrid", strategy="deepspeed_stage_3", accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match="FP8DeepSpeedPrecision\\(...\\)\\] is the FP8 plugin of the Trainer; Fabric "
                                        "takes fp8_plugin.fabric.FP8Precision"):
        L.Fabric(plugins=[FP8DeepSpeedPrecision()], accelerator="cpu", devices=1)
