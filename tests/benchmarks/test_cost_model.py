"""The projected cost model's arithmetic (benchmarks/cost_model.py, benchmarks/fp8_suite/op_costs.py).

Expectations are computed by hand from the shapes: a GEMM's 2 M N K FLOPs and the bytes of its
operands, the bytes an ideal fused cast must move, and the FP8 / BF16 peak ratio that a layer's
speed-up approaches when its GEMMs dwarf its casts.
"""

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_plugin  # noqa: E402
from fp8_suite import op_costs, workloads  # noqa: E402

H100 = op_costs.GPUS["H100 SXM"]
M, K, N = 512, 256, 384


def _gemms(ops):
    return [op for op in ops if op.category == "gemm"]


def test_bf16_gemm_flops_and_bytes_are_the_hand_computed_ones():
    fwd, dgrad, wgrad = _gemms(workloads.linear_ops(M, K, N, None))
    assert (fwd.name, fwd.peak) == ("mm", "bf16")
    for op, (m, k, n) in ((fwd, (M, K, N)), (dgrad, (M, N, K)), (wgrad, (K, M, N))):
        assert op.flops == 2 * m * k * n
        assert op.bytes == 2 * (m * k + k * n + m * n)  # BF16 operands read, BF16 result written
    # Compute-bound on an H100 at this size? No: 2.3 MB at 3.35 TB/s beats 0.1 GFLOP at 989.5 TFLOP/s.
    assert fwd.seconds(H100) == pytest.approx(max(2 * M * K * N / 989.5e12, fwd.bytes / 3.35e12))


def test_fp8_gemm_reads_one_byte_per_operand_value():
    fwd, dgrad, wgrad = _gemms(workloads.linear_ops(M, K, N, fp8_plugin.DelayedScaling()))
    assert {op.name for op in (fwd, dgrad, wgrad)} == {"_scaled_mm"}
    assert {op.peak for op in (fwd, dgrad, wgrad)} == {"fp8"}
    # FP8 operands, two float32 scale_inv, the output: BF16 (fprop, dgrad), float32 (wgrad).
    assert fwd.bytes == M * K + N * K + 2 * 4 + 2 * M * N
    assert dgrad.bytes == M * N + K * N + 2 * 4 + 2 * M * K
    assert wgrad.bytes == N * M + K * M + 2 * 4 + 4 * N * K
    assert fwd.flops == dgrad.flops == wgrad.flops == 2 * M * K * N


@pytest.mark.parametrize("recipe, amax_reads",
                         [(fp8_plugin.DelayedScaling(), 0), (fp8_plugin.Float8CurrentScaling(), 1)])
def test_fused_casts_read_each_input_once_and_write_two_fp8_copies(recipe, amax_reads):
    ops = workloads.linear_ops(M, K, N, recipe)
    fused = op_costs.fuse(ops, amax_pass=amax_reads > 0)
    casts = [op for op in fused if op.category == "cast"]
    # Inputs: x (BF16), the FP32 master weight, grad_output (BF16); each cast writes its FP8
    # rowwise copy and the transposed copy the backward consumes; current scaling reads each
    # input once more for its amax.
    reads = 2 * M * K + 4 * K * N + 2 * M * N
    writes = 2 * (M * K + K * N + M * N)
    assert sum(op.bytes for op in casts) == reads * (1 + amax_reads) + writes
    eager = sum(op.bytes for op in ops if op.category in ("cast", "amax"))
    assert eager > 5 * sum(op.bytes for op in casts)  # eager: float32 intermediates through memory


def test_speedup_of_a_huge_layer_tends_to_the_fp8_over_bf16_peak_ratio():
    peak_ratio = H100.fp8_tflops / H100.bf16_tflops
    speedups = []
    for size in (4096, 32768, 131072):
        bf16 = op_costs.project(workloads.linear_ops(size, size, size, None), H100).total
        ops = workloads.linear_ops(size, size, size, fp8_plugin.DelayedScaling())
        speedups.append(bf16 / op_costs.project(op_costs.fuse(ops, amax_pass=False), H100).total)
    assert speedups == sorted(speedups) and speedups[-1] < peak_ratio
    # At 131072^3 the casts move ~14 bytes per weight-sized element against 6 N^3 FP8 FLOPs:
    # about 1% of the GEMM time.
    assert speedups[-1] == pytest.approx(peak_ratio, rel=0.02)


