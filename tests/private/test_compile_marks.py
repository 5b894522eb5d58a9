"""fp8_plugin/_private/compile_marks.py: torch.compile's marks without importing dynamo at import time.

``import fp8_plugin`` must not import ``torch._dynamo`` (2.1 to 2.4 s of CPU on a 2-core AMD EPYC,
more than torch itself); the marks must then be what torch's own decorators make of a function.
Whether dynamo honours them in a compiled graph: tests/numerics/test_gemm_kernels.py (allow_in_graph,
fp8_plugin imported before dynamo) and tests/modules/test_compile.py (the constant results of
numerics/gemm.py, under fullgraph=True).
"""

import json
import subprocess
import sys

import torch

from fp8_plugin._private import compile_marks
from fp8_plugin._private.post_import import PostImportFinder

PROBE = r'''
import json, sys
import fp8_plugin
from fp8_plugin.numerics import gemm_kernels
before = "torch._dynamo" in sys.modules
import torch._dynamo
from torch._dynamo import trace_rules
print(json.dumps({"dynamo_at_import": before,
                  "allowed": bool(trace_rules.is_callable_allowed(gemm_kernels._block_scaled_mm))}))
'''


def test_import_fp8_plugin_imports_no_dynamo_and_dynamos_import_applies_allow_in_graph():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"dynamo_at_import": False, "allowed": True}


def test_assume_constant_result_sets_what_torchs_decorator_sets():
    def ours():
        return 1

    def torchs():
        return 1

    compile_marks.assume_constant_result(ours)
    torch.compiler.assume_constant_result(torchs)  # imports dynamo: this process only
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_allow_in_graph_once_dynamo_is_imported_is_torchs_at_once():
    from torch._dynamo import trace_rules

    def fn(x):
        return x + 1

    assert compile_marks.allow_in_graph(fn) is fn
    assert trace_rules.is_callable_allowed(fn)
    assert not any(isinstance(f, PostImportFinder) and f.module == compile_marks.DYNAMO for f in sys.meta_path)
