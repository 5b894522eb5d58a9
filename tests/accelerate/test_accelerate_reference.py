"""Reference checks on a model the FP8 Accelerator prepared: a check by hand, and the checks under
FSDP2 (refused under FSDP1).
"""

import pytest
import torch
from torch import nn

import fp8_plugin as fp
from fp8_plugin.accelerate import Accelerator
from fp8_plugin.modules.linear import FP8Linear
from fp8_plugin.numerics.recipes import GEMMS
from test_accelerate import batches, make_model

pytestmark = pytest.mark.usefixtures("fresh_accelerate")  # Accelerate's singletons afresh, as in test_accelerate.py

class _LossModel(nn.Module):
    """make_model() after a LayerNorm, returning its MSE loss as a transformers model returns
    ``.loss``; sharded, the norm's parameters are the root's own (gathered by its FSDP hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.norm = nn.LayerNorm(32)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(self.norm(x)).float(), y)


def test_a_check_by_hand_on_a_prepared_model_replays_in_fp8_and_in_high_precision():
    # The prepared model's forward enters the FP8 context itself; inside a check's replay it
    # leaves the check's FP8 switch alone (before, the reference replay ran in FP8 and the guard
    # against a check that cannot fail stopped it).
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    model = accelerator.prepare(_LossModel())
    x, y = batches(1)[0]
    result = fp.reference_check(model, (x, y), lambda m, batch: m(*batch), compute_dtype=torch.float32)
    assert set(result.layer_sqnr_db) == {"net.0", "net.2", "net.4"}
    assert all(0 < db < float("inf") for db in result.layer_sqnr_db.values())  # FP8 against high precision
    assert result.loss_fp8 != result.loss_reference
    plain = _LossModel()  # the same weights (make_model seeds), never converted: the reference's loss
    assert plain(x, y).item() == pytest.approx(result.loss_reference, rel=1e-6)


def test_reference_checks_run_under_fsdp2_and_are_refused_under_fsdp1(tmp_path, monkeypatch):
    # Accelerate never picks FSDP on CPUs (it keeps MULTI_CPU, i.e. DDP, whatever
    # ACCELERATE_USE_FSDP says): the construction check is called with the type a GPU run gets,
    # and FSDP2's sharding is applied by hand after prepare(), as Accelerate's FSDP2 applies it.
    # (FSDP1's FullyShardedDataParallel cannot be built on a CPU.)
    from accelerate.utils import DistributedType
    from fp8_plugin.accelerate.setup_checks import _check_reference_setup

    monkeypatch.setenv("ACCELERATE_FP8_REFERENCE_EVERY", "2")
    accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
    for allowed in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        _check_reference_setup(accelerator.fp8_settings, allowed)
    _check_reference_setup(accelerator.fp8_settings, DistributedType.FSDP, fsdp2=True)
    with pytest.raises(ValueError, match="FP8 reference checks \\(ACCELERATE_FP8_REFERENCE_EVERY=2\\) are not "
                                         "supported with distributed_type=FSDP.*FSDP1 \\(fsdp_version: 1\\) does "
                                         "not make.*Valid set-ups: one process, DDP.*FSDP2"):
        _check_reference_setup(accelerator.fp8_settings, DistributedType.FSDP)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # FSDP2: the same two steps (a check at step 2) on the model sharded and not.
        figures = {}
        for sharded in (True, False):
            accelerator = Accelerator(mixed_precision="fp8", fp8_compute_dtype=torch.float32)
            model = accelerator.prepare(_LossModel())
            if sharded:
                for layer in model.net:
                    if isinstance(layer, FP8Linear):
                        fully_shard(layer)
                fully_shard(model)
            optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
            for x, y in batches(2):
                accelerator.backward(model(x, y))
                optimizer.step()
                optimizer.zero_grad()
            (result,) = accelerator.fp8_runs[0].reference.results
            figures[sharded] = result
            weight = model.net[2].weight
            figures[sharded].weight = (weight.full_tensor() if sharded else weight).detach().clone()
        # One rank: FSDP's reduce-scatter hands each gradient on as it is, so the figures are the
        # unsharded model's (up to float64 summation order: 4 gamma_n, as tests/training/test_reference_fsdp.py
        # derives, n < 5000 elements: under 3e-12) and training is unchanged.
        got, expected = figures[True], figures[False]
        assert got.layer_sqnr_db.keys() == {"net.0", "net.2", "net.4"} and got.gemm_sqnr_db["net.2"].keys() == set(GEMMS)
        assert got.grad_cosine == pytest.approx(expected.grad_cosine, rel=0, abs=3e-12)
        assert got.loss_fp8 == expected.loss_fp8 and got.loss_reference == expected.loss_reference
        assert got.layer_sqnr_db == pytest.approx(expected.layer_sqnr_db, rel=1e-6)
        assert torch.equal(got.weight, expected.weight)
    finally:
        dist.destroy_process_group()
