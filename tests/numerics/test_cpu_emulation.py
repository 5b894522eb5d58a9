"""fp8_plugin/numerics/cpu_emulation.py and the BF16 emulation (gemm_kernels.emulated_bf16):
the choice, and every operand pairing and output dtype against float64 within its bound."""

import pytest
import torch

import fp8_plugin as fp
from fp8_plugin.numerics import cpu_emulation as emulation
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device import describe_device
from fp8_plugin.numerics.gemm import force_path, fp8_gemm
from fp8_plugin.numerics.gemm_kernels import emulated_bf16
from fp8_plugin.numerics.quantizers import QuantizedTensor
from reference import assert_within_bound, scaled_gemm_error_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def fresh_choice(monkeypatch):
    # Each test decides again; the suite's own pin (tests/conftest.py) is restored after it.
    emulation._decide.cache_clear()
    yield monkeypatch
    emulation._decide.cache_clear()


@pytest.fixture
def counted_bf16_gemms(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "_emulated_bf16", lambda *a: calls.append(1) or emulated_bf16(*a))
    return calls


def test_a_bad_setting_is_refused_with_the_setting_the_value_and_the_choices(fresh_choice):
    fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", "fp16")
    with pytest.raises(ValueError, match=r"FP8_PLUGIN_CPU_EMULATION='fp16' .*valid: auto, float32, bfloat16"):
        emulation.cpu_emulation()
    with pytest.raises(ValueError, match="FP8_PLUGIN_CPU_EMULATION"):  # at start-up: the swap asks
        fp.convert_model(torch.nn.Sequential(torch.nn.Linear(32, 32)))


@pytest.mark.parametrize("speedup, expected", [(2.1, "bfloat16"), (1.1, "float32"), (0.04, "float32")])
def test_auto_takes_bf16_gemms_only_where_measured_clearly_faster(fresh_choice, speedup, expected):
    fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", "auto")
    fresh_choice.setattr(emulation, "bf16_matmul_speedup", lambda device_type="cpu", k=384: (speedup, "timed"))
    choice = emulation.cpu_emulation()
    assert choice.dtype_name == expected and "auto: timed" in choice.why
    fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", "float32" if expected == "bfloat16" else "bfloat16")
    assert emulation.cpu_emulation().dtype_name != expected  # a pin overrides the timing


def test_the_bf16_speedup_is_timed_once_per_process_however_its_callers_spell_the_call(monkeypatch):
    # Its callers pass (device_type), (device_type, k) or keywords: one timing is two dtypes x
    # (a warm-up and 3 timed matmuls), 8 in all, and every caller gets the same figures. Keyed
    # on the spelling, the cache timed once per spelling (16 matmuls for two), a second each on
    # a CPU with slow BF16, and the callers could disagree near the threshold.
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8_plugin.numerics.device import bf16_matmul_is_fast

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
            return func(*args, **(kwargs or {}))

    emulation.bf16_matmul_speedup.cache_clear()
    try:
        with CountMatmuls() as counted:
            answers = [emulation.bf16_matmul_speedup("cpu"), emulation.bf16_matmul_speedup("cpu", 384),
                       emulation.bf16_matmul_speedup(device_type="cpu", k=384), emulation.bf16_matmul_speedup()]
            fast, why = bf16_matmul_is_fast("cpu")
    finally:
        emulation.bf16_matmul_speedup.cache_clear()  # later callers time afresh, outside this mode
    assert counted.count == 2 * (1 + 3)
    assert all(answer == answers[0] for answer in answers) and why == answers[0][1]
    assert fast == (answers[0][0] >= 0.5)


@pytest.mark.parametrize("setting", ["bfloat16", "float32"])
def test_the_process_choice_decides_which_emulation_training_gemms_run(fresh_choice, counted_bf16_gemms, setting):
    fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", setting)
    layer = fp.FP8Linear(32, 16)
    for _ in range(2):  # counted from the second step: on CPUs whose torch._scaled_mm computes
        # otherwise (AMX), the first step times it against the emulation once (tensorwise_choice)
        counted_bf16_gemms.clear()
        with fp.autocast():
            layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert len(counted_bf16_gemms) == (3 if setting == "bfloat16" else 0)
    assert ("BF16 GEMMs" if setting == "bfloat16" else "float32 GEMMs") in str(describe_device("cpu"))
    counted_bf16_gemms.clear()  # the report may have timed the pairings it lists, as the first step did
    with force_path("emulated"):  # the float32 emulation, whatever the process chose
        fp8_gemm(*_operands(E4M3, E4M3, 4, 32, 4), torch.float32)
    assert counted_bf16_gemms == []


