"""One rank of tests/training/test_statistics.py's reduction test, started by torchrun (gloo, CPU): an FP8
layer under current scaling sees rank-dependent inputs on a sampled step; writes the figures the
collector formed and the rank's input to ``<out>/rank<r>.pt``. With ``fsdp2`` the layer is
sharded by ``fully_shard`` first (its weight a DTensor between forwards).

    python -m torch.distributed.run --nproc_per_node 2 tests/training/statistics_worker.py [fsdp2] OUT
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin import FP8Linear, FP8Statistics  # noqa: E402
from fp8_plugin.modules.autocast import new_step_id  # noqa: E402
from fp8_plugin.training.statistics import StatisticsCollector  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402


def main(out: Path, fsdp2: bool) -> None:
    if not dist.is_initialized():  # else: run within tests/training/distributed_worker.py's launch
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, bias=False, recipe=fp8_plugin.Float8CurrentScaling())
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(layer)
        assert type(layer.weight).__name__ == "DTensor"
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 + rank)) * (1 + 3 * rank)
    collector = StatisticsCollector(FP8Statistics(every=1))
    collector.start_step(layer, 1)
    with fp8_plugin.autocast(step=new_step_id()):
        layer(x).sum().backward()
    collector.end_step()
    torch.save({"metrics": collector.pop_metrics(), "x": x}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[-1]), sys.argv[1:-1] == ["fsdp2"])
    tear_down_process_group()
