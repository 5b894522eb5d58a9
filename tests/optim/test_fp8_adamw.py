"""FP8AdamW (fp8_plugin/optim/fp8_adamw.py) against torch's own AdamW and the moment format's spec.

The optimizer claims that its step is torch.optim.AdamW's, computed from the stored moments, and
that only the stored moments' rounding differs. So each step is checked bit for bit against a
torch AdamW started from FP8AdamW's own (dequantized, exactly representable) moments, and the
moments it stores against the spec's rounding of torch's FP32 moments (E4M3 per block of 128,
test_moment_blocks.reference; BF16 round to nearest even).
"""

import io

import pytest
import torch
from torch import nn

from fp8_plugin.optim import FP8AdamW, fp8_adamw
from fp8_plugin.optim.moment_blocks import BLOCK
from test_moment_blocks import reference

HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 3))  # 1000 + 40, 120 + 3 elements


def grads_for(net, step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 24, generator=g), torch.randn(16, 3, generator=g)
    net.zero_grad(set_to_none=True)
    ((net(x) - y) ** 2).mean().backward()


@pytest.mark.parametrize("chunk", [None, 2 * BLOCK], ids=["whole", "in-chunks"])
def test_each_step_is_torch_adamw_from_the_stored_moments_and_stores_them_as_the_spec_rounds(chunk, monkeypatch):
    if chunk:  # the 960-element weight updated in pieces of 256, 256, 256 and 192 elements
        monkeypatch.setattr(fp8_adamw, "STEP_CHUNK", chunk)
    net = model()
    opt = FP8AdamW(net.parameters(), **HYPER)
    for step in range(5):
        twin = model()
        twin.load_state_dict(net.state_dict())
        torch_opt = torch.optim.AdamW(twin.parameters(), foreach=False, **HYPER)
        if step:
            torch_opt.load_state_dict(opt.torch_adamw_state_dict())
        grads_for(net, step)
        grads_for(twin, step)
        opt.step()
        torch_opt.step()
        for p, q in zip(net.parameters(), twin.parameters()):
            assert torch.equal(p, q), step  # the update: torch's, bit for bit
            mine, theirs = opt.state[p], torch_opt.state[q]
            values, scale_inv = reference(theirs["exp_avg"])
            assert torch.equal(mine["exp_avg"].double(), values)
            assert torch.equal(mine["exp_avg_scale_inv"], scale_inv)
            assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"].to(torch.bfloat16))
            assert float(mine["step"]) == float(theirs["step"]) == step + 1
    assert any(not torch.equal(opt.state[p]["exp_avg"].float(), torch_opt.state[q]["exp_avg"])
               for p, q in zip(net.parameters(), twin.parameters()))  # FP8 storage did round


