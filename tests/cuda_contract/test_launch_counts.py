"""Kernel launches of one FP8 training step on the CUDA path, counted against the targets.

Counted by the contract suite's recorder (conftest.py): every aten op that launches a kernel (not
views, not bare allocations) and the project's fused casts at the launches each documents
(``fp8_plugin.numerics.kernels.ops.OP_LAUNCHES``). The step is the steady state: the second
training step of a layer, after an optimizer update of the weight and a scale update, so the
weight is cast again and delayed scaling casts with stored scales.
"""

import dataclasses

import pytest
import torch

import fp8_plugin as fp

CONTRACT_DEVICES = ("meta", "cuda")


def batch(layer, tokens=512):
    x = torch.empty(tokens, layer.in_features, device=layer.weight.device, dtype=torch.bfloat16).normal_()
    grad = torch.empty(tokens, layer.out_features, device=layer.weight.device, dtype=torch.bfloat16).normal_()
    return x.requires_grad_(), grad


def train_step(layer, recipe, x, grad):
    with fp.autocast(recipe=recipe):
        y = layer(x)
    y.backward(grad)


def optimizer_step(layers):
    with torch.no_grad():
        for layer in layers:
            layer.weight.add_(1e-3)  # the next forward casts the weight anew
            layer.weight.grad = None
            if layer.bias is not None:
                layer.bias.grad = None


@pytest.mark.parametrize("recipe,op,most", [(fp.DelayedScaling(), "cast_delayed", 10),
                                            (fp.Float8CurrentScaling(), "cast_current", 14)],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_linear_step_launches_at_most_the_target(cuda, recipe, op, most, bias):
    # With a bias, its gradient comes from the grad_output cast: 2 more launches (the sum over
    # the cast's row tiles, the cast to the bias dtype) and no pass of its own over grad_output.
    most += 2 if bias else 0
    layer = fp.FP8Linear(256, 384, bias=bias, device=cuda.device, dtype=torch.bfloat16)
    train_step(layer, recipe, *batch(layer))
    optimizer_step([layer])
    fp.update_pending_scales(layer)
    x, grad = batch(layer)
    cuda.reset()
    train_step(layer, recipe, x, grad)
    assert cuda.ops[f"fp8_plugin.{op}.default"] == 3  # input, weight, grad_output: the fused casts ran
    assert cuda.scaled_gemms() == 3
    assert sum(cuda.launches.values()) <= most


def converted(layers: int, device) -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(layers)])
    # skip_small=False: on a machine with a GPU, 256-wide layers count as too small for FP8.
    fp.convert_model(model, recipe=fp.DelayedScaling(), skip_small=False)
    return model.to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("layers", [1, 12])
@pytest.mark.parametrize("reduced", [False, True], ids=["one-process", "amax-reduction"])
def test_the_scale_update_of_a_whole_model_takes_at_most_four_launches(cuda, layers, reduced):
    model = converted(layers, cuda.device)
    reductions = []

    def reduce_amax(amaxes):  # stands in for the all-reduce: in place, one launch
        reductions.append(amaxes.shape)
        amaxes.mul_(1.0)

    for step in range(2):  # the second step's update: the steady state (the first builds the address table)
        x = torch.empty(64, 256, device=cuda.device, dtype=torch.bfloat16).normal_().requires_grad_()
        with fp.autocast():
            y = model(x)
        y.backward(torch.empty_like(y).normal_())
        cuda.reset()
        reductions.clear()
        fp.update_pending_scales(model, reduce_amax if reduced else None)
    assert sum(cuda.launches.values()) <= 4, {k: v for k, v in cuda.launches.items() if v}
    assert cuda.ops["fp8_plugin.scale_update.default"] == 1
    assert reductions == ([(3 * layers,)] if reduced else [])  # one reduction of every row's amax
    cuda.clean()


@pytest.mark.parametrize("cuda,recipe,most", [((9, 0), fp.Float8BlockScaling(), 9), ((10, 0), fp.MXFP8BlockScaling(), 7)],
                         indirect=["cuda"], ids=["sm90-blockwise", "sm100-mxfp8"])
def test_block_scaled_step_casts_in_one_launch_each(cuda, recipe, most):
    # One fused cast per tensor, which writes the scales in the GEMM's layouts (MXFP8's swizzled
    # E8M0, 1x128 column-major); blockwise pads its 128x128 weight scales for 2 GEMMs; then the
    # 3 GEMMs and the weight gradient's dtype cast.
    layer = fp.FP8Linear(256, 384, bias=False, device=cuda.device, dtype=torch.bfloat16)
    train_step(layer, recipe, *batch(layer))
    optimizer_step([layer])
    x, grad = batch(layer)
    cuda.reset()
    train_step(layer, recipe, x, grad)
    assert cuda.ops["fp8_plugin.cast_blocks.default"] == 3
    assert cuda.scaled_gemms() == 3
    assert sum(cuda.launches.values()) <= most


def grouped_step_launches(cuda, experts: int) -> int:
    # fp8_grouped_linear forward + backward on sorted token rows, every expert routed.
    from fp8_plugin.modules.experts import fp8_grouped_linear
    from fp8_plugin.numerics.quantizers import ScalingState

    tokens, k, n = 96, 128, 64
    states = [ScalingState(16, device=cuda.device) for _ in range(experts)]
    x = torch.empty(tokens, k, device=cuda.device, dtype=torch.bfloat16).normal_().requires_grad_()
    weight = torch.empty(experts, n, k, device=cuda.device, dtype=torch.bfloat16).normal_().requires_grad_()
    expert_of_row = torch.arange(tokens, device=cuda.device) * experts // tokens
    grad = torch.empty(tokens, n, device=cuda.device, dtype=torch.bfloat16).normal_()
    tables = {}  # the module's cache of the experts' address tables: built by the first step
    for step in range(2):
        x.grad = weight.grad = None  # as an optimizer's zero_grad leaves them: no accumulation
        cuda.reset()
        out = fp8_grouped_linear(x, weight, expert_of_row, None, states, fp.DelayedScaling(), tables=tables)
        out.backward(grad)
    # The token rows, the weight stack and grad_output: one fused per-expert cast each (zero
    # fill, amax pass, cast).
    assert cuda.ops["fp8_plugin.cast_groups.default"] == 3
    cuda.clean()
    return sum(cuda.launches.values())


def test_an_experts_step_launches_as_many_kernels_at_any_expert_count(cuda):
    assert grouped_step_launches(cuda, 4) == grouped_step_launches(cuda, 32) <= 40


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(), fp.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fprop_accumulates_fast_and_the_backward_gemms_split_as_transformer_engine_does(cuda, recipe):
    # TE's defaults (Float8CurrentScaling's fp8_gemm_* fields, DelayedScaling's _2X_ACC_*
    # constants): fprop with fast accumulation, dgrad and wgrad promoting to float32.
    layer = fp.FP8Linear(256, 384, bias=False, device=cuda.device, dtype=torch.bfloat16)
    cuda.reset()
    train_step(layer, recipe, *batch(layer))
    assert cuda.fast_accum == [True, False, False]  # fprop, dgrad, wgrad
    split = dataclasses.replace(recipe, fp8_gemm_fprop=fp.MMParams(use_split_accumulator=True))
    cuda.reset()
    train_step(layer, split, *batch(layer))
    assert cuda.fast_accum == [False, False, False]
