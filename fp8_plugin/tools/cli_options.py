"""Option types the command line's commands share (``tools/cli.py``, ``tools/memory_cli.py``)."""

from __future__ import annotations

from enum import Enum
from typing import Union

__all__ = ["SkipSmall", "skip_small_value"]


class SkipSmall(str, Enum):
    """``--skip-small``: ``convert_model``'s ``skip_small`` as the command line spells it."""

    auto = "auto"
    true = "true"
    false = "false"


def skip_small_value(value: SkipSmall) -> Union[str, bool]:
    """``convert_model``'s ``skip_small`` for a ``--skip-small`` value: ``"auto"``, True or False."""
    return {"auto": "auto", "true": True, "false": False}[SkipSmall(value).value]
