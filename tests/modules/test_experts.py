"""FP8 MoE experts (fp8_plugin.modules.experts, fp8_plugin.numerics.grouped_gemm).

Numerics are checked against float64 products of the dequantized FP8 operands, cast here with
the scales of Transformer Engine's formula (``fp8_max / amax`` per expert), within the
float32-accumulation bound; model-level tests count the grouped FP8 GEMMs, so that experts that
silently ran in high precision fail them.
"""

import copy
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp8_plugin.modules.autocast import autocast, update_pending_scales  # noqa: E402
from fp8_plugin.modules.convert import convert_model, fp8_state_dict, split_fp8_state  # noqa: E402
from fp8_plugin.modules.experts import (  # noqa: E402
    ROUTER_REASON, FP8ExpertsMixin, expert_gemm_counts, fp8_grouped_linear,
)
from fp8_plugin.numerics.quantizers import ScalingState  # noqa: E402
from fp8_plugin.numerics.recipes import (  # noqa: E402
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
)

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from reference import assert_state_dicts_equal  # noqa: E402

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
U32 = 2.0**-24  # float32 unit roundoff


def tiny_config(**kwargs) -> MixtralConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    return MixtralConfig(**{**base, **kwargs})


def tiny_mixtral(seed: int = 0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    return MixtralForCausalLM(tiny_config())


# ---------------------------------------------------------------- grouped GEMMs against float64


def dequantized(x: torch.Tensor, groups: list[tuple[int, int]], fp8: torch.dtype, fp8_max: float) -> torch.Tensor:
    """Float64 copy of ``x`` [S, K] as cast per group with scale fp8_max / amax (1 for amax 0)."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for start, stop in groups:
        part = x[start:stop].float()
        amax = part.abs().max() if part.numel() else torch.zeros(())
        scale = torch.tensor(fp8_max, dtype=torch.float32) / amax if amax > 0 else torch.ones(())
        data = (part * scale).clamp(-fp8_max, fp8_max).to(fp8)
        out[start:stop] = data.double() * (1.0 / scale).double()
    return out


def accumulation_bound(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """|fl32(a @ b) - a @ b| for float64 a [M, K], b [K, N]: gamma_K of float32 summation plus
    one float32 rounding of each dequantized operand (2 u) and of the float32 output (u)."""
    absprod = a.abs() @ b.abs()
    return (k + 3) * U32 * 1.01 * absprod


def run_grouped(counts, k, n, transposed, seed, recipe=None, stale_rows=False, token_scaling="current"):
    gen = torch.Generator().manual_seed(seed)
    experts, rows = len(counts), sum(counts)
    expert_of_row = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts, dtype=torch.int64))
    # Experts with different magnitudes: one scale per expert must follow each.
    mags = torch.exp2(torch.randint(-6, 7, (experts,), generator=gen).float())
    x = (torch.randn(rows, k, generator=gen) * mags[expert_of_row].unsqueeze(1)).requires_grad_()
    w = torch.randn(experts, n, k, generator=gen) * mags.view(-1, 1, 1)
    weight = (w.transpose(1, 2).contiguous() if transposed else w).requires_grad_()
    grad_out = torch.randn(rows, n, generator=gen) * 1e-3
    states = [ScalingState(1) for _ in range(experts)]
    recipe = recipe or Float8CurrentScaling()  # HYBRID: E4M3 forward, E5M2 gradients
    if stale_rows:  # delayed scales of input and grad_output from amaxes 1000x below these rows'
        for e, state in enumerate(states):
            state.scale[0] = E4M3_MAX / (mags[e] * 4e-3)
            state.scale[2] = E5M2_MAX / (mags[e] * 4e-6)
            state.initialized[0] = state.initialized[2] = True
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)  # torch's offs: end rows
    y = fp8_grouped_linear(x, weight, expert_of_row, ends, states, recipe, transposed=transposed,
                           token_scaling=token_scaling)
    y.backward(grad_out)
    return x, w, grad_out, y, weight.grad if not transposed else weight.grad.transpose(1, 2)


def check_grouped(counts, k, n, transposed, seed, **kwargs):
    x, w, g, y, grad_w = run_grouped(counts, k, n, transposed, seed, **kwargs)
    groups, start = [], 0
    for c in counts:
        groups.append((start, start + c))
        start += c
    xq = dequantized(x.detach(), groups, torch.float8_e4m3fn, E4M3_MAX)
    gq = dequantized(g, groups, torch.float8_e5m2, E5M2_MAX)
    for e, (start, stop) in enumerate(groups):
        wq = dequantized(w[e], [(0, n)], torch.float8_e4m3fn, E4M3_MAX)  # one scale for the expert's weight
        rows = slice(start, stop)
        want_y = xq[rows] @ wq.T  # fprop
        bound = accumulation_bound(xq[rows], wq.T, k)
        assert ((y[rows].double() - want_y).abs() <= bound).all(), f"fprop, expert {e}"
        want_dx = gq[rows] @ wq  # dgrad
        bound = accumulation_bound(gq[rows], wq, n)
        assert ((x.grad[rows].double() - want_dx).abs() <= bound).all(), f"dgrad, expert {e}"
        want_dw = gq[rows].T @ xq[rows]  # wgrad, contraction over the expert's tokens
        bound = accumulation_bound(gq[rows].T, xq[rows], stop - start)
        assert ((grad_w[e].double() - want_dw).abs() <= bound).all(), f"wgrad, expert {e}"
        if stop == start:
            assert torch.equal(grad_w[e], torch.zeros_like(grad_w[e]))


def test_grouped_gemms_match_float64_with_empty_experts_odd_counts_and_one_busy_expert():
    check_grouped([7, 0, 13, 1], k=48, n=24, transposed=False, seed=0)  # empty expert, odd counts
    check_grouped([0, 0, 21, 0], k=32, n=16, transposed=True, seed=1)  # all tokens to one expert
    check_grouped([0, 0], k=1, n=4, transposed=False, seed=2)  # no tokens at all
    check_grouped([1], k=1, n=4, transposed=False, seed=0)  # size-1 dims: strides the kernel misreads


def test_token_rows_take_their_own_amax_under_delayed_scaling_whatever_their_history():
    # Delayed scales of input and grad_output that a young history left 1000x too large: with
    # the default token scaling each expert's rows are cast by their own amax (the float64
    # expectation of current scaling holds), and the weights, uninitialized, by their own.
    check_grouped([7, 0, 13, 1], k=48, n=24, transposed=False, seed=0, recipe=DelayedScaling(), stale_rows=True)
    # As the recipe says, the same rows saturate at the stale scales: the expectation fails.
    with pytest.raises(AssertionError, match="fprop"):
        check_grouped([7, 0, 13, 1], k=48, n=24, transposed=False, seed=0, recipe=DelayedScaling(),
                      stale_rows=True, token_scaling="recipe")


def test_a_token_scaling_outside_the_choices_is_refused_naming_them():
    experts = mixtral_experts(torch.float32)
    convert_model(experts, DelayedScaling())
    with pytest.raises(ValueError, match=r"token_scaling='delayed'.*valid: 'current', 'recipe'"):
        experts.token_scaling = "delayed"
    assert experts.token_scaling == "current"
    x = torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match=r"token_scaling=None.*valid"):
        fp8_grouped_linear(x[0], x, torch.zeros(3, dtype=torch.int64), None, [ScalingState(1) for _ in range(8)],
                           DelayedScaling(), token_scaling=None)


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(0, 19), min_size=1, max_size=5),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemms_match_float64_over_shapes_and_routings(counts, k, n, transposed, seed):
    check_grouped(counts, k, n, transposed, seed)


# ---------------------------------------------------------------- the experts module


def mixtral_experts(dtype=torch.float64):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = tiny_config()
    cfg._experts_implementation = "eager"
    experts = MixtralExperts(cfg).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def cast_error(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Bound on |fp8(t) - t| for an E4M3 cast with scale 448 / amax', amax' <= ``amax``: 3 mantissa
    bits (relative 2^-4) in the normal range, half the subnormal spacing 2^-9 below it, i.e.
    2^-10 / scale <= 2^-10 * amax / 448 (OCP OFP8 rev 1.0)."""
    return 2.0**-4 * t.abs() + 2.0**-10 * amax / E4M3_MAX


def gemm_error(w, dw, x, dx, k):
    """Bound on |fl(W^ x^) - W x| for |W^ - W| <= dw, |x^ - x| <= dx: the operand errors and
    float32 accumulation over k terms plus the output rounding (gamma_{k+1})."""
    first = dw @ x.abs() + w.abs() @ dx + dw @ dx
    return first + (k + 1) * U32 * 1.01 * ((w.abs() + dw) @ (x.abs() + dx))


def experts_reference(experts, x, top_k_index, top_k_weights):
    """Float64 experts forward, and a bound on the FP8 forward's error propagated through it to
    first order and beyond (E4M3 casts of both GEMMs' operands; |silu'| <= 1.1)."""
    inter = experts.intermediate_dim
    x_amax = x.abs().max()
    pairs = []
    for t in range(x.shape[0]):
        for slot in range(top_k_index.shape[1]):
            e = int(top_k_index[t, slot])
            w1 = experts.gate_up_proj[e].detach()
            h = w1 @ x[t]
            dh = gemm_error(w1, cast_error(w1, w1.abs().max()), x[t], cast_error(x[t], x_amax), x.shape[1])
            gate, up, dgate, dup = h[:inter], h[inter:], dh[:inter], dh[inter:]
            a = torch.nn.functional.silu(gate) * up
            da = 1.1 * dgate * (up.abs() + dup) + torch.nn.functional.silu(gate).abs() * dup
            pairs.append((t, slot, e, a, da))
    a_amax = max((a.abs() + da).max() for *_, a, da in pairs)  # any expert's amax of its input
    out, err = torch.zeros_like(x), torch.zeros_like(x)
    for t, slot, e, a, da in pairs:
        w2 = experts.down_proj[e].detach()
        d_in = da + cast_error(a.abs() + da, a_amax)  # the computed a, then its cast
        y = w2 @ a
        dy = gemm_error(w2, cast_error(w2, w2.abs().max()), a, d_in, inter)
        out[t] += top_k_weights[t, slot] * y
        err[t] += top_k_weights[t, slot] * dy
    return out, err * 1.001 + 1e-12  # the float64 reference's own rounding


@pytest.mark.parametrize("routing", ["spread", "one_expert_each", "two_experts_only"])
def test_experts_module_forward_within_fp8_bound_of_float64(routing):
    experts = mixtral_experts()
    reference = copy.deepcopy(experts)
    convert_model(experts, Float8CurrentScaling())
    assert isinstance(experts, FP8ExpertsMixin)
    gen = torch.Generator().manual_seed(3)
    tokens = 7  # not a multiple of 16
    x = torch.randn(tokens, 64, generator=gen, dtype=torch.float64)
    if routing == "spread":
        index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    elif routing == "one_expert_each":  # every token's first choice is expert 0: experts 0 and 3 only
        index = torch.tensor([[0, 3]] * tokens)
    else:  # experts 1 and 2 receive nothing
        index = torch.tensor([[0, 3], [3, 0]] * 3 + [[0, 3]])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen, dtype=torch.float64), dim=-1)
    before = expert_gemm_counts()
    with torch.no_grad(), autocast():
        got = experts(x, index, weights)
    assert expert_gemm_counts()["fprop"] == before["fprop"] + 2
    want, bound = experts_reference(reference, x, index, weights)
    assert got.dtype == torch.float64
    assert ((got - want).abs() <= bound).all()
    # FP8 did run: the output is not the high-precision one.
    with torch.no_grad():
        assert not torch.allclose(got, reference(x, index, weights), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- whole models, counted


def train_steps(model, steps: int, seed: int = 1, lr: float = 1e-3, optimizer=None, batch=(2, 9)):
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, batch, generator=gen)
        with autocast():
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_pending_scales(model)
        losses.append(loss.item())
    return losses, opt


