"""Projected FP8 against BF16 on H100 SXM and H200: a model from counted ops, not a measurement.

Every aten op of a training step (forward + backward) is counted on fake tensors
(``fp8_suite/op_costs.py``; no memory, no GPU), and each op's time bounded by its FLOPs or its
bytes on the GPU's published peak figures: ``max(FLOPs / peak, bytes / HBM bandwidth)``. Three
levels for the FP8 casts: ``eager`` (torch ops, each alone, as PyTorch runs them without
torch.compile and fp8-plugin's fused kernels), ``kernels`` (eager with fp8-plugin's fused Triton
casts, as it runs on a CUDA GPU: the traces see each cast as one custom op, charged the bytes and
launches its kernels take) and ``fused`` (an ideal bound: a cast reads its input once and writes
FP8 once, the amax fused into it). Workloads: ``FP8Linear`` against ``nn.Linear`` under BF16 autocast at
M = 4096 to 16384 tokens, K, N = 2048 to 8192; one transformers Llama decoder block; the smallest
layer where FP8 wins, against the ``skip_small`` thresholds (``too_small_for_fp8``, torchao's
H100 measurements); the layer traced on the CUDA path itself through the CUDA contract suite's
seam, as an sm90 GPU (delayed and blockwise scaling, BF16 weights); and MXFP8 (OCP MX: E4M3
elements, one E8M0 scale per 32 elements along the contraction dim, Transformer Engine's
``MXFP8BlockScaling``) traced the same way as an sm100 GPU, where it reaches Blackwell's
block-scaled ``torch.nn.functional.scaled_mm`` with swizzled scales, projected on a B200
(:data:`MX_GPUS`, its datasheet's dense figures; MXFP8 has no tensor cores on Hopper). Writes
JSON and markdown (default ``runs/benchmarks/cost_model.json``).

    python benchmarks/cost_model.py                     # about a minute on one CPU core, no GPU
    python benchmarks/cost_model.py --kernel-floor-us 4 --recipes delayed
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import shlex
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8_plugin from this checkout

import torch  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin.modules.convert import too_small_for_fp8  # noqa: E402
from fp8_suite.common import device_name, git_commit, write_report  # noqa: E402  (benchmarks/)
from fp8_suite.op_costs import GPU, GPUS, fuse, project  # noqa: E402
from fp8_suite.workloads import BLOCKS, KV_HEADS, HEAD_DIM, SEQ_LEN, block_ops, linear_ops, seam_linear_ops  # noqa: E402

RECIPES = {"delayed": fp8_plugin.DelayedScaling, "current": fp8_plugin.Float8CurrentScaling}
# Traced through the CUDA seam as sm90 (BF16 weights): Hopper's native block-scaled recipe beside delayed scaling.
SEAM_RECIPES = {"delayed": fp8_plugin.DelayedScaling, "blockwise": fp8_plugin.Float8BlockScaling}
# Traced through the CUDA seam as sm100 (BF16 weights): Blackwell's MXFP8 beside tensorwise delayed scaling.
MX_RECIPES = {"delayed": fp8_plugin.DelayedScaling, "mxfp8": fp8_plugin.MXFP8BlockScaling}
MX_CAPABILITY = (10, 0)
# A GPU with MXFP8 tensor cores. NVIDIA lists its tensor-core figures with 2:4 sparsity; dense is
# half: FP8/FP6 9 -> 4.5 PFLOP/s, FP16/BF16 4.5 -> 2.25 PFLOP/s. MXFP8 GEMMs run at the FP8 rate
# (the E8M0 block scales are applied inside the tensor-core MMA).
MX_GPUS = {
    "B200": GPU("B200 (HGX)", 4500.0, 2250.0, 75.0, 7.7,
                "NVIDIA GB200 NVL72 / HGX B200 technical specifications, HGX B200 column, individual Blackwell "
                "GPU (https://www.nvidia.com/en-us/data-center/hgx/): FP8/FP6 Tensor Core 9 PFLOPS, FP16/BF16 "
                "Tensor Core 4.5 PFLOPS (tensor-core figures with sparsity), FP32 75 TFLOPS, GPU memory 180 GB "
                "HBM3E at 7.7 TB/s"),
}
ALL_GPUS = {**GPUS, **MX_GPUS}
TOKENS = (4096, 8192, 16384)
DIMS = (2048, 4096, 8192)
# Square K = N scanned for the smallest layer where FP8 wins, and the K x N grid set against skip_small.
SCAN = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
GRID = (512, 1024, 2048, 4096, 8192)
GRID_TOKENS = 8192
LEVELS = ("eager", "kernels", "fused")


class Model:
    """Traces (cached per workload) and their projections per GPU and fusion level."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._ops: dict = {}

    def ops(self, key: tuple, cast_path: str = "torch"):
        """The ops of a workload: ``("linear", M, K, N, recipe name or None)``, the same with
        ``"seam"`` (traced through the CUDA seam as sm90) or ``"seam_mx"`` (as sm100, recipes of
        :data:`MX_RECIPES`), or ``("block", tokens, hidden, recipe name or None, skip_small)``;
        the FP8 casts as torch ops (``cast_path="torch"``) or the fused kernels (``"triton"``)."""
        cached = (key, cast_path)
        if cached not in self._ops:
            kind, *rest = key
            if kind == "linear":
                ops = linear_ops(*rest[:3], _recipe(rest[3]), cast_path=cast_path)
            elif kind == "seam":
                ops = seam_linear_ops(*rest[:3], None if rest[3] is None else SEAM_RECIPES[rest[3]](),
                                      cast_path=cast_path)
            elif kind == "seam_mx":
                recipe = None if rest[3] is None else MX_RECIPES[rest[3]]()
                ops = seam_linear_ops(*rest[:3], recipe, capability=MX_CAPABILITY, cast_path=cast_path)
            else:
                ops = block_ops(rest[0], rest[1], _recipe(rest[2]), skip_small=rest[3], cast_path=cast_path)
            self._ops[cached] = ops
        return self._ops[cached]

    def time(self, key: tuple, gpu: str, level: str, floor: bool = False):
        """The projection of a workload at a level: ``"eager"`` (torch ops, each alone),
        ``"kernels"`` (eager with the fused cast kernels, as fp8-plugin runs on a CUDA GPU) or
        ``"fused"`` (the ideal bound)."""
        recipe = key[3] if key[0] == "block" else key[4]
        ops = self.ops(key, "triton" if level == "kernels" and recipe is not None else "torch")
        if level == "fused" and recipe is not None:
            ops = fuse(ops, amax_pass=recipe == "current")
        return project(ops, ALL_GPUS[gpu], self.floor_s if floor else 0.0)


