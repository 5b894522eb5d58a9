"""One rank of tests/modules/test_fsdp_fp8.py, started by torchrun: an MLP sharded by FSDP2 trains a few
steps with its FP8 layers' weights all-gathered in FP8, and again in their own dtype.

Writes ``<out>/<run>-rank<r>.pt``: per-step losses, the full weights after training, and what
each FP8 layer's forward saw as its weight (type and payload dtype).

    python -m torch.distributed.run --nproc_per_node 2 tests/modules/fsdp_fp8_worker.py RECIPE OUT
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin import FP8Linear  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

RECIPES = {"current": fp8_plugin.Float8CurrentScaling(), "delayed": fp8_plugin.DelayedScaling()}
STEPS = 4


def train(recipe, fp8_all_gather: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16))
    fp8_plugin.convert_model(model, recipe)
    if fp8_all_gather:
        assert fp8_plugin.enable_fp8_all_gather(model) == 3
    seen = []
    for layer in model:
        if isinstance(layer, FP8Linear):
            layer.register_forward_pre_hook(
                lambda m, args: seen.append((type(m.weight).__name__, str(getattr(m.weight, "_data", m.weight).dtype)))
            )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, FP8Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reducer = fp8_plugin.amax_reducer()
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        x, target = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
        with fp8_plugin.autocast(reduce_amax=reducer):
            loss = nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    weights = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    weights = {name: (w._tensor if hasattr(w, "_tensor") else w).clone() for name, w in weights.items()}
    return {"losses": torch.stack(losses), "weights": weights, "seen": seen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    run(args.recipe, args.out)
    tear_down_process_group()


def run(recipe_name: str, out: Path) -> None:
    """Both gathers under ``RECIPES[recipe_name]`` into ``out`` (also within tests/training/distributed_worker.py's launch)."""
    rank = dist.get_rank()
    recipe = RECIPES[recipe_name]
    for name, fp8_all_gather in (("fp8-gather", True), ("hp-gather", False)):
        torch.save(train(recipe, fp8_all_gather), out / f"{name}-rank{rank}.pt")


if __name__ == "__main__":
    main()
