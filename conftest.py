"""The Python blocks of README.md and docs/*.md run as tests (Sybil), so a snippet that drifts from
the code fails the suite.

`pytest` collects them next to `tests/` (pyproject's `testpaths` lists README.md and docs/;
`pytest README.md docs` runs them alone): one test per ```` ```python ```` block, named by file and
line (`README.md::line:95,column:1`), run in the order of the page with one namespace per page,
as a reader runs them one after another. A block runs as written; a block that asks
`torch.autocast` for a device that is not there fails (it would run nothing in BF16).
Shell, YAML, JSON and text blocks are not Python and are not collected. A Python block that cannot
run here (a CUDA-only call, a multi-process launch) is preceded in the Markdown by Sybil's skip
directive with its reason, which pytest reports as a skip:

    <!-- skip: next "needs two processes (torchrun)" -->
    <!-- skip: next if(not CUDA_FP8, "needs a CUDA GPU of compute capability 8.9+") -->

Each page runs in a fresh scratch folder (the current directory while its blocks run; removed
afterwards), so blocks that write `"out"`, `"ckpt"` or `lightning_logs` write there, and on one
device (`PL_TRAINER_DEVICES=1`, `LT_DEVICES=1`: Lightning's defaults for `devices`).

The names a block uses without defining them are the fixtures below, made afresh for every block
that mentions them (the tiny models take milliseconds, so every block sees a new, unconverted
model), seeded with `torch.manual_seed(0)`:

| name | what |
| --- | --- |
| `model` | a tiny Llama (2 layers, hidden 64, intermediate 128, 4 heads, 2 KV heads, vocabulary 128) on the CPU: `LlamaForSequenceClassification` with 5 labels, or `LlamaForCausalLM` on the pages in `CAUSAL_LM_PAGES` |
| `batch` | a dict of 4 x 16 `input_ids`, `attention_mask` and `labels` (class ids, or the tokens for a causal LM) |
| `loader`, `train_loader` | a `DataLoader` of 8 such samples in batches of 4: two steps an epoch |
| `ds`, `train` | the 8 samples as a dataset (a list of dicts), for the transformers Trainer |
| `optimizer`, `scheduler` | `AdamW(model.parameters(), lr=1e-4)` and a `LinearLR` over it |
| `module` | a LightningModule around `model` (`training_step` returns `model(**batch).loss`; AdamW); its `fit` stops after `DOC_TRAIN_STEPS` optimizer steps, so the pages' Trainers with Lightning's default `max_epochs` stay short |
| `args`, `training_args` | `TrainingArguments` for the Trainer: batches of 4, `max_steps=DOC_TRAIN_STEPS`, no reports, no saving |
| `path` | a folder holding the tiny causal LM written by `save_pretrained` (what `from_pretrained(path)` reads) |
| `CUDA_FP8` | True where a CUDA GPU runs FP8 GEMMs (compute capability 8.9+), for skip conditions |

Every block also starts with fresh Accelerate singletons (Accelerate keeps its state
process-wide), as one Python session per snippet would.
"""

import atexit
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

# The same settings as tests/conftest.py, for `pytest README.md docs` alone: one thread is faster
# than two fighting on tiny models, and nothing may touch the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _interpret_triton_without_a_gpu() -> None:
    # The fused cast kernels' tests (tests/numerics/test_kernels_tensorwise.py) run Triton's interpreter on
    # CPU tensors. It must be on before triton is first imported in the process: triton decorates
    # its standard library (tl.max, ...) at import, and another test's torch.compile may import it
    # first. On a machine with a GPU it stays off: the kernels run compiled there.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_a_gpu()

import pytest  # noqa: E402
from sybil import Sybil  # noqa: E402
from sybil.evaluators.python import PythonEvaluator  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, SkipParser  # noqa: E402

# Optimizer steps a fixture's training run takes (the LightningModule's fit, the Trainer's args).
DOC_TRAIN_STEPS = 2
# Pages whose `model` is a causal LM (their blocks load what they export with AutoModelForCausalLM).
CAUSAL_LM_PAGES = {"export.md"}

_SAMPLES, _SEQ, _BATCH, _VOCAB, _LABELS = 8, 16, 4, 128, 5


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, num_labels=_LABELS)


def _causal_lm(page: str) -> bool:
    return page in CAUSAL_LM_PAGES


def _model(page: str):
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    return (LlamaForCausalLM if _causal_lm(page) else LlamaForSequenceClassification)(_config())


def _samples(page: str) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(_SAMPLES):
        ids = torch.randint(1, _VOCAB, (_SEQ,), generator=gen)
        label = ids.clone() if _causal_lm(page) else torch.randint(0, _LABELS, (), generator=gen)
        samples.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": label})
    return samples


def _loader(page: str):
    import torch

    return torch.utils.data.DataLoader(_samples(page), batch_size=_BATCH)


def _batch(page: str) -> dict[str, Any]:
    return next(iter(_loader(page)))


