"""Where the host time of one FP8Linear training step goes, per recipe, against nn.Linear.

A training step of an ``FP8Linear`` (forward under :func:`fp8_plugin.autocast`, backward) on the
CUDA path, against ``nn.Linear`` under BF16 on the same tensors. The shapes are small, so that
the GPU waits for the host: the step time is the host's. Per recipe:

- **host µs per step**, FP8 and BF16, and their ratio (the fastest of ``--repeats`` runs of
  ``--steps`` steps each);
- **the floor** (per-tensor recipes): the same three casts and three GEMM launches inside a bare
  ``autograd.Function`` and nothing else, the host time a layer step cannot go below with these
  kernels; what the FP8 step costs above it is the layer's own Python;
- **launches per step**: the fused casts' Triton kernels by name, and the GEMMs;
- **where the FP8 step's host time goes** (cProfile, each function's own time, scaled to the
  unprofiled step): fp8-plugin's Python by module, Triton's launch path, torch's Python (autograd,
  ``nn.Module``), torch's C++ ops (the dispatcher and kernels' host side), and, on the meta
  proxy only, torch's Python meta kernels, which a GPU runs in C++ (``torch._scaled_mm``'s
  checks above all);
- the per-model share: ``ScalingGroup.update`` (one scale update per step for the whole model,
  not per layer) and the ``fp8_plugin.autocast`` context (entered once per step for the whole
  model), timed as they run (not from the profile), are reported apart, and **per-layer host
  µs** leaves them and the meta kernels out;
- **a chain of layers as a model runs them** (``--chain``, default 32): each layer's input the
  previous layer's output (K -> N, then N -> K), one FP8 autocast and one backward per step, one
  scale update for them all; its host µs per layer, FP8 and ``nn.Linear``, less its own meta
  kernels (their share in a profile of the same chain step). Per-step costs (the autocast, the
  backward call, the scale update, which grows with the layers it updates) are counted here as a
  model pays them.

Devices:

- ``--device meta`` (any machine, the default): meta tensors presented as an sm90 GPU
  (``meta_as_cuda``), the native GEMM path, the fused casts' eager path with their launches
  counted and not run (``record_launches``): the host work of the CUDA path without a GPU.
  ``mxfp8`` presents an sm100 GPU (Blackwell's MXFP8 GEMM).
- ``--device cuda``: the same on a real GPU, launches run; a step's host time is measured as the
  wall time of ``--steps`` steps with one synchronisation at the end (the GPU work of these
  shapes is some microseconds per kernel: the GPU waits for the host).

Precision: ``--precision bf16-true`` (the default) runs both layers with BF16 weights and no torch
autocast, the cheapest ``nn.Linear`` step; ``bf16-mixed`` (a GPU only) runs FP32 master weights
under ``torch.autocast(bfloat16)``, as Lightning's bf16-mixed and the fp8-* precisions run them.

    OMP_NUM_THREADS=1 python benchmarks/host_profile.py                       # meta, ~30 s
    python benchmarks/host_profile.py --device cuda --shape 4096x2048x2048   # on a GPU
    python benchmarks/host_profile.py --device cuda --gemm-kernel triton     # the Triton GEMM's host time
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8_plugin from this checkout

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fp8_plugin  # noqa: E402
from fp8_plugin.modules.speed_rule import chain_steps  # noqa: E402
from fp8_plugin.numerics.device_kind import meta_as_cuda  # noqa: E402
from fp8_plugin.numerics.gemm import force_path  # noqa: E402
from fp8_plugin.numerics.kernels import GEMM_KERNELS, force_gemm_kernel, force_kernels  # noqa: E402
from fp8_plugin.numerics.device import recipe_gemm_kind  # noqa: E402
from fp8_plugin.numerics.kernels import gemm_kernel  # noqa: E402
from fp8_plugin.numerics.kernels.launch import record_launches  # noqa: E402
from fp8_plugin.numerics.kernels.scaled_gemm import scaled_gemm  # noqa: E402
from fp8_plugin.numerics.quantizers import GRAD_OUTPUT, INPUT, WEIGHT, make_quantizer  # noqa: E402
from fp8_suite.common import RECIPES, environment, write_report  # noqa: E402  (benchmarks/)

# The presented GPU per recipe on the meta proxy: MXFP8 GEMMs are Blackwell's.
CAPABILITY = {"mxfp8": (10, 0)}
GEMMS = ("_scaled_mm", "_scaled_mm_v2", "scaled_mm", "mm", "addmm")
# Where a function's own time goes, by its file (first match wins).
META_KERNELS = "meta kernels (proxy only)"
CATEGORIES = (
    ("fp8_plugin/", "fp8-plugin Python"),
    ("triton/", "Triton launch path"),
    ("torch/_meta_registrations", META_KERNELS),
    ("torch/_refs", META_KERNELS),
    ("torch/_prims", META_KERNELS),
    ("torch/_decomp", META_KERNELS),
    ("torch/fx/experimental/symbolic_shapes", META_KERNELS),
    ("torch/__init__.py", META_KERNELS),  # torch._check, called by the meta kernels
    ("torch/", "torch Python (autograd, nn.Module)"),
)


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MxKxN (tokens x in x out), e.g. 512x256x384") from None
    return m, k, n


@contextlib.contextmanager
def _cuda_path(device: str, recipe: str) -> Iterator[Counter]:
    # The CUDA path: on meta tensors presented as a GPU, launches recorded; on a GPU, as it runs.
    with contextlib.ExitStack() as stack:
        launches: Counter = Counter()
        if device == "meta":
            stack.enter_context(meta_as_cuda(CAPABILITY.get(recipe, (9, 0))))
            stack.enter_context(force_path("native"))
            stack.enter_context(force_kernels("triton"))
            launches = stack.enter_context(record_launches())
        yield launches


def _step_tensors(shape: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A step's input [M, K] (requires grad) and output gradient [M, N], BF16; values except on meta.
    m, k, n = shape
    x = torch.empty(m, k, device=device, dtype=torch.bfloat16)
    grad = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    if device.type != "meta":
        x.normal_(), grad.normal_()
    return x.requires_grad_(), grad


def _precision(device: torch.device, precision: str) -> tuple[torch.dtype, Callable[[], contextlib.AbstractContextManager]]:
    # The weights' dtype and the torch autocast of a precision. bf16-true: BF16 weights, no torch
    # autocast; bf16-mixed: FP32 master weights under torch.autocast(bfloat16), as Lightning's
    # bf16-mixed and the fp8-* precisions run them.
    if precision == "bf16-mixed":
        return torch.float32, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.bfloat16, contextlib.nullcontext


def _layers(shape: tuple[int, int, int], device: torch.device, recipe_name: str, precision: str = "bf16-true"):
    # The two layers' steps, in ``precision`` (_precision), and a function (steps, repeats) -> the
    # FP8 step's per-model host µs (_per_model_us).
    _, k, n = shape
    recipe = RECIPES[recipe_name]()
    weight_dtype, autocast = _precision(device, precision)
    fp8 = fp8_plugin.FP8Linear(k, n, bias=False, device=device, dtype=weight_dtype, recipe=recipe)
    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=weight_dtype)
    x, grad = _step_tensors(shape, device)

    def fp8_step() -> None:
        with autocast(), fp8_plugin.autocast(recipe=recipe):
            y = fp8(x)
        y.backward(grad)
        fp8.weight.grad = x.grad = None

    def bf16_step() -> None:
        with autocast():
            y = bf16(x)
        y.backward(grad)
        bf16.weight.grad = x.grad = None

    def per_model_us(steps: int, repeats: int) -> float:
        return _per_model_us(fp8, lambda: fp8_plugin.autocast(recipe=recipe), autocast, x, grad, steps, repeats)

    return fp8_step, bf16_step, per_model_us


def _per_model_us(layer: nn.Module, fp8_autocast: Callable[[], contextlib.AbstractContextManager],
                  autocast: Callable[[], contextlib.AbstractContextManager], x: torch.Tensor, grad: torch.Tensor,
                  steps: int, repeats: int) -> float:
    # The per-model host work of the FP8 step, timed as it runs (no profiler: cProfile inflates
    # Python-heavy work unevenly): the scale update (the layer's group's, wrapped on the instance
    # for the runs) and the FP8 autocast's entry and exit. The least of ``repeats`` means.
    group = layer.scaling_group
    update, spent = group.update, [0.0]

    def timed_update(*args, **kwargs) -> None:
        start = time.perf_counter()
        update(*args, **kwargs)
        spent[0] += time.perf_counter() - start

    def step() -> None:
        with autocast():
            start = time.perf_counter()
            context = fp8_autocast()
            context.__enter__()
            entered = time.perf_counter()
            y = layer(x)
            left = time.perf_counter()
            context.__exit__(None, None, None)
            spent[0] += entered - start + time.perf_counter() - left
        y.backward(grad)
        layer.weight.grad = x.grad = None

    group.update = timed_update  # an instance attribute: the forward's group.update(...) finds it first
    try:
        for _ in range(5):
            step()
        runs = []
        for _ in range(repeats):
            spent[0] = 0.0
            for _ in range(steps):
                step()
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            runs.append(spent[0] / steps * 1e6)
    finally:
        del group.update
    return min(runs)


def _chain(shape: tuple[int, int, int], device: torch.device, recipe_name: str, layers: int,
           precision: str = "bf16-true") -> tuple[Callable[[], None], Callable[[], None]]:
    # Steps of ``layers`` FP8 layers and as many nn.Linear layers, each layer's input the previous
    # one's output (K -> N, N -> K, ...), as a model's blocks run them: the chain skip_small="auto"
    # measures (fp8_plugin.modules.speed_rule.chain_steps) at this profile's shape and precision.
    m, k, n = shape
    return chain_steps(device, RECIPES[recipe_name](), layers=layers, tokens=m, features=(k, n),
                       mixed=precision == "bf16-mixed")


def _floor_step(shape: tuple[int, int, int], device: torch.device, recipe_name: str) -> Optional[Callable[[], None]]:
    # The host floor of a per-tensor FP8 layer step: the same three fused casts (the plugin's
    # quantizers, their kept launch plans) and three GEMMs (the kernel in use: the Triton GEMM or
    # torch._scaled_mm) inside a bare autograd.Function, with nothing else. None for block recipes.
    recipe = RECIPES[recipe_name]()
    if recipe_gemm_kind(recipe) != "tensorwise":
        return None
    _, k, n = shape
    layer = fp8_plugin.FP8Linear(k, n, bias=False, device=device, dtype=torch.bfloat16, recipe=recipe)
    cast_x, cast_w, cast_g = (make_quantizer(recipe, role, layer.fp8_state, True, host=False)
                              for role in (INPUT, WEIGHT, GRAD_OUTPUT))
    if gemm_kernel() == "triton":
        def gemm(a, b, scale_a, scale_b):  # a [M, K] @ b [N, K].T
            return scaled_gemm(a, b, scale_a, scale_b, torch.bfloat16)
    else:
        def gemm(a, b, scale_a, scale_b):
            return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, x_data, x_scale_inv, w_data, w_scale_inv, xt_data, wt_data):
            ctx.save_for_backward(xt_data, x_scale_inv, wt_data, w_scale_inv)
            return gemm(x_data, w_data, x_scale_inv, w_scale_inv)

        @staticmethod
        def backward(ctx, grad):
            xt_data, x_scale_inv, wt_data, w_scale_inv = ctx.saved_tensors
            g, g_t = cast_g.quantize_pair(grad, columnwise=True)
            grad_x = gemm(g.data, wt_data, g.scale_inv, w_scale_inv)  # dgrad: g [M, N] @ W [N, K]
            grad_w = gemm(g_t.data, xt_data, g.scale_inv, x_scale_inv)  # wgrad: g.T [N, M] @ x [M, K]
            return grad_x, grad_w, None, None, None, None, None, None

    x, grad = _step_tensors(shape, device)

    def floor_step() -> None:
        qx, qx_t = cast_x.quantize_pair(x, columnwise=True)
        qw, qw_t = cast_w.quantize_pair(layer.weight, columnwise=True)
        Bare.apply(x, layer.weight, qx.data, qx.scale_inv, qw.data, qw.scale_inv, qx_t.data, qw_t.data).backward(grad)
        layer.weight.grad = x.grad = None

    return floor_step


def _per_step_us(step: Callable[[], None], steps: int, repeats: int, device: torch.device) -> float:
    for _ in range(5):
        step()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append((time.perf_counter() - start) / steps * 1e6)
    return min(runs)  # the least disturbed run: other processes only ever add time


def _category(filename: str) -> str:
    if filename == "~":
        return "torch C++ ops (dispatch, kernels' host side)"
    for fragment, name in CATEGORIES:
        if fragment in filename.replace("\\", "/"):
            return name
    return "other Python"


def _profile(step: Callable[[], None], steps: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Own time per category and per fp8-plugin function (seconds per step), and the whole
    profiled step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own, cumulative, callers)}
    categories: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    total = 0.0
    for (filename, line, name), (_, _, own, _, _) in stats.items():
        category = _category(filename)
        categories[category] += own / steps
        total += own / steps
        if category == "fp8-plugin Python":
            functions[f"{filename.split('fp8_plugin/')[-1]}:{name}"] += own / steps
    return dict(categories), dict(functions), total


def _less_meta_kernels(us: float, step: Callable[[], None], steps: int) -> float:
    # ``us`` (the unprofiled time of ``step``, or a part of it) less the share of torch's Python
    # meta kernels in a profile of the same step: between 0 and ``us`` whatever the load.
    categories, _, profiled = _profile(step, steps)
    return us * (1 - categories.get(META_KERNELS, 0.0) / profiled) if profiled else us


def _gemm_calls(step: Callable[[], None]) -> Counter:
    # GEMM calls of one step, by aten op (a dispatch mode sees them on meta and on a GPU alike).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gemms(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.lstrip("_") in {g.lstrip("_") for g in GEMMS} or name in GEMMS:
                self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    with Gemms() as mode:
        step()
    return mode.calls


def profile_recipe(recipe: str, shape: tuple[int, int, int], device: torch.device, steps: int, repeats: int,
                   top: int, precision: str = "bf16-true", chain: int = 32) -> dict:
    """The figures of one recipe (module docstring), as a dict."""
    with _cuda_path(device.type, recipe) as launches:
        fp8_step, bf16_step, per_model = _layers(shape, device, recipe, precision)
        fp8_us = _per_step_us(fp8_step, steps, repeats, device)
        bf16_us = _per_step_us(bf16_step, steps, repeats, device)
        per_model_us = per_model(steps, repeats)
        chain_steps = max(1, steps // max(chain, 1))
        # Per layer, each chain step less its own meta kernels, profiled on that step: the single
        # layer's, timed at another moment, made a figure negative under a changing load.
        chain_us = [_less_meta_kernels(_per_step_us(s, chain_steps, repeats, device) / chain, s, chain_steps)
                    for s in _chain(shape, device, recipe, chain, precision)] if chain else [None, None]
        floor_step = _floor_step(shape, device, recipe)
        floor_us = None if floor_step is None else _per_step_us(floor_step, steps, repeats, device)
        launches.clear()
        fp8_step()
        triton = dict(launches)
        categories, functions, profiled = _profile(fp8_step, steps)
        bf16_categories, _, bf16_profiled = _profile(bf16_step, steps)
        # The Triton GEMM's are launches (a dispatch mode would see torch._scaled_mm in their place).
        gemms = ({"_scaled_gemm_kernel": triton["_scaled_gemm_kernel"]} if "_scaled_gemm_kernel" in triton
                 else dict(_gemm_calls(fp8_step)))
    scale = fp8_us / profiled  # profiled seconds -> unprofiled µs
    shares = {name: seconds * scale for name, seconds in sorted(categories.items(), key=lambda kv: -kv[1])}
    meta_us = shares.get(META_KERNELS, 0.0)
    bf16_meta_us = bf16_categories.get(META_KERNELS, 0.0) * bf16_us / bf16_profiled
    per_layer = fp8_us - meta_us - per_model_us
    bf16_per_layer = bf16_us - bf16_meta_us
    chain_fp8, chain_bf16 = chain_us
    return {
        "recipe": recipe,
        "fp8_us": fp8_us,
        "bf16_us": bf16_us,
        "ratio": fp8_us / bf16_us,
        "per_layer_fp8_us": per_layer,
        "per_layer_bf16_us": bf16_per_layer,
        "per_layer_ratio": per_layer / bf16_per_layer,
        "per_model_us": per_model_us,
        "chain_layers": chain,
        "chain_fp8_us_per_layer": chain_fp8,
        "chain_bf16_us_per_layer": chain_bf16,
        "chain_ratio": None if chain_fp8 is None else chain_fp8 / chain_bf16,
        "floor_us": floor_us,
        "floor_ratio": None if floor_us is None else floor_us / bf16_per_layer,
        "meta_kernels_us": meta_us,
        "triton_launches": triton,
        "gemm_calls": gemms,
        "categories_us": shares,
        "top_functions_us": dict(sorted(((f, s * scale) for f, s in functions.items()), key=lambda kv: -kv[1])[:top]),
    }


def table(data: dict) -> str:
    """The markdown report of :func:`main`'s data."""
    env = data["environment"]
    m, k, n = data["shape"]
    kernel = data.get("gemm_kernel", "torch")
    lines = [f"# FP8Linear host time per training step ({data['device']}, {m} x {k} -> {n}, "
             f"{data.get('precision', 'bf16-true')}, "
             f"{'the Triton GEMM' if kernel == 'triton' else 'torch._scaled_mm'})", "",
             f"{env['device']}; torch {env['torch']}; commit {env['commit']}; {env['date']}", "",
             "| recipe | FP8 µs | nn.Linear µs | ratio | per-layer FP8 µs | per-layer ratio | floor µs | floor ratio "
             "| per-model µs | chain FP8 µs/layer | chain nn.Linear µs/layer | chain ratio | meta kernels µs "
             "| Triton launches | GEMMs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["recipes"]:
        floor = (f"{r['floor_us']:.0f} | {r['floor_ratio']:.2f}x" if r.get("floor_us") is not None else "- | -")
        chain = (f"{r['chain_fp8_us_per_layer']:.0f} | {r['chain_bf16_us_per_layer']:.0f} | {r['chain_ratio']:.2f}x"
                 if r.get("chain_ratio") is not None else "- | - | -")
        lines.append(f"| {r['recipe']} | {r['fp8_us']:.0f} | {r['bf16_us']:.0f} | {r['ratio']:.2f}x | "
                     f"{r['per_layer_fp8_us']:.0f} | {r['per_layer_ratio']:.2f}x | {floor} | "
                     f"{r['per_model_us']:.0f} | {chain} | {r['meta_kernels_us']:.0f} | {sum(r['triton_launches'].values())} | "
                     f"{sum(r['gemm_calls'].values())} |")
    lines += ["", "Per-layer: the step less the per-model work (the scale update, the FP8 autocast's entry and "
              "exit: once per step for a whole model) and (meta proxy) torch's Python meta "
              "kernels, which a GPU runs in C++; nn.Linear's less its own meta kernels. Floor: the same casts "
              "and GEMM launches in a bare autograd.Function, nothing else (per-tensor recipes; on the meta "
              "proxy with torch._scaled_mm it includes that op's meta kernels); floor ratio: against nn.Linear's "
              "per-layer figure. Chain: a step of a chain of layers (each one's input the previous one's output) "
              "as a model runs them, per layer, the per-step work included (the scale update grows with the "
              "layers it updates), less its own meta kernels (their share of a profile of the chain step).", ""]
    for r in data["recipes"]:
        lines.append(f"## {r['recipe']}: where the FP8 step's host time goes (µs)")
        lines.append("")
        lines += [f"- {name}: {us:.0f}" for name, us in r["categories_us"].items()]
        lines.append(f"- Triton launches: {', '.join(f'{k} x{v}' for k, v in r['triton_launches'].items()) or 'none'}")
        lines.append("")
        lines.append("| fp8-plugin function | own µs |")
        lines.append("| --- | ---: |")
        lines += [f"| `{name}` | {us:.1f} |" for name, us in r["top_functions_us"].items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("meta", "cuda"), default="meta")
    parser.add_argument("--shape", type=_shape, default=(512, 256, 384), help="tokens x in x out (default 512x256x384)")
    parser.add_argument("--recipes", default="delayed,current,blockwise,mxfp8",
                        help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the fastest is kept)")
    parser.add_argument("--top", type=int, default=12, help="fp8-plugin functions listed per recipe")
    parser.add_argument("--gemm-kernel", choices=GEMM_KERNELS, default="torch",
                        help="the per-tensor recipes' GEMM: torch._scaled_mm (torch) or the Triton GEMM (triton)")
    parser.add_argument("--precision", choices=("bf16-true", "bf16-mixed"), default="bf16-true",
                        help="bf16-true: BF16 weights, no torch autocast (default); bf16-mixed: FP32 master weights "
                             "under torch.autocast(bfloat16), as the precision plugins run them (a GPU only)")
    parser.add_argument("--chain", type=int, default=32,
                        help="layers in the chain measured as a model runs them (default 32; 0: none)")
    parser.add_argument("--output", type=Path, default=Path("runs/benchmarks/host_profile.json"))
    args = parser.parse_args(argv)
    if args.chain < 0:
        parser.error(f"--chain {args.chain}: a layer count; valid: 0 (no chain) or more")
    if args.precision == "bf16-mixed" and args.device != "cuda":
        parser.error("--precision bf16-mixed needs --device cuda: torch.autocast does nothing on meta tensors, "
                     "and emulating it in Python would add host time a GPU does not spend; valid on meta: bf16-true")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes {','.join(unknown)}: not a recipe; valid: {', '.join(RECIPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU; valid here: --device meta")
    device = torch.device(args.device)
    with force_gemm_kernel(args.gemm_kernel):
        profiles = [profile_recipe(r, args.shape, device, args.steps, args.repeats, args.top, args.precision, args.chain)
                    for r in recipes]
    data = {"device": args.device, "shape": list(args.shape), "steps": args.steps, "repeats": args.repeats,
            "gemm_kernel": args.gemm_kernel, "precision": args.precision, "chain": args.chain,
            "environment": environment(torch.device("cuda" if args.device == "cuda" else "cpu")),
            "recipes": profiles}
    write_report(args.output, data, table(data))
    return data


if __name__ == "__main__":
    main()
