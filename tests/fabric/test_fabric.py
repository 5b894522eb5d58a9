"""fp8_plugin/fabric/precision.py: Lightning Fabric with FP8, single process, real Fabric on CPU."""

import lightning as L
import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.modules.convert import fp8_state_dict
from fp8_plugin.fabric import FP8Precision
from reference import count_fp8_gemms

STEPS = 4


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _batches(n=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen) * 3, torch.randint(0, 4, (16,), generator=gen)) for _ in range(n)]


def _fabric_run(fabric, model, batches):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_fabric_precision_string_trains_in_fp8_like_the_plain_pytorch_loop():
    fabric = L.Fabric(precision="fp8-hybrid", accelerator="cpu", devices=1)
    assert isinstance(fabric._precision, FP8Precision)
    with count_fp8_gemms() as gemms:
        model, _, losses = _fabric_run(fabric, _mlp(), _batches())
    # 2 FP8 layers (the 4-output head stays high precision), forward, dgrad (not the first
    # layer's: its input needs none) and wgrad, every step.
    assert gemms.count == STEPS * (3 + 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The same step written by hand: BF16 autocast, fp8_plugin.autocast, settle after the step.
    ref = _mlp()
    fp.convert_model(ref)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expected = []
    for x, y in _batches():
        with torch.autocast("cpu", dtype=torch.bfloat16), fp.autocast():
            loss = nn.functional.cross_entropy(ref(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp.update_pending_scales(ref)
        expected.append(loss.item())
    assert losses == expected
    for layer in (0, 2):
        assert not model.module[layer].fp8_state.pending  # settled after every step


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path):
    batches = _batches(6)
    fabric = L.Fabric(precision="fp8-hybrid", accelerator="cpu", devices=1)
    model, opt, _ = _fabric_run(fabric, _mlp(), batches[:3])
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    for x, y in batches[3:]:
        fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()

    fabric2 = L.Fabric(precision="fp8-hybrid", accelerator="cpu", devices=1)
    model2 = _mlp()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2, opt2 = fabric2.setup(model2, opt2)
    fabric2.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})
    for x, y in batches[3:]:
        fabric2.backward(nn.functional.cross_entropy(model2(x).float(), y))
        opt2.step()
        opt2.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        if isinstance(a, dict):  # an FP8 layer's scaling state
            for key in a:
                assert torch.equal(a[key], b[key]), (name, key)
        else:
            assert torch.equal(a, b), name
    assert fp8_state_dict(model.module).keys() == {"0.fp8_state._extra_state", "2.fp8_state._extra_state"}


def test_fabric_plugin_object_and_bad_strings():
    recipe = fp.Float8CurrentScaling()
    fabric = L.Fabric(plugins=[FP8Precision(recipe, compute_dtype=torch.float32)], accelerator="cpu", devices=1)
    model, _, _ = _fabric_run(fabric, _mlp(), _batches(2))
    assert all(m.recipe is recipe for m in model.modules() if isinstance(m, fp.FP8Linear))
    assert fabric._precision.report.recipe is recipe
    with pytest.raises(ValueError, match="precision='fp8-foo' is not a valid FP8 precision; valid: fp8-hybrid"):
        L.Fabric(precision="fp8-foo", accelerator="cpu")
    with pytest.raises(ValueError, match="choose one"):
        L.Fabric(precision="fp8-hybrid", plugins=[FP8Precision()], accelerator="cpu")
    with pytest.raises(ValueError, match="compute_dtype=torch.int8"):
        FP8Precision(compute_dtype=torch.int8)


def test_each_loop_refuses_the_other_loops_fp8_plugin_when_built():
    """The Trainer's plugin is a Fabric Precision too: Fabric used to accept it and fail at the
    first backward inside Lightning. Both loops now refuse the other's plugin at construction,
    naming the class to use."""
    with pytest.raises(TypeError, match=r"fp8_plugin\.fabric\.FP8Precision"):
        L.Fabric(accelerator="cpu", devices=1, plugins=[fp.FP8Precision()])
    with pytest.raises(TypeError, match=r"fp8_plugin\.FP8Precision"):
        L.Trainer(accelerator="cpu", devices=1, plugins=FP8Precision(), logger=False, enable_checkpointing=False)


def test_fabric_with_fp8_adamw_trains_in_fp8_and_resumes_bit_for_bit(tmp_path):
    from fp8_plugin.optim import FP8AdamW

    def run(model, batches, load=None, save=None):
        fabric = L.Fabric(precision="fp8-hybrid", accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, FP8AdamW(model.parameters(), lr=1e-2))
        if load:
            fabric.load(load, {"model": model, "optimizer": opt})
        for i, (x, y) in enumerate(batches):
            fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
            opt.step()
            opt.zero_grad()
            if save and i == 2:
                fabric.save(save, {"model": model, "optimizer": opt})
        return model, opt

    batches = _batches(6)
    with count_fp8_gemms() as gemms:
        full, opt = run(_mlp(), batches, save=tmp_path / "ckpt")
    assert gemms.count == 6 * (3 + 2)
    assert opt.state[full.module[2].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    resumed, _ = run(_mlp(), batches[3:], load=tmp_path / "ckpt")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
