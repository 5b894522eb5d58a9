"""A real Accelerate loop with fp8_plugin.accelerate.Accelerator, started by the tests under
``accelerate launch`` (one process, config file) or torchrun (two processes, the environment
``accelerate launch`` would set). Writes what it saw to ``<out>/rank<R>.pt``. The model returns
its loss (``{"loss": ...}``) when given targets, so that the BF16 reference checks (config keys
``reference_every`` / ``reference_policy``) can replay it; the run ends with ``end_training()``.

    python accelerate_worker.py <out> [--steps N] [--grad-accum K]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import fp8_plugin.modules.linear_function
from amax_reductions import MAX_ALL_REDUCES  # counts every amax all-reduce
from fp8_plugin.accelerate import Accelerator
from fp8_plugin.modules.linear import FP8Linear
from dist_teardown import tear_down_process_group  # noqa: E402

FP8_GEMMS = [0]
_fp8_gemm = fp8_plugin.modules.linear_function.fp8_gemm


def _counting_gemm(*args, **kwargs):
    FP8_GEMMS[0] += 1
    return _fp8_gemm(*args, **kwargs)


fp8_plugin.modules.linear_function.fp8_gemm = _counting_gemm


class Net(nn.Sequential):
    """The layers of the tests' Sequential (names 0, 2, 4); with targets, ``{"loss", "output"}``."""

    def forward(self, x, y=None):
        out = super().forward(x)
        return out if y is None else {"loss": nn.functional.mse_loss(out.float(), y), "output": out}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    n = 16 * args.steps * args.grad_accum * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(n, 32, generator=generator) * 3,
                                          torch.randn(n, 16, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, reduces_per_step = [], []
    seen = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, y)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if accelerator.sync_gradients:
            reduces_per_step.append(MAX_ALL_REDUCES[seen:])
            seen = len(MAX_ALL_REDUCES)
    train_gemms = FP8_GEMMS[0]

    model.eval()
    with torch.no_grad():
        model(x)
    eval_gemms = FP8_GEMMS[0] - train_gemms

    layers = {name: m for name, m in accelerator.unwrap_model(model).named_modules() if isinstance(m, FP8Linear)}
    settings = accelerator.fp8_settings
    result = {
        "recipe": repr(settings.recipe),
        "resolved_recipe": repr(next(iter(layers.values())).recipe) if layers else None,
        "include": settings.include,
        "exclude": settings.exclude,
        "compute_dtype": str(settings.compute_dtype),
        "use_autocast_during_eval": settings.use_autocast_during_eval,
        "mixed_precision": accelerator.mixed_precision,
        "fp8_layers": sorted(layers),
        "history_len": {name: m.fp8_state.amax_history.shape[-1] for name, m in layers.items()},
        "fp8_state": {name: {k: v.clone() for k, v in m.fp8_state.get_extra_state().items()}
                      for name, m in layers.items()},
        "weights": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "losses": losses,
        "max_all_reduces": reduces_per_step,
        "train_fp8_gemms": train_gemms,
        "eval_fp8_gemms": eval_gemms,
        "world_size": accelerator.num_processes,
        "reference_check": repr(settings.reference_check),
        "reference_sources": {k: v for k, v in settings.sources.items() if k.startswith("reference")},
        "reference_results": [r.to_dict() for r in accelerator.fp8_runs[0].reference.results]
        if accelerator.fp8_runs[0].reference is not None else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{accelerator.process_index}.pt")
    tear_down_process_group()  # before Accelerate's destroy, which frees nothing first
    accelerator.end_training()  # the reference checks' summary, printed by the main process


if __name__ == "__main__":
    sys.exit(main())
