"""FP8 layers under ``torch.compile(fullgraph=True)``: no graph break, the same numerics as eager.

``fullgraph=True`` turns any graph break into an error, so a test that compiles and runs is a
test that nothing of the project breaks the graph (nor synchronises with the host: a ``.item()``
or a data-dependent branch breaks it too). The "aot_eager" backend traces forward and backward
as Inductor would but runs the traced ops as they are, so its results must equal eager's bit for
bit, scaling state included: a delayed-scaling history that the compiled backward failed to
update would differ.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import transformers

import fp8_plugin
from fp8_plugin import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, FP8Linear, MXFP8BlockScaling

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()]

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.filterwarnings("ignore:FP8 GEMM emulated", "ignore:Dynamo detected a call")]


def _train_step(layer: torch.nn.Module, recipe):
    def step(x: torch.Tensor) -> torch.Tensor:
        with fp8_plugin.autocast(recipe=recipe):
            y = layer(x)
        return (y.float() ** 2).mean()

    return step


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_linear_compiles_whole_and_trains_as_eager(recipe):
    # Ten steps, more than dynamo's recompile limit (8): a guard on anything that changes every
    # step (a step id) would recompile each step and fail here. The loop applies each step's
    # amaxes after it, as the integrations do (compiled forwards leave that to the loop).
    torch.manual_seed(0)
    eager = FP8Linear(128, 64, recipe=recipe)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(_train_step(compiled_layer, recipe), fullgraph=True, backend="aot_eager")
    reference = _train_step(eager, recipe)
    torch._dynamo.utils.counters.clear()
    for i in range(10):
        x = torch.randn(32, 128) * (i + 1)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        loss_c, loss_e = compiled(xs[0]), reference(xs[1])
        loss_c.backward()
        loss_e.backward()
        assert torch.equal(loss_c, loss_e)
        assert torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(compiled_layer.weight.grad, eager.weight.grad)
        for name, tensor in eager.fp8_state.tensors().items():
            assert torch.equal(compiled_layer.fp8_state.tensors()[name], tensor), (i, name)
        assert compiled_layer.fp8_state.pending.keys() == eager.fp8_state.pending.keys()
        if i == 0:  # the compiled steps recorded amaxes: the layer ran in FP8
            assert bool((compiled_layer.fp8_state.amax_history[:, 0] > 0).all())
        fp8_plugin.update_pending_scales(compiled_layer)
        fp8_plugin.update_pending_scales(eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # forward; at most one recompile


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_linear_evaluation_compiles_whole(recipe):
    torch.manual_seed(0)
    layer = FP8Linear(128, 64, recipe=recipe)

    def evaluate(x):
        with fp8_plugin.autocast(recipe=recipe):
            return layer(x)

    x = torch.randn(32, 128)
    with torch.no_grad():
        compiled = torch.compile(evaluate, fullgraph=True, backend="eager")(x)
        assert torch.equal(compiled, evaluate(x))


def _tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_converted_transformers_model_compiles_whole_forward_and_backward():
    model = _tiny_llama()
    report = fp8_plugin.convert_model(model, recipe=DelayedScaling())
    fp8_layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == 2 * 7  # q, k, v, o, gate, up, down per block; lm_head stays
    assert report is not None

    def step(input_ids):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_plugin.autocast():
            return model(input_ids=input_ids, labels=input_ids).loss

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    input_ids = torch.randint(0, 256, (2, 16))
    for _ in range(10):  # more than the recompile limit
        loss = compiled(input_ids)
        loss.backward()
        assert torch.isfinite(loss)
        fp8_plugin.update_pending_scales(model)  # compiled forwards leave this to the loop
    # Every FP8 layer recorded its input and grad_output amax in the compiled forward and
    # backward: the GEMMs ran in FP8 (a high-precision fallback records nothing).
    for layer in fp8_layers:
        assert bool((layer.fp8_state.amax_history[:, 1] > 0).all()), layer
        assert layer.weight.grad is not None


def _recorded_in_fp8(layer: FP8Linear) -> bool:
    # Amaxes of input, weight and grad_output reached the history: forward and backward ran FP8.
    return bool((layer.fp8_state.amax_history.amax(dim=1) > 0).all())


def test_lightning_trains_a_fullgraph_compiled_module_in_fp8():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_modules import CountingMLP

    class MLP(CountingMLP):
        def training_step(self, batch, batch_idx):
            # No step counter here: Lightning compiles training_step too, and an int attribute
            # changing every step would recompile it (the test's own doing, not the layers').
            return self.net(batch[0]).square().mean()

    torch.manual_seed(0)
    module = MLP()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=10, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    sys.modules["fp8_plugin.modules.autocast"]._warned_no_fp8 = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(compiled, DataLoader(TensorDataset(torch.randn(160, 32)), batch_size=16))
    # The compiled FP8 forwards count as FP8 forwards: no warning that none ran.
    assert not [w for w in caught if "no FP8 layer ran" in str(w.message)]
    assert trainer.global_step == 10  # more than the recompile limit: nothing recompiles per step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    layers = [m for m in module.net if isinstance(m, FP8Linear)]
    assert len(layers) == 2 and all(_recorded_in_fp8(m) for m in layers)


def test_accelerate_compiles_the_fp8_forward_without_a_graph_break():
    # An Accelerator made earlier in this process would keep its state, and with it a dynamo
    # plugin that compiles nothing: tests/conftest.py resets that state around every test.
    from accelerate.utils import TorchDynamoPlugin

    from fp8_plugin.accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(mixed_precision="fp8", cpu=True,
                              dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", fullgraph=True))  # fmt: skip
    prepared, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
    torch._dynamo.utils.counters.clear()
    for _ in range(10):  # more than the recompile limit: nothing recompiles per step
        accelerator.backward(prepared(torch.randn(16, 32)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    layers = [m for m in accelerator.unwrap_model(prepared, keep_torch_compile=False) if isinstance(m, FP8Linear)]
    assert len(layers) == 2 and all(_recorded_in_fp8(m) for m in layers)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


def _tiny_moe(family: str) -> transformers.PreTrainedModel:
    # One decoder layer, 4 experts, top-2: the smallest model that routes tokens to several experts.
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)
    configs = {
        "Mixtral": transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4),
        "Qwen3Moe": transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                                                num_experts=4, head_dim=16),
    }
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(configs[family])


@pytest.mark.parametrize("family, recipe", [("Mixtral", DelayedScaling(amax_history_len=4)),
                                            ("Qwen3Moe", Float8CurrentScaling())], ids=["Mixtral", "Qwen3Moe"])
def test_fp8_moe_experts_compile_whole_and_train_as_eager(family, recipe):
    # The experts' groups are device-side offsets: no .tolist() breaks the graph (fullgraph=True
    # raises on a break). aot_eager traces forward and backward as Inductor does and runs the
    # traced ops as they are, the same ops as eager: losses, gradients and the experts' scaling
    # state must be equal bit for bit. Three steps with delayed-scaling updates in between, as a
    # loop does after each optimizer step.
    from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts

    model = _tiny_moe(family)
    fp8_plugin.convert_model(model, recipe=recipe)
    experts = [m for m in model.modules() if isinstance(m, FP8ExpertsMixin)]
    assert len(experts) == 1
    eager = copy.deepcopy(model)

    def step_of(m):
        def step(input_ids):
            with fp8_plugin.autocast(recipe=recipe):
                return m(input_ids=input_ids, labels=input_ids).loss
        return step

    compiled = torch.compile(step_of(model), fullgraph=True, backend="aot_eager")
    reference = step_of(eager)
    torch._dynamo.utils.counters.clear()
    for i in range(3):
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i))
        before = expert_gemm_counts()
        loss_c = compiled(ids)
        loss_c.backward()
        ran = {k: v - before[k] for k, v in expert_gemm_counts().items()}
        # Both projections' fprop, dgrad and wgrad ran as grouped FP8 GEMMs in the compiled step.
        assert ran == {"fprop": 2, "dgrad": 2, "wgrad": 2}, (i, ran)
        loss_e = reference(ids)
        loss_e.backward()
        assert torch.equal(loss_c, loss_e), i
        for (name, p_c), p_e in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p_c.grad, p_e.grad), (i, name)
        eager_experts = [m for m in eager.modules() if isinstance(m, FP8ExpertsMixin)]
        for member_c, member_e in zip(experts[0]._fp8_members(), eager_experts[0]._fp8_members()):
            for name, tensor in member_e.fp8_state.tensors().items():  # amaxes and scales per expert
                assert torch.equal(member_c.fp8_state.tensors()[name], tensor), (i, name)
        fp8_plugin.update_pending_scales(model)
        fp8_plugin.update_pending_scales(eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # nothing recompiles per step
