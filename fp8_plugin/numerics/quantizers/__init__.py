"""Quantizers: turn a high-precision tensor into FP8 data plus the scale_inv to undo it.

One small interface, :class:`Quantizer`, that every scaling granularity implements: per-tensor
delayed and current scaling here; block-scaled recipes (MXFP8, 128-blockwise) plug in beside
them by returning a :class:`QuantizedTensor` whose ``scale_inv`` has block shape.

Per-tensor scaling state of a layer lives in :class:`ScalingState`, whose extra state carries it
through ``state_dict()`` / ``load_state_dict()`` (identical scales on resume), and whose tensors
give per-layer figures (amaxes, scales, non-finite counts) without recomputation.

The package, one job per module: :mod:`.tensor` (``QuantizedTensor``, the ``Quantizer``
interface, the roles), :mod:`.state` (``ScalingState`` and its saved form), :mod:`.casts` (the
per-tensor and block quantizers, ``make_quantizer``, ``mark_recorded``), :mod:`.delayed_update`
(``update_delayed_scaling``).
"""

from __future__ import annotations

from .casts import BlockQuantizer, PerTensorQuantizer, columnwise_copy, make_quantizer, mark_recorded
from .delayed_update import update_delayed_scaling
from .state import SCALINGS, STATE_VERSION, ScalingState, check_saved_state, is_scaling_state_key, recipe_key
from .tensor import GRAD_OUTPUT, INPUT, ROLES, WEIGHT, QuantizedTensor, Quantizer  # noqa: F401  (the roles, for the layers)

__all__ = [
    "ROLES",
    "QuantizedTensor",
    "Quantizer",
    "PerTensorQuantizer",
    "BlockQuantizer",
    "make_quantizer",
    "columnwise_copy",
    "ScalingState",
    "is_scaling_state_key",
    "update_delayed_scaling",
    "recipe_key",
    "check_saved_state",
    "mark_recorded",
    "STATE_VERSION",
    "SCALINGS",
]
