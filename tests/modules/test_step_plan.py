"""An FP8 layer's eager step plan (modules/linear_function.StepPlan, FP8Linear._step_info): one
key per forward in place of a lookup per quantizer, cast and GEMM, with the same results.

The expectation is the same model whose layers make no plan (each forward then looks every
answer up as it did before plans existed). The fused casts run under Triton's interpreter on
CPU (``force_kernels("triton")``), so that the plans' kept launches are the ones that cast; on
the meta proxy (meta tensors presented as sm90, launches recorded) the plans' GEMM routes
launch the Triton GEMM.
"""

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import fp8_plugin as fp
from fp8_plugin import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from fp8_plugin.modules.autocast import new_step_id
from fp8_plugin.modules.linear import FP8Linear

triton = pytest.importorskip("triton")

from fp8_plugin.numerics.device_kind import meta_as_cuda  # noqa: E402
from fp8_plugin.numerics.gemm import force_path  # noqa: E402
from fp8_plugin.numerics.kernels import force_gemm_kernel, force_kernels  # noqa: E402
from fp8_plugin.numerics.kernels.launch import record_launches  # noqa: E402
from reference import count_fp8_gemms  # noqa: E402


def _model(recipe):
    # The first layer with a bias (its grad_output cast sums it too), the second without.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32, bias=False))
    fp.convert_model(model, recipe)
    return model


def _without_plans(model):
    # Every layer answers each forward's questions one lookup at a time, as before step plans.
    for layer in model.modules():
        if isinstance(layer, FP8Linear):
            layer._step_info = lambda *args, **kwargs: None
    return model


def _fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def _train(model, batches, autocast_steps=(), sum_steps=(), accumulate_steps=(), checkpoint_steps=()):
    # SGD steps; the steps listed in ``autocast_steps`` run under torch's CPU autocast (BF16),
    # those in ``sum_steps`` take the outputs' sum for a loss (its gradient: a stride-0 expand),
    # those in ``accumulate_steps`` run two micro-batches (the second takes the weight casts the
    # first kept), those in ``checkpoint_steps`` recompute the forward in the backward.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step, x in enumerate(batches):
        cpu_autocast = torch.autocast("cpu", torch.bfloat16) if step in autocast_steps else contextlib.nullcontext()
        step_id = new_step_id()
        for micro_batch in (x, x.flip(0)) if step in accumulate_steps else (x,):
            with cpu_autocast, fp.autocast(step=step_id):
                if step in checkpoint_steps:
                    out = torch.utils.checkpoint.checkpoint(model, micro_batch, use_reentrant=False).float()
                else:
                    out = model(micro_batch).float()
                loss = out.sum() / 1000 if step in sum_steps else out.square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def _cpu_routes(monkeypatch):
    # fp8_gemm takes no kept route on CPU (the Triton GEMM and the native ones are a GPU's). A
    # stand-in route, fp8_gemm at the output dtype, bias presence and accumulation it was
    # resolved for, makes a plan's kept routes compute here, per-tensor and block-scaled: one
    # kept past a change of what it was resolved for computes the wrong dtype.
    import fp8_plugin.modules.linear_function as linear_function
    from fp8_plugin.numerics.gemm import fp8_gemm

    def route_for(a, b, out_dtype, has_bias, use_split_accumulator):
        def route(a, b, bias):
            assert (bias is not None) == has_bias
            return fp8_gemm(a, b, out_dtype, bias, use_split_accumulator)
        return route

    monkeypatch.setattr(linear_function, "gemm_route", route_for)


# Block casts: 128-blockwise (MXFP8's take the same quantizer path; its swizzled grid makes
# hundreds of interpreted programs per cast at these sizes, half a minute a run).
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()],
                         ids=["delayed", "current", "blockwise"])
