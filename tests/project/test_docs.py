"""The documentation site builds with MkDocs without a warning (API reference included)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_build_without_warnings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "FP8Linear" in api and "DelayedScaling" in api  # the reference was generated from the code


def test_api_reference_follows_the_folders():
    """docs/api.md documents every module of every folder (private shims aside), folder by folder."""
    package = ROOT / "fp8_plugin"
    entries = [line.split()[1] for line in (ROOT / "docs" / "api.md").read_text().splitlines() if line.startswith("::: ")]
    modules = [".".join(("fp8_plugin",) + p.relative_to(package).with_suffix("").parts)
               for p in sorted(package.glob("*/*.py")) if p.name != "__init__.py" and not p.parts[-2].startswith("_")]
    missing = [m for m in modules if m not in entries]
    assert not missing, f"docs/api.md lacks {missing}"
    folders = [e.split(".")[1] for e in entries if e.count(".") >= 1]
    # each folder's entries stand together: a folder never reappears after another one
    seen = []
    for folder in folders:
        if not seen or seen[-1] != folder:
            assert folder not in seen, f"docs/api.md: {folder} entries are split by another folder's"
            seen.append(folder)
