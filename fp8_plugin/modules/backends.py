"""Backends that build FP8 layers: the one seam between the model swap and a layer library.

``native`` is this project's :class:`~fp8_plugin.modules.linear.FP8Linear` (torch._scaled_mm, exact
emulation where no FP8 GEMM exists). A Transformer Engine backend registers here later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ..numerics.recipes import Recipe
from .linear import FP8Linear

__all__ = ["Backend", "get_backend", "BACKENDS"]


@dataclass(frozen=True)
class Backend:
    """How to turn a high-precision linear layer into an FP8 one.

    Attributes:
        name: the name users pass as ``backend=``.
        make_linear: ``(module, recipe) -> FP8 module`` reusing the module's Parameters.
        fp8_types: classes of the layers it builds, so a converted model is recognised.
    """

    name: str
    make_linear: Callable[[nn.Module, Optional[Recipe]], nn.Module]
    fp8_types: tuple[type, ...]


BACKENDS: dict[str, Backend] = {
    "native": Backend("native", FP8Linear.from_module, (FP8Linear,)),
}


def get_backend(name: str) -> Backend:
    """Backend registered under ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend={name!r} is not available; valid: {', '.join(sorted(BACKENDS))}") from None
