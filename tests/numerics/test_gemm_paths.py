"""GEMM paths per device: scale layouts of the native block GEMMs, describe_device, recipe "auto"."""

import contextlib
import math
import time
import warnings

import pytest
import torch

import fp8_plugin as fp
from fp8_plugin.modules.autocast import get_fp8_recipe
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device import _CPU_PAIRINGS, recipe_gemm_kind, resolve_recipe
from fp8_plugin.numerics.gemm import (
    NATIVE_SPEEDUP_REQUIRED,
    choose_native,
    force_path,
    fp8_gemm,
    gemm_kind,
    native_gemm,
    scaled_mm_supported,
    tensorwise_choice,
)
from fp8_plugin.numerics.quantizers import INPUT, WEIGHT, QuantizedTensor, ScalingState, make_quantizer
from fp8_plugin.numerics.scale_layouts import (
    blockwise_1x128_gemm_scale,
    blockwise_128x128_gemm_scale,
    e8m0_bits,
    mx_gemm_scale,
    swizzle_32_4_4,
)
from reference import accumulator_scaled_mm, assert_within_bound, cpu_scaled_mm_uses_onednn, scaled_gemm_error_bound


def test_e8m0_encoding_is_the_biased_exponent():
    # OCP MX v1.0, 5.4: E8M0 byte b means 2^(b - 127); 0xFF is NaN.
    exps = list(range(-127, 128))
    values = torch.tensor([math.ldexp(1.0, e) for e in exps] + [float("nan")], dtype=torch.float32)
    assert e8m0_bits(values).tolist() == [e + 127 for e in exps] + [255]
    back = mx_gemm_scale(values[:-1].reshape(1, -1)).view(torch.uint8)
    assert back.numel() == 128 * 256  # one row padded to 128, 255 columns to 256