def _recipe(name):
    return None if name is None else RECIPES[name]()


def _speedup(model: Model, bf16: tuple, fp8: tuple, gpu: str, level: str, floor: bool = False) -> float:
    return model.time(bf16, gpu, "eager", floor).total / model.time(fp8, gpu, level, floor).total


def layer_results(model: Model, recipes: list[str]) -> list[dict]:
    rows = []
    for recipe, m, k, n in itertools.product(recipes, TOKENS, DIMS, DIMS):
        bf16, fp8 = ("linear", m, k, n, None), ("linear", m, k, n, recipe)
        row = {"recipe": recipe, "m": m, "k": k, "n": n, "skip_small": too_small_for_fp8(k, n, RECIPES[recipe]())}
        for gpu in GPUS:
            base = model.time(bf16, gpu, "eager")
            eager, fused = model.time(fp8, gpu, "eager"), model.time(fp8, gpu, "fused")
            kernels = model.time(fp8, gpu, "kernels")
            row[gpu] = {
                "bf16_us": base.total * 1e6,
                "fp8_eager_us": eager.total * 1e6,
                "fp8_kernels_us": kernels.total * 1e6,
                "fp8_fused_us": fused.total * 1e6,
                "speedup_eager": _speedup(model, bf16, fp8, gpu, "eager"),
                "speedup_kernels": _speedup(model, bf16, fp8, gpu, "kernels"),
                "speedup_fused": _speedup(model, bf16, fp8, gpu, "fused"),
                "speedup_eager_floor": _speedup(model, bf16, fp8, gpu, "eager", floor=True),
                "speedup_kernels_floor": _speedup(model, bf16, fp8, gpu, "kernels", floor=True),
                "kernels_kernels": sum(kernels.kernels.values()),
                "share_eager": {c: eager.share(c) for c in ("cast", "amax", "bookkeeping", "gemm")},
                "share_fused": {c: fused.share(c) for c in ("cast", "bookkeeping", "gemm")},
                "share_bookkeeping_eager_floor": model.time(fp8, gpu, "eager", floor=True).share("bookkeeping"),
                "kernels_eager": sum(eager.kernels.values()),
                "kernels_bf16": sum(base.kernels.values()),
            }
        rows.append(row)
    return rows


