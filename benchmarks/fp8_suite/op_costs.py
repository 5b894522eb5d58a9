"""A projected cost model: every aten op of a training step, each bounded by its FLOPs or its bytes.

:class:`OpCounter`, a ``TorchDispatchMode``, records every aten op that a forward + backward
dispatches, with the bytes it reads and writes and, for GEMMs and attention, its FLOPs. The step
runs on fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and strides, no
memory, no arithmetic), so LLM shapes cost nothing to trace. :func:`project` turns the ops into a
time on a GPU from its published peak figures (:data:`GPUS`): each op takes

    max(FLOPs / peak FLOP/s of its dtype, bytes read + written / HBM bandwidth)

(a roofline bound per op: a lower bound on a real kernel, which reaches neither peak). Two
fusion levels:

- ``eager``: each op alone, as PyTorch runs it without ``torch.compile``: every intermediate of
  a cast (the scaled float32 copy, the saturation, the transpose) goes through memory.
- ``fused``: an ideal fused bound. Each run of consecutive FP8 cast / amax / bookkeeping ops
  between two other ops is one kernel that reads each tensor it needs from outside the run once
  and writes only what leaves the run (the FP8 data, its transposed copy, block scales, the
  state): a cast reads its input once and writes FP8 once per copy, and the amax is fused into
  the cast. One exception, from the data flow: current scaling needs the whole tensor's amax
  before its first element can be scaled, so the bound charges its amax a read of its own
  (``amax_pass=True``); delayed scaling casts with the stored scale and block scaling computes
  each block's amax on chip, so their amax costs no extra read.

Ops are attributed by where they were issued: GEMMs and attention (``gemm``), ops issued by
fp8-plugin's code on tensors of more than :data:`SMALL` elements (``amax`` for the abs / max
reductions, ``cast`` for the rest: scaling, saturation, the FP8 cast, transposed copies,
padding), ops of fp8-plugin's code on small tensors only (``bookkeeping``: scales, amax
histories, counters, the scale update), and everything else (``other``: the model's own ops,
autocast's casts, gradient accumulation). Views cost nothing; element-wise FLOPs are not counted
(an element-wise op does a few FLOPs per 2 to 12 bytes, far below the 20 to 600 FLOP/byte at which
an H100 stops being bound by its memory).

FLOPs: ``2 M N K`` per GEMM (a multiply and an add per term); attention ``4 B H Sq Skv D``
forward (two GEMMs) and 2.5 times that backward (five GEMMs, FlashAttention-2's count), halved
for a causal mask (the blocks above the diagonal are skipped).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fp8_plugin
from fp8_plugin.numerics.kernels.ops import OP_INPUT_READS, OP_LAUNCHES, op_input_reads

# A tensor of at most this many elements is state (scales, amax histories, counters), not data.
SMALL = 1 << 16
CATEGORIES = ("gemm", "cast", "amax", "bookkeeping", "other")
FP8_OVERHEAD = ("cast", "amax", "bookkeeping")
_PLUGIN_DIR = str(Path(fp8_plugin.__file__).resolve().parent) + os.sep
_AMAX_OPS = {"abs", "amax", "max", "aminmax"}
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm"}
# Ops that read only their inputs' metadata (shape, dtype), never the data.
_METADATA_ONLY = {"full_like", "zeros_like", "ones_like", "empty_like", "new_zeros", "new_ones", "new_full",
                  "new_empty", "new_empty_strided", "empty", "empty_strided", "rand_like", "randn_like"}
# Ops that allocate without writing: no kernel.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"}
# Ops that overwrite the tensor they mutate without reading it.
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_"}
_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class GPU:
    """Published peak figures of one GPU: dense tensor-core TFLOP/s (without 2:4 sparsity) per
    operand dtype, FP32 without tensor cores, and HBM bandwidth in TB/s."""

    name: str
    fp8_tflops: float
    bf16_tflops: float
    fp32_tflops: float
    hbm_tb_s: float
    source: str

    def peak_flops(self, kind: str) -> float:
        """FLOP/s of a GEMM whose operands are ``kind``: "fp8", "bf16" (and fp16) or "fp32"."""
        return {"fp8": self.fp8_tflops, "bf16": self.bf16_tflops, "fp32": self.fp32_tflops}[kind] * 1e12

    @property
    def bandwidth(self) -> float:
        """HBM bytes/s."""
        return self.hbm_tb_s * 1e12


# NVIDIA's datasheets list tensor-core figures "with sparsity" (2:4 structured sparsity doubles
# them); dense is half: FP8 3,958 -> 1,979 TFLOP/s, BF16 1,979 -> 989.5 TFLOP/s. FP32 67 TFLOP/s
# (torch's default float32 matmul on CUDA uses no TF32). H200 has the H100's compute and faster
# HBM3e.
GPUS = {
    "H100 SXM": GPU("H100 SXM", 1979.0, 989.5, 67.0, 3.35,
                    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
                    "(https://www.nvidia.com/en-us/data-center/h100/): FP8 Tensor Core 3,958 TFLOPS, BF16 Tensor "
                    "Core 1,979 TFLOPS (both with sparsity), FP32 67 TFLOPS, GPU memory bandwidth 3.35 TB/s"),
    "H200 SXM": GPU("H200 SXM", 1979.0, 989.5, 67.0, 4.8,
                    "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
                    "(https://www.nvidia.com/en-us/data-center/h200/): FP8 Tensor Core 3,958 TFLOPS, BF16 Tensor "
                    "Core 1,979 TFLOPS (both with sparsity), FP32 67 TFLOPS, GPU memory bandwidth 4.8 TB/s"),
}


@dataclass
class Op:
    """One aten op: what it reads and writes (bytes per storage), its FLOPs and their dtype.

    ``reads`` / ``writes`` map a storage key to bytes; ``created``: the storages it allocated;
    ``peak``: "fp8", "bf16" or "fp32" for GEMMs and attention, "" otherwise; ``large``: it
    touches a tensor of more than :data:`SMALL` elements; ``launches``: GPU kernels it takes (1,
    or what a fused cast of fp8-plugin documents: ``fp8_plugin.numerics.kernels.ops``).
    """

    name: str
    category: str
    flops: float = 0.0
    peak: str = ""
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    created: set = field(default_factory=set)
    large: bool = False
    launches: int = 1

    @property
    def bytes(self) -> int:
        return sum(self.reads.values()) + sum(self.writes.values())

    def seconds(self, gpu: GPU) -> float:
        """The op's roofline time on ``gpu``: the larger of its FLOP time and its memory time."""
        compute = self.flops / gpu.peak_flops(self.peak) if self.flops else 0.0
        return max(compute, self.bytes / gpu.bandwidth)


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses: a broadcast (stride-0) dim counts once."""
    if t.numel() == 0:
        return 0
    elements = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)
    return elements * t.element_size()


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _bound(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    # The op's arguments by schema name.
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def gemm_flops(name: str, a: dict[str, Any], out: Any) -> float:
    """FLOPs of a GEMM or attention op (0 for any other op), from its arguments by schema name."""
    if name in _GEMM_OPS:
        # mm(self, mat2), addmm(self, mat1, mat2), bmm(self, mat2), baddbmm(self, batch1, batch2)
        if "mat1" in a or "batch1" in a:
            x, y = a.get("mat1", a.get("batch1")), a.get("mat2", a.get("batch2"))
        else:
            x, y = a["self"], a["mat2"]
        batch = x.shape[0] if x.dim() == 3 else 1
        return 2.0 * batch * x.shape[-2] * x.shape[-1] * y.shape[-1]
    if "scaled_mm" in name:  # torch._scaled_mm and torch.nn.functional.scaled_mm: [M, K] x [K, N]
        x, y = [t for t in a.values() if isinstance(t, torch.Tensor)][:2]  # then the scales
        return 2.0 * x.shape[0] * x.shape[1] * y.shape[1]
    if "attention" in name:
        q, k = a["query"], a["key"]
        b, h, sq, d = q.shape
        forward = 4.0 * b * h * sq * k.shape[2] * d
        if a.get("is_causal"):
            forward /= 2
        return forward * (2.5 if "backward" in name else 1.0)
    return 0.0


def _peak_kind(name: str, a: dict[str, Any]) -> str:
    if "attention" in name:
        return "bf16"  # CUDA autocast runs attention in BF16 (also with FP8 linear layers)
    dtype = next(t.dtype for t in a.values() if isinstance(t, torch.Tensor) and t.dim() >= 2)
    if dtype in _FP8_DTYPES:
        return "fp8"
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def _issued_by_plugin() -> bool:
    # Whether fp8-plugin's code is on the Python stack (backward ops of its autograd function too).
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PLUGIN_DIR):
            return True
        frame = frame.f_back
    return False


class OpCounter(TorchDispatchMode):
    """Records every aten op dispatched inside it as an :class:`Op` (``self.ops``); views and
    allocations without a kernel are left out. Keeps the storage of every tensor it saw alive
    until it is discarded, so that storage keys stay unique (fake tensors hold no memory); not the
    tensors, whose extra references would stop autograd from taking a gradient over without a
    copy."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._alive: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._alive += [t.untyped_storage() for t in inputs + outputs]
        schema = getattr(func, "_schema", None)
        mutated = []
        if schema is not None:
            bound = _bound(func, args, kwargs)
            mutated = [bound[a.name] for a in schema.arguments if a.alias_info is not None
                       and a.alias_info.is_write and isinstance(bound.get(a.name), torch.Tensor)]
        input_keys = {_key(t) for t in inputs}
        new_outputs = [t for t in outputs if _key(t) not in input_keys]
        if not mutated and not new_outputs or name in _NO_KERNEL:
            return  # a view, an alias, metadata, or an allocation that writes nothing
        op = Op(name, "other")
        mutated_keys = {_key(t) for t in mutated}
        for t in inputs:
            key = _key(t)
            if name in _METADATA_ONLY or (key in mutated_keys and name in _OVERWRITE):
                continue
            op.reads[key] = max(op.reads.get(key, 0), touched_bytes(t))
        for t in mutated + new_outputs:
            key = _key(t)
            op.writes[key] = max(op.writes.get(key, 0), touched_bytes(t))
        if getattr(func, "namespace", "") == "fp8_plugin":
            # A fused cast: its launches, and its input read as often as its kernels read it
            # (current scaling: the amax pass, then the cast).
            op.launches = OP_LAUNCHES.get(name, 1)
            if inputs and name in OP_INPUT_READS:
                reads = op_input_reads(name, bound if schema is not None else {})
                op.reads[_key(inputs[0])] = touched_bytes(inputs[0]) * reads
        op.created = {_key(t) for t in new_outputs}
        op.large = max(t.numel() for t in inputs + outputs) > SMALL
        if schema is not None:
            op.flops = gemm_flops(name, bound, out)
            if op.flops:
                op.peak = _peak_kind(name, bound)
        op.category = self._category(op)
        self.ops.append(op)

    @staticmethod
    def _category(op: Op) -> str:
        if op.flops:
            return "gemm"
        if not _issued_by_plugin():
            return "other"
        if not op.large:
            return "bookkeeping"
        return "amax" if op.name in _AMAX_OPS else "cast"


