"""Teach Lightning's Trainer and Fabric the ``"fp8-*"`` precision strings without importing Lightning.

``import fp8_plugin`` must stay as light as torch and transformers: plain-PyTorch and Accelerate
users never pay for Lightning. Lightning has no registry for precision strings (its accelerator
connector accepts a fixed list), so the strings are added by wrapping one private method,
``_check_config_and_set_final_flags`` of the Trainer's ``_AcceleratorConnector`` and of Fabric's
``_Connector``, at the moment each connector module is imported: at once if it already is,
otherwise from a post-import hook (:mod:`fp8_plugin._private.post_import`, a ``sys.meta_path``
finder for each of those two modules). Nothing else of Lightning is touched, and the plugin
classes are imported only when a Trainer or Fabric is given an ``"fp8-*"`` string.

This module imports nothing from Lightning. ``tests/lightning/test_lightning_import.py`` fails loudly if
the wrapped method's name or parameters change.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

from .._private.post_import import when_imported

__all__ = ["CONNECTOR_MODULE", "FABRIC_CONNECTOR_MODULE", "WRAPPED_METHOD", "WRAPPED_PARAMETERS", "SUPPORTED_LIGHTNING", "install", "register", "register_precision_strings"]

CONNECTOR_MODULE = "lightning.pytorch.trainer.connectors.accelerator_connector"
FABRIC_CONNECTOR_MODULE = "lightning.fabric.connector"
WRAPPED_METHOD = "_check_config_and_set_final_flags"
# Its parameters in the Trainer's connector; Fabric's lacks the last one.
WRAPPED_PARAMETERS = ("self", "strategy", "accelerator", "precision", "plugins", "sync_batchnorm")
# Lightning versions whose connector has the method and signature wrapped here: [low, high).
SUPPORTED_LIGHTNING = ("2.4", "3")

_lock = threading.Lock()


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def _is_fp8_string(precision: object) -> bool:
    return isinstance(precision, str) and precision.lower().startswith("fp8")


def register(connector: ModuleType) -> bool:
    """Wrap a connector's flag check so that ``"fp8-*"`` strings become FP8 plugins. Idempotent.

    Args:
        connector: the imported ``lightning.pytorch.trainer.connectors.accelerator_connector``
            (Trainer) or ``lightning.fabric.connector`` (Fabric).

    Returns:
        True when the strings are registered; False (with a warning) on a Lightning version
        outside ``SUPPORTED_LIGHTNING`` or whose connector lacks the wrapped method with the
        expected parameters, where ``plugins=[fp8_plugin.FP8Precision()]`` (or
        ``fp8_plugin.fabric.FP8Precision()``) still works. It never raises for a changed
        Lightning: it runs inside ``import lightning``, which must not fail because of it.
    """
    fabric = connector.__name__ == FABRIC_CONNECTOR_MODULE
    cls = getattr(connector, "_Connector" if fabric else "_AcceleratorConnector", None)
    with _lock:
        if getattr(cls, "_fp8_plugin_registered", False):
            return True
        try:
            found = version("lightning")
        except PackageNotFoundError:  # a source checkout: trust the method check below
            found = "0"
        low, high = SUPPORTED_LIGHTNING
        if found != "0" and not _version_tuple(low) <= _version_tuple(found) < _version_tuple(high):
            warnings.warn(
                f"fp8_plugin: lightning=={found} is outside the supported range [{low}, {high}); precision "
                "strings 'fp8-*' are not registered. Use plugins=[fp8_plugin.FP8Precision()] (Trainer) or "
                "plugins=[fp8_plugin.fabric.FP8Precision()] (Fabric).",
                stacklevel=2,
            )
            return False
        # The one private Lightning API used here (tests/lightning/test_lightning_import.py pins it).
        expected = WRAPPED_PARAMETERS[:-1] if fabric else WRAPPED_PARAMETERS
        original = getattr(cls, WRAPPED_METHOD, None)
        if original is None or tuple(inspect.signature(original).parameters) != expected:
            warnings.warn(
                f"fp8_plugin: lightning=={found} has no {connector.__name__}.{getattr(cls, '__name__', '?')}."
                f"{WRAPPED_METHOD}{expected}; precision strings 'fp8-*' are not registered. Use "
                "plugins=[fp8_plugin.FP8Precision()] (Trainer) or plugins=[fp8_plugin.fabric.FP8Precision()] (Fabric).",
                stacklevel=2,
            )
            return False
        if fabric:

            @functools.wraps(original)
            def _check_config_and_set_final_flags(self, strategy, accelerator, precision, plugins):
                _refuse_other_loops_plugin(plugins, fabric=True)
                if _is_fp8_string(precision):
                    plugins = _with_fp8_plugin(precision, strategy, accelerator, plugins, fabric=True)
                    precision = None
                return original(self, strategy, accelerator, precision, plugins)

        else:

            @functools.wraps(original)
            def _check_config_and_set_final_flags(self, strategy, accelerator, precision, plugins, sync_batchnorm):
                _refuse_other_loops_plugin(plugins, fabric=False)
                if _is_fp8_string(precision):
                    plugins = _with_fp8_plugin(precision, strategy, accelerator, plugins, fabric=False)
                    precision = None
                return original(self, strategy, accelerator, precision, plugins, sync_batchnorm)

        setattr(cls, WRAPPED_METHOD, _check_config_and_set_final_flags)
        cls._fp8_plugin_registered = True
        return True


def _as_list(plugins: Any) -> list:
    import torch

    if plugins is None:
        return []
    if not isinstance(plugins, Iterable) or isinstance(plugins, (str, torch.nn.Module)):
        return [plugins]
    return list(plugins)


def _refuse_other_loops_plugin(plugins: Any, fabric: bool) -> None:
    """Refuse, when the Trainer or Fabric is built, the FP8 plugin written for the other loop.

    The Trainer's plugin is a Fabric ``Precision`` too, so Fabric would accept it and fail at the
    first backward (it reaches for a Trainer); the Trainer refuses Fabric's with a message that
    does not say which class to use.

    Raises:
        TypeError: naming the class that loop takes.
    """
    # Imported here: Lightning is fully imported by the time a Trainer or Fabric is built.
    if fabric:
        from .deepspeed_precision import FP8DeepSpeedPrecision
        from .precision import FP8FSDPPrecision, FP8Precision

        wrong = (FP8Precision, FP8FSDPPrecision, FP8DeepSpeedPrecision)
        right = "fp8_plugin.fabric.FP8Precision (or precision='fp8-hybrid')"
    else:
        from ..fabric.precision import FP8Precision

        wrong, right = (FP8Precision,), ("fp8_plugin.FP8Precision, FP8FSDPPrecision under FSDP, FP8DeepSpeedPrecision "
                                         "under DeepSpeed (or precision='fp8-hybrid')")
    for plugin in _as_list(plugins):
        if isinstance(plugin, wrong):
            loop = "Fabric" if fabric else "the Trainer"
            raise TypeError(f"plugins=[{type(plugin).__module__}.{type(plugin).__name__}(...)] is the FP8 plugin of "
                            f"{'the Trainer' if fabric else 'Fabric'}; {loop} takes {right}")


def _with_fp8_plugin(precision: str, strategy: Any, accelerator: Any, plugins: Any, fabric: bool) -> list:
    # Imported here: Lightning is fully imported by the time a Trainer or Fabric is built.
    if fabric:
        from lightning.fabric.plugins.precision import Precision

        from ..fabric.precision import precision_plugin_from_string
    else:
        from lightning.pytorch.plugins.precision import Precision

        from .precision_strings import precision_plugin_from_string

    plugin = precision_plugin_from_string(precision, strategy, accelerator)
    plugins = _as_list(plugins)
    if any(isinstance(p, Precision) for p in plugins):
        raise ValueError(f"Received both precision={precision!r} and a precision plugin in plugins={plugins}; choose one")
    plugins.append(plugin)
    return plugins


def install() -> None:
    """Register now for each connector already imported, else when it is (a post-import hook,
    :mod:`fp8_plugin._private.post_import`). Idempotent."""
    for module in (CONNECTOR_MODULE, FABRIC_CONNECTOR_MODULE):
        when_imported(module, register)


def register_precision_strings() -> bool:
    """Teach ``lightning.pytorch.Trainer`` the ``"fp8-*"`` precision strings now. Idempotent.

    ``import fp8_plugin`` already arranges this for when Lightning is imported
    (:mod:`fp8_plugin.lightning.import_hook`); calling it imports Lightning's accelerator connector.

    Returns:
        True when the strings are registered; False (with a warning) on a Lightning version
        outside ``SUPPORTED_LIGHTNING``, where ``plugins=[FP8Precision()]`` still works.
    """
    from lightning.pytorch.trainer.connectors import accelerator_connector

    return register(accelerator_connector)
