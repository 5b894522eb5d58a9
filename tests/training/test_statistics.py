"""Per-layer FP8 statistics (fp8_plugin.training.statistics) against values computed here, independently.

The expected figures come from the tensors the test builds and from the formats' definitions
(OCP OFP8: E4M3 max 448, smallest subnormal 2^-9, so a scaled magnitude below 2^-10 rounds to
zero; OCP MX v1.0: X = 2^(floor(log2 amax) - 8) for E4M3), not from the code under test.
"""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8_plugin
from fp8_plugin import DelayedScaling, Float8CurrentScaling, FP8Linear, FP8Statistics, MXFP8BlockScaling
from fp8_plugin.modules.autocast import new_step_id
from fp8_plugin.training.statistics import StatisticsCollector


def _sampled_step(layer: nn.Module, x: torch.Tensor, every: int = 1) -> dict[str, float]:
    collector = StatisticsCollector(FP8Statistics(every=every))
    collector.start_step(layer, 1)
    with fp8_plugin.autocast(step=new_step_id()):
        y = layer(x)
    y.float().sum().backward()
    collector.end_step()
    return collector.pop_metrics()


def test_a_planted_share_of_underflowing_values_is_reported():
    # 10% of the values are nonzero but 1e-9: times the current scale (448 / 100) far below
    # 2^-10, so they become zero; the other 90% are at least 0.01 (scaled: >= 0.0448).
    torch.manual_seed(0)
    layer = FP8Linear(64, 32, bias=False, recipe=Float8CurrentScaling())
    x = torch.rand(40, 64) * 9.99 + 0.01
    x[0, 0] = 100.0
    planted = torch.rand(40, 64) < 0.10
    planted[0, 0] = False
    x[planted] = 1e-9
    metrics = _sampled_step(layer, x)
    # A bare layer is the model: its figures carry no layer name.
    assert metrics["fp8_stats/input/underflow_pct"] == pytest.approx(
        100.0 * planted.sum().item() / x.numel(), abs=1e-9)
    assert metrics["fp8_stats/input/amax"] == 100.0
    assert metrics["fp8_stats/input/scale_min"] == metrics["fp8_stats/input/scale_max"] == pytest.approx(4.48, rel=1e-7)
    assert metrics["fp8_stats/input/saturation_pct"] == 0.0


