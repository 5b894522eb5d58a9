"""fp8_plugin.make_graphed_callables (modules/cuda_graphs.py): what needs no capture, tested on CPU.

The capture itself needs a GPU (tests/cuda_contract/test_cuda_graphs_gpu.py runs it there, graphed
against eager bit for bit). Here: the guards (static shapes, dtypes, devices, hooks, modules with
no FP8 layer), the refusal without a GPU, and the FP8 bookkeeping around warm-up, capture and
replays, with torch's capture replaced by its observable behaviour on CPU: warm-up runs, a capture
run whose Python runs as a real capture's does, and replays that run the kernels again and do
nothing on the host.
"""

import copy

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules import cuda_graphs
from fp8_plugin.modules.cuda_graphs import StaticSignature, check_graphable
from fp8_plugin.numerics.quantizers import ScalingState
from reference import count_fp8_gemms


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def converted(recipe):
    torch.manual_seed(0)
    model = MLP()
    fp.convert_model(model, recipe, skip_small=False, device="cpu")
    return model


class _StaticReplay(torch.autograd.Function):
    """A replay as torch's graphed autograd function runs it (torch/cuda/graphs.py, ``Graphed``):
    its inputs are the call's tensors and the module's parameters; the backward writes every
    gradient into a static buffer of the graph and returns those buffers detached, so autograd
    sees tensors that the next replay overwrites."""

    @staticmethod
    def forward(ctx, run, buffers, n_args, *tensors):
        args = [t.detach().requires_grad_(t.requires_grad) for t in tensors[:n_args]]
        with torch.enable_grad():
            out = run(*args)
        ctx.run_out, ctx.inputs, ctx.buffers = out, args + list(tensors[n_args:]), buffers
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [t for t in ctx.inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(ctx.run_out, wanted, grad, allow_unused=True))
        returned = []
        for i, t in enumerate(ctx.inputs):
            g = next(grads) if t.requires_grad else None
            if g is not None:
                buffer = ctx.buffers.setdefault(i, torch.empty_like(g))
                buffer.copy_(g)
                g = buffer.detach()  # torch's return: the static buffer itself
            returned.append(g)
        return (None, None, None, *returned)


def emulated_capture(callables, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    # torch.cuda.make_graphed_callables as the FP8 code sees it: warm-up forward-backward runs,
    # one capture run (its Python runs; on a GPU its kernels are recorded), then a forward that
    # replays: the captured kernels again, no Python of the module, so no host-side FP8 record,
    # and gradients returned in the graph's static buffers (_StaticReplay).
    for module, args in zip(callables, sample_args):
        params = tuple(p for p in module.parameters() if p.requires_grad)
        inputs = tuple(a for a in args if a.requires_grad) + params
        for _ in range(num_warmup_iters + 1):  # the warm-up runs, then the capture run
            out = module(*args)
            torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=allow_unused_input)
        eager = module.forward
        states = [m for m in module.modules() if isinstance(m, ScalingState)]
        buffers = {}

        def replay(*user_args, eager=eager, states=states, params=params, buffers=buffers):
            pending = [dict(s.pending) for s in states]
            out = _StaticReplay.apply(eager, buffers, len(user_args), *user_args, *params)
            for s, p in zip(states, pending):
                s.pending = p
            return out

        module.forward = replay
    return callables


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_capture", emulated_capture)
    monkeypatch.setattr(cuda_graphs, "_check_cuda", lambda devices: None)


