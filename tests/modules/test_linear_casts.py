"""Which FP8 copies an FP8Linear makes, and what it keeps for backward.

FP8 tensors are counted as the aten ops that produce them (a dispatch mode sees every op; views
of FP8 tensors are not copies and are not counted), so the counts are facts about the work done,
not about the layer's own bookkeeping. Expected counts come from the algorithm: a training
forward casts x and W and makes the transposed copies the backward consumes (wgrad needs x.T,
dgrad needs W.T); an evaluation forward needs x and W alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8_plugin
from fp8_plugin import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, FP8Linear, MXFP8BlockScaling
from fp8_plugin.modules.autocast import new_step_id, replay

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
RECIPES = [DelayedScaling(), Float8CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()]


class FP8Copies(TorchDispatchMode):
    """Counts the FP8 tensors aten ops make in new memory (casts into FP8, copies of FP8 data);
    views of an input's memory (transposes, reshapes) are not copies."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES and t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


def _layer(recipe, seed: int = 0, bias: bool = True) -> FP8Linear:
    # A throwaway forward and backward first: the process's one-off choice of GEMM path times
    # probe GEMMs of its own (fp8_plugin.numerics.gemm.tensorwise_choice), which are not this layer's work.
    warm = FP8Linear(256, 128, recipe=recipe)
    with fp8_plugin.autocast():
        warm(torch.randn(64, 256, requires_grad=True)).float().sum().backward()
    torch.manual_seed(seed)
    return FP8Linear(256, 128, bias=bias, recipe=recipe)


def _forward_copies(layer: FP8Linear, x: torch.Tensor, **autocast) -> tuple[int, torch.Tensor]:
    with fp8_plugin.autocast(**autocast), FP8Copies() as mode:
        y = layer(x)
    return mode.count, y


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_training_forward_makes_the_transposed_copies_and_evaluation_does_not(recipe):
    layer = _layer(recipe)
    layer.cache_fp8_weights = False
    x = torch.randn(64, 256, requires_grad=True)
    training, _ = _forward_copies(layer, x)
    assert training == 4  # x, W, x.T, W.T
    with torch.no_grad():
        evaluation, _ = _forward_copies(layer, x)
    assert evaluation == 2  # x, W: no copy for a backward that cannot run
    with torch.inference_mode():
        inference, _ = _forward_copies(layer, x)
    assert inference == 2


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_evaluation_output_is_the_training_forward_output(recipe):
    layer = _layer(recipe)
    x = torch.randn(64, 256)
    with torch.no_grad():
        _, evaluation = _forward_copies(layer, x)
    # A forward that records nothing, with grad on: the same casts, the same GEMM.
    with replay(fp8=True, recipe=recipe):
        with_grad = layer(x.clone().requires_grad_())
    assert torch.equal(evaluation, with_grad.detach())


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_gradient_accumulation_casts_each_weight_once_per_optimizer_step(recipe):
    cached, auto, uncached = _layer(recipe), _layer(recipe), _layer(recipe)
    cached.cache_fp8_weights, uncached.cache_fp8_weights = True, False
    assert auto.cache_fp8_weights == "auto"
    layers = (cached, auto, uncached)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in layers]
    torch.manual_seed(1)
    batches = [torch.randn(64, 256) for _ in range(6)]
    for optimizer_step in range(3):
        step = new_step_id()
        for micro in range(2):
            x = batches[2 * optimizer_step + micro]
            counts = []
            for layer in layers:
                count, y = _forward_copies(layer, x.clone().requires_grad_(), step=step)
                (y.float() ** 2).mean().backward()
                counts.append(count)
            # A micro-batch that casts makes x, x.T, W, W.T; one that reuses the weight's casts
            # makes x and x.T only. "auto" keeps the casts once it has seen a second micro-batch.
            reused = micro == 1
            assert counts == [2 if reused else 4, 2 if reused and optimizer_step > 0 else 4, 4]
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
            for layer in layers:
                layer.clear_weight_cache()  # as the loops do before each optimizer step
        # Same numerics as casting every time: weights, scales and histories bit for bit.
        for layer in (cached, auto):
            assert torch.equal(layer.weight, uncached.weight)
            assert torch.equal(layer.bias, uncached.bias)
            for name, tensor in layer.fp8_state.tensors().items():
                assert torch.equal(tensor, uncached.fp8_state.tensors()[name]), name


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
def test_a_training_step_without_accumulation_keeps_no_weight_cast_and_evaluation_keeps_its_own():
    # "auto": the rowwise copy is not held through the backward that never reads it, nor the
    # columnwise one after its dgrad (modules/weight_cache.py).
    layer = _layer(DelayedScaling())
    x = torch.randn(64, 256)
    with torch.no_grad():
        _forward_copies(layer, x)
    assert layer._weight_cache is not None and layer._weight_cache.columnwise is None  # evaluation: W only
    for _ in range(2):  # two steps of one micro-batch each
        count, y = _forward_copies(layer, x.clone().requires_grad_())
        assert count == 4 and layer._weight_cache is None  # the evaluation cast dropped, nothing kept
        y.float().sum().backward()


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
def test_cached_weight_is_recast_after_any_change_to_the_weight_or_its_scale():
    layer = _layer(DelayedScaling())
    x = torch.randn(64, 256)
    with torch.no_grad():
        assert _forward_copies(layer, x)[0] == 2
        assert _forward_copies(layer, x)[0] == 1  # W reused
        layer.weight.mul_(2.0)  # in place, as optimizers update
        count, y = _forward_copies(layer, x)
        assert count == 2
        fresh = copy.deepcopy(layer)
        fresh.clear_weight_cache()
        assert torch.equal(y, _forward_copies(fresh, x)[1])
        layer.weight.data = layer.weight.data.clone()  # new storage, as device moves make
        assert _forward_copies(layer, x)[0] == 2
        layer.fp8_state.scale[1] = 4.0  # a scale update writes in place
        layer.fp8_state.initialized[1] = True
        count, y = _forward_copies(layer, x)
        assert count == 2
        expected = torch.clamp(layer.weight.float() * 4.0, -448, 448).to(torch.float8_e4m3fn).float() / 4.0
        q = layer._weight_cache.rowwise
        assert torch.equal(q.dequantize(), expected)


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
def test_a_fused_optimizer_step_makes_the_cached_cast_stale_though_the_weight_version_stays():
    # torch's fused AdamW writes the weights without bumping their version counters: an
    # evaluation, such a step, and another evaluation must not reuse the first one's cast.
    layer = _layer(DelayedScaling())
    x = torch.randn(64, 256)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        assert _forward_copies(layer, x)[0] == 2  # evaluation: cached
    layer.weight.grad = torch.randn_like(layer.weight)
    version = layer.weight._version
    opt.step()
    assert layer.weight._version == version  # what makes a version key miss the change
    with torch.no_grad():
        count, y = _forward_copies(layer, x)
        fresh = copy.deepcopy(layer)
        fresh.clear_weight_cache()
        assert count == 2 and torch.equal(y, _forward_copies(fresh, x)[1])


