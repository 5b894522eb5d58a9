"""One rank of tests/modules/test_calibration_distributed.py, run in the shared two-rank launch
(tests/training/distributed_worker.py, scenario ``calibration``): each rank calibrates the same
model on its own batches; only rank 1's hold a massive activation.

Writes ``<out>/calibration-rank<r>.pt``: each FP8 layer's scaling state and choice, and the
calibration report's rows.
"""

import torch
import torch.distributed as dist
from torch import nn

import fp8_plugin


class TwoBranches(nn.Module):
    """Two FP8 candidate layers of 256 -> 32, each on its own input: ``forward(x, y)``."""

    def __init__(self):
        super().__init__()
        self.outliers = nn.Linear(256, 32)
        self.plain = nn.Linear(256, 32)

    def forward(self, x, y):
        return self.outliers(x), self.plain(y)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``rank``: 2 of (x, y), each 32 x 256, seeded by rank; rank 1's x holds one
    value 2^15 per batch (a massive activation of one token, one channel)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(2):
        x, y = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)
        if rank == 1:
            x[3, 7] = 2.0**15
        out.append((x, y))
    return out


def run(out) -> None:
    if not dist.is_initialized():  # the launch's earlier scenarios may have made it already
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on both ranks
    model = TwoBranches()
    fp8_plugin.convert_model(model, fp8_plugin.DelayedScaling(), skip_small=False)
    report = fp8_plugin.calibrate(model, batches(rank))
    torch.save({
        "states": {name: {k: t.clone() for k, t in getattr(model, name).fp8_state.tensors().items()}
                   for name in ("outliers", "plain")},
        "scaling": {name: getattr(model, name).fp8_scaling for name in ("outliers", "plain")},
        "rows": [r.__dict__ for r in report.layers],
    }, out / f"calibration-rank{rank}.pt")
