"""Files this project writes, written so that a crash never leaves a truncated one."""

from __future__ import annotations

import os
import tempfile
from typing import IO, Any, Callable

__all__ = ["atomic_write"]


def atomic_write(path: str, write: Callable[[IO[Any]], Any], mode: str = "w") -> None:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, then rename it
    into place: readers see the old file or the whole new one, never a part.

    Args:
        path: the file to create or replace; its folder is created if missing.
        write: called with the open temporary file.
        mode: ``"w"`` (text) or ``"wb"`` (binary).

    Raises:
        OSError: the folder cannot be created or written; whatever ``write`` raises. The
            temporary file is removed and ``path`` keeps its old content.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        # mkstemp makes the file private (0600); the result gets the mode any new file would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
