"""The model table (benchmarks/model_table.py, fp8_suite/training_runs.py, model_table.py,
cuda_graphs.py) rehearsed on this CPU, and the results files (benchmarks/results.py,
fp8_suite/results.py).

The table's figures need a GPU; here: every run of the tiny model gets its row, the fp8-hybrid
and torchao rows ran FP8 layers, what cannot run says why, the GPU plan's order and budget, a run
past its limit is killed, the graphs mode computes the model's own loss, and results files are
gathered from a GPU run's archive and rendered as markdown.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import fp8_plugin

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fp8_suite import cuda_graphs, model_table, results, training_runs  # noqa: E402
from fp8_suite.training_runs import RunResult, RunSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:FP8 GEMM emulated", "ignore:.*is an Enum subclass")


def test_the_cpu_rehearsal_writes_every_run_and_its_fp8_rows_ran_fp8_layers(tmp_path, monkeypatch):
    import model_table as cli  # benchmarks/model_table.py

    monkeypatch.setattr(model_table, "torchao_installed", lambda: False)
    runs = ("bf16-mixed:eager,fp8-hybrid:eager,fp8-hybrid:eager-triton,fp8-hybrid:graphs,fp8-hybrid:compiled,"
            "torchao-tensorwise:eager")
    out = cli.main(["--device", "cpu", "--in-process", "--runs", runs, "--steps", "1", "--warmup", "1",
                    "--output", str(tmp_path / "models.json")])
    assert json.loads((tmp_path / "models.json").read_text())["results"] == out["results"]
    rows = {(r["precision"], r["mode"]): r for r in out["results"]}
    assert list(rows) == [("bf16-mixed", "eager"), ("fp8-hybrid", "eager"), ("fp8-hybrid", "eager-triton"),
                          ("fp8-hybrid", "graphs"), ("fp8-hybrid", "compiled"),
                          ("torchao-tensorwise", "eager")]  # the table's order
    bf16, fp8 = rows["bf16-mixed", "eager"], rows["fp8-hybrid", "eager"]
    assert bf16["status"] == fp8["status"] == "ran" and bf16["fp8_layers"] is None
    assert fp8["fp8_layers"] == 4 * 7 and fp8["linear_layers"] == 4 * 7 + 1  # every block's linears; lm_head stays
    assert fp8["fp8_recipe"] == "delayed" and fp8["tokens_per_s"] > 0 and fp8["speedup"] > 0
    assert rows["fp8-hybrid", "graphs"]["error"] == "CUDA graphs need a CUDA device"
    assert rows["fp8-hybrid", "eager-triton"]["error"] == "the Triton GEMM runs on CUDA GPUs"
    assert rows["fp8-hybrid", "compiled"]["error"] == "compile rehearsed on GPU only"
    assert rows["torchao-tensorwise", "eager"]["error"] == "torchao not installed"
    assert all(r["status"] == "not run" for key, r in rows.items() if key not in {("bf16-mixed", "eager"),
                                                                               ("fp8-hybrid", "eager")})
    table = (tmp_path / "models.md").read_text()
    assert "| tiny | eager | fp8-hybrid | " in table and "28/29 layers FP8 (delayed)" in table
    assert "not run: torchao not installed" in table


def test_torchao_rows_run_torchaos_float8_layers():
    pytest.importorskip("torchao.float8")
    # 2 x 16 tokens: on CPUs with AMX torchao's torch._scaled_mm runs in oneDNN's reference kernel,
    # whose time grows with the tokens (65 s a run at 2 x 64 there).
    result = training_runs.measure(RunSpec("tiny", "torchao-tensorwise", "eager", 2, 16, 1, 0, "cpu"))
    assert result.status == "ran", result.error
    assert result.fp8_layers == 4 * 7 and result.fp8_recipe is None and result.tokens_per_s > 0


def test_the_gpu_plan_puts_the_8b_block_first_each_model_after_its_baseline_and_every_run_once():
    specs = model_table.plan("cuda")
    order = [(s.model, s.precision, s.mode) for s in specs]
    assert order[:6] == [("8b-block", "bf16-mixed", "eager"), ("8b-block", "fp8-hybrid", "eager"),
                         ("8b-block", "fp8-hybrid", "graphs"), ("8b-block", "fp8-hybrid", "eager-triton"),
                         ("125m", "bf16-mixed", "eager"), ("125m", "fp8-hybrid", "eager-triton")]
    assert sorted(order) == sorted((m, p, k) for m in ("125m", "1b", "8b-block") for p, k in training_runs.KINDS)
    for model in ("125m", "1b", "8b-block"):  # the baseline of a model's ratios runs before its other runs
        assert [o for o in order if o[0] == model][0] == (model, "bf16-mixed", "eager")
    assert {(s.model, s.batch) for s in specs} == {("125m", 4), ("1b", 2), ("8b-block", 2)}
    assert {(s.seq_len, s.steps, s.warmup) for s in specs} == {(2048, 5, 3)}
    config = training_runs.SIZES["8b-block"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (4096, 14336, 8)


def test_a_run_with_too_little_budget_left_is_not_run_and_ratios_are_against_bf16_eager(monkeypatch):
    monkeypatch.setattr(model_table, "torchao_installed", lambda: True)
    specs = [s for s in model_table.plan("cuda", models=["125m"])]
    measured = []

    def fake(spec: RunSpec) -> RunResult:
        measured.append(spec)
        result = RunResult.of(spec, "ran")
        result.tokens_per_s, result.peak_bytes = (1000.0, 100) if spec.precision == "bf16-mixed" else (1500.0, 80)
        result.step_ms, result.seconds = 1.0, 0.0
        return result

    saved = []
    rows = model_table.run_table(specs, 30, False, lambda line: None, lambda rs: saved.append(len(rs)), fake)
    assert saved == list(range(1, 9))  # written after every run
    by_kind = {(r.precision, r.mode): r for r in rows}
    assert [(s.precision, s.mode) for s in measured] == [("bf16-mixed", "eager"), ("fp8-hybrid", "eager-triton"),
                                                        ("fp8-hybrid", "eager"), ("fp8-hybrid", "graphs"),
                                                        ("torchao-tensorwise", "eager")]
    assert by_kind["fp8-hybrid", "eager"].speedup == 1.5 and by_kind["fp8-hybrid", "eager"].memory_ratio == 0.8
    compiled = by_kind["bf16-mixed", "compiled"]
    assert compiled.status == "not run" and compiled.error.startswith("budget: ")
    assert compiled.error.endswith("of 30 s left")


def test_a_run_past_its_limit_is_killed_and_recorded_as_timed_out():
    # Starting Python, torch and transformers alone takes longer than a second here.
    result = model_table.run_isolated(RunSpec("tiny", "bf16-mixed", "eager", 2, 64, 1, 0, "cpu"), 1.0)
    assert (result.status, result.error) == ("timed out", "after 1 s")
    assert model_table._Child.process is None and result.seconds < 10


def test_the_graphs_mode_computes_the_models_own_loss_and_asks_for_fp8(monkeypatch):
    calls = []

    def make_graphed_callables(modules, sample_args, **kwargs):  # stands in for the API: no capture
        calls.append((modules, sample_args, kwargs))
        return modules

    monkeypatch.setattr(fp8_plugin, "make_graphed_callables", make_graphed_callables, raising=False)
    model = training_runs.build_model("tiny", torch.device("cpu"), 64)
    batch = training_runs.random_batch(8192, 2, 16, torch.device("cpu"))
    recipe = fp8_plugin.DelayedScaling()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        graphed = cuda_graphs.graphed_loss(model, batch, recipe)()
        own = model(**batch).loss
    assert torch.equal(graphed, own)
    modules, samples, kwargs = calls[0]
    assert kwargs == {"fp8_enabled": True, "fp8_recipe": recipe} and len(modules) == len(samples) == 4
    assert [m.layer for m in modules] == list(model.model.layers)
    hidden, cos, sin = samples[0]
    assert hidden.shape == (2, 16, 256) and hidden.requires_grad and cos.shape[-2] == 16
    # A whole fp8-hybrid graphs run through the training loop (no capture on a CPU, only the code path).
    result = training_runs.measure(RunSpec("tiny", "fp8-hybrid", "graphs", 2, 16, 1, 0, "cpu"))
    assert result.status == "ran" and result.fp8_layers == 28, result.error
    assert model_table.skip_reason(RunSpec("tiny", "fp8-hybrid", "graphs", 2, 16, 1, 0, "cpu")) == \
        "CUDA graphs need a CUDA device"


ENV = {"device": "NVIDIA H100 80GB HBM3 (sm90)", "torch": "2.13.0+cu130", "commit": "unknown",
       "date": "2026-11-27T10:00:00"}
LAYER = {"environment": ENV, "layer": {"results": [
    {"m": 16384, "k": 8192, "n": 8192, "variant": "bf16", "compiled": False, "ms": 2.0, "speedup": None,
     "peak_bytes": 1024 * 2**20, "gemm_path": None, "recompiles": None, "error": None},
    {"m": 16384, "k": 8192, "n": 8192, "variant": "delayed", "compiled": False, "ms": 1.25, "speedup": 1.6,
     "peak_bytes": 900 * 2**20, "gemm_path": "native", "recompiles": None, "error": None},
]}}
COMPILED = {"environment": ENV, "layer": {"results": [
    {**LAYER["layer"]["results"][0], "ms": 2.1},  # the eager row again: layer.json's is kept
    {**LAYER["layer"]["results"][1], "compiled": True, "ms": 1.0, "speedup": 1.9, "gemm_path": None},
]}}
MODELS = {"environment": ENV, "results": [
    {**vars(RunResult("1b", "bf16-mixed", "eager", 2, 2048, status="ran")), "tokens_per_s": 40000.0,
     "peak_bytes": 30000 * 2**20, "linear_layers": 113},
    {**vars(RunResult("1b", "fp8-hybrid", "eager", 2, 2048, status="ran")), "tokens_per_s": 52000.0,
     "peak_bytes": 27000 * 2**20, "speedup": 1.3, "memory_ratio": 0.9, "fp8_layers": 112, "linear_layers": 113,
     "fp8_recipe": "delayed"},
    {**vars(RunResult("1b", "torchao-tensorwise", "compiled", 2, 2048, status="not run")),
     "error": "torchao not installed"},
]}


def _archive(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in (("layer.json", LAYER), ("compiled.json", COMPILED), ("models.json", MODELS)):
            blob = json.dumps(data).encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(blob)
            archive.addfile(info, io.BytesIO(blob))
    return path


def test_a_gpu_runs_archive_becomes_one_row_per_model_or_layer_mode_and_recipe(tmp_path):
    rows = results.collect(_archive(tmp_path / "gpu_run.tar.gz"), commit="7ba7e64")
    keys = [(r["model"] or r["layer"], r["mode"], r["recipe"]) for r in rows]
    assert keys == [("16384x8192x8192", "eager", "bf16"), ("16384x8192x8192", "eager", "delayed"),
                    ("16384x8192x8192", "compiled", "delayed"), ("1b", "eager", "bf16-mixed"),
                    ("1b", "eager", "fp8-hybrid"), ("1b", "compiled", "torchao-tensorwise")]
    assert rows[0]["ms"] == 2.0 and rows[0]["peak_mib"] == 1024.0  # layer.json's eager row, not compiled.json's
    fp8 = rows[4]
    assert {k: fp8[k] for k in ("date", "device", "torch", "commit", "tokens_per_s", "ms", "peak_mib", "speedup",
                                "error")} == {"date": "2026-11-27", "device": "NVIDIA H100 80GB HBM3 (sm90)",
                                              "torch": "2.13.0+cu130", "commit": "7ba7e64", "tokens_per_s": 52000.0,
                                              "ms": None, "peak_mib": 27000.0, "speedup": 1.3, "error": None}
    assert rows[5]["error"] == "not run: torchao not installed"
    assert results.results_path(rows, tmp_path).name == "2026-11-27-h100.json"


@pytest.mark.parametrize("device, slug", [("NVIDIA H100 80GB HBM3 (sm90)", "h100"), ("NVIDIA H200 (sm90)", "h200"),
                                          ("NVIDIA A100-SXM4-80GB (sm80)", "a100"),
                                          ("AMD EPYC, 2 cores, 2 torch threads", "cpu"),
                                          ("NVIDIA GeForce RTX 4090 (sm89)", "geforce-rtx-4090")])
def test_device_slugs(device, slug):
    assert results.device_slug(device) == slug


def test_render_markdown_of_a_hand_written_results_file(tmp_path):
    import results as cli  # benchmarks/results.py

    rows = results.collect(_archive(tmp_path / "gpu_run.tar.gz"), commit="7ba7e64")
    path = tmp_path / "2026-11-27-h100.json"
    assert cli.main(["collect", str(tmp_path / "gpu_run.tar.gz"), "--commit", "7ba7e64", "--output", str(path)]) == 0
    assert json.loads(path.read_text()) == rows
    assert results.render_markdown(json.loads(path.read_text())) == """\
