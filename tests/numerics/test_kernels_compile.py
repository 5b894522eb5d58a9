"""The fused cast kernels and the FP8 GEMM compile for the GPUs they are for, with the installed
Triton, on a machine without one (Triton compiles to PTX and cubin for a named target without a
device); the GEMM as a launch specializes it, into Hopper's FP8 MMA with its loads pipelined.

The interpreter tests (tests/numerics/test_kernels_tensorwise.py) check the kernels' bytes; these check
that the same source lowers for sm90 (Hopper) and sm100 (Blackwell), and that the compiled code
has no fused multiply-add and no flush of subnormals to zero, either of which would change the
bytes on a GPU against the interpreter and torch. Run in a subprocess without
``TRITON_INTERPRET``, which the interpreter tests set for their process.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp8_plugin.numerics.kernels import blockwise as bw, grouped as gr, scale_update as su, tensorwise as tw

# The per-tensor casts take bfloat16 and FP8 tensors as they are (bitcast inside the kernel).
ptr = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "out_t_ptr": "*fp8e4nv", "amax_bits_ptr": "*i32"}
dims = {"M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}
blocks = {"x_ptr": "*i16", "out_ptr": "*u8", "out_t_ptr": "*u8", "scale_inv_ptr": "*fp32", "scale_inv_t_ptr": "*fp32",
          "gemm_ptr": "*u8", "gemm_t_ptr": "*u8", "workspace_ptr": "*i32", "history_ptr": "*fp32", "count_ptr": "*i64",
          "state_scale_ptr": "*fp32", **dims, "n_programs": "i32"}
block_consts = {"SQUARE": False, "FP8_MAX": 448.0, "E4M3": True, "EMAX": 8, "POWER_2": False, "EPS": 0.0,
                "TRANSPOSE": True, "RECORD": True}
cases = {
    "cast_transpose e4m3 T amax": (tw._cast_transpose_kernel, {**ptr, "scale_ptr": "*fp32", **dims},
                                   {"FP8_MAX": 448.0, "E4M3": True, "TRANSPOSE": True, "AMAX": True, "TILE": 64}),
    "amax": (tw._amax_kernel, {"x_ptr": "*bf16", "amax_bits_ptr": "*i32", **dims}, {"TILE": 64}),
    "amax unless initialized": (tw._amax_unless_initialized_kernel, {"x_ptr": "*bf16", "workspace_ptr": "*i32",
                                                                     "initialized_ptr": "*i1", **dims}, {"TILE": 64}),
    "delayed e4m3 T": (tw._delayed_kernel, {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "out_t_ptr": "*fp8e4nv",
                                            "workspace_ptr": "*i32", "initialized_ptr": "*i1",
                                            "state_scale_ptr": "*fp32", "history_ptr": "*fp32", "count_ptr": "*i64",
                                            "scale_out_ptr": "*fp32", "scale_inv_out_ptr": "*fp32", "partials_ptr": "*fp32",
                                            **dims, "n_programs": "i32", "MAX_OVER_MARGIN": "fp32"},
                       {"FP8_MAX": 448.0, "E4M3": True, "TRANSPOSE": True, "RECORD": True, "BGRAD": True,
                        "SCALE_OUT": False, "TILE": 64}),
    "current e5m2 T": (tw._current_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp8e5", "out_t_ptr": "*fp8e5",
                                            "workspace_ptr": "*i32", "history_ptr": "*fp32", "count_ptr": "*i64",
                                            "state_scale_ptr": "*fp32", "scale_out_ptr": "*fp32",
                                            "scale_inv_out_ptr": "*fp32", "partials_ptr": "*fp32", **dims,
                                            "n_programs": "i32", "MAX_OVER_MARGIN": "fp32"},
                       {"FP8_MAX": 57344.0, "E4M3": False, "TRANSPOSE": True, "RECORD": True, "BGRAD": True,
                        "SCALE_OUT": True, "TILE": 64}),
    "scale update": (su._update_kernel, {"table_ptr": "*i64", "params_ptr": "*fp32", "current_ptr": "*fp32",
                                         "flags_ptr": "*i8"},
                     {"FROM_CURRENT": True, "FIELDS": 9, "PARAMS": 4, "BLOCK": 1024, "FLAGS": True}),
    "blocks 1x128 e4m3 T": (bw._block_cast_kernel, blocks, {**block_consts, "B": 128, "MX": False}),
    "blocks mxfp8 e4m3 T": (bw._block_cast_kernel, blocks, {**block_consts, "B": 32, "MX": True}),
    "groups amax": (gr._group_amax_kernel, {"x_ptr": "*i16", "group_ptr": "*i64", "table_ptr": "*i64",
                                            "workspace_ptr": "*i32", "S": "i32", "K": "i32", "ROWS_PER_GROUP": "i32",
                                            "stride_g": "i32", "stride_r": "i32", "stride_k": "i32"},
                    {"DELAYED": True, "FIELDS": 9, "TILE_ROWS": 32, "TILE_COLS": 128}),
    "groups cast e4m3": (gr._group_cast_kernel, {"x_ptr": "*i16", "group_ptr": "*i64", "table_ptr": "*i64",
                                                 "workspace_ptr": "*i32", "out_ptr": "*u8", "scale_inv_ptr": "*fp32",
                                                 "S": "i32", "K": "i32", "ROWS_PER_GROUP": "i32",
                                                 "stride_g": "i32", "stride_r": "i32", "stride_k": "i32",
                                                 "n_programs": "i32", "MAX_OVER_MARGIN": "fp32"},
                         {"E": 8, "FP8_MAX": 448.0, "E4M3": True, "DELAYED": True, "RECORD": True, "FIELDS": 9,
                          "TILE_ROWS": 32, "TILE_COLS": 128}),
    "scale update gather": (su._gather_kernel, {"table_ptr": "*i64", "current_ptr": "*fp32"}, {"FIELDS": 9}),
}
result = {}
for arch in map(int, sys.argv[1:]):
    # Every kernel for Hopper; Blackwell's lowering differs by target alone: the delayed and MXFP8 casts.
    blackwell = ["delayed e4m3 T", "blocks mxfp8 e4m3 T"]
    for name, (fn, sig, consts) in (cases.items() if arch == 90 else [(n, cases[n]) for n in blackwell]):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                                  options={"enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        result[f"sm{arch} {name}"] = {"cubin": len(compiled.asm["cubin"]), "fma": len(re.findall(r"\bfma\.", ptx)),
                                     "ftz": ptx.count(".ftz"), "target": re.search(r"\.target (\S+)", ptx).group(1)}
print(json.dumps(result))
'''


def test_every_kernel_compiles_for_sm90_and_sm100_without_fma_or_ftz():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "90", "100"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 13
    for name, facts in result.items():
        assert facts["cubin"] > 0, name
        assert facts["fma"] == 0 and facts["ftz"] == 0, (name, facts)
        assert facts["target"].startswith("sm_90" if name.startswith("sm90") else "sm_100"), (name, facts)


GEMM_SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp8_plugin.numerics.kernels.scaled_gemm import _scaled_gemm_kernel as kernel

# As a launch specializes it: unit strides constant, pointers and the other sizes divisible by 16.
sig = {"a": "*fp8e5", "b": "*fp8e4nv", "out": "*bf16", "scale_a": "*fp32", "scale_b": "*fp32", "bias": "*bf16",
       "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_bn": "i32",
       "stride_bk": "constexpr", "stride_om": "i32", "stride_on": "constexpr"}
aligned = ("a", "b", "out", "scale_a", "scale_b", "bias", "M", "N", "K", "stride_am", "stride_bn", "stride_om")
attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
result = {}
for arch, fast in ((90, False), (90, True), (100, False)):
    consts = {"stride_ak": 1, "stride_bk": 1, "stride_on": 1, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128,
              "GROUP_M": 8, "HAS_BIAS": True, "FAST_ACCUM": fast}
    compiled = triton.compile(ASTSource(kernel, {**sig, **{k: "constexpr" for k in consts if k not in sig}},
                                        constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"enable_fp_fusion": False, "num_warps": 8, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    result[f"sm{arch} {'fast' if fast else 'split'}"] = {
        "cubin": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"), "adds": len(re.findall(r"\badd(\.rn)?\.f32", ptx)),
        "fma": len(re.findall(r"\bfma\.", ptx)), "ftz": ptx.count(".ftz"),
        "target": re.search(r"\.target (\S+)", ptx).group(1)}
print(json.dumps(result))
'''


def test_the_fp8_gemm_compiles_for_sm90_pipelined_on_wgmma_and_for_sm100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", GEMM_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    split, fast, blackwell = result["sm90 split"], result["sm90 fast"], result["sm100 split"]
    for name, facts in result.items():
        assert facts["cubin"] > 0 and facts["fma"] == 0 and facts["ftz"] == 0, (name, facts)
    assert split["target"].startswith("sm_90") and blackwell["target"].startswith("sm_100")
    # Hopper's FP8 MMA, K = 32 per instruction: 4 per 128-wide slice of K; 3 stages of a 128 x 128
    # FP8 tile of each operand in shared memory (the loads pipelined).
    assert split["wgmma"] == fast["wgmma"] == 4
    assert split["shared"] == fast["shared"] == 3 * 2 * 128 * 128
    # Split accumulation adds each instruction's partial sums to the float32 accumulator (fast adds
    # the bias alone).
    assert split["adds"] > fast["adds"]