def crossover(model: Model, recipes: list[str]) -> list[dict]:
    """Per recipe, GPU, level and token count: the smallest square K = N of SCAN from which FP8
    is faster at every larger size scanned."""
    rows = []
    for recipe, gpu, level, floor, m in itertools.product(recipes, GPUS, LEVELS, (False, True), TOKENS):
        if floor and level == "fused":
            continue
        wins = [_speedup(model, ("linear", m, d, d, None), ("linear", m, d, d, recipe), gpu, level, floor) > 1
                for d in SCAN]
        first = next((d for i, d in enumerate(SCAN) if all(wins[i:])), None)
        rows.append({"recipe": recipe, "gpu": gpu, "level": level + (" + floor" if floor else ""), "m": m,
                     "smallest_winning_kn": first})
    return rows


def grid(model: Model, recipes: list[str]) -> list[dict]:
    """K x N grid at GRID_TOKENS tokens: the model's speed-up against skip_small's decision."""
    rows = []
    for recipe, k, n in itertools.product(recipes, GRID, GRID):
        bf16, fp8 = ("linear", GRID_TOKENS, k, n, None), ("linear", GRID_TOKENS, k, n, recipe)
        row = {"recipe": recipe, "k": k, "n": n, "skip_small": too_small_for_fp8(k, n, RECIPES[recipe]())}
        for gpu in GPUS:
            row[gpu] = {level: _speedup(model, bf16, fp8, gpu, level) for level in LEVELS}
            row[gpu]["eager + floor"] = _speedup(model, bf16, fp8, gpu, "eager", floor=True)
            row[gpu]["kernels + floor"] = _speedup(model, bf16, fp8, gpu, "kernels", floor=True)
        rows.append(row)
    return rows


def seam_results(model: Model) -> dict:
    """FP8Linear on the CUDA path itself (meta tensors as an sm90 GPU, BF16 weights): delayed and
    blockwise scaling against a BF16 ``nn.Linear``; skipped with the reason where this
    fp8-plugin has no CUDA seam."""
    try:
        import fp8_plugin.numerics.device_kind  # noqa: F401
    except ImportError as err:
        return {"skipped": f"no CUDA device seam in this fp8-plugin ({err})", "results": []}
    rows = []
    for m, k, n in itertools.product(TOKENS, DIMS, DIMS):
        row = {"m": m, "k": k, "n": n}
        bf16 = ("seam", m, k, n, None)
        for recipe in SEAM_RECIPES:
            fp8 = ("seam", m, k, n, recipe)
            row[recipe] = {}
            for gpu in GPUS:
                eager = model.time(fp8, gpu, "eager")
                row[recipe][gpu] = {
                    "speedup_eager": _speedup(model, bf16, fp8, gpu, "eager"),
                    "speedup_kernels": _speedup(model, bf16, fp8, gpu, "kernels"),
                    "speedup_fused": _speedup(model, bf16, fp8, gpu, "fused"),
                    "speedup_eager_floor": _speedup(model, bf16, fp8, gpu, "eager", floor=True),
                    "speedup_kernels_floor": _speedup(model, bf16, fp8, gpu, "kernels", floor=True),
                    "share_eager": {c: eager.share(c) for c in ("cast", "amax", "bookkeeping", "gemm")},
                    "gemms": sorted({op.name for op in model.ops(fp8) if op.peak == "fp8"}),
                }
        rows.append(row)
    return {"skipped": "", "results": rows}


