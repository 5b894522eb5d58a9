"""transformers' ``Trainer`` with FP8: ``FP8Trainer`` is a drop-in for ``Trainer``.

It runs the Trainer on :class:`fp8_plugin.accelerate.Accelerator` with ``mixed_precision="fp8"``;
the Trainer's own precision setting becomes the dtype of the non-FP8 ops (``bf16=True``: BF16;
``fp16=True``: FP16 with Accelerate's loss scaler; neither: float32). Everything else is the
Trainer's: the model is converted when the Trainer prepares it, each optimizer step ends an FP8
training step (one amax reduction per step across processes, however many accumulated
micro-batches), evaluation runs in high precision, ``save_model`` writes a vanilla checkpoint.
``accelerate launch`` with a config file saying ``mixed_precision: fp8`` works too: the
``fp8_config`` keys apply as in :mod:`fp8_plugin.accelerate.settings`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

from transformers import Trainer

from ._transformers_private import trainer_accelerator_class
from .accelerate import Accelerator
from .accelerate.settings import BASE_PRECISION
from .recipes import Recipe
from .training import Patterns

__all__ = ["FP8Trainer"]

_COMPUTE_DTYPES = {precision: dtype for dtype, precision in BASE_PRECISION.items()}


class FP8Trainer(Trainer):
    """``transformers.Trainer`` whose linear layers train in FP8.

    Args:
        *args, **kwargs: those of ``transformers.Trainer``.
        fp8_recipe: a :class:`~fp8_plugin.recipes.Recipe` or an ``"fp8-*"`` precision string;
            default: the config file's, else ``AutoRecipe()`` (HYBRID).
        fp8_include, fp8_exclude: module-name glob patterns for :func:`fp8_plugin.convert_model`.

    Attributes:
        accelerator: a :class:`fp8_plugin.accelerate.Accelerator`; ``accelerator.fp8_reports``
            says which layers run in FP8 once training started.

    Raises:
        ValueError: as :class:`fp8_plugin.accelerate.Accelerator` (bad or contradictory FP8
            settings, DeepSpeed), when the Trainer is built.
        RuntimeError: a transformers version that builds its Accelerator differently.
    """

    def __init__(self, *args: Any, fp8_recipe: Union[Recipe, str, None] = None, fp8_include: Patterns = None,
                 fp8_exclude: Patterns = None, **kwargs: Any) -> None:
        self._fp8_arguments = {"fp8_recipe": fp8_recipe, "fp8_include": fp8_include, "fp8_exclude": fp8_exclude}
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        factory = functools.partial(_fp8_accelerator, **self._fp8_arguments)
        with trainer_accelerator_class(factory):
            super().create_accelerator_and_postprocess()


def _fp8_accelerator(mixed_precision: Optional[str] = None, **kwargs: Any) -> Accelerator:
    # The Trainer's precision ("bf16", "fp16", "no", or "fp8" from accelerate launch) picks the
    # dtype of the non-FP8 ops; "fp8" leaves it to the config file and the defaults.
    compute_dtype = _COMPUTE_DTYPES.get(str(mixed_precision).lower())
    return Accelerator(mixed_precision="fp8", fp8_compute_dtype=compute_dtype, **kwargs)
