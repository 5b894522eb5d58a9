"""The one private detail of Lightning this project reads.

``DDPStrategy`` keeps its ``start_method`` (``"popen"`` for ``strategy="ddp"``, ``"spawn"`` for
``"ddp_spawn"``, ``"fork"`` / ``"forkserver"``) as ``_start_method``; Lightning has no public
accessor. Under the three multiprocessing start methods the model the user holds after ``fit``
is the main process's copy, into which Lightning loads the trained weights only, so the FP8
precision plugin warns at start-up that the FP8 state stays with the workers and the checkpoints.
tests/private/test_lightning_private.py checks the attribute: a Lightning release that renames it fails
there, not silently.
"""

from __future__ import annotations

from typing import Any

__all__ = ["spawns_workers"]

MULTIPROCESSING_START_METHODS = ("spawn", "fork", "forkserver")


def spawns_workers(strategy: Any) -> bool:
    """Whether a Lightning strategy trains in worker processes whose model the main process
    does not get back (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``)."""
    return getattr(strategy, "_start_method", None) in MULTIPROCESSING_START_METHODS
