"""The fused casts launched through the compiled kernels' own launchers (numerics/kernels/launch.py).

On a GPU (``FP8_CONTRACT_DEVICE=cuda``, the GPU run's contract step) a cast's first launch of a
key compiles through ``kernel[grid]`` and the later ones take the kept launcher: every one must
write the torch reference's bytes. On meta tensors, with launches recorded, the same calls make
the same launches.
"""

import pytest
import torch

from fp8_plugin.numerics.kernels import ops, tensorwise
from fp8_plugin.numerics.kernels.launch import record_launches
from fp8_plugin.numerics.quantizers import ScalingState

CONTRACT_DEVICES = ("meta", "cuda")
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_every_launch_of_a_cast_writes_the_torch_references_bytes(cuda, kind):
    state = ScalingState(4, device=cuda.device)
    x = torch.empty(200, 136, device=cuda.device, dtype=torch.bfloat16)
    if not cuda.real:
        with record_launches() as launches:
            for _ in range(3):
                data, data_t, scale_inv, _ = ops.eager_cast(kind, x, state, 0, E4M3, 0, True, False, False)
        first, cast = ("_amax_unless_initialized_kernel", "_delayed_kernel") if kind == "delayed" else (
            "_amax_kernel", "_current_kernel")
        assert launches == {first: 3, cast: 3}  # nothing recorded: the state is never known initialized
        assert data.shape == (200, 136) and data_t.shape == (136, 200) and data.dtype == E4M3
        return
    x.normal_().mul_(7)
    if kind == "delayed":  # a stored scale, as after a scale update
        state.scale[0], state.initialized[0] = 3.5, True
    _, launcher = tensorwise._recording_cast(kind, E4M3, True, False, False, False)
    for call in range(3):
        data, data_t, scale_inv, _ = ops.eager_cast(kind, x, state, 0, E4M3, 0, True, False, False)
        if kind == "delayed":
            want, want_t, _, want_inv, _ = tensorwise.reference_delayed(x, state.scale[0], state.initialized[0], E4M3,
                                                                        0, True)
        else:
            want, want_t, _, want_inv, _ = tensorwise.reference_current(x, E4M3, 0, True)
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), call
        assert torch.equal(data_t.view(torch.uint8), want_t.view(torch.uint8)), call
        assert torch.equal(scale_inv, want_inv), call
    assert launcher._runners, "no launcher was kept: every launch went through kernel[grid]"
