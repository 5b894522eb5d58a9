"""The device report (``python -m fp8_plugin``, ``describe_device``) and the CPU GEMM path it names.

The path of a tensorwise operand pairing on CPU must not change between runs on one machine,
the report must name the path training takes, and its "native" column must agree with every
pairing. Timings are scripted through the probe's one clock (``gemm._time_gemm``), so nothing
here depends on this machine's speed; a kernel that computes otherwise than the emulation
(oneDNN's order, on AMX CPUs) is stood in for by ``reference.accumulator_scaled_mm``.
"""

import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import fp8_plugin as fp
from fp8_plugin.numerics import gemm
from fp8_plugin.numerics.device import _CPU_PAIRINGS, recipe_gemm_kind
from fp8_plugin.numerics.gemm import NATIVE_SPEEDUP_REQUIRED, tensorwise_choice
from fp8_plugin.numerics.quantizers import QuantizedTensor
from fp8_plugin.tools.cli import app
from reference import accumulator_scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU = torch.device("cpu")
NAMES = {E4M3: "E4M3", E5M2: "E5M2", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _operands(dtype_a, dtype_b, out_dtype) -> str:
    return f"{NAMES[dtype_a]} x {NAMES[dtype_b]} -> {NAMES[out_dtype]}"


@pytest.fixture
def fresh_decisions():
    # The choice is cached per process (a new process decides afresh): clearing the cache is
    # what a new run does.
    tensorwise_choice.cache_clear()
    yield
    tensorwise_choice.cache_clear()


class ScriptedClock:
    """Seconds per GEMM for the probe, by path and operand pairing, instead of a clock.

    ``speedup(pairing)`` is emulated_s / native_s; each call's time is jittered by a factor from
    ``jitter`` (cycled), as a loaded machine's timings are. Records every call.
    """

    def __init__(self, speedup, jitter=(1.0,)):
        self.speedup, self.jitter, self.calls = speedup, jitter, []

    def __call__(self, path, a, b, out_dtype):
        pairing = (a.data.dtype, b.data.dtype, out_dtype)
        self.calls.append((path, pairing))
        factor = self.jitter[len(self.calls) % len(self.jitter)]
        emulated_s = 1e-3
        return factor * (emulated_s / self.speedup(pairing) if path == "native" else emulated_s)


# Timings that straddle the threshold call by call: best-of or mean of a few calls lands on
# either side of NATIVE_SPEEDUP_REQUIRED from one run to the next.
NEAR_THRESHOLD = ScriptedClock(lambda pairing: NATIVE_SPEEDUP_REQUIRED, jitter=(0.9, 1.1, 0.95, 1.05, 1.0))


@pytest.mark.parametrize("dtype_a, dtype_b, out_dtype", [p[:3] for p in _CPU_PAIRINGS],
                         ids=[_operands(*p[:3]) for p in _CPU_PAIRINGS])
def test_same_computation_is_decided_without_the_clock(monkeypatch, fresh_decisions, dtype_a, dtype_b, out_dtype):
    # Where torch computes _scaled_mm itself (no AMX, or oneDNN disabled, as here on any CPU:
    # torch's dispatch, aten/src/ATen/native/Blas.cpp) the two paths are one computation: the
    # decision must not read the clock at all, so near-threshold timings cannot flip it.
    clock = ScriptedClock(NEAR_THRESHOLD.speedup, NEAR_THRESHOLD.jitter)
    monkeypatch.setattr(gemm, "_time_gemm", clock)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    decisions = []
    for _ in range(5):  # five runs
        tensorwise_choice.cache_clear()
        choice = tensorwise_choice(CPU, dtype_a, dtype_b, out_dtype)
        decisions.append((choice.native, choice.same_computation))
    assert decisions == [(False, True)] * 5
    assert clock.calls == []
    assert "not timed" in choice.describe() and " ms" not in choice.describe()


def test_the_emulation_gives_the_bits_of_torchs_own_kernel_for_every_pairing(monkeypatch):
    # The premise of the rule above, on shapes other than the check's (narrow outputs, odd K,
    # a bias): torch's own _scaled_mm (oneDNN disabled) and the emulation agree bit for bit.
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    gen = torch.Generator().manual_seed(3)
    for dtype_a, dtype_b, out_dtype, _ in _CPU_PAIRINGS:
        for m, k, n in [(37, 200, 24), (16, 64, 3), (64, 384, 256)]:
            a = QuantizedTensor((torch.randn(m, k, generator=gen) * 30).to(dtype_a), torch.tensor(0.0371))
            b = QuantizedTensor((torch.randn(n, k, generator=gen) * 30).to(dtype_b), torch.tensor(0.00913))
            bias = torch.randn(n, generator=gen)
            for with_bias in (None, bias):
                native = gemm._scaled_mm_tensorwise(a, b, out_dtype, with_bias)
                assert torch.equal(native, gemm._emulated(a, b, out_dtype, with_bias)), (m, k, n, out_dtype)


def test_a_kernel_that_computes_otherwise_is_timed(monkeypatch, fresh_decisions):
    # oneDNN's order of operations gives other bits: only then is the clock read, and the
    # kernel is used where it is at least NATIVE_SPEEDUP_REQUIRED times faster.
    monkeypatch.setattr(gemm, "_scaled_mm_tensorwise", accumulator_scaled_mm)
    for speedup, native in [(3.0, True), (NATIVE_SPEEDUP_REQUIRED, True), (1.1, False), (1 / 600, False)]:
        clock = ScriptedClock(lambda pairing: speedup)
        monkeypatch.setattr(gemm, "_time_gemm", clock)
        tensorwise_choice.cache_clear()
        choice = tensorwise_choice(CPU, E5M2, E4M3, torch.bfloat16)
        assert (choice.native, choice.same_computation) == (native, False), speedup
        assert clock.calls and " ms" in choice.describe()


# Which pairings run natively in the "mixed" scenario (a kernel that computes otherwise, timed
# 3x faster than the emulation for these pairings and 3x slower for the others).
def _mixed_native(pairing) -> bool:
    dtype_a, _, out_dtype = pairing
    return dtype_a == E5M2 or out_dtype == torch.bfloat16


SCENARIOS = {
    "this-cpu": None,
    "all-native": lambda pairing: True,
    "mixed": _mixed_native,
    "none-native": lambda pairing: False,
}


def _scenario(monkeypatch, name):
    native = SCENARIOS[name]
    if native is not None:
        monkeypatch.setattr(gemm, "_scaled_mm_tensorwise", accumulator_scaled_mm)
        monkeypatch.setattr(gemm, "_time_gemm", ScriptedClock(lambda pairing: 3.0 if native(pairing) else 1 / 3))
    tensorwise_choice.cache_clear()
    return fp.describe_device("cpu")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_native_column_agrees_with_every_pairing(monkeypatch, fresh_decisions, scenario):
    report = _scenario(monkeypatch, scenario)
    expected = SCENARIOS[scenario]
    # One row per operand pairing of the training step, each the path fp8_gemm's own choice gives.
    assert [p.operands for p in report.pairings] == [_operands(*p[:3]) for p in _CPU_PAIRINGS]
    for pairing, (dtype_a, dtype_b, out_dtype, _) in zip(report.pairings, _CPU_PAIRINGS):
        if expected is not None:
            assert pairing.native == expected((dtype_a, dtype_b, out_dtype)), pairing
        assert pairing.native == gemm._tensorwise_native(CPU, dtype_a, dtype_b, out_dtype)
    native = {p.operands for p in report.pairings if p.native}
    text = str(report)
    for row in report.recipes[:2]:  # the tensorwise recipes
        assert row.gemm == "tensorwise"
        assert row.native == (len(native) == len(report.pairings))  # "yes" only if every pairing is native
        cell = row.column()
        assert cell in text
        if row.native:
            assert cell == "yes"
        elif native:  # some: "partly", naming exactly those
            assert set(row.native_pairings) == native and cell.startswith("partly: torch._scaled_mm for ")
            named = cell.removeprefix("partly: torch._scaled_mm for ").split("; ")[0].split(", ")
            assert set(named) == native
        else:
            assert cell.startswith("no: ") and row.native_pairings == []
    assert {"all-native": "yes", "none-native": "no", "mixed": "partly"}.get(scenario, "no") == \
        report.recipes[0].column().split(":")[0]


class PathLog:
    """The path of every GEMM fp8_gemm runs, through the two functions it dispatches to."""

    def __init__(self, monkeypatch):
        self.seen = []
        native, emulated = gemm._native, gemm._emulated

        def logged_native(kind, support, a, b, out_dtype, bias, fast_accum=False):
            self.seen.append((kind, a.data.dtype, b.data.dtype, out_dtype, True))
            return native(kind, support, a, b, out_dtype, bias, fast_accum)

        def logged_emulated(a, b, out_dtype, bias=None):
            self.seen.append((gemm.gemm_kind(a, b), a.data.dtype, b.data.dtype, out_dtype, False))
            return emulated(a, b, out_dtype, bias)

        monkeypatch.setattr(gemm, "_native", logged_native)
        monkeypatch.setattr(gemm, "_emulated", logged_emulated)


RECIPES = {
    "delayed-hybrid": fp.DelayedScaling(),
    "delayed-e4m3": fp.DelayedScaling(fp8_format=fp.Format.E4M3),
    "current-hybrid": fp.Float8CurrentScaling(),
    "blockwise": fp.Float8BlockScaling(),
    "mxfp8": fp.MXFP8BlockScaling(),
}


@pytest.mark.parametrize("scenario", ["this-cpu", "mixed"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_report_names_the_paths_training_takes(monkeypatch, fresh_decisions, scenario, recipe):
    report = _scenario(monkeypatch, scenario)  # decided here, as python -m fp8_plugin does
    row = next(r for r in report.recipes if r.recipe == type(RECIPES[recipe]).__name__)
    by_operands = {p.operands: p.native for p in report.pairings}
    log = PathLog(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp.FP8Linear(128, 128, recipe=RECIPES[recipe]),
                                fp.FP8Linear(128, 128, recipe=RECIPES[recipe]))
    # float32, then BF16 and FP16 autocast: the second layer's input is then in the autocast
    # dtype, so its dgrad writes that dtype.
    for dtype in (None, torch.bfloat16, torch.float16):
        x = torch.randn(16, 128, requires_grad=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None), fp.autocast():
            y = model(x)
        y.float().sum().backward()
    # Every layer ran its forward, dgrad and wgrad as FP8 GEMMs, and nothing else did.
    assert len(log.seen) == 3 * 2 * 3
    assert {kind for kind, *_ in log.seen} == {recipe_gemm_kind(RECIPES[recipe])}
    for kind, dtype_a, dtype_b, out_dtype, native in log.seen:
        if kind == "tensorwise":
            operands = _operands(dtype_a, dtype_b, out_dtype)
            assert operands in by_operands, f"training ran {operands}, which the report does not list"
            assert native == by_operands[operands], operands
        else:
            assert native == row.native
    if scenario == "mixed" and row.gemm == "tensorwise":
        assert {n for *_, n in log.seen} == {True, False}  # both paths ran, as the report said


def _without_timings(text: str) -> str:
    return re.sub(r"\d+\.\d+ ms", "_ ms", text)


def test_python_m_fp8_plugin_is_the_devices_command():
    help_run = subprocess.run([sys.executable, "-m", "fp8_plugin", "--help"], capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0, help_run.stderr
    assert "Usage: python -m fp8_plugin [OPTIONS]" in help_run.stdout and "--json" in help_run.stdout
    run = subprocess.run([sys.executable, "-m", "fp8_plugin"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # The output of `fp8-plugin devices`, whose paths this process decided for itself: two
    # processes, the same paths and the same table.
    devices = CliRunner().invoke(app, ["devices"])
    assert devices.exit_code == 0, devices.output
    assert _without_timings(run.stdout) == _without_timings(devices.stdout)
    assert run.stdout.startswith("CPU (cpu), torch ")
    paths = {}
    for line in run.stdout.splitlines():
        match = re.match(r"  (E\dM\d x E\dM\d -> \w+) \(.*?\): (torch\._scaled_mm|float32 emulation) ", line)
        if match:
            paths[match[1]] = match[2] == "torch._scaled_mm"
    assert paths == {p.operands: p.native for p in fp.describe_device("cpu").pairings}
    assert len(paths) == len(_CPU_PAIRINGS)
