"""A quiet run (fp8_plugin/tools/quiet.py): the main job and the command line print no line from
another library that a user cannot act on, and each filter drops its one message and nothing else."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foreign_lines import foreign_lines

ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=300):
    # One thread: the suite's other worker has the second core (two threads each wait on the other).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_main_job_prints_no_line_from_another_library(tmp_path):
    # A twentieth of the articles tested (twice: in FP8 and with FP8 off), as the printed lines are the same.
    proc = run(str(ROOT / "examples" / "finetune_classifier.py"), "--precision", "fp8-hybrid", "--max-steps", "1",
               "--seq-len", "32", "--optimizer", "fp8-adamw", "--test-fraction", "0.05")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "FP8 layers: 36 of 38 linear layers in FP8" in output  # the job ran, in FP8
    # Its test accuracy twice: FP8 layers in FP8, and in the reference precision.
    assert re.search(r"^fp8-hybrid +[01]\.\d{4} +[01]\.\d{4} ", output, re.M), output[-2000:]
    assert foreign_lines(output) == []


def test_the_command_line_prints_no_line_from_another_library():
    proc = run("-m", "fp8_plugin", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DelayedScaling" in proc.stdout and foreign_lines(proc.stdout + proc.stderr) == []


def test_each_filter_drops_its_one_message_and_nothing_else():
    code = textwrap.dedent('''
        import logging, sys, warnings
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
        from fp8_plugin.tools.quiet import quiet_foreign_output
        quiet_foreign_output()
        quiet_foreign_output()  # twice: still one filter each
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1")
        logging.getLogger("torchao").warning("torchao: another warning")
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass and is now "
                                                         "natively supported by torch.compile")
        logging.getLogger("torch.utils._pytree").warning("<enum 'Mine'> is an Enum subclass and is now natively "
                                                         "supported by torch.compile")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info(
            "Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](x)")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", DeprecationWarning, "x.py", 1,
                               module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", DeprecationWarning, "y.py", 1,
                               module="mine")
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "m.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit("an fp8_plugin warning", UserWarning, "f.py", 1, module="fp8_plugin.modules.linear")
        import fp8_plugin.modules.autocast as a
        a._warn_no_fp8_layer()  # the project's own
        ''')
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    for dropped in ("Skipping import of cpp extensions", "KernelPreference", "litlogger", "x.py",
                    "is_gradient_checkpointing"):
        assert dropped not in err, dropped
    for kept in ("torchao: another warning", "<enum 'Mine'>", "GPU available: False", "y.py",
                 "an fp8_plugin warning", "no FP8 layer ran"):
        assert kept in err, kept