def mxfp8_results(model: Model) -> dict:
    """FP8Linear on the CUDA path as a Blackwell GPU (meta tensors as sm100, BF16 weights): MXFP8
    and tensorwise delayed scaling against a BF16 ``nn.Linear``, projected on :data:`MX_GPUS`;
    skipped with the reason where this fp8-plugin has no CUDA seam. MXFP8's fused bound charges
    no amax read of its own: each 32-element block's amax is computed on chip, in the cast."""
    try:
        import fp8_plugin.numerics.device_kind  # noqa: F401
    except ImportError as err:
        return {"skipped": f"no CUDA device seam in this fp8-plugin ({err})", "results": []}
    rows = []
    for m, k, n in itertools.product(TOKENS, DIMS, DIMS):
        row = {"m": m, "k": k, "n": n}
        bf16 = ("seam_mx", m, k, n, None)
        for recipe in MX_RECIPES:
            fp8 = ("seam_mx", m, k, n, recipe)
            row[recipe] = {}
            for gpu in MX_GPUS:
                eager, fused, base = (model.time(fp8, gpu, "eager"), model.time(fp8, gpu, "fused"),
                                      model.time(bf16, gpu, "eager"))
                kernels = model.time(fp8, gpu, "kernels")
                row[recipe][gpu] = {
                    "bf16_us": base.total * 1e6,
                    "fp8_fused_us": fused.total * 1e6,
                    "fp8_kernels_us": kernels.total * 1e6,
                    "speedup_eager": _speedup(model, bf16, fp8, gpu, "eager"),
                    "speedup_kernels": _speedup(model, bf16, fp8, gpu, "kernels"),
                    "speedup_kernels_floor": _speedup(model, bf16, fp8, gpu, "kernels", floor=True),
                    "kernels_kernels": sum(kernels.kernels.values()),
                    "speedup_fused": _speedup(model, bf16, fp8, gpu, "fused"),
                    "speedup_eager_floor": _speedup(model, bf16, fp8, gpu, "eager", floor=True),
                    "share_eager": {c: eager.share(c) for c in ("cast", "amax", "bookkeeping", "gemm")},
                    "share_fused": {c: fused.share(c) for c in ("cast", "bookkeeping", "gemm")},
                    "kernels_eager": sum(eager.kernels.values()),
                    "kernels_bf16": sum(base.kernels.values()),
                    "gemms": sorted({op.name for op in model.ops(fp8) if op.peak == "fp8"}),
                }
        rows.append(row)
    return {"skipped": "", "results": rows}