def test_steps_with_plans_train_bit_for_bit_as_steps_without(recipe, monkeypatch):
    # Layouts and settings change between steps (a short batch, a 3-D batch, a non-contiguous
    # one, torch autocast, a stride-0 output gradient, two micro-batches, an activation-checkpoint
    # recomputation, BF16 weights, evaluation), so every plan key part that tells them apart is
    # used: a plan kept for another layout would cast or multiply the wrong shapes or dtypes.
    _cpu_routes(monkeypatch)
    torch.manual_seed(1)
    batches = [torch.randn(8, 32), torch.randn(8, 32), torch.randn(5, 32), torch.randn(2, 4, 32),
               torch.randn(32, 8).t(), torch.randn(8, 32), torch.randn(8, 32), torch.randn(8, 32),
               torch.randn(8, 32)]
    runs = []
    with force_kernels("triton"):
        for model in (_model(recipe), _without_plans(_model(recipe))):
            with count_fp8_gemms() as gemms:
                losses = _train(model, batches, autocast_steps=(5,), sum_steps=(6,), accumulate_steps=(7,),
                                checkpoint_steps=(8,))
                with torch.no_grad(), fp.autocast():
                    evaluated = model(batches[0])
                # BF16 weights, the same FP32 input under torch autocast: only the weight's dtype
                # (wgrad's output dtype) tells this step's layout from step 5's.
                losses += _train(model.to(torch.bfloat16), [batches[5]], autocast_steps=(0,))
            # Every GEMM in FP8: per micro-batch the first layer's fprop and wgrad (its input needs
            # no gradient, so no dgrad) and the second's three; 11 micro-batches (9 steps, one of
            # two, the BF16-weight step), the checkpointed step's recomputed fprops, the evaluation's.
            assert gemms.count == 5 * 11 + 2 + 2, gemms.count
            runs.append((losses, evaluated, model.state_dict(), fp8_stats(model)))
    (losses, evaluated, weights, stats), (want_losses, want_evaluated, want_weights, want_stats) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True))
    assert torch.equal(evaluated, want_evaluated)
    # Weights, biases and every layer's scaling state as saved: exactly equal.
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0, equal_nan=True)
    assert stats == want_stats


def fp8_stats(model):
    return [{k: {n: t.tolist() for n, t in v.items()} for k, v in layer.fp8_stats().items()}
            for layer in _fp8_layers(model)]


def test_a_steady_step_asks_no_quantizer_and_decides_no_gemm_path(monkeypatch):
    # The point of the plan: after a layout's first step, its steps make no quantizer lookup
    # and no GEMM-path decision. Counted by wrapping both where the layer and its autograd
    # function call them; without the plan each step asks 3 quantizers per layer.
    import fp8_plugin.modules.linear as linear
    import fp8_plugin.modules.linear_function as linear_function

    model = _model(DelayedScaling(amax_history_len=4))
    calls = Counter()
    for module in (linear, linear_function):
        original = module.make_quantizer

        def counting(*args, _original=original, **kwargs):
            calls["make_quantizer"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "make_quantizer", counting)
    with force_kernels("triton"):
        _train(model, [torch.randn(8, 32)])
        calls.clear()
        _train(model, [torch.randn(8, 32) for _ in range(3)])
        assert calls == Counter()
        _train(_without_plans(model), [torch.randn(8, 32)])
    assert calls["make_quantizer"] == 3 * 2  # input, weight, grad_output of each of the two layers


def test_an_eager_step_calls_its_autograd_function_past_torchs_python_apply(monkeypatch):
    # torch.autograd.Function.apply's Python wrapper costs a few µs of CPU a call: an eager FP8
    # step calls the C++ apply directly (fp8_plugin._private.torch_api.eager_apply). Counted by
    # wrapping the public apply; the steps still run every GEMM in FP8 and the weights still
    # get their gradients.
    calls = Counter()
    public = torch.autograd.Function.apply.__func__

    def counting(cls, *args, **kwargs):
        calls[cls.__name__] += 1
        return public(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counting))
    model = _model(DelayedScaling(amax_history_len=4))
    before = [layer.weight.detach().clone() for layer in _fp8_layers(model)]
    with count_fp8_gemms() as gemms:
        _train(model, [torch.randn(8, 32) for _ in range(2)])
    assert calls["FP8LinearFunction"] == 0
    assert gemms.count == 2 * (2 + 3)  # per step: the first layer has no dgrad (its input needs none)
    assert all(not torch.equal(b, layer.weight) for b, layer in zip(before, _fp8_layers(model)))


def _meta_step(layer, x, grad):
    with fp.autocast():
        y = layer(x)
    y.backward(grad)
    layer.weight.grad = x.grad = None


