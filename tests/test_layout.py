"""The package's dependency direction: numerics and layers never import the integrations."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8_plugin"
CORE = ["formats", "recipes", "scaling", "block_scaling", "scale_layouts", "quantizers", "gemm", "device", "autocast", "distributed", "linear", "backends", "convert"]
FORBIDDEN = ("lightning", "pytorch_lightning", "accelerate", ".lightning")


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or "")


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_no_integration(name):
    bad = [m for m in imported_modules(PACKAGE / f"{name}.py") if m.startswith(FORBIDDEN) or m == "..lightning"]
    assert not bad, f"fp8_plugin/{name}.py imports {bad}"