def block_results(model: Model, recipes: list[str]) -> list[dict]:
    rows = []
    for recipe, hidden, tokens, skip in itertools.product(recipes, BLOCKS, TOKENS, (False, True)):
        bf16, fp8 = ("block", tokens, hidden, None, False), ("block", tokens, hidden, recipe, skip)
        row = {"recipe": recipe, "hidden": hidden, "intermediate": BLOCKS[hidden], "tokens": tokens,
               "skip_small": skip}
        for gpu in GPUS:
            eager = model.time(fp8, gpu, "eager")
            row[gpu] = {
                "bf16_us": model.time(bf16, gpu, "eager").total * 1e6,
                "speedup_eager": _speedup(model, bf16, fp8, gpu, "eager"),
                "speedup_kernels": _speedup(model, bf16, fp8, gpu, "kernels"),
                "speedup_fused": _speedup(model, bf16, fp8, gpu, "fused"),
                "speedup_eager_floor": _speedup(model, bf16, fp8, gpu, "eager", floor=True),
                "speedup_kernels_floor": _speedup(model, bf16, fp8, gpu, "kernels", floor=True),
                "share_eager": {c: eager.share(c) for c in ("cast", "amax", "bookkeeping", "gemm", "other")},
                "gemms_fp8": sum(1 for op in model.ops(fp8) if op.peak == "fp8"),
            }
        rows.append(row)
    return rows


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _pct(v: float) -> str:
    return f"{v:.1%}" if v >= 0.001 or v == 0 else "<0.1%"


