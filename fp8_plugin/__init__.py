"""fp8-plugin: FP8 mixed-precision training for Hugging Face models in Lightning and Accelerate.

Importing the package does not import Lightning: it arranges for the Lightning precision strings
(``"fp8-hybrid"``, ``"fp8-e4m3"``, the recipe strings) to be registered when Lightning is
imported (see :mod:`fp8_plugin.lightning.import_hook`). ``fp8_plugin.FP8Precision`` and
``fp8_plugin.FP8FSDPPrecision`` import Lightning when first used, and so do the loop adapters'
packages ``fp8_plugin.lightning``, ``fp8_plugin.fabric``, ``fp8_plugin.accelerate`` and
``fp8_plugin.hf_trainer``: each is imported on first attribute access (PEP 562).

The package's folders are its layers (docs/design.md): ``numerics`` (formats, recipes, scaling,
quantizers, GEMMs), ``modules`` (the FP8 layer, autocast, the model swap), ``training`` (the
loop-neutral core and its services), one folder per loop adapter, ``tools``, and ``_private``
(the private APIs of other libraries). Imports point down that list, never up.
"""

import importlib
from typing import Any

from .lightning.import_hook import install as _install_lightning_hook
from .modules.autocast import autocast, is_fp8_enabled, update_pending_scales
from .modules.calibration import CalibrationReport, calibrate
from .modules.convert import ConversionReport, convert_model, split_fp8_state, too_small_for_fp8
from .modules.cuda_graphs import make_graphed_callables
from .modules.freezing import dequantize_frozen_weights
from .modules.fsdp_fp8 import enable_fp8_all_gather
from .modules.linear import FP8Linear
from .modules.speed_rule import SpeedRule
from .numerics.device import DeviceReport, auto_recipe, describe_device
from .numerics.formats import Format
from . import optim
from .tools.export import export
from .tools.fp8_checkpoint import fp8_checkpoint_recipe, from_pretrained
from .training.distributed import amax_reducer
from .training.faults import FaultPolicy, FP8NonFiniteError
from .training.reference import FP8ReferenceCheckError, ReferenceCheck, ReferenceResult, reference_check
from .training.statistics import FP8Statistics
from .numerics.recipes import (
    AutoRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MMParams,
    MXFP8BlockScaling,
    QParams,
    Recipe,
)

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "QParams",
    "MMParams",
    "AutoRecipe",
    "auto_recipe",
    "describe_device",
    "DeviceReport",
    "FP8Linear",
    "FP8Precision",
    "FP8FSDPPrecision",
    "amax_reducer",
    "enable_fp8_all_gather",
    "autocast",
    "convert_model",
    "ConversionReport",
    "calibrate",
    "CalibrationReport",
    "split_fp8_state",
    "dequantize_frozen_weights",
    "export",
    "from_pretrained",
    "fp8_checkpoint_recipe",
    "too_small_for_fp8",
    "make_graphed_callables",
    "SpeedRule",
    "FaultPolicy",
    "FP8Statistics",
    "FP8NonFiniteError",
    "is_fp8_enabled",
    "ReferenceCheck",
    "ReferenceResult",
    "FP8ReferenceCheckError",
    "reference_check",
    "update_pending_scales",
    "register_precision_strings",
    "optim",
]
__version__ = "0.1.0"

# The Lightning names and the loop adapters' packages, imported on first use (PEP 562): each
# imports its training library, which `import fp8_plugin` must not.
_LIGHTNING_NAMES = ("FP8Precision", "FP8FSDPPrecision", "register_precision_strings")
_ADAPTER_PACKAGES = ("lightning", "fabric", "accelerate", "hf_trainer")


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        from . import lightning

        return getattr(lightning, name)
    if name in _ADAPTER_PACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fp8_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LIGHTNING_NAMES) | set(_ADAPTER_PACKAGES))


_install_lightning_hook()
