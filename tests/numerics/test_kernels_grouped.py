"""The experts' fused per-expert casts (fp8_plugin/numerics/kernels/grouped.py) under Triton's
interpreter, against the torch ops of fp8_plugin.modules.experts bit for bit: token rows sorted
by expert (experts without rows, an infinity), weight stacks in both layouts, delayed scaling
(initialized or not per expert) and current scaling, the amaxes each expert's state records;
then a Mixtral model trained through the kernels against the torch ops."""

import copy
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU)",
                allow_module_level=True)

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.numerics.kernels import force_kernels, grouped, ops  # noqa: E402
from fp8_plugin.numerics.kernels.scale_update import build_table  # noqa: E402
from fp8_plugin.numerics.formats import fp8_max  # noqa: E402
from fp8_plugin.numerics.quantizers import ScalingState  # noqa: E402
from fp8_plugin.numerics.scaling import scale_from_amax  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value", "ignore:overflow", "ignore:divide by zero")
E = 5


def expert_states(role: int) -> list[ScalingState]:
    states = [ScalingState(4) for _ in range(E)]
    for i, s in enumerate(states):
        s.scale[role], s.initialized[role], s.amax_history[role, 0] = 0.5 + i, i % 2 == 0, 3.0
    return states


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
@pytest.mark.parametrize("dtype,role", [(torch.float8_e4m3fn, 0), (torch.float8_e5m2, 2)], ids=["e4m3", "e5m2"])
def test_token_rows_cast_and_record_as_the_torch_ops(delayed, dtype, role):
    recipe = fp.DelayedScaling() if delayed else fp.Float8CurrentScaling()
    states = expert_states(role)
    counts = torch.tensor([3, 0, 40, 1, 20])  # an expert without rows
    group_of_row = torch.repeat_interleave(torch.arange(E), counts)
    x = (torch.randn(int(counts.sum()), 150, generator=torch.Generator().manual_seed(0)) * 30).to(torch.bfloat16)
    x[5, 3] = float("inf")  # expert 2's amax is not finite: counted, not recorded
    scale = torch.stack([s.scale[role] for s in states])
    initialized = torch.stack([s.initialized[role] for s in states])
    want, want_inv, amax = grouped.reference_groups(x, group_of_row, scale, initialized, dtype, 0, delayed)
    table, _ = build_table([(recipe, role, s) for s in states], x.device)
    data, scale_inv = grouped.cast_groups(x, group_of_row, table, E, dtype, 0, delayed=delayed, record=True)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale_inv, want_inv)
    for g, s in enumerate(states):
        finite = bool(torch.isfinite(amax[g]))
        slot = (max(3.0, amax[g].item()) if delayed else amax[g].item()) if finite else 3.0
        assert s.amax_history[role, 0].item() == slot and s.nonfinite_amax_count[role].item() == (not finite), g
        if not delayed:  # current scaling records the scale it cast with
            one = torch.ones(())
            assert torch.equal(s.scale[role], scale_from_amax(amax[g], fp8_max(dtype), 0, one)), g


@pytest.mark.parametrize("dtype,role", [(torch.float8_e4m3fn, 0), (torch.float8_e5m2, 2)], ids=["e4m3", "e5m2"])
def test_own_scale_rows_under_delayed_scaling_cast_and_record_as_current_scaling(dtype, role):
    # The experts' token_scaling="current" under DelayedScaling: every expert's rows scaled by
    # their own amax (the states' delayed scales, initialized or not, unused), the amax and the
    # scale stored as current scaling stores them.
    states = expert_states(role)
    counts = torch.tensor([3, 0, 40, 1, 20])
    group_of_row = torch.repeat_interleave(torch.arange(E), counts)
    x = (torch.randn(int(counts.sum()), 150, generator=torch.Generator().manual_seed(3)) * 30).to(torch.bfloat16)
    x[50, 7] = float("inf")  # expert 4's amax is not finite: counted, not stored
    no_state = torch.zeros(E, dtype=torch.bool)
    want, want_inv, amax = grouped.reference_groups(x, group_of_row, torch.ones(E), no_state, dtype, 0, False)
    data, scale_inv = ops.cast_groups(x, group_of_row, states, role, fp.DelayedScaling(), dtype, record=True,
                                      own_scale=True)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale_inv, want_inv)
    one = torch.ones(())
    for g, s in enumerate(states):
        finite = bool(torch.isfinite(amax[g]))
        assert s.amax_history[role, 0].item() == (amax[g].item() if finite else 3.0), g
        assert s.nonfinite_amax_count[role].item() == (not finite), g
        assert torch.equal(s.scale[role], scale_from_amax(amax[g], fp8_max(dtype), 0, one)), g


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
@pytest.mark.parametrize("transposed", [False, True], ids=["e-n-k", "e-k-n"])
def test_weight_stacks_cast_with_one_scale_per_expert(delayed, transposed):
    recipe = fp.DelayedScaling() if delayed else fp.Float8CurrentScaling()
    states = expert_states(1)
    w = torch.randn(E, 24, 150, generator=torch.Generator().manual_seed(1))
    w = w.transpose(1, 2) if transposed else w  # [E, 150, 24] strided, as a converted layout reads it
    scale = torch.stack([s.scale[1] for s in states])
    initialized = torch.stack([s.initialized[1] for s in states])
    want, want_inv, _ = grouped.reference_groups(w, None, scale, initialized, torch.float8_e4m3fn, 0, delayed)
    table, _ = build_table([(recipe, 1, s) for s in states], w.device)
    data, scale_inv = grouped.cast_groups(w, None, table, E, torch.float8_e4m3fn, 0, delayed=delayed, record=False)
    assert data.is_contiguous() and torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scale_inv, want_inv)
    assert all(s.amax_history[1, 0].item() == 3.0 for s in states)  # record=False


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_mixtral_trains_bit_for_bit_through_the_grouped_kernels(recipe, monkeypatch):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    fp.convert_model(model, recipe=recipe, skip_small=False)
    twin = copy.deepcopy(model)
    calls = []
    real = grouped.cast_groups
    monkeypatch.setattr(grouped, "cast_groups", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = []
    for module, path in ((model, "triton"), (twin, "torch")):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 9), generator=gen)
            with force_kernels(path):
                with fp.autocast(recipe=recipe):
                    loss = module(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                fp.update_pending_scales(module)
            losses.append(loss.detach())
        runs.append(losses)
    # Per step: 2 projections x (input, weight, grad_output) casts.
    assert len(calls) == 2 * 2 * 3
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    states = [(name, a, b) for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values())
              if name.endswith("fp8_state._extra_state")]
    assert len(states) == 4 + 2 * 4  # 4 attention linears, and each expert of both projections
    for name, a, b in states:
        for key, t in a.items():
            assert torch.equal(t, b[key]), (name, key)
