"""One expert at a time: an FP8 experts module with some experts switched to high precision
(``FP8ExpertsMixin.fp8_experts``), and the reference checks that name a drifting expert with its
index and move it alone.

Expectations: the float64 experts forward and its FP8 error bound (tests/modules/test_experts.py), the
unconverted module's own gradients, and a planted fault whose figure is known exactly (an expert
whose inputs all cast to zero outputs zero: its SQNR is 0 dB).
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_experts import (assert_fp8_expert_gemms, experts_reference, mixtral_experts, tiny_mixtral,  # noqa: E402
                          train_steps)

from fp8_plugin import Float8CurrentScaling, autocast, convert_model  # noqa: E402
from fp8_plugin.modules.convert import fp8_state_dict  # noqa: E402
from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts  # noqa: E402
from fp8_plugin.numerics.quantizers import INPUT  # noqa: E402
from fp8_plugin.training.reference import ReferenceCheck, reference_check  # noqa: E402

OFF = 1  # the expert switched to high precision


def _routing(tokens: int = 9):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 64, generator=gen, dtype=torch.float64)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen, dtype=torch.float64), dim=-1)
    assert (index == OFF).any(dim=1).any() and not (index == OFF).any(dim=1).all()  # both kinds of token
    return x, index, weights


def test_an_expert_switched_off_runs_in_high_precision_and_the_others_in_fp8():
    experts = mixtral_experts()  # float64, so that the high-precision expert's part is exact to ~1e-16
    plain = copy.deepcopy(experts)
    convert_model(experts, Float8CurrentScaling())
    all_fp8 = copy.deepcopy(experts)
    experts.fp8_experts = tuple(e != OFF for e in range(4))
    assert experts.fp8_experts == (True, False, True, True) and experts.use_fp8
    x, index, weights = _routing()
    before = expert_gemm_counts()["fprop"]
    with torch.no_grad(), autocast():
        got, fp8_everywhere = experts(x, index, weights), all_fp8(x, index, weights)
    assert expert_gemm_counts()["fprop"] == before + 4  # both modules ran their FP8 grouped GEMMs
    # Within the FP8 bound of the experts still in FP8 alone: the switched expert adds no FP8 error.
    want, _ = experts_reference(plain, x, index, weights)
    _, fp8_bound = experts_reference(plain, x, index, torch.where(index == OFF, 0.0, weights))
    assert ((got - want).abs() <= fp8_bound).all()
    # Only the tokens routed to the switched expert changed; the others are the FP8 module's, bit for bit.
    touched = (index == OFF).any(dim=1)
    assert torch.equal(got[~touched], fp8_everywhere[~touched])
    assert ((got[touched] - fp8_everywhere[touched]).abs().amax(dim=1) > 0).all()


def test_the_switched_expert_trains_as_the_unconverted_module_and_the_others_do_not():
    experts = mixtral_experts()
    plain = copy.deepcopy(experts)
    convert_model(experts, Float8CurrentScaling())
    experts.fp8_experts = tuple(e != OFF for e in range(4))
    x, index, weights = _routing()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w8, wp = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    with autocast():
        (experts(x, index, w8) * g).sum().backward()
    (plain(x, index, wp) * g).sum().backward()
    for name in ("gate_up_proj", "down_proj"):
        mine, theirs = getattr(experts, name).grad, getattr(plain, name).grad
        assert torch.equal(mine[OFF], theirs[OFF]), name  # the FP8 pass adds exact zeros to it
        assert not torch.equal(mine[0], theirs[0]), name  # expert 0's wgrad is FP8's
    # A routing weight's gradient is its expert's output: exact for the switched expert's slots.
    off = index == OFF
    assert torch.equal(w8.grad[off], wp.grad[off])
    assert not torch.equal(w8.grad[~off], wp.grad[~off])


def test_fp8_experts_refuses_a_wrong_length_naming_the_count():
    experts = mixtral_experts()
    convert_model(experts, Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"fp8_experts=\(True, False\).*4 experts"):
        experts.fp8_experts = (True, False)


def _loss(model, batch):
    return model(batch, labels=batch).loss


def test_reference_check_names_each_expert_with_its_index():
    model = tiny_mixtral()
    convert_model(model)
    train_steps(model, 1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    routed = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda m, args, i=i: routed.__setitem__(i, set(args[1].flatten().tolist())))
        for i, layer in enumerate(model.model.layers)]
    result = reference_check(model, ids, _loss, compute_dtype=torch.float32)
    for hook in hooks:
        hook.remove()
    experts = {name: db for name, db in result.layer_sqnr_db.items() if ".experts" in name}
    # One figure per expert a token was routed to, named by its index; none for an idle expert.
    assert set(experts) == {f"model.layers.{i}.mlp.experts[{e}]" for i, hit in routed.items() for e in hit}
    for db in experts.values():
        # Finite (FP8 differs from the reference) and sane; the element-wise bound is
        # test_experts.py's test_experts_module_forward_within_fp8_bound_of_float64.
        assert 10.0 < db < float("inf")
    # A threshold no layer meets: every expert falls back, each by its own switch.
    reference_check(model, ids, _loss, compute_dtype=torch.float32,
                    config=ReferenceCheck(policy="fallback", min_sqnr_db=200.0))
    assert all(not m.use_fp8 for m in model.modules() if isinstance(m, FP8ExpertsMixin))
    with pytest.raises(AssertionError):  # and they now run in high precision: no FP8 expert GEMM
        assert_fp8_expert_gemms(model, steps=1)


def test_a_drifting_expert_is_named_and_falls_back_alone_and_the_switch_is_saved():
    model = tiny_mixtral()
    convert_model(model)  # delayed scaling: the replays cast with the scales as they are
    layer = model.model.layers[1].mlp.experts
    layer.token_scaling = "recipe"  # the inputs too, so that a planted input scale is cast with
    train_steps(model, 2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    # The fault: expert 2's input scale of both projections so small that every input casts to
    # zero (|x| * 2^-40 is below E4M3's smallest subnormal, 2^-9), so its FP8 output is exactly
    # zero and its SQNR exactly 10 log10(sum y^2 / sum y^2) = 0 dB.
    with torch.no_grad():
        for proj in layer.fp8_scaling.values():
            proj[2].fp8_state.scale[INPUT] = 2.0**-40
    config = ReferenceCheck(policy="fallback", min_sqnr_db=10.0, max_loss_rel_diff=1.0, min_grad_cosine=0.0,
                            max_grad_rel_error=10.0)
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.experts\[2\]"):
        result = reference_check(model, ids, _loss, compute_dtype=torch.float32, config=config)
    name = "model.layers.1.mlp.experts[2]"
    assert result.layer_sqnr_db[name] == 0.0
    # Its GEMMs: those that read the zeroed input (fprop, wgrad) give exactly 0 dB, in both
    # projections; dgrad reads the weight and grad_output, not the planted operand, and stays
    # far above it (its own E5M2 error, with this tiny model's stale delayed scales: 14 to 25 dB).
    for proj in ("gate_up_proj", "down_proj"):
        figures = result.gemm_sqnr_db[f"{name}.{proj}"]
        assert figures["fprop"] == 0.0 and figures["wgrad"] == 0.0, (proj, figures)
        assert figures["dgrad"] > 10.0, (proj, figures)
    assert min(result.layer_sqnr_db, key=result.layer_sqnr_db.get) == name
    assert result.fallback_layers == [name]
    assert layer.fp8_experts == (True, True, False, True)
    assert model.model.layers[0].mlp.experts.fp8_experts == (True,) * 4
    # And the move took effect where the fault is, and only there: against a copy with every
    # expert in FP8 (the fault kept), the tokens routed to expert 2 changed, the others did not.
    inputs = []
    hook = layer.register_forward_pre_hook(lambda m, args: inputs.append(tuple(a.detach() for a in args[:3])))
    with torch.no_grad():
        model(ids)
    hook.remove()
    faulty = copy.deepcopy(layer)
    faulty.use_fp8 = True
    with torch.no_grad(), autocast():
        moved, kept = layer(*inputs[0]), faulty(*inputs[0])
    touched = (inputs[0][1] == 2).any(dim=1)
    assert touched.any() and torch.equal(moved[~touched], kept[~touched])
    assert ((moved[touched] - kept[touched]).abs().amax(dim=1) > 0).all()
    # The module still runs its other experts in FP8: every projection's GEMMs counted.
    assert_fp8_expert_gemms(model, steps=1)
    # The switch travels in the FP8 state, as a layer's does.
    fresh = tiny_mixtral(seed=1)
    convert_model(fresh)
    fresh.load_state_dict({**model.state_dict(), **fp8_state_dict(model)})
    assert fresh.model.layers[1].mlp.experts.fp8_experts == (True, True, False, True)


def test_each_experts_fprop_figure_is_the_float64_sqnr_of_its_e4m3_casts():
    """Current scaling, so that each expert's scales come from its own operands: the check's
    fprop figure of each expert's first projection against the same figure computed here in
    float64 from torch's own E4M3 casts (scale 448 / amax per expert, Transformer Engine's
    formula with margin 0) of the rows routed to it and of its weight. The check computes its
    reference in float32 and its FP8 GEMM with float32 accumulation: each is within ~K u32 of
    float64 relative to its terms (K = 64), four orders of magnitude below E4M3's 2^-4, so the
    two figures agree to far better than 0.01 dB."""
    model = tiny_mixtral()
    convert_model(model, Float8CurrentScaling())
    train_steps(model, 1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    experts = model.model.layers[0].mlp.experts
    calls = []
    hook = experts.register_forward_pre_hook(lambda m, args: calls.append(tuple(a.detach() for a in args[:3])))
    result = reference_check(model, ids, _loss, compute_dtype=torch.float32)
    hook.remove()
    hidden, index, _ = calls[-1]  # the reference replay's call, the one the figures read

    def e4m3(t):
        scale = 448.0 / t.abs().max()
        return (t * scale).to(torch.float8_e4m3fn).double() / scale

    checked = 0
    for e in range(4):
        rows = hidden.double()[(index == e).nonzero()[:, 0]]  # one row per routed slot
        if not len(rows):
            assert "model.layers.0.mlp.experts[{e}].gate_up_proj" not in result.gemm_sqnr_db
            continue
        w = experts.gate_up_proj[e].detach().double()
        want = rows @ w.t()
        got = e4m3(rows.float()) @ e4m3(w.float()).t()
        expected = 10 * torch.log10(want.square().sum() / (got - want).square().sum()).item()
        figure = result.gemm_sqnr_db[f"model.layers.0.mlp.experts[{e}].gate_up_proj"]["fprop"]
        assert abs(figure - expected) < 0.01, (e, figure, expected)
        checked += 1
    assert checked >= 2


def test_expert_figures_under_fsdp2_are_those_of_the_unsharded_model(tmp_path):
    """Each decoder layer and the model sharded with FSDP2 (one gloo rank: the reduce-scatter hands
    each gradient on as it is): the experts' output and per-GEMM figures are the unsharded
    model's, bit for bit (the same operations on the same all-gathered values), and so are the
    other layers'."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        results = {}
        for sharded in (True, False):
            model = tiny_mixtral()
            convert_model(model)
            train_steps(model, 1)
            if sharded:
                for layer in model.model.layers:
                    fully_shard(layer)
                fully_shard(model)
            results[sharded] = reference_check(model, ids, _loss, compute_dtype=torch.float32)
    finally:
        dist.destroy_process_group()
    got, expected = results[True], results[False]
    assert any("experts[" in name for name in got.gemm_sqnr_db)
    assert got.gemm_sqnr_db == expected.gemm_sqnr_db and got.layer_sqnr_db == expected.layer_sqnr_db
    # The gradient sums: up to float64 summation order (4 gamma_n, tests/training/test_reference_fsdp.py).
    assert got.grad_cosine == pytest.approx(expected.grad_cosine, rel=0, abs=3e-12)
