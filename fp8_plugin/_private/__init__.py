"""The private APIs of torch, Triton, Lightning, transformers and PEFT that fp8-plugin cannot avoid, one module
per library, each used through one small function and pinned by a test that fails loudly when the
library changes it (``tests/private/test_*_private.py``); and what lets ``import fp8_plugin``
leave the libraries it adapts unimported: a post-import hook (:mod:`.post_import`) and
torch.compile's marks applied without importing dynamo (:mod:`.compile_marks`).

May import: torch, Triton, Lightning, transformers, PEFT; nothing of fp8_plugin.
"""
