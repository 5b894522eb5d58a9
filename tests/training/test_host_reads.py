"""FP8 adds no host read to a training step, in any loop and setting (recorder: tests/support/host_reads.py).

Each loop (Lightning's Trainer, Fabric, the project's Accelerate ``Accelerator``, ``FP8Trainer``)
trains a tiny model for four steps twice, with FP8 and, as the expectation, in the same loop
without it (BF16 autocast; FP16 with dynamic loss scaling for the FP16 setting). Steps 2 and 3
(steady state: step 1 sets up, step 4 has no next step to close its window) must hold the same
host reads, host copies and value-dependent shapes, site by site, in both runs. No logger or
tracker is attached: nothing asks for FP8's figures, so they stay on the device.

Two reads are set apart, each pinned by its own test:

- the fault check's, the one host read FP8 adds on purpose (``fp8_plugin/training/faults.py``:
  whether to take the optimizer step, as ``GradScaler`` decides it with its own read under FP16;
  docs/reliability.md): exactly one per step;
- the MoE experts' routing check, which reads the ids on the CPU only
  (:func:`test_the_experts_routing_check_reads_the_host_on_the_cpu_only`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from host_reads import HostReads

STEPS = 4
STEADY = (2, 3)
BATCH = 4
FAULT_CHECK = ("read", "fp8_plugin/training/faults.py:check")
CPU_ONLY = (("read", "fp8_plugin/modules/experts.py:_check_expert_ids"),)


# ------------------------------------------------------------------------------------------ models


class TinyMLP(nn.Module):
    """Two FP8 candidate layers; ``forward(x)`` returns ``{"loss": ...}`` as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).float().square().mean()}


def tiny_model(moe: bool) -> nn.Module:
    if moe:
        from test_experts import tiny_mixtral  # 2 layers of 4 experts, hidden size 64

        return tiny_mixtral()
    torch.manual_seed(0)
    return TinyMLP()


class Samples(torch.utils.data.Dataset):
    """Per-sample dicts of the model's keyword arguments (``x``, or ``input_ids`` and ``labels``),
    host tensors for ``recorder``: a GPU run's loop copies each batch to the device."""

    def __init__(self, moe: bool, recorder: HostReads, n: int = STEPS * BATCH) -> None:
        g = torch.Generator().manual_seed(1)
        if moe:
            self.items = [{"input_ids": i, "labels": i} for i in torch.randint(0, 128, (n, 9), generator=g)]
        else:
            self.items = [{"x": x} for x in torch.randn(n, 32, generator=g)]
        recorder.host(*(t for item in self.items for t in item.values()))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def loss_of(output: Any) -> torch.Tensor:
    return output["loss"]


# -------------------------------------------------------------------------------------- settings

# id -> (the model is the MoE, the FP8 arguments (loop-neutral names), base precision).
SETTINGS = {
    "default": (False, {}, "bf16"),
    "statistics-every-step": (False, {"statistics": 1}, "bf16"),
    "fp16-loss-scaling": (False, {}, "fp16"),
    "moe-experts": (True, {}, "bf16"),
    "moe-experts-observers": (True, {"statistics": 1}, "bf16"),  # statistics observe the experts' casts
    "reference-check-between-checks": (False, {"reference_every": 100}, "bf16"),  # steps 1-4: none due
}
LOOPS = ("lightning", "fabric", "accelerate", "hf_trainer")
# The FP8 arguments' names in the Accelerator and FP8Trainer.
_PREFIXED = {"statistics": "fp8_statistics", "reference_every": "fp8_reference_every"}


@functools.lru_cache(maxsize=None)
def _dtype(base: str) -> torch.dtype:
    return torch.float16 if base == "fp16" else torch.bfloat16


# ----------------------------------------------------------------------------------------- loops
# Each trains STEPS steps, calls recorder.step() as each begins, and returns the FP8 run (None
# without FP8) and the FP8 statistics the loop formed (read after the loop; {} when off).

Result = tuple[Any, dict[str, float]]


def run_lightning(recorder: HostReads, moe: bool, fp8: Optional[dict], base: str) -> Result:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    import fp8_plugin as fp

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model(moe)

        def training_step(self, batch, batch_idx):
            return loss_of(self.model(**batch))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Steps(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            recorder.step()

    if fp8 is None:
        scaler = torch.amp.GradScaler("cpu") if base == "fp16" else None
        plugin = MixedPrecision("16-mixed" if scaler else "bf16-mixed", device="cpu", scaler=scaler)
    else:
        plugin = fp.FP8Precision(compute_dtype=_dtype(base), device="cpu", **fp8)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Steps()])
    trainer.fit(Module(), torch.utils.data.DataLoader(Samples(moe, recorder), batch_size=BATCH))
    run = plugin.fp8 if fp8 is not None else None
    return run, run.statistics.pop_metrics() if run is not None and run.statistics is not None else {}