def test_kernel_floor_charges_each_op_at_least_the_floor():
    ops = workloads.linear_ops(M, K, N, fp8_plugin.DelayedScaling())
    # At this size every op is shorter than 1 us (the largest moves ~1 MB: 0.3 us at 3.35 TB/s),
    # so a floor of 1 us makes the step exactly one microsecond per op.
    assert max(op.seconds(H100) for op in ops) < 1e-6
    floored = op_costs.project(ops, H100, kernel_floor_s=1e-6)
    assert floored.total == pytest.approx(len(ops) * 1e-6)
    assert sum(floored.kernels.values()) == len(ops)


@pytest.mark.parametrize("cast_path", ["torch", "triton"])
def test_fake_cpu_trace_issues_the_ops_of_the_cuda_path(cast_path):
    """The model traces on fake CPU tensors with the native path forced; on meta tensors treated
    as a Hopper GPU (the CUDA contract seam) the layer issues the same data ops, with the casts
    as torch ops or as the fused kernels' custom ops alike."""
    device_kind = pytest.importorskip("fp8_plugin.numerics.device_kind")
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_plugin.modules.linear import FP8Linear
    from fp8_plugin.numerics import gemm
    from fp8_plugin.numerics.kernels import force_kernels

    def trace(context, device, fake):
        # BF16 weights: CUDA autocast cannot be entered without CUDA, so no autocast in either.
        with context, gemm.force_path("native"), force_kernels(cast_path), \
                (FakeTensorMode() if fake else contextlib.nullcontext()):
            layer = FP8Linear(K, N, bias=False, device=device, dtype=torch.bfloat16)
            x = torch.empty(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            for _ in range(2):
                layer.weight.grad, x.grad = None, None
                layer.clear_weight_cache()
                counter = op_costs.OpCounter()
                with fp8_plugin.autocast(recipe=fp8_plugin.DelayedScaling()), counter:
                    out = layer(x)
                with counter:
                    out.backward(grad)
        return [(op.name, op.category, op.bytes, op.flops) for op in counter.ops if op.large or op.flops]

    gemm.clear_plans()
    try:
        cuda = trace(device_kind.meta_as_cuda((9, 0)), "meta", False)
    finally:
        gemm.clear_plans()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # weight-cache key
        cpu = trace(contextlib.nullcontext(), "cpu", True)
    assert cpu == cuda
    assert sum(1 for op in cuda if op[0] == "_scaled_mm") == 3
    fused = sum(1 for op in cuda if op[0] == "cast_delayed")
    assert fused == (3 if cast_path == "triton" else 0)


def test_command_refuses_a_recipe_it_does_not_model(capsys):
    import cost_model  # benchmarks/cost_model.py

    with pytest.raises(SystemExit):
        cost_model.parse_args(["--recipes", "mxfp8"])
    assert "--recipes mxfp8: valid: delayed, current" in capsys.readouterr().err


def test_cuda_seam_trace_reaches_hoppers_block_scaled_gemm():
    pytest.importorskip("fp8_plugin.numerics.device_kind")
    ops = workloads.seam_linear_ops(M, K, N, fp8_plugin.Float8BlockScaling())
    gemms = _gemms(ops)
    assert [op.name for op in gemms] == ["_scaled_mm_v2"] * 3  # torch.nn.functional.scaled_mm
    assert all(op.peak == "fp8" and op.flops == 2 * M * K * N for op in gemms)


# MXFP8 (OCP Microscaling Formats (MX) v1.0: E4M3 elements, one E8M0 scale, 1 byte, per block of
# 32 elements along the contraction dim), traced through the CUDA seam as sm100. M, K, N are
# multiples of 128 rows and of 4 x 32 columns, so the swizzled scale layout (rows padded to
# 128, scale columns to 4) adds no padding and each operand's scales are exactly elements / 32 bytes.


def _mx_ops():
    pytest.importorskip("fp8_plugin.numerics.device_kind")
    import cost_model  # benchmarks/cost_model.py

    return workloads.seam_linear_ops(M, K, N, fp8_plugin.MXFP8BlockScaling(), capability=cost_model.MX_CAPABILITY)


def test_mxfp8_gemms_read_one_byte_per_element_and_one_e8m0_byte_per_32():
    fwd, dgrad, wgrad = _gemms(_mx_ops())
    assert [op.name for op in (fwd, dgrad, wgrad)] == ["_scaled_mm_v2"] * 3  # torch.nn.functional.scaled_mm
    assert {op.peak for op in (fwd, dgrad, wgrad)} == {"fp8"}
    assert fwd.flops == dgrad.flops == wgrad.flops == 2 * M * K * N

    def operands(a, b):  # two E4M3 operands sharing the contraction dim, and their E8M0 scales
        return a + b + a // 32 + b // 32

    # fprop x[M, K] . W[N, K]; dgrad dy[M, N] . W^T[K, N]; wgrad dy^T[N, M] . x^T[K, M]. Outputs:
    # BF16 (fprop, dgrad; wgrad: the weight's dtype, BF16 on the seam, where weights are BF16).
    assert fwd.bytes == operands(M * K, N * K) + 2 * M * N
    assert dgrad.bytes == operands(M * N, K * N) + 2 * M * K
    assert wgrad.bytes == operands(N * M, K * M) + 2 * N * K


def test_mxfp8_fused_cast_reads_two_bytes_and_writes_two_fp8_bytes_per_element():
    ops = _mx_ops()
    fused = op_costs.fuse(ops, amax_pass=False)  # the block amax is computed in the cast
    casts = [op for op in fused if op.category == "cast" and op.writes]
    # x[M, K], the BF16 weight [N, K], dy[M, N]: each read once (2 bytes an element), each written
    # as a rowwise and a columnwise E4M3 copy (1 byte an element each); their scales are small
    # tensors here (bookkeeping), charged at the GEMMs above.
    elements = M * K + K * N + M * N
    assert sum(op.bytes for op in casts) == 4 * elements
    eager = sum(op.bytes for op in ops if op.category in ("cast", "amax"))
    assert eager > 5 * sum(op.bytes for op in casts)  # eager: float32 intermediates through memory


def test_b200_peaks_are_the_datasheet_figures_without_sparsity():
    import cost_model

    b200 = cost_model.MX_GPUS["B200"]
    # The datasheet's tensor-core figures are with 2:4 sparsity: dense is half.
    assert "FP8/FP6 Tensor Core 9 PFLOPS" in b200.source and b200.fp8_tflops == 9000 / 2
    assert "FP16/BF16 Tensor Core 4.5 PFLOPS" in b200.source and b200.bf16_tflops == 4500 / 2
    assert "7.7 TB/s" in b200.source and b200.bandwidth == 7.7e12


def test_mxfp8_speedup_of_a_huge_layer_tends_to_the_b200_fp8_over_bf16_peak_ratio():
    pytest.importorskip("fp8_plugin.numerics.device_kind")
    import cost_model

    b200 = cost_model.MX_GPUS["B200"]
    peak_ratio = b200.fp8_tflops / b200.bf16_tflops
    speedups = []
    for size in (4096, 32768, 131072):
        bf16 = op_costs.project(workloads.seam_linear_ops(size, size, size, None, capability=(10, 0)), b200).total
        ops = workloads.seam_linear_ops(size, size, size, fp8_plugin.MXFP8BlockScaling(), capability=(10, 0))
        speedups.append(bf16 / op_costs.project(op_costs.fuse(ops, amax_pass=False), b200).total)
    assert speedups == sorted(speedups) and speedups[-1] < peak_ratio
    # At 131072^3 the GEMMs take 6 N^3 / 4.5 PFLOP/s = 3.0 s; the fused casts move 4 bytes per
    # element of each of the three N^2 tensors, the float32 wgrad's cast back to BF16 4 more, the
    # scales a fraction: under 20 bytes per N^2 element, under 0.045 s at 7.7 TB/s, 1.5% of the
    # FP8 step, against BF16's 6 s of GEMMs: within 2% of the ratio.
    assert speedups[-1] == pytest.approx(peak_ratio, rel=0.02)


def test_mxfp8_section_runs_on_the_cuda_seam_as_sm100(monkeypatch):
    pytest.importorskip("fp8_plugin.numerics.device_kind")
    import cost_model

    monkeypatch.setattr(cost_model, "TOKENS", (M,))
    monkeypatch.setattr(cost_model, "DIMS", (K,))
    out = cost_model.mxfp8_results(cost_model.Model(0.0))
    (row,) = out["results"]
    mx = row["mxfp8"]["B200"]
    assert mx["gemms"] == ["_scaled_mm_v2"] and row["delayed"]["B200"]["gemms"] == ["_scaled_mm"]
    assert mx["kernels_bf16"] == 3  # fprop, dgrad, wgrad of nn.Linear: one kernel each
    section = "\n".join(cost_model.mxfp8_section(out))
    assert f"| {M} x {K} x {K} |" in section and "B200" in section
