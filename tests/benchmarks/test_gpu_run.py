"""The first GPU run's command, rehearsed on this CPU (benchmarks/gpu_run.sh, benchmarks/gpu_probe.py).

A GPU slot is short and rare: the command must run to its end the first time. These tests run
the same script with ``--device cpu`` (the probe on CPU, the contract suite on meta tensors, the
layer and model benchmarks at CPU sizes), its budget running out, and the probe surviving a
variant that kills its process or hangs. The whole rehearsal, every contract test and every
compiled layer included, is ``benchmarks/gpu_run.sh --device cpu`` (77 s on a 2-core AMD EPYC);
here the contract suite is narrowed to one file, the layer shapes to one, the compiled variants
to BF16's (the FP8 layer's compilation is tests/modules/test_compile.py's) and the model table to its
fp8-hybrid eager run, in a process of its own as on a GPU (tests/benchmarks/test_model_table.py runs the
rest of it in one process).
"""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_run.sh"
PROBE = ROOT / "benchmarks" / "gpu_probe.py"
STEPS = ("device", "contract", "models", "memory", "compiled", "host", "layer", "model", "probe")


def run_script(tmp_path, *args, **env):
    # Without the interpreter the root conftest.py turns on: as a user runs it (the probe's cast
    # kernel lines then say they need it; tests/numerics/test_kernels_tensorwise.py checks the kernels).
    environ = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)


