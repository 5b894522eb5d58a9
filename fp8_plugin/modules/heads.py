"""Which layers of a model are output heads: the rule ``convert_model`` keeps them in high
precision by, and the rule the FP8 coverage (:mod:`fp8_plugin.modules.coverage`) excepts them by.

A layer is an output head if the model's ``get_output_embeddings()`` (transformers) returns it,
if its weight is tied to an ``nn.Embedding``, or if a component of its dotted name is one of
:data:`HEAD_NAMES` (transformers' naming of heads: ``lm_head``, ``classifier``, ``score``, ...).
"""

from __future__ import annotations

from torch import nn

__all__ = ["HEAD_NAMES", "output_embedding_ids", "tied_weight_ids", "head_reason"]

# Module-name components that mark an output head (transformers' naming).
HEAD_NAMES = frozenset({"lm_head", "classifier", "score", "qa_outputs", "pooler", "cls", "head", "heads"})


def output_embedding_ids(model: nn.Module) -> set[int]:
    """``id()`` of every module some ``get_output_embeddings()`` in ``model`` returns."""
    ids = set()
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter):
            try:
                out = getter()
            except (NotImplementedError, AttributeError):
                out = None
            if isinstance(out, nn.Module):
                ids.add(id(out))
    return ids


def tied_weight_ids(model: nn.Module) -> set[int]:
    """``id()`` of the weight of every ``nn.Embedding`` in ``model``."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def head_reason(name: str, module: nn.Module, heads: set[int], tied: set[int]) -> str:
    """Why the layer ``module`` at ``name`` is an output head; "" if it is not.

    ``heads`` and ``tied`` are :func:`output_embedding_ids` and :func:`tied_weight_ids` of the model.
    """
    if id(module) in heads:
        return "output head (get_output_embeddings)"
    if id(getattr(module, "weight", None)) in tied:
        return "weight tied to an embedding"
    head = next((c for c in name.split(".") if c in HEAD_NAMES), None)
    if head is not None:
        return f"output head ({head!r})"
    return ""
