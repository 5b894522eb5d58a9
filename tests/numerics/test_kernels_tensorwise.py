"""The fused per-tensor cast kernels (fp8_plugin/numerics/kernels/) under Triton's interpreter.

Every kernel must give the bytes of the torch ops it replaces (``scaling.quantize``, ``amax``,
``scale_from_amax``), which are themselves checked against the OCP OFP8 spec elsewhere
(tests/numerics/test_scaling.py): every BF16 bit pattern (65,536), float16 and float32 samples over the
whole range, zeros, infinities, NaN, values at and beyond the saturation bound, shapes that are
not multiples of the 64 x 64 tile, and non-contiguous inputs; amaxes and scales bit for bit.
Triton's interpreter runs the kernels on CPU tensors, with numpy's IEEE float32 arithmetic.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    # The root conftest.py turns the interpreter on where no GPU is (before triton's first import).
    pytest.skip("runs the kernels under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU); "
                "on a GPU, benchmarks/gpu_probe.py checks them on the device", allow_module_level=True)
from fp8_plugin.numerics.kernels import tensorwise  # noqa: E402
from fp8_plugin.numerics.kernels.tensorwise import (  # noqa: E402
    cast_transpose, cast_transpose_current, reference_cast, reference_current)
from fp8_plugin.numerics.quantizers import ScalingState  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy on NaN and inf lanes
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_float(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 values, NaN equal to NaN (the amax of NaN data is some NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def every_bf16_pattern() -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)


def wide_samples(dtype: torch.dtype, n: int = 1 << 16) -> torch.Tensor:
    """Random magnitudes across the dtype's range (subnormals to max), both signs, and specials."""
    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    exponents = torch.randint(int(torch.log2(torch.tensor(info.tiny)).item()) - 8,
                              int(torch.log2(torch.tensor(info.max)).item()), (n,), generator=gen)
    x = (torch.rand(n, generator=gen) + 1) * torch.exp2(exponents.double()) * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
    x = x.clamp(-info.max, info.max).to(dtype)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.max, -info.max, info.tiny])
    return x.reshape(256, -1)


@FORMATS
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 3.0, 1 / 3, 2.0**120], ids=["1", "2^-7", "3", "1/3", "2^120"])
def test_every_bf16_pattern_casts_to_torchs_bytes(dtype, scale):
    x = every_bf16_pattern()
    s = torch.tensor(scale)
    amax = torch.zeros(1)
    data, data_t = cast_transpose(x, s, dtype, transpose=True, amax_out=amax)
    ref, ref_t, ref_amax = reference_cast(x, s, dtype, transpose=True)
    assert same_bits(data, ref) and same_bits(data_t, ref_t)
    assert amax.isnan().item() and ref_amax.isnan().item()  # the patterns include NaN


