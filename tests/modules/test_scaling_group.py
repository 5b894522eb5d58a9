"""fp8_plugin/modules/scaling_group.py: delayed-scaling updates belong to the model, once per step."""

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8CurrentScaling
from fp8_plugin.modules.convert import fp8_state_dict
from fp8_plugin.numerics.quantizers import INPUT


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _train_step(model, x, recipe=None, reduce_amax=None):
    with fp.autocast(recipe=recipe, reduce_amax=reduce_amax):
        loss = model(x).square().mean()
    loss.backward()


def test_one_amax_reduction_per_step_covers_every_layer_of_the_model():
    model = _mlp()
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    sizes = []
    for step in range(4):
        _train_step(model, torch.randn(8, 16), reduce_amax=lambda t: sizes.append(t.numel()))
    # Step 1 has nothing pending; each later step reduces 2 layers x 3 roles in one call.
    assert sizes == [6, 6, 6]


def test_a_dropped_model_is_freed_and_models_never_share_an_update():
    a, b = _mlp(), _mlp()
    fp.convert_model(a), fp.convert_model(b)
    _train_step(a, torch.randn(4, 16))
    _train_step(b, torch.randn(4, 16))
    fp.update_pending_scales(a)
    assert all(not m.fp8_state.pending for m in a.modules() if isinstance(m, fp.FP8Linear))
    assert all(m.fp8_state.pending for m in b.modules() if isinstance(m, fp.FP8Linear))
    ref = weakref.ref(b[0])
    del b
    gc.collect()
    assert ref() is None  # no process-wide registry keeps it alive


@pytest.mark.parametrize("later", [Float8CurrentScaling(), DelayedScaling(margin=1, amax_history_len=4)],
                         ids=["current", "delayed-margin-1"])
def test_resume_mid_step_applies_pending_amaxes_under_the_recipe_in_force(later):
    # Amaxes recorded under the autocast's recipe, saved before they became scales, then resumed
    # under the same autocast recipe: the resumed run equals the uninterrupted one. (The layer's
    # own recipe, DelayedScaling(margin=0), must not be the one applied.)
    torch.manual_seed(0)
    model = _mlp()
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    xs = [torch.randn(8, 16) * (i + 1) for i in range(4)]
    for x in xs[:2]:
        _train_step(model, x, later)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    resumed = _mlp()
    fp.convert_model(resumed, DelayedScaling(amax_history_len=4))
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for x in xs[2:]:
        _train_step(model, x, later)
        _train_step(resumed, x, later)
    fp.update_pending_scales(model), fp.update_pending_scales(resumed)
    for (key, a), b in zip(fp8_state_dict(model).items(), fp8_state_dict(resumed).values()):
        for name in a:
            assert torch.equal(a[name], b[name]), (key, name)


def test_copies_update_on_their_own():
    model = _mlp()
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    _train_step(model, torch.randn(8, 16))
    twin = copy.deepcopy(model)
    _train_step(model, torch.randn(8, 16) * 100)
    assert not torch.equal(model[0].fp8_state.scale, twin[0].fp8_state.scale)
    assert twin[0].fp8_state.pending  # the copy's amaxes still wait for its own next step
    assert twin[0].scaling_group is twin[2].scaling_group is not model[0].scaling_group


def test_copies_and_pickles_start_without_the_updates_device_tables():
    # The fused update's tables are keyed by this process's objects and hold their addresses: a
    # deepcopy or a pickle must build its own, or its kernel would write into the original's
    # (or freed) memory. The fused kernels run here under Triton's interpreter.
    pytest.importorskip("triton")
    from fp8_plugin.numerics.kernels import force_kernels

    model = _mlp()
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    group = model[0].scaling_group
    with force_kernels("triton"):
        for _ in range(2):
            _train_step(model, torch.randn(8, 16))
        group.update()
    assert group._tables and group._recipe_groups
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    original = [m.fp8_state.amax_history.clone() for m in (model[0], model[2])]
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        twin_group = twin[0].scaling_group
        assert twin_group is not group and twin_group._tables == {} and twin_group._recipe_groups == {}
        with force_kernels("triton"):
            _train_step(twin, torch.randn(8, 16))
            twin_group.update()
        # The twin's casts recorded into its own states, none into the original's.
        assert all(torch.equal(m.fp8_state.amax_history, h) for m, h in zip((model[0], model[2]), original))
        assert [id(state) for _, state in next(iter(twin_group._tables.values())).objects] == \
            [id(twin[i].fp8_state) for _ in range(3) for i in (0, 2)]  # by role, then layer
    assert group._tables  # the original keeps its own


