"""The training steps the cost model traces, on fake tensors: an ``FP8Linear`` (or ``nn.Linear``
under BF16 autocast) forward + backward, and one Llama decoder block of transformers.

Fake tensors live on the CPU device here, under ``torch.autocast("cpu", torch.bfloat16)``: CUDA
autocast is off on a machine without CUDA, and fake tensors on a ``cuda`` device abort in
autograd. The FP8 GEMMs are forced onto the native ``torch._scaled_mm`` path
(``force_path("native")``), whose calls, operand layouts and casts are those of the CUDA path at
shapes that need no padding (every dim a multiple of 16, as all shapes here are). Each step runs
twice and the second one is recorded: the steady state, in which delayed scaling updates its
scales from the previous step's amaxes and every weight is cast again (as after an optimizer
step).

:func:`seam_linear_ops` traces the layer on the CUDA path itself instead: ``meta`` tensors that
the project treats as a CUDA GPU (the CUDA contract suite's seam), which reaches the block-scaled
GEMMs of Hopper; without CUDA autocast there, its weights are BF16.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8_plugin
from fp8_plugin.modules.linear import FP8Linear
from fp8_plugin.numerics.gemm import force_path
from fp8_plugin.numerics.kernels import force_kernels

from .op_costs import Op, OpCounter

HEAD_DIM = 128
KV_HEADS = 8
SEQ_LEN = 4096
# Llama-style blocks by hidden size: intermediate size (Llama 3.2 1B, Llama 3 8B, Llama 3 70B).
BLOCKS = {2048: 8192, 4096: 14336, 8192: 28672}


@contextlib.contextmanager
def _fake(cast_path: str = "torch") -> contextlib.AbstractContextManager:
    with FakeTensorMode(allow_non_fake_inputs=True), force_path("native"), force_kernels(cast_path), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped small layers, an autocast run without FP8 layers
        yield


def _steady_step(module: nn.Module, call: Callable[[], torch.Tensor], grad: torch.Tensor,
                 leaves: list[torch.Tensor], recipe: Optional[fp8_plugin.Recipe], autocast: bool = True) -> list[Op]:
    # Two training steps, the second one recorded: forward under BF16 autocast (unless
    # ``autocast`` is False) and the FP8 autocast, backward from ``grad``; gradients set to None and FP8 weight copies dropped
    # before each step, as an optimizer step with zero_grad(set_to_none=True) leaves them.
    counter = OpCounter()
    for _ in range(2):
        for t in [*module.parameters(), *leaves]:
            t.grad = None
        for layer in module.modules():
            if isinstance(layer, FP8Linear):
                layer.clear_weight_cache()
        counter = OpCounter()
        fp8 = fp8_plugin.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with bf16, fp8, counter:
            out = call()
        with counter:
            out.backward(grad)
    return counter.ops


def linear_ops(m: int, k: int, n: int, recipe: Optional[fp8_plugin.Recipe], cast_path: str = "torch") -> list[Op]:
    """The ops of one training step of a linear layer ``[M, K] -> [M, N]``: ``FP8Linear`` under
    ``recipe``, or ``nn.Linear`` under BF16 autocast for ``recipe=None``. FP32 master weights, no
    bias, a BF16 input that needs its gradient, a BF16 output gradient. ``cast_path``: the FP8
    casts as torch ops (``"torch"``) or as the fused kernels' custom ops (``"triton"``, the
    default on a CUDA GPU)."""
    with _fake(cast_path):
        layer = nn.Linear(k, n, bias=False) if recipe is None else FP8Linear(k, n, bias=False, recipe=recipe)
        x = torch.empty(m, k, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.empty(m, n, dtype=torch.bfloat16)
        return _steady_step(layer, lambda: layer(x), grad, [x], recipe)


def llama_config(hidden: int):
    """A one-layer ``LlamaConfig`` of hidden size ``hidden`` (a key of :data:`BLOCKS`): heads of
    128, 8 KV heads (grouped-query attention), SDPA attention."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=BLOCKS[hidden], num_attention_heads=hidden // HEAD_DIM,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=32000,
                       attn_implementation="sdpa")


def block_ops(tokens: int, hidden: int, recipe: Optional[fp8_plugin.Recipe], skip_small: bool = False,
              cast_path: str = "torch") -> list[Op]:
    """The ops of one training step of a transformers ``LlamaDecoderLayer`` on ``tokens`` tokens
    (sequences of :data:`SEQ_LEN`), its seven linear layers converted by
    ``fp8_plugin.convert_model(skip_small=skip_small)`` under ``recipe`` (``None``: BF16 autocast
    alone). FP32 parameters and residual stream, as in a ``bf16-mixed`` model; causal attention
    through ``scaled_dot_product_attention``. The rotary embedding's cos / sin are computed
    before the step (once per model, not per block). ``cast_path`` as in :func:`linear_ops`."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = llama_config(hidden)
    batch, seq = max(1, tokens // SEQ_LEN), min(tokens, SEQ_LEN)
    with _fake(cast_path):
        layer = LlamaDecoderLayer(config, layer_idx=0)
        if recipe is not None:
            fp8_plugin.convert_model(layer, recipe, skip_small=skip_small, device="cpu")
        x = torch.empty(batch, seq, hidden, dtype=torch.float32, requires_grad=True)
        position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        with torch.no_grad():
            cos, sin = LlamaRotaryEmbedding(config)(x, position_ids)
        grad = torch.empty(batch, seq, hidden, dtype=torch.float32)

        def call() -> torch.Tensor:
            out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
            return out[0] if isinstance(out, tuple) else out

        return _steady_step(layer, call, grad, [x], recipe)


def seam_linear_ops(m: int, k: int, n: int, recipe: Optional[fp8_plugin.Recipe],
                    capability: tuple[int, int] = (9, 0), cast_path: str = "torch") -> list[Op]:
    """The ops of one training step of a linear layer on ``meta`` tensors that the project treats
    as a CUDA GPU of compute ``capability`` (``fp8_plugin.numerics.device_kind.meta_as_cuda``,
    the CUDA contract suite's seam): the CUDA path itself, block-scaled GEMMs included
    (``Float8BlockScaling`` on sm90). CUDA autocast cannot be entered without CUDA, so weights,
    input and output gradient are all BF16 here, and ``recipe=None`` is a BF16 ``nn.Linear``.
    ``cast_path`` as in :func:`linear_ops` (block-scaled casts have no fused kernel yet).

    Raises:
        ImportError: this fp8-plugin has no ``device_kind`` seam.
    """
    from fp8_plugin.numerics import gemm
    from fp8_plugin.numerics.device_kind import meta_as_cuda

    gemm.clear_plans()  # decided per device: the presented GPU changes
    try:
        with meta_as_cuda(capability), force_path("native"), force_kernels(cast_path), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = dict(bias=False, device="meta", dtype=torch.bfloat16)
            layer = nn.Linear(k, n, **kwargs) if recipe is None else FP8Linear(k, n, recipe=recipe, **kwargs)
            x = torch.empty(m, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.empty(m, n, device="meta", dtype=torch.bfloat16)
            return _steady_step(layer, lambda: layer(x), grad, [x], recipe, autocast=False)
    finally:
        gemm.clear_plans()