def fuse(ops: list[Op], amax_pass: bool) -> list[Op]:
    """The ideal fused bound of ``ops``: each run of consecutive FP8 cast / amax / bookkeeping
    ops becomes one ``cast`` op (its large tensors) and one ``bookkeeping`` op (its small ones),
    reading what the run needs from outside once and writing what leaves it once (see the module
    docstring); with ``amax_pass`` (current scaling) each amax reduction reads its input once
    more. Other ops are kept as they are."""
    fused: list[Op] = []
    i = 0
    while i < len(ops):
        if ops[i].category not in FP8_OVERHEAD:
            fused.append(ops[i])
            i += 1
            continue
        j = i
        while j < len(ops) and ops[j].category in FP8_OVERHEAD:
            j += 1
        fused += _fuse_run(ops[i:j], ops[j:], amax_pass)
        i = j
    return fused


def _fuse_run(run: list[Op], later: list[Op], amax_pass: bool) -> list[Op]:
    created = set().union(*(op.created for op in run))
    read_later = set().union(*(op.reads.keys() for op in later)) if later else set()
    reads: dict = {}
    writes: dict = {}
    for op in run:
        for key, n in op.reads.items():
            if key not in created:
                reads[key] = max(reads.get(key, 0), n)
        for key, n in op.writes.items():
            if key not in created or key in read_later:  # state it updates, or a result used after it
                writes[key] = max(writes.get(key, 0), n)
    extra = 0
    if amax_pass:
        extra = sum(n for op in run if op.category == "amax" for key, n in op.reads.items() if key not in created)
    # Data (storages of more than SMALL bytes) against state.
    cast = Op("fused cast", "cast", large=True)
    state = Op("fused bookkeeping", "bookkeeping")
    for side, items in (("reads", reads), ("writes", writes)):
        for key, n in items.items():
            getattr(cast if n > SMALL else state, side)[key] = n
    if extra:
        cast.reads["amax pass"] = extra
    return [op for op in (cast, state) if op.reads or op.writes]


@dataclass
class Projection:
    """A step's projected time on one GPU: seconds per category, kernels (ops) per category."""

    seconds: dict[str, float]
    kernels: dict[str, int]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def share(self, *categories: str) -> float:
        """Fraction of the step's time spent in ``categories``."""
        return sum(self.seconds[c] for c in categories) / self.total if self.total else 0.0


def project(ops: Iterable[Op], gpu: GPU, kernel_floor_s: float = 0.0) -> Projection:
    """Sum of each op's roofline time on ``gpu`` (:meth:`Op.seconds`), each op at least
    ``kernel_floor_s`` per launch (0: the pure roofline; a GPU kernel takes a few microseconds
    at least)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    kernels = dict.fromkeys(CATEGORIES, 0)
    for op in ops:
        seconds[op.category] += max(op.seconds(gpu), kernel_floor_s * op.launches)
        kernels[op.category] += op.launches
    return Projection(seconds, kernels)
