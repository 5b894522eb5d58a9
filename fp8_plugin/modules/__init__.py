"""FP8 modules: the FP8 layer (``FP8Linear`` and its autograd function), the FP8 autocast context,
the scaling group that updates a model's FP8 layers together, the model swap (``convert_model``)
with its layer backends, its list of known-equivalent layer classes and its output-head rule, the
FP8 share of a model's GEMM FLOPs (``coverage``), the MoE experts modules' FP8 grouped GEMMs
(``experts``), FSDP2's FP8 all-gather of those layers' weights, which layers FP8 makes faster on a
GPU (``speed_rule``), and FP8 modules as CUDA graphs (``cuda_graphs``).

May import: :mod:`fp8_plugin.numerics`, :mod:`fp8_plugin._private`. Never a training loop.
"""
