"""The ``fp8-plugin`` command line: inspect a checkpoint under a recipe, list devices, export.

``fp8-plugin inspect MODEL_PATH`` loads a Hugging Face checkpoint folder, converts it with
:func:`fp8_plugin.convert_model` and prints which linear layers would run in FP8 (and why the
others would not), the FP8 share of the model's GEMM FLOPs in one forward of the sample batch
(:mod:`fp8_plugin.modules.coverage`), and each FP8 layer's
quantization error (SQNR) on one sample batch. ``fp8-plugin devices`` prints which recipes run
natively here (``python -m fp8_plugin`` is the same command). ``fp8-plugin export MODEL_PATH
OUT_DIR`` writes a checkpoint with :func:`fp8_plugin.tools.export.export`. ``python -m fp8_plugin.tools.cli`` runs the same commands.

Only the local folder is read (``local_files_only=True``): nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from ..training.precision_strings import PRECISION_STRINGS
from .cli_options import SkipSmall, skip_small_value
from .hf_models import model_class
from .memory_cli import memory
from .quiet import quiet_foreign_output

__all__ = ["app", "main", "RECIPE_NAMES"]

# "--recipe" values: "auto" (the best native recipe for the device, HYBRID: what "fp8-hybrid"
# means) and the precision strings of fp8_plugin.training.precision_strings.
RECIPE_NAMES = ("auto", *PRECISION_STRINGS)

# Files one of which a folder with a tokenizer holds.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model")

DEFAULT_SAMPLE_TEXT = (
    "The central bank left interest rates unchanged on Thursday, saying that inflation had eased "
    "over the summer but that wage growth remained strong. Shares in London rose slightly after the "
    "announcement, while the pound fell against the dollar. Analysts expect the next move to be a cut "
    "early next year, provided that energy prices stay where they are."
)

FLOP_NOTE = (
    "FLOPs (2 per multiply-add) of one forward of the sample batch, measured; the share is over the linear "
    "layers and MoE experts (experts: the tokens routed to them); excepted: output heads, MoE routers, attention "
    "score matmuls (Q K^T, scores x V); embeddings are lookups, not GEMMs"
)

app = typer.Typer(
    name="fp8-plugin",
    help="FP8 mixed-precision training for Hugging Face models: inspect a checkpoint under an FP8 "
    "recipe, list the recipes this machine runs natively, export a checkpoint.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


# The --recipe choices, as an Enum so that the help and the error for an unknown name list them.
RecipeName = Enum("RecipeName", {name: name for name in RECIPE_NAMES}, type=str)


class ExportFormat(str, Enum):
    hf = "hf"
    hf_fp8 = "hf-fp8"


# Shared options.
_RECIPE_HELP = ('FP8 recipe: "auto" (the best native recipe for the device, E4M3 forward / E5M2 backward) '
                "or a precision string (fp8-delayed, fp8-current, fp8-mxfp8, fp8-blockwise, ...).")
RecipeOption = typer.Option("auto", "--recipe", "-r", help=_RECIPE_HELP, case_sensitive=False)
IncludeOption = typer.Option(None, "--include", help="Glob pattern over layer names (full dotted name or one "
                             "component); only matching layers are candidates. Repeatable.")
ExcludeOption = typer.Option(None, "--exclude", help="Glob pattern over layer names; matching layers stay in "
                             "high precision. Repeatable.")
SkipSmallOption = typer.Option(SkipSmall.auto, "--skip-small", case_sensitive=False,
                               help="Keep layers too small for FP8 to be faster in high precision: auto (on GPUs "
                               "only), true, false.")
DeviceOption = typer.Option(None, "--device", help="Device the model is converted for and the sample batch runs "
                            "on (default: the current CUDA device if any, else cpu).")


app.command(help=(
    "The peak memory of one training step of a Hugging Face model, every byte accounted for, precisions "
    "side by side.\n\nTwo steps run (forward with the loss, backward, optimizer step) and the second one's "
    "peak is broken down: parameters, FP8 weight copies, gradients, optimizer states, activations saved for "
    "backward by kind, transients. --device meta (default) traces the step on tensors without data presented as "
    "a GPU, on any machine; --device cuda runs it on the GPU and prints torch.cuda.max_memory_allocated beside."))(memory)


def main() -> None:
    """Entry point of the ``fp8-plugin`` console script."""
    quiet_foreign_output()  # before transformers is imported: only lines a user can act on
    app()


# --- user errors ---------------------------------------------------------------------------


def _bad(message: str, hint: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=hint)


def _check_model_path(path: Path) -> Path:
    if not path.exists():
        raise _bad(f"{str(path)!r} does not exist; valid: a local folder holding a Hugging Face checkpoint "
                   "(config.json and its weights)", "MODEL_PATH")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise _bad(f"{str(path)!r} is not a Hugging Face checkpoint folder (no config.json in it); valid: a local "
                   "folder written by save_pretrained()", "MODEL_PATH")
    return path


def _make_recipe(name: Any):
    # Reuses the precision strings' recipe factories; "auto" is AutoRecipe(HYBRID), as fp8-hybrid.
    from ..training.precision_strings import parse_precision_string

    name = name.value if isinstance(name, Enum) else str(name)
    key = name.lower()
    if key == "auto":
        key = "fp8-hybrid"
    try:
        make_recipe, _ = parse_precision_string(key)
    except ValueError:
        raise _bad(f"{name!r} is not a recipe; valid: {', '.join(RECIPE_NAMES)}", "'--recipe'") from None
    return make_recipe()


def _check_device(device: Optional[str]):
    import torch

    from ..numerics.device import default_device

    if device is not None:
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        valid = "valid here: cpu" + (", cuda" if cuda else "") + "".join(f", cuda:{i}" for i in range(cuda))
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise _bad(f"{device!r} is not a device; {valid}", "'--device'") from None
        if parsed.type not in ("cpu", "cuda") or (parsed.type == "cuda" and (parsed.index or 0) >= cuda):
            raise _bad(f"{device!r} is not available; {valid}", "'--device'")
    return default_device(device)


# --- progress and warnings -------------------------------------------------------------------


def _console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _progress() -> Iterator[Any]:
    """A rich progress display on stderr (shown only on a terminal, gone when done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = _console()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as progress:
        yield progress


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # The CLI shows its own progress; transformers' weight-loading bar would interleave with it.
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if enabled:
            hf_logging.enable_progress_bar()


def _warning_lines(caught: list) -> list[str]:
    seen: list[str] = []
    for w in caught:
        text = str(w.message).strip()
        if text and text not in seen:
            seen.append(text)
    return seen


# --- loading ---------------------------------------------------------------------------------


def _load_model(path: Path, dtype: Any):
    import torch
    from transformers import AutoConfig

    from .fp8_checkpoint import from_pretrained

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise _bad(f"{str(path)!r} has a config.json that transformers cannot read ({err}); valid: a folder "
                   "written by save_pretrained()", "MODEL_PATH") from None
    cls = model_class(config)
    qc = getattr(config, "quantization_config", None)
    fp8 = (qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)) == "fp8"
    try:
        with _quiet_transformers():
            if fp8:  # a fine-grained FP8 checkpoint: its FP8 weights kept as in the file, frozen
                model = from_pretrained(cls, path, dtype=torch.bfloat16 if dtype == "auto" else dtype,
                                        local_files_only=True)
            else:
                model = cls.from_pretrained(path, config=config, local_files_only=True, dtype=dtype)
    except Exception as err:  # noqa: BLE001 - missing or corrupt weight files are the user's input, not a crash
        raise _bad(f"{str(path)!r} could not be loaded with {cls.__name__}.from_pretrained "
                   f"({type(err).__name__}: {err}); valid: a folder written by save_pretrained()", "MODEL_PATH") from None
    model.eval()
    return config, model


