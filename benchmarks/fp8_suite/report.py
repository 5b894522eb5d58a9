"""The suite's results as markdown: environment, targets, one table per section."""

from __future__ import annotations

from typing import Optional

from . import layers, saved_bytes

MiB = 2**20
MODEL_SPEEDUP_TARGET = 1.3  # the ~1B model's FP8 step against bf16-mixed, tokens/s
BOOKKEEPING_TARGET = 0.03  # of the MiniLM step time
TARGET_MODEL = "1b"


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "—"
    digits = 3 if value < 1 else 2 if value < 100 else 1
    return f"{value:.{digits}f} ms"


def _times(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}x"


def _ratio(value: Optional[float]) -> str:
    return "" if value is None else f" ({_times(value)})"


def _percent(value: Optional[float], bold: bool = False) -> str:
    if value is None:
        return ""
    return f"**{value:.1%}**" if bold else f"{value:.1%}"


def _mib(value: Optional[int]) -> str:
    return "—" if value is None else f"{value / MiB:,.0f} MiB" if value >= 10 * MiB else f"{value / MiB:.1f} MiB"


def _share(ms: Optional[float], share: Optional[float]) -> str:
    if ms is None or share is None:
        return "—"
    return f"{ms:.2f} ms ({share:.2%})" if share >= 1e-4 else f"{ms:.2f} ms (<0.01%)"


def header(env: dict) -> list[str]:
    load = env["load_average"]
    lines = [
        f"Device: {env['device']}; torch {env['torch']}; fp8-plugin commit `{env['commit']}`; {env['date']}; "
        f"OMP_NUM_THREADS={env['omp_num_threads'] or 'unset'}; load average (1 min) {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end; {env['elapsed_s']:.0f} s in all.",
        "",
        f"Command: `{env['command']}`",
    ]
    if not env["bf16_matmul_fast"]:
        lines += ["", f"BF16 matmuls are slow on this device ({env['bf16_matmul']}): every BF16 figure here, and "
                      "so every ratio against BF16, reflects that."]
    return lines


def _layer_cell(r: dict) -> str:
    if r["ms"] is None:
        return "not run (below)"
    recompiled = f", recompiled {r['recompiles']}x" if r.get("recompiles") else ""
    return f"{_ms(r['ms'])}{_ratio(r['speedup'])}{recompiled}"


def _layer_matrix(results: list[dict], compiled: bool, cell) -> list[str]:
    rows: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if r["compiled"] == compiled:
            rows.setdefault((r["m"], r["k"], r["n"]), {})[r["variant"]] = r
    lines = ["| M x K x N | " + " | ".join(layers.VARIANTS) + " |", "| --- |" + " --- |" * len(layers.VARIANTS)]
    for (m, k, n), by_variant in rows.items():
        cells = [cell(by_variant[v]) if v in by_variant else "—" for v in layers.VARIANTS]
        lines.append(f"| {m} x {k} x {n} | " + " | ".join(cells) + " |")
    return lines


def _gemm_paths(section: dict) -> list[str]:
    support = {s["recipe"]: s for s in section["recipe_support"]}
    names = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling",
             "blockwise": "Float8BlockScaling"}
    lines = ["| recipe | GEMM | native on this device | path taken (eager), shapes |", "| --- | --- | --- | --- |"]
    for variant, cls in names.items():
        s = support.get(cls, {})
        paths: dict[str, list[str]] = {}
        for r in section["results"]:
            if r["variant"] == variant and not r["compiled"] and r["gemm_path"]:
                paths.setdefault(r["gemm_path"], []).append(f"{r['m']}x{r['k']}x{r['n']}")
        taken = "; ".join(f"{p}: {len(shapes)} shape(s)" for p, shapes in paths.items()) or "—"
        native = "yes" if s.get("native") else f"no: {s.get('reason', '?')}"
        lines.append(f"| {variant} | {s.get('gemm', '?')} | {native} | {taken} |")
    return lines


def layer_section(section: dict) -> list[str]:
    lines = ["## 1. Layer: FP8Linear forward + backward against nn.Linear under BF16 autocast", "",
             f"Time per forward + backward (speed-up over BF16) after {section['warmup']} untimed iteration(s): "
             f"the mean of {section['steps']} iterations on GPU (CUDA events), their median on CPU. FP32 master weights, BF16 "
             "input, no bias; each iteration a training step (scale update, FP8 weight casts). torchao: "
             "tensorwise `Float8Linear`.", ""]
    lines += _layer_matrix(section["results"], False, _layer_cell)
    if any(r["peak_bytes"] for r in section["results"]):
        lines += ["", "Peak GPU memory of the timed iterations (`torch.cuda.max_memory_allocated`):", ""]
        lines += _layer_matrix(section["results"], False, lambda r: _mib(r["peak_bytes"]))
    if section["compile_shapes"]:
        lines += ["", "`torch.compile(fullgraph=True)` of the layer, the autocasts outside it (speed-up over compiled "
                      "BF16; \"recompiled Nx\": graphs compiled during the timed iterations, whose time includes "
                      "the compiling):", ""]
        lines += _layer_matrix(section["results"], True, _layer_cell)
    lines += ["", "FP8 GEMM paths:", ""] + _gemm_paths(section)
    if section["gemm_paths_cpu"]:
        lines += ["", "Tensorwise GEMM path per operand pairing (decided once per process):", ""]
        lines += [f"- {path}" for path in section["gemm_paths_cpu"]]
    return lines + _errors(section["results"], lambda r: f"{r['m']}x{r['k']}x{r['n']} {r['variant']}"
                           + (" compiled" if r["compiled"] else ""))


