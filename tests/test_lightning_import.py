"""fp8_plugin/lightning_hook.py: ``import fp8_plugin`` does not import Lightning, and the
``"fp8-*"`` strings still reach Lightning's Trainer in either import order (fresh interpreters)."""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

TRAINER = 'L.Trainer(precision="fp8-hybrid", accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)'


def _run(code: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_import_fp8_plugin_imports_no_lightning_module():
    out = _run("""
        import sys, fp8_plugin
        print(sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning"))))
    """)
    assert out == "[]"


@pytest.mark.parametrize("order", ["fp8_plugin first", "lightning first"])
def test_precision_strings_work_in_either_import_order(order):
    first, second = ("import fp8_plugin", "import lightning as L") if order == "fp8_plugin first" else (
        "import lightning as L", "import fp8_plugin")
    out = _run(f"""
        {first}
        {second}
        trainer = {TRAINER}
        print(type(trainer.precision_plugin).__name__, trainer.precision)
    """)
    assert out == "FP8Precision fp8-hybrid"


def test_lightning_names_are_importable_lazily_from_the_package():
    out = _run("""
        import sys, fp8_plugin
        before = "lightning" in sys.modules
        plugin = fp8_plugin.FP8Precision()
        print(before, "lightning" in sys.modules, type(plugin).__name__, "FP8Precision" in dir(fp8_plugin))
    """)
    assert out == "False True FP8Precision True"


def test_unknown_fp8_string_lists_the_valid_ones():
    out = _run("""
        import fp8_plugin, lightning as L
        try:
            L.Trainer(precision="fp8-foo", accelerator="cpu", logger=False)
        except ValueError as err:
            print(err)
    """)
    assert out.startswith("precision='fp8-foo' is not a valid FP8 precision; valid: fp8-hybrid, fp8-e4m3")


def test_the_wrapped_private_lightning_method_is_as_expected():
    # The one private Lightning API used: fail loudly if its name or parameters change.
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from fp8_plugin.lightning_hook import WRAPPED_METHOD

    method = getattr(_AcceleratorConnector, WRAPPED_METHOD)
    params = list(inspect.signature(inspect.unwrap(method)).parameters)
    assert params == ["self", "strategy", "accelerator", "precision", "plugins", "sync_batchnorm"]


def test_fabric_precision_strings_work_after_import_fp8_plugin():
    out = _run("""
        import fp8_plugin
        import lightning as L
        fabric = L.Fabric(precision="fp8-current", accelerator="cpu", devices=1)
        print(type(fabric._precision).__name__, type(fabric._precision.fp8.recipe).__name__)
    """)
    assert out == "FP8Precision Float8CurrentScaling"


def test_the_wrapped_private_fabric_method_is_as_expected():
    from lightning.fabric.connector import _Connector

    from fp8_plugin.lightning_hook import WRAPPED_METHOD

    params = list(inspect.signature(inspect.unwrap(getattr(_Connector, WRAPPED_METHOD))).parameters)
    assert params == ["self", "strategy", "accelerator", "precision", "plugins"]