def _convert(model: Any, recipe_name: Any, include: Optional[list[str]], exclude: Optional[list[str]],
             skip_small: SkipSmall, device: Any):
    from ..modules.convert import convert_model

    recipe = _make_recipe(recipe_name)
    key = recipe_name.value if isinstance(recipe_name, Enum) else str(recipe_name)
    if key.lower() == "auto" and any(getattr(m, "frozen_layout", None) is not None for m in model.modules()):
        # Weights kept in FP8 as a checkpoint stored them: "auto" is the recipe that reads them.
        recipe = model.fp8_recipe
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = convert_model(model, recipe, include=include or None, exclude=exclude or None,
                                   device=device, skip_small=skip_small_value(skip_small))
    except ValueError as err:  # a pattern that matches no layer, or a recipe that cannot read FP8 weights
        text = str(err)
        setting = ("'--include'" if "include pattern" in text else "'--exclude'" if "exclude pattern" in text
                   else "'--recipe'")
        raise _bad(text.removeprefix("convert_model: "), setting) from None
    return report, _warning_lines(caught)


# --- figures ---------------------------------------------------------------------------------


def _sample_inputs(path: Path, config: Any, text: Optional[str], seq_len: int, seed: int, device: Any):
    """One sequence of at most ``seq_len`` tokens: ``text`` (repeated to fill ``seq_len``) through the
    folder's tokenizer when there is one, else seeded random token ids of the config's vocabulary."""
    import torch

    limit = _max_positions(config)
    if limit is not None:
        seq_len = min(seq_len, limit)
    tokenizer, why = None, "no tokenizer in MODEL_PATH"
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            with _quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, ImportError) as err:
            why = f"the tokenizer in MODEL_PATH did not load ({type(err).__name__})"
    if tokenizer is not None:
        sample = text or DEFAULT_SAMPLE_TEXT
        count = max(1, len(tokenizer(sample)["input_ids"]))
        filled = " ".join([sample] * (seq_len // count + 2))
        encoded = tokenizer(filled, return_tensors="pt", truncation=True, max_length=seq_len)
        inputs = {k: v.to(device) for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        source = {"source": "tokenizer", "text": sample, "tokens": int(inputs["input_ids"].shape[1])}
    else:
        vocab = getattr(config, "vocab_size", None)
        if not vocab:
            raise _bad("has no tokenizer and its config no vocab_size, so no sample batch can be made",
                       "MODEL_PATH")
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, int(vocab), (1, seq_len), generator=generator)
        inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        source = {"source": f"random token ids, seed {seed}: {why}", "text": None, "tokens": seq_len}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"]
    return inputs, source


def _max_positions(config: Any) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _quantization_errors(model: Any, inputs: dict, progress: Any) -> tuple[dict[str, float], list[str]]:
    """SQNR in dB of every FP8 layer's FP8 output against its high-precision output, on one
    forward of ``inputs``. The model runs in high precision (no FP8 autocast), so each layer's
    figure is its own quantization error, not one inherited from the layers before it."""
    import torch

    from ..modules.linear import FP8Linear
    from ..training.reference import sqnr_db, sqnr_hook

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Linear) and m.use_fp8]
    device = next(model.parameters()).device
    energies = torch.zeros(len(layers), 2, dtype=torch.float64, device=device)  # signal, noise
    task = progress.add_task("quantization error per FP8 layer", total=len(layers))
    done: set[str] = set()

    def progress_for(name: str):
        def hook(layer: FP8Linear, args: tuple, output: torch.Tensor) -> None:
            if name not in done:
                done.add(name)
                progress.advance(task)
        return hook

    handles = []
    for i, (name, layer) in enumerate(layers):
        handles.append(layer.register_forward_hook(sqnr_hook(energies[i], layer.recipe)))
        handles.append(layer.register_forward_hook(progress_for(name)))
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    values = energies.tolist()
    result = {name: sqnr_db(*values[i]) for i, (name, _) in enumerate(layers) if name in done}
    return result, _warning_lines(caught)


