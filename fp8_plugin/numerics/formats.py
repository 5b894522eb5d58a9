"""FP8 formats: E4M3 and E5M2, and the HYBRID pairing of the two.

Numbers follow the OCP 8-bit Floating Point Specification (OFP8) rev 1.0, as implemented by
``torch.float8_e4m3fn`` (no infinities, max 448) and ``torch.float8_e5m2`` (IEEE-like, max 57344).
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["Format", "fp8_dtype", "fp8_max", "parse_format"]


class Format(Enum):
    """FP8 format of a recipe, named as Transformer Engine names it (``transformer_engine.common.recipe.Format``).

    - ``E4M3``: E4M3 in the forward and the backward pass.
    - ``E5M2``: E5M2 in both passes. Only valid for recipes that never quantize forward tensors; the
      recipes here refuse it because E5M2's 2-bit mantissa is too coarse for activations and weights.
    - ``HYBRID``: E4M3 for activations and weights in the forward pass, E5M2 for output gradients
      in the backward pass (Micikevicius et al., "FP8 Formats for Deep Learning", 2022).
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        """Torch dtype of activations and weights in the forward pass."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """Torch dtype of output gradients (grad_output) in the backward pass."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_dtype(fmt: Format, *, backward: bool) -> torch.dtype:
    """Torch dtype used by ``fmt`` in the backward (``backward=True``) or forward pass."""
    return fmt.backward_dtype if backward else fmt.forward_dtype


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2 (OCP OFP8 rev 1.0, table 1).

    Raises:
        ValueError: ``dtype`` is not ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    """
    try:
        return _MAX[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype} is not an FP8 dtype; valid: torch.float8_e4m3fn, torch.float8_e5m2"
        ) from None


def parse_format(value: Format | str, setting: str = "fp8_format") -> Format:
    """Accept a ``Format`` or its name (any case) and return the ``Format``.

    Raises:
        ValueError: the value names no format; the message lists the valid ones.
    """
    if isinstance(value, Format):
        return value
    if isinstance(value, str) and value.upper() in Format.__members__:
        return Format[value.upper()]
    valid = ", ".join(f"Format.{f.name}" for f in Format)
    raise ValueError(f"{setting}={value!r} is not a valid FP8 format; valid: {valid}")