def assert_fp8_expert_gemms(model, steps: int = 2) -> list[float]:
    """Train ``steps`` steps and require every experts projection's fprop, dgrad and wgrad in FP8."""
    layers = len([m for m in model.modules() if isinstance(m, FP8ExpertsMixin)])
    before = expert_gemm_counts()
    losses, _ = train_steps(model, steps)
    after = expert_gemm_counts()
    ran = {kind: after[kind] - before[kind] for kind in after}
    want = 2 * layers * steps
    assert ran == {"fprop": want, "dgrad": want, "wgrad": want}, ran
    return losses


def test_mixtral_experts_train_in_fp8_with_counted_grouped_gemms():
    model = tiny_mixtral()
    report = convert_model(model)
    experts = [d for d in report.layers if d.kind == "MixtralExperts"]
    assert [d.name for d in experts] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                         for p in ("gate_up_proj", "down_proj")]
    assert all(d.swapped for d in experts)
    routers = [d for d in report.layers if d.kind == "MixtralTopKRouter"]
    assert len(routers) == 2 and all(not d.swapped and d.reason == ROUTER_REASON for d in routers)
    assert "MixtralExperts" in str(report) and "MoE router" in str(report)
    losses = assert_fp8_expert_gemms(model, steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))
    # One delayed scale per expert per role: experts that saw tokens have their own input scales.
    states = [m.fp8_state for m in model.model.layers[0].mlp.experts.fp8_scaling["gate_up_proj"]]
    assert all(bool(s.initialized[1]) for s in states)  # every expert's weight
    scales = torch.stack([s.scale[1] for s in states])
    assert len(set(scales.tolist())) > 1  # per expert, not one for all