@pytest.mark.parametrize("chunk", [2**12, 2**20], ids=["in-chunks", "whole"])
def test_the_steps_temporaries_are_bounded_by_the_chunk_not_the_parameter(chunk, monkeypatch):
    # Traced on meta tensors (shapes and lifetimes, no data): the bytes a second step allocates
    # beyond the parameter, its gradient and the states. Its FP32 temporaries (the widened
    # moments, the denominator, the scaled blocks) are a few at a time: at most 8 x 4 bytes per
    # element of a piece, and at least 4 x 4 (the two moments widened, the square root, the
    # denominator); with no pieces, the piece is the whole parameter.
    from fp8_plugin.tools.memory_trace import MemoryTrace

    monkeypatch.setattr(fp8_adamw, "STEP_CHUNK", chunk)
    numel = 2**16
    p = nn.Parameter(torch.empty(numel // 64, 64, device="meta"))
    p.grad = torch.empty_like(p)
    opt = FP8AdamW([p])
    opt.step()  # the states exist from here on
    with MemoryTrace("meta") as trace:
        for tensor in (p, p.grad, *opt.state[p].values()):
            trace.register(tensor, "parameters")
        trace.reset_peak()
        held = trace.live_bytes
        opt.step()
        temporaries = trace.peak().bytes - held
    piece = min(chunk, numel)
    assert 4 * 4 * piece <= temporaries <= 8 * 4 * piece


def test_state_formats_and_bytes_per_parameter():
    net = model()
    opt = FP8AdamW(net.parameters())
    grads_for(net, 0)
    opt.step()
    numel = sum(p.numel() for p in net.parameters())
    blocks = sum(-(-p.numel() // BLOCK) for p in net.parameters())
    for p in net.parameters():
        s = opt.state[p]
        assert (s["exp_avg"].dtype, s["exp_avg_sq"].dtype, s["exp_avg_scale_inv"].dtype) == (
            torch.float8_e4m3fn, torch.bfloat16, torch.float32)
        assert s["exp_avg"].shape == s["exp_avg_sq"].shape == p.shape
    # 1 byte (E4M3) + 2 (BF16) per element, 4 per block scale, 4 per step counter.
    assert opt.state_bytes() == 3 * numel + 4 * blocks + 4 * len(list(net.parameters()))
    assert opt.state_bytes() / numel <= 3.1
    torch_opt = torch.optim.AdamW(net.parameters())
    torch_opt.step()
    torch_bytes = sum(t.numel() * t.element_size() for s in torch_opt.state.values() for t in s.values())
    assert torch_bytes == 8 * numel + 4 * 4  # torch's: two FP32 moments


def test_resume_from_a_saved_state_is_bit_for_bit():
    full = model()
    full_opt = FP8AdamW(full.parameters(), **HYPER)
    for step in range(6):
        grads_for(full, step)
        full_opt.step()
    first = model()
    first_opt = FP8AdamW(first.parameters(), **HYPER)
    for step in range(3):
        grads_for(first, step)
        first_opt.step()
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = model(seed=7)
    resumed.load_state_dict(saved["model"])
    resumed_opt = FP8AdamW(resumed.parameters(), **HYPER)
    resumed_opt.load_state_dict(saved["optimizer"])
    assert resumed_opt.state[resumed[0].weight]["exp_avg"].dtype == torch.float8_e4m3fn  # not widened on load
    for step in range(3, 6):
        grads_for(resumed, step)
        resumed_opt.step()
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_scale_inv", "exp_avg_sq", "step"):
            assert torch.equal(full_opt.state[p][key].float(), resumed_opt.state[q][key].float()), key


def test_torch_adamw_states_go_both_ways():
    net = model()
    torch_opt = torch.optim.AdamW(net.parameters(), **HYPER)
    for step in range(2):
        grads_for(net, step)
        torch_opt.step()
    opt = FP8AdamW(net.parameters(), **HYPER)
    opt.load_state_dict(torch_opt.state_dict())  # torch's FP32 moments rounded into the format
    for p in net.parameters():
        values, scale_inv = reference(torch_opt.state[p]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg"].double(), values)
        assert torch.equal(opt.state[p]["exp_avg_scale_inv"], scale_inv)
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[p]["exp_avg_sq"].to(torch.bfloat16))
    back = torch.optim.AdamW(net.parameters(), **HYPER)
    back.load_state_dict(opt.torch_adamw_state_dict())
    for p in net.parameters():
        values, scale_inv = reference(torch_opt.state[p]["exp_avg"])
        per_element = scale_inv.double().repeat_interleave(BLOCK)[: p.numel()].view(p.shape)
        assert back.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(back.state[p]["exp_avg"], (values * per_element).float())
        assert float(back.state[p]["step"]) == 2
    assert back.param_groups[0]["betas"] == HYPER["betas"] and "exp_avg_sq_dtype" not in back.param_groups[0]


def test_bfloat16_parameters_and_a_float32_second_moment():
    net = model().to(torch.bfloat16)
    opt = FP8AdamW(net.parameters(), exp_avg_sq_dtype=torch.float32)
    before = [p.clone() for p in net.parameters()]
    g = torch.Generator().manual_seed(1)
    net(torch.randn(4, 24, generator=g).bfloat16()).float().square().mean().backward()
    opt.step()
    assert all(not torch.equal(a, p) and p.dtype == torch.bfloat16 for a, p in zip(before, net.parameters()))
    assert opt.state[net[0].weight]["exp_avg_sq"].dtype == torch.float32


def test_bad_input_is_refused_with_the_setting_named():
    net = model()
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported; valid: amsgrad=False"):
        FP8AdamW(net.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match=r"fused=True is not supported"):
        FP8AdamW(net.parameters(), fused=True)
    with pytest.raises(ValueError, match=r"exp_avg_sq_dtype=torch.float16 is not supported; valid: torch.bfloat16"):
        FP8AdamW(net.parameters(), exp_avg_sq_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"invalid learning rate lr=-1.0"):
        FP8AdamW(net.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match=r"invalid beta parameter at index 1: 1.0"):
        FP8AdamW(net.parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"parameter 0 has dtype torch.int64; valid: a floating-point parameter"):
        FP8AdamW([nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
    opt = FP8AdamW(net.parameters())
    grads_for(net, 0)
    net[2].bias.grad[1] = float("inf")
    before = [p.clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"the gradient of parameter 3 .* holds a NaN or an infinity; nothing was "
                                         r"updated"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters())) and not opt.state  # nothing moved
    grads_for(net, 0)
    net[0].weight.grad[3, 5] = float("nan")  # a NaN alone, among finite values: no max may drop it
    with pytest.raises(ValueError, match=r"the gradient of parameter 0 .* holds a NaN or an infinity"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters())) and not opt.state
    net.zero_grad()
    emb = nn.Embedding(10, 4, sparse=True)
    sparse_opt = FP8AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        sparse_opt.step()
    amsgrad = torch.optim.AdamW(net.parameters(), amsgrad=True)
    net.zero_grad()
    grads_for(net, 0)
    amsgrad.step()
    with pytest.raises(ValueError, match=r"amsgrad=True; FP8AdamW keeps no max_exp_avg_sq"):
        FP8AdamW(net.parameters()).load_state_dict(amsgrad.state_dict())
    state = FP8AdamW(net.parameters())
    state.step()
    saved = state.state_dict()
    saved["state"][0]["exp_avg_scale_inv"] = saved["state"][0]["exp_avg_scale_inv"][:1]
    with pytest.raises(ValueError, match=r"parameter 0 has 1 block scales; expected 8"):
        FP8AdamW(net.parameters()).load_state_dict(saved)
