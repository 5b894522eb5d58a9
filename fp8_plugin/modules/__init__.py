"""FP8 modules: the FP8 layer (``FP8Linear`` and its autograd function), the FP8 autocast context,
the scaling group that updates a model's FP8 layers together, the model swap (``convert_model``)
and its layer backends, and FSDP2's FP8 all-gather of those layers' weights.

May import: :mod:`fp8_plugin.numerics`, :mod:`fp8_plugin._private`. Never a training loop.
"""
