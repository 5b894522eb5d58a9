"""LoRA over base weights kept only in FP8, sharded by FSDP2 on two gloo ranks (the
``frozen-lora-fsdp2`` scenario of the shared launch, tests/modules/frozen_fsdp_worker.py)."""

import torch


def test_fsdp2_shards_the_frozen_fp8_bytes_gathers_them_as_fp8_and_trains_as_the_unsharded_model(distributed_runs):
    runs = distributed_runs("frozen-lora-fsdp2")
    r0, r1, whole = runs["sharded-rank0"], runs["sharded-rank1"], runs["unsharded-rank0"]
    # FSDP2 gathered the E4M3 bytes as they are: every frozen layer's forward saw an FP8 weight.
    assert r0["gathered_dtypes"] == r1["gathered_dtypes"] == ["torch.float8_e4m3fn"]
    # Each rank holds half the E4M3 bytes (1 byte per value) and every layer's 0-dim scale (nothing
    # to shard), against BF16's 2 bytes per value split over 2 ranks.
    values = r0["frozen_values"]
    assert whole["frozen_bytes_here"] == values + 14 * 4
    assert r0["frozen_bytes_here"] == r1["frozen_bytes_here"] == values // 2 + 14 * 4
    assert r0["frozen_bytes_here"] <= 0.55 * (2 * values / 2)
    # The frozen bytes never changed, and are those of the unsharded model (which never changed either).
    assert r0["frozen"].keys() == whole["frozen"].keys() and len(whole["frozen"]) == 14
    for name, (data, scale_inv) in whole["frozen"].items():
        assert torch.equal(r0["frozen"][name][0], data) and torch.equal(r1["frozen"][name][0], data), name
        assert torch.equal(r0["frozen"][name][1], scale_inv), name
    # The unsharded run takes each global batch as the ranks' parts in turn, each with half the
    # loss; FSDP2 averages the ranks' gradients: (g0 + g1) / 2 against g0 / 2 + g1 / 2, the same
    # numbers (halving is exact), and the same casts (each part's own current scale). So the
    # losses and the adapters are equal bit for bit, on both ranks.
    assert r0["losses"] == r1["losses"] == whole["losses"]
    assert r0["adapters"].keys() == whole["adapters"].keys() and len(whole["adapters"]) == 2 * 14
    for name, value in whole["adapters"].items():
        assert torch.equal(r0["adapters"][name], value) and torch.equal(r1["adapters"][name], value), name
    assert any(v.abs().sum() > 0 for n, v in whole["adapters"].items() if "lora_B" in n)  # they trained


def test_fsdp2_frozen_fp8_lora_resumes_from_a_distributed_checkpoint_bit_for_bit(distributed_runs):
    runs = distributed_runs("frozen-lora-fsdp2")
    for rank in (0, 1):
        full, resumed = runs[f"sharded-rank{rank}"], runs[f"resumed-rank{rank}"]
        assert resumed["losses"] == full["losses"][2:]
        for name, value in full["adapters"].items():
            assert torch.equal(resumed["adapters"][name], value), name
        for name, (data, scale_inv) in full["frozen"].items():
            assert torch.equal(resumed["frozen"][name][0], data) and torch.equal(resumed["frozen"][name][1], scale_inv)
