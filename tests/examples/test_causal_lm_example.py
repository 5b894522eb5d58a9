"""The causal-LM example under `accelerate launch` with its config file: the real SmolLM2
checkpoint (converted from the packaged GGUF file), real text, two steps of each run, and a BF16
reference check of the FP8 run's second step."""

import os
import re
import subprocess
import sys
from pathlib import Path

from foreign_lines import foreign_lines

ROOT = Path(__file__).resolve().parents[2]


def test_accelerate_launch_runs_the_causal_lm_example_with_its_config_file(smollm2_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # One thread: the suite's other worker has the second core (two threads each wait on the other).
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "examples" / "accelerate_fp8.yaml"), str(ROOT / "examples" / "finetune_causal_lm.py"),
           "--model-path", str(smollm2_path), "--max-steps", "2", "--seq-len", "32", "--batch-size", "2",
           "--val-blocks", "2", "--reference-every", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert foreign_lines(proc.stdout + proc.stderr) == []  # a quiet run (fp8_plugin/tools/quiet.py)
    # The config file's fp8_config reached the FP8 run: amax history 16, "max".
    assert "210 of 211 linear layers in FP8" in out
    assert "amax_history_len=16, amax_compute_algo='max'" in out
    # The reference checks: the option's interval, the config file's policy; one check, its figures, the summary.
    assert "'reference_every': 'Accelerator(fp8_reference_every)'" in out
    assert "'reference_policy': 'ACCELERATE_FP8_REFERENCE_POLICY'" in out
    assert "BF16 reference checks: every 2 steps, policy 'warn'" in out
    check_line = r"^  step +2  reference check: loss FP8 [\d.]+ vs BF16 [\d.]+, grad cosine"
    assert re.search(check_line, out, re.M), out[-3000:]
    assert "FP8 reference checks: 1 run (every 2 steps, policy 'warn')" in out
    rows = re.findall(r"^(fp8|reference) \S+\s+([\d.]+)\s+([\d.]+)\s+(\S+)", out, re.M)
    assert [r[0] for r in rows] == ["fp8", "reference"], out[-2000:]
    assert all(float(before) > 1 and float(after) > 1 for _, before, after, _ in rows)
    # The FP8 run validated in FP8 too (its own column), the reference run not.
    (_, _, _, fp8_in_fp8), (_, _, _, reference_in_fp8) = rows
    assert float(fp8_in_fp8) > 1 and reference_in_fp8 == "-"