@FORMATS
@pytest.mark.parametrize("src", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_float16_and_float32_samples_cast_to_torchs_bytes(dtype, src):
    x = wide_samples(src)
    for scale in (1.0, 2.0**-20, 5.0):
        s = torch.tensor(scale)
        amax = torch.zeros(1)
        data, _ = cast_transpose(x, s, dtype, transpose=False, amax_out=amax)
        ref, _, ref_amax = reference_cast(x, s, dtype, transpose=False)
        assert same_bits(data, ref), scale
        assert amax.isnan().item() and ref_amax.isnan().item()
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(src)
    amax = torch.zeros(1)
    cast_transpose(finite, torch.tensor(1.0), dtype, transpose=False, amax_out=amax)
    assert torch.equal(amax.reshape(()), reference_cast(finite, torch.tensor(1.0), dtype, False)[2])


@FORMATS
def test_saturation_bound_infinities_and_nan(dtype):
    bound = 448.0 if dtype == E4M3 else 57344.0
    values = [bound, -bound, bound * 1.01, -bound * 1.01, bound * 1e3, 3e38, float("inf"), -float("inf"),
              float("nan"), -float("nan"), 0.0, -0.0, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 464.0, 465.0]
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    for scale in (1.0, 1e-30):
        data, data_t = cast_transpose(x, torch.tensor(scale), dtype, transpose=True)
        ref, ref_t, _ = reference_cast(x, torch.tensor(scale), dtype, transpose=True)
        assert same_bits(data, ref) and same_bits(data_t, ref_t), scale
    # The spec's values (OCP OFP8 rev 1.0): saturation to +-max; E4M3 has no inf (NaN 0x7F);
    # E5M2 keeps inf (0x7C).
    codes = cast_transpose(x, torch.tensor(1.0), dtype, transpose=False)[0].view(torch.uint8)[0].tolist()
    top = 0x7E if dtype == E4M3 else 0x7B
    assert codes[:6] == [top, top | 0x80, top, top | 0x80, top, top]
    assert codes[6:8] == ([0x7F, 0x7F] if dtype == E4M3 else [0x7C, 0xFC])


@FORMATS
@pytest.mark.parametrize("shape", [(1, 1), (63, 65), (130, 7), (200, 129)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_ragged_shapes_and_any_layout(dtype, shape, layout):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(shape[0] * 2, shape[1] * 2, generator=gen).to(torch.bfloat16) * 300
    x = {"contiguous": base[: shape[0], : shape[1]].contiguous(),
         "transposed": base[: shape[1], : shape[0]].t(),
         "strided": base[::2, ::2][: shape[0], : shape[1]]}[layout]
    scale = torch.tensor(0.37)
    amax = torch.zeros(1)
    data, data_t = cast_transpose(x, scale, dtype, transpose=True, amax_out=amax)
    ref, ref_t, ref_amax = reference_cast(x, scale, dtype, transpose=True)
    assert same_bits(data, ref) and same_bits(data_t, ref_t)
    assert torch.equal(amax.reshape(()), ref_amax)
    assert data.is_contiguous() and data_t.is_contiguous()


def test_the_amax_folds_into_a_running_maximum():
    x = torch.full((3, 5), 2.0)
    amax = torch.tensor([7.0])
    cast_transpose(x, torch.tensor(1.0), E4M3, transpose=False, amax_out=amax)
    assert amax.item() == 7.0
    cast_transpose(x * 4, torch.tensor(1.0), E4M3, transpose=False, amax_out=amax)
    assert amax.item() == 8.0


def state_with(role: int, slot: float, scale: float = 0.0123, initialized: bool = False) -> ScalingState:
    """A scaling state whose ``role`` row holds a current-step amax ``slot`` and a delayed scale."""
    state = ScalingState(amax_history_len=4)
    state.amax_history[role, 0] = slot
    state.amax_history[role, 1] = 5.0
    state.scale[role] = scale
    state.initialized[role] = initialized
    return state


def recorded(state: ScalingState, role: int, amax: torch.Tensor, current: bool) -> dict[str, torch.Tensor]:
    """The state after a recording cast of ``role``, as ScalingState.record_amax (delayed) or
    observe_current (current) define it, computed here in float64 from the amax: a finite amax
    enters the slot (delayed: the larger of the two), a non-finite one is counted."""
    want = {name: t.clone() for name, t in state.tensors().items()}
    if bool(torch.isfinite(amax)):
        slot = want["amax_history"][role, 0].double()
        want["amax_history"][role, 0] = amax.double() if current else torch.maximum(slot, amax.double())
    else:
        want["nonfinite_amax_count"][role] += 1
    return want


CASES = ["bf16-patterns", "normal", "zeros", "tiny", "huge", "inf", "nan", "empty"]


def case_input(case: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    x = {"bf16-patterns": every_bf16_pattern()[:, :200],
         "normal": torch.randn(70, 90, generator=gen).to(torch.bfloat16) * 5,
         "zeros": torch.zeros(9, 17),
         "tiny": torch.full((4, 4), 1e-40),          # a float32 subnormal amax: the scale clamps to the max
         "huge": torch.full((4, 4), 3e38),
         "inf": torch.tensor([[1.0, float("inf")], [2.0, 3.0]]),
         "nan": torch.tensor([[1.0, float("nan")], [2.0, 3.0]]),
         "empty": torch.zeros(0, 16)}[case]
    if case == "bf16-patterns":
        x = torch.nan_to_num(x.float(), nan=1.0).to(torch.bfloat16)  # NaN-free: "nan" has its own case
    return x


@FORMATS
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("case", CASES)
def test_current_scaling_cast_and_recorded_state_bit_for_bit(dtype, margin, case):
    x = case_input(case)
    role = 2 if dtype == E5M2 else 0
    state = state_with(role, slot=7.0)
    ref, ref_t, ref_scale, ref_scale_inv, ref_amax = reference_current(x, dtype, margin, transpose=True)
    want = recorded(state, role, ref_amax, current=True)
    want["scale"][role] = ref_scale  # the scale the cast used, whatever the amax (1 where it is not finite)
    data, data_t, scale, scale_inv = cast_transpose_current(x, dtype, margin, transpose=True, record=True, role=role,
                                                            **kernel_state(state))
    assert torch.equal(scale, ref_scale) and torch.equal(scale_inv, ref_scale_inv), (scale, ref_scale)
    assert same_bits(data, ref) and same_bits(data_t, ref_t)
    for name, t in state.tensors().items():
        assert same_float(t, want[name]), name
    assert not state.kernel_workspace.any()  # zeroed for the next cast


def kernel_state(state: ScalingState, initialized: bool = False) -> dict[str, torch.Tensor]:
    names = ["scale", "amax_history", "nonfinite_amax_count"] + (["initialized"] if initialized else [])
    return {**{n: getattr(state, n) for n in names}, "workspace": state.kernel_workspace}


def test_a_nan_makes_the_current_scale_one_as_the_torch_ops_do():
    x = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    state = ScalingState(4)
    _, _, scale, scale_inv = cast_transpose_current(x, E4M3, 0, transpose=False, record=True, role=0,
                                                    **kernel_state(state))
    assert scale.item() == 1.0 and scale_inv.item() == 1.0
    assert state.nonfinite_amax_count.tolist() == [1, 0, 0] and state.amax_history[0, 0].item() == 0.0


@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_a_cast_that_does_not_record_leaves_the_state_and_zeroes_the_workspace(current):
    x = torch.randn(100, 70)
    state = state_with(1, slot=0.5, initialized=True)
    before = {name: t.clone() for name, t in state.tensors().items()}
    cast = cast_transpose_current if current else tensorwise.cast_transpose_delayed
    for _ in range(2):  # the second cast starts from the workspace the first left
        cast(x, E4M3, 0, transpose=True, record=False, role=1, **kernel_state(state, initialized=not current))
    for name, t in state.tensors().items():
        assert torch.equal(t, before[name]), name
    assert not state.kernel_workspace.any()


def test_a_workspace_of_another_shape_is_refused():
    state = ScalingState(4)
    with pytest.raises(ValueError, match=r"workspace must be int32 \[3, 2\] zeros"):
        cast_transpose_current(torch.ones(2, 2), E4M3, 0, transpose=False, record=True, role=0,
                               **{**kernel_state(state), "workspace": torch.zeros(3, dtype=torch.int32)})


def test_bad_input_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        cast_transpose(torch.zeros(4), torch.tensor(1.0), E4M3, transpose=False)
    with pytest.raises(ValueError, match=r"x.dtype=torch.float64 has no fused cast; valid: float32, bfloat16, float16"):
        cast_transpose(torch.zeros(2, 2, dtype=torch.float64), torch.tensor(1.0), E4M3, transpose=False)
    with pytest.raises(ValueError, match=r"not an FP8 dtype"):
        cast_transpose(torch.zeros(2, 2), torch.tensor(1.0), torch.bfloat16, transpose=False)


def test_each_ops_launch_count_is_what_it_launches(monkeypatch):
    """The launch counts the cost model and the CUDA contract suite read (ops.OP_LAUNCHES),
    against the launches each eager entry point makes: Triton kernels run, and fills of new
    tensors (torch.zeros)."""
    from triton.runtime.interpreter import InterpretedFunction

    import fp8_plugin as fp
    from fp8_plugin.numerics.kernels import ops, scale_update

    launched = []
    real_run, real_zeros = InterpretedFunction.run, torch.zeros
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(1) or real_run(self, *a, **k))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: launched.append(1) or real_zeros(*a, **k))

    def launches(call) -> int:
        launched.clear()
        call()
        return len(launched)

    states = [ScalingState(4) for _ in range(3)]
    x = torch.randn(70, 130)
    group_of_row = torch.tensor([0] * 30 + [2] * 40)
    recipe = fp.DelayedScaling(amax_history_len=4)
    table = scale_update.build_table([(recipe, 0, s) for s in states], x.device)
    counted = {
        "cast_delayed": launches(lambda: ops.cast_delayed(x, states[0], 0, E4M3, 0, transpose=True, record=True)),
        "cast_current": launches(lambda: ops.cast_current(x, states[0], 0, E4M3, 0, transpose=True, record=True)),
        "cast_blocks": launches(lambda: ops.cast_blocks(x, states[0], 0, E4M3, (1, 32), mx=True, power_2_scale=False,
                                                        amax_epsilon=0.0, transpose=True, record=True)),
        "cast_groups": launches(lambda: ops.cast_groups(x, group_of_row, states, 0, recipe, E4M3, record=True)),
        "scale_update_gather": launches(lambda: scale_update._gather(table[0], torch.empty(3))),
        "scale_update": launches(lambda: scale_update._update(table[0], table[1], torch.empty(3), False, 4)),
    }
    assert counted == ops.OP_LAUNCHES


# ---------------------------------------------------------------------------------------------
# FP8Linear through the kernels (force_kernels("triton")) against FP8Linear through the torch
# ops: training steps bit for bit, outputs, gradients and scaling state.

import copy  # noqa: E402
from unittest import mock  # noqa: E402

import fp8_plugin as fp  # noqa: E402
from fp8_plugin.numerics.kernels import force_kernels, fused_casts  # noqa: E402


def train(layer, path, steps, autocast_dtype, recipe):
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    record = []
    for _ in range(steps):
        x = (torch.randn(3, 40, 96, generator=gen) * 4).requires_grad_()
        with force_kernels(path):
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                with fp.autocast(recipe=recipe):
                    y = layer(x)
                y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            fp.update_pending_scales(layer)  # delayed scaling: the fused scale update
        record.append((y.detach(), x.grad))
    return record


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(fp8_format="HYBRID", amax_history_len=4),
                                    fp.Float8CurrentScaling(fp8_format="HYBRID")], ids=["delayed", "current"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_fp8_linear_trains_bit_for_bit_through_the_kernels(recipe, autocast_dtype, transposed):
    # No bias: the fused bias gradient sums in another order than torch's (its own test below).
    torch.manual_seed(0)
    layer = fp.FP8Linear(96, 80, bias=False)
    if transposed:  # a converted GPT-2 Conv1D keeps its weight [in, out]: the weight cast reads a transposed view
        layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous())
        layer.weight_transposed = True
    twin = copy.deepcopy(layer)
    casts, cast = [], tensorwise.RecordingCast.__call__
    with mock.patch.object(tensorwise.RecordingCast, "__call__",
                           lambda plan, *args: casts.append(plan.kind) or cast(plan, *args)):
        fused = train(layer, "triton", 3, autocast_dtype, recipe)
    plain = train(twin, "torch", 3, autocast_dtype, recipe)
    # Three casts per step through the kernels (input, weight, grad_output): the fused path ran.
    assert casts == ["delayed" if recipe.delayed() else "current"] * 9
    for (y1, g1), (y2, g2) in zip(fused, plain):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    assert torch.equal(layer.weight, twin.weight)
    for name, t in layer.fp8_state.tensors().items():
        assert torch.equal(t, twin.fp8_state.tensors()[name]), name


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(), fp.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_bias_gradient_comes_from_the_grad_output_cast_within_float32_summation_error(recipe, grad_dtype):
    torch.manual_seed(0)
    layer = fp.FP8Linear(96, 200, bias=True, dtype=grad_dtype)
    twin = copy.deepcopy(layer)
    x = (torch.randn(300, 96) * 3).to(grad_dtype).requires_grad_()  # 300 rows: 5 row tiles, the last partial
    g = (torch.randn(300, 200) * torch.logspace(-3, 3, 200)).to(grad_dtype)  # column scales over 6 decades
    g[7, 5] = 1e4  # one large term: cancellation and a wide range within a column
    calls, cast = [], tensorwise.RecordingCast.__call__
    with mock.patch.object(tensorwise.RecordingCast, "__call__",
                           lambda plan, *args: calls.append(plan.bias_grad) or cast(plan, *args)):
        with force_kernels("triton"), fp.autocast(recipe=recipe):
            layer(x).backward(g)
    assert calls.count(True) == 1  # the grad_output cast summed the bias gradient
    with force_kernels("torch"), fp.autocast(recipe=recipe):
        x2 = x.detach().clone().requires_grad_()
        twin(x2).backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, twin.weight.grad)
    # float32 summation of 300 terms (in tiles, then across them): |error| <= (n - 1) u sum|g|,
    # u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 4.2), then the rounding
    # to the bias dtype: half an ulp of it.
    exact = g.double().sum(0)
    bound = 299 * 2.0**-24 * g.double().abs().sum(0) + exact.abs() * torch.finfo(grad_dtype).eps / 2
    assert layer.bias.grad.dtype == grad_dtype
    assert ((layer.bias.grad.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_a_fullgraph_compile_holds_the_fused_casts_as_custom_ops_and_trains_as_eager(recipe):
    torch.manual_seed(0)
    layer = fp.FP8Linear(64, 48, bias=True)
    twin = copy.deepcopy(layer)
    graphs = []

    def backend(gm, example_inputs):  # dynamo's graph, run as it is: what Inductor would be given
        graphs.append(gm)
        return gm.forward

    x = torch.randn(32, 64)
    with force_kernels("triton"):
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        for _ in range(2):
            for module in (compiled, twin):
                with fp.autocast(recipe=recipe):
                    y = module(x)
                y.square().mean().backward()
            fp.update_pending_scales(layer)
            fp.update_pending_scales(twin)
    op = "fp8_plugin.cast_delayed" if recipe.delayed() else "fp8_plugin.cast_current"
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count(op) >= 2  # input and weight in the forward graph, each one op
    assert torch.equal(layer.weight.grad, twin.weight.grad) and torch.equal(layer.bias.grad, twin.bias.grad)
    for name, t in layer.fp8_state.tensors().items():
        assert torch.equal(t, twin.fp8_state.tensors()[name]), name


def test_compiled_code_keeps_the_torch_ops_unless_the_environment_asks_for_the_kernels(monkeypatch):
    from fp8_plugin.numerics.device_kind import meta_as_cuda
    from fp8_plugin.numerics.kernels import ENV_VAR

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with meta_as_cuda((9, 0)):
        assert fused_casts(torch.device("meta")) == (False, "torch.compile fuses the torch ops itself")
        monkeypatch.setenv(ENV_VAR, "triton")
        assert fused_casts(torch.device("meta")) == (True, "")


def test_the_kernels_run_on_cuda_devices_only_unless_forced():
    assert fused_casts(torch.device("cpu")) == (False, "the fused kernels run on CUDA GPUs, not on cpu")
    assert fused_casts(torch.device("meta"))[0] is False  # meta is a GPU only inside meta_as_cuda
    with force_kernels("triton"):
        assert fused_casts(torch.device("cpu")) == (True, "")
    with pytest.raises(ValueError, match=r"force_kernels\(path='cuda'\) is not a cast path; valid: auto, triton, torch"):
        with force_kernels("cuda"):
            pass


@FORMATS
@pytest.mark.parametrize("initialized", [False, True], ids=["first-cast", "steady-state"])
@pytest.mark.parametrize("case", CASES + ["huge-over-scale"])
def test_delayed_scaling_cast_chooses_the_scale_on_the_device_and_records_bit_for_bit(dtype, initialized, case):
    x = torch.randn(33, 65, generator=torch.Generator().manual_seed(4)) * 1e4 if case == "huge-over-scale" \
        else case_input(case)
    role = 1
    state = state_with(role, slot=3.0, initialized=initialized)
    flag, state_scale = state.initialized[role], state.scale[role]
    want_data, want_t, want_scale, want_scale_inv, amax = tensorwise.reference_delayed(x, state_scale, flag, dtype, 1,
                                                                                       transpose=True)
    want = recorded(state, role, amax, current=False)
    data, data_t, scale, scale_inv = tensorwise.cast_transpose_delayed(
        x, dtype, 1, transpose=True, record=True, role=role, **kernel_state(state, initialized=True))
    assert same_bits(data, want_data) and same_bits(data_t, want_t)
    assert torch.equal(scale, want_scale) and torch.equal(scale_inv, want_scale_inv)
    if initialized:
        assert scale.item() == state_scale.item()
    for name, t in state.tensors().items():
        assert same_float(t, want[name]), name
    assert not state.kernel_workspace.any()


@pytest.mark.parametrize("path,expected", [("auto", "casts: torch ops (the fused kernels run on CUDA GPUs, not on cpu)"),
                                           ("triton", "casts: fused Triton kernels")])
def test_the_conversion_report_names_the_cast_path(path, expected):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with force_kernels(path):
        report = fp.convert_model(model, recipe=fp.DelayedScaling())
    assert report.gemm.endswith(expected) and expected in str(report)


def test_the_casts_write_into_the_state_a_checkpoint_load_puts_in_place():
    # The casts use each state's cached row views (ScalingState.kernel_rows): a load replaces the
    # state tensors, and the casts after it must record into the new ones, as the torch ops do.
    recipe = fp.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    layer = fp.FP8Linear(96, 80, bias=False)
    twin = copy.deepcopy(layer)
    runs = []
    for model, path in ((layer, "triton"), (twin, "torch")):
        train(model, path, 2, None, recipe)
        model.load_state_dict(copy.deepcopy(model.state_dict()))  # new state tensors, the same values
        runs.append(train(model, path, 2, None, recipe))
    for (y1, g1), (y2, g2) in zip(*runs):
        assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for name, t in layer.fp8_state.tensors().items():
        assert torch.equal(t, twin.fp8_state.tensors()[name]), name


@pytest.mark.parametrize("kind, kernels", [("delayed", ("_amax_unless_initialized_kernel", "_delayed_kernel")),
                                           ("current", ("_amax_kernel", "_current_kernel"))])
def test_an_eager_cast_makes_its_outputs_and_nothing_else_on_the_host(kind, kernels):
    # On the GPU every op is some microseconds of CPU (an H100 machine's host ran a 4096 x 2048
    # FP8Linear step 10x longer than BF16's): a steady-state cast makes its three outputs (data,
    # data_t, scale_inv) and no view, select or placeholder besides the two launches.
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8_plugin.numerics.kernels import ops

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    from fp8_plugin.numerics.kernels.launch import record_launches

    state, x = ScalingState(4), torch.randn(128, 96, dtype=torch.bfloat16)
    with record_launches() as launches:  # counted, not run: what the host does around them is left alone
        ops.eager_cast(kind, x, state, 0, E4M3, 0, True, True, False)  # the first call makes the row views
        launches.clear()
        with Ops() as seen:
            data, data_t, scale_inv, bias = ops.eager_cast(kind, x, state, 0, E4M3, 0, True, True, False)
    assert seen.names == ["empty.memory_format"] * 3
    assert launches == {name: 1 for name in kernels}
    assert data.shape == (128, 96) and data_t.shape == (96, 128) and data.dtype == data_t.dtype == E4M3
    assert scale_inv.shape == () and scale_inv.dtype == torch.float32 and bias is None


def test_a_delayed_cast_skips_its_amax_pass_once_the_host_knows_the_state_holds_a_scale(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    from fp8_plugin.numerics.kernels import ops, scale_update

    launched = []
    real_run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(1) or real_run(self, *a, **k))
    recipe = fp.DelayedScaling(amax_history_len=4)

    def cast(state, x):
        launched.clear()
        data, _, scale_inv, _ = ops.cast_delayed(x, state, 0, E4M3, 0, transpose=True, record=True)
        return len(launched), data, scale_inv

    def update(state):
        launched.clear()
        scale_update.bulk_update([(recipe, 0, state)], None)
        return len(launched)

    x = torch.randn(70, 130) * 5
    state = ScalingState(4)
    assert cast(state, x)[0] == 2 and not state.initialized_known(0)
    assert update(state) == 1  # the flags come back with the update itself
    assert state.initialized_known(0)
    launches, data, scale_inv = cast(state, x)
    assert launches == 1
    # The steady-state cast, bit for bit as the torch ops: the state's scale, the amax recorded.
    want, _, _, want_inv, want_amax = tensorwise.reference_delayed(x, state.scale[0], state.initialized[0], E4M3, 0, True)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale_inv, want_inv)
    assert state.amax_history[0, 0] == want_amax
    # A state that got no positive amax stays unknown (its first cast's pass still runs), and a
    # reset forgets what was known.
    empty = ScalingState(4)
    cast(empty, torch.zeros(70, 130))
    update(empty)
    assert not empty.initialized_known(0) and cast(empty, x)[0] == 2
    state.reset()
    assert not state.initialized_known(0) and cast(state, x)[0] == 2


def test_a_copied_state_leaves_the_host_caches_behind():
    # A pending flag copy holds a CUDA event on a GPU, which deepcopy cannot copy (a lock stands
    # in for it here); an EMA model or a reference twin deep-copies states at any step.
    import threading

    state = ScalingState(4)
    rows = state.kernel_rows(0)
    state.expect_initialized(0, torch.ones(1, dtype=torch.int8), 0, threading.Lock())
    state._initialized_known[1] = True
    twin = copy.deepcopy(state)
    assert not any(twin.initialized_known(role) for role in range(3))
    assert twin.kernel_rows(0).scale.data_ptr() == twin.scale[0].data_ptr() != rows.scale.data_ptr()
    assert state.initialized_known(1)  # the original keeps what it knows


def test_a_quantizers_next_cast_of_one_layout_launches_its_kept_plan_until_anything_it_was_chosen_on_changes(
        monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8_plugin.numerics.kernels import ops
    from fp8_plugin.numerics.quantizers import INPUT, make_quantizer

    looked_up = []
    real = ops.eager_cast_plan
    monkeypatch.setattr(ops, "eager_cast_plan", lambda *a: looked_up.append(1) or real(*a))
    recipe, state = fp.DelayedScaling(amax_history_len=4), ScalingState(4)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 5

    def cast(x, state=state):
        with force_kernels("triton"):
            row, col = make_quantizer(recipe, INPUT, state, record=True, host=False).quantize_pair(x, columnwise=True)
        # The bytes of the torch ops at the scale the state held (a first cast: x's own amax).
        want, want_t, _, want_inv, _ = tensorwise.reference_delayed(x, state.scale[0], torch.tensor(False), E4M3, 0, True)
        assert same_bits(row.data, want) and same_bits(col.data, want_t) and torch.equal(row.scale_inv, want_inv)
        return len(looked_up)

    assert cast(x) == 1 and cast(x) == 1  # the second: the kept plan, no lookup
    assert cast(x[:32]) == 2  # another layout
    old = state.amax_history
    state.amax_history = torch.zeros_like(old)  # new state tensors (a load, a move)
    assert cast(x[:32]) == 3
    # Recorded into the new tensors (delayed scaling keeps the step's largest amax: the slot was
    # 0), not the old ones, which hold x's amax from the first casts.
    assert state.amax_history[0, 0] == x[:32].float().abs().max()
    assert old[0, 0] == x.float().abs().max()

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():  # a dispatch mode sees the custom op: no eager plan
        assert cast(x[:32]) == 3
