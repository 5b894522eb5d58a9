"""The package's layers are its folders, and imports point down them (docs/design.md).

Each folder of ``fp8_plugin`` may import itself and the folders ``MAY_IMPORT`` names; the root
``__init__`` and ``__main__`` (the public facade) may import anything. Every import counts: at
module level, inside functions, under ``TYPE_CHECKING``. No two modules may import each other,
directly or round a longer cycle. The checks run on the real package and, to show they bite, on
a copy with a planted upward import and a planted cycle.
"""

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fp8_plugin"
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"

BELOW_TRAINING = {"training", "modules", "numerics", "_private"}
MAY_IMPORT = {
    "_private": set(),
    "numerics": {"_private"},
    "modules": {"numerics", "_private"},
    "optim": {"numerics", "_private"},
    "training": {"modules", "numerics", "_private"},
    "lightning": {"fabric"} | BELOW_TRAINING,  # the import hook hands Fabric's connector Fabric's plugin
    "fabric": set(BELOW_TRAINING),
    "accelerate": set(BELOW_TRAINING),
    "hf_trainer": {"accelerate"} | BELOW_TRAINING,  # the Trainer runs its loop on Accelerate
    "tools": {"optim"} | BELOW_TRAINING,  # the memory tool traces FP8AdamW
}
# Training libraries the loop-neutral layers must never import.
LOOP_LIBRARIES = ("lightning", "pytorch_lightning", "accelerate")
LOOP_NEUTRAL = ("numerics", "modules", "training")  # _private holds shims of those libraries


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["fp8_plugin", *parts])


def imports_of(path: Path, root: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (fp8_plugin's resolved, others as written)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import module` imports pkg.module where that is a module of the package
            found.append(base)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if base.startswith("fp8_plugin") and module_path(candidate, root) is not None:
                    found.append(candidate)
    return found


def module_path(name: str, root: Path):
    rel = Path(*name.split(".")[1:])
    for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def folder_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def layer_violations(root: Path) -> list[str]:
    bad = []
    for name, path in package_modules(root).items():
        folder = folder_of(name)
        if folder not in MAY_IMPORT:  # the root __init__ and __main__
            continue
        for target in imports_of(path, root):
            if target.startswith("fp8_plugin."):
                other = folder_of(target)
                if other != folder and other not in MAY_IMPORT[folder]:
                    bad.append(f"{name} imports {target} ({folder} may import {sorted(MAY_IMPORT[folder])})")
            elif folder in LOOP_NEUTRAL and target.split(".")[0] in LOOP_LIBRARIES:
                bad.append(f"{name} imports {target}: {folder} is loop-neutral")
    return bad


def import_cycles(root: Path) -> list[list[str]]:
    modules = package_modules(root)
    graph = {name: sorted({t for t in imports_of(path, root) if t in modules and t != name})
             for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is no cycle with them: Python imports the
    # __init__ first and its modules then find it; an edge from a module up to its own package is dropped.
    for name in graph:
        graph[name] = [t for t in graph[name] if not name.startswith(t + ".")]
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    return cycles


def test_every_folder_is_a_known_layer_with_a_docstring_saying_what_it_may_import():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(MAY_IMPORT), "a new folder needs its rule in MAY_IMPORT and a row in docs/design.md"
    design = DESIGN.read_text()
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"fp8_plugin/{folder}/__init__.py needs a docstring saying what it may import"
        assert f"`{folder}/`" in design, f"docs/design.md has no row for {folder}/"
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")], \
        "modules belong in a layer's folder"


def test_imports_point_down_the_layers():
    assert layer_violations(PACKAGE) == []


def test_no_import_cycles():
    assert import_cycles(PACKAGE) == []


@pytest.fixture
def package_copy(tmp_path):
    root = tmp_path / "fp8_plugin"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_planted_upward_import_is_found(package_copy):
    scaling = package_copy / "numerics" / "scaling.py"
    scaling.write_text(scaling.read_text() + "\n\ndef _planted():\n    from ..training.core import FP8Training\n")
    assert any("fp8_plugin.numerics.scaling imports fp8_plugin.training.core" in v for v in layer_violations(package_copy))


def test_a_planted_loop_library_import_is_found(package_copy):
    linear = package_copy / "modules" / "linear.py"
    linear.write_text(linear.read_text() + "\n\nimport lightning\n")
    assert any("fp8_plugin.modules.linear imports lightning" in v for v in layer_violations(package_copy))


def test_a_planted_cycle_is_found(package_copy):
    formats = package_copy / "numerics" / "formats.py"
    formats.write_text(formats.read_text() + "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .scaling import amax\n")
    assert layer_violations(package_copy) == []  # same folder: allowed by the layers, not as a cycle
    cycles = import_cycles(package_copy)
    assert any({"fp8_plugin.numerics.formats", "fp8_plugin.numerics.scaling"} <= set(c) for c in cycles), cycles


TESTS = Path(__file__).resolve().parents[1]
# The tests' folders: one per package layer (the private shims' as ``private``), and those that
# guard no layer of their own: the examples, the benchmarks, the project's checks, the CUDA
# contract and the helpers several folders share.
TEST_FOLDERS = {*MAY_IMPORT, "private", "examples", "benchmarks", "project", "cuda_contract", "support"}


def _module_keys() -> dict[str, str]:
    # Each package module's path inside its layer, "/" as "_" (numerics/kernels/tensorwise.py:
    # "kernels_tensorwise"), with its layer; a key two layers share names neither.
    keys: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*/**/*.py"):
        layer = path.relative_to(PACKAGE).parts[0]
        key = "_".join(path.relative_to(PACKAGE / layer).with_suffix("").parts)
        keys.setdefault(key, set()).add("private" if layer == "_private" else layer)
    return {key: layers.pop() for key, layers in keys.items() if len(layers) == 1}


def test_tests_are_arranged_as_the_package_is():
    assert not list(TESTS.glob("test_*.py")), "test files at the top of tests/: put each in its layer's folder"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name[0] not in "._"}
    assert folders <= TEST_FOLDERS, f"tests/ has folders no layer names: {sorted(folders - TEST_FOLDERS)}"
    keys = _module_keys()
    misplaced = [f"{path.relative_to(TESTS)} (for fp8_plugin/{keys[path.stem[5:]]})"
                 for path in TESTS.glob("*/test_*.py") if keys.get(path.stem[5:], path.parent.name) != path.parent.name]
    assert not misplaced, f"a test file for a layer's module lives in that layer's folder: {misplaced}"
    workers = [p.relative_to(TESTS) for p in TESTS.glob("*/*_worker.py")
               if not any(p.stem.removesuffix("_worker") in t.read_text() for t in p.parent.glob("test_*.py"))]
    assert not workers, f"workers sit beside the tests that launch them: {workers}"


# Small modules with one job each (the project's style): a package file past this many lines
# holds more than one job and is split by job, as numerics/quantizers/ and training/reference/ were.
MAX_MODULE_LINES = 600


def test_no_package_module_is_longer_than_the_limit():
    long = {str(path.relative_to(PACKAGE)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"package modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_the_files_the_suite_starts_first_exist():
    # tests/conftest.py schedules these first; a renamed file would silently drop back in the order.
    tree = ast.parse((TESTS / "conftest.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SLOWEST_FILES")
    missing = [name for name in names if not (TESTS.parent / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FILES names files that are not there: {missing}"
