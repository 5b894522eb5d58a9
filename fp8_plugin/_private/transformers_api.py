"""The one private hook into transformers this project uses.

``transformers.Trainer.create_accelerator_and_postprocess`` builds its Accelerator as
``Accelerator(**args)``, with ``Accelerator`` looked up in the module ``transformers.trainer``
(imported there from ``accelerate``); transformers offers no public way to choose the class.
:func:`trainer_accelerator_class` makes that name point at another class while the Trainer
builds its Accelerator. It refuses to run when the name no longer holds Accelerate's class, and
tests/test_hf_trainer.py checks that the Trainer ends up with the class given: a transformers
release that changes this fails loudly, not silently without FP8.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["trainer_accelerator_class"]


@contextlib.contextmanager
def trainer_accelerator_class(factory: Callable[..., Any]) -> Iterator[None]:
    """Make ``transformers.trainer.Accelerator`` ``factory`` inside the context.

    Raises:
        RuntimeError: ``transformers.trainer`` has no ``Accelerator`` name holding
            ``accelerate.Accelerator`` (transformers changed how the Trainer builds it).
    """
    import accelerate
    import transformers.trainer as trainer_module

    original = getattr(trainer_module, "Accelerator", None)
    if original is not accelerate.Accelerator:
        raise RuntimeError(
            "transformers.trainer.Accelerator is not accelerate.Accelerator in this transformers version "
            f"(found {original!r}): fp8_plugin.hf_trainer.FP8Trainer cannot choose the Trainer's Accelerator; "
            "use fp8_plugin.accelerate.Accelerator in your own loop instead"
        )
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = original