@contextlib.contextmanager
def _meta_proxy():
    # The host profile's CUDA path: meta tensors presented as sm90, launches recorded not run.
    with meta_as_cuda((9, 0)), force_path("native"), force_kernels("triton"), record_launches() as launches:
        yield launches


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_on_the_cuda_path_plans_launch_what_the_lookups_launch_and_follow_the_gemm_kernel_setting(recipe, monkeypatch):
    # Per step, with and without plans: the same launches by kernel. Under the Triton GEMM
    # setting each step launches it three times (fprop, dgrad, wgrad), and with plans no GEMM
    # path is decided again after the first step. Switched to torch._scaled_mm, the kept plan
    # must not keep launching the Triton GEMM.
    import fp8_plugin.numerics.gemm as gemm

    decided = Counter()
    cached_plan = gemm._cached_plan
    monkeypatch.setattr(gemm, "_cached_plan", lambda *a: decided.update(["plan"]) or cached_plan(*a))
    per_step = {}
    with _meta_proxy() as launches:
        for planned in (True, False):
            layer = FP8Linear(32, 48, device="meta", dtype=torch.bfloat16, recipe=copy.deepcopy(recipe))
            if not planned:
                layer._step_info = lambda *args, **kwargs: None
            x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.empty(64, 48, device="meta", dtype=torch.bfloat16)
            with force_gemm_kernel("triton"):
                for _ in range(3):
                    _meta_step(layer, x, grad)
                launches.clear(), decided.clear()
                _meta_step(layer, x, grad)
                per_step[planned] = (Counter(launches), decided["plan"])
            with force_gemm_kernel("torch"):
                launches.clear()
                _meta_step(layer, x, grad)
                assert "_scaled_gemm_kernel" not in launches, planned
    (with_plans, decisions), (without, lookups) = per_step[True], per_step[False]
    assert with_plans == without and with_plans["_scaled_gemm_kernel"] == 3
    assert decisions == 0 and lookups == 3


@pytest.mark.parametrize("tokens, decisions", [(64, 0), (72, 3)], ids=["aligned", "padded"])
def test_on_the_cuda_path_plans_keep_scaled_mm_for_operands_that_need_no_padding(tokens, decisions, monkeypatch):
    # torch._scaled_mm (the default GEMM kernel) is a kept route where M, K and N are multiples
    # of 16: a steady step decides no GEMM path and calls torch._scaled_mm three times. With 72
    # tokens fp8_gemm pads each call, so each GEMM is decided as it comes.
    m = -(-tokens // 16) * 16  # the GEMMs' M after padding: fprop's and dgrad's tokens, wgrad's N
    calls = _steady_native_gemms(monkeypatch, torch, "_scaled_mm", DelayedScaling(amax_history_len=4), 32, 48, tokens)
    assert calls == (decisions, Counter({m: 2, 48: 1}))


@pytest.mark.parametrize("tokens, decisions", [(128, 0), (72, 3)], ids=["aligned", "padded"])
def test_on_the_cuda_path_plans_keep_the_block_scaled_gemm_for_operands_that_need_no_padding(tokens, decisions,
                                                                                             monkeypatch):
    # 128-blockwise on sm90: torch's scaled_mm with 1x128 and 128x128 scales wants K and the
    # 128x128-scaled operand's rows in whole blocks, and every dim a multiple of 16. 128 tokens
    # into a 128 -> 256 layer: every GEMM is a kept route. 72 tokens: wgrad's K (the tokens)
    # is padded to 128 and fprop's and dgrad's M to 80, each GEMM decided as it comes.
    m = -(-tokens // 16) * 16
    calls = _steady_native_gemms(monkeypatch, torch.nn.functional, "scaled_mm", Float8BlockScaling(), 128, 256, tokens)
    assert calls == (decisions, Counter({m: 2, 256: 1}))


def _steady_native_gemms(monkeypatch, module, name, recipe, k, n, tokens):
    # A steady step's GEMM-path decisions and calls of the native GEMM ``module.name`` by the
    # first operand's rows, on the meta proxy with torch's GEMMs (not the Triton one).
    import fp8_plugin.numerics.gemm as gemm

    decided, native = Counter(), Counter()
    cached_plan = gemm._cached_plan
    monkeypatch.setattr(gemm, "_cached_plan", lambda *a: decided.update(["plan"]) or cached_plan(*a))
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: native.update([a[0].shape[0]]) or original(*a, **kw))
    with _meta_proxy(), force_gemm_kernel("torch"):
        layer = FP8Linear(k, n, device="meta", dtype=torch.bfloat16, recipe=recipe)
        x = torch.empty(tokens, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.empty(tokens, n, device="meta", dtype=torch.bfloat16)
        for _ in range(2):
            _meta_step(layer, x, grad)
        decided.clear(), native.clear()
        _meta_step(layer, x, grad)
    return decided["plan"], native


def test_copies_of_a_layer_start_without_its_plans():
    # A plan holds the layer's quantizers and its state's launch plans: a copy must make its
    # own, or its casts would record into the original's state.
    model = _model(DelayedScaling(amax_history_len=4))
    with force_kernels("triton"):
        _train(model, [torch.randn(8, 32)])
        twin = copy.deepcopy(model)
        before = [layer.fp8_state.amax_history.clone() for layer in _fp8_layers(model)]
        x = torch.randn(8, 32) * 50
        _train(twin, [x])
    assert all(torch.equal(layer.fp8_state.amax_history, h) for layer, h in zip(_fp8_layers(model), before))
    assert _fp8_layers(twin)[0].fp8_state.amax_history[0, 0] == x.abs().max()  # the twin's input, in its own row
