"""Known-equivalent layer classes: ``nn.Linear`` subclasses whose own ``forward`` computes exactly
what ``nn.Linear`` computes, so that ``convert_model`` may swap them like ``nn.Linear``.

A subclass that overrides ``forward`` is in general not swapped: the FP8 layer would compute
``nn.Linear``'s function instead of the subclass's. A class listed here is the exception: its
forward was read, and ``tests/modules/test_equivalent_subclasses.py`` checks it against ``nn.Linear``
bit for bit on the installed library (outputs and both gradients; float32, bfloat16, float16,
float64; 2-D to 4-D inputs, contiguous or not; with and without bias), so a library update that
changes it fails there. An entry covers the exact class only, never its subclasses, and may
hold a condition an instance must meet.

The list:

* ``transformers.models.falcon.modeling_falcon.FalconLinear``, without a bias. Its forward is
  ``input @ self.weight.T`` (plus ``self.bias``); without a bias that is the ``matmul`` that
  ``F.linear`` runs. With a bias it is refused: it rounds ``input @ W^T`` to the input dtype
  and then adds the bias (two roundings) where ``nn.Linear``'s ``addmm`` rounds ``x W^T + b``
  once, so the two differ in the last bit in bfloat16, float16 and float64. Falcon configs have
  ``bias=False`` by default (Falcon-7B, -40B, -180B); ``bias=True`` ones (falcon-rw) keep their
  linear layers in high precision.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

__all__ = ["EquivalentLinear", "EQUIVALENT_LINEARS", "equivalent_linear_reason"]


@dataclass(frozen=True)
class EquivalentLinear:
    """One known-equivalent ``nn.Linear`` subclass.

    Attributes:
        qualname: ``module.ClassName`` of the class (looked up in ``sys.modules`` only: a
            library that is not imported has no instances to swap).
        condition: ``(layer) -> str``: "" when this instance computes as ``nn.Linear``, else why not.
    """

    qualname: str
    condition: Callable[[nn.Linear], str]

    def load(self) -> Optional[type]:
        """The class itself (importing its module), or None if it does not exist (anymore)."""
        module, _, name = self.qualname.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


def _no_bias(layer: nn.Linear) -> str:
    if layer.bias is None:
        return ""
    return ("equal to nn.Linear only without a bias: with one it rounds x @ W^T before adding the bias, "
            "nn.Linear rounds once")


EQUIVALENT_LINEARS: tuple[EquivalentLinear, ...] = (
    EquivalentLinear("transformers.models.falcon.modeling_falcon.FalconLinear", _no_bias),
)

_BY_NAME = {e.qualname: e for e in EQUIVALENT_LINEARS}


def equivalent_linear_reason(layer: nn.Module) -> Optional[str]:
    """Whether ``layer``'s exact class is on the list, and whether this instance qualifies.

    Returns:
        None: the class is not listed (the general subclass rule applies); "": listed and this
        instance computes as ``nn.Linear``; otherwise why this instance does not.
    """
    cls = type(layer)
    entry = _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
    if entry is None or entry.load() is not cls:  # a class of the same name defined elsewhere
        return None
    return entry.condition(layer)
