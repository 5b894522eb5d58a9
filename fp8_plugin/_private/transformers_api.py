"""The private hooks into transformers this project uses.

``transformers.Trainer.create_accelerator_and_postprocess`` builds its Accelerator as
``Accelerator(**args)``, with ``Accelerator`` looked up in the module ``transformers.trainer``
(imported there from ``accelerate``); transformers offers no public way to choose the class.
:func:`trainer_accelerator_class` makes that name point at another class while the Trainer
builds its Accelerator. It refuses to run when the name no longer holds Accelerate's class, and
tests/hf_trainer/test_hf_trainer.py checks that the Trainer ends up with the class given: a transformers
release that changes this fails loudly, not silently without FP8.

``save_pretrained`` writes a model's weights through the reverse of its weight conversions
(``model._weight_conversions`` when ``from_pretrained`` attached them, else the model's default
conversion mapping), and transformers offers no public way to add the per-expert scale
converters its FP8 quantizer adds at load time. :func:`set_save_conversions_with_scales` does
that, as ``HfQuantizer.update_weight_conversions`` does (the converters' original patterns,
``WeightConverter.copy``). tests/tools/test_export.py checks the keys, dtypes and shapes written and
loads them back with transformers: a release that changes this fails loudly.
:func:`saved_tensors` asks transformers which checkpoint tensors ``save_pretrained`` would write
for some of a model's tensors (``core_model_loading.revert_weight_conversion``, the function
``save_pretrained`` itself calls; not in transformers' documented API), so that the export can
refuse a layout before writing anything.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["trainer_accelerator_class", "set_save_conversions_with_scales", "saved_tensors"]


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


def set_save_conversions_with_scales(model: Any, suffix: str = "_scale_inv") -> None:
    """Make ``model.save_pretrained`` write each tensor merged by a weight converter (e.g.
    Mixtral's ``experts.*.w1.weight`` into ``experts.gate_up_proj``) with its companion
    ``<tensor><suffix>`` split the same way (``experts.<e>.w1.weight_scale_inv``), for every
    converter whose sources are ``*.weight`` tensors.

    Raises:
        RuntimeError: transformers' converters lack the attributes this relies on.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as save_pretrained does for a model not loaded by from_pretrained
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    out = []
    for converter in conversions:
        out.append(converter)
        if not isinstance(converter, WeightConverter):
            continue
        try:
            sources, targets = converter._original_source_patterns, converter._original_target_patterns
            operations = list(converter.operations)
        except AttributeError as error:
            raise RuntimeError(f"transformers' WeightConverter changed ({error}): the per-expert FP8 scales cannot "
                               "be written beside their weights with this transformers version") from None
        if all(s.endswith(".weight") for s in sources):
            out.append(converter.copy([s + suffix for s in sources], [t + suffix for t in targets],
                                      operations=operations))
    model._weight_conversions = out


def saved_tensors(model: Any, tensors: dict) -> dict:
    """The checkpoint tensors ``model.save_pretrained`` would write for ``tensors`` (model
    names -> tensors, meta tensors allowed): its weight conversions reverted, as
    ``save_pretrained`` does (names -> tensors as they would be stored)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)
