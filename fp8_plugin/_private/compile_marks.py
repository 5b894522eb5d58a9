"""torch.compile's marks on a function, without importing ``torch._dynamo`` at ``import fp8_plugin``.

``torch.compiler.assume_constant_result`` and ``torch.compiler.allow_in_graph`` both import
``torch._dynamo`` first: 2.1 to 2.4 s of CPU on a 2-core AMD EPYC, more than ``import torch``
itself (3.6 s there), paid by every process that imports fp8_plugin, compiled or not. Dynamo is
imported before anything compiles (``torch.compile`` imports it), so a mark can wait for it:

- :func:`assume_constant_result` sets the one attribute torch's decorator sets
  (``torch/_dynamo/decorators.py``, torch 2.11 to 2.13: ``fn._dynamo_marked_constant = True``),
  which dynamo reads when it traces a call; private, pinned by ``tests/private/test_compile_marks.py``.
- :func:`allow_in_graph` calls ``torch.compiler.allow_in_graph`` (public) when ``torch._dynamo``
  is imported: at once if it is already, else from a post-import hook (:mod:`.post_import`, which
  :mod:`fp8_plugin.lightning.import_hook` uses for Lightning's connectors too).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from .post_import import when_imported

__all__ = ["DYNAMO", "assume_constant_result", "allow_in_graph"]

DYNAMO = "torch._dynamo"
F = TypeVar("F", bound=Callable[..., Any])


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
    when_imported(DYNAMO, lambda _dynamo: torch.compiler.allow_in_graph(fn))
    return fn
