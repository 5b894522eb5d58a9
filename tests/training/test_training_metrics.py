"""fp8_plugin/training/core.py: ``FP8Training.metrics``, the figures every adapter logs, for FP8
linear layers and FP8 MoE experts modules."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from fp8_plugin import FP8Linear
from fp8_plugin.modules.autocast import autocast
from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts
from fp8_plugin.numerics.recipes import DelayedScaling
from fp8_plugin.training.core import FP8Training

E4M3_MAX = 448.0
LAYERS, EXPERTS = 2, 4


def tiny_mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64))


def train(run: FP8Training, model, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` FP8 training steps through ``run``; each expert weight as each step's forward saw it."""
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    before = expert_gemm_counts()
    for _ in range(steps):
        seen.append({(name, proj): getattr(m, proj).detach().clone() for name, m in model.named_modules()
                     if isinstance(m, FP8ExpertsMixin) for proj in ("gate_up_proj", "down_proj")})
        ids = torch.randint(0, 128, (2, 9), generator=gen)
        with run.forward_context("cpu"):
            loss = model(ids, labels=ids).loss
        loss.backward()
        assert run.before_optimizer_step()
        opt.step()
        opt.zero_grad()
        run.after_optimizer_step()
    after = expert_gemm_counts()
    # Every experts module ran both projections' fprop, dgrad and wgrad as grouped FP8 GEMMs.
    want = 2 * LAYERS * steps
    assert {k: after[k] - before[k] for k in after} == {"fprop": want, "dgrad": want, "wgrad": want}
    return seen


def test_metrics_cover_fp8_experts_modules_and_their_per_expert_scales():
    model = tiny_mixtral()
    run = FP8Training(DelayedScaling(), compute_dtype=torch.float32)
    run.convert(model)
    seen = train(run, model, steps=2)
    metrics = run.metrics()

    # Mixtral's q, k, v, o per decoder layer are FP8 linear layers (the router and lm_head are not).
    assert metrics["fp8/layers"] == 4 * LAYERS
    assert metrics["fp8/experts"] == LAYERS
    assert metrics["fp8/expert_projections"] == LAYERS * EXPERTS * 2
    # Delayed scaling: after two steps each expert's weight scale is 448 / (the largest weight amax
    # in its history, the two steps' casts), in float32, computed here from the weights themselves.
    weight_scales = []
    for (name, proj) in seen[0]:
        amax = torch.stack([s[(name, proj)].abs().amax(dim=(1, 2)) for s in seen]).amax(dim=0).double()
        expect = (E4M3_MAX / amax).float()
        states = model.get_submodule(name).fp8_scaling[proj]
        got = torch.stack([g.fp8_state.scale[1] for g in states])
        assert torch.equal(got, expect), (name, proj)
        weight_scales.append(expect)
    # Its weight scales lie within the experts' reported range; the range is that of every
    # expert's input, weight and grad_output scale, and the overall range spans the FP8 linear
    # layers' scales too.
    weight_scales = torch.cat(weight_scales)
    assert metrics["fp8/experts_scale_min"] <= weight_scales.min().item()
    assert metrics["fp8/experts_scale_max"] >= weight_scales.max().item()
    expert_scales = torch.cat([g.fp8_state.scale for m in model.modules() if isinstance(m, FP8ExpertsMixin)
                               for states in m.fp8_scaling.values() for g in states])
    linear_scales = torch.cat([m.fp8_state.scale for m in model.modules() if isinstance(m, FP8Linear)])
    assert (metrics["fp8/experts_scale_min"], metrics["fp8/experts_scale_max"]) == (
        expert_scales.min().item(), expert_scales.max().item())
    assert (metrics["fp8/scale_min"], metrics["fp8/scale_max"]) == (
        min(expert_scales.min(), linear_scales.min()).item(), max(expert_scales.max(), linear_scales.max()).item())
    assert metrics["fp8/nonfinite_amax"] == 0.0 and metrics["fp8/amax_outliers"] == 0.0

    # The fault counters of an expert's scaling state are summed in with the linear layers'.
    expert = model.model.layers[1].mlp.experts.fp8_scaling["down_proj"][3].fp8_state
    expert.nonfinite_amax_count[2] += 2
    expert.outlier_count[0] += 1
    model.model.layers[0].self_attn.q_proj.fp8_state.nonfinite_amax_count[0] += 1
    metrics = run.metrics()
    assert metrics["fp8/nonfinite_amax"] == 3.0 and metrics["fp8/amax_outliers"] == 1.0


def test_metrics_of_a_model_whose_only_fp8_modules_are_experts():
    model = tiny_mixtral()
    run = FP8Training(DelayedScaling(), compute_dtype=torch.float32, exclude=["*self_attn*"])
    run.convert(model)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    train(run, model, steps=1)
    metrics = run.metrics()
    assert metrics["fp8/layers"] == 0.0 and metrics["fp8/experts"] == LAYERS
    assert metrics["fp8/expert_projections"] == LAYERS * EXPERTS * 2
    assert metrics["fp8/scale_min"] == metrics["fp8/experts_scale_min"] > 0
    assert metrics["fp8/scale_max"] == metrics["fp8/experts_scale_max"]


def test_metrics_of_a_model_without_experts_keep_their_keys():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    run = FP8Training(DelayedScaling(), compute_dtype=torch.float32)
    run.convert(model)
    with run.forward_context("cpu"):
        model(torch.randn(4, 16)).sum().backward()
    run.after_optimizer_step()
    metrics = run.metrics()
    assert set(metrics) == {"fp8/layers", "fp8/scale_min", "fp8/scale_max", "fp8/nonfinite_amax",
                            "fp8/amax_outliers", "fp8/nonfinite_skipped_steps"}
    assert metrics["fp8/layers"] == 2.0
    assert FP8Training(DelayedScaling()).metrics() == {}