@pytest.mark.filterwarnings("ignore:FP8 GEMM emulated")
def test_an_evaluation_cast_is_not_taken_for_a_training_cast_that_must_record_the_weight_amax():
    layer = _layer(DelayedScaling())
    with torch.no_grad():
        layer(torch.randn(8, 256))  # outside the autocast: high precision, nothing cached
        with fp8_plugin.autocast():
            layer(torch.randn(8, 256))  # evaluation: cached, not recorded
    count, _ = _forward_copies(layer, torch.randn(8, 256, requires_grad=True))
    assert count == 4
    assert layer.fp8_state.amax_history[1, 0] == layer.weight.detach().abs().max()


def _saved_bytes(model: nn.Module, x: torch.Tensor, fp8: bool) -> int:
    """Bytes of distinct storages saved for backward during one training forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_plugin.autocast(enabled=fp8):
            model(x)
    return sum(storages.values())


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=lambda r: type(r).__name__)
def test_fp8_layers_save_at_most_60_percent_of_the_bytes_bf16_mixed_saves(recipe):
    # Two layers in a row, as in an MLP: bf16-mixed saves each layer's bf16 input and bf16
    # weight copy (2 bytes per value); FP8 saves their FP8 transposed copies (1 byte) plus a
    # 4-byte scale_inv each. The target of 60% leaves room for scales, not for high-precision
    # copies.
    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(512, 1024, recipe=recipe), FP8Linear(1024, 512, recipe=recipe))
    x = torch.randn(256, 512, requires_grad=True)
    bf16 = _saved_bytes(model, x, fp8=False)
    fp8 = _saved_bytes(model, x, fp8=True)
    values = 256 * 512 + 512 * 1024 + 256 * 1024 + 1024 * 512  # x, W1, h, W2
    assert bf16 >= 2 * values  # bf16 copies of all four
    assert fp8 <= values + 4 * 4 + 1024  # one byte each, four scale_invs, allocator slack
    assert fp8 <= 0.6 * bf16
