"""FP8 formats: E4M3 and E5M2, and the HYBRID pairing of the two, in two families.

- **OCP** (NVIDIA GPUs, AMD MI350, CPUs): the OCP 8-bit Floating Point Specification (OFP8)
  rev 1.0, as implemented by ``torch.float8_e4m3fn`` (no infinities, max 448) and
  ``torch.float8_e5m2`` (IEEE-like, max 57344).
- **FNUZ** (AMD MI300: gfx940, gfx941, gfx942): ``torch.float8_e4m3fnuz`` and
  ``torch.float8_e5m2fnuz``, whose exponent bias is one higher (8 and 16), with no infinity and
  no negative zero; the one NaN is the 0x80 pattern. E4M3FNUZ's max is 240, E5M2FNUZ's 57344
  (AMD's Transformer Engine fork, ``_FormatMaxVals``; ``torch.finfo``).

A recipe names a format (``Format.HYBRID``); the device picks the family
(:func:`fp8_plugin.numerics.device_kind.fp8_family`), as AMD's fork picks FNUZ with
``is_fp8_fnuz()``.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["Format", "fp8_dtype", "fp8_max", "parse_format", "FAMILIES", "has_infinity", "is_e4m3", "is_fnuz"]

# FP8 format families: which dtypes a format name stands for on a device.
FAMILIES = ("ocp", "fnuz")


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


_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0,
        torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2fnuz: 57344.0}
_FNUZ = {torch.float8_e4m3fn: torch.float8_e4m3fnuz, torch.float8_e5m2: torch.float8_e5m2fnuz}


def fp8_dtype(fmt: Format, *, backward: bool, family: str = "ocp") -> torch.dtype:
    """Torch dtype used by ``fmt`` in the backward (``backward=True``) or forward pass, in the
    format ``family`` (``"ocp"`` or ``"fnuz"``: :func:`fp8_plugin.numerics.device_kind.fp8_family`).

    Raises:
        ValueError: an unknown ``family``.
    """
    dtype = fmt.backward_dtype if backward else fmt.forward_dtype
    if family == "ocp":
        return dtype
    if family == "fnuz":
        return _FNUZ[dtype]
    raise ValueError(f"family={family!r} is not an FP8 format family; valid: {', '.join(FAMILIES)}")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2 (OCP OFP8 rev 1.0,
    table 1); 240 for E4M3FNUZ, 57344 for E5M2FNUZ (``torch.finfo``).

    Raises:
        ValueError: ``dtype`` is not one of the four FP8 dtypes.
    """
    try:
        return _MAX[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype} is not an FP8 dtype; valid: torch.float8_e4m3fn, torch.float8_e5m2, "
            "torch.float8_e4m3fnuz, torch.float8_e5m2fnuz"
        ) from None


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the four FP8 dtypes (OCP E4M3 / E5M2, FNUZ E4M3 / E5M2)."""
    return dtype in _MAX


def has_infinity(dtype: torch.dtype) -> bool:
    """Whether the FP8 dtype encodes infinities: OCP E5M2 only (E4M3 and both FNUZ have none)."""
    return dtype == torch.float8_e5m2


def is_e4m3(dtype: torch.dtype) -> bool:
    """Whether the FP8 dtype is an E4M3 (OCP or FNUZ)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def is_fnuz(dtype: torch.dtype) -> bool:
    """Whether the FP8 dtype is one of AMD MI300's FNUZ formats."""
    return dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


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
