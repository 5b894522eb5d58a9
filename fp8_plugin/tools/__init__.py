"""Tools around training: the ``fp8-plugin`` command line, checkpoint export (vanilla or
transformers' fine-grained FP8), the memory of a training step, and where the real data packages
keep their files.

May import: :mod:`fp8_plugin.training`, :mod:`fp8_plugin.optim`, :mod:`fp8_plugin.modules`,
:mod:`fp8_plugin.numerics`, :mod:`fp8_plugin._private`. No loop adapter.
"""