def train(model, steps, micro_batches, recipe):
    gen = torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for _ in range(steps):
        step = fp.modules.autocast.new_step_id()
        for _ in range(micro_batches):  # gradient accumulation: one step id, one scale update
            x = torch.randn(8, 32, generator=gen).requires_grad_()
            with fp.autocast(recipe=recipe, step=step):
                y = model(x)
            y.square().mean().backward()
            record.append((y.detach(), x.grad))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_a_graphed_module_trains_as_its_eager_self(emulated, recipe):
    eager_model = converted(recipe)
    graphed_model = copy.deepcopy(eager_model)
    fp.make_graphed_callables(graphed_model, (torch.randn(8, 32).requires_grad_(),), fp8_recipe=recipe)
    assert isinstance(graphed_model.forward, cuda_graphs._GraphedFP8)
    with count_fp8_gemms() as gemms:
        eager = train(eager_model, 3, 2, recipe)
    with count_fp8_gemms() as graphed_gemms:
        graphed = train(graphed_model, 3, 2, recipe)
    # 3 steps x 2 micro-batches x 2 layers x (fprop, dgrad, wgrad): FP8 ran, eagerly and replayed.
    assert gemms.count == graphed_gemms.count == 36
    for (y1, g1), (y2, g2) in zip(eager, graphed):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for (name, a), b in zip(eager_model.state_dict().items(), graphed_model.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    for layer, twin in zip((eager_model.up, eager_model.down), (graphed_model.up, graphed_model.down)):
        for name, t in layer.fp8_state.tensors().items():
            assert torch.equal(t, twin.fp8_state.tensors()[name]), name
    if recipe.delayed():  # the scales moved: the replays' amaxes were marked and updated
        assert graphed_model.up.fp8_state.initialized.all()


def test_warm_up_and_capture_leave_the_fp8_state_as_it_was(emulated):
    recipe = fp.DelayedScaling(amax_history_len=4)
    model = converted(recipe)
    train(model, 1, 1, recipe)  # a pending update and a filled history
    before = {name: t.clone() for name, t in model.up.fp8_state.tensors().items()}
    pending = dict(model.up.fp8_state.pending)
    fp.make_graphed_callables(model, (torch.randn(8, 32) * 100,), fp8_recipe=recipe)
    assert all(torch.equal(t, before[name]) for name, t in model.up.fp8_state.tensors().items())
    assert model.up.fp8_state.pending == pending and pending


def test_a_replay_refuses_inputs_the_graph_was_not_captured_for(emulated):
    model = converted(fp.DelayedScaling())
    fp.make_graphed_callables(model, (torch.randn(8, 32).requires_grad_(),))
    with fp.autocast():
        with pytest.raises(ValueError, match=r"argument #0 is \[4, 32\] torch.float32 on cpu requiring grad, but the "
                                             r"graph was captured for \[8, 32\] torch.float32 on cpu requiring grad; "
                                             r"a CUDA graph replays static shapes"):
            model(torch.randn(4, 32).requires_grad_())  # a short last batch would broadcast into the buffer
        with pytest.raises(ValueError, match=r"torch.bfloat16"):
            model(torch.randn(8, 32, dtype=torch.bfloat16).requires_grad_())
        with pytest.raises(ValueError, match=r"MLP was graphed for a call of structure"):
            model(torch.randn(8, 32), torch.randn(8, 32))
    with pytest.raises(RuntimeError, match=r"call it inside fp8_plugin.autocast\(\) with grad enabled"):
        model(torch.randn(8, 32).requires_grad_())


def test_evaluation_runs_the_eager_forward(emulated):
    recipe = fp.DelayedScaling()
    model = converted(recipe)
    fp.make_graphed_callables(model, (torch.randn(8, 32).requires_grad_(),))
    model.eval()
    with torch.no_grad(), fp.autocast():
        out = model(torch.randn(3, 32))  # another shape: evaluation is not graphed
    assert out.shape == (3, 16)


def test_modules_a_graph_cannot_hold_are_refused_before_any_capture():
    model = converted(fp.DelayedScaling())
    handle = model.down.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"has module hooks on down; a CUDA graph replays kernels, not Python"):
        check_graphable(model)
    handle.remove()
    with pytest.raises(ValueError, match=r"has no FP8 layer; convert it first"):
        check_graphable(MLP())
    with pytest.raises(TypeError, match=r"is a function; valid: an nn.Module holding FP8 layers"):
        fp.make_graphed_callables(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match=r"the sample arguments of MLP hold no tensor"):
        fp.make_graphed_callables(model, (None, 3))


