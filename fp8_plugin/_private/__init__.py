"""The private APIs of torch, Triton, Lightning, transformers and PEFT that fp8-plugin cannot avoid, one module
per library, each used through one small function and pinned by a test that fails loudly when the
library changes it (``tests/private/test_*_private.py``).

May import: torch, Triton, Lightning, transformers, PEFT; nothing of fp8_plugin.
"""