def test_forcing_fp8_off_for_experts_fails_the_counted_test():
    model = tiny_mixtral()
    convert_model(model)
    for module in model.modules():
        if isinstance(module, FP8ExpertsMixin):
            module.use_fp8 = False
    with pytest.raises(AssertionError):
        assert_fp8_expert_gemms(model, steps=1)


def test_block_scaled_recipes_are_refused_for_experts_at_conversion():
    for recipe in (MXFP8BlockScaling(), Float8BlockScaling()):
        model = tiny_mixtral()
        with pytest.raises(ValueError, match=rf"{type(recipe).__name__}.*DelayedScaling, Float8CurrentScaling"):
            convert_model(model, recipe)
        assert not any(isinstance(m, FP8ExpertsMixin) for m in model.modules())  # nothing half-done
    report = convert_model(model, Float8BlockScaling(), exclude=["experts"])
    assert {d.reason for d in report.layers if d.kind == "MixtralExperts"} == {"matched by exclude"}


def test_a_recipe_overriding_gemm_precision_is_refused_for_experts_at_conversion():
    # The experts' grouped GEMMs have no per-GEMM switch: the override would be silently ignored.
    model = tiny_mixtral()
    with pytest.raises(ValueError, match=r"override_linear_precision=\(False, False, True\).*exclude=\['experts'\]"):
        convert_model(model, DelayedScaling(override_linear_precision=(False, False, True)))
    assert not any(isinstance(m, FP8ExpertsMixin) for m in model.modules())
    report = convert_model(model, DelayedScaling(override_linear_precision=(False, False, True)), exclude=["experts"])
    assert {d.reason for d in report.layers if d.kind == "MixtralExperts"} == {"matched by exclude"}