def markdown(out: dict) -> str:
    env, floor = out["environment"], out["settings"]["kernel_floor_us"]
    h100, h200 = GPUS
    lines = ["# fp8-plugin projected cost model (model, not measured)", "",
             f"Traced on: {env['device']}; torch {env['torch']}; fp8-plugin commit `{env['commit']}`; {env['date']}; "
             f"{env['elapsed_s']:.0f} s. No GPU was used: every figure is projected from counted ops.", "",
             f"Command: `{env['command']}`", "",
             "Peak figures (dense, without sparsity; NVIDIA datasheets):", ""]
    lines += [f"- {g.name}: FP8 {g.fp8_tflops:,.0f} TFLOP/s, BF16 {g.bf16_tflops:,.1f} TFLOP/s, FP32 "
              f"{g.fp32_tflops:.0f} TFLOP/s, HBM {g.hbm_tb_s} TB/s. Source: {g.source}." for g in GPUS.values()]
    lines += ["", "Each op: max(FLOPs / peak of its dtype, bytes read + written / HBM bandwidth). **kernels**: eager (no "
              "torch.compile) as fp8-plugin runs on a CUDA GPU, each FP8 cast one fused Triton kernel call (2 launches: "
              "the amax pass, then cast + transpose; delayed scaling's steady state reads its input once, current "
              "scaling twice) and the delayed-scaling update of the model one launch. **torch ops**: eager with the "
              "casts as separate torch ops (`FP8_PLUGIN_CAST_KERNELS=torch`, and CPU). "
              "**fused**: an ideal bound, each cast reading its "
              "input once and writing FP8 once (rowwise and transposed copies), the amax fused into the cast (current "
              "scaling: its amax reads the input once more, as the scale must be known before the cast). BF16: "
              "`nn.Linear` under BF16 autocast, eager (autocast's weight cast included). "
              f"**+ floor**: every kernel launch at least {floor:g} µs (an assumption for eager launches, not a datasheet "
              "figure). FP32 master weights, BF16 input and output gradient, no bias; the second of two training "
              "steps (scale update, weight casts) is counted.", ""]
    for recipe in out["settings"]["recipes"]:
        lines += [f"## FP8Linear forward + backward: {recipe} scaling", "",
                  f"| M x K x N | BF16 {h100} | FP8 kernels {h100} | {h100} kernels | {h100} kernels + floor | "
                  f"{h100} fused | {h100} torch ops | {h100} torch ops + floor | {h200} kernels | {h200} fused | "
                  f"{h100} torch ops: casts / amax / bookkeeping | launches FP8 kernels / torch ops / BF16 | "
                  "skip_small |", "| --- |" + " --- |" * 12]
        for r in (r for r in out["layer"] if r["recipe"] == recipe):
            a, b = r[h100], r[h200]
            s = a["share_eager"]
            lines.append(
                f"| {r['m']} x {r['k']} x {r['n']} | {a['bf16_us']:.0f} µs | {a['fp8_kernels_us']:.0f} µs | "
                f"**{_x(a['speedup_kernels'])}** | {_x(a['speedup_kernels_floor'])} | {_x(a['speedup_fused'])} | "
                f"{_x(a['speedup_eager'])} | {_x(a['speedup_eager_floor'])} | **{_x(b['speedup_kernels'])}** | "
                f"{_x(b['speedup_fused'])} | {_pct(s['cast'])} / {_pct(s['amax'])} / {_pct(s['bookkeeping'])} | "
                f"{a['kernels_kernels']} / {a['kernels_eager']} / {a['kernels_bf16']} | "
                f"{'skip' if r['skip_small'] else 'convert'} |")
        lines.append("")
    lines += ["## Where FP8 starts to win", "",
              f"Smallest square K = N (of {', '.join(map(str, SCAN))}) from which FP8Linear forward + backward is "
              "projected faster than BF16 at every larger size:", "",
              "| recipe | GPU | level | " + " | ".join(f"M = {m}" for m in TOKENS) + " |",
              "| --- | --- | --- |" + " --- |" * len(TOKENS)]
    keyed = {}
    for r in out["crossover"]:
        keyed.setdefault((r["recipe"], r["gpu"], r["level"]), {})[r["m"]] = r["smallest_winning_kn"]
    for (recipe, gpu, level), by_m in keyed.items():
        lines.append(f"| {recipe} | {gpu} | {level} | " + " | ".join(str(by_m[m] or "none") for m in TOKENS) + " |")
    for recipe in out["settings"]["recipes"]:
        lines += ["", f"K x N grid at M = {GRID_TOKENS}, {recipe} scaling, {h100}: projected speed-up kernels / "
                  "kernels + floor / torch ops / fused, and skip_small's decision (`too_small_for_fp8`, torchao's "
                  "H100 measurements); **bold**: the fused bound and skip_small disagree.", "",
                  "| K \\ N | " + " | ".join(map(str, GRID)) + " |", "| --- |" + " --- |" * len(GRID)]
        cells = {(r["k"], r["n"]): r for r in out["grid"] if r["recipe"] == recipe}
        for k in GRID:
            row = []
            for n in GRID:
                r = cells[(k, n)]
                v = r[h100]
                text = (f"{v['kernels']:.2f} / {v['kernels + floor']:.2f} / {v['eager']:.2f} / {v['fused']:.2f} "
                        f"{'skip' if r['skip_small'] else 'convert'}")
                row.append(f"**{text}**" if (v["fused"] > 1) == r["skip_small"] else text)
            lines.append(f"| {k} | " + " | ".join(row) + " |")
    for recipe in out["settings"]["recipes"]:
        lines += ["", f"## One Llama decoder block, forward + backward: {recipe} scaling", "",
                  f"transformers `LlamaDecoderLayer`, heads of {HEAD_DIM}, {KV_HEADS} KV heads, sequences of "
                  f"{SEQ_LEN} tokens, causal SDPA attention (BF16 in both runs), FP32 parameters and residual stream "
                  "(bf16-mixed); its seven linear layers converted by `convert_model` (skip_small: off = all seven, "
                  "on = the GPU default, which keeps layers `too_small_for_fp8` names in BF16). Non-FP8 ops are "
                  "charged eagerly at every level.", "",
                  f"| hidden / intermediate | tokens | skip_small | FP8 GEMMs | BF16 {h100} | {h100} kernels | "
                  f"{h100} kernels + floor | {h100} fused | {h100} torch ops | {h100} torch ops + floor | {h200} kernels | "
                  f"{h200} fused | {h100} torch ops: casts / amax / bookkeeping / other |", "| --- |" + " --- |" * 13]
        for r in (r for r in out["block"] if r["recipe"] == recipe):
            a, b = r[h100], r[h200]
            s = a["share_eager"]
            lines.append(
                f"| {r['hidden']} / {r['intermediate']} | {r['tokens']} | {'on' if r['skip_small'] else 'off'} | "
                f"{a['gemms_fp8']} | {a['bf16_us'] / 1e3:.2f} ms | **{_x(a['speedup_kernels'])}** | "
                f"{_x(a['speedup_kernels_floor'])} | {_x(a['speedup_fused'])} | {_x(a['speedup_eager'])} | "
                f"{_x(a['speedup_eager_floor'])} | **{_x(b['speedup_kernels'])}** | {_x(b['speedup_fused'])} | "
                f"{_pct(s['cast'])} / {_pct(s['amax'])} / {_pct(s['bookkeeping'])} / {_pct(s['other'])} |")
    lines += seam_section(out["seam"])
    lines += mxfp8_section(out["mxfp8"])
    return "\n".join(lines) + "\n"


