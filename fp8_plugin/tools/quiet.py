"""A quiet run: the lines other libraries print that a user of the main jobs cannot act on, kept out.

The main jobs (``examples/``) and the ``fp8-plugin`` command call :func:`quiet_foreign_output`
before they import transformers or Lightning. Each filter drops one message of one library, says
why, and nothing else: the project's own warnings and every other library's lines, errors above
all, still show. Importing ``fp8_plugin`` changes no other library's output; only these entry
points do.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["quiet_foreign_output", "FOREIGN_LINES"]

# What each filter drops, as it appears in the output (tests/tools/test_quiet_output.py counts them).
FOREIGN_LINES = (
    r"Failed to load .*torchao/_C",
    r"Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1",
    r"<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and is now natively supported",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Tip: For seamless cloud logging and experiment tracking, try installing \[litlogger\]",
    r"`is_gradient_checkpointing` is deprecated and will be removed in v6",
)


class _DropMessage(logging.Filter):
    # Drops the records of one logger whose message matches one pattern.
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_foreign_output() -> None:
    """Install the narrow filters (module docstring); idempotent. Call it before transformers,
    Lightning or torchao is imported: torchao's switch is read at its import."""
    import torch

    if not torch.cuda.is_available():
        # transformers imports torchao whenever it is installed (its quantizers' registry), and
        # torchao loads its CUDA kernels' libraries at import: without CUDA each fails with a line.
        # torchao's documented switch skips them; its note saying so is dropped below.
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    _drop("torchao", FOREIGN_LINES[1])
    # torchao registers two enums of its own with a pytree API torch has deprecated for enums.
    _drop("torch.utils._pytree", FOREIGN_LINES[2])
    # Lightning's own call of a deprecated torch API, in lightning/pytorch/utilities/_pytree.py.
    warnings.filterwarnings("ignore", message=FOREIGN_LINES[3], module=r"lightning\.pytorch\.utilities\._pytree")
    # Lightning advertises a cloud logger at every fit.
    _drop("lightning.pytorch.utilities.rank_zero", FOREIGN_LINES[4])
    # PEFT reads transformers' deprecated is_gradient_checkpointing (peft/peft_model.py).
    warnings.filterwarnings("ignore", message=FOREIGN_LINES[5], category=FutureWarning,
                            module=r"transformers\.modeling_utils")


def _drop(logger: str, pattern: str) -> None:
    target = logging.getLogger(logger)
    if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern for f in target.filters):
        target.addFilter(_DropMessage(pattern))