def test_current_scaling_experts_train_with_counted_gemms():
    model = tiny_mixtral()
    convert_model(model, Float8CurrentScaling())
    assert_fp8_expert_gemms(model, steps=2)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_reruns_experts_with_the_same_scales_bit_for_bit(use_reentrant):
    plain, checkpointed = tiny_mixtral(), tiny_mixtral()
    for model in (plain, checkpointed):
        convert_model(model)
        model.train()
    checkpointed.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    grads, fprops = [], []
    for model in (plain, checkpointed):
        before = expert_gemm_counts()["fprop"]
        for _ in range(2):  # the second step uses delayed scales from the first
            with autocast():
                loss = model(ids, labels=ids).loss
            model.zero_grad()
            loss.backward()
        fprops.append(expert_gemm_counts()["fprop"] - before)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "experts" in n})
    assert fprops == [2 * 4, 2 * 4 * 2]  # the checkpointed run recomputed every experts forward, in FP8
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    # States identical too: the recomputation recorded nothing twice.
    update_pending_scales(plain), update_pending_scales(checkpointed)
    _, fp8_a = split_fp8_state(plain.state_dict())
    _, fp8_b = split_fp8_state(checkpointed.state_dict())
    for key in fp8_a:
        if ".experts." in key:
            assert all(torch.equal(fp8_a[key][k], fp8_b[key][k]) for k in fp8_a[key]), key


# ---------------------------------------------------------------- checkpoints


def test_save_pretrained_loads_into_plain_transformers_with_identical_outputs(tmp_path):
    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 2)
    model.save_pretrained(tmp_path)
    plain = MixtralForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, FP8ExpertsMixin) for m in plain.modules())
    assert set(plain.state_dict()) == set(split_fp8_state(model.state_dict())[0])
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    model.eval(), plain.eval()
    with torch.no_grad():  # high precision: outside the FP8 autocast
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_resume_from_state_dict_is_bit_for_bit():
    model = tiny_mixtral()
    convert_model(model)
    _, opt = train_steps(model, 2, seed=1)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _, fp8 = split_fp8_state(saved_model)
    assert any(".experts.fp8_scaling." in k for k in fp8)
    continued, _ = train_steps(model, 2, seed=2, optimizer=opt)

    resumed = tiny_mixtral(seed=123)  # other weights: everything must come from the checkpoint
    convert_model(resumed)
    resumed.load_state_dict(saved_model)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(saved_opt)
    again, _ = train_steps(resumed, 2, seed=2, optimizer=opt2)
    assert again == continued
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        if isinstance(a, dict):
            assert all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert torch.equal(a, b), name


def test_corrupted_expert_scaling_state_is_refused_naming_the_key():
    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    state = model.state_dict()
    key = "model.layers.1.mlp.experts.fp8_scaling.down_proj.2.fp8_state._extra_state"
    state[key]["scale"][0] = -1.0
    target = tiny_mixtral()
    convert_model(target)
    with pytest.raises(RuntimeError, match=key.replace(".", r"\.")):
        target.load_state_dict(state)


def test_converted_model_deepcopies_and_pickles_whole(tmp_path):
    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    # The fused casts' device tables (a GPU's) are keyed by this process's objects: copies start without.
    model.model.layers[0].mlp.experts._fp8_tables[("layout",)] = "a table"
    torch.save(model, tmp_path / "model.pt")
    for copy_ in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        experts = copy_.model.layers[0].mlp.experts
        assert isinstance(experts, FP8ExpertsMixin) and type(experts) is type(model.model.layers[0].mlp.experts)
        assert experts._fp8_tables == {}
        with torch.no_grad(), autocast():
            assert torch.equal(copy_(ids).logits, model(ids).logits)


def test_fault_check_names_the_expert_whose_weight_went_non_finite():
    from fp8_plugin.training.faults import FaultMonitor, FaultPolicy, FP8NonFiniteError

    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    monitor = FaultMonitor(FaultPolicy(nonfinite="raise"))
    assert monitor.check(model, 1, loss_scaled=False)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[2, 0, 0] = float("inf")  # expert 2 of layer 0
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with autocast():
        loss = model(ids, labels=ids).loss
    loss.backward()
    with pytest.raises(FP8NonFiniteError, match=r"model\.layers\.0\.mlp\.experts\.fp8_scaling\.gate_up_proj\.2"):
        monitor.check(model, 2, loss_scaled=False)