def test_saturation_mse_and_sqnr_match_an_independent_cast():
    # Delayed scaling with a scale set by hand (as a history would have set it): 5% of the values
    # land beyond 448 after scaling and are clamped.
    torch.manual_seed(1)
    layer = FP8Linear(64, 32, bias=False, recipe=DelayedScaling())
    scale = 8.0
    layer.fp8_state.scale[0] = scale
    layer.fp8_state.initialized[0] = True
    x = torch.randn(50, 64).clamp(-50, 50)
    hot = torch.rand(50, 64) < 0.05
    x[hot] = 60.0 * torch.sign(x[hot] + 1e-3)  # |x| * 8 = 480 > 448
    metrics = _sampled_step(layer, x)
    expected_saturation = 100.0 * ((x.abs() * scale) > 448).sum().item() / x.numel()
    assert metrics["fp8_stats/input/saturation_pct"] == pytest.approx(expected_saturation, abs=1e-9)
    cast = (x.double() * scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() / scale
    err2 = (cast - x.double()).square().sum().item()
    assert metrics["fp8_stats/input/mse"] == pytest.approx(err2 / x.numel(), rel=1e-9)
    assert metrics["fp8_stats/input/sqnr_db"] == pytest.approx(10 * math.log10(x.double().square().sum().item() / err2), rel=1e-9)
    for role in ("input", "weight", "grad_output"):
        assert all(f"fp8_stats/{role}/{name}" in metrics for name in fp8_plugin.training.statistics.STAT_NAMES)


def test_block_recipes_report_the_range_of_their_block_scales():
    # MXFP8 (OCP MX v1.0, 6.3): block scale X = 2^(floor(log2 amax) - 8) for E4M3; the cast
    # multiplies by 1 / X. Two rows of 32-value blocks with amaxes 1.0 and 96.0.
    layer = FP8Linear(32, 16, bias=False, recipe=MXFP8BlockScaling())
    x = torch.full((2, 32), 0.5)
    x[0, 3], x[1, 7] = 1.0, 96.0
    metrics = _sampled_step(layer, x)
    assert metrics["fp8_stats/input/scale_max"] == 2.0 ** (8 - math.floor(math.log2(1.0)))
    assert metrics["fp8_stats/input/scale_min"] == 2.0 ** (8 - math.floor(math.log2(96.0)))


def test_a_layer_moved_to_blockwise_reports_its_choice_and_its_block_scales():
    # Float8BlockScaling (TE): 1x128 input tiles, scale 2^floor(log2(448 / amax)) (power_2_scale).
    # Two rows of one tile each, amaxes 1.0 and 96.0: scales 2^8 and 2^2.
    layer = FP8Linear(128, 16, bias=False, recipe=DelayedScaling())
    x = torch.full((2, 128), 0.5)
    x[0, 3], x[1, 7] = 1.0, 96.0
    assert _sampled_step(layer, x)["fp8_stats/blockwise"] == 0.0
    layer.fp8_scaling = "blockwise"
    metrics = _sampled_step(layer, x)
    assert metrics["fp8_stats/blockwise"] == 1.0
    assert metrics["fp8_stats/input/scale_max"] == 2.0 ** math.floor(math.log2(448 / 1.0))
    assert metrics["fp8_stats/input/scale_min"] == 2.0 ** math.floor(math.log2(448 / 96.0))


def test_statistics_are_sampled_every_n_steps_only_for_matching_layers():
    collector = StatisticsCollector(FP8Statistics(every=3, layers=["2"]))
    model = nn.Sequential(FP8Linear(16, 16), nn.ReLU(), FP8Linear(16, 16))
    for step in (1, 2, 3):
        collector.start_step(model, step)
        with fp8_plugin.autocast(step=new_step_id()):
            model(torch.randn(4, 16)).sum().backward()
        collector.end_step()
        metrics = collector.pop_metrics()
        assert (metrics != {}) == (step == 3), step
    assert {key.split("/")[1] for key in metrics} == {"2"}  # the layer named "2" only


class _Captured(Logger):
    """A Lightning logger that keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "captured"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def test_lightning_logs_the_sampled_statistics_to_the_trainers_logger():
    from lightning_modules import CountingMLP

    torch.manual_seed(0)
    module = CountingMLP()
    logger = _Captured()
    plugin = fp8_plugin.FP8Precision(statistics=FP8Statistics(every=2, layers=["net.2"]))
    trainer = L.Trainer(plugins=[plugin], max_steps=4, accelerator="cpu", logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1000)  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=16))
    sampled = [(step, m) for step, m in logger.logged if any(k.startswith("fp8_stats/") for k in m)]
    # The 2nd and 4th optimizer steps, logged at the global step they ran as (0-based), as
    # Lightning logs a training step's metrics.
    assert [step for step, _ in sampled] == [1, 3]
    for _, metrics in sampled:
        keys = {k for k in metrics if k.startswith("fp8_stats/")}
        assert keys == {f"fp8_stats/net.2/{role}/{name}" for role in ("input", "weight", "grad_output")
                        for name in fp8_plugin.training.statistics.STAT_NAMES} | {"fp8_stats/net.2/blockwise"}
        assert metrics["fp8_stats/net.2/blockwise"] == 0.0  # per-tensor scaling, as converted
        assert metrics["fp8_stats/net.2/weight/amax"] > 0


def test_statistics_settings_are_checked():
    with pytest.raises(ValueError, match=r"FP8Statistics\(every=0\) is invalid; valid: an int >= 1"):
        FP8Statistics(every=0)
    with pytest.raises(TypeError, match=r"FP8Precision\(statistics='often'\) is invalid; valid: None, an int >= 1"):
        fp8_plugin.FP8Precision(statistics="often")


def test_ranks_report_the_same_figures_reduced_over_both_ranks_inputs_with_or_without_fsdp2(distributed_runs):
    runs = distributed_runs("statistics")  # tests/training/statistics_worker.py, in the shared launch
    assert runs["rank0"]["metrics"] == runs["rank1"]["metrics"]
    metrics = runs["rank0"]["metrics"]
    xs = [runs[f"rank{r}"]["x"].double() for r in (0, 1)]
    # Current scaling: each rank scales its own input by 448 / its amax (TE: activations are not
    # reduced); counts and energies add up over ranks, amaxes and scales take their extremes.
    scales = [(448.0 / x.abs().max()).float().double() for x in xs]
    noise = sum(((x * s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() / s - x).square().sum().item()
                for x, s in zip(xs, scales))
    numel = sum(x.numel() for x in xs)
    assert metrics["fp8_stats/input/amax"] == pytest.approx(max(x.abs().max().item() for x in xs), rel=1e-7)
    assert metrics["fp8_stats/input/scale_min"] == pytest.approx(min(scales).item(), rel=1e-7)
    assert metrics["fp8_stats/input/scale_max"] == pytest.approx(max(scales).item(), rel=1e-7)
    assert metrics["fp8_stats/input/mse"] == pytest.approx(noise / numel, rel=1e-6)
    # Under FSDP2 the weight is sharded between forwards; the statistics read it gathered, as the
    # forward casts it, and reduce over the ranks as above: every figure is the unsharded run's.
    sharded = distributed_runs("statistics-fsdp2")
    assert sharded["rank0"]["metrics"] == sharded["rank1"]["metrics"] == metrics
    assert {k.split("/")[1] for k in metrics} == {"input", "weight", "grad_output", "blockwise"}


def test_accelerate_hands_the_sampled_statistics_to_its_trackers_and_the_trainer_log():
    from fp8_plugin.accelerate import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(mixed_precision="fp8", cpu=True, fp8_statistics=FP8Statistics(every=2, layers=["0"]))
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []
    for _ in range(2):
        accelerator.backward(model(torch.randn(16, 32)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        seen.append(sorted({k.split("/")[1] for k in accelerator.fp8_reference_metrics() if k.startswith("fp8_stats/")}))
    assert seen == [[], ["0"]]
    with pytest.raises(TypeError, match=r"Accelerator\(fp8_statistics=2.5\) is invalid"):
        Accelerator(mixed_precision="fp8", cpu=True, fp8_statistics=2.5)
