"""The quantizers, property-based: over recipe configurations and tensor contents, a cast is
finite, within the format's rounding bound, and fails only in the documented ways.

Recipes: ``DelayedScaling`` (margin 0..7, short histories, "max" / "most_recent", HYBRID and
E4M3) and ``Float8CurrentScaling`` through ``PerTensorQuantizer``; ``MXFP8BlockScaling`` and
``Float8BlockScaling`` (power-of-two or FP32 scales, amax epsilons, 1x128 or 128x128 blocks)
through ``BlockQuantizer``; every role (input, weight, grad_output: E4M3 and E5M2), always via
``make_quantizer(...).quantize_pair(x, columnwise=True)``. Tensors: float32, bfloat16 and float16
of any shape (one row, sizes that are not multiples of a block), all-zero, mixed signs,
magnitudes from float32's smallest subnormal to its max, a few huge outliers.

What is asserted:

- Finite input gives finite FP8 data, a finite positive ``scale_inv`` and a finite dequantized
  tensor (FP8 rounding can carry a value near the float32 max past it: dequantization
  saturates), and ``scale_inv`` follows the documented formula, clamps included.
- Where the scale comes from the tensor itself (current and block scaling, a first delayed
  step), every element is within half an FP8 ulp at its scaled magnitude (see
  :func:`half_ulp_bound`). Where it cannot cover the tensor (a delayed scale from an earlier
  tensor, MX's floor-rounded exponent) the elements beyond ``FP8_MAX * scale_inv`` saturate to
  exactly ``+-FP8_MAX * scale_inv`` and the others obey the same bound.
- Invalid recipe arguments raise ``ValueError`` / ``TypeError`` naming the setting.
- inf stays inf in E5M2 and becomes NaN in E4M3, NaN stays NaN, and a non-finite amax is
  counted, never stored in the delayed-scaling history or scale.

Three of these held only after fixes: current and block scaling stored a non-finite amax in
``amax_history``, ``QParams`` accepted an ``amax_epsilon`` beyond the float32 range that the
cast then could not use, and a block-scaled tensor dequantized to bfloat16 / float16 could
overflow to inf.
"""

import math

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fp8_plugin.numerics.formats import Format
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT, ScalingState, make_quantizer, update_delayed_scaling
from fp8_plugin.numerics.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, QParams
from reference import MANTISSA_BITS, MAX, MIN_NORMAL_EXP

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32, 2^-126
FORMATS = [Format.HYBRID, Format.E4M3]
ROLES = [0, 1, 2]  # input, weight, grad_output
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# log2 of the smallest subnormal and of the first power of two above the max, per input dtype.
EXP_RANGE = {torch.float32: (-149, 128), torch.bfloat16: (-133, 128), torch.float16: (-24, 16)}
EMAX_ELEM = {E4M3: 8, E5M2: 15}  # OCP MX v1.0, table 2
MAX_MARGIN = 7  # DelayedScaling's valid margins are 0..7
# Slack for float32 arithmetic around the FP8 rounding, derived in half_ulp_bound.
F32_SLACK = 2.0**-20


def fp8_dtype_of(fmt: Format, role: int) -> torch.dtype:
    """HYBRID: E4M3 forward (input, weight), E5M2 for grad_output; E4M3: E4M3 everywhere."""
    return E5M2 if fmt is Format.HYBRID and role == GRAD_OUTPUT else E4M3


