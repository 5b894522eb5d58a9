"""The private Triton API this package relies on: a compiled kernel's own launcher.

``kernel[grid](*args)`` goes through ``JITFunction.run``, which binds the arguments, computes
their specialization and looks the compiled kernel up on every call: about 12 µs of CPU per
launch (tritonbench), several times the launch itself. The compiled kernel that call returns
has a launcher of its own, ``CompiledKernel[grid](*args)``, which skips all of that; Triton
documents neither it nor the arguments it takes. :func:`compiled_runner` reads how this Triton
passes them (from ``JITFunction.run``'s own launch), and answers None where it cannot tell: the
callers then keep ``kernel[grid]``. ``tests/private/test_triton_private.py`` fails loudly when Triton
changes either.

May import: Triton (only when a kernel launches); nothing of fp8_plugin.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

__all__ = ["launch_convention", "compiled_runner", "LAUNCH_CONVENTIONS"]

# How JITFunction.run hands its arguments to the compiled kernel's launcher: every parameter in
# signature order, constexprs included (Triton 3.3 and later), or the runtime ones only (before).
LAUNCH_CONVENTIONS = {"*bound_args.values()": "all", "*non_constexpr_vals": "runtime"}


@functools.lru_cache(maxsize=None)
def launch_convention() -> Optional[str]:
    """``"all"`` or ``"runtime"``: which arguments this Triton's launchers take (see
    :data:`LAUNCH_CONVENTIONS`), read from ``JITFunction.run``'s source; None where it matches
    neither or has no source to read."""
    from triton.runtime.jit import JITFunction

    try:
        source = inspect.getsource(JITFunction.run)
    except (OSError, TypeError):
        return None
    launch = source.split("kernel.run(", 1)[-1] if "kernel.run(" in source else ""
    found = {convention for marker, convention in LAUNCH_CONVENTIONS.items() if marker in launch}
    return found.pop() if len(found) == 1 else None


def compiled_runner(compiled: Any, grid: tuple[int, int, int]) -> Optional[Callable[..., None]]:
    """The launcher of ``compiled`` (what ``kernel[grid](...)`` returned) bound to ``grid``, or
    None where it cannot be used: Triton's interpreter (which returns no compiled kernel) or an
    unknown argument convention. The runner launches on the current stream of the current device
    and calls Triton's launch hooks (a profiler's), as ``kernel[grid]`` does."""
    if compiled is None or not hasattr(compiled, "__getitem__") or launch_convention() is None:
        return None
    return compiled[grid]
