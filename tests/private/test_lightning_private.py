"""fp8_plugin/_private/lightning_api.py: the private Lightning detail behaves as the package assumes,
and the FP8 plugin says at start-up that a spawned strategy does not hand back the FP8 state."""

import lightning as L
import pytest
import torch
from torch import nn

from fp8_plugin._private.lightning_api import spawns_workers
from fp8_plugin.lightning import FP8Precision


@pytest.mark.parametrize("strategy, spawned", [("ddp_spawn", True), ("ddp_fork", True), ("ddp", False),
                                               ("auto", False)])
def test_start_method_attribute_tells_spawned_strategies(strategy, spawned):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2 if strategy != "auto" else 1, logger=False)
    if strategy.startswith("ddp"):
        assert hasattr(trainer.strategy, "_start_method"), "Lightning renamed DDPStrategy._start_method"
    assert spawns_workers(trainer.strategy) is spawned


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def test_plugin_warns_under_ddp_spawn_that_the_fp8_state_stays_with_the_workers():
    # convert_module is what the worker runs at set-up; here with the spawn strategy's Trainer.
    trainer = L.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, logger=False)
    module = Module()
    module.trainer = trainer
    with pytest.warns(UserWarning, match=r"after fit, the model in the main process has the trained weights .* but "
                                         r"not the FP8 scaling state"):
        FP8Precision(compute_dtype=torch.float32).convert_module(module)
    module = Module()
    module.trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*spawned strategy.*")
        FP8Precision(compute_dtype=torch.float32).convert_module(module)
