"""fp8_plugin/lightning/import_hook.py: ``import fp8_plugin`` does not import Lightning, and the
``"fp8-*"`` strings still reach Lightning's Trainer in either import order (fresh interpreters: one shared by the checks that need only "fp8_plugin, then Lightning")."""

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


# One fresh interpreter serves the checks that need only "fp8_plugin first, then Lightning":
# each step below is one test's scenario, in an order that keeps them apart (nothing of
# Lightning is imported before the steps that must see it absent). Each test asserts its entry.
_FP8_PLUGIN_FIRST = f"""
    import json, sys, fp8_plugin
    from fp8_plugin.lightning import import_hook as lightning_hook
    out = {{}}
    out["lightning_modules"] = sorted(m for m in sys.modules if m == "lightning"
                                      or m.startswith(("lightning.", "pytorch_lightning")))
    lightning_hook.install()
    from fp8_plugin._private.post_import import PostImportFinder
    connectors = (lightning_hook.CONNECTOR_MODULE, lightning_hook.FABRIC_CONNECTOR_MODULE)
    count = lambda: sum(isinstance(f, PostImportFinder) and f.module in connectors for f in sys.meta_path)
    out["finders_before"] = count()
    before = "lightning" in sys.modules
    plugin = fp8_plugin.FP8Precision()
    out["lazy"] = [before, "lightning" in sys.modules, type(plugin).__name__, "FP8Precision" in dir(fp8_plugin)]
    import lightning as L
    trainer = {TRAINER}
    out["trainer"] = [type(trainer.precision_plugin).__name__, trainer.precision]
    try:
        L.Trainer(precision="fp8-foo", accelerator="cpu", logger=False)
    except ValueError as err:
        out["unknown"] = str(err)
    fabric = L.Fabric(precision="fp8-current", accelerator="cpu", devices=1)
    out["fabric"] = [type(fabric._precision).__name__, type(fabric._precision.fp8.recipe).__name__]
    import json, xml.dom.minidom
    out["finders_after"] = count()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fp8_plugin_first():
    import json

    return json.loads(_run(_FP8_PLUGIN_FIRST))


def test_import_fp8_plugin_imports_no_lightning_module(fp8_plugin_first):
    assert fp8_plugin_first["lightning_modules"] == []


def test_precision_strings_work_with_fp8_plugin_imported_first(fp8_plugin_first):
    assert fp8_plugin_first["trainer"] == ["FP8Precision", "fp8-hybrid"]


def test_precision_strings_work_with_lightning_imported_first():
    out = _run(f"""
        import lightning as L
        import fp8_plugin
        trainer = {TRAINER}
        print(type(trainer.precision_plugin).__name__, trainer.precision)
    """)
    assert out == "FP8Precision fp8-hybrid"


def test_lightning_names_are_importable_lazily_from_the_package(fp8_plugin_first):
    assert fp8_plugin_first["lazy"] == [False, True, "FP8Precision", True]


def test_unknown_fp8_string_lists_the_valid_ones(fp8_plugin_first):
    assert fp8_plugin_first["unknown"].startswith(
        "precision='fp8-foo' is not a valid FP8 precision; valid: fp8-hybrid, fp8-e4m3")


def test_the_wrapped_private_lightning_method_is_as_expected():
    # The one private Lightning API used: fail loudly if its name or parameters change.
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from fp8_plugin.lightning.import_hook import WRAPPED_METHOD, WRAPPED_PARAMETERS

    method = getattr(_AcceleratorConnector, WRAPPED_METHOD)
    params = list(inspect.signature(inspect.unwrap(method)).parameters)
    assert params == ["self", "strategy", "accelerator", "precision", "plugins", "sync_batchnorm"]
    assert tuple(params) == WRAPPED_PARAMETERS  # what register() checks at run time


def test_fabric_precision_strings_work_after_import_fp8_plugin(fp8_plugin_first):
    assert fp8_plugin_first["fabric"] == ["FP8Precision", "Float8CurrentScaling"]


def test_the_wrapped_private_fabric_method_is_as_expected():
    from lightning.fabric.connector import _Connector

    from fp8_plugin.lightning.import_hook import WRAPPED_METHOD

    params = list(inspect.signature(inspect.unwrap(getattr(_Connector, WRAPPED_METHOD))).parameters)
    assert params == ["self", "strategy", "accelerator", "precision", "plugins"]


def test_a_changed_private_method_warns_and_import_lightning_still_works():
    # A Lightning that renamed the method: the strings are not registered, Lightning is not broken.
    out = _run("""
        import warnings, fp8_plugin
        from fp8_plugin.lightning import import_hook as lightning_hook
        lightning_hook.WRAPPED_METHOD = "_renamed_by_a_future_lightning"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lightning as L
        trainer = L.Trainer(plugins=[fp8_plugin.FP8Precision()], accelerator="cpu", logger=False)
        print(type(trainer.precision_plugin).__name__, any("are not registered" in str(w.message) for w in caught))
    """)
    assert out == "FP8Precision True"


def test_the_hook_is_installed_once_and_removed_after_it_fired(fp8_plugin_first):
    # install() is idempotent: after import fp8_plugin (which installed them) one finder per
    # connector (the Trainer's and Fabric's), both gone once those modules were imported.
    assert (fp8_plugin_first["finders_before"], fp8_plugin_first["finders_after"]) == (2, 0)


def test_a_failed_connector_import_leaves_the_hook_for_the_retry():
    out = _run("""
        import importlib.machinery, sys, fp8_plugin
        from fp8_plugin.lightning.import_hook import CONNECTOR_MODULE

        class FailsOnce:  # a loader whose first exec fails (say, a broken optional dependency)
            failed = False
            def __init__(self, loader): self.loader = loader
            def create_module(self, spec): return None
            def exec_module(self, module):
                if not FailsOnce.failed:
                    FailsOnce.failed = True
                    raise ImportError("simulated")
                self.loader.exec_module(module)

        class Finder:  # behind fp8_plugin's finder, as any other finder would be
            def find_spec(self, name, path, target=None):
                if name != CONNECTOR_MODULE:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path, target)
                spec.loader = FailsOnce(spec.loader)
                return spec

        ours = next(i for i, f in enumerate(sys.meta_path) if getattr(f, "module", None) == CONNECTOR_MODULE)
        sys.meta_path.insert(ours + 1, Finder())
        try:
            import lightning
        except ImportError as err:
            print("first import:", err)
        for name in [m for m in sys.modules if m.startswith("lightning")]:
            del sys.modules[name]
        import lightning as L
        trainer = L.Trainer(precision="fp8-hybrid", accelerator="cpu", logger=False, enable_checkpointing=False)
        print(type(trainer.precision_plugin).__name__)
    """)
    assert out == "FP8Precision"