def _operands(dtype_a, dtype_b, m, k, n, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=gen) * 40).to(dtype_a)
    b = (torch.randn(n, k, generator=gen) * 40).to(dtype_b)
    # Scales that are not powers of two, so that every rounding of the scales shows.
    return QuantizedTensor(a, torch.tensor(0.0123)), QuantizedTensor(b, torch.tensor(3.7e-3))


@pytest.mark.parametrize("dtype_a, dtype_b", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_emulation_rounds_bf16_outputs_once_and_others_once_more_within_float64_bounds(counted_bf16_gemms, dtype_a, dtype_b,
                                                                    out_dtype, with_bias):
    gen = torch.Generator().manual_seed(3)
    m, k, n = 33, 1024, 48
    a, b = _operands(dtype_a, dtype_b, m, k, n, gen)
    bias = torch.randn(n, generator=gen) * 0.5 if with_bias else None
    with force_path("emulated-bf16"):
        got = fp8_gemm(a, b, out_dtype, bias)
    assert len(counted_bf16_gemms) == 1 and got.dtype == out_dtype and got.shape == (m, n)
    kernel_bias = bias.to(out_dtype) if bias is not None and out_dtype != torch.float32 else bias
    expected = ((a.data.double() * a.scale_inv.item()) @ (b.data.double() * b.scale_inv.item()).t()
                + (kernel_bias.double() if bias is not None else 0))
    # A BF16 output is rounded once, the scales applied to the float32 sums inside the GEMM, as a
    # GPU's scaled GEMM does: the float32 emulation's bound. Other outputs round each sum to
    # bfloat16 first (torch's CPU GEMMs have no BF16-in, float32-out form).
    bound = scaled_gemm_error_bound(a.data, a.scale_inv.item(), b.data, b.scale_inv.item(), out_dtype,
                                    kernel_bias, bf16_gemm=out_dtype != torch.bfloat16)
    assert_within_bound(got, expected, bound)


def test_bf16_emulation_keeps_nan_and_inf_and_refuses_block_scales():
    a, b = _operands(E5M2, E4M3, 4, 64, 8)
    a.data.view(torch.uint8)[1, 3] = 0x7C  # E5M2 +inf
    b.data.view(torch.uint8)[2, 5] = 0x7F  # E4M3 NaN
    with force_path("emulated-bf16"):
        got = fp8_gemm(a, b, torch.float32)
    assert got[:, 2].isnan().all()  # the NaN's column of b reaches every output of its column
    assert got[1].isinf().sum() + got[1].isnan().sum() == 8  # the inf's row: inf, or NaN where 0 * inf
    blocked = QuantizedTensor(a.data, torch.ones(4, 1), (1, 128))
    with pytest.raises(ValueError, match="per-tensor scales only"):
        emulated_bf16(blocked, b, torch.float32)


@pytest.mark.parametrize("setting", ["bfloat16", "float32"])
def test_under_bf16_the_columnwise_copy_is_a_view_and_native_gemms_still_read_row_major(fresh_choice, setting):
    from fp8_plugin.numerics.quantizers import ScalingState, make_quantizer

    fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", setting)
    quantizer = make_quantizer(fp.DelayedScaling(), 0, ScalingState(16), record=False)
    x = torch.randn(24, 40)
    row, col = quantizer.quantize_pair(x, columnwise=True)
    assert torch.equal(col.data.view(torch.uint8), row.data.t().view(torch.uint8))
    assert (col.data.data_ptr() == row.data.data_ptr()) == (setting == "bfloat16")  # a view, or a copy
    assert col.data.is_contiguous() == (setting == "float32")
    from fp8_plugin.modules.frozen_weight import frozen_columnwise  # a frozen FP8 weight's dgrad operand

    frozen_t = frozen_columnwise(row, fp.DelayedScaling())
    assert torch.equal(frozen_t.data.view(torch.uint8), col.data.view(torch.uint8))
    assert (frozen_t.data.data_ptr() == row.data.data_ptr()) == (setting == "bfloat16")

    # torch._scaled_mm reads the view made row-major: the bits of the row-major copy's GEMM.
    layer = fp.FP8Linear(40, 16)
    grads = {}
    for emulation in ("float32", setting):
        fresh_choice.setenv("FP8_PLUGIN_CPU_EMULATION", emulation)
        layer.zero_grad()
        x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with force_path("native"), fp.autocast():
            y = layer(x)
        with force_path("native"):
            y.backward(torch.ones_like(y))
        grads[emulation] = (y.detach(), x.grad, layer.weight.grad.clone())
    assert all(torch.equal(a, b) for a, b in zip(grads["float32"], grads[setting]))
