"""The model table's "graphs" mode: a Llama's decoder layers replayed as CUDA graphs.

:func:`fp8_plugin.make_graphed_callables` (Transformer Engine's name and arguments) captures each
decoder layer ``model.model.layers[i]``'s forward and backward, called through a module whose
arguments are tensors only (the hidden states and the rotary tables: a capture takes positional
tensors), with no attention mask (causal attention) and no cache. The embedding, the rotary
tables, the final norm, ``lm_head`` and the loss run eagerly around them, as the model's own
forward runs them (``tests/benchmarks/test_model_table.py`` checks that the two compute the same loss).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

import fp8_plugin

class DecoderLayerCall(nn.Module):
    """A decoder layer called with tensors only: ``(hidden [batch, seq, hidden], cos, sin)``,
    the rotary tables as ``model.model.rotary_emb`` returns them; returns the hidden states."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out  # transformers < 5 returned a tuple


def graphed_loss(model: nn.Module, batch: dict[str, torch.Tensor],
                 recipe: Optional[fp8_plugin.Recipe]) -> Callable[[], torch.Tensor]:
    """Capture ``model``'s decoder layers (a ``LlamaForCausalLM``) and return a function computing
    the training loss on ``batch`` with them, the rest eager.

    Call it under the torch autocast the training steps use, with ``cache_enabled=False``
    (graph capture refuses the autocast cache). ``recipe``: FP8 on with that recipe
    (``fp8_enabled=True, fp8_recipe=recipe``), or None for high precision.
    """
    inner = model.model
    ids, labels = batch["input_ids"], batch["labels"]
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden, positions)
        return hidden, cos, sin

    calls = tuple(DecoderLayerCall(layer) for layer in inner.layers)
    hidden, cos, sin = inputs()
    # One sample per layer, needing its gradient as the real hidden states do.
    samples = tuple((hidden.detach().clone().requires_grad_(), cos, sin) for _ in calls)
    fp8 = dict(fp8_enabled=True, fp8_recipe=recipe) if recipe is not None else {}
    graphed = fp8_plugin.make_graphed_callables(calls, samples, **fp8)

    def loss() -> torch.Tensor:
        hidden, cos, sin = inputs()
        for layer in graphed:
            hidden = layer(hidden, cos, sin)
        logits = model.lm_head(inner.norm(hidden))
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

    return loss