def test_the_whole_command_runs_on_cpu_into_one_archive(tmp_path):
    proc = run_script(tmp_path, "--device", "cpu", CONTRACT_TESTS="tests/cuda_contract/test_block_pairings.py",
                      LAYER_SHAPES="64x64x64", COMPILE_VARIANTS="bf16", MODEL_RUNS="fp8-hybrid:eager",
                      HOST_RECIPES="delayed")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.tar.gz", "summary.txt"]  # 8 files come back at most
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary[:-1]] == list(STEPS)
    assert all(": passed in " in line for line in summary[:-1]), summary
    assert summary[-1].startswith("total: ") and "0 step(s) not passed" in summary[-1]
    with tarfile.open(out / "gpu_run.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
        read = lambda name: archive.extractfile(f"./{name}").read().decode()  # noqa: E731
        assert {"device.txt", "probe.txt", "contract.txt", "host.md", "host.json", "layer.md", "model.md",
                "models.json", "models.md", "memory.json", "compiled.md", "summary.txt"} <= names
        device, probe, layer = read("device.txt"), read("probe.txt"), read("compiled.md")
        contract, models, host = read("contract.txt"), read("models.md"), read("host.md")
        host_figures = {r["recipe"]: r for r in json.loads(read("host.json"))["recipes"]}
    assert "torch " in device and "cuda available: False" in device and "commit: " in device
    assert 'recipe "auto"' in device and "per-tensor FP8 casts: torch ops" in device
    lines = probe.splitlines()
    assert lines[-1].startswith(f"{len(lines) - 1} variants on cpu") and "FAIL" not in lines[-1]
    assert any(line.startswith("PASS     tensorwise E5M2 x E4M3 -> bfloat16 +bias") for line in lines)
    assert "passed" in contract.splitlines()[-1]
    assert "compiled" in layer and "bf16" in layer and "64" in layer
    assert "| tiny | eager | fp8-hybrid |" in models and "28/29 layers FP8" in models
    assert "| delayed |" in host and "_delayed_kernel" in host  # the host profile, launches recorded on meta
    # Beside each per-tensor recipe's step, its floor: its casts and GEMMs in a bare autograd.Function,
    # against nn.Linear's per-layer figure. (Which of floor and step is faster is a timing that a
    # loaded 2-core machine, the suite's other worker running beside, has reversed: not checked.)
    delayed = host_figures["delayed"]
    assert delayed["floor_us"] > 0 and delayed["floor_ratio"] == pytest.approx(
        delayed["floor_us"] / delayed["per_layer_bf16_us"])
    # And a chain of 32 layers as a model runs them, per layer, FP8 and nn.Linear.
    assert delayed["chain_layers"] == 32 and delayed["chain_fp8_us_per_layer"] > 0 < delayed["chain_bf16_us_per_layer"]


def test_a_spent_budget_skips_the_remaining_steps_and_still_writes_the_archive(tmp_path):
    proc = run_script(tmp_path, "--device", "cpu", BUDGET_S="4")
    assert proc.returncode == 1
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[:-1] == [f"{name}: not run (budget of 4 s spent)" for name in STEPS]
    assert f"{len(STEPS)} step(s) not passed" in summary[-1]
    assert (tmp_path / "out" / "gpu_run.tar.gz").stat().st_size > 0


def test_a_bad_device_is_refused_naming_the_valid_ones(tmp_path):
    proc = run_script(tmp_path, "--device", "gpu")
    assert proc.returncode == 2 and "--device gpu is not a device; valid: cuda, cpu" in proc.stderr


def probe(*args, timeout=120):
    return subprocess.run([sys.executable, str(PROBE), "--device", "cpu", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_variants_that_kill_or_hang_their_process_cost_one_line_each():
    abort, hang = "tensorwise E5M2 x E4M3 -> float16 +bias", "tensorwise E4M3 x E5M2 -> float32 64x128x96"
    proc = probe("--only", "tensorwise", "--timeout", "3", "--crash-in", f"{abort},hang:{hang}")
    assert proc.returncode == 1, proc.stdout[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 + 2 * 2 * 3 * 2 + 1 + 1  # decision tensorwise, 24 GEMMs, the padded GEMM, the count
    crashed = [line for line in lines if line.startswith("CRASH")]
    assert len(crashed) == 2
    assert hang in crashed[0] and "hung past 3.0 s" in crashed[0]  # the hang comes first in the order
    assert abort in crashed[1] and "exit status -6" in crashed[1]  # SIGABRT
    # Every other variant ran in a fresh process and passed, as without the faults.
    others = [line for line in lines[:-1] if not line.startswith("CRASH")]
    assert len(others) == len(lines) - 3 and all(line.startswith(("PASS", "INFO")) for line in others), others
    assert lines[-1].endswith("2 CRASH, 1 INFO, 23 PASS")


def test_on_hopper_the_blockwise_gemms_are_checked_and_only_mxfp8_is_skipped(monkeypatch):
    # Each variant must keep its own kind's verdict: a closure over the loop's last kind skipped
    # the blockwise GEMMs on the first H100 run with MXFP8's reason.
    monkeypatch.syspath_prepend(str(PROBE.parent))
    import gpu_probe

    from fp8_plugin.numerics.device_kind import meta_as_cuda

    def refuse(fn):
        raise gpu_probe.Refused("ran")

    monkeypatch.setattr(gpu_probe, "run_kernel", refuse)
    with meta_as_cuda((9, 0)):
        listed = list(gpu_probe.variants(torch.device("meta")))  # all first, as the probe's child runs them
        verdicts = {name: run() for name, run in listed if name.startswith(("blockwise", "mxfp8"))}
    assert len(verdicts) == 2 * 3 * 3 + 3 * 3
    for name, words in verdicts.items():
        expected = "REFUSED: ran" if name.startswith("blockwise") else "SKIP mxfp8 kernels are for sm10x"
        assert words.startswith(expected), (name, words)


def test_a_device_side_assertion_is_named_once_not_per_thread(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBE.parent))
    import gpu_probe

    printed = [f"/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:111: operator(): block: [0,0,0], thread: [{t},0,0] "
               "Assertion `-sizes[i] <= index && index < sizes[i] && \"index out of bounds\"` failed.\n" for t in range(40)]
    words = gpu_probe._assertions(printed + ["Traceback (most recent call last):"])
    assert words == ("; device-side: /pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:111: operator(): Assertion "
                     "`-sizes[i] <= index && index < sizes[i] && \"index out of bounds\"` failed.")
    assert gpu_probe._assertions(["RuntimeError: no assertion here"]) == ""


def test_each_grouped_variant_gets_the_offsets_of_its_own_groups(monkeypatch):
    # A closure over the loop's last offsets handed the groups [5, 0, 37, 16] (58 rows) the
    # ends of [16, 32, 0, 16] (64): a device-side assertion on the H200 run, not a kernel fault.
    monkeypatch.syspath_prepend(str(PROBE.parent))
    import gpu_probe

    from fp8_plugin.numerics import grouped_gemm

    seen = {}

    def record(a, sa, b, sb, offsets, out_dtype):
        seen.setdefault(current, []).append(offsets.tolist())
        raise gpu_probe.Refused("recorded")

    monkeypatch.setattr(grouped_gemm, "_emulated", record)
    monkeypatch.setattr(grouped_gemm, "_emulated_wgrad", record)
    listed = [(name, run) for name, run in gpu_probe.variants(torch.device("cpu")) if name.startswith("grouped")]
    assert len(listed) == 6
    for current, run in listed:
        with pytest.raises(gpu_probe.Refused):
            run()
        counts = [int(c) for c in current.split("groups [")[1].split("]")[0].split(", ")]
        ends = [sum(counts[:i + 1]) for i in range(len(counts))]  # hand-computed cumulative ends
        assert seen[current] == [ends], current