@pytest.mark.parametrize("rows, cols", [(128, 4), (256, 8), (130, 6), (5, 3)])
def test_swizzle_matches_cublas_block_scaling_factor_layout(rows, cols):
    # cuBLAS docs, "1D Block Scaling Factors Layout": 128x4 tiles, row of tiles after row of
    # tiles; in a tile, the scale at (r, c) is byte (r % 32) * 16 + (r // 32) * 4 + c.
    grid = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    out = swizzle_32_4_4(grid)
    tiles_per_row = -(-cols // 4)
    assert out.numel() == (-(-rows // 128) * 128) * (tiles_per_row * 4)
    expected = torch.zeros_like(out)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_per_row + c // 4
            rr, cc = r % 128, c % 4
            expected[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = grid[r, c]
    assert torch.equal(out, expected)


def test_blockwise_scale_layouts_match_torch_scaled_mm_shapes():
    # torch._scaled_mm_v2 (torch/_meta_registrations.py): 1x128 [M, K/128] strides (1, M);
    # 128x128 of the second operand [round_up(K/128, 4), N/128] strides (1, round_up(K/128, 4)).
    m, n, k = 48, 256, 640
    a = torch.randn(m, k // 128)
    sa = blockwise_1x128_gemm_scale(a)
    assert sa.shape == (m, k // 128) and sa.stride() == (1, m) and torch.equal(sa, a)
    assert blockwise_1x128_gemm_scale(sa) is sa  # the casts' column-major grids are used as they are
    b = torch.randn(n // 128, k // 128)
    sb = blockwise_128x128_gemm_scale(b)
    assert sb.shape == (8, n // 128) and sb.stride() == (1, 8)
    assert torch.equal(sb[: k // 128], b.t()) and not sb[k // 128 :].any()
    # K in whole groups of 4 blocks: no padding; a row-major grid is its own layout's transpose,
    # taken as it is (no copy), and a column-major one is copied into that layout.
    whole = torch.randn(n // 128, 1024 // 128)
    for grid in (whole, whole.t().contiguous().t()):
        sw = blockwise_128x128_gemm_scale(grid)
        assert sw.shape == (8, n // 128) and sw.stride() == (1, 8) and torch.equal(sw, whole.t())
    assert blockwise_128x128_gemm_scale(whole).data_ptr() == whole.data_ptr()


def _operand(recipe, role, x):
    return make_quantizer(recipe, role, ScalingState(16)).quantize(x)


@pytest.mark.parametrize(
    "recipe, kind",
    [(fp.DelayedScaling(), "tensorwise"), (fp.Float8CurrentScaling(), "tensorwise"),
     (fp.Float8BlockScaling(), "blockwise"), (fp.MXFP8BlockScaling(), "mxfp8")],
)
def test_each_recipe_maps_to_its_gemm_kind(recipe, kind):
    a, b = _operand(recipe, INPUT, torch.randn(32, 256)), _operand(recipe, WEIGHT, torch.randn(128, 256))
    assert gemm_kind(a, b) == kind == recipe_gemm_kind(recipe)
    with force_path("native"):  # the kernel where one exists, whatever the timing says
        ok, reason = scaled_mm_supported(a, b)
    # On a CPU torch has tensorwise (and rowwise) FP8 GEMMs only.
    if torch.cuda.is_available():
        pytest.skip("CPU expectations")
    assert ok == (kind == "tensorwise")
    assert ok or reason == f"torch has no {kind} GEMM on CPU (tensorwise and rowwise only)"


def test_blocks_without_a_native_pairing_are_named():
    a = QuantizedTensor(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    b = QuantizedTensor(torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(128, 1), (1, 128))
    assert gemm_kind(a, b) == "unsupported-blocks"
    assert scaled_mm_supported(a, b) == (False, "no native GEMM for (128, 128) x (1, 128) blocks")
    with pytest.raises(ValueError, match="kind='nvfp4' is not a GEMM kind; valid: tensorwise, blockwise, mxfp8"):
        native_gemm("nvfp4", "cpu")


@pytest.mark.parametrize("recipe", [fp.MXFP8BlockScaling(), fp.Float8BlockScaling()], ids=["mxfp8", "blockwise"])
def test_emulation_ignores_torch_autocast(recipe):
    # wgrad asks for a float32 result while bf16 autocast is on: the emulated GEMM must still
    # multiply the exact dequantized operands in float32, not in bf16.
    x, w = torch.randn(64, 256), torch.randn(128, 256)
    a, b = _operand(recipe, INPUT, x), _operand(recipe, WEIGHT, w)
    expected = a.dequantize().double() @ b.dequantize().double().t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp8_gemm(a, b, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU expectations")
def test_describe_device_on_cpu_reports_the_gemm_path_of_each_pairing():
    report = fp.describe_device("cpu")
    rows = {r.recipe: r.gemm for r in report.recipes}
    assert rows == {
        "DelayedScaling": "tensorwise",
        "Float8CurrentScaling": "tensorwise",
        "Float8BlockScaling": "blockwise",
        "MXFP8BlockScaling": "mxfp8",
    }
    assert [r.native for r in report.recipes][2:] == [False, False]
    assert report.auto == fp.DelayedScaling(fp8_format=fp.Format.HYBRID)
    text = str(report)
    assert text.startswith("CPU (cpu), torch ") and 'recipe "auto"' in text and "no: torch has no mxfp8 GEMM" in text
    # One line per operand pairing of a training step: the check's verdict, or both measured times.
    assert len(report.gemm_paths) == len(_CPU_PAIRINGS) == 6
    for line in report.gemm_paths:
        assert "_scaled_mm" in line and "emulation" in line, line
    native = all(r.native for r in report.recipes[:2])
    assert native == all(line.split(": ", 1)[1].startswith("torch._scaled_mm") for line in report.gemm_paths)
    # The lines are the cached decisions; a timed one never chose the clearly slower path.
    for (dtype_a, dtype_b, out_dtype, _), line in zip(_CPU_PAIRINGS, report.gemm_paths):
        choice = tensorwise_choice(torch.device("cpu"), dtype_a, dtype_b, out_dtype)
        assert line.endswith(choice.describe())
        assert (" ms" in line) != choice.same_computation, line
        if not choice.same_computation:
            chosen, other = (choice.native_s, choice.emulated_s) if choice.native else (choice.emulated_s, choice.native_s)
            assert chosen <= NATIVE_SPEEDUP_REQUIRED * other


def test_the_native_kernel_is_chosen_only_when_clearly_faster():
    # Times as measured on a CPU whose E4M3 x E4M3 kernel is a reference one (7.7 s against
    # 12 ms), on one where both are equal, and on one where the kernel is twice as fast.
    assert choose_native(7.7, 0.012) is False
    assert choose_native(0.012, 0.012) is False  # both exact: a tie goes to the emulation
    assert choose_native(0.0105, 0.012) is False  # within NATIVE_SPEEDUP_REQUIRED: a tie too
    assert choose_native(0.006, 0.012) is True
    assert choose_native(math.inf, 0.012) is False


@pytest.fixture
def fresh_probe():
    # The timed choice is cached per process: measure afresh here, and again after.
    tensorwise_choice.cache_clear()
    yield
    tensorwise_choice.cache_clear()


def test_probe_stops_timing_a_reference_kernel_on_the_scout_shape(monkeypatch, fresh_probe):
    # A kernel ~5 ms per call, hundreds of times the emulation, as oneDNN's reference kernel is
    # (summing in its own order, so that the bit-for-bit check sends it to the clock): the probe
    # must give up on the tiny scout product after the check (its float32 GEMM, which already
    # differs; also the warm-up) and two timed calls.
    calls = []

    def reference_kernel(*args):
        calls.append(args[0].data.shape)
        time.sleep(0.005)
        return accumulator_scaled_mm(*args)

    monkeypatch.setattr(gemm, "_scaled_mm_tensorwise", reference_kernel)
    choice = tensorwise_choice(torch.device("cpu"), torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
    assert not choice.native and choice.shape == gemm._SCOUT_SHAPE
    assert choice.native_s >= 0.005 > choice.emulated_s
    assert len(calls) == 3 and set(calls) == {gemm._SCOUT_SHAPE[:2]}
    assert choice.describe().startswith("float32 emulation (32x64x64: _scaled_mm ")
    assert f"_scaled_mm {choice.native_s * 1e3:.2f} ms, emulation {choice.emulated_s * 1e3:.2f} ms" in choice.describe()


def test_probe_picks_the_native_kernel_where_it_is_clearly_faster(monkeypatch, fresh_probe):
    # A kernel that computes otherwise (oneDNN's order) against an emulation slowed by 2 ms per
    # call: the kernel (well under 1 ms here) must be chosen, on the full probe shape.
    monkeypatch.setattr(gemm, "_scaled_mm_tensorwise", accumulator_scaled_mm)
    real = gemm._emulated

    def slow_emulation(*args):
        time.sleep(0.002)
        return real(*args)

    monkeypatch.setattr(gemm, "_emulated", slow_emulation)
    choice = tensorwise_choice(torch.device("cpu"), torch.float8_e5m2, torch.float8_e4m3fn, torch.float32)
    assert choice.native and choice.shape == gemm._PROBE_SHAPE
    assert choice.native_s * NATIVE_SPEEDUP_REQUIRED <= choice.emulated_s
    assert choice.describe().startswith("torch._scaled_mm (64x128x128: _scaled_mm ")


def test_a_pairing_the_cpu_kernel_refuses_takes_the_emulation(monkeypatch, fresh_probe):
    # torch's CPU _scaled_mm hands FP8 GEMMs to oneDNN on CPUs with AMX, and oneDNN refuses the
    # FNUZ formats of an AMD MI300 ("itensor_view_from_dense expects float/bfloat16/half/int8/fp8
    # tensor input"): the choice must send that pairing to the emulation, not fail the step.
    def refusing_kernel(*args):
        raise RuntimeError("itensor_view_from_dense expects float/bfloat16/half/int8/fp8 tensor input")

    monkeypatch.setattr(gemm, "_scaled_mm_tensorwise", refusing_kernel)
    cpu, e4m3 = torch.device("cpu"), torch.float8_e4m3fnuz
    choice = tensorwise_choice(cpu, e4m3, e4m3, torch.float32)
    assert not choice.native and "refuses" in choice.describe() and "itensor_view_from_dense" in choice.describe()
    # Integers in [-2, 2] and power-of-two scales: every product and sum (at most 128 in size) is
    # exact in float32 and in bfloat16, whichever emulation the process runs.
    gen = torch.Generator().manual_seed(0)
    a_int, b_int = (torch.randint(-2, 3, shape, generator=gen).double() for shape in ((16, 32), (8, 32)))
    a, b = QuantizedTensor(a_int.to(e4m3), torch.tensor(0.5)), QuantizedTensor(b_int.to(e4m3), torch.tensor(0.25))
    assert torch.equal(fp8_gemm(a, b, torch.float32).double(), a_int @ b_int.t() * 0.125)


def test_forced_paths_and_bad_path_names():
    a = QuantizedTensor(torch.randn(16, 32).to(torch.float8_e4m3fn), torch.tensor(0.5))
    b = QuantizedTensor(torch.randn(16, 32).to(torch.float8_e4m3fn), torch.tensor(0.25))
    with force_path("native"):
        assert scaled_mm_supported(a, b) == (True, "")
    with force_path("emulated"):
        assert scaled_mm_supported(a, b)[0] is False
    with pytest.raises(ValueError, match=r"force_path\(path='fast'\) is not a GEMM path; valid: auto, native, emulated"):
        with force_path("fast"):
            pass


@pytest.mark.parametrize("path", ["native", "emulated"])
def test_float64_output_is_computed_in_float32_and_cast(path):
    # A float64 model: no kernel writes float64, so a float32 GEMM (bias rounded to float32),
    # then the cast; on the native path too, and without an "emulated" warning.
    a = QuantizedTensor((torch.randn(16, 32) * 8).to(torch.float8_e4m3fn), torch.tensor(0.37))
    b = QuantizedTensor((torch.randn(24, 32) * 8).to(torch.float8_e4m3fn), torch.tensor(0.25))
    bias = torch.randn(24, dtype=torch.float64)
    with force_path(path), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fp8_gemm(a, b, torch.float64, bias)
    assert out.dtype == torch.float64
    if path == "native" and cpu_scaled_mm_uses_onednn(a.data.dtype, b.data.dtype):
        # oneDNN (AMX CPUs) sums in its own order: within the float32 accumulation bound.
        bound = scaled_gemm_error_bound(a.data, a.scale_inv.item(), b.data, b.scale_inv.item(), torch.float32,
                                        bias.float())
        exact = a.data.double() * a.scale_inv.item() @ (b.data.double() * b.scale_inv.item()).t() + bias.float().double()
        assert_within_bound(out, exact, bound)
    else:
        expected = (a.dequantize() @ b.dequantize().t().contiguous() + bias.float()).double()
        assert torch.equal(out, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU expectations")
def test_auto_recipe_is_resolved_at_conversion_and_in_autocast():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    report = fp.convert_model(model, fp.AutoRecipe(fp.Format.E4M3))
    assert model[0].recipe == fp.DelayedScaling(fp8_format=fp.Format.E4M3) == report.recipe
    assert "recipe DelayedScaling(E4M3) on cpu: tensorwise GEMMs: torch._scaled_mm or the exact float32 emulation" in str(report)
    assert resolve_recipe(fp.Float8CurrentScaling()) == fp.Float8CurrentScaling()
    with fp.autocast(recipe=fp.AutoRecipe()):
        assert get_fp8_recipe() == fp.DelayedScaling()
    with pytest.raises(ValueError, match="AutoRecipe\\(fp8_format=Format.E5M2\\) is not supported"):
        fp.AutoRecipe("E5M2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", [fp.DelayedScaling(), fp.Float8BlockScaling(), fp.MXFP8BlockScaling()],
                         ids=["tensorwise", "blockwise", "mxfp8"])
def test_native_gemm_on_gpu_matches_the_emulation(recipe):
    kind = recipe_gemm_kind(recipe)
    support = native_gemm(kind, "cuda")
    major, _ = torch.cuda.get_device_capability()
    expected_native = {"tensorwise": (major, _) >= (8, 9), "blockwise": major == 9, "mxfp8": major >= 10}[kind]
    if support.native != expected_native:
        pytest.fail(f"{kind} on sm{major}{_}: native={support.native} ({support.reason})")
    x, w = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda")
    a, b = _operand(recipe, INPUT, x), _operand(recipe, WEIGHT, w)
    assert scaled_mm_supported(a, b)[0] == support.native
    expected = a.dequantize().double() @ b.dequantize().double().t()
    got = fp8_gemm(a, b, torch.bfloat16).double()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", [fp.DelayedScaling(), fp.Float8BlockScaling(), fp.MXFP8BlockScaling()],
                         ids=["tensorwise", "blockwise", "mxfp8"])
def test_unaligned_token_counts_run_natively_on_gpu_padded(recipe):
    kind = recipe_gemm_kind(recipe)
    if not native_gemm(kind, "cuda").native:
        pytest.skip(f"no native {kind} GEMM on this GPU")
    # 250 tokens: M of the forward and dgrad, K of wgrad; no dim the kernels take as it is.
    x, w = torch.randn(250, 512, device="cuda"), torch.randn(384, 512, device="cuda")
    a, b = _operand(recipe, INPUT, x), _operand(recipe, WEIGHT, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an emulated GEMM warns
        got = fp8_gemm(a, b, torch.bfloat16).double()
        wgrad_a, wgrad_b = _operand(recipe, INPUT, w.t().contiguous()), _operand(recipe, WEIGHT, x.t().contiguous())
        fp8_gemm(wgrad_a, wgrad_b, torch.float32)
    assert got.shape == (250, 384) and got.is_contiguous()
    expected = a.dequantize().double() @ b.dequantize().double().t()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bias_is_rounded_to_the_output_dtype_on_both_paths(out_dtype, bias_dtype):
    # One rule on every path: bias rounded to the (low-precision) output dtype, float32 for a
    # float32 output, added to the float32 accumulator, the sum rounded. Operands on a coarse
    # grid keep the accumulation exact, so only the bias rule can make the paths differ.
    gen = torch.Generator().manual_seed(0)
    a = QuantizedTensor(((torch.randn(32, 64, generator=gen) * 8).round() / 4).to(torch.float8_e4m3fn), torch.tensor(1.0))
    b = QuantizedTensor(((torch.randn(48, 64, generator=gen) * 8).round() / 4).to(torch.float8_e4m3fn), torch.tensor(1.0))
    bias = (torch.randn(48, generator=gen, dtype=torch.float64) * 3).to(bias_dtype)  # off the output grid
    acc = a.dequantize().double() @ b.dequantize().double().t()  # exact
    kernel_bias = bias.to(out_dtype if out_dtype != torch.float32 else torch.float32)
    expected = (acc.float() + kernel_bias.float()).to(out_dtype)
    for path in ("emulated", "native"):
        with force_path(path):
            assert torch.equal(fp8_gemm(a, b, out_dtype, bias), expected), path


def _exact_operand(rows: int, cols: int, block, dtype, gen: torch.Generator) -> QuantizedTensor:
    # FP8 integers in [-8, 8] and power-of-two scales: every product and partial sum of a GEMM
    # with K <= 1024 is exact in float32, so any summation order gives the float64 result.
    data = torch.randint(-8, 9, (rows, cols), generator=gen).to(torch.float32).to(dtype)
    if block is None:
        scale_inv = torch.tensor(2.0**-3)
    else:
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale_inv = torch.exp2(torch.randint(-3, 4, grid, generator=gen).to(torch.float32))
    return QuantizedTensor(data, scale_inv, block)


@pytest.mark.parametrize(
    "block_a, block_b, multiples",
    [(None, None, (16, 16, 16)), ((1, 128), (128, 128), (16, 128, 128)), ((1, 128), (1, 128), (16, 128, 16)),
     ((1, 32), (1, 32), (16, 32, 16))],
    ids=["tensorwise", "blockwise-1x128-128x128", "blockwise-1x128-1x128", "mxfp8"],
)
@pytest.mark.parametrize("m, k, n", [(37, 200, 24), (16, 129, 130), (1, 33, 1), (48, 256, 256)])
def test_padding_to_the_kernel_alignment_keeps_the_product_exactly(block_a, block_b, multiples, m, k, n):
    gen = torch.Generator().manual_seed(m * k + n)
    a = _exact_operand(m, k, block_a, torch.float8_e4m3fn, gen)
    b = _exact_operand(n, k, block_b, torch.float8_e5m2, gen)
    pa, pb = gemm.pad_to_alignment(a, b, multiples)
    assert [d % mult for d, mult in zip((*pa.data.shape, pb.data.shape[0]), multiples)] == [0, 0, 0]
    assert pa.data.shape[1] == pb.data.shape[1]
    expected = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    out = pa.dequantize(torch.float64) @ pb.dequantize(torch.float64).t()
    assert torch.equal(out[:m, :n], expected)
    assert not out[m:].any() and not out[:, n:].any()
    if block_a is None:  # torch._scaled_mm takes the padded operands on CPU: the same product
        with force_path("native"):
            got = fp8_gemm(pa, pb, torch.float32)
        assert torch.equal(got[:m, :n].double(), expected)


@pytest.mark.parametrize("dtype_a, dtype_b", [(torch.float8_e5m2, torch.float8_e4m3fn),
                                              (torch.float8_e4m3fn, torch.float8_e4m3fn)], ids=["dgrad", "fprop"])
def test_fp8_gemm_in_bf16_is_within_one_bf16_rounding_of_the_float64_product(dtype_a, dtype_b):
    # FP8 values are exact in bfloat16 and their products exact in float32; the BF16 GEMM sums
    # in float32 and rounds each output once to bfloat16 (2^-8), then the float32 product of the
    # scales is applied: the bound of a float32-accumulated GEMM with a bfloat16 output cast.
    gen = torch.Generator().manual_seed(7)
    m, k, n = 33, 1024, 48
    data_a = (torch.randn(m, k, generator=gen) * 40).to(dtype_a)
    data_b = (torch.randn(n, k, generator=gen) * 40).to(dtype_b)
    scale_a, scale_b = torch.tensor(0.0123), torch.tensor(3.7e-3)  # not powers of two
    got = gemm.fp8_gemm_in_bf16(QuantizedTensor(data_a, scale_a), QuantizedTensor(data_b, scale_b))
    assert got.dtype == torch.float32 and got.shape == (m, n)
    expected = (data_a.double() * scale_a.item()) @ (data_b.double() * scale_b.item()).t()
    assert_within_bound(got, expected, scaled_gemm_error_bound(data_a, scale_a.item(), data_b, scale_b.item(),
                                                               torch.bfloat16))
    with pytest.raises(ValueError, match="per-tensor scales only"):
        gemm.fp8_gemm_in_bf16(QuantizedTensor(data_a, torch.ones(m, k // 128), (1, 128)),
                              QuantizedTensor(data_b, scale_b))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_value_is_exact_in_bf16(dtype):
    # Decoded from the bits (OCP OFP8 v1.0, 5.3): E4M3 bias 7, S.1111.111 NaN; E5M2 bias 15,
    # exponent 11111 inf / NaN; subnormals at the least exponent.
    mantissa_bits, bias = (3, 7) if dtype == torch.float8_e4m3fn else (2, 15)
    bits = torch.arange(256, dtype=torch.uint8)
    got = gemm.fp8_values_in_bf16(bits.view(dtype))
    assert got.dtype == torch.bfloat16
    for byte, value in zip(range(256), got.double().tolist()):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte & 0x7F) >> mantissa_bits, byte & ((1 << mantissa_bits) - 1)
        if dtype == torch.float8_e4m3fn and (byte & 0x7F) == 0x7F or dtype == torch.float8_e5m2 and exponent == 31:
            expected = sign * math.inf if dtype == torch.float8_e5m2 and mantissa == 0 else math.nan
        elif exponent == 0:
            expected = sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
        else:
            expected = sign * (1 + mantissa / 2**mantissa_bits) * 2.0 ** (exponent - bias)
        assert value == expected or math.isnan(value) and math.isnan(expected), (byte, value, expected)


# --- the Triton GEMM's place among the paths -------------------------------------------------------


def _layer_step_on_meta_gpu(kernel: str, monkeypatch, mode=None) -> tuple[dict, int, fp.FP8Linear, torch.Tensor]:
    # One training step of an FP8Linear on meta tensors presented as an H100, the casts' and
    # GEMM's launches counted (record_launches), torch._scaled_mm's calls counted too.
    from fp8_plugin.numerics.device_kind import meta_as_cuda
    from fp8_plugin.numerics.kernels import force_gemm_kernel, force_kernels
    from fp8_plugin.numerics.kernels.launch import record_launches

    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    with meta_as_cuda((9, 0)), force_path("native"), force_kernels("triton"), force_gemm_kernel(kernel), \
            record_launches() as launches:
        layer = fp.FP8Linear(256, 384, device="meta", dtype=torch.bfloat16)
        x = torch.empty(100, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with mode if mode is not None else contextlib.nullcontext():
            with fp.autocast():
                out = layer(x)
            out.backward(torch.empty_like(out))
    return dict(launches), len(calls), layer, x


@pytest.mark.parametrize("kernel, triton_gemms, scaled_mms", [("torch", 0, 3), ("triton", 3, 0)])
def test_the_gemm_kernel_setting_sends_a_layers_three_gemms_to_one_kernel_or_the_other(kernel, triton_gemms,
                                                                                        scaled_mms, monkeypatch):
    launches, calls, layer, x = _layer_step_on_meta_gpu(kernel, monkeypatch)
    assert launches.get("_scaled_gemm_kernel", 0) == triton_gemms and calls == scaled_mms
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.bfloat16
    assert x.grad.shape == (100, 256) and layer.weight.grad.shape == (384, 256)


def test_fnuz_operands_keep_torchs_scaled_gemm_under_the_triton_setting(monkeypatch):
    # The Triton GEMM's tl.dot reads the OCP formats only: an MI300's E4M3FNUZ / E5M2FNUZ GEMMs
    # stay torch._scaled_mm, all three of a layer's, whatever the setting says.
    from fp8_plugin.numerics.device_kind import present_rocm

    with present_rocm("gfx942"):
        launches, calls, layer, _ = _layer_step_on_meta_gpu("triton", monkeypatch)
    assert "_scaled_gemm_kernel" not in launches and calls == 3
    assert layer.weight.grad.shape == (384, 256)


def test_a_dispatch_mode_sees_torchs_scaled_gemm_whatever_the_setting(monkeypatch):
    # A mode (the memory tool, fake tensors, the contract recorder) sees aten ops only: the GEMMs
    # stay torch._scaled_mm there, as they do under torch.compile.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    launches, calls, _, _ = _layer_step_on_meta_gpu("triton", monkeypatch, Passthrough())
    assert "_scaled_gemm_kernel" not in launches and calls == 3


def test_an_unknown_gemm_kernel_is_refused_naming_the_valid_ones(monkeypatch):
    from fp8_plugin.numerics.kernels import force_gemm_kernel, gemm_kernel

    monkeypatch.setenv("FP8_PLUGIN_GEMM_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="FP8_PLUGIN_GEMM_KERNEL='cutlass' is not a GEMM kernel; valid: torch, triton"):
        gemm_kernel()
    with pytest.raises(ValueError, match="kernel='cublas'.*valid: torch, triton"):
        with force_gemm_kernel("cublas"):
            pass
    monkeypatch.setenv("FP8_PLUGIN_GEMM_KERNEL", "triton")
    assert gemm_kernel() == "triton"


def test_the_conversion_report_names_the_triton_gemm_and_a_bad_setting_stops_the_conversion(monkeypatch):
    from fp8_plugin.numerics.device_kind import meta_as_cuda

    def convert():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, device="meta"))
        with meta_as_cuda((9, 0)), force_path("native"):
            return fp.convert_model(model, recipe=fp.DelayedScaling(), device="meta", skip_small=False)

    monkeypatch.setenv("FP8_PLUGIN_GEMM_KERNEL", "triton")
    assert "tensorwise GEMMs native (the Triton GEMM: FP8_PLUGIN_GEMM_KERNEL=triton)" in convert().gemm
    monkeypatch.setenv("FP8_PLUGIN_GEMM_KERNEL", "torch")
    assert "Triton GEMM" not in convert().gemm
    monkeypatch.setenv("FP8_PLUGIN_GEMM_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="FP8_PLUGIN_GEMM_KERNEL='cutlass' is not a GEMM kernel; valid: torch, triton"):
        convert()
