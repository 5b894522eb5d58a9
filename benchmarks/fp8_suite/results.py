"""Benchmark results as rows, one per (model or layer, mode, recipe), and their markdown tables.

A results file (``benchmarks/results/<date>-<device>.json``, e.g. ``2026-11-27-h100.json``) is a
JSON list of rows gathered from one GPU run's archive by :func:`collect`: the suite's layer
sections (``suite.py --sections layer``: ``layer.json`` eager, ``compiled.json`` compiled) and
the model table (``models.json``, ``benchmarks/model_table.py``). Every row has:

- ``date`` (``YYYY-MM-DD``), ``device`` (as torch reports it: ``"NVIDIA H100 80GB HBM3 (sm90)"``),
  ``torch``, ``commit``;
- ``model`` (model rows) or ``layer`` (``"MxKxN"``, layer rows), the other None;
- ``mode``: ``"eager"``, ``"compiled"``, ``"graphs"`` (CUDA graphs) or ``"eager-triton"`` (eager, the Triton GEMM);
- ``recipe``: layers: the suite's variant (``"bf16"``, ``"delayed"``, ``"current"``, ``"mxfp8"``,
  ``"blockwise"``, ``"delayed+triton"``, ``"current+triton"``, ``"torchao"``); models: the precision (``"bf16-mixed"``, ``"fp8-hybrid"``,
  ``"torchao-tensorwise"``), with the recipe ``fp8-hybrid`` resolved to in ``fp8_recipe``;
- ``tokens_per_s`` (models, tokens per second) or ``ms`` (layers, milliseconds per forward +
  backward); ``peak_mib``: ``torch.cuda.max_memory_allocated`` in MiB (None on a CPU);
- ``speedup``: models over the same model's ``bf16-mixed`` eager run, layers over the BF16 layer
  of the same shape and mode; None for a baseline and for a row that did not run;
- ``error``: None when the row ran, else what happened (``"not run: torchao not installed"``).

Model rows also carry ``memory_ratio``, ``fp8_layers``, ``linear_layers``, ``batch`` and
``seq_len``; layer rows ``gemm_path``.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any, Optional

Row = dict[str, Any]
MIB = 2**20
# The archive's files, in the order their rows come.
LAYER_FILES = ("layer.json", "compiled.json")
MODEL_FILE = "models.json"


def _common(env: dict, commit: Optional[str]) -> Row:
    known = env.get("commit") not in (None, "unknown")
    return {"date": str(env.get("date", ""))[:10], "device": env.get("device"), "torch": env.get("torch"),
            "commit": env.get("commit") if known or not commit else commit}


def _mib(peak_bytes: Optional[int]) -> Optional[float]:
    return None if peak_bytes is None else round(peak_bytes / MIB, 1)


def layer_rows(suite: dict, commit: Optional[str] = None) -> list[Row]:
    """Rows of a ``suite.py --sections layer`` JSON (``commit`` replaces an unknown one)."""
    common = _common(suite["environment"], commit)
    return [{**common, "model": None, "layer": f"{r['m']}x{r['k']}x{r['n']}",
             "mode": "compiled" if r["compiled"] else "eager", "recipe": r["variant"], "tokens_per_s": None,
             "ms": r["ms"], "peak_mib": _mib(r["peak_bytes"]), "speedup": r["speedup"], "error": r["error"],
             "gemm_path": r.get("gemm_path")}
            for r in suite["layer"]["results"]]


def model_rows(table: dict, commit: Optional[str] = None) -> list[Row]:
    """Rows of a ``benchmarks/model_table.py`` JSON (``commit`` replaces an unknown one)."""
    common = _common(table["environment"], commit)
    rows = []
    for r in table["results"]:
        error = None if r["status"] == "ran" else f"{r['status']}: {r['error']}"
        rows.append({**common, "model": r["model"], "layer": None, "mode": r["mode"], "recipe": r["precision"],
                     "tokens_per_s": r["tokens_per_s"], "ms": None, "peak_mib": _mib(r["peak_bytes"]),
                     "speedup": r["speedup"], "error": error, "fp8_recipe": r["fp8_recipe"],
                     "memory_ratio": r["memory_ratio"], "fp8_layers": r["fp8_layers"],
                     "linear_layers": r["linear_layers"], "batch": r["batch"], "seq_len": r["seq_len"]})
    return rows


def _read_archive(source: Path) -> dict[str, dict]:
    """The JSON files of a ``gpu_run.sh`` archive (``gpu_run.tar.gz``) or of its unpacked folder."""
    names = (*LAYER_FILES, MODEL_FILE)
    if source.is_dir():
        return {n: json.loads((source / n).read_text()) for n in names if (source / n).exists()}
    found = {}
    with tarfile.open(source) as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            if name in names and member.isfile():
                found[name] = json.loads(archive.extractfile(member).read())
    return found


def collect(source: Path, commit: Optional[str] = None) -> list[Row]:
    """Every row of a GPU run: its layer sections, then its model table (files it lacks, steps
    that did not run, are left out). ``commit`` replaces an unknown commit (a device machine
    without the git checkout)."""
    files = _read_archive(Path(source))
    rows = [row for name in LAYER_FILES if name in files for row in layer_rows(files[name], commit)]
    if MODEL_FILE in files:
        rows += model_rows(files[MODEL_FILE], commit)
    # compiled.json times the larger shape eagerly again beside its compiled variants: the first
    # row of each (model or layer, mode, recipe) is kept, layer.json's.
    unique: dict[tuple, Row] = {}
    for row in rows:
        unique.setdefault((row["model"], row["layer"], row["mode"], row["recipe"]), row)
    return list(unique.values())


def device_slug(device: str) -> str:
    """A short file-name form of a device: ``"NVIDIA H100 80GB HBM3 (sm90)"`` -> ``"h100"``,
    ``"NVIDIA GH200 480GB (sm90)"`` -> ``"gh200"``; a CPU -> ``"cpu"``; else the name, slugged."""
    name = re.sub(r"\(sm\d+\)|NVIDIA|Tesla", "", device or "")
    if "cores" in name or not name.strip():  # common.device_name's CPU form
        return "cpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if model:
        return model.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_path(rows: list[Row], directory: Path) -> Path:
    """``directory/<date>-<device slug>.json`` for ``rows`` (their first row's date and device)."""
    first = rows[0] if rows else {}
    return Path(directory) / f"{first.get('date') or 'undated'}-{device_slug(first.get('device') or '')}.json"


def render_markdown(rows: list[Row]) -> str:
    """The rows as markdown for docs/benchmarks.md: a line naming the device(s), torch, commit and
    date, then a model table and a layer table (each only when it has rows)."""
    def cell(value: Any, form: str, suffix: str = "") -> str:
        return "—" if value is None else f"{value:{form}}{suffix}"

    def note(row: Row) -> str:
        if row["error"]:
            return row["error"].replace("|", "\\|")
        if row.get("fp8_layers") is not None:
            recipe = f" ({row['fp8_recipe']})" if row.get("fp8_recipe") else ""
            return f"{row['fp8_layers']}/{row['linear_layers']} layers FP8{recipe}"
        return row.get("gemm_path") or ""

    runs = sorted({(r["device"], r["torch"], r["commit"], r["date"]) for r in rows}, key=str)
    lines = ["; ".join(f"{d}, torch {t}, commit `{c}`, {day}" for d, t, c, day in runs) + "."]
    models = [r for r in rows if r.get("model") is not None]
    layers = [r for r in rows if r.get("layer") is not None]
    if models:
        lines += ["", "| model | mode | recipe | tokens/s | vs bf16-mixed eager | peak MiB "
                      "| memory vs bf16-mixed eager | note |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['model']} | {r['mode']} | {r['recipe']} | {cell(r['tokens_per_s'], ',.0f')} | "
                  f"{cell(r['speedup'], '.2f', 'x')} | {cell(r['peak_mib'], ',.0f')} | "
                  f"{cell(r.get('memory_ratio'), '.2f', 'x')} | {note(r)} |" for r in models]
    if layers:
        lines += ["", "| layer (MxKxN) | mode | recipe | ms | vs bf16 | peak MiB | note |",
                  "| --- | --- | --- | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['layer']} | {r['mode']} | {r['recipe']} | {cell(r['ms'], '.3f')} | "
                  f"{cell(r['speedup'], '.2f', 'x')} | {cell(r['peak_mib'], ',.0f')} | {note(r)} |" for r in layers]
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- gpu-results:start -->", "<!-- gpu-results:end -->"


def readme_markdown(runs: list[list[Row]]) -> str:
    """The README's compact table of GPU results: per results file (a GPU run, newest first), a
    line naming the device, torch, commit and date, then each FP8 row that has a speed-up (its
    workload, mode, recipe, speed-up and memory against BF16 in the same loop or layer shape); a
    model row that ran no FP8 layer says so beside its recipe."""
    lines: list[str] = []
    for rows in sorted(runs, key=lambda rs: rs[0]["date"] if rs else "", reverse=True):
        if not rows:
            continue
        first = rows[0]
        lines += [f"{first['device']}, torch {first['torch']}, commit `{first['commit']}`, {first['date']}:", "",
                  "| workload | mode | FP8 recipe | speed-up vs BF16 | peak memory vs BF16 |",
                  "| --- | --- | --- | ---: | ---: |"]
        for r in rows:
            if r.get("speedup") is None:
                continue
            workload = f"{r['model']} model" if r.get("model") else f"FP8Linear {r['layer'].replace('x', ' x ')}"
            memory = r.get("memory_ratio")
            if memory is None and r.get("layer") and r.get("peak_mib"):
                base = next((b for b in rows if b.get("layer") == r["layer"] and b["mode"] == r["mode"]
                             and b.get("speedup") is None and b.get("peak_mib")), None)
                memory = r["peak_mib"] / base["peak_mib"] if base else None
            recipe = r["recipe"]
            if r.get("fp8_layers") == 0:  # skip_small="auto" kept every layer in BF16: say so
                recipe += f" (0/{r.get('linear_layers')} layers FP8)"
            lines.append(f"| {workload} | {r['mode']} | {recipe} | {r['speedup']:.2f}x | "
                         f"{'—' if memory is None else f'{memory:.2f}x'} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def with_readme_table(readme: str, table: str) -> str:
    """``readme`` with the text between its results markers replaced by ``table``.

    Raises:
        ValueError: the markers are missing.
    """
    if README_START not in readme or README_END not in readme:
        raise ValueError(f"README lacks the markers {README_START} ... {README_END}")
    head, rest = readme.split(README_START, 1)
    return f"{head}{README_START}\n{table}{README_END}{rest.split(README_END, 1)[1]}"
