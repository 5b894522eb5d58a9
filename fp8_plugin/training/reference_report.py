"""What the BF16 reference checks of a run found: a text summary, a JSON file, a PNG plot.

The plot (matplotlib, ``pip install fp8-plugin[plot]``) has the replayed micro-batch's loss in
FP8 and in the reference over the checks, and below it four heat maps sharing their rows (FP8
layers in model order; darker is worse; layers moved to high precision are marked): every
layer's output SQNR in dB at each check, then its fprop, dgrad and wgrad GEMMs' own SQNR.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Protocol

from .files import atomic_write

__all__ = ["CheckHistory", "move_text", "summary_text", "report_data", "write_json", "write_plot", "write_reports", "with_written"]


class CheckHistory(Protocol):
    """What the reports read of a run's checks: a
    :class:`~fp8_plugin.training.reference.ReferenceChecker` is one. Declared here so that
    the reports need not import the checks, which import the reports."""

    config: Any  # ReferenceCheck: thresholds and the report paths
    results: list  # ReferenceResult of each check, in step order
    steps: int
    check_seconds: float
    train_seconds: float

    def fallback_layers(self) -> list[tuple[int, str]]: ...


def move_text(entry: dict[str, Any]) -> str:
    """One replay of a verified fallback (an entry of ``ReferenceResult.fallback_tried``) as text:
    the move, its figures before -> after, and whether it passed and was kept."""
    moves = entry["moves"]
    if entry.get("stage") == "escalation":
        what = f"escalation {entry['escalation']!r} ({len(moves)} moves)"
    else:
        if entry.get("stage") == "blockwise":  # "<layer>.blockwise": the layers, said once
            moves = [m.rsplit(".", 1)[0] for m in moves]
        what = ", ".join(moves[:6]) + (f" and {len(moves) - 6} more" if len(moves) > 6 else "")
        if entry.get("stage") == "blockwise":
            what = f"blockwise scaling of {what}"
    before = entry.get("before", {})
    figures = []
    for key, label, fmt in (("grad_cosine", "grad cosine", "{:.4f}"), ("loss_rel_diff", "loss rel diff", "{:.2%}"),
                            ("grad_rel_error", "grad rel error", "{:.3f}"), ("sqnr_min_db", "lowest SQNR", "{:.1f} dB")):
        if key in entry:
            old = before.get(key)
            figures.append(f"{label} {'?' if old is None else fmt.format(old)} -> {fmt.format(none_to_inf(entry[key]))}")
    verdict = "passed, kept" if entry["kept"] else "passed, not kept" if entry["passed"] else "failed"
    return f"{what}: {', '.join(figures) or 'no replay'} ({verdict})"


def finite_or_none(value: Any) -> Any:
    """``value`` (a float, or dicts, lists and tuples of them) ready for JSON: infinite and NaN
    figures (an exact output's SQNR) as None, tuples as lists; anything else as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def none_to_inf(value: Any) -> Any:
    """The inverse for one figure: None (an infinity in a JSON report) as ``math.inf``."""
    return math.inf if value is None else value


def summary_text(checker: CheckHistory) -> str:
    """A few lines: checks run and failed, the layers with the lowest SQNR, fallbacks, overhead."""
    results = checker.results
    config = checker.config
    if not results:
        return f"FP8 reference checks: none ran (every {config.every} steps, {checker.steps} steps trained)"
    failed = [r for r in results if not r.passed]
    lines = [
        f"FP8 reference checks: {len(results)} run (every {config.every} steps, policy {config.policy!r}), "
        f"{len(failed)} failed",
        "  loss rel diff: max {:.3%}, last {:.3%}; grad cosine: min {:.4f}, last {:.4f}".format(
            max(r.loss_rel_diff for r in results), results[-1].loss_rel_diff,
            min(r.grad_cosine for r in results), results[-1].grad_cosine),
    ]
    lowest: dict[str, float] = {}
    for r in results:
        for name, db in r.layer_sqnr_db.items():
            lowest[name] = min(lowest.get(name, math.inf), db)
    worst = sorted(lowest.items(), key=lambda item: item[1])[:3]
    if worst:
        lines.append("  lowest layer SQNR: " + ", ".join(f"{name} {db:.1f} dB" for name, db in worst))
    gemms: dict[str, tuple[float, str]] = {}  # GEMM kind -> (lowest dB, layer) over all checks
    for r in results:
        for name, figures in getattr(r, "gemm_sqnr_db", {}).items():
            for gemm, db in figures.items():
                if db < gemms.get(gemm, (math.inf, ""))[0]:
                    gemms[gemm] = (db, name)
    if gemms:
        lines.append("  lowest GEMM SQNR: " + ", ".join(f"{gemm} {name} {db:.1f} dB"
                                                       for gemm, (db, name) in gemms.items()))
    kept = [(r.step + 1, t) for r in results for t in getattr(r, "fallback_tried", []) if t.get("kept")]
    if kept:  # every move with the replay that justified it: its figures before and after
        for step, entry in kept:
            label = {"escalation": "escalated", "blockwise": "moved to blockwise scaling"}.get(
                entry.get("stage"), "moved to high precision")
            lines.append(f"  {label} at step {step}: {move_text(entry)}")
    else:
        fallbacks = checker.fallback_layers() + [(r.step + 1, g) for r in results for g in getattr(r, "fallback_gemms", [])]
        lines.append("  moved to high precision: " + (", ".join(f"{name} (step {step})" for step, name in fallbacks)
                                                      or "none"))
    unkept = sum(1 for r in results for t in getattr(r, "fallback_tried", []) if not t.get("kept"))
    if unkept:
        lines.append(f"  replays of moves not kept: {unkept} (in the JSON report's fallback_tried)")
    if failed:
        reasons = Counter(reason.split(" ")[0] + " " + reason.split(" ")[1] for r in failed for reason in r.failures)
        lines.append("  failures: " + ", ".join(f"{what} x{n}" for what, n in reasons.items()))
    if checker.train_seconds > 0:
        lines.append(f"  overhead: {checker.check_seconds:.3g} s of {checker.train_seconds:.3g} s training "
                     f"({checker.check_seconds / checker.train_seconds:.2%})")
    else:
        lines.append(f"  overhead: {checker.check_seconds:.3g} s")
    return "\n".join(lines)


def report_data(checker: CheckHistory) -> dict[str, Any]:
    """Everything the JSON file holds: settings, timing and every check's figures."""
    config = checker.config
    return {
        "config": {k: getattr(config, k) for k in ("every", "policy", "min_sqnr_db", "max_loss_rel_diff",
                                                    "min_grad_cosine", "max_grad_rel_error", "fallback_worst_k",
                                                    "min_gemm_sqnr_db", "max_fallback_replays",
                                                    "max_escalation_replays", "fallback_blockwise")},
        "steps": checker.steps,
        "check_seconds": checker.check_seconds,
        "train_seconds": checker.train_seconds,
        "fallbacks": [{"step": step, "layer": name} for step, name in checker.fallback_layers()]
        + [{"step": r.step + 1, "gemm": gemm} for r in checker.results for gemm in getattr(r, "fallback_gemms", [])]
        + [{"step": r.step + 1, "blockwise": name} for r in checker.results
           for name in getattr(r, "fallback_blockwise", [])],
        # Every kept move with its evidence: the figures before (the check) and after (its replay).
        "moves": [finite_or_none({"step": r.step + 1, **t}) for r in checker.results
                  for t in getattr(r, "fallback_tried", []) if t.get("kept")],
        "checks": [r.to_dict() for r in checker.results],
    }


def write_json(checker: CheckHistory, path: str) -> None:
    """Write :func:`report_data` to ``path`` (infinite SQNR as null)."""
    data = report_data(checker)
    atomic_write(path, lambda f: json.dump(data, f, indent=1, allow_nan=False))


def write_plot(checker: CheckHistory, path: str) -> None:
    """Write the PNG described in the module docstring to ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install fp8-plugin[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("ReferenceCheck(plot_path=...) needs matplotlib: pip install 'fp8-plugin[plot]'") from error
    import numpy as np

    results = checker.results
    steps = [r.step + 1 for r in results]
    layers: list[str] = []
    for r in results:
        layers.extend(name for name in r.layer_sqnr_db if name not in layers)
    def grid(figure) -> "np.ndarray":  # [layers, checks]; figure(result, layer) -> dB or None
        values = np.full((max(len(layers), 1), max(len(results), 1)), np.nan)
        for j, r in enumerate(results):
            for i, name in enumerate(layers):
                value = figure(r, name)
                if value is not None:
                    values[i, j] = min(value, 60.0)  # exact outputs (inf dB) drawn at the scale's top
        return values

    sqnr = grid(lambda r, name: r.layer_sqnr_db.get(name))
    gemm_names = ("fprop", "dgrad", "wgrad")
    gemm_grids = [grid(lambda r, name, g=g: getattr(r, "gemm_sqnr_db", {}).get(name, {}).get(g)) for g in gemm_names]
    fig = plt.figure(figsize=(9 + 3 * len(gemm_names), 4 + 0.12 * len(layers)), layout="constrained")
    spec = fig.add_gridspec(2, 1 + len(gemm_names), height_ratios=[1, max(1.0, 0.04 * len(layers))])
    ax_loss = fig.add_subplot(spec[0, :])
    ax_sqnr = fig.add_subplot(spec[1, 0])
    ax_gemms = [fig.add_subplot(spec[1, 1 + k], sharey=ax_sqnr) for k in range(len(gemm_names))]
    ax_loss.plot(steps, [r.loss_reference for r in results], "o-", label="reference (FP8 off)")
    ax_loss.plot(steps, [r.loss_fp8 for r in results], "s--", label="FP8")
    for r in results:
        if not r.passed:
            ax_loss.axvline(r.step + 1, color="tab:red", alpha=0.3)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("replayed loss")
    ax_loss.legend()
    ax_loss.set_title("FP8 against reference (red lines: failed checks)")
    scale = {"aspect": "auto", "interpolation": "nearest", "cmap": "viridis", "vmin": 0.0,
             "vmax": max(40.0, checker.config.min_sqnr_db + 10.0)}
    image = ax_sqnr.imshow(sqnr, **scale)
    ax_sqnr.set_yticks(range(len(layers)))
    ax_sqnr.set_yticklabels(layers, fontsize=6)
    for ax, title, values in ((ax_sqnr, "layer output", sqnr), *zip(ax_gemms, gemm_names, gemm_grids)):
        if ax is not ax_sqnr:
            ax.imshow(values, **scale)
            ax.tick_params(labelleft=False)
        ax.set_title(title, fontsize=8)
        ax.set_xticks(range(len(steps)))
        ax.set_xticklabels([str(s) for s in steps], fontsize=6, rotation=90)
        ax.set_xlabel("check at optimizer step")
    fallen = {name for _, name in checker.fallback_layers()}
    for i, name in enumerate(layers):
        if name in fallen:
            ax_sqnr.get_yticklabels()[i].set_color("tab:red")
    fig.colorbar(image, ax=[ax_sqnr, *ax_gemms], label=f"SQNR dB (min {checker.config.min_sqnr_db:g})")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")
    plt.close(fig)


def write_reports(checker: CheckHistory) -> list[str]:
    """Write the files ``checker.config`` names (``json_path``, ``plot_path``); their paths."""
    written = []
    if checker.config.json_path:
        write_json(checker, checker.config.json_path)
        written.append(checker.config.json_path)
    if checker.config.plot_path:
        write_plot(checker, checker.config.plot_path)
        written.append(checker.config.plot_path)
    return written


def with_written(text: str, paths: list[str]) -> str:
    """``text`` followed by a ``written: <path>`` line per report file written."""
    return text + "".join(f"\n  written: {path}" for path in paths)