def seam_section(seam: dict) -> list[str]:
    h100, h200 = GPUS
    lines = ["", "## FP8Linear on the CUDA path itself: delayed and blockwise scaling, BF16 weights", ""]
    if seam["skipped"]:
        return lines + [f"Not run: {seam['skipped']}."]
    lines += ["Traced on meta tensors that fp8-plugin treats as an sm90 GPU (`meta_as_cuda((9, 0))`, the CUDA contract "
              "suite's seam), so that Float8BlockScaling reaches Hopper's native block-scaled GEMM "
              "(`torch.nn.functional.scaled_mm`, 1x128 / 128x128 blocks). CUDA autocast cannot be entered without CUDA: "
              "weights, input and output gradient are BF16, against a BF16 `nn.Linear` (no weight cast on either "
              "side). Blockwise's fused bound computes each block's amax on chip (no extra read).", "",
              f"| M x K x N | delayed {h100} kernels / torch ops / fused | blockwise {h100} kernels | blockwise {h100} "
              f"kernels + floor | blockwise {h100} fused | blockwise {h100} torch ops | blockwise {h200} kernels / fused | "
              f"blockwise {h100} torch ops: casts / amax / bookkeeping |", "| --- |" + " --- |" * 7]
    for r in seam["results"]:
        d, b, b2 = r["delayed"][h100], r["blockwise"][h100], r["blockwise"][h200]
        s = b["share_eager"]
        lines.append(
            f"| {r['m']} x {r['k']} x {r['n']} | {_x(d['speedup_kernels'])} / {_x(d['speedup_eager'])} / "
            f"{_x(d['speedup_fused'])} | **{_x(b['speedup_kernels'])}** | {_x(b['speedup_kernels_floor'])} | "
            f"{_x(b['speedup_fused'])} | {_x(b['speedup_eager'])} | {_x(b2['speedup_kernels'])} / "
            f"{_x(b2['speedup_fused'])} | {_pct(s['cast'])} / {_pct(s['amax'])} / {_pct(s['bookkeeping'])} |")
    return lines