# --- output ----------------------------------------------------------------------------------


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def _table(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _format_db(value: Optional[float]) -> str:
    if value is None:
        return "not run"
    return "exact" if value == math.inf else f"{value:.1f}"


def _inspect_text(result: dict, report: Any) -> str:
    lines = [f"{result['model_class']} from {result['model_path']}",
             f"recipe {result['recipe_option']} -> {result['recipe']}", "", "Linear layers:", str(report),
             f"  {FLOP_NOTE}", ""]  # the note explains the coverage lines that end the report
    sample = result["sample"]
    origin = "the sample text through MODEL_PATH's tokenizer" if sample["source"] == "tokenizer" else sample["source"]
    lines.append(f"Quantization error on a sample batch ({sample['tokens']} tokens: {origin}):")
    lines.append("SQNR = 10 log10(sum y^2 / sum (y_fp8 - y)^2) of each FP8 layer's output, in float64; "
                 "E4M3 rounding alone gives about 29 dB")
    rows = [(d["name"], d["in_features"], d["out_features"], _format_db(d["sqnr_db"]))
            for d in result["layers"] if d["swapped"]]
    if rows:
        lines += _table(("layer", "in", "out", "SQNR dB"), rows)
        summary = result["sqnr_summary"]
        if summary["min"] is not None:
            lines.append(f"SQNR min {summary['min']:.1f} dB ({summary['min_layer']}), median "
                         f"{summary['median']:.1f} dB, max {summary['max']:.1f} dB")
    else:
        lines.append("no layer in FP8")
    for w in result["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


# --- commands --------------------------------------------------------------------------------


@app.command(help=(
    "Which layers would run in FP8, their share of the GEMM FLOPs, and their quantization error.\n\n"
    "Loads MODEL_PATH, converts it with convert_model under the recipe, and prints the conversion report "
    "(each linear layer, swapped or not and why), the FP8 share of the GEMM FLOPs of one forward of the sample "
    "batch (heads, routers and attention score matmuls excepted), and each FP8 layer's SQNR (its FP8 output against its high-precision output) on one sample batch."))
def inspect(
    model_path: Path = typer.Argument(..., metavar="MODEL_PATH", show_default=False,
                                      help="Local Hugging Face checkpoint folder (config.json, weights)."),
    recipe: RecipeName = RecipeOption,
    include: Optional[list[str]] = IncludeOption,
    exclude: Optional[list[str]] = ExcludeOption,
    skip_small: SkipSmall = SkipSmallOption,
    sample_text: Optional[str] = typer.Option(None, "--sample-text", help="Text of the sample batch (repeated "
                                              "to fill --seq-len tokens); default: a news paragraph. Used when "
                                              "MODEL_PATH has a tokenizer, else random token ids are used."),
    seq_len: int = typer.Option(128, "--seq-len", min=1, help="Tokens in the sample batch, for the FLOP share "
                                "and the SQNR (at most the model's maximum positions)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random token ids (models without a tokenizer)."),
    device: Optional[str] = DeviceOption,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Which layers would run in FP8, their share of the GEMM FLOPs, and their quantization error.

    Loads MODEL_PATH, converts it with convert_model under the recipe, prints the conversion
    report (each linear layer, swapped or not and why), the FP8 share of the GEMM FLOPs of one
    forward of the sample batch (:mod:`fp8_plugin.modules.coverage`), and each FP8 layer's SQNR (FP8 output against high-precision
    output) on one sample batch.
    """
    import torch

    from ..numerics.device import recipe_name

    _check_model_path(model_path)
    _make_recipe(recipe)  # an unknown name fails before the model loads
    target = _check_device(device)
    with _progress() as progress:
        task = progress.add_task(f"loading {model_path.name}", total=None)
        config, model = _load_model(model_path, torch.float32)
        progress.update(task, description="converting", total=1, completed=1)
        report, convert_warnings = _convert(model, recipe, include, exclude, skip_small, target)
        model.to(target)
        inputs, sample = _sample_inputs(model_path, config, sample_text, seq_len, seed, target)
        sqnr, forward_warnings = _quantization_errors(model, inputs, progress)
        progress.add_task("GEMM FLOPs of one forward", total=None)
        coverage = report.gemm_coverage(model, inputs=inputs)  # printed with the report

    layers = [{"name": d.name, "kind": d.kind, "in_features": d.in_features, "out_features": d.out_features,
               "swapped": d.swapped, "reason": d.reason, "frozen_fp8": d.frozen or None,
               "weight_bytes": d.weight_bytes_after or None,
               "sqnr_db": sqnr.get(d.name) if d.swapped else None} for d in report.layers]
    finite = {n: v for n, v in sqnr.items() if math.isfinite(v)}
    worst = min(finite, key=finite.get) if finite else None
    result = {
        "model_path": str(model_path),
        "model_class": type(model).__name__,
        "recipe_option": RecipeName(recipe).value,
        "recipe": recipe_name(report.recipe),
        "device": report.device,
        "gemm": report.gemm,
        "swapped": len(report.swapped),
        "skipped": len(report.skipped),
        "layers": layers,
        "fp8_flop_share": coverage.share,
        "gemm_flops": coverage.as_dict(),
        "flop_note": FLOP_NOTE,
        "sample": sample,
        "sqnr_summary": {
            "min": finite[worst] if worst else None, "min_layer": worst,
            "median": statistics.median(finite.values()) if finite else None,
            "max": max(finite.values()) if finite else None,
        },
        "warnings": convert_warnings + [w for w in forward_warnings if w not in convert_warnings],
    }
    if as_json:
        typer.echo(json.dumps(_json_ready(result), indent=2))
    else:
        typer.echo(_inspect_text(result, report))


def _json_ready(value: Any) -> Any:
    # JSON has no infinities: an exact layer output (infinite SQNR) is written as null.
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


@app.command()
def devices(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Which recipes run their GEMMs natively on this machine (CPU and every CUDA device), and on
    the CPU the GEMM path of each operand pairing that training takes here."""
    import dataclasses

    import torch

    from ..numerics.device import describe_device

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    targets = ["cpu"] + [f"cuda:{i}" for i in range(cuda)]
    reports = [describe_device(t) for t in targets]
    if as_json:
        out = []
        for r in reports:
            item = dataclasses.asdict(r)
            item["auto"] = type(r.auto).__name__ if r.auto is not None else None
            out.append(item)
        typer.echo(json.dumps({"devices": out}, indent=2))
    else:
        typer.echo("\n\n".join(str(r) for r in reports))


@app.command(help=(
    "Convert a checkpoint under a recipe and write it as a Hugging Face checkpoint.\n\n"
    "The model is converted on the CPU with convert_model (--recipe, --include, --exclude and --skip-small "
    "choose its FP8 layers, as in inspect) and written by fp8_plugin.export. hf: a vanilla checkpoint "
    "that plain transformers loads (the FP8 layers written as the layers they replaced). hf-fp8: transformers' "
    "fine-grained FP8 checkpoint: the weight of each FP8 nn.Linear in E4M3 with one scale per 128x128 block "
    "(whatever the recipe), everything else in the checkpoint's dtype."))
def export(
    model_path: Path = typer.Argument(..., metavar="MODEL_PATH", show_default=False,
                                      help="Local Hugging Face checkpoint folder (config.json, weights)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", show_default=False,
                                   help="Folder to write the checkpoint to (created if missing; an earlier "
                                   "export's weight files in it are replaced, other files left alone)."),
    format: ExportFormat = typer.Option(ExportFormat.hf, "--format", "-f", case_sensitive=False,
                                        help="hf: vanilla Hugging Face checkpoint; hf-fp8: transformers "
                                        "fine-grained FP8 checkpoint."),
    recipe: RecipeName = RecipeOption,
    include: Optional[list[str]] = IncludeOption,
    exclude: Optional[list[str]] = ExcludeOption,
    skip_small: SkipSmall = SkipSmallOption,
) -> None:
    """Convert a checkpoint under a recipe and write it with :func:`fp8_plugin.tools.export.export`.

    The conversion targets the CPU, as ``export`` itself does for an unconverted model, so that
    the checkpoint does not depend on the machine that writes it (``--skip-small auto`` leaves
    every layer in; ``true`` applies the GPU size rule).
    """
    _check_model_path(model_path)
    _make_recipe(recipe)
    if out_dir.exists() and not out_dir.is_dir():
        raise _bad(f"{str(out_dir)!r} is a file; valid: a folder, new or existing", "OUT_DIR")
    from .export import export as export_checkpoint

    fmt = ExportFormat(format).value
    with _progress() as progress:
        task = progress.add_task(f"loading {model_path.name}", total=None)
        _, model = _load_model(model_path, "auto")
        progress.update(task, description="converting")
        report, convert_warnings = _convert(model, recipe, include, exclude, skip_small, "cpu")
        progress.update(task, description=f"writing {fmt}")
        try:
            with warnings.catch_warnings(record=True) as caught, _quiet_transformers():
                warnings.simplefilter("always")
                written = Path(export_checkpoint(model, out_dir, format=fmt))
        except (ValueError, TypeError, FileExistsError) as err:  # e.g. hf-fp8 with no layer it can store
            typer.echo(f"Error: export --format {fmt}: {str(err).removeprefix('export: ')}", err=True)
            raise typer.Exit(1) from None
    for line in convert_warnings + _warning_lines(caught):
        typer.echo(f"warning: {line}", err=True)
    typer.echo(f"{len(report.swapped)} of {len(report.layers)} linear layers in FP8 under {_recipe_label(report)}")
    if fmt == "hf-fp8":
        quant = json.loads((written / "config.json").read_text()).get("quantization_config", {})
        kept = quant.get("modules_to_not_convert") or []
        block = "x".join(str(b) for b in quant.get("weight_block_size") or ())
        typer.echo(f"hf-fp8: the FP8 layers' weights in E4M3 with {block} block scales; "
                   f"linear modules kept in high precision (modules_to_not_convert): {len(kept)}")
    files = sorted(p.name for p in written.iterdir())
    typer.echo(f"wrote {fmt} checkpoint to {written}: {', '.join(files)}")


def _recipe_label(report: Any) -> str:
    from ..numerics.device import recipe_name

    return recipe_name(report.recipe) if report.recipe is not None else "no recipe"


if __name__ == "__main__":
    main()