def test_inf_gradient_reaches_grad_scaler_and_the_step_is_skipped():
    # An overflowed loss-scaled gradient must not be saturated to the E5M2 max: GradScaler has to
    # find the inf, skip the optimizer step and back off its scale. No biases: their gradient
    # (a plain sum) would carry the inf past the FP8 GEMMs.
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    with fp.autocast():
        out = model[2](model[1](model[0](torch.randn(8, 16))))
    out.register_hook(lambda g: torch.where(torch.arange(g.numel()).reshape(g.shape) == 5, torch.inf, g))
    scaler.scale(out.square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert model[2].fp8_state.nonfinite_amax_count[2].item() == 1
    assert model[0].fp8_state.initialized[INPUT].item() is False  # step 1: nothing applied yet


def test_the_fused_update_writes_into_a_loaded_states_new_tensors(monkeypatch):
    # The fused update keeps the table of the states' addresses from one update to the next
    # (counted: no table built in the steady state). A checkpoint load replaces the tensors: the
    # next update builds a new table and writes into the new tensors, as a model that loaded the
    # same checkpoint fresh does. The kernels run under Triton's interpreter.
    pytest.importorskip("triton")
    from fp8_plugin.numerics.kernels import force_kernels, scale_update

    built = []
    build_table = scale_update.build_table
    monkeypatch.setattr(scale_update, "build_table", lambda rows, device: built.append(len(rows)) or build_table(rows, device))
    torch.manual_seed(0)
    model = _mlp()
    fp.convert_model(model, DelayedScaling(amax_history_len=4))
    batches = [torch.randn(8, 16) * (i + 1) for i in range(6)]
    with force_kernels("triton"):
        for x in batches[:3]:
            _train_step(model, x)
        built.clear()
        _train_step(model, batches[3])
        assert built == []  # the steady state: the kept table
        saved = copy.deepcopy(model.state_dict())
        _train_step(model, batches[4])
        model.load_state_dict(saved)
        twin = _mlp()
        fp.convert_model(twin, DelayedScaling(amax_history_len=4))
        twin.load_state_dict(saved)
        built.clear()
        _train_step(model, batches[5])
        model[0].scaling_group.update()
        assert built == [6]  # the loaded states' new tensors: a new table, 2 layers x 3 roles
        _train_step(twin, batches[5])
        twin[0].scaling_group.update()
    torch.testing.assert_close(fp8_state_dict(model), fp8_state_dict(twin), rtol=0, atol=0)


def test_the_updates_grouping_is_kept_while_the_same_roles_are_pending_and_made_anew_when_they_change(monkeypatch):
    # A step whose layers had the same roles pending under the same recipe objects as the last
    # update's reuses that update's grouping (counted: no _entries call). A step under another
    # recipe object, or with a layer off FP8, must group anew: the scales equal those of a twin
    # whose every update groups anew.
    from fp8_plugin.modules.scaling_group import ScalingGroup

    made = []
    entries = ScalingGroup._entries
    monkeypatch.setattr(ScalingGroup, "_entries", lambda self, *a: made.append(1) or entries(self, *a))
    torch.manual_seed(0)
    model, twin = _mlp(), _mlp()
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        fp.convert_model(m, DelayedScaling(amax_history_len=4))
    other = DelayedScaling(amax_history_len=4, margin=1)
    plan = [None, None, None, None, other, other, None, "off", None, None]
    counts = []
    for step, recipe in enumerate(plan):
        x = torch.randn(8, 16) * (step + 1)
        for m in (model, twin):
            m[2].use_fp8 = recipe != "off"
            if m is twin:
                m[0].scaling_group._last_update = None  # the twin groups anew at every update
            made.clear()
            _train_step(m, x, None if recipe == "off" else recipe)
            if m is model:
                counts.append(len(made))
    # The update at a step's start groups what the step before recorded: step 0 groups nothing
    # (a first grouping), step 1 the first recordings; steps 2 to 4 the same again; 5 the other
    # recipe's, 6 the same again; 7 the default recipe's once more, 8 one layer's (the other was
    # off FP8), 9 both layers again.
    assert counts == [1, 1, 0, 0, 0, 1, 0, 1, 1, 1], counts
    torch.testing.assert_close(fp8_state_dict(model), fp8_state_dict(twin), rtol=0, atol=0)
