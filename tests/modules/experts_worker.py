"""One rank of the 2-rank FP8 MoE test (tests/modules/test_experts_distributed.py), started by torchrun.

Trains a tiny Mixtral with a real Lightning Trainer (DDP or FSDP2, gloo,
``precision="fp8-hybrid"``), each rank on its own samples, and writes ``<out>/<scenario>-rank<r>.pt``: the experts' FP8 scaling
state, the losses, the MAX all-reduces issued per step and the grouped FP8 GEMMs run.

    python -m torch.distributed.run --nproc_per_node 2 tests/modules/experts_worker.py {ddp,fsdp2} OUT
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

import fp8_plugin  # noqa: E402,F401  (registers the precision strings)
from amax_reductions import MAX_ALL_REDUCES  # noqa: E402  (counts every amax all-reduce)
from fp8_plugin.modules.experts import FP8ExpertsMixin, expert_gemm_counts  # noqa: E402
from dist_teardown import tear_down_process_group  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 4


class MoE(L.LightningModule):
    def __init__(self, fsdp2: bool = False) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        torch.manual_seed(0)
        self.model = MixtralForCausalLM(MixtralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            # Convert before sharding: FSDP2 hooks belong to the module objects it shards.
            self.trainer.precision_plugin.convert_module(self)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.model(batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Record(Callback):
    def __init__(self) -> None:
        self.losses, self.max_all_reduces, self.gemms = [], [], []
        self._seen = len(MAX_ALL_REDUCES)  # this fit's own, whatever ran before in the process
        self._gemms = expert_gemm_counts()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.max_all_reduces.append(MAX_ALL_REDUCES[self._seen:])
        self._seen = len(MAX_ALL_REDUCES)
        now = expert_gemm_counts()
        self.gemms.append({k: now[k] - self._gemms[k] for k in now})
        self._gemms = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["ddp", "fsdp2"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    run(args.scenario, args.out)
    tear_down_process_group()


def run(scenario: str, out: Path) -> None:
    """One scenario (``"ddp"`` or ``"fsdp2"``) into ``out`` (also within tests/training/distributed_worker.py's launch)."""
    fsdp2 = scenario == "fsdp2"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ids = torch.randint(0, 128, (STEPS * GLOBAL_BATCH, 9), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(ids)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    record = Record()
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if fsdp2 else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="fp8-hybrid", max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[record], use_distributed_sampler=False)
    module = MoE(fsdp2)
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler))
    state = {}
    for name, m in module.named_modules():
        if isinstance(m, FP8ExpertsMixin):
            for proj, members in m.fp8_scaling.items():
                for e, member in enumerate(members):
                    s = member.fp8_state
                    state[f"{name}.{proj}.{e}"] = {k: v.clone() for k, v in s.tensors().items()}
                    state[f"{name}.{proj}.{e}"]["pending"] = torch.tensor(sorted(s.pending))
    result = {"experts_state": state, "losses": record.losses, "max_all_reduces": record.max_all_reduces,
              "gemms": record.gemms, "report": str(trainer.precision_plugin.report)}
    torch.save(result, out / f"{scenario}-rank{rank}.pt")


if __name__ == "__main__":
    main()
