"""torch.compile's marks on a function, without importing ``torch._dynamo`` at ``import fp8_plugin``.

``torch.compiler.assume_constant_result`` and ``torch.compiler.allow_in_graph`` both import
``torch._dynamo`` first: 2.1 to 2.4 s of CPU on a 2-core AMD EPYC, more than ``import torch``
itself (3.6 s there), paid by every process that imports fp8_plugin, compiled or not. Dynamo is
imported before anything compiles (``torch.compile`` imports it), so a mark can wait for it:

- :func:`assume_constant_result` sets the one attribute torch's decorator sets
  (``torch/_dynamo/decorators.py``, torch 2.11 to 2.13: ``fn._dynamo_marked_constant = True``),
  which dynamo reads when it traces a call; private, pinned by ``tests/private/test_compile_marks.py``.
- :func:`allow_in_graph` calls ``torch.compiler.allow_in_graph`` (public) when ``torch._dynamo``
  is imported: at once if it is already, else from a post-import hook (a ``sys.meta_path`` finder
  for that one module, the mechanism :mod:`fp8_plugin.lightning.import_hook` uses for Lightning).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

__all__ = ["DYNAMO", "assume_constant_result", "allow_in_graph"]

DYNAMO = "torch._dynamo"
F = TypeVar("F", bound=Callable[..., Any])
_pending: list[Callable[..., Any]] = []  # allow_in_graph's functions until dynamo is imported
_lock = threading.RLock()


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo: under
    ``torch.compile`` a call of ``fn`` is evaluated once while tracing and its result taken as a
    constant of the graph. Returns ``fn``."""
    fn._dynamo_marked_constant = True  # what torch's decorator sets (module docstring)
    return fn


def allow_in_graph(fn: F) -> F:
    """``torch.compiler.allow_in_graph(fn)``, applied when ``torch._dynamo`` is imported (at once
    if it is): dynamo puts a call of ``fn`` in the graph as it is, without tracing inside it.
    Returns ``fn``."""
    with _lock:
        if DYNAMO not in sys.modules:
            _pending.append(fn)
            if not any(isinstance(f, _DynamoFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _DynamoFinder())
            return fn
    return torch.compiler.allow_in_graph(fn)


def _apply_pending() -> None:
    with _lock:
        pending, _pending[:] = list(_pending), []
    for fn in pending:
        torch.compiler.allow_in_graph(fn)


class _ApplyAfterExec(importlib.abc.Loader):
    """Runs dynamo's own loader, then marks the pending functions."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        except BaseException:
            with _lock:  # the import failed: mark when it is retried
                sys.meta_path.insert(0, _DynamoFinder())
            raise
        _apply_pending()

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` through the other finders and wraps its loader; fires once."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != DYNAMO:
            return None
        with _lock:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ApplyAfterExec(spec.loader)
        return spec