def test_without_a_gpu_the_capture_is_refused_at_start_up():
    model = converted(fp.DelayedScaling())
    with pytest.raises(RuntimeError, match=r"CUDA graphs run on a CUDA GPU; the modules and sample_args are on cpu"):
        fp.make_graphed_callables(model, (torch.randn(8, 32),))
    assert not isinstance(model.forward, cuda_graphs._GraphedFP8)


def test_a_static_signature_names_what_differs():
    sig = StaticSignature.of((torch.zeros(2, 3),), dict(mask=None, rope=(torch.zeros(4), torch.zeros(4)), cache=False),
                             "block")
    assert sig.names == ("#0", "mask", "rope[0]", "rope[1]", "cache")
    sig.check((torch.ones(2, 3),), dict(mask=None, rope=(torch.ones(4), torch.ones(4)), cache=False), "block")
    with pytest.raises(ValueError, match=r"argument rope\[1\] is \[4\] torch.int32 on cpu, but the graph was captured "
                                         r"for \[4\] torch.float32 on cpu"):
        sig.check((torch.ones(2, 3),), dict(mask=None, rope=(torch.ones(4), torch.ones(4, dtype=torch.int32)),
                                            cache=False), "block")
    with pytest.raises(ValueError, match=r"argument cache is True, but the graph was captured with False, which it "
                                         r"holds as a constant"):
        sig.check((torch.ones(2, 3),), dict(mask=None, rope=(torch.ones(4), torch.ones(4)), cache=True), "block")
    with pytest.raises(ValueError, match=r"argument mask is \[2\] torch.float32 on cpu, but the graph was captured "
                                         r"with None"):
        sig.check((torch.ones(2, 3),), dict(mask=torch.ones(2), rope=(torch.ones(4), torch.ones(4)), cache=False),
                  "block")
    with pytest.raises(ValueError, match=r"graphed for a call of structure"):
        sig.check((torch.ones(2, 3),), dict(mask=None, rope=(torch.ones(4),), cache=False), "block")
    with pytest.raises(TypeError, match=r"the sample arguments of block hold no tensor"):
        StaticSignature.of((None,), {}, "block")


class Block(nn.Module):
    """A transformers-style block: hidden states, keyword tensors (a tuple among them) and flags."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, hidden, attention_mask=None, position_embeddings=None, use_cache=False):
        cos, sin = position_embeddings
        out = self.mlp(hidden * cos + sin)
        return out if attention_mask is None else out * attention_mask


def test_keyword_arguments_are_graphed_tensors_and_constants(emulated):
    recipe = fp.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    eager = Block()
    fp.convert_model(eager, recipe, skip_small=False, device="cpu")
    graphed = copy.deepcopy(eager)
    rope = (torch.randn(8, 32), torch.randn(8, 32))
    fp.make_graphed_callables(graphed, (torch.randn(8, 32).requires_grad_(),),
                              sample_kwargs=dict(attention_mask=None, position_embeddings=rope, use_cache=False),
                              fp8_recipe=recipe)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, rope = torch.randn(8, 32, generator=gen), (torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen))
        outs = []
        for model in (eager, graphed):
            xi = x.clone().requires_grad_()
            with fp.autocast(recipe=recipe):
                y = model(xi, attention_mask=None, position_embeddings=rope, use_cache=False)
            y.square().mean().backward()
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with fp.autocast(recipe=recipe), pytest.raises(ValueError, match=r"argument use_cache is True"):
        graphed(x.requires_grad_(), attention_mask=None, position_embeddings=rope, use_cache=True)


def test_a_module_graphed_without_fp8_replays_outside_the_fp8_autocast(emulated):
    model = converted(fp.DelayedScaling())
    fp.make_graphed_callables(model, (torch.randn(8, 32).requires_grad_(),), fp8_enabled=False)
    x = torch.randn(8, 32)
    out = model(x.clone().requires_grad_())  # no fp8_plugin.autocast: as captured, in high precision
    with torch.no_grad():
        want = model.down(torch.nn.functional.gelu(model.up(x)))  # the eager layers outside the autocast
    assert torch.equal(out.detach(), want)
    assert not model.up.fp8_state.pending and not model.up.fp8_state.initialized.any()