def half_ulp_bound(x: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |dequantize(quantize(x)) - x| per element, x and scale_inv float64, not saturated.

    OCP OFP8: with m mantissa bits and smallest normal exponent emin (E4M3: 3, -6; E5M2: 2, -14),
    round to nearest moves y = x * scale by at most half an ulp, 2^(max(e_y, emin) - m - 1):
    at most 2^-(m+1) |y| for a normal y (2^-4 E4M3, 2^-3 E5M2) and at most 2^(emin - m - 1)
    for a subnormal one (2^-10 E4M3, 2^-17 E5M2). Mapped back by scale_inv, that is
    2^-(m+1) |x| + 2^(emin-m-1) scale_inv.

    float32 around it: y = fl(x * scale) (relative 2^-24, or 2^-150 absolute below 2^-126,
    at most 2^-133 times the FP8 subnormal half-step), scale_inv = fl(1 / scale) (relative 2^-24;
    2^-22 where it is subnormal, as scale <= float32 max keeps it >= 2^-128), and
    fl(data * scale_inv) (relative 2^-24, or 2^-150 absolute in float32's subnormal range). These
    add less than 2^-20 (|x| + the FP8 term) and one float32 subnormal step, 2^-149.
    """
    m, emin = MANTISSA_BITS[dtype], MIN_NORMAL_EXP[dtype]
    fp8_term = 2.0 ** -(m + 1) * x.abs() + 2.0 ** (emin - m - 1) * scale_inv
    return fp8_term * (1 + F32_SLACK) + F32_SLACK * x.abs() + 2.0**-149


def elementwise(t: torch.Tensor, block, shape) -> torch.Tensor:
    """A per-tensor (0-dim) or per-block ``scale_inv`` broadcast to every element of ``shape``."""
    if block is None:
        return t.expand(shape)
    return t.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def _worst(mask_bad, **columns) -> str:
    i = int(mask_bad.flatten().nonzero()[0])
    return f"{int(mask_bad.sum())} elements; first at flat index {i}: " + ", ".join(
        f"{k}={v.flatten()[i].item():.9g}" for k, v in columns.items())


def assert_cast_within_bound(x: torch.Tensor, q, dtype: torch.dtype, may_saturate: bool) -> None:
    """Property (a) and (b) for one cast ``q`` of ``x`` (2-D, finite)."""
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert torch.isfinite(q.data.float()).all(), "finite input gave non-finite FP8 data"
    assert q.scale_inv.dtype == torch.float32
    assert torch.isfinite(q.scale_inv).all() and (q.scale_inv > 0).all(), q.scale_inv
    deq32 = q.dequantize()
    assert deq32.dtype == torch.float32
    bad = ~torch.isfinite(deq32)
    assert not bad.any(), "finite input dequantized to inf/NaN: " + _worst(
        bad, x=x.double(), data=q.data.float(), scale_inv=elementwise(q.scale_inv, q.block, x.shape))

    x64, deq = x.double(), deq32.double()
    si32 = elementwise(q.scale_inv, q.block, x.shape)
    si = si32.double()
    # Beyond FP8_MAX * scale_inv (with the float32 slack of half_ulp_bound): saturated, exactly
    # +-FP8_MAX * scale_inv as float32 computes it. Elements inside that slack round to FP8_MAX
    # either way and stay within the bound.
    beyond = x64.abs() > MAX[dtype] * si * (1 + F32_SLACK)
    if not may_saturate:
        assert not beyond.any(), "a scale computed from the tensor saturated it: " + _worst(
            beyond, x=x64, scale_inv=si)
    saturated = (torch.full_like(si32, MAX[dtype]) * si32).double() * torch.sign(x64)
    wrong = beyond & (deq != saturated)
    assert not wrong.any(), "a value beyond the range did not saturate to FP8_MAX * scale_inv: " + _worst(
        wrong, x=x64, dequantized=deq, expected=saturated)
    event("saturated" if beyond.any() else "not saturated")
    event("scale_inv subnormal" if (si32 < F32_TINY).any() else "scale_inv normal")
    event("all zero" if not x.any() else "some non-zero")
    bound = half_ulp_bound(x64, si, dtype)
    error = (deq - x64).abs()
    over = ~beyond & (error > bound)
    assert not over.any(), "error beyond half an FP8 ulp: " + _worst(
        over, x=x64, dequantized=deq, error=error, bound=bound, scale_inv=si)


def assert_pair_within_bound(x, row, col, dtype, may_saturate) -> None:
    """The rowwise cast of ``x`` and its columnwise one (a cast of ``x.T``)."""
    assert_cast_within_bound(x, row, dtype, may_saturate)
    assert col is not None
    assert_cast_within_bound(x.t(), col, dtype, may_saturate)


def state_snapshot(state: ScalingState) -> dict:
    return {name: t.clone() for name, t in state.tensors().items()}


def assert_state_unchanged(state: ScalingState, before: dict) -> None:
    for name, t in state.tensors().items():
        assert torch.equal(t, before[name]), f"record=False changed ScalingState.{name}"


# ---------------------------------------------------------------------------------------------
# Strategies


@st.composite
def finite_tensors(draw, max_rows=260, max_cols=300, max_numel=20_000):
    """A finite 2-D tensor: magnitudes 2^e for e uniform in a drawn range of the dtype's
    exponents (smallest subnormal to max), random signs, some zeros (or all), a few outliers
    up to the dtype's max, and a few float32 values hypothesis picks itself (its edge cases)."""
    dtype = draw(st.sampled_from(INPUT_DTYPES), label="dtype")
    rows = draw(st.integers(1, max_rows), label="rows")
    cols = draw(st.integers(1, max(1, min(max_cols, max_numel // rows))), label="cols")
    lo, hi = EXP_RANGE[dtype]
    # Where the magnitudes lie: anywhere, or bunched at the ends of the range, where scales
    # clamp (tiny amaxes) and dequantized values approach the dtype's max (huge ones).
    regime = draw(st.sampled_from(["anywhere", "tiny", "huge", "moderate"]), label="regime")
    first, last = {"anywhere": (lo, hi), "tiny": (lo, lo + 30), "huge": (hi - 30, hi),
                   "moderate": (max(lo, -20), min(hi, 20))}[regime]
    e_lo = draw(st.integers(first, last), label="e_lo")
    e_hi = draw(st.integers(e_lo, last), label="e_hi")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    zero_fraction = draw(st.sampled_from([0.0, 0.0, 0.25, 0.9, 1.0]), label="zero_fraction")
    if zero_fraction == 1.0:
        return torch.zeros(rows, cols, dtype=dtype)
    outliers = draw(st.integers(0, 3), label="outliers")
    outlier_exp = draw(st.integers(e_hi, min(hi, e_hi + 60)), label="outlier_exp")
    picked = draw(st.lists(st.tuples(st.integers(0, rows * cols - 1),
                                     st.floats(allow_nan=False, allow_infinity=False, width=32)),
                           max_size=4), label="picked")
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(e_lo + (e_hi - e_lo) * torch.rand(rows, cols, generator=g, dtype=torch.float64))
    x = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -x, x)
    x = torch.where(torch.rand(rows, cols, generator=g) < zero_fraction, torch.zeros_like(x), x)
    flat = x.view(-1)
    where = torch.randint(rows * cols, (outliers,), generator=g)
    flat[where] = 2.0**outlier_exp * (1 + torch.rand(outliers, generator=g, dtype=torch.float64))
    for i, v in picked:
        flat[i] = v
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


delayed_recipes = st.builds(
    DelayedScaling,
    margin=st.integers(0, MAX_MARGIN),
    fp8_format=st.sampled_from(FORMATS),
    amax_history_len=st.integers(1, 4),
    amax_compute_algo=st.sampled_from(["max", "most_recent"]),
)
# amax_epsilon: 0, a few fixed values and anything within float32's range (the block amaxes
# are float32; QParams refuses non-finite and negative values).
amax_epsilons = st.one_of(st.sampled_from([0.0, 1e-30, 1e-12, 1e-4, 1.0]),
                          st.floats(0.0, 3e38, allow_subnormal=True))
qparams = st.builds(QParams, power_2_scale=st.booleans(), amax_epsilon=amax_epsilons)
blockwise_recipes = st.builds(
    Float8BlockScaling,
    fp8_format=st.sampled_from(FORMATS),
    fp8_quant_fwd_inp=qparams, fp8_quant_fwd_weight=qparams, fp8_quant_bwd_grad=qparams,
    x_block_scaling_dim=st.sampled_from([1, 2]), w_block_scaling_dim=st.sampled_from([1, 2]),
    grad_block_scaling_dim=st.sampled_from([1, 2]),
)
mx_recipes = st.builds(MXFP8BlockScaling, fp8_format=st.sampled_from(FORMATS))


def _tensor(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def reciprocal(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 1 / t (``1 / t`` in torch is ``t.reciprocal()``, which is not)."""
    return torch.ones_like(t) / t


# scale_inv of a scale clamped to the float32 max: a float32 subnormal, about 2.9e-39.
CLAMPED_SCALE_INV = reciprocal(torch.tensor(F32_MAX)).item()


def assert_per_tensor_scale(scale_inv: float, amax: float, dtype: torch.dtype, margin: int) -> None:
    """scale = (FP8_MAX / amax) / 2^margin (TE); 1.0 for an all-zero tensor; the float32 max
    where that overflows (amax below about 1.3e-36 / 2^margin for E4M3), as documented."""
    if amax == 0:
        assert scale_inv == 1.0
        return
    ideal = MAX[dtype] / amax / 2**margin
    if ideal > F32_MAX * (1 + F32_SLACK):
        assert scale_inv == CLAMPED_SCALE_INV
    elif not (ideal >= F32_MAX * (1 - F32_SLACK) and scale_inv == CLAMPED_SCALE_INV):
        # scale and scale_inv: two float32 roundings (2^-22 where scale_inv is subnormal).
        assert abs(scale_inv * ideal - 1) <= F32_SLACK, (scale_inv, amax, margin)


# ---------------------------------------------------------------------------------------------
# (a), (b): current scaling


@settings(max_examples=200, deadline=None)
@given(fmt=st.sampled_from(FORMATS), role=st.sampled_from(ROLES), record=st.booleans(), x=finite_tensors())
# Amaxes below FP8_MAX / float32 max: the scale clamps to float32 max, scale_inv is subnormal.
@example(fmt=Format.HYBRID, role=2, record=True, x=_tensor([[1e-40, -3e-41, 1e-45, 0.0]]))
@example(fmt=Format.E4M3, role=0, record=True, x=_tensor([[2.0**-149, -(2.0**-149)]]))
def test_current_scaling_casts_finite_tensors_to_finite_fp8_within_half_an_ulp(fmt, role, record, x):
    dtype = fp8_dtype_of(fmt, role)
    state = ScalingState(1)
    before = state_snapshot(state)
    recipe = Float8CurrentScaling(fp8_format=fmt)
    row, col = make_quantizer(recipe, role, state, record=record).quantize_pair(x, columnwise=True)
    assert_pair_within_bound(x, row, col, dtype, may_saturate=False)
    # One per-tensor scale: the columnwise cast is the rowwise one transposed.
    assert torch.equal(col.data.view(torch.uint8), row.data.view(torch.uint8).t())
    assert torch.equal(col.scale_inv, row.scale_inv)

    si = row.scale_inv.item()
    amax = x.abs().max().double().item()
    assert_per_tensor_scale(si, amax, dtype, margin=0)

    if record:
        assert state.amax_history[role, 0].item() == amax
        assert torch.equal(row.scale_inv, reciprocal(state.scale[role]))
        assert state.nonfinite_amax_count.sum() == 0
    else:
        assert_state_unchanged(state, before)


# ---------------------------------------------------------------------------------------------
# (a), (b): delayed scaling, with a history from earlier tensors


@settings(max_examples=200, deadline=None)
@given(
    recipe=delayed_recipes, role=st.sampled_from(ROLES), record=st.booleans(),
    history=st.lists(finite_tensors(max_rows=8, max_cols=40), max_size=3), x=finite_tensors(),
)
# margin 1, history amax 0.64 * float32 max: float32 max casts to 350, above E4M3's midpoint
# 336 between 320 and 352, so it rounds to 352, and 352 * scale_inv is beyond float32 (inf
# unless dequantization saturates).
@example(recipe=DelayedScaling(margin=1, amax_history_len=1), role=0, record=False,
         history=[_tensor([[0.64 * F32_MAX]])], x=_tensor([[F32_MAX, -F32_MAX]]))
# A first step with amax 1.3e-36 and margin 1: FP8_MAX / amax (3.4e38) is beyond float32 but
# the scale, half of it, is not; it must not be clamped (which would drop the margin).
@example(recipe=DelayedScaling(margin=1, amax_history_len=1), role=0, record=False, history=[],
         x=_tensor([[-1.3041447602350203e-36]]))
@example(recipe=DelayedScaling(margin=7, amax_history_len=1), role=2, record=True, history=[],
         x=_tensor([[1e-37, -3e-38, 0.0]]))
# A tiny history amax: scale clamped to float32 max; every larger value saturates.
@example(recipe=DelayedScaling(margin=3, amax_history_len=2, amax_compute_algo="most_recent"), role=2,
         record=True, history=[_tensor([[1e-40]])], x=_tensor([[1.0, -1e-37, 1e-39, 0.0]]))
def test_delayed_scaling_saturates_beyond_the_history_range_and_stays_within_half_an_ulp_below(
        recipe, role, record, history, x):
    dtype = fp8_dtype_of(recipe.fp8_format, role)
    state = ScalingState(recipe.amax_history_len)
    for earlier in history:  # one training step each: record the amax, then update the scale
        make_quantizer(recipe, role, state, record=True).quantize_pair(earlier, columnwise=True)
        update_delayed_scaling([(recipe, role, [state])])
    assert torch.isfinite(state.scale).all() and (state.scale > 0).all()
    assert torch.isfinite(state.amax_history).all()
    initialized = bool(state.initialized[role])
    before = state_snapshot(state)

    row, col = make_quantizer(recipe, role, state, record=record).quantize_pair(x, columnwise=True)
    # A scale from earlier tensors need not cover this one: beyond it, saturation. On a first
    # step (no non-zero amax yet) the scale is this tensor's own, and nothing saturates.
    assert_pair_within_bound(x, row, col, dtype, may_saturate=initialized)
    if initialized:
        assert torch.equal(row.scale_inv, reciprocal(before["scale"][role]))
    else:
        assert_per_tensor_scale(row.scale_inv.item(), x.abs().max().double().item(), dtype, recipe.margin)

    if record:
        # The cast's amax joins the current step's slot; the scale waits for the next update.
        amax = x.abs().max().float()
        assert state.amax_history[role, 0] == torch.maximum(before["amax_history"][role, 0], amax)
        assert torch.equal(state.scale, before["scale"])
    else:
        assert_state_unchanged(state, before)


# ---------------------------------------------------------------------------------------------
# (a), (b): block scaling


def _mx_reference_scale_inv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """OCP MX v1.0, 6.3, per 1x32 block: X = 2^(floor(log2 amax) - emax_elem), the exponent
    clamped to E8M0's -127..127; 2^-127 for an all-zero block (the module's documented choice)."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.double().abs(), (0, -cols % 32))
    amax = padded.reshape(rows, -1, 32).amax(dim=2)
    floor_log2 = torch.frexp(amax)[1].double() - 1  # exact; float32 subnormals are normal here
    exp = torch.where(amax > 0, floor_log2 - EMAX_ELEM[dtype], torch.full_like(amax, -127.0))
    return torch.exp2(exp.clamp(-127, 127))


@settings(max_examples=200, deadline=None)
@given(recipe=mx_recipes, role=st.sampled_from(ROLES), record=st.booleans(), x=finite_tensors())
def test_mxfp8_saturates_only_beyond_fp8_max_times_the_block_scale_and_stays_within_half_an_ulp(
        recipe, role, record, x):
    dtype = fp8_dtype_of(recipe.fp8_format, role)
    state = ScalingState(1)
    before = state_snapshot(state)
    row, col = make_quantizer(recipe, role, state, record=record).quantize_pair(x, columnwise=True)
    assert row.block == (1, 32) and col.block == (1, 32)
    # The exponent is floor-rounded: amax / X lies in [2^emax_elem, 2^(emax_elem + 1)), above
    # FP8_MAX for the largest values of a block, which saturate (OCP MX v1.0, 6.3).
    assert_pair_within_bound(x, row, col, dtype, may_saturate=True)
    # E8M0 scales: exactly the spec's power of two, clamped to [2^-127, 2^127] (a block of
    # values below 2^-119 (E4M3) / 2^-112 (E5M2) keeps X = 2^-127 and casts below full range).
    assert torch.equal(row.scale_inv.double(), _mx_reference_scale_inv(x, dtype))
    assert torch.equal(col.scale_inv.double(), _mx_reference_scale_inv(x.t(), dtype))
    if record:
        assert state.amax_history[role, 0].item() == x.abs().max().double().item()
    else:
        assert_state_unchanged(state, before)


@settings(max_examples=200, deadline=None)
@given(recipe=blockwise_recipes, role=st.sampled_from(ROLES), record=st.booleans(), x=finite_tensors())
# TE's default power-of-two scale for a block at float32 max: scale 2^-120, 2^128 (1 - 2^-24)
# casts to 255.99998, rounds to 256, and 256 * 2^120 = 2^128 is beyond float32 (inf unless
# dequantization saturates); the same in E5M2 from bfloat16.
@example(recipe=Float8BlockScaling(), role=0, record=False, x=_tensor([[F32_MAX, -F32_MAX]]))
@example(recipe=Float8BlockScaling(fp8_format=Format.HYBRID), role=2, record=True,
         x=_tensor([[3.3e38] * 3, [-1.0] * 3], dtype=torch.bfloat16))
def test_blockwise_scaling_never_saturates_finite_blocks_and_stays_within_half_an_ulp(recipe, role, record, x):
    dtype = fp8_dtype_of(recipe.fp8_format, role)
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)[role]
    params = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)[role]
    block = (128, 128) if dims == 2 else (1, 128)
    state = ScalingState(1)
    before = state_snapshot(state)
    row, col = make_quantizer(recipe, role, state, record=record).quantize_pair(x, columnwise=True)
    assert row.block == block and col.block == block
    # scale = FP8_MAX / max(amax, amax_epsilon) <= FP8_MAX / amax, truncated (never rounded up)
    # to a power of two: no element of a finite block exceeds FP8_MAX.
    assert_pair_within_bound(x, row, col, dtype, may_saturate=False)
    for xt, q in ((x, row), (x.t(), col)):
        si = q.scale_inv.double()
        rows, cols = xt.shape
        padded = torch.nn.functional.pad(xt.double().abs(), (0, -cols % block[1], 0, -rows % block[0]))
        amax = padded.reshape(padded.shape[0] // block[0], block[0], -1, block[1]).amax(dim=(1, 3))
        floor = amax.clamp(min=float(torch.tensor(params.amax_epsilon, dtype=torch.float32)))
        ideal = torch.where(floor > 0, MAX[dtype] / floor.clamp(min=1e-300), torch.ones_like(floor))
        clamped = ideal > F32_MAX * (1 + F32_SLACK)
        # Overflowing scales become the float32 max (2^127 as a power of two): scale_inv
        # 1 / float32 max or 2^-127, both float32 subnormals.
        limit = 2.0**-127 if params.power_2_scale else CLAMPED_SCALE_INV
        assert (si[clamped] == limit).all()
        if params.power_2_scale:
            assert (torch.frexp(si)[0] == 0.5).all(), "power_2_scale gave a scale that is not a power of two"
            # 1/ideal <= scale_inv < 2/ideal, up to the float32 rounding of FP8_MAX / amax.
            ok = (si * ideal >= 1 - F32_SLACK) & (si * ideal < 2 * (1 + F32_SLACK))
        else:
            ok = (si * ideal - 1).abs() <= F32_SLACK
        ok |= (si == limit) & (ideal >= F32_MAX * (1 - F32_SLACK))  # at the clamp's edge
        assert (ok | clamped).all(), _worst(~(ok | clamped), scale_inv=si, ideal_scale=ideal)
    if record:
        assert state.amax_history[role, 0].item() == x.abs().max().double().item()
    else:
        assert_state_unchanged(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_tensor_dequantization_to_the_input_dtype_saturates_instead_of_overflowing(dtype):
    # 2^128 (1 - 2^-24) (float32), the bfloat16 max and the float16 max, each cast with a
    # delayed scale from 0.64 times itself at margin 1: FP8 rounding carries it past the max.
    big = torch.finfo(dtype).max
    recipe, state = DelayedScaling(margin=1, amax_history_len=1), ScalingState(1)
    make_quantizer(recipe, 0, state).quantize(_tensor([[0.64 * big]], dtype))
    update_delayed_scaling([(recipe, 0, [state])])
    q = make_quantizer(recipe, 0, state).quantize(_tensor([[big, -big]], dtype))
    assert q.dequantize(dtype).tolist() == [[big, -big]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_dequantization_to_the_input_dtype_saturates_instead_of_overflowing(dtype):
    # The dtype's max, power-of-two scale: its cast rounds up to the next power of two.
    big = torch.finfo(dtype).max
    q = make_quantizer(Float8BlockScaling(), 0, ScalingState(1)).quantize(_tensor([[big, -big]], dtype))
    assert q.dequantize(dtype).tolist() == [[big, -big]]


# ---------------------------------------------------------------------------------------------
# (d): non-finite inputs

any_recipe = st.one_of(
    delayed_recipes, st.builds(Float8CurrentScaling, fp8_format=st.sampled_from(FORMATS)), mx_recipes,
    blockwise_recipes,
)


@settings(max_examples=200, deadline=None)
@given(
    recipe=any_recipe, role=st.sampled_from(ROLES), x=finite_tensors(max_rows=140, max_cols=160),
    specials=st.lists(st.tuples(st.integers(0, 2**20), st.sampled_from([math.inf, -math.inf, math.nan])),
                      min_size=1, max_size=4),
    earlier=st.none() | finite_tensors(max_rows=8, max_cols=40),
)
def test_nonfinite_inputs_keep_inf_in_e5m2_nan_in_e4m3_and_never_enter_the_delayed_history(
        recipe, role, x, specials, earlier):
    dtype = fp8_dtype_of(recipe.fp8_format, role)
    state = ScalingState(getattr(recipe, "amax_history_len", 1))
    if earlier is not None and recipe.delayed():
        make_quantizer(recipe, role, state, record=True).quantize_pair(earlier, columnwise=True)
        update_delayed_scaling([(recipe, role, [state])])
    x = x.clone()
    for i, v in specials:
        x.view(-1)[i % x.numel()] = v
    row, col = make_quantizer(recipe, role, state, record=True).quantize_pair(x, columnwise=True)

    for xt, q in ((x, row), (x.t(), col)):
        xf, data, deq = xt.float(), q.data.float(), q.dequantize()
        inf, nan, finite = torch.isinf(xf), torch.isnan(xf), torch.isfinite(xf)
        # MX: a block holding an inf or NaN gets the E8M0 NaN as its scale and is NaN
        # throughout, data and dequantized values (never silently finite). Blockwise and
        # per-tensor scales stay finite (1.0, or the previous scale).
        block_nan = elementwise(q.scale_inv, q.block, xt.shape).isnan()
        if isinstance(recipe, MXFP8BlockScaling):
            padded = torch.nn.functional.pad((~finite).float(), (0, -xt.shape[1] % 32))
            has_nonfinite = padded.reshape(xt.shape[0], -1, 32).amax(dim=2) > 0
            assert torch.equal(q.scale_inv.isnan(), has_nonfinite)
            assert data[block_nan].isnan().all() and deq[block_nan].isnan().all()
        else:
            assert not block_nan.any()
        keep = ~block_nan
        # OCP OFP8: E5M2 has infinities, E4M3 (fn) none (inf becomes its NaN); NaN stays NaN;
        # finite values stay finite (saturated where the scale does not cover them).
        if dtype == E5M2:
            assert torch.equal(data[inf & keep], xf[inf & keep])
            assert torch.equal(deq[inf & keep], xf[inf & keep])
        else:
            assert data[inf].isnan().all() and deq[inf].isnan().all()
        assert data[nan].isnan().all() and deq[nan].isnan().all()
        assert torch.isfinite(data[finite & keep]).all() and torch.isfinite(deq[finite & keep]).all()

    # The amax (inf or NaN) is counted once per cast.
    assert state.nonfinite_amax_count[role] == 1
    assert torch.isfinite(state.scale).all() and (state.scale > 0).all()
    if recipe.delayed():
        # record_amax: counted, not recorded; the next update leaves a finite, positive scale.
        assert torch.isfinite(state.amax_history).all()
        update_delayed_scaling([(recipe, role, [state])])
        assert torch.isfinite(state.amax_history).all()
        assert torch.isfinite(state.scale).all() and (state.scale > 0).all()


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), MXFP8BlockScaling(), Float8BlockScaling()],
                         ids=["current", "mxfp8", "blockwise"])
def test_nonfinite_amax_never_enters_the_history_under_current_and_block_scaling(recipe):
    state = ScalingState(1)
    x = _tensor([[1.0, math.inf], [2.0, math.nan]])
    make_quantizer(recipe, 0, state, record=True).quantize_pair(x, columnwise=True)
    assert state.nonfinite_amax_count[0] == 1
    assert torch.isfinite(state.scale).all()
    assert torch.isfinite(state.amax_history).all()


# ---------------------------------------------------------------------------------------------
# (c): only the documented exceptions


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: DelayedScaling(margin=-1), "margin"),
        (lambda: DelayedScaling(margin=MAX_MARGIN + 1), "margin"),
        (lambda: DelayedScaling(margin=1.5), "margin"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: DelayedScaling(amax_history_len=-4), "amax_history_len"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(fp8_format="E6M1"), "fp8_format"),
        (lambda: DelayedScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: Float8CurrentScaling(fp8_format="e5m2"), "fp8_format"),
        (lambda: MXFP8BlockScaling(fp8_format="E5M2"), "fp8_format"),
        (lambda: QParams(amax_epsilon=-1), "amax_epsilon"),
        (lambda: QParams(amax_epsilon=math.nan), "amax_epsilon"),
        (lambda: QParams(amax_epsilon=math.inf), "amax_epsilon"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim"),
        (lambda: Float8BlockScaling(w_block_scaling_dim=0), "w_block_scaling_dim"),
        (lambda: Float8BlockScaling(grad_block_scaling_dim=-1), "grad_block_scaling_dim"),
    ],
)
def test_invalid_recipe_arguments_raise_value_error_naming_the_setting(make, setting):
    with pytest.raises(ValueError, match=f"{setting}="):
        make()


def _valid_margin(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_MARGIN


def _valid_history_len(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@settings(max_examples=200, deadline=None)
@given(
    margin=st.one_of(st.integers(-3, 12), st.floats(-2, 10), st.booleans(), st.none()),
    amax_history_len=st.one_of(st.integers(-2, 8), st.floats(-1, 8), st.booleans()),
    amax_compute_algo=st.sampled_from(["max", "most_recent", "mean", "MAX", ""]),
    fp8_format=st.sampled_from([Format.HYBRID, Format.E4M3, Format.E5M2, "hybrid", "e4m3", "E5M2", "E3M4"]),
)
def test_delayed_scaling_accepts_valid_arguments_and_names_an_invalid_one(margin, amax_history_len,
                                                                         amax_compute_algo, fp8_format):
    invalid = [
        name for name, ok in (
            ("margin", _valid_margin(margin)),
            ("amax_history_len", _valid_history_len(amax_history_len)),
            ("amax_compute_algo", amax_compute_algo in ("max", "most_recent")),
            ("fp8_format", str(getattr(fp8_format, "name", fp8_format)).upper() in ("HYBRID", "E4M3")),
        ) if not ok
    ]
    kwargs = dict(margin=margin, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo,
                  fp8_format=fp8_format)
    if not invalid:
        recipe = DelayedScaling(**kwargs)
        assert (recipe.margin, recipe.amax_history_len) == (margin, amax_history_len)
        return
    with pytest.raises((ValueError, TypeError)) as info:
        DelayedScaling(**kwargs)
    assert any(f"{name}=" in str(info.value) for name in invalid), (invalid, str(info.value))


@settings(max_examples=200, deadline=None)
@given(amax_epsilon=st.one_of(st.floats(), st.integers(-3, 3)))
def test_qparams_accept_a_finite_non_negative_epsilon_and_name_any_other(amax_epsilon):
    if math.isfinite(amax_epsilon) and amax_epsilon >= 0 and amax_epsilon <= F32_MAX:
        assert QParams(amax_epsilon=amax_epsilon).amax_epsilon == amax_epsilon
    else:
        with pytest.raises(ValueError, match="amax_epsilon="):
            QParams(amax_epsilon=amax_epsilon)


@pytest.mark.parametrize("amax_epsilon", [3.5e38, 1e300])
def test_an_amax_epsilon_beyond_float32_is_refused_up_front(amax_epsilon):
    # Block amaxes are float32: such an epsilon cannot floor them (the cast would raise).
    with pytest.raises(ValueError, match="amax_epsilon="):
        QParams(amax_epsilon=amax_epsilon)
