"""Saved-for-backward bytes: what the linear layers keep for the backward, FP8 against BF16.

One training forward of a model under each precision (BF16 autocast alone; BF16 autocast with
:func:`fp8_plugin.autocast` around the model converted with each recipe), inside
``torch.autograd.graph.saved_tensors_hooks``: every tensor packed for backward is counted once
by its storage (its storage's bytes), for the whole model and, separately, for what is packed
while a linear layer's forward runs (``nn.Linear`` / ``FP8Linear`` forward pre- and post-hooks).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

import fp8_plugin

from . import models
from .common import RECIPES, release_memory

BASELINE = "bf16"
TARGET_RATIO = 0.6  # FP8 layers' saved bytes <= 60% of BF16's
MINILM_BATCH = (16, 128)


@dataclass
class SavedBytes:
    """Bytes saved for backward by one forward: by the layers that run in FP8 (and by the same
    layers in the BF16 forward), and by the whole model."""

    model: str
    precision: str
    fp8_layers: Optional[int] = None  # layers converted (the BF16 row: every linear layer)
    linear_bytes: Optional[int] = None
    bf16_linear_bytes: Optional[int] = None  # the same layers in the BF16 forward
    total_bytes: Optional[int] = None
    linear_ratio: Optional[float] = None
    total_ratio: Optional[float] = None
    error: Optional[str] = None


@contextlib.contextmanager
def _linear_layer_stack(model: nn.Module) -> Iterator[list[str]]:
    """The names of the linear layers whose forward is running, innermost last."""
    stack: list[str] = []

    def enter(name: str) -> Callable:
        def hook(module, args) -> None:
            stack.append(name)
        return hook

    def leave(module, args, output) -> None:
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):  # FP8Linear included
            handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def count_saved(model: nn.Module, forward: Callable[[], object]) -> tuple[dict[str, int], int]:
    """Bytes packed for backward during ``forward()``: per linear layer (packed while its forward
    ran), and in all. Each storage is counted once, for the first layer that packed it."""
    owner: dict[tuple, tuple[Optional[str], int]] = {}
    with _linear_layer_stack(model) as stack:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            owner.setdefault((tensor.device, storage.data_ptr()), (stack[-1] if stack else None, storage.nbytes()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = forward()
    del output
    per_layer: dict[str, int] = {}
    for layer, nbytes in owner.values():
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + nbytes
    return per_layer, sum(nbytes for _, nbytes in owner.values())


def _minilm(device: torch.device) -> tuple[str, nn.Module, dict]:
    """all-MiniLM-L6-v2 as a 5-class classifier (the checkpoint of the ``data`` extra, or the same
    architecture with random weights where it is not installed) and a random batch."""
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    try:
        from fp8_plugin.tools.data import minilm_path

        model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
        name = "MiniLM-L6"
    except FileNotFoundError:
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                                         intermediate_size=1536, num_labels=5))
        name = "MiniLM-L6 architecture (random weights)"
    b, s = MINILM_BATCH
    ids = torch.randint(model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.to(device), "labels": torch.zeros(b, dtype=torch.long, device=device)}
    return f"{name}, {b} x {s} tokens", model.to(device).train(), batch


def _llama(size: str, batch: tuple[int, int], device: torch.device) -> tuple[str, nn.Module, dict]:
    b, s = batch
    model = models.build_model(size, device, s)
    return f"Llama {size}, {b} x {s} tokens", model, models.random_batch(model.config.vocab_size, b, s, device)


def _forward(model: nn.Module, batch: dict, precision: str) -> Callable[[], object]:
    device_type = next(model.parameters()).device.type

    def forward():
        fp8 = fp8_plugin.autocast(recipe=RECIPES[precision]()) if precision in RECIPES else contextlib.nullcontext()
        with torch.autocast(device_type, dtype=torch.bfloat16), fp8:
            return model(**batch).loss

    return forward


def measure(make: Callable[[], tuple[str, nn.Module, dict]], device: torch.device) -> list[SavedBytes]:
    """BF16 and every recipe on one model (a fresh copy each); each recipe's layers against the
    same layers under BF16."""
    results, bf16_layers, bf16_total = [], {}, None
    for precision in (BASELINE, *RECIPES):
        release_memory(device)
        name, model, batch = make()
        result = SavedBytes(name, precision)
        try:
            if precision in RECIPES:
                fp8_plugin.convert_model(model, RECIPES[precision](), device=device)
            per_layer, result.total_bytes = count_saved(model, _forward(model, batch, precision))
            if precision == BASELINE:
                bf16_layers, bf16_total = per_layer, result.total_bytes
                layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
            else:
                layers = [n for n, m in model.named_modules() if isinstance(m, fp8_plugin.FP8Linear)]
            result.fp8_layers = len(layers)
            result.linear_bytes = sum(per_layer.get(n, 0) for n in layers)
            result.bf16_linear_bytes = sum(bf16_layers.get(n, 0) for n in layers)
            if precision in RECIPES and result.bf16_linear_bytes and bf16_total:
                result.linear_ratio = result.linear_bytes / result.bf16_linear_bytes
                result.total_ratio = result.total_bytes / bf16_total
        except Exception as err:  # noqa: BLE001  (reported; the other precisions go on)
            result.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        results.append(result)
        del model, batch
    return results


def run(llama_size: Optional[str], llama_batch: tuple[int, int], device: torch.device,
        log: Callable[[str], None]) -> dict:
    """MiniLM-L6, and the Llama model of ``llama_size`` (None: none)."""
    makers = [lambda: _minilm(device)]
    if llama_size is not None:
        makers.append(lambda: _llama(llama_size, llama_batch, device))
    results = [r for make in makers for r in measure(make, device)]
    for r in results:
        log(f"saved bytes {r.model} {r.precision}: "
            + (f"linear {r.linear_bytes / 2**20:.1f} MiB" if r.linear_bytes is not None else f"failed ({r.error})"))
    return {"results": [asdict(r) for r in results]}