NVIDIA H100 80GB HBM3 (sm90), torch 2.13.0+cu130, commit `7ba7e64`, 2026-11-27.

| model | mode | recipe | tokens/s | vs bf16-mixed eager | peak MiB | memory vs bf16-mixed eager | note |
| --- | --- | --- | ---: | ---: | ---: | ---: | --- |
| 1b | eager | bf16-mixed | 40,000 | — | 30,000 | — |  |
| 1b | eager | fp8-hybrid | 52,000 | 1.30x | 27,000 | 0.90x | 112/113 layers FP8 (delayed) |
| 1b | compiled | torchao-tensorwise | — | — | — | — | not run: torchao not installed |

| layer (MxKxN) | mode | recipe | ms | vs bf16 | peak MiB | note |
| --- | --- | --- | ---: | ---: | ---: | --- |
| 16384x8192x8192 | eager | bf16 | 2.000 | — | 1,024 |  |
| 16384x8192x8192 | eager | delayed | 1.250 | 1.60x | 900 | native |
| 16384x8192x8192 | compiled | delayed | 1.000 | 1.90x | 900 |  |
"""


def test_a_graph_break_is_reported_with_its_reason_and_the_user_line_it_broke_at():
    # The GPU run of 2026-11-27 recorded only "Unsupported: Unsupported method call" for the
    # compiled FP8 layers; the line must say what dynamo refused and where.
    from fp8_suite.common import describe_error, graph_break_reasons

    def breaks(x):
        torch._dynamo.graph_break()  # an error under fullgraph=True
        return x + 1

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as caught:
            torch.compile(breaks, fullgraph=True, backend="eager")(torch.ones(3))
        line = describe_error(caught.value)
        assert line.startswith(type(caught.value).__name__ + ": ")
        assert f"(at benchmarks/test_model_table.py:{breaks.__code__.co_firstlineno + 1}, in breaks)" in line
        torch.compile(breaks, backend="eager")(torch.ones(3))  # without fullgraph: it breaks and runs on
        assert graph_break_reasons().startswith("1x ")
    finally:
        torch._dynamo.reset()
    assert describe_error(ValueError("first\nsecond")) == "ValueError: first"


def test_torchaos_suite_rows_are_left_out_only_where_this_cpus_scaled_mm_is_a_slow_kernel(monkeypatch):
    # The suite's torchao rows call torch._scaled_mm whatever it costs: on CPUs with AMX oneDNN's
    # reference kernel made one tiny-model step take 32 s. They are left out, with the reason,
    # exactly where fp8-plugin's own per-pairing measurement timed the kernel far slower than the
    # emulation; a CPU where torch computes it itself, and a GPU, run them.
    from fp8_plugin.numerics import gemm
    from fp8_plugin.numerics.gemm import TensorwiseChoice
    from fp8_suite.common import scaled_mm_too_slow

    cpu = torch.device("cpu")
    for choice, skipped in ((TensorwiseChoice(False, 0.012, 0.0002, (32, 64, 64)), True),
                            (TensorwiseChoice(False, 0.0012, 0.0002, (64, 128, 128)), False),  # 6x: run
                            (TensorwiseChoice(True, 0.0001, 0.0002, (64, 128, 128)), False),
                            (TensorwiseChoice(False, float("nan"), float("nan"), (32, 64, 64), True), False)):
        monkeypatch.setattr(gemm, "tensorwise_choice", lambda *args, choice=choice: choice)
        reason = scaled_mm_too_slow(cpu)
        assert (reason is not None) == skipped, choice
        assert not skipped or "12.00 ms" in reason and "0.20 ms" in reason
    assert scaled_mm_too_slow(torch.device("cuda")) is None
