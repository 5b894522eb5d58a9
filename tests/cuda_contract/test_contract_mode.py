"""How the CUDA contract suite chooses its device (``FP8_CONTRACT_DEVICE``, conftest.py).

Runs on any machine: the choice is a function of the environment and of whether torch sees a
GPU, both given here; the real-device fixture's skip for another compute capability is checked
with ``torch.cuda``'s answers stood in for. The expectations are the documented behaviour
(docs/cuda_contract.md): unset -> meta, ``cuda`` without a GPU -> a stop naming the variable and
``torch.cuda.is_available()``, anything else -> a stop naming the valid values.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_GPU_MESSAGE = "FP8_CONTRACT_DEVICE=cuda but torch.cuda.is_available() is False"


@functools.lru_cache(maxsize=None)
def _conftest():
    # The suite's conftest.py, loaded under its own name (pytest's copy is not importable by name);
    # registered before it runs, as its dataclasses look their module up.
    spec = importlib.util.spec_from_file_location("cuda_contract_conftest", HERE / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _never_asked():
    raise AssertionError("torch.cuda.is_available() asked in the meta mode")


@pytest.mark.parametrize("environ", [{}, {"FP8_CONTRACT_DEVICE": ""}, {"FP8_CONTRACT_DEVICE": "meta"},
                                     {"FP8_CONTRACT_DEVICE": " meta "}], ids=["unset", "empty", "meta", "spaces"])
def test_without_the_variable_the_suite_runs_on_meta(environ):
    assert _conftest().contract_mode(environ, _never_asked) == "meta"


def test_cuda_with_a_gpu_runs_on_the_gpu():
    assert _conftest().contract_mode({"FP8_CONTRACT_DEVICE": "cuda"}, lambda: True) == "cuda"


def test_cuda_without_a_gpu_stops_with_the_reason():
    with pytest.raises(pytest.UsageError) as err:
        _conftest().contract_mode({"FP8_CONTRACT_DEVICE": "cuda"}, lambda: False)
    assert str(err.value).startswith(NO_GPU_MESSAGE)


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:0", "cpu"])
def test_an_unknown_value_stops_naming_the_valid_ones(value):
    with pytest.raises(pytest.UsageError) as err:
        _conftest().contract_mode({"FP8_CONTRACT_DEVICE": value}, lambda: True)
    assert str(err.value) == f"FP8_CONTRACT_DEVICE={value!r} is not a contract device; valid: meta, cuda (unset: meta)"


def _request(module_devices, param):
    module = types.SimpleNamespace(__name__="test_some_contract")
    if module_devices is not None:
        module.CONTRACT_DEVICES = module_devices
    return types.SimpleNamespace(module=module, param=param)


def test_real_gpu_presents_only_its_own_capability(monkeypatch):
    conftest = _conftest()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    contract = conftest._real_gpu(_request(("meta", "cuda"), None), None)
    assert contract.device == torch.device("cuda", 0) and contract.capability == (9, 0) and contract.real
    assert contract.mode == "cuda"
    assert conftest._real_gpu(_request(("meta", "cuda"), (9, 0)), (9, 0)).capability == (9, 0)
    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest._real_gpu(_request(("meta", "cuda"), (10, 0)), (10, 0))
    assert "presents sm100, but this GPU (NVIDIA H100 80GB HBM3) is sm90" in str(skipped.value)
    # A module that builds meta tensors is not run on the GPU, where it would test nothing.
    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest._real_gpu(_request(None, (9, 0)), (9, 0))
    assert "builds its tensors on the meta device" in str(skipped.value)


def test_the_meta_mode_fixture_is_a_meta_device():
    conftest = _conftest()
    assert conftest.Contract((9, 0)).device == torch.device("meta") and not conftest.Contract((9, 0)).real
    assert conftest.Contract((9, 0)).mode == "meta"


REFUSALS = {"meta": (RuntimeError, "mat2 must be col_major"), "cuda": (ValueError, "Expected mat2 to be transposed")}


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_a_kernel_refusal_is_exactly_its_modes_type_and_words(device):
    contract = _conftest().Contract((9, 0), torch.device(device))
    kind, words = REFUSALS[device]
    with contract.kernel_refusal(REFUSALS):
        raise kind(f"{words}, and more")
    other = "meta" if device == "cuda" else "cuda"
    # The other mode's refusal, a subclass (torch's NotImplementedError is a RuntimeError), other words.
    for wrong in (REFUSALS[other][0](REFUSALS[other][1]), type("Sub", (kind,), {})(words), kind("other words")):
        with pytest.raises(AssertionError, match=device):
            with contract.kernel_refusal(REFUSALS):
                raise wrong
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        with contract.kernel_refusal(REFUSALS):
            pass
    with contract.kernel_refusal({**REFUSALS, device: None}):  # None: this mode's kernel accepts the call
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: FP8_CONTRACT_DEVICE=cuda runs there")
def test_collection_stops_when_cuda_is_asked_without_a_gpu():
    env = {**os.environ, "FP8_CONTRACT_DEVICE": "cuda", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "--collect-only", "-p", "no:cacheprovider", "--confcutdir", str(HERE),
         str(HERE / "test_cuda_contract.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert NO_GPU_MESSAGE in output, output
    assert "test_fp8_linear_forward_and_backward_run_the_native_kernels" not in output  # nothing collected
