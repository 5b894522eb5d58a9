"""A real Accelerate loop under DeepSpeed ZeRO on CPU (gloo), started by tests/training/test_deepspeed.py
under torchrun with two processes. ``--precision fp8`` uses fp8_plugin.accelerate.Accelerator,
``--precision bf16`` plain Accelerate (the reference run); both with DeepSpeed's bf16.
``--precision fp16`` runs :func:`fp16_skips` instead (DeepSpeed's fp16 and its loss scaler);
``--model llama`` runs :func:`llama_saves_pretrained` instead (a transformers model trained in FP8,
saved with ``save_pretrained`` as Accelerate documents for ZeRO-3).

It trains ``--steps`` optimizer steps of ``--grad-accum`` micro-batches, saves the state
(``accelerator.save_state``: DeepSpeed's save_checkpoint) after ``--save-at`` steps, trains on,
then loads that state and trains the same last steps again; writes what it saw to
``<out>/rank<R>.pt``.

    python deepspeed_worker.py <out> --stage S [--precision fp8|bf16|fp16] [--model net|llama]
        [--steps N] [--grad-accum K] [--from-env]
    python deepspeed_worker.py <out> --runs 2:bf16,2:fp8,2:reference,3:fp8,3:llama,...

``--runs`` runs one after the other in the same launch, each with an Accelerator of its own,
into ``<out>/<stage>/<run>`` (``reference``: :func:`reference_checks`; ``llama``:
:func:`llama_saves_pretrained`): a launch's start is most of such a small run's time.

With ``--from-env`` (under ``accelerate launch --config_file ...``) the Accelerator takes
everything from the environment the launcher sets from the config file.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from torch import nn  # noqa: E402

import fp8_plugin.modules.linear_function  # noqa: E402
from amax_reductions import MAX_ALL_REDUCES  # noqa: E402  (counts every amax all-reduce)
from fp8_plugin.modules.linear import FP8Linear  # noqa: E402
from fp8_plugin.training.reference import ReferenceChecker  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402


def _start_deepspeed_on_cpus() -> None:
    """Two shims for this CPU-only test machine, neither touching what is under test.

    Accelerate starts DeepSpeed's process group only with an accelerator backend (nccl, ...):
    on a machine without one it sees a single process, while DeepSpeed then joins the real
    (gloo) group, so the data would not be sharded. Here Accelerate's backend choice answers
    gloo / multi-CPU instead, after which Accelerate starts DeepSpeed's group itself.
    DeepSpeed's CPU back end also JIT-compiles a shared-memory all-reduce that serves only its
    inference path: skipped (plain gloo collectives are used either way).
    """
    import importlib

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # (deepspeed.comm re-exports the torch package as ``torch``: the module is looked up by path.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    prepare_backend = PartialState._prepare_backend

    def cpu_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        if distributed_type == DistributedType.NO and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, distributed_type

    PartialState._prepare_backend = cpu_backend


_start_deepspeed_on_cpus()
FP8_GEMMS = [0]
_fp8_gemm = fp8_plugin.modules.linear_function.fp8_gemm


def _counting_gemm(*args, **kwargs):
    FP8_GEMMS[0] += 1
    return _fp8_gemm(*args, **kwargs)


fp8_plugin.modules.linear_function.fp8_gemm = _counting_gemm
CHECK_GEMMS = [0]  # of those, the FP8 GEMMs the reference checks ran (replays and figures)
_run_check = ReferenceChecker.run


def _counted_check(self, *args, **kwargs):
    before = FP8_GEMMS[0]
    try:
        return _run_check(self, *args, **kwargs)
    finally:
        CHECK_GEMMS[0] += FP8_GEMMS[0] - before


ReferenceChecker.run = _counted_check


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def ds_config(stage: int, grad_accum: int, precision: str = "bf16") -> dict:
    # fp16: DeepSpeed's dynamic loss scaler, from 2**8 (no overflow of this tiny model's gradients).
    half = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}} \
        if precision == "fp16" else {"bf16": {"enabled": True}}
    return {**half,
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {
            "stage": stage,
            # Partition every parameter under ZeRO-3 (the default keeps small ones whole).
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def full_fp32_weights(model) -> dict:
    # The FP32 master weights, whole, on every rank (ZeRO partitions them across ranks).
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).clone() for name, p in model.module.named_parameters()}


def fp8_state(model) -> dict:
    return {name: {k: v.clone() for k, v in m.fp8_state.get_extra_state().items()}
            for name, m in model.module.named_modules() if isinstance(m, FP8Linear)}


def fp16_skips(args, out: Path):
    """DeepSpeed fp16 with FP8: a non-finite gradient (an inf input on rank 0 in optimizer step
    2) makes DeepSpeed's dynamic loss scaler skip that step on both ranks; the FP8 step still
    ends (one amax reduction), and the skip is counted."""
    from deepspeed.accelerator import get_accelerator

    from fp8_plugin.accelerate import Accelerator

    # DeepSpeed's CPU back end allows fp16 only where oneDNN has fast fp16 kernels (a speed
    # gate): fp16 itself computes on any CPU.
    get_accelerator().is_fp16_supported = lambda: True
    gemms_before, reduces_before = FP8_GEMMS[0], len(MAX_ALL_REDUCES)
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, args.grad_accum, "fp16"))
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float16, deepspeed_plugin=plugin,
                              gradient_accumulation_steps=args.grad_accum)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    n = 16 * args.steps * args.grad_accum * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(n, 32, generator=generator) * 3,
                                          torch.randn(n, 16, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    run = accelerator.fp8_runs[0]
    applied, skips, weights, reduces = [], [], [full_fp32_weights(model)], []
    for index, (x, y) in enumerate(loader):
        step, last = divmod(index, args.grad_accum)
        if step == 1 and last == args.grad_accum - 1 and accelerator.process_index == 0:
            x = x.clone()
            x[0, 0] = float("inf")
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x.to(torch.float16)).float(), y)
            accelerator.backward(loss)
        if accelerator.sync_gradients:
            applied.append(model.was_step_applied())
            skips.append(int(run.faults._scaler_skipped))  # loss-scaler skips in a row, as counted
            weights.append(full_fp32_weights(model))
            reduces.append(MAX_ALL_REDUCES[reduces_before + len(sum(reduces, [])):])
    result = {
        "applied": applied,
        "weights": weights,
        "max_all_reduces": reduces,
        "optimizer_steps": run.optimizer_steps,
        "scaler_skips": skips,
        "train_fp8_gemms": FP8_GEMMS[0] - gemms_before,
        "fp8_state": fp8_state(model),
        "param_dtypes": sorted({str(p.dtype) for p in model.module.parameters()}),
    }
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{accelerator.process_index}.pt")
    return accelerator


LLAMA_STEPS = 2


def make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def llama_saves_pretrained(args, out: Path):
    """A tiny LlamaForCausalLM trained in FP8 through fp8_plugin.accelerate.Accelerator, then
    saved the way Accelerate documents for ZeRO-3: ``accelerator.get_state_dict(model)`` (which
    gathers the 16-bit weights from the partitions when
    ``stage3_gather_16bit_weights_on_model_save`` is on), then ``save_pretrained`` of the
    unwrapped model with that state dict into ``<out>/pretrained``. The test loads it with plain
    transformers in its own process: here transformers sees DeepSpeed's ZeRO-3 config and would
    load through ``deepspeed.zero.Init`` (collectives on the loading rank alone)."""
    from fp8_plugin.accelerate import Accelerator

    gemms_before = FP8_GEMMS[0]
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, args.grad_accum))
    accelerator = Accelerator(mixed_precision="fp8", deepspeed_plugin=plugin,
                              gradient_accumulation_steps=args.grad_accum)
    model = make_llama()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    n = 16 * args.steps * args.grad_accum * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randint(1, 128, (n, 16), generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for (ids,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    result = {
        "zero_stage": model.zero_optimization_stage(),
        "steps": args.steps,
        "train_fp8_gemms": FP8_GEMMS[0] - gemms_before,
        "fp8_layers": sorted(n for n, m in model.module.named_modules() if isinstance(m, FP8Linear)),
        "initial_weights": initial,
        "weights": full_fp32_weights(model),  # the FP32 masters, gathered from the partitions
    }
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    saved = out / "pretrained"
    accelerator.unwrap_model(model).save_pretrained(saved, is_main_process=accelerator.is_main_process,
                                                    state_dict=state_dict)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{accelerator.process_index}.pt")
    return accelerator


def frozen_lora(args, out: Path):
    """PEFT LoRA over a tiny Llama whose base (frozen before the FP8 Accelerator converts it)
    is kept only in FP8, under ZeRO ``args.stage``: ``--steps`` steps of one micro-batch,
    ``save_state`` after ``--save-at``, then the last steps again from it."""
    from peft import LoraConfig, get_peft_model

    from fp8_plugin.accelerate import Accelerator

    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, 1))
    accelerator = Accelerator(mixed_precision="fp8", deepspeed_plugin=plugin)

    def lora():
        return get_peft_model(make_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))

    refusal = None
    model = lora()
    if args.stage == 3:  # gloo cannot all-gather float8 partitions: refused at prepare, then the way out
        try:
            accelerator.prepare(model)
        except ValueError as err:
            refusal = str(err)
        model = lora()
        fp8_plugin.convert_model(model, fp8_plugin.DelayedScaling(), frozen_weights="keep")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    n = 16 * args.steps * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randint(1, 128, (n, 16), generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    gemms_before = FP8_GEMMS[0]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = [ids for (ids,) in loader]
    frozen = {name: m for name, m in model.module.named_modules()
              if isinstance(m, FP8Linear) and m.frozen_layout is not None}

    def frozen_bytes():
        return {name: (m.weight.detach().view(torch.uint8).clone(), m.weight_scale_inv.detach().clone())
                for name, m in frozen.items()}

    def train(steps):
        losses = []
        for step in steps:
            loss = model(input_ids=batches[step], labels=batches[step]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    before = frozen_bytes()
    losses = train(range(args.save_at))
    accelerator.save_state(str(out / "checkpoint"))
    losses += train(range(args.save_at, args.steps))
    result = {"zero_stage": model.zero_optimization_stage(), "losses": losses, "refusal": refusal,
              "train_fp8_gemms": FP8_GEMMS[0] - gemms_before, "frozen_layers": sorted(frozen),
              "frozen_before": before, "frozen_after": frozen_bytes(),
              "adapters": {n: p.detach().clone() for n, p in model.module.named_parameters() if p.requires_grad}}
    accelerator.load_state(str(out / "checkpoint"))
    result["resumed_losses"] = train(range(args.save_at, args.steps))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{accelerator.process_index}.pt")
    return accelerator


def reference_checks(args, out: Path):
    """Reference checks under DeepSpeed (``--reference``): a fault planted on rank 1 only (its
    inputs carry channel 0 at 1e6, whose weight column in layer 0 is zero and kept zero; current
    scaling, so only rank 1's layer 0 flushes its other inputs to zero). Checks every 2 steps
    with ``policy="fallback"``; the state is saved after step 3, then step 4 (checked) is run again
    from it with the checks off: a check that leaves training alone gives the same weights."""
    import fp8_plugin
    from fp8_plugin.accelerate import Accelerator

    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, 1))
    accelerator = Accelerator(mixed_precision="fp8", deepspeed_plugin=plugin,
                              fp8_recipe=fp8_plugin.Float8CurrentScaling(),
                              fp8_reference_check=fp8_plugin.ReferenceCheck(every=2, policy="fallback"))
    model = _LossOf(make_model())
    with torch.no_grad():
        model.net[0].weight[:, 0] = 0
    model.net[0].weight.register_hook(lambda grad: grad.index_fill(1, torch.tensor([0], device=grad.device), 0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    batches = [(torch.randn(16, 32, generator=generator), torch.randn(16, 16, generator=generator))
               for _ in range(4)]
    if accelerator.process_index == 1:
        for x, _ in batches:
            x[:, 0] = 1e6
    run = accelerator.fp8_runs[0]

    def train(steps: range) -> None:
        for step in steps:
            x, y = batches[step]
            accelerator.backward(model(x.to(torch.bfloat16), y))
            optimizer.step()
            optimizer.zero_grad()

    train(range(3))
    accelerator.save_state(str(out / "checkpoint"))
    train(range(3, 4))
    result = {
        "results": [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in run.reference.results],
        "use_fp8": {n: m.use_fp8 for n, m in model.module.net.named_modules() if isinstance(m, FP8Linear)},
        "weights": full_fp32_weights(model),
    }
    accelerator.load_state(str(out / "checkpoint"))
    result["loaded_checks"] = (run.reference.steps, len(run.reference.results))  # as saved after step 3
    run.reference = None  # step 4 again, unchecked
    train(range(3, 4))
    result["unchecked_weights"] = full_fp32_weights(model)
    # One check by hand on the same micro-batch on every rank (fp8_plugin.reference_check, the
    # fault's channel included on both): whole-gradient sums and averaged-gradient parts agree.
    same = (batches[0][0].clone(), batches[0][1].clone())
    dist.broadcast(same[0], 0)
    dist.broadcast(same[1], 0)
    check = fp8_plugin.reference_check(model.module, (same[0].to(torch.bfloat16), same[1]),
                                       lambda module, batch: module(*batch))
    result["same_batch"] = {k: v for k, v in check.to_dict().items() if k != "seconds"}
    result["numel"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.module.parameters())
    result["unchecked_use_fp8"] = {n: m.use_fp8 for n, m in model.module.net.named_modules()
                                   if isinstance(m, FP8Linear)}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{accelerator.process_index}.pt")
    return accelerator


class _LossOf(nn.Module):
    """A model returning its MSE loss, as transformers models return ``.loss``: the replay reads it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).float(), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--precision", default="fp8", choices=RUNS[:3])
    parser.add_argument("--runs", default="",
                        help="several runs in this launch, 'STAGE:RUN,...' (RUN: fp8, bf16, fp16, llama, reference), "
                             "each into <out>/<STAGE>/<RUN>; --stage and --precision are then ignored")
    parser.add_argument("--model", default="net", choices=("net", "llama"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--from-env", action="store_true", help="the Accelerator from accelerate launch's environment")
    args = parser.parse_args()

    runs = parse_runs(parser, args.runs, RUNS) if args.runs else [(str(args.stage), args.precision)]
    accelerator = None
    # One launch, several runs: each a new Accelerator on the same process group (the start of a
    # launch, imports and group, is most of a small run's time).
    for stage, name in runs:
        if accelerator is not None:
            _reset_accelerate()
        run_args = argparse.Namespace(**{**vars(args), "stage": int(stage)})
        out = args.out / stage / name if args.runs else args.out
        if name == "fp16":
            accelerator = fp16_skips(run_args, out)
        elif name == "reference":
            accelerator = reference_checks(run_args, out)
        elif name == "frozen-lora":
            accelerator = frozen_lora(run_args, out)
        elif name == "llama" or args.model == "llama":
            if name == "llama":  # LLAMA_STEPS steps of one micro-batch
                run_args.steps, run_args.grad_accum = LLAMA_STEPS, 1
            accelerator = llama_saves_pretrained(run_args, out)
        else:
            accelerator = train_and_resume(run_args, name, out)
    tear_down_process_group()  # before Accelerate's destroy, which frees nothing first
    accelerator.end_training()


RUNS = ("fp8", "bf16", "fp16", "llama", "reference", "fp8-adamw", "frozen-lora")


def parse_runs(parser: argparse.ArgumentParser, spec: str, names: tuple) -> list[tuple[str, str]]:
    """``"STAGE:RUN,..."`` as ``[(stage, run), ...]`` (the DeepSpeed workers' ``--runs``)."""
    runs = [tuple(item.split(":")) for item in spec.split(",")]
    if any(len(r) != 2 or r[0] not in "0123" or r[1] not in names for r in runs):
        parser.error(f"--runs {spec}: valid: STAGE:RUN,... with STAGE 0-3 and RUN one of {', '.join(names)}")
    return runs


def _reset_accelerate() -> None:
    # A new Accelerator with other settings in this process: Accelerate's shared state starts
    # afresh (the process group stays).
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _base_optimizer(optimizer):
    # The client optimizer under Accelerate's and DeepSpeed's wrappers (each holds the next as .optimizer).
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def train_and_resume(args, precision: str, out: Path):
    # "fp8-adamw": the FP8 run with fp8_plugin.optim.FP8AdamW as the client optimizer.
    fp8_adamw = precision == "fp8-adamw"
    precision = "fp8" if fp8_adamw else precision
    if precision == "fp8":
        from fp8_plugin.accelerate import Accelerator
    else:
        from accelerate import Accelerator
    if args.from_env:  # what `accelerate launch` set from a config file: DeepSpeed, precision, fp8_config
        accelerator = Accelerator()
    else:
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, args.grad_accum))
        # The FP8 run samples the per-layer statistics every 2 optimizer steps.
        fp8 = {"fp8_statistics": 2} if precision == "fp8" else {}
        accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin,
                                  gradient_accumulation_steps=args.grad_accum, **fp8)
    gemms_before, reduces_before = FP8_GEMMS[0], len(MAX_ALL_REDUCES)
    model = make_model()
    optimizer = (fp8_plugin.optim.FP8AdamW if fp8_adamw else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    n = 16 * args.steps * args.grad_accum * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(n, 32, generator=generator) * 3,
                                          torch.randn(n, 16, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)
    per_step = args.grad_accum

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            for x, y in batches[step * per_step:(step + 1) * per_step]:
                input_amaxes.append(float(x.to(torch.bfloat16).abs().max()))
                with accelerator.accumulate(model):
                    # DeepSpeed's bf16 casts the model to bf16: the inputs too (both runs alike).
                    loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
            reduces.append(MAX_ALL_REDUCES[reduces_before + len(sum(reduces, [])):])
            statistics.append(accelerator.fp8_reference_metrics() if precision == "fp8" else {})
        return losses

    reduces: list[list[int]] = []
    input_amaxes: list[float] = []  # per micro-batch: the largest magnitude of the bf16 inputs
    statistics: list[dict] = []  # per optimizer step: the fp8_stats/ figures it formed
    losses = train(range(args.save_at))
    checkpoint = out / "checkpoint"
    accelerator.save_state(str(checkpoint))
    losses += train(range(args.save_at, args.steps))
    train_gemms = FP8_GEMMS[0] - gemms_before
    result = {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "zero_stage": model.zero_optimization_stage(),
        "param_dtypes": sorted({str(p.dtype) for p in model.module.parameters()}),
        "losses": losses,
        "max_all_reduces": reduces,
        "input_amaxes": input_amaxes,
        "statistics": statistics,
        "train_fp8_gemms": train_gemms,
        "fp8_layers": sorted(n for n, m in model.module.named_modules() if isinstance(m, FP8Linear)),
        "weight_cache": [m.cache_fp8_weights for m in model.module.modules() if isinstance(m, FP8Linear)],
        "fp8_state": fp8_state(model),
        "weights": full_fp32_weights(model),
    }
    base = _base_optimizer(optimizer)
    result["base_optimizer"] = type(base).__name__
    result["moment_dtypes"] = sorted({str(s["exp_avg"].dtype) for s in base.state.values()})
    # The consolidated weights (gathered across ranks under ZeRO-3) load into the plain model.
    consolidated = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        plain = make_model()
        plain.load_state_dict({k: v.float() for k, v in consolidated.items()}, strict=True)
        result["consolidated_matches_master"] = all(
            torch.equal(p, result["weights"][name].to(torch.bfloat16).float()) for name, p in plain.named_parameters())
    # Resume: the state saved after save_at steps, then the same last steps again.
    accelerator.load_state(str(checkpoint))
    result["resumed_losses"] = train(range(args.save_at, args.steps))
    result["resumed_fp8_state"] = fp8_state(model)
    result["resumed_weights"] = full_fp32_weights(model)
    if args.stage == 3:
        # ZeRO-3 gathers each weight into a fresh buffer for each forward and updates the
        # partitions outside the parameter. A weight changed that way (here: doubled through
        # DeepSpeed's GatheredParameters, no optimizer step, no FP8 hook) must reach the next
        # forward; a cached FP8 copy keyed on the parameter's version and address would not.
        import deepspeed

        x = batches[0][0].to(torch.bfloat16)
        last = model.module[4]
        with torch.no_grad():
            before = model(x).float()
            with deepspeed.zero.GatheredParameters([last.weight, last.bias], modifier_rank=0):
                last.weight.data.mul_(2)
                last.bias.data.mul_(2)
            after = model(x).float()
        result["regathered_ratio"] = (after / before).flatten()

    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{accelerator.process_index}.pt")
    return accelerator


if __name__ == "__main__":
    sys.exit(main())
