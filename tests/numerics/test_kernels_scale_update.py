"""The fused delayed-scaling update (fp8_plugin/numerics/kernels/scale_update.py) under Triton's
interpreter, against the torch ops of ``update_delayed_scaling`` bit for bit: every state tensor
(amax history, scale, initialized, outlier counters) after updates with and without an amax
reduction, each outlier policy and amax algorithm, mixed history lengths, and rows whose amax
is an outlier, zero, or the float32 extremes."""

import copy
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU)",
                allow_module_level=True)

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.numerics.kernels import force_kernels, scale_update  # noqa: E402
from fp8_plugin.numerics.quantizers import ScalingState, update_delayed_scaling  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value", "ignore:overflow")


def states(lengths=(6, 6, 6, 6, 6)) -> list[ScalingState]:
    """Initialized states whose current amaxes cover: ordinary, an outlier (50x the amax the
    scale came from), zero, the float32 max and a subnormal; one state never initialized."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, length in enumerate(lengths):
        s = ScalingState(length)
        s.amax_history.uniform_(0.5, 10, generator=gen)
        s.scale.uniform_(0.5, 40, generator=gen)
        s.initialized[:] = i != 4
        bound = 448.0 / s.scale[0].item() / 2  # margin 1
        s.amax_history[:, 0] = torch.tensor([[bound, 3.0, 0.0], [50 * bound, 3.4e38, 1e-40], [bound * 0.5, 0.0, 7.0],
                                             [2 * bound, 1.0, 1.0], [1.0, 2.0, 3.0]][i])
        out.append(s)
    return out


def same_state(a: list[ScalingState], b: list[ScalingState]) -> None:
    for i, (sa, sb) in enumerate(zip(a, b)):
        for name, t in sa.tensors().items():
            assert torch.equal(t, sb.tensors()[name]), (i, name, t, sb.tensors()[name])


@pytest.mark.parametrize("policy", ["clip", "keep", "skip"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("reduced", [False, True], ids=["one-process", "amax-reduction"])
def test_the_fused_update_equals_the_torch_ops_bit_for_bit(policy, algo, reduced):
    recipe = fp.DelayedScaling(fp8_format="HYBRID", amax_history_len=6, margin=1, amax_outlier_policy=policy,
                               amax_compute_algo=algo, amax_outlier_factor=4.0)
    fused, plain = states(), None
    plain = copy.deepcopy(fused)
    reduce = (lambda t: t.mul_(1.5)) if reduced else None  # a stand-in all-reduce: any in-place change
    for _ in range(3):  # the later updates run on rolled histories and updated scales
        with force_kernels("triton"):
            update_delayed_scaling([(recipe, r, fused) for r in range(3)], reduce, {})
        with force_kernels("torch"):
            update_delayed_scaling([(recipe, r, plain) for r in range(3)], reduce)
        same_state(fused, plain)
    assert sum(int(s.outlier_count.sum()) for s in fused) >= 1  # the 50x row was an outlier


def test_mixed_history_lengths_update_in_one_call():
    recipe = fp.DelayedScaling(amax_history_len=6)
    fused = states((1, 6, 16, 1024, 3))
    plain = copy.deepcopy(fused)
    with force_kernels("triton"):
        update_delayed_scaling([(recipe, 0, fused), (recipe, 2, fused)], None, {})
    with force_kernels("torch"):
        for s in plain:  # the torch ops stack one group's histories: one state at a time
            update_delayed_scaling([(recipe, 0, [s]), (recipe, 2, [s])])
    same_state(fused, plain)


def test_the_device_tables_are_built_once_per_layout(monkeypatch):
    recipe = fp.DelayedScaling(amax_history_len=6)
    group = states()
    built = []
    real = scale_update.build_table
    monkeypatch.setattr(scale_update, "build_table", lambda rows, device: built.append(len(rows)) or real(rows, device))
    tables = {}
    with force_kernels("triton"):
        for _ in range(3):
            update_delayed_scaling([(recipe, r, group) for r in range(3)], None, tables)
        assert built == [15]  # steady state: no host-to-device copy after the first
        group[2].load_state_dict(copy.deepcopy(group[3].state_dict()))  # new tensors: a new layout
        update_delayed_scaling([(recipe, r, group) for r in range(3)], None, tables)
        assert built == [15, 15]
        update_delayed_scaling([(recipe, 0, group)], None, tables)  # another pending set
        assert built == [15, 15, 5]
        group[0].resize_history(8)  # a longer history: new tensors, a new layout
        update_delayed_scaling([(recipe, 0, group)], None, tables)
        assert built == [15, 15, 5, 5] and group[0].amax_history.shape == (3, 8)
        same = fp.DelayedScaling(amax_history_len=6)  # an equal recipe object: the same table serves
        update_delayed_scaling([(same, 0, group)], None, tables)
        assert built == [15, 15, 5, 5]
        other = fp.DelayedScaling(amax_history_len=6, margin=1)  # another recipe: a table of its own
        update_delayed_scaling([(other, 0, group)], None, tables)
        assert built == [15, 15, 5, 5, 5]


def test_a_callable_amax_algorithm_keeps_the_torch_ops(monkeypatch):
    recipe = fp.DelayedScaling(amax_history_len=6, amax_compute_algo=lambda h: h.amax(dim=0))
    monkeypatch.setattr(scale_update, "bulk_update", lambda *a, **k: pytest.fail("the kernel ran"))
    group = states()
    with force_kernels("triton"):
        update_delayed_scaling([(recipe, 0, group)], None, {})
    assert not group[0].amax_history[0, 0]  # updated (rolled) by the torch ops


def test_the_kernels_know_grad_outputs_row_of_the_scaling_state():
    from fp8_plugin.numerics.quantizers import GRAD_OUTPUT

    assert scale_update.GRAD_OUTPUT_ROLE == GRAD_OUTPUT