def model_section(section: dict) -> list[str]:
    lines = ["## 2. Model: a training step of Llama-style models", "",
             f"Batch {section['batch']} x {section['seq_len']} random tokens, AdamW, FP32 master weights; "
             f"{section['warmup']} untimed step(s), then the median of {section['steps']}. Ratios against the same "
             "loop's BF16 run; torchao: tensorwise `Float8Linear` on the layers fp8-plugin converts, under "
             "`bf16-mixed`.", "",
             "| model | loop | precision | FP8 layers | step | tokens/s | vs BF16 | peak memory | vs BF16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in section["results"]:
        if r["step_ms"] is None:
            lines.append(f"| {r['model']} ({r['parameters'] / 1e6:.0f}M) | {r['loop']} | {r['precision']} | "
                         "not run (below) | | | | | |")
            continue
        lines.append(
            f"| {r['model']} ({r['parameters'] / 1e6:.0f}M) | {r['loop']} | {r['precision']} | "
            f"{r['fp8_layers'] if r['fp8_layers'] is not None else '—'} | {_ms(r['step_ms'])} | "
            f"{r['tokens_per_s']:,.0f} | {_times(r['speedup'])} | {_mib(r['peak_bytes'])} | "
            f"{_times(r['memory_ratio'])} |")
    return lines + _errors(section["results"], lambda r: f"{r['model']} {r['loop']} {r['precision']}")


def bookkeeping_section(section: dict) -> list[str]:
    first = next(iter(section["results"]), None)
    every = first["reference_default_every"] if first else "?"
    lines = ["## 3. Bookkeeping: the FP8 state's per-step work outside the GEMMs and casts", "",
             f"Lightning `FP8Precision` (fp8-hybrid recipe, non-FP8 ops in "
             f"{section['compute_dtype'].replace('torch.', '')}), {section['warmup']} untimed step(s) then "
             f"{section['steps']}, a reference check every {section['check_every']}. Each cell: ms per step (per "
             f"call for the metrics and the reference check) and its share of the mean step time (steps without a "
             f"check); the metrics counted once every {section['metrics_interval']} steps (Lightning's default "
             f"logging interval), a reference check once every {every} (`ReferenceCheck().every`).", ""]
    if section["minilm_skipped"]:
        lines += [f"MiniLM run skipped: {section['minilm_skipped']}", ""]
    lines += ["| run | step (mean) | scale update | amax reduction | fault check | metrics | reference check | "
              "**total** |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in section["results"]:
        if r["step_ms"] is None:
            lines.append(f"| {r['run']} | not run (below) | | | | | | |")
            continue
        cells = [_share(r["ms"].get(c), r["share"].get(c)) for c in
                 ("scale update", "amax reduction", "fault check", "metrics", "reference check")]
        if not r["calls"].get("amax reduction"):
            cells[1] = "none (one process)"
        lines.append(f"| {r['run']} | {_ms(r['step_ms'])} | " + " | ".join(cells) + f" | **{r['total_share']:.2%}** |")
    return lines + _errors(section["results"], lambda r: r["run"])


def memory_section(section: dict) -> list[str]:
    lines = ["## 4. Saved for backward: the FP8 layers against the same layers under BF16", "",
             "One training forward under BF16 autocast, alone and with `fp8_plugin.autocast` around the model "
             "converted with each recipe; every tensor packed for backward counted once by storage, attributed to "
             "the linear layer whose forward packed it.", "",
             "| model | precision | FP8 layers | their saved bytes | same layers under BF16 | ratio | whole model | "
             "ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in section["results"]:
        if r["linear_bytes"] is None:
            lines.append(f"| {r['model']} | {r['precision']} | not run (below) | | | | | |")
            continue
        fp8 = r["precision"] != saved_bytes.BASELINE
        count = r["fp8_layers"] if fp8 else f"({r['fp8_layers']} linear)"
        lines.append(
            f"| {r['model']} | {r['precision']} | {count} | {_mib(r['linear_bytes'])} | "
            f"{_mib(r['bf16_linear_bytes']) if fp8 else ''} | {_percent(r['linear_ratio'], bold=True)} | "
            f"{_mib(r['total_bytes'])} | {_percent(r['total_ratio'])} |")
    return lines + _errors(section["results"], lambda r: f"{r['model']} {r['precision']}")


def _verdict(ok: Optional[bool]) -> str:
    return "not measured" if ok is None else "pass" if ok else "**FAIL**"


def _layer_target(report: dict, variant: str) -> tuple[str, Optional[bool]]:
    m, k, n = layers.TARGET_SHAPE
    for r in report.get("layer", {}).get("results", []):
        if (r["m"], r["k"], r["n"], r["variant"], r["compiled"]) == (m, k, n, variant, False) and r["speedup"]:
            return f"{variant}: {_times(r['speedup'])}", r["speedup"] >= layers.TARGET_SPEEDUP
    return "—", None


def _model_targets(report: dict) -> list[tuple[str, str, Optional[bool]]]:
    runs = {(r["loop"], r["precision"]): r for r in report.get("model", {}).get("results", [])
            if r["model"] == TARGET_MODEL and r["step_ms"]}
    fp8 = [(loop, runs.get((loop, p))) for loop, p in (("lightning", "fp8-hybrid"), ("accelerate", "fp8"))]
    fp8 = [(loop, r) for loop, r in fp8 if r is not None and r["speedup"] is not None]
    speed = ", ".join(f"{loop} {_times(r['speedup'])}" for loop, r in fp8) or "—"
    memory = ", ".join(f"{loop} {_times(r['memory_ratio'])}" for loop, r in fp8 if r["memory_ratio"]) or "—"
    lightning, torchao = runs.get(("lightning", "fp8-hybrid")), runs.get(("lightning", "torchao"))
    against_torchao = (lightning["tokens_per_s"] / torchao["tokens_per_s"]) if lightning and torchao else None
    return [
        ("~1B model step >= 1.3x bf16-mixed tokens/s (GPU)", speed,
         all(r["speedup"] >= MODEL_SPEEDUP_TARGET for _, r in fp8) if fp8 else None),
        ("~1B model FP8 tokens/s >= torchao tensorwise (GPU)",
         f"lightning {_times(against_torchao)}" if against_torchao else "—",
         None if against_torchao is None else against_torchao >= 1.0),
        ("~1B model peak memory <= bf16-mixed (GPU)", memory,
         all(r["memory_ratio"] <= 1.0 for _, r in fp8 if r["memory_ratio"]) if memory != "—" else None),
    ]


def _bookkeeping_target(report: dict) -> tuple[str, Optional[bool]]:
    for r in report.get("bookkeeping", {}).get("results", []):
        if r["run"].startswith("MiniLM") and r["total_share"] is not None:
            return f"{r['total_share']:.2%}", r["total_share"] <= BOOKKEEPING_TARGET
    return "—", None


def _saved_bytes_target(report: dict) -> tuple[str, Optional[bool]]:
    rows = [r for r in report.get("memory", {}).get("results", [])
            if r["model"].startswith("MiniLM") and r["linear_ratio"] is not None]
    if not rows:
        return "—", None
    measured = ", ".join(f"{r['precision']} {r['linear_ratio']:.1%}" for r in rows)
    return measured, all(r["linear_ratio"] <= saved_bytes.TARGET_RATIO for r in rows)


def targets(report: dict, auto_variant: str) -> list[dict]:
    """Each target with what this run measured for it and the verdict (None: not measured);
    ``auto_variant``: the recipe ``"fp8-hybrid"`` resolves to on this device."""
    m, k, n = layers.TARGET_SHAPE
    rows = [(f"FP8Linear fwd+bwd >= {layers.TARGET_SPEEDUP}x BF16 at M={m}, K={k}, N={n} (GPU)",
             *_layer_target(report, auto_variant))]
    rows += _model_targets(report)
    rows += [(f"bookkeeping <= {BOOKKEEPING_TARGET:.0%} of the MiniLM step time (CPU)", *_bookkeeping_target(report)),
             (f"saved-for-backward bytes of the FP8 layers <= {saved_bytes.TARGET_RATIO:.0%} of BF16, MiniLM (CPU)",
              *_saved_bytes_target(report))]
    return [{"target": t, "measured": measured, "ok": ok, "result": _verdict(ok)} for t, measured, ok in rows]


def targets_section(targets: list[dict]) -> list[str]:
    lines = ["## Targets", "", "| target | measured | result |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {t['result']} |" for t in targets]
    return lines


def _errors(results: list[dict], name) -> list[str]:
    """The runs that did not run or failed, grouped by their error message."""
    by_error: dict[str, list[str]] = {}
    for r in results:
        if r.get("error"):
            by_error.setdefault(r["error"], []).append(name(r))
    lines = [f"- {', '.join(names)}: {error}" for error, names in by_error.items()]
    return (["", "Not run or failed:", ""] + lines) if lines else []


def markdown(report: dict) -> str:
    """The whole report: environment, targets, then each section that ran."""
    lines = ["# fp8-plugin benchmark suite", ""] + header(report["environment"])
    lines += [""] + targets_section(report["targets"])
    for key, render in (("layer", layer_section), ("model", model_section), ("bookkeeping", bookkeeping_section),
                        ("memory", memory_section)):
        if key in report:
            lines += [""] + render(report[key])
    return "\n".join(lines) + "\n"