def _module(model):
    import lightning as L
    import torch

    class DocModule(L.LightningModule):
        """`model(**batch).loss`, AdamW; fit stops after DOC_TRAIN_STEPS optimizer steps."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step >= DOC_TRAIN_STEPS:
                self.trainer.should_stop = True

    return DocModule(model)


def _training_args():
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="trainer_out", per_device_train_batch_size=_BATCH,
                             max_steps=DOC_TRAIN_STEPS, report_to="none", save_strategy="no",
                             use_cpu=True)


_CHECKPOINT: dict[str, str] = {}


def _path() -> str:
    """The tiny causal LM, written once per process by save_pretrained."""
    if "path" not in _CHECKPOINT:
        folder = tempfile.mkdtemp(prefix="fp8-docs-checkpoint-")
        atexit.register(shutil.rmtree, folder, True)
        _model(next(iter(CAUSAL_LM_PAGES))).save_pretrained(folder)
        _CHECKPOINT["path"] = folder
    return _CHECKPOINT["path"]


def _cuda_fp8() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _fixtures(page: str, wanted: set[str]) -> dict[str, Any]:
    """The fixtures a block names, made afresh; `optimizer`, `scheduler` and `module` hold the
    block's `model`."""
    import torch

    made: dict[str, Any] = {}
    if wanted & {"model", "optimizer", "scheduler", "module"}:
        made["model"] = _model(page)
    if wanted & {"optimizer", "scheduler"}:
        made["optimizer"] = torch.optim.AdamW(made["model"].parameters(), lr=1e-4)
        made["scheduler"] = torch.optim.lr_scheduler.LinearLR(made["optimizer"])
    if "module" in wanted:
        made["module"] = _module(made["model"])
    if "batch" in wanted:
        made["batch"] = _batch(page)
    for name in wanted & {"loader", "train_loader"}:
        made[name] = _loader(page)
    for name in wanted & {"ds", "train"}:
        made[name] = _samples(page)
    for name in wanted & {"args", "training_args"}:
        made[name] = _training_args()
    if "path" in wanted:
        made["path"] = _path()
    return made


FIXTURES = {"model", "batch", "loader", "train_loader", "ds", "train", "optimizer", "scheduler", "module",
            "args", "training_args", "path"}


def _fresh_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        del os.environ[key]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class _BlockEvaluator:
    """Runs one Python block: fresh fixtures for the names it mentions, then the block itself."""

    def __init__(self) -> None:
        self._python: Callable = PythonEvaluator()

    def __call__(self, example) -> None:
        import torch

        _fresh_accelerate()
        torch.manual_seed(0)
        wanted = set(re.findall(r"\b\w+\b", str(example.parsed))) & FIXTURES
        example.namespace.update(_fixtures(Path(example.path).name, wanted))
        with warnings.catch_warnings():
            # torch.autocast for a device that is not there runs nothing in the lower precision:
            # a block must choose its device.
            warnings.filterwarnings("error", message=r".*Disabling autocast")
            self._python(example)


# Lightning's Trainer and Fabric read these as their `devices` default: on a machine with several
# GPUs the pages' `L.Trainer(...)` / `L.Fabric(...)` would otherwise start DDP workers, which rerun
# the whole pytest command.
_ONE_DEVICE = {"PL_TRAINER_DEVICES": "1", "LT_DEVICES": "1"}


def _enter_scratch_folder(namespace: dict[str, Any]) -> None:
    namespace["__docs_cwd__"] = os.getcwd()
    namespace["__docs_scratch__"] = tempfile.mkdtemp(prefix="fp8-docs-")
    namespace["__docs_environ__"] = {key: os.environ.get(key) for key in _ONE_DEVICE}
    namespace["CUDA_FP8"] = _cuda_fp8()
    os.environ.update(_ONE_DEVICE)
    os.chdir(namespace["__docs_scratch__"])


def _leave_scratch_folder(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["__docs_cwd__"])
    shutil.rmtree(namespace["__docs_scratch__"], ignore_errors=True)
    _fresh_accelerate()  # a page's Accelerator leaves nothing to the tests after it
    for key, value in namespace["__docs_environ__"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


ROOT = Path(__file__).resolve().parent
_collect = Sybil(
    parsers=[CodeBlockParser("python", _BlockEvaluator()), SkipParser()],
    patterns=["*.md"],
    setup=_enter_scratch_folder,
    teardown=_leave_scratch_folder,
).pytest()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A skipped block is reported at its line in the page, with the directive's reason.
    outcome = yield
    report = outcome.get_result()
    example = getattr(item, "example", None)
    if example is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (str(example.path), example.line, report.longrepr[2])


def pytest_collect_file(file_path: Path, parent):
    # This README and the site's pages only: not benchmarks/README.md or a test folder's notes.
    if file_path == ROOT / "README.md" or file_path.parent == ROOT / "docs":
        return _collect(file_path, parent)
    return None
