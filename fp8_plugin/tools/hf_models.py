"""Which transformers class loads a Hugging Face config: the command line's and the memory tool's."""

from __future__ import annotations

from typing import Any

__all__ = ["model_class"]


def model_class(config: Any) -> type:
    """The model class for ``config``: the Auto class whose mapping gives ``config.architectures[0]``,
    else that class from transformers by name, else ``AutoModel``."""
    import transformers
    from transformers.models.auto import modeling_auto

    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return transformers.AutoModel
    wanted = architectures[0]
    names = ["AutoModel"] + sorted(n for n in dir(modeling_auto) if n.startswith("AutoModelFor"))
    for name in names:
        auto = getattr(modeling_auto, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None:
            continue
        try:
            cls = mapping[type(config)]
        except (KeyError, ValueError, ImportError, AttributeError):
            continue
        if getattr(cls, "__name__", None) == wanted:
            return auto
    cls = getattr(transformers, wanted, None)
    if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
        return cls
    return transformers.AutoModel
