"""The prose of README.md and docs/*.md names only what exists: every dotted ``fp8_plugin.…`` name
resolves (module, then attributes), every repository path it cites (``fp8_plugin/…``, ``tests/…``,
``examples/…``, ``benchmarks/…``, ``scripts/…``, ``docs/…``) is a file, and every
``test_x.py::name`` it cites (``*`` a wildcard) names a test function of that file.

The pages' Python blocks run as tests themselves (conftest.py at the repository root); this covers
the names in the text around them, which a move or a rename of a module leaves behind.
"""

import fnmatch
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DOTTED = re.compile(r"\bfp8_plugin(?:\.[A-Za-z_]\w*)+")
REPO_PATH = re.compile(r"(?<![\w/.-])(?:fp8_plugin|tests|examples|benchmarks|scripts|docs)/[\w./-]*\w\.(?:py|sh|txt|yaml|md)\b")
TEST_REF = re.compile(r"`(?:tests/(?:\w+/)?)?(test_\w+\.py)::([\w*]+)`")
CONTINUED_TEST_REF = re.compile(r"`::([\w*]+)`")


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def _ids(pages):
    return [str(page.relative_to(ROOT)) for page in pages]


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_dotted_names_resolve(page):
    missing = []
    for name in sorted(set(DOTTED.findall(page.read_text()))):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
    assert not missing, f"{page.name} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_repository_paths_exist(page):
    missing = sorted(path for path in set(REPO_PATH.findall(page.read_text())) if not (ROOT / path).exists())
    assert not missing, f"{page.name} cites files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_cited_tests_exist(page):
    missing = []
    for line in page.read_text().splitlines():
        cited = TEST_REF.findall(line)
        if not cited:
            continue
        # `test_x.py::a`, `::b` in one table cell: b is in test_x.py too.
        refs = cited + [(cited[0][0], name) for name in CONTINUED_TEST_REF.findall(line)]
        for file, name in refs:
            found = sorted((ROOT / "tests").rglob(file))  # test files have unique names across the folders
            tests = re.findall(r"^def (\w+)", found[0].read_text(), re.M) if found else []
            if not fnmatch.filter(tests, name):
                missing.append(f"{file}::{name}")
    assert not missing, f"{page.name} cites tests that do not exist: {missing}"