# ---------------------------------------------------------------- other MoE families, no per-model code

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
FAMILIES = {
    # transposed 3-D weights, biases, interleaved gate/up, a custom gate activation
    "GptOss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                   layer_types=["full_attention"] * 2),
    "Qwen3Moe": dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16),
    "Olmoe": dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "Qwen2Moe": dict(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2),
    # shared experts (an nn.Linear MLP beside the routed ones)
    "DeepseekV3": dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                       kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                       num_key_value_heads=4),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_families_run_their_experts_in_fp8_with_the_weights_layout(family, monkeypatch):
    import fp8_plugin.modules.grouped_linear as grouped_linear_module

    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_COMMON, **FAMILIES[family]})).float()
    report = convert_model(model)
    converted = [m for m in model.modules() if isinstance(m, FP8ExpertsMixin)]
    experts_kind = f"{family}Experts"
    assert len(converted) == 2 and type(converted[0]).__name__ == f"FP8{experts_kind}"
    assert [d.swapped for d in report.layers if d.kind == experts_kind] == [True] * 4
    if family == "DeepseekV3":  # the shared experts are plain linear layers, swapped as such
        assert all(d.swapped for d in report.layers if ".shared_experts." in d.name)
    # Every fprop's weight operand is the cast of W_e in [out, in] layout, whatever the storage.
    seen = []
    real = grouped_linear_module.grouped_gemm

    def recording(a, sa, b, sb, counts, out_dtype, kind="fprop"):
        if kind == "fprop":
            seen.append((b.float() * sb.view(-1, 1, 1)).double())
        return real(a, sa, b, sb, counts, out_dtype, kind)

    weights = []  # as the forward sees them, before the optimizer step
    for m in converted:
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(m, proj).detach().double()
            weights.append(w.transpose(1, 2) if m.is_transposed else w)
    monkeypatch.setattr(grouped_linear_module, "grouped_gemm", recording)
    assert_fp8_expert_gemms(model, steps=1)
    assert len(seen) == len(weights)
    for got, w in zip(seen, weights):
        amax = w.abs().amax(dim=(1, 2), keepdim=True)
        assert ((got - w).abs() <= cast_error(w, amax)).all()


