import os

# Tiny models: one thread is faster than two fighting, and nothing may touch the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """No ACCELERATE_* variables and fresh Accelerate singletons (Accelerate keeps its state
    process-wide; its own tests reset it the same way)."""
    from accelerate.state import AcceleratorState, GradientState

    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):
            monkeypatch.delenv(key)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory):
    """The float32 SmolLM2-135M-Instruct folder the examples use: the one the README's commands
    leave in the cache, or the packaged GGUF file converted once for the whole session (about
    15 s on 2 cores), shared by the causal-LM and MoE example tests."""
    from fp8_plugin.tools.data import convert_gguf_checkpoint, smollm2_gguf_path

    cached = os.path.expanduser("~/.cache/fp8-plugin/smollm2-135m-instruct")
    if os.path.isfile(os.path.join(cached, "config.json")):
        return cached
    path = tmp_path_factory.mktemp("smollm2")
    convert_gguf_checkpoint(smollm2_gguf_path(), path)
    return path
