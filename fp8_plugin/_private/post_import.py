"""Run a function on a module once it is imported, without importing it (a post-import hook).

Python has no public post-import hook; the import system's documented extension point is a
``sys.meta_path`` finder. :func:`when_imported` calls back at once when the module is imported
already, else installs a finder for that one module: it finds the real spec through the other
finders, wraps its loader so that the callback runs right after the module's code, and removes
itself (installed again when the import fails, for the retry). ``import fp8_plugin`` uses it so
as not to import what it adapts: Lightning's connectors (:mod:`fp8_plugin.lightning.import_hook`)
and ``torch._dynamo`` (:mod:`.compile_marks`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

__all__ = ["PostImportFinder", "when_imported"]

_lock = threading.RLock()


def when_imported(module: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` now if ``module`` (a dotted name) is imported, else right after
    its import completes. Idempotent for one (module, callback) pair while it waits."""
    imported = sys.modules.get(module)
    if imported is not None:
        callback(imported)
    else:
        _install(module, callback)


def _install(module: str, callback: Callable[[ModuleType], None]) -> None:
    with _lock:
        if not any(isinstance(f, PostImportFinder) and f.module == module and f.callback == callback
                   for f in sys.meta_path):
            sys.meta_path.insert(0, PostImportFinder(module, callback))


class _CallbackAfterExec(importlib.abc.Loader):
    """Runs the real loader, then the callback on the module it executed."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        except BaseException:
            # The import failed (the half-run module is still in sys.modules until this returns):
            # call back when it is retried.
            _install(module.__name__, self._callback)
            raise
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds one module through the other finders and wraps its loader; fires once.

    Attributes:
        module: the dotted name it waits for.
        callback: what it calls with the module once imported.
    """

    def __init__(self, module: str, callback: Callable[[ModuleType], None]) -> None:
        self.module = module
        self.callback = callback

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != self.module:
            return None
        with _lock:  # fire once; the other finders find the real spec
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbackAfterExec(spec.loader, self.callback)
        return spec