def mxfp8_section(mx: dict) -> list[str]:
    lines = ["", "## FP8Linear on the CUDA path as a Blackwell GPU: MXFP8, BF16 weights", ""]
    if mx["skipped"]:
        return lines + [f"Not run: {mx['skipped']}."]
    lines += [f"- {g.name}: FP8 {g.fp8_tflops:,.0f} TFLOP/s, BF16 {g.bf16_tflops:,.0f} TFLOP/s, FP32 "
              f"{g.fp32_tflops:.0f} TFLOP/s, HBM {g.hbm_tb_s} TB/s. Source: {g.source}." for g in MX_GPUS.values()]
    lines += ["", f"Traced on meta tensors that fp8-plugin treats as an sm100 GPU (`meta_as_cuda({MX_CAPABILITY})`), so "
              "that MXFP8BlockScaling (E4M3 elements, one E8M0 scale per 32 elements along K) reaches Blackwell's "
              "block-scaled GEMM (`torch.nn.functional.scaled_mm`, swizzled E8M0 scales); MXFP8 GEMMs charged at the "
              "FP8 tensor-core peak. BF16 weights, input and output gradient, against a BF16 `nn.Linear`, as in the "
              "sm90 table. MXFP8's fused bound computes each block's amax in the cast (no extra read); fp8-plugin keeps "
              "float32 scale_inv beside the FP8 data and writes the GEMM's swizzled E8M0 scales from it before each "
              "GEMM (4 small ops per operand), which every level charges.", "",
              "| M x K x N | BF16 B200 | MXFP8 kernels B200 | MXFP8 kernels | MXFP8 kernels + floor | MXFP8 fused | "
              "MXFP8 torch ops | delayed kernels / fused | MXFP8 torch ops: casts / amax / bookkeeping | "
              "launches MXFP8 kernels / torch ops / BF16 |", "| --- |" + " --- |" * 9]
    for r in mx["results"]:
        x, d = r["mxfp8"]["B200"], r["delayed"]["B200"]
        s = x["share_eager"]
        lines.append(
            f"| {r['m']} x {r['k']} x {r['n']} | {x['bf16_us']:.0f} µs | {x['fp8_kernels_us']:.0f} µs | "
            f"**{_x(x['speedup_kernels'])}** | {_x(x['speedup_kernels_floor'])} | {_x(x['speedup_fused'])} | "
            f"{_x(x['speedup_eager'])} | {_x(d['speedup_kernels'])} / {_x(d['speedup_fused'])} | {_pct(s['cast'])} / "
            f"{_pct(s['amax'])} / {_pct(s['bookkeeping'])} | {x['kernels_kernels']} / {x['kernels_eager']} / "
            f"{x['kernels_bf16']} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="delayed,current",
                   help=f"comma-separated, of: {','.join(RECIPES)} (default: both)")
    p.add_argument("--kernel-floor-us", type=float, default=2.0,
                   help="least time of one kernel in the '+ floor' columns, microseconds (default 2)")
    p.add_argument("--no-block", action="store_true", help="leave out the Llama block (its traces take longest)")
    p.add_argument("--no-seam", action="store_true",
                   help="leave out the layer traced through the CUDA seam (delayed and blockwise, BF16 weights)")
    p.add_argument("--no-mxfp8", action="store_true",
                   help="leave out MXFP8 traced through the CUDA seam as sm100 and projected on a B200")
    p.add_argument("--output", type=Path, default=Path("runs/benchmarks/cost_model.json"),
                   help="JSON file; the markdown goes next to it as .md")
    args = p.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = set(args.recipes) - set(RECIPES)
    if unknown or not args.recipes:
        p.error(f"--recipes {','.join(sorted(unknown)) or '(none)'}: valid: {', '.join(RECIPES)}")
    if args.kernel_floor_us < 0:
        p.error(f"--kernel-floor-us {args.kernel_floor_us}: must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    model = Model(args.kernel_floor_us * 1e-6)
    out = {"settings": {"recipes": args.recipes, "kernel_floor_us": args.kernel_floor_us,
                        "gpus": {name: vars(g) for name, g in ALL_GPUS.items()}}}
    out["layer"] = layer_results(model, args.recipes)
    out["crossover"] = crossover(model, args.recipes)
    out["grid"] = grid(model, args.recipes)
    out["block"] = [] if args.no_block else block_results(model, args.recipes)
    out["seam"] = {"skipped": "--no-seam", "results": []} if args.no_seam else seam_results(model)
    out["mxfp8"] = {"skipped": "--no-mxfp8", "results": []} if args.no_mxfp8 else mxfp8_results(model)
    out["environment"] = {
        "device": device_name(torch.device("cpu")), "torch": torch.__version__, "commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "elapsed_s": time.perf_counter() - start, "traces": len(model._ops),
    }
    write_report(args.output, out, markdown(out))
    return out


if __name__ == "__main__":
    main()
