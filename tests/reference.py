"""Independent float64 references written from the specs, for the tests only."""

import torch

import fp8_plugin as fp

# Devices the device-parametrized tests run on: the CPU always, a CUDA GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# OCP OFP8 rev 1.0, table 1.
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}
# Mantissa bits and the smallest normal exponent of each format.
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}


def fp8_operand(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The value an FP8 GEMM sees for ``x`` cast with ``scale``: saturate, round, unscale; float64."""
    q = (x.double() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() / scale


def te_scale(amax: float, dtype: torch.dtype, margin: int = 0) -> float:
    """TE's formula, scale = (FP8_MAX / amax) / 2 ** margin."""
    return MAX[dtype] / amax / 2**margin


def train_losses(model, use_fp8: bool, steps: int = 6, lr: float = 1e-3, **batch) -> list[float]:
    """Losses of ``steps`` AdamW steps on one batch; FP8 on or off. The unconverted copy of a
    model trained this way is the reference the FP8 run is compared with."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        with fp.autocast(enabled=use_fp8):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
