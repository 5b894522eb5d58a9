"""The README's first screen: its GPU results table is generated from benchmarks/results/*.json
and matches those files; the quick start and the first GPU figure come early."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fp8_suite import results  # noqa: E402


def test_the_readmes_gpu_table_is_the_one_the_results_files_give():
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks" / "results").glob("*.json"))]
    assert runs, "no results file"
    readme = (ROOT / "README.md").read_text()
    assert results.with_readme_table(readme, results.readme_markdown(runs)) == readme, (
        "README.md's GPU results differ from benchmarks/results/*.json: run python benchmarks/results.py readme")
    for rows in runs:  # every row names its machine, torch, commit and date
        assert all(r["device"] and r["torch"] and r["commit"] and re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"])
                   for r in rows)


def test_the_compact_table_gives_each_fp8_row_against_its_bf16_baseline():
    common = {"device": "NVIDIA H100 80GB HBM3 (sm90)", "torch": "2.11.0+cu130", "commit": "abc1234",
              "date": "2026-12-01", "model": None, "tokens_per_s": None, "error": None}
    rows = [{**common, "layer": "16384x8192x8192", "mode": "eager", "recipe": "bf16", "ms": 8.0, "peak_mib": 1600,
             "speedup": None},
            {**common, "layer": "16384x8192x8192", "mode": "eager", "recipe": "delayed", "ms": 5.0, "peak_mib": 2000,
             "speedup": 1.6},
            {**common, "layer": None, "model": "1b", "mode": "graphs", "recipe": "fp8-hybrid", "ms": None,
             "peak_mib": 900, "speedup": 1.31, "memory_ratio": 0.9, "fp8_layers": 112, "linear_layers": 113},
            {**common, "layer": None, "model": "1b", "mode": "eager", "recipe": "fp8-hybrid", "ms": None,
             "peak_mib": 1000, "speedup": 1.0, "memory_ratio": 1.0, "fp8_layers": 0, "linear_layers": 113}]
    table = results.readme_markdown([rows])
    # "auto" kept every layer in BF16: the row must not read as an FP8 result.
    assert "| 1b model | eager | fp8-hybrid (0/113 layers FP8) | 1.00x | 1.00x |" in table
    assert table.splitlines()[0] == "NVIDIA H100 80GB HBM3 (sm90), torch 2.11.0+cu130, commit `abc1234`, 2026-12-01:"
    assert "| FP8Linear 16384 x 8192 x 8192 | eager | delayed | 1.60x | 1.25x |" in table  # 2000 / 1600 MiB
    assert "| 1b model | graphs | fp8-hybrid | 1.31x | 0.90x |" in table
    assert "bf16" not in table.replace("BF16", "")  # the baseline is the reference, not a row


def test_the_quick_start_and_the_first_gpu_figure_open_the_readme():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_code = next(i for i, line in enumerate(lines, 1) if line.startswith("trainer = L.Trainer("))
    first_figure = next(i for i, line in enumerate(lines, 1) if re.search(r"\| \d+\.\d\dx \|", line))
    assert first_code <= 40 and first_figure <= 60, (first_code, first_figure)
    assert lines[9:11] == [  # the two set-up commands, first
        "bash scripts/install.sh && .venv/bin/python examples/finetune_classifier.py   # the main job",
        "bash scripts/install.sh && .venv/bin/python -m pytest -q                      # the tests"]
