"""Fixtures every test folder shares. The folders follow the package's layers (numerics, modules,
training, one per loop adapter, tools, examples, benchmarks, the private shims, the project's
own checks; the CUDA contract has its own conftest); ``support/`` holds the helpers several
folders use. Every folder is put on ``sys.path`` and on ``PYTHONPATH`` (which the worker processes
the tests launch inherit), so that helpers and workers import each other by module name wherever
they sit."""

import os
import shutil
import sys
from pathlib import Path
from typing import Callable

_FOLDERS = [str(p) for p in sorted(Path(__file__).resolve().parent.iterdir()) if p.is_dir() and p.name[0] not in "._"]
for _folder in reversed(_FOLDERS):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
os.environ["PYTHONPATH"] = os.pathsep.join(_FOLDERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# Tiny models: one thread is faster than two fighting, and nothing may touch the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# CPU FP8 GEMMs in the exact float32 emulation on every machine, whatever its BF16 speed, so that
# the suite's bounds and bit-for-bit comparisons mean the same everywhere; the BF16 emulation's
# own tests force it (numerics/cpu_emulation.py).
os.environ.setdefault("FP8_PLUGIN_CPU_EMULATION", "float32")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# The files that take longest, heaviest first (measured with --durations=0: a file's tests summed).
# pytest-xdist hands each worker one file at a time (--dist loadfile), in collection order with
# --no-loadscope-reorder (pyproject's addopts; its default puts the files with the most tests
# first, which left these few-test files to the end): started first, they no longer leave one
# worker running alone while the other has finished.
SLOWEST_FILES = (  # seconds, 2-core Intel Xeon, 2026-11-28
    "tests/benchmarks/test_gpu_run.py",  # 118
    "tests/accelerate/test_accelerate.py",  # 117
    "tests/examples/test_causal_lm_example.py",  # 110
    "tests/training/test_reference_check_cases.py",  # 101
    "tests/training/test_deepspeed.py",  # 98
    "tests/modules/test_compile.py",  # 74
    "tests/examples/test_moe_example.py",  # 59
    "tests/training/test_interruption.py",  # 53
    "tests/tools/test_quiet_output.py",  # 39
    "tests/numerics/test_kernels_tensorwise.py",  # 38
    "tests/training/test_distributed.py",  # 33, the two-rank launch the other files read
)


def pytest_collection_modifyitems(config, items):
    # A stable sort: every file's tests, and each docs page's blocks, keep their order.
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _reset_accelerate() -> None:
    # Only where Accelerate is imported already: some tests check what importing fp8_plugin imports.
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def _no_accelerate_state_between_tests():
    """Every test starts and ends without Accelerate's process-wide state: the suite's workers run
    tests of many files in one process, in an order that varies, and an Accelerator left behind
    makes the next one refuse its own settings (or ignore its dynamo plugin)."""
    _reset_accelerate()
    yield
    _reset_accelerate()


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """No ACCELERATE_* variables, and fresh Accelerate singletons (Accelerate keeps its state
    process-wide; its own tests reset it the same way; every test gets those from
    ``_no_accelerate_state_between_tests``)."""
    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):
            monkeypatch.delenv(key)
    yield


def made_once_per_run(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder ``make(folder)`` fills once per pytest run, for a session fixture that launches or
    converts something costly. Under pytest-xdist every worker process has its own session
    fixtures: the workers share the run's base folder, and a file lock lets the first worker make
    it while the others wait and then read it (pytest-xdist's documented recipe), so that two
    workers never pay for the same launch. A ``make`` that raises leaves nothing marked done: the
    next worker tries again and reports its own error."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory):
    """The float32 SmolLM2-135M-Instruct folder the examples use: the one the README's commands
    leave in the cache, or the packaged GGUF file converted once for the whole session (about
    15 s on 2 cores), shared by the causal-LM and MoE example tests."""
    from fp8_plugin.tools.data import convert_gguf_checkpoint, smollm2_gguf_path

    cached = os.path.expanduser("~/.cache/fp8-plugin/smollm2-135m-instruct")
    if os.path.isfile(os.path.join(cached, "config.json")):
        return cached
    return made_once_per_run(tmp_path_factory, "smollm2", lambda path: convert_gguf_checkpoint(smollm2_gguf_path(), path))


# The two-rank scenarios of tests/training/distributed_worker.py, all in one launch (a launch's start,
# imports and process group, is most of such a small run's time): FSDP2 after the DDP ones.
DISTRIBUTED_SCENARIOS = ("ddp", "ddp-fp8-adamw", "ddp-local", "fp16", "reference", "fabric-ddp", "statistics", "experts-ddp",
                         "fsdp2", "reference-fsdp2", "statistics-fsdp2", "experts-fsdp2", "fsdp-fp8-current",
                         "calibration", "frozen-lora-fsdp2")


@pytest.fixture(scope="session")
def distributed_runs(tmp_path_factory):
    """``distributed_runs(scenario)``: the ``.pt`` files the scenario wrote, by file stem, from
    one torchrun launch of every scenario of :data:`DISTRIBUTED_SCENARIOS` made at the first call
    (once per run, whichever worker asks first: :func:`made_once_per_run`)."""
    from test_distributed import run_worker_script

    loaded: dict[str, dict] = {}

    def get(scenario: str) -> dict:
        if not loaded:
            out = made_once_per_run(tmp_path_factory, "distributed", lambda folder: run_worker_script(
                "distributed_worker.py", [",".join(DISTRIBUTED_SCENARIOS)], folder))
            for name in DISTRIBUTED_SCENARIOS:
                loaded[name] = {p.stem: torch.load(p, weights_only=False) for p in (out / name).glob("*.pt")}
        return loaded[scenario]

    return get