def run_fabric(recorder: HostReads, moe: bool, fp8: Optional[dict], base: str) -> Result:
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    from fp8_plugin.fabric import FP8Precision

    if fp8 is None:
        scaler = torch.amp.GradScaler("cpu") if base == "fp16" else None
        plugin = MixedPrecision("16-mixed" if scaler else "bf16-mixed", device="cpu", scaler=scaler)
    else:
        plugin = FP8Precision(compute_dtype=_dtype(base), device="cpu", **fp8)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = tiny_model(moe)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in fabric.setup_dataloaders(torch.utils.data.DataLoader(Samples(moe, recorder), batch_size=BATCH)):
        recorder.step()
        fabric.backward(loss_of(model(**batch)))
        optimizer.step()
        optimizer.zero_grad()
    return (plugin.fp8, plugin.statistics_metrics()) if fp8 is not None else (None, {})


def _cpu_grad_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accelerate makes its GradScaler only on GPUs ("fp16 ... and self.device.type != 'cpu'"
    # in accelerate/accelerator.py), and fp8_plugin's Accelerator refuses FP16 without one. Both
    # runs get torch's CPU GradScaler where a GPU would get Accelerate's, so that the FP16
    # loss-scaling path runs here as it would there.
    from accelerate import Accelerator as Plain

    original = Plain.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler("cpu")
            self.native_amp = True  # autocast in float16, as Accelerate does with its scaler

    monkeypatch.setattr(Plain, "__init__", init)


def run_accelerate(recorder: HostReads, moe: bool, fp8: Optional[dict], base: str) -> Result:
    from accelerate import Accelerator as Plain

    from fp8_plugin.accelerate import Accelerator

    if fp8 is None:
        accelerator = Plain(cpu=True, mixed_precision=base)
    else:
        accelerator = Accelerator(cpu=True, mixed_precision="fp8", fp8_compute_dtype=_dtype(base),
                                  **{_PREFIXED[key]: value for key, value in fp8.items()})
    model = tiny_model(moe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(Samples(moe, recorder), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for batch in data:
        recorder.step()
        accelerator.backward(loss_of(model(**batch)))
        optimizer.step()
        optimizer.zero_grad()
    return (accelerator.fp8_runs[0], accelerator.fp8_reference_metrics()) if fp8 is not None else (None, {})


def run_hf_trainer(recorder: HostReads, moe: bool, fp8: Optional[dict], base: str, tmp_path) -> Result:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fp8_plugin.hf_trainer import FP8Trainer

    class Steps(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            recorder.step()

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, bf16=base == "bf16", fp16=base == "fp16")  # logging_steps: 500
    extra = {} if fp8 is None else {_PREFIXED[key]: value for key, value in fp8.items()}
    trainer = (Trainer if fp8 is None else FP8Trainer)(model=tiny_model(moe), args=args, callbacks=[Steps()],
                                                       train_dataset=Samples(moe, recorder), **extra)
    trainer.train()  # its last log (train_runtime, ...) takes the figures sampled since the last one
    logged = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("fp8_stats/")}
    return (trainer.accelerator.fp8_runs[0], logged) if fp8 is not None else (None, {})


# ------------------------------------------------------------------------------------- recording

_RUNS: dict[tuple, tuple[HostReads, Result]] = {}


def recorded(loop: str, setting: str, fp8: bool, monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> HostReads:
    """The recorder of ``loop`` in ``setting``, with FP8 or without; runs are shared (settings
    that train the same model at the same base precision share one baseline)."""
    from accelerate.state import AcceleratorState, GradientState

    moe, arguments, base = SETTINGS[setting]
    key = (loop, setting if fp8 else f"baseline moe={moe} {base}", fp8)
    if key not in _RUNS:
        run: Callable[..., Result] = {"lightning": run_lightning, "fabric": run_fabric, "accelerate": run_accelerate,
                                      "hf_trainer": functools.partial(run_hf_trainer,
                                                                      tmp_path=tmp_path_factory.mktemp(loop))}[loop]
        AcceleratorState._reset_state(True)  # Accelerate keeps its state process-wide
        GradientState._reset_state()
        with monkeypatch.context() as patch:
            if base == "fp16" and loop in ("accelerate", "hf_trainer"):
                _cpu_grad_scaler(patch)
            with HostReads() as recorder:
                result = run(recorder, moe, arguments if fp8 else None, base)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        assert len(recorder.steps) == STEPS + 1, f"{loop}: {len(recorder.steps) - 1} steps recorded, {STEPS} expected"
        _RUNS[key] = (recorder, result)
    return _RUNS[key]


def assert_fp8_ran(setting: str, result: Result) -> None:
    """The FP8 run did what the setting asks (else no read would be a vacuous pass)."""
    moe, arguments, _ = SETTINGS[setting]
    run, statistics = result
    run._fp8_layers()
    assert run.report.swapped if not moe else run._experts, "no FP8 layer"
    if "statistics" in arguments:
        assert statistics, "no statistics formed"
        if moe:
            assert any(".experts.gate_up_proj/input/" in key for key in statistics), "the experts were not observed"
    if "reference_every" in arguments:
        assert run.reference is not None and run.reference.steps == STEPS and not run.reference.results


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("loop", LOOPS)
def test_fp8_adds_no_host_read_to_a_training_step(loop, setting, monkeypatch, tmp_path_factory):
    baseline, _ = recorded(loop, setting, False, monkeypatch, tmp_path_factory)
    with_fp8, result = recorded(loop, setting, True, monkeypatch, tmp_path_factory)
    assert_fp8_ran(setting, result)
    for step in STEADY:
        events = collections.Counter(with_fp8.steps[step])
        fault_checks = events.pop(FAULT_CHECK, 0)
        for site in CPU_ONLY:
            events.pop(site, None)
        print(f"\n{loop} / {setting} / step {step}: baseline {baseline.kinds(step)}; FP8 {with_fp8.kinds(step)}")
        assert fault_checks == 1, with_fp8.sites(step)
        assert events == baseline.steps[step], (
            f"{loop}, {setting}, step {step}: FP8 {with_fp8.sites(step)} against the baseline's {baseline.sites(step)}"
        )


def test_the_recorder_counts_what_would_wait_for_a_gpu_and_nothing_else():
    x = torch.randn(4)  # before recording: a device tensor
    cases = {
        "x.tolist()": "read", "bool(x[0] > 0)": "read", "float(x.sum())": "read", "x[0].item()": "read",
        "f'{x[0]:.2f}'": "read", "torch.equal(x, x + 1)": "read", "x.cpu()": "to_host", "x.to('cpu')": "to_host",
        "torch.tensor(3.0, device=x.device)": "to_device", "x + torch.tensor([1.0, 2.0, 3.0, 4.0])": "to_device",
        "torch.ones(4).to(x.device)": "to_device", "torch.ones(4).to(x)": "to_device", "x.nonzero()": "shape_sync", "x[x > 0]": "shape_sync",
        "x.repeat_interleave(torch.ones(4, dtype=torch.long, device=x.device))": "shape_sync",
        # Nothing waits: host tensors read, device tensors made or moved on the device.
        "torch.tensor([1.0, 2.0]).tolist()": None, "x.cpu().tolist()": "to_host", "x.to(x.device)": None,
        "torch.zeros((), device=x.device) + x": None, "x * torch.tensor(2.0)": None,
        "x.repeat_interleave(2)": None, "x[torch.arange(2, device=x.device)]": None,
    }
    with HostReads() as recorder:
        for code in cases:
            recorder.step()
            eval(code)
    seen = {code: recorder.kinds(index + 1) for index, code in enumerate(cases)}
    assert seen == {code: {kind: 1} if kind else {} for code, kind in cases.items()}


def test_the_experts_routing_check_reads_the_host_on_the_cpu_only():
    # The routing ids are checked where reading them waits for nothing: on a GPU (any device but
    # the CPU; meta here) the check returns before reading, so CPU_ONLY discounts it.
    from fp8_plugin.modules.experts import _check_expert_ids

    ids = torch.tensor([0, 1, 3])
    with HostReads() as recorder:
        recorder.step()
        _check_expert_ids(ids.to("meta"), 4)
        assert recorder.count(1) == 0
        _check_expert_ids(ids, 4)  # made before recording: a device tensor for the recorder
        assert recorder.sites(1) == {" ".join(CPU_ONLY[0]): 2}


def test_sampled_statistics_are_read_on_the_host_when_a_tracker_takes_them(fresh_accelerate):
    # "Until a logger needs them": with a tracker, each sampled step's figures are read once, by
    # the hand-over to the tracker, at that step; the steps between samples read nothing.
    from test_accelerate import ListTracker

    from fp8_plugin.accelerate import Accelerator

    tracker = ListTracker()
    accelerator = Accelerator(cpu=True, mixed_precision="fp8", fp8_statistics=2, log_with=[tracker])
    accelerator.init_trackers("host-reads")
    model = tiny_model(False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with HostReads() as recorder:
        for batch in Samples(False, recorder, n=STEPS):
            recorder.step()
            accelerator.backward(loss_of(model(batch["x"][None].to(accelerator.device))))
            optimizer.step()
            optimizer.zero_grad()
    reads = [{site: n for (kind, site), n in recorder.steps[step].items() if kind == "read" and (kind, site) != FAULT_CHECK}
             for step in range(1, STEPS + 1)]
    taken = {"fp8_plugin/training/statistics.py:pop_metrics": 1}
    assert reads == [{}, taken, {}, taken]
    assert [step for step, values in tracker.logged if any(k.startswith("fp8_stats/") for k in values)] == [2, 4]
