"""The FP8 autograd functions hand autograd an output no other traced node yields (torch 2.11).

torch 2.11's dynamo returns every intermediate of an ``autograd.Function``'s forward as an extra
output, and where one is the very tensor the forward returns, the backward gets the real
output's gradient in the wrong slot: every gradient of the layer is zero (pytorch/pytorch#180642).
The suite runs on a later torch, whose dynamo filters those aliases, so the tests here look at
the traced graph itself: with the 2.11 handling switched on, no node of a traced FP8 forward
other than its output may yield the output's tensor, on every path whose last op is a no-op
cast or an in-place op (the CPU emulation in float32, a GEMM kept in high precision, sm90's
native blockwise GEMM, the MoE experts' grouped GEMM). A probe pins the switch to what the
installed torch does.
"""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import transformers

import fp8_plugin
from fp8_plugin import DelayedScaling, Float8BlockScaling, FP8Linear
from fp8_plugin.modules import function_outputs
from fp8_plugin.numerics.device_kind import meta_as_cuda
from fp8_plugin.numerics.gemm import force_path

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.filterwarnings("ignore:FP8 GEMM emulated", "ignore:Dynamo detected a call")]


class _Double(torch.autograd.Function):
    """y = 2x, whose forward ends in a cast to the dtype y already has, as the GEMM paths do."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        return y.to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _outputs_yielded_twice(graphs: list[torch.fx.GraphModule]) -> list[tuple[str, list[str]]]:
    # For each autograd function's traced forward in ``graphs``: the outputs the model reads
    # (those the outer graph takes out of the call; torch 2.11 appends the intermediates after
    # them) whose tensor (the fake tensor dynamo traced) another node of the forward yields too.
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target is not torch.ops.higher_order.autograd_function_apply:
                continue
            body = getattr(gm, node.args[0].target)
            returned = next(n for n in body.graph.nodes if n.op == "output").args[0][0]  # (outputs, saved)
            returned = returned if isinstance(returned, (tuple, list)) else (returned,)
            read = sorted({user.args[1] for user in node.users if user.target is operator.getitem})
            for out in (returned[i] for i in read):
                value = out.meta["example_value"]
                others = [n.name for n in body.graph.nodes if n is not out and n.meta.get("example_value") is value]
                if others:
                    found.append((out.name, others))
    return found


def _traced(fn, *args) -> list[torch.fx.GraphModule]:
    # The graphs dynamo traces for fn(*args), in one piece (fullgraph), not run further.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs


def _probe_misroutes_the_gradient() -> bool:
    x = torch.ones(4, requires_grad=True)
    torch.compile(_Double.apply, fullgraph=True, backend="eager")(x).sum().backward()
    return not torch.equal(x.grad, torch.full((4,), 2.0))


def test_the_switch_says_whether_this_torch_misroutes_an_aliased_outputs_gradient():
    # The 2.11 handling is on exactly where this torch's compiled _Double has the wrong
    # gradient (by hand: 2 per element), so a torch release that fixes or reintroduces the bug
    # fails here rather than in a model.
    assert _probe_misroutes_the_gradient() == function_outputs.ALIASED_INTERMEDIATES_RETURNED


def test_the_check_finds_the_alias_of_a_no_op_cast_last():
    found = _outputs_yielded_twice(_traced(_Double.apply, torch.ones(4, requires_grad=True)))
    assert len(found) == 1 and len(found[0][1]) == 1, found


def _linear_case(device: str, dtype: torch.dtype, recipe, bias: bool, m: int = 16, k: int = 64, n: int = 48):
    layer = FP8Linear(k, n, bias=bias, device=device, dtype=dtype, recipe=recipe)

    def step(x):
        with fp8_plugin.autocast(recipe=recipe):
            return layer(x)

    return step, torch.ones(m, k, device=device, dtype=dtype, requires_grad=True)


def _experts_case():
    # A Mixtral experts module alone (4 experts of 64 -> 2 x 32 -> 64), top-2 routing.
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4,
                                        num_experts_per_tok=2)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config)
    recipe = DelayedScaling()
    fp8_plugin.convert_model(experts, recipe=recipe)
    index, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)

    def step(x):
        with fp8_plugin.autocast(recipe=recipe):
            return experts(x, index, weights)

    return step, torch.ones(3, 64, requires_grad=True)


CASES = {
    # The CPU emulation's float32 output: `out.to(torch.float32)` of a float32 GEMM, after the bias.
    "cpu-float32-bias": lambda: _linear_case("cpu", torch.float32, DelayedScaling(), True),
    "cpu-float32": lambda: _linear_case("cpu", torch.float32, DelayedScaling(), False),
    # fprop kept in high precision: F.linear's output cast to the dtype it has.
    "cpu-fprop-in-high-precision": lambda: _linear_case(
        "cpu", torch.float32, DelayedScaling(override_linear_precision=(True, False, False)), True),
    # sm90's native blockwise GEMM written in BF16, then cast to BF16 (operands in whole 128-blocks:
    # a padded GEMM's output is a slice, another tensor).
    "sm90-blockwise": lambda: _linear_case("meta", torch.bfloat16, Float8BlockScaling(), False, 128, 256, 384),
    "experts": _experts_case,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_traced_fp8_forward_hands_autograd_an_output_no_other_node_yields(monkeypatch, case):
    monkeypatch.setattr(function_outputs, "ALIASED_INTERMEDIATES_RETURNED", True)
    on_sm90 = case.startswith("sm90")
    with (meta_as_cuda((9, 0)) if on_sm90 else contextlib.nullcontext()), \
            (force_path("native") if on_sm90 else contextlib.nullcontext()):
        step, example = CASES[case]()
        graphs = _traced(step, example)
    applies = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.higher_order.autograd_function_apply]
    assert applies, "no autograd function was traced: the case tests nothing"
    assert _outputs_yielded_twice(graphs) == []
