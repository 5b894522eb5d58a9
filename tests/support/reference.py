"""Independent float64 references written from the specs, for the tests only."""

import torch

import fp8_plugin as fp

# Devices the device-parametrized tests run on: the CPU always, a CUDA GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# OCP OFP8 rev 1.0, table 1.
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}
# Every FP8 dtype a GEMM may take: the OCP pair and AMD MI300's FNUZ pair.
FP8_DTYPES = (*MAX, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# Mantissa bits and the smallest normal exponent of each format.
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}


def fp8_operand(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The value an FP8 GEMM sees for ``x`` cast with ``scale``: saturate, round, unscale; float64."""
    q = (x.double() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() / scale


def gemm_error_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     bias: torch.Tensor = None, bf16_gemm: bool = False) -> torch.Tensor:
    """Per-element bound on |fl(a @ b.T + bias) - (a @ b.T + bias)| for float32 accumulation.

    ``a`` ``[M, K]`` and ``b`` ``[N, K]`` are float64 copies of the dequantized FP8 operands (their
    products are exact in float32). Summing K products in float32, in any order, errs by at most
    gamma_K * sum_k |a_ik b_jk| with gamma_K = K u / (1 - K u), u = 2^-24 (Higham, "Accuracy and
    Stability of Numerical Algorithms", 3.1); the bias add and the rounding to ``out_dtype`` add
    one rounding each of the result (u = 2^-24 float32, 2^-8 bfloat16, 2^-11 float16).

    ``bf16_gemm``: the BF16 emulation (numerics/cpu_emulation.py), which rounds each sum of raw
    products once to bfloat16 before the scales and the bias are applied: :func:`bf16_rounding`.
    """
    k = a.shape[1] + (1 if bias is not None else 0)
    u32 = 2.0**-24
    gamma = k * u32 / (1 - k * u32)
    magnitude = a.abs() @ b.abs().t() + (bias.abs() if bias is not None else 0)
    exact = a @ b.t() + (bias if bias is not None else 0)
    u_out = {torch.float32: u32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 0.0}[out_dtype]
    bound = gamma * magnitude + (u_out + u32) * exact.abs()
    if bf16_gemm:
        bound = bound + bf16_rounding(a @ b.t(), gamma * magnitude, magnitude) * (1 + u_out + u32)
    return bound


def bf16_rounding(product: torch.Tensor, accumulation: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """The BF16 emulation's one more rounding, as a bound: the float32 sum of the raw products
    (within ``accumulation`` of the scaled ``product``, the GEMM without bias) rounded to
    bfloat16 (unit roundoff 2^-8), then multiplied by the float32 product of the two scales
    (two roundings of 2^-24 each, taken on ``magnitude``, the sum of |products|)."""
    return 2.0**-8 * (product.abs() + accumulation) + 4 * 2.0**-24 * magnitude


def scaled_gemm_error_bound(data_a: torch.Tensor, scale_a: float, data_b: torch.Tensor, scale_b: float,
                            out_dtype: torch.dtype = torch.float32, bias: torch.Tensor = None,
                            bf16_gemm: bool = False) -> torch.Tensor:
    """Per-element bound on |got - exact| for an FP8 GEMM with any float32 scales, on either path.

    ``data_a`` ``[M, K]`` and ``data_b`` ``[N, K]`` are the FP8 data, ``scale_a`` / ``scale_b``
    the float32 ``scale_inv`` values, ``bias`` ``[N]`` the bias as the epilogue adds it (already
    rounded to the output dtype); exact = (data_a scale_a) (data_b scale_b)^T + bias, in float64.

    Either path rounds each product at most three times beyond a float32 dot product of K + 1
    terms: the emulation rounds both dequantized operands (2u) and their product; oneDNN rounds
    scale_a * scale_b and the scaled accumulator. So the float32 result s before the output
    rounding satisfies |s - exact| <= E = (gamma_{K+1} + 3u + u^2) * m, with
    m = sum_k |a_ik b_jk| + |bias_j| and u = 2^-24 (Higham, "Accuracy and Stability of Numerical
    Algorithms", 3.1 and lemma 3.3). The cast to ``out_dtype`` adds u_out * |s| <=
    u_out * (|exact| + E), and half the smallest subnormal of float16. The float64 reference
    itself errs by at most gamma64_{K+1} * m, added too. ``bf16_gemm``: the BF16 emulation's
    rounding of each raw sum (:func:`bf16_rounding`) comes before the cast.
    """
    a = data_a.double() * scale_a
    b = data_b.double() * scale_b
    k = a.shape[1] + 1
    u32, u64 = 2.0**-24, 2.0**-53
    magnitude = a.abs() @ b.abs().t() + (bias.double().abs() if bias is not None else 0)
    exact = a @ b.t() + (bias.double() if bias is not None else 0)
    before_cast = (k * u32 / (1 - k * u32) + 3 * u32 + u32**2) * magnitude
    if bf16_gemm:
        before_cast = before_cast + bf16_rounding(a @ b.t(), before_cast, magnitude)
    u_out = {torch.float32: u32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 0.0}[out_dtype]
    tiny = 2.0**-25 if out_dtype == torch.float16 else 0.0
    reference = 2 * k * u64 * magnitude
    return before_cast * (1 + u_out) + u_out * exact.abs() + tiny + reference


def cpu_scaled_mm_uses_onednn(dtype_a: torch.dtype, dtype_b: torch.dtype) -> bool:
    """Whether torch's CPU ``_scaled_mm`` hands this operand pairing to oneDNN on this machine.

    torch (aten/src/ATen/native/Blas.cpp, ``_scaled_mm_out_cpu``) calls oneDNN when mkldnn is
    enabled and the CPU has AMX-INT8 (equal formats) or AMX-FP16 (mixed formats); otherwise it
    dequantizes to float32 and runs one float32 GEMM, the computation of the emulation. Read
    from /proc/cpuinfo; where that cannot be read, True (assume oneDNN).
    """
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return True
    return ("amx_int8" if dtype_a == dtype_b else "amx_fp16") in flags


def assert_within_bound(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - expected| <= bound elementwise, with the worst offender in the message."""
    error = (got.double() - expected).abs()
    excess = error - bound
    worst = int(excess.argmax())
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} elements beyond the bound; worst at flat index {worst}: "
        f"error {error.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g}"
    )


def fp8_operand_fp32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value an FP8 GEMM sees for ``x`` cast with its own amax, computed as Transformer
    Engine's cast kernels compute it, in float32: scale = fp32(FP8_MAX / amax), each value
    fp32(x * scale) saturated and rounded to nearest even, read back times fp32(1 / scale);
    float64. Short inputs (BF16) often land exactly on a tie of the FP8 grid, where a float64
    scale (:func:`fp8_operand`) and a float32 one round apart."""
    amax = x.detach().abs().max().to(torch.float32)
    scale = torch.tensor(MAX[dtype], dtype=torch.float32) / amax
    q = (x.detach().to(torch.float32) * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() * (1.0 / scale).double()


def te_scale(amax: float, dtype: torch.dtype, margin: int = 0) -> float:
    """TE's formula, scale = (FP8_MAX / amax) / 2 ** margin."""
    return MAX[dtype] / amax / 2**margin


def train_losses(model, use_fp8: bool, steps: int = 6, lr: float = 1e-3, **batch) -> list[float]:
    """Losses of ``steps`` AdamW steps on one batch; FP8 on or off. The unconverted copy of a
    model trained this way is the reference the FP8 run is compared with.

    With FP8 on, every FP8 layer must run three FP8 GEMMs per step (forward, dgrad, wgrad): a
    layer that silently ran in high precision fails here."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    layers = sum(isinstance(m, fp.FP8Linear) for m in model.modules())
    losses = []
    with count_fp8_gemms() as gemms:
        for _ in range(steps):
            with fp.autocast(enabled=use_fp8):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert gemms.count == (steps * 3 * layers if use_fp8 else 0), (gemms.count, layers)
    return losses


class count_fp8_gemms:
    """Counts the FP8 GEMMs FP8 layers run (operands in an FP8 dtype) while the context is open.

    A model-level test that asserts ``count`` fails if its layers silently ran in high precision.
    """

    def __enter__(self):
        import fp8_plugin.modules.linear_function as linear

        self.count = 0
        self.dtypes = []  # dtype of each GEMM's first operand
        self._linear, self._original = linear, linear.fp8_gemm

        def counting(a, b, *args, **kwargs):
            if a.data.dtype in FP8_DTYPES and b.data.dtype in FP8_DTYPES:
                self.count += 1
                self.dtypes.append(a.data.dtype)
            return self._original(a, b, *args, **kwargs)

        linear.fp8_gemm = counting
        return self

    def __exit__(self, *exc):
        self._linear.fp8_gemm = self._original
        return False


def accumulator_scaled_mm(a, b, out_dtype: torch.dtype, bias=None, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b.T`` computed as oneDNN's CPU ``_scaled_mm`` (AMX CPUs) orders it: the FP8 values
    multiplied and summed unscaled in float32, then ``scale_a * scale_b`` applied to the
    accumulator, the bias (rounded to a low-precision ``out_dtype``) added, one final rounding.

    A kernel that computes otherwise than the emulation (which scales each operand first), for
    tests of the GEMM path choice on machines without AMX; same signature as
    ``fp8_plugin.numerics.gemm._scaled_mm_tensorwise`` (``fast_accum``, a GPU's, changes nothing
    in a float32 sum).
    """
    out = (a.data.float() @ b.data.float().t()) * (a.scale_inv * b.scale_inv)
    if bias is not None:
        out = out + bias.to(out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32).float()
    return out.to(out_dtype)


def assert_state_dicts_equal(expected: dict, got: dict) -> None:
    """Every entry of ``expected`` equals ``got``'s bit for bit: tensors, and the tensors of
    extra-state dicts (the FP8 scaling state); the failing key is named."""
    for key, value in expected.items():
        if isinstance(value, dict):
            assert all(torch.equal(value[k], got[key][k]) for k in value), key
        else:
            assert torch.equal(value, got[key]), key
