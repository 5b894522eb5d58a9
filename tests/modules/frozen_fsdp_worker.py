"""One rank of tests/modules/test_frozen_fsdp.py (the ``frozen-lora-fsdp2`` scenario of the shared
two-rank launch): PEFT LoRA over a tiny Llama whose base weights are kept only in FP8, sharded by
FSDP2, against the same model unsharded on the whole batch, and resumed from a distributed
checkpoint.

Writes ``<out>/<run>-rank<r>.pt`` for the runs ``sharded`` (FSDP2, each rank half of every
global batch), ``unsharded`` (no FSDP, the whole global batch, on every rank) and ``resumed``
(FSDP2 from the checkpoint ``sharded`` saved after ``SAVE_AT`` steps): per-step losses (the
global batch's mean), the full adapter weights, the full frozen FP8 bytes and scales, the frozen
bytes each rank holds, and the dtypes FSDP2's all-gather saw for the frozen weights.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import fp8_plugin
from fp8_plugin import FP8Linear

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 4, 2, 4, 16


def lora_model() -> torch.nn.Module:
    """Two decoder layers (dims multiples of 128), LoRA rank 8 on every projection, the base
    frozen by PEFT before the conversion, so kept only in FP8."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=384, vocab_size=300,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    report = fp8_plugin.convert_model(model, fp8_plugin.Float8CurrentScaling())
    assert len(report.frozen) == 14, report
    return model


def frozen_layers(model) -> dict[str, FP8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear) and m.frozen_layout is not None}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full_bytes(t: torch.Tensor) -> torch.Tensor:
    # An FP8 weight's full bytes: gloo has no float8 collectives, so its shards travel as uint8.
    if not hasattr(t, "full_tensor"):
        return t.detach().view(torch.uint8).clone()
    from torch.distributed.tensor import DTensor

    local = t.to_local().detach().view(torch.uint8)
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def batches(rank: int, world: int, sharded: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, 300, (GLOBAL_BATCH, SEQ), generator=gen)
        per_rank = GLOBAL_BATCH // world
        out.append(ids[rank * per_rank:(rank + 1) * per_rank] if sharded else ids)
    return out


def shard(model, mesh) -> None:
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model, steps: range, data: list[torch.Tensor], optimizer, sharded: bool) -> list[float]:
    """``sharded``: this rank's part of each global batch (FSDP2 averages the ranks' gradients).
    Else the whole global batch as the ranks' parts in turn, each a micro-batch of half the loss:
    the same casts as the ranks' (current scaling takes each part's own amax), so the two runs
    differ only in the order of the sums."""
    world = dist.get_world_size()
    losses = []
    for step in steps:
        parts = [data[step]] if sharded else data[step].chunk(world)
        value = torch.zeros(())
        for ids in parts:
            with fp8_plugin.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            (loss / len(parts)).backward()
            value += loss.detach() / len(parts)
        optimizer.step()
        optimizer.zero_grad()
        if sharded:  # every rank's part mean -> the global batch's mean (equal token counts)
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def record(model, losses: list[float], gathered: list) -> dict:
    layers = frozen_layers(model)
    return {
        "losses": losses,
        "adapters": {n: _full(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "frozen": {n: (_full_bytes(m.weight), _full(m.weight_scale_inv).detach().clone()) for n, m in layers.items()},
        "frozen_bytes_here": sum(_local(m.weight).numel() * _local(m.weight).element_size()
                                 + _local(m.weight_scale_inv).numel() * 4 for m in layers.values()),
        "frozen_values": sum(m.weight.numel() for m in layers.values()),
        "gathered_dtypes": sorted(set(gathered)),
    }


def run(out: Path) -> None:
    if not dist.is_initialized():  # the launch's earlier scenarios may have made it already
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = lora_model()
    mesh = init_device_mesh("cpu", (world,))

    # Unsharded, the whole global batch: the reference every rank computes alike.
    model = copy.deepcopy(initial)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = train(model, range(STEPS), batches(rank, world, False), optimizer, sharded=False)
    torch.save(record(model, losses, []), out / f"unsharded-rank{rank}.pt")

    # FSDP2: each rank half of each global batch; a distributed checkpoint after SAVE_AT steps.
    model = copy.deepcopy(initial)
    gathered = []
    for m in frozen_layers(model).values():  # what the forward sees: the gathered weight's dtype
        m.register_forward_pre_hook(lambda mod, args: gathered.append(str(mod.weight.dtype)))
    shard(model, mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = batches(rank, world, True)
    losses = train(model, range(SAVE_AT), data, optimizer, sharded=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(out / "dcp"))
    losses += train(model, range(SAVE_AT, STEPS), data, optimizer, sharded=True)
    torch.save(record(model, losses, gathered), out / f"sharded-rank{rank}.pt")

    # Resumed: a fresh sharded model and optimizer, the checkpoint loaded, the last steps again.
    model = copy.deepcopy(lora_model())
    shard(model, mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train(model, range(1), data, optimizer, sharded=True)  # moves the weights: the load must put them back
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    losses = train(model, range(SAVE_AT, STEPS), data, optimizer, sharded=True)
    torch.save(record(model, losses, []), out / f"resumed-rank{rank}.pt")
