"""The import paths the README and docs use work after a bare ``import fp8_plugin`` (fresh
interpreters), and the loop adapters' packages load their training library only when used."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BIN = Path(sys.executable).parent


def _run(code: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


ADAPTER_PATHS = ["fp8_plugin.fabric.FP8Precision", "fp8_plugin.lightning.FP8Precision",
                 "fp8_plugin.lightning.FP8FSDPPrecision", "fp8_plugin.accelerate.Accelerator",
                 "fp8_plugin.hf_trainer.FP8Trainer"]


def test_documented_adapter_paths_work_after_import_fp8_plugin():
    out = _run(f"""
        import sys
        import fp8_plugin
        before = [lib in sys.modules for lib in ("lightning", "accelerate")]
        names = [obj.__name__ for obj in ({", ".join(ADAPTER_PATHS)},)]
        print(before, names)
    """)
    assert out == f"{[False, False]} {[path.rsplit('.', 1)[1] for path in ADAPTER_PATHS]}"


def test_lightning_package_imports_no_lightning_until_a_plugin_is_used():
    out = _run("""
        import sys
        import fp8_plugin.lightning as fl
        before = "lightning" in sys.modules
        names = sorted(fl.__all__)
        print(before, all(n in dir(fl) for n in names))
    """)
    assert out == "False True"


def test_python_m_fp8_plugin_and_the_command_line_start():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in ([sys.executable, "-m", "fp8_plugin", "--help"], [str(BIN / "fp8-plugin"), "--help"]):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Usage" in proc.stdout or "usage" in proc.stdout, proc.stdout