def test_statistics_sample_each_expert_projections_casts():
    from fp8_plugin.training.statistics import FP8Statistics, StatisticsCollector

    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    experts = model.model.layers[0].mlp.experts
    seen = {}
    experts.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach().clone()))
    collector = StatisticsCollector(FP8Statistics(every=1))
    collector.start_step(model, 1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with autocast():
        loss = model(ids, labels=ids).loss
    loss.backward()
    collector.end_step()
    metrics = collector.pop_metrics()
    prefix = "fp8_stats/model.layers.0.mlp.experts.gate_up_proj/"
    # Every token is routed somewhere: the experts' input amax is the whole input's; the weight's
    # is the largest of all experts'.
    assert metrics[prefix + "input/amax"] == seen["x"].abs().max().item()
    assert metrics[prefix + "weight/amax"] == experts.gate_up_proj.detach().abs().max().item()
    assert prefix + "grad_output/sqnr_db" in metrics
    # One scale per expert: the weight scales span several values.
    assert metrics[prefix + "weight/scale_min"] < metrics[prefix + "weight/scale_max"]
    # E4M3 round-to-nearest: relative error <= 2^-4, so SQNR >= 20 log10(16) = 24.1 dB (less a
    # little for subnormals).
    assert metrics[prefix + "input/sqnr_db"] > 23.0 and metrics[prefix + "weight/sqnr_db"] > 23.0
    assert "fp8_stats/model.layers.1.mlp.experts.down_proj/input/amax" in metrics
    # After end_step no more observation: the hooks are gone.
    assert not experts._fp8_observers


def test_experts_casts_observed_at_once_give_the_per_expert_figures_added_up():
    # The observers get every row at once, each with its expert's scale (no host read); the
    # figures must be those of each expert's cast alone, added up (extremes: the largest).
    from fp8_plugin.numerics.quantizers import WEIGHT, QuantizedTensor
    from fp8_plugin.training.statistics import cast_statistics

    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    seen = []
    handle = model.model.layers[0].mlp.experts.observe_casts(lambda *call: seen.append(call))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with autocast():
        loss = model(ids, labels=ids).loss
    loss.backward()
    handle.remove()
    assert sorted((proj, role) for proj, role, _, _ in seen) == [(p, r) for p in ("down_proj", "gate_up_proj")
                                                               for r in range(3)]
    for proj, role, rows, cast in seen:
        scale_inv = cast.scale_inv[:, 0]
        starts = [0] + [i + 1 for i in (scale_inv[1:] != scale_inv[:-1]).nonzero().flatten().tolist()]
        parts = [cast_statistics(rows[a:b], QuantizedTensor(cast.data[a:b], scale_inv[a]), cast.data.dtype)
                 for a, b in zip(starts, starts[1:] + [rows.shape[0]])]
        # The weights: a run of rows per expert (4 experts, 4 scales); tokens: the experts routed to.
        assert len(parts) == 4 if role == WEIGHT else 1 <= len(parts) <= 4
        whole = cast_statistics(rows, cast, cast.data.dtype)
        parts = torch.stack(parts)
        assert torch.equal(whole[:3], parts[:, :3].max(0).values), (proj, role)  # amax, -scale_min, scale_max
        assert torch.equal(whole[3:7], parts[:, 3:7].sum(0)), (proj, role)  # counts: exact
        torch.testing.assert_close(whole[7:], parts[:, 7:].sum(0), rtol=1e-12, atol=0)  # energies: float64 sums


def test_lightning_run_of_a_moe_resumes_bit_for_bit(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import fp8_plugin  # noqa: F401  (registers the precision strings)

    class MoE(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_mixtral()

        def training_step(self, batch, batch_idx):
            return self.model(batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Losses(Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    data = DataLoader(TensorDataset(torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(2))),
                      batch_size=2)

    def fit(ckpt_path=None, save=False):
        losses = Losses()
        callbacks = [losses] + ([ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")] if save else [])
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="fp8-hybrid", max_epochs=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=save,
                            callbacks=callbacks)
        module = MoE()
        trainer.fit(module, data, ckpt_path=ckpt_path)
        # The plugin keeps the FP8 state out of the module's state_dict (its checkpoint entry carries it).
        return losses.losses, {**module.state_dict(), **fp8_state_dict(module)}

    full_losses, full = fit(save=True)
    resumed_losses, resumed = fit(ckpt_path=tmp_path / "epoch=0.ckpt")
    assert resumed_losses == full_losses[2:]
    assert any(".experts.fp8_scaling." in k for k in full)
    assert_state_dicts_equal(full, resumed)


def test_native_grouped_path_spreads_scales_as_the_kernel_expects(monkeypatch):
    """No CPU kernel exists: torch._scaled_grouped_mm is replaced by its contract (torch's meta
    checks and documented semantics: offs are the groups' end rows, row-wise scale_a [rows],
    scale_b [G, N], bfloat16 out), so that the groups and scale layout this project feeds the
    GPU kernel are checked here against the emulation."""
    from fp8_plugin.numerics import grouped_gemm as gg

    calls = []

    def contract(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None):
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        assert mat_b.stride(-2) == 1  # column-major second operand
        assert scale_a.shape == (mat_a.shape[0],) and scale_b.shape == (mat_b.shape[0], mat_b.shape[2])
        ends = offs.tolist()
        assert offs.dtype == torch.int32
        out = torch.zeros(mat_a.shape[0], mat_b.shape[2])
        start = 0
        for g, end in enumerate(ends):
            a = mat_a[start:end].float() * scale_a[start:end, None]
            out[start:end] = a @ (mat_b[g].float() * scale_b[g][None, :])
            start = end
        calls.append(ends)
        return out.to(torch.bfloat16)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", contract, raising=False)
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 37, 16]
    a = (torch.randn(sum(counts), 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(4, 48, 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor([0.5, 2.0, 0.25, 1.0]), torch.tensor([1.0, 0.125, 4.0, 0.5])
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = gg._native(a, sa, b, sb, offsets, torch.float32)
    assert calls == [[5, 5, 42, 58]]  # the groups as routed: the kernel needs no padding
    want = gg._emulated(a, sa, b, sb, offsets, torch.float32)
    # The kernel writes bfloat16: one rounding (relative 2^-8) of the float32 result.
    assert ((got - want).abs() <= 2.0**-8 * want.abs()).all()


@pytest.mark.parametrize("counts, k, n", [([5, 0, 37, 16], 64, 48), ([0, 0, 21, 0], 24, 40), ([1, 3, 7, 9], 13, 9)])
@pytest.mark.parametrize("dtype_a", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["E4M3", "E5M2"])
def test_bfloat16_grouped_kernel_path_matches_float64(counts, k, n, dtype_a):
    """The sm90 / sm100 path for what torch._scaled_grouped_mm does not take (E5M2 dgrad, wgrad):
    torch._grouped_mm in bfloat16 on the FP8 values. Run here through torch's CPU kernel, the
    same op with the same dtype rules, so the padding to 16-byte strides, the column-major wgrad
    operand, the per-expert scales and the zeros of empty experts are checked against float64."""
    from fp8_plugin.numerics import grouped_gemm as gg

    gen = torch.Generator().manual_seed(sum(counts) + k)
    groups = len(counts)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(groups), torch.tensor(counts))
    a = (torch.randn(sum(counts), k, generator=gen) * 16).to(dtype_a)
    b = (torch.randn(groups, n, k, generator=gen) * 16).to(torch.float8_e4m3fn)
    g = (torch.randn(sum(counts), n, generator=gen) * 16).to(dtype_a)
    sa = torch.exp2(torch.randn(groups, generator=gen))  # not powers of two: rounded products
    sb = torch.exp2(torch.randn(groups, generator=gen))
    a64 = a.double() * sa.double()[rows].unsqueeze(1)
    b64 = b.double() * sb.double().view(-1, 1, 1)
    g64 = g.double() * sa.double()[rows].unsqueeze(1)
    x = a.to(torch.float32).to(torch.float8_e4m3fn)  # wgrad's second operand, the E4M3 input
    # Error bound: each FP8 value is a bfloat16 value (exact); float32 accumulation over the
    # contraction (gamma_K); one bfloat16 rounding of the kernel's output (relative 2^-8); the
    # float32 scaling and the float32 scale product (2 u). Float64 reference of the unrounded sums.
    fprop = gg._bf16_grouped(a, sa, b, sb, ends, torch.float32).double()
    for e in range(groups):
        r = rows == e
        want = a64[r] @ b64[e].T
        absprod = a64[r].abs() @ b64[e].abs().T
        bound = 2.0**-8 * 1.01 * want.abs() + (k + 3) * U32 * 1.01 * absprod
        assert ((fprop[r] - want).abs() <= bound).all(), e
    wgrad = gg._bf16_grouped_wgrad(g, sa, x, sb, ends, torch.float32).double()
    x_scaled = x.double() * sb.double()[rows].unsqueeze(1)
    for e in range(groups):
        r = rows == e
        if counts[e] == 0:
            assert torch.equal(wgrad[e], torch.zeros_like(wgrad[e])), e
            continue
        want = g64[r].T @ x_scaled[r]
        absprod = g64[r].abs().T @ x_scaled[r].abs()
        bound = 2.0**-8 * 1.01 * want.abs() + (counts[e] + 3) * U32 * 1.01 * absprod
        assert ((wgrad[e] - want).abs() <= bound).all(), e


def test_grouped_gemms_follow_force_path_through_the_public_accessor():
    from fp8_plugin.numerics import gemm
    from fp8_plugin.numerics import grouped_gemm as gg

    a = torch.zeros(4, 16, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 16, dtype=torch.float8_e4m3fn)
    assert gemm.forced_path() is None
    with gemm.force_path("emulated"):
        assert gemm.forced_path() == "emulated"
        assert gg.native_grouped_gemm(a, b) == (False, "forced emulation")
    with gemm.force_path("native"):
        assert gemm.forced_path() == "native"
        assert gg.native_grouped_gemm(a, b) == (False, "no grouped FP8 kernel on cpu")
    assert gemm.forced_path() is None


@pytest.mark.parametrize("path", ["emulated-bf16", "emulated"])
def test_grouped_gemms_on_cpu_follow_the_dense_gemms_emulation(path):
    # Under the CPU's BF16 emulation the experts take the bfloat16 grouped kernel on the FP8
    # values (test_bfloat16_grouped_kernel_path_matches_float64 bounds it against float64), and
    # the float32 emulation otherwise: bit for bit the function each path names.
    from fp8_plugin.numerics import gemm
    from fp8_plugin.numerics import grouped_gemm as gg

    gen = torch.Generator().manual_seed(7)
    counts = [5, 0, 37, 16]
    a = (torch.randn(sum(counts), 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(4, 48, 32, generator=gen) * 8).to(torch.float8_e4m3fn)
    g = (torch.randn(sum(counts), 48, generator=gen) * 8).to(torch.float8_e5m2)
    sa, sb = torch.exp2(torch.randn(4, generator=gen)), torch.exp2(torch.randn(4, generator=gen))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    fprop, wgrad = (gg._bf16_grouped, gg._bf16_grouped_wgrad) if path == "emulated-bf16" else \
        (gg._emulated, gg._emulated_wgrad)
    with gemm.force_path(path):
        assert gemm.emulates_in_bf16(a.device) == (path == "emulated-bf16")
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(gg.grouped_gemm(a, sa, b, sb, offsets, out_dtype),
                               fprop(a, sa, b, sb, offsets, out_dtype))
            assert torch.equal(gg.grouped_gemm_wgrad(g, sa, a, sb, offsets, out_dtype),
                               wgrad(g, sa, a, sb, offsets, out_dtype))
    assert not torch.equal(gg._bf16_grouped(a, sa, b, sb, offsets, torch.float32),
                           gg._emulated(a, sa, b, sb, offsets, torch.float32))  # the two paths differ


def test_the_bfloat16_grouped_kernels_scale_their_float32_result_in_place():
    # The experts' wgrad [E, N, K] is the largest tensor of an MoE backward (the GPU's wgrad path
    # too): one float32 tensor of its shape at a time, the result, and likewise for fprop's [S, N].
    from itertools import accumulate

    from fp8_plugin.numerics import grouped_gemm as gg
    from fp8_plugin.tools.memory_trace import MemoryTrace

    experts, n, k, tokens = 4, 48, 32, 58
    g = torch.empty(tokens, n, dtype=torch.float8_e5m2, device="meta")
    a = torch.empty(tokens, k, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device="meta")
    sa, sb = torch.empty(experts, device="meta"), torch.empty(experts, device="meta")
    offsets = torch.empty(experts, dtype=torch.int32, device="meta")
    for run, shape in ((lambda: gg._bf16_grouped_wgrad(g, sa, a, sb, offsets, torch.float32), (experts, n, k)),
                       (lambda: gg._bf16_grouped(a, sa, b, sb, offsets, torch.float32), (tokens, n))):
        with MemoryTrace("meta") as trace:
            out = run()
        assert out.shape == shape and out.dtype == torch.float32
        made = [r for r in trace.allocations if r.dtype == torch.float32 and r.shape == shape]
        events = sorted([(r.start, 1) for r in made] + [(r.end, -1) for r in made if r.end is not None])
        assert max(accumulate(step for _, step in events)) == 1


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_routing_ids_outside_the_experts_are_refused_on_cpu(bad_id):
    # The offsets are device-side and would silently drop such rows; on the CPU (eager) the sorted
    # ids' ends are read, which costs no sync there.
    model = tiny_mixtral()
    convert_model(model)
    experts = model.model.layers[0].mlp.experts
    index = torch.tensor([[0, 1], [2, bad_id], [3, 0]])
    with autocast(), pytest.raises(ValueError, match=r"expert ids outside 0\.\.3 \(4 experts\)"):
        experts(torch.randn(3, 64), index, torch.rand(3, 2))


@pytest.mark.parametrize("token_scaling", ["recipe", "current"])
def test_delayed_scaling_keeps_one_amax_history_and_scale_per_expert_per_role(token_scaling):
    experts = mixtral_experts(torch.float32)
    report = convert_model(experts, DelayedScaling(amax_history_len=4))
    assert [d.name for d in report.layers] == ["gate_up_proj", "down_proj"]
    experts.token_scaling = token_scaling
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(11, 64, generator=gen)
    x[3] *= 50  # token 3 goes to experts 1 and 2 only: their input amax, not the others'
    index = torch.tensor([[0, 1]] * 3 + [[1, 2]] + [[0, 1]] * 7)  # expert 3 gets nothing
    weights = torch.full((11, 2), 0.5)
    with autocast():
        experts(x, index, weights).sum().backward()
    update_pending_scales(experts)
    states = [m.fp8_state for m in experts.fp8_scaling["gate_up_proj"]]
    for e, state in enumerate(states):
        rows = (index == e).any(dim=1)
        amax = x[rows].abs().max() if rows.any() else torch.zeros(())
        want = torch.tensor(E4M3_MAX) / amax if rows.any() else torch.ones(())
        if token_scaling == "recipe":
            # TE's delayed scaling: scale = 448 / amax of the (one-step) history; an expert
            # without tokens keeps its scale (1.0) and stays uninitialized for the input.
            assert state.amax_history[0, 1] == amax  # rolled: the step's amax is now one step old
            assert state.scale[0] == want and bool(state.initialized[0]) == bool(rows.any())
        else:
            # Current scaling of the expert's own rows: their amax and scale stored at the cast,
            # no delayed update (not rolled, never initialized).
            assert state.amax_history[0, 0] == amax and state.amax_history[0, 1] == 0
            assert state.scale[0] == want and not bool(state.initialized[0])
        w_amax = experts.gate_up_proj[e].detach().abs().max()
        assert state.scale[1] == torch.tensor(E4M3_MAX) / w_amax  # every expert's weight


def test_a_linear_router_stays_high_precision_unless_included_by_name():
    from torch import nn

    from fp8_plugin.modules.linear import FP8Linear

    def block():
        moe = nn.Module()
        moe.gate = nn.Linear(64, 16, bias=False)  # a router that is a plain nn.Linear
        moe.experts = mixtral_experts(torch.float32)
        moe.shared = nn.Linear(64, 64)
        return moe

    moe = block()
    report = convert_model(moe)
    decision = {d.name: d for d in report.layers}
    assert not decision["gate"].swapped and decision["gate"].reason == ROUTER_REASON
    assert decision["shared"].swapped and decision["experts.gate_up_proj"].swapped
    assert type(moe.gate) is nn.Linear
    moe = block()
    convert_model(moe, include=["gate", "experts", "shared"])
    assert isinstance(moe.gate, FP8Linear)


def test_a_fused_optimizer_step_makes_the_experts_cached_casts_stale(monkeypatch):
    # torch's fused AdamW writes the weights without bumping their version counters: the
    # evaluation after it must cast the updated expert stacks, as a fresh copy of the model does.
    import fp8_plugin.modules.experts as experts_module

    casts = []
    real = experts_module.cast_expert_weights
    monkeypatch.setattr(experts_module, "cast_expert_weights", lambda *a, **k: casts.append(1) or real(*a, **k))
    model = tiny_mixtral()
    convert_model(model, DelayedScaling())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), autocast():
        model(ids)
    stacks = len(casts)  # 2 layers x 2 projections, kept by the evaluation
    assert stacks == 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with torch.no_grad(), autocast():
        logits = model(ids).logits
    assert len(casts) == 2 * stacks
    fresh = copy.deepcopy(model)
    for m in fresh.modules():
        if isinstance(m, FP8ExpertsMixin):
            m.clear_weight_cache()
    with torch.no_grad(), autocast():
        assert torch.equal(logits, fresh(ids).logits)


def test_gradient_accumulation_casts_each_expert_stack_once_per_step_bit_for_bit(monkeypatch):
    import fp8_plugin.modules.experts as experts_module
    from fp8_plugin.modules.autocast import new_step_id
    from fp8_plugin.training.core import FP8Training

    casts = []
    real = experts_module.cast_expert_weights
    monkeypatch.setattr(experts_module, "cast_expert_weights", lambda *a, **k: casts.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(11)
    micro = [torch.randint(0, 128, (2, 9), generator=gen) for _ in range(4)]
    results = []
    for cache in (True, False):
        model = tiny_mixtral()
        fp8 = FP8Training(DelayedScaling(), compute_dtype=torch.float32)
        fp8.convert(model)
        for m in model.modules():
            if isinstance(m, FP8ExpertsMixin):
                m.cache_fp8_weights = cache
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        casts.clear()
        for step in range(2):  # two micro-batches per optimizer step: one training step id
            step_id = new_step_id()
            for ids in micro[2 * step: 2 * step + 2]:
                with autocast(step=step_id):
                    (model(ids, labels=ids).loss / 2).backward()
            fp8.before_optimizer_step()
            assert all(not m._fp8_weight_cache for m in model.modules() if isinstance(m, FP8ExpertsMixin))
            opt.step()
            opt.zero_grad()
            fp8.after_optimizer_step()
        # 2 layers x 2 projections: once per optimizer step with the cache, per micro-batch without.
        assert len(casts) == (2 * 4 if cache else 2 * 2 * 4)
        results.append({**model.state_dict()})
    assert_state_dicts_equal(results[0], results[1])
