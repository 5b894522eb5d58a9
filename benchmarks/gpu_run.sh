#!/usr/bin/env bash
# The first command to run on a GPU: at most 9 min 20 s, the most valuable answers first, every
# step under its own time limit, all results in one archive (benchmarks/README.md, "GPU protocol").
#
#   benchmarks/gpu_run.sh [OUTPUT_DIR] [--device cuda|cpu]
#
#   1. device.txt     date, commit, torch / CUDA / Triton versions, the GPU as torch reports it,
#                     describe_device() (which recipes run natively), nvidia-smi;
#   2. contract.txt   the CUDA contract suite on the GPU itself (FP8_CONTRACT_DEVICE=cuda);
#   3. models.md/json the model table (benchmarks/model_table.py): 125M, 1B and an 8B-shaped block at
#                     sequence 2048, bf16-mixed / fp8-hybrid / torchao, eager, CUDA graphs and
#                     compiled, each run a process of its own, the missing figures first; torchao's
#                     wheel is installed for this step alone where one was carried in
#                     (TORCHAO_WHEEL_DIR, default wheels/);
#   4. memory.json    benchmarks/memory_fit.py check: the memory tool's traced peak (meta tensors as
#                     this GPU) against torch.cuda.max_memory_allocated of the same step, 125M and 1B,
#                     bf16-mixed / fp8-hybrid, AdamW / FP8AdamW (issue 46: within 10%);
#   5. compiled.md/json  the larger layer shape compiled (BF16, delayed and current scaling; a graph
#                     break is reported with its reason and the user line it broke at);
#   6. host.md/json, host_4096.md/json  benchmarks/host_profile.py: where an FP8Linear step's host
#                     time goes, per recipe, against nn.Linear (HOST_RECIPES narrows the recipes);
#                     host_triton*.md/json the same with the Triton GEMM (delayed, current);
#                     host_triton_mixed.md/json with FP32 master weights under bf16-mixed autocast;
#   7. layer.md/json  FP8Linear forward + backward against BF16 at 2 shapes, every recipe, eagerly
#                     (delayed+triton, current+triton: with the Triton GEMM);
#   8. model.md/json  a 125M Llama model's training steps, Lightning and Accelerate, FP8 against BF16;
#   9. probe.txt      benchmarks/gpu_probe.py: every GEMM variant the project can call, native
#                     against the emulation, one line each (crash-isolated);
#  10. contract_meta.log  the contract suite on meta tensors against this machine's torch, with the
#                     time left (GPU run only).
#
# What each step cost on the H100 of 2026-11-27, its cap in brackets: device 13 s [45]; contract
# over 120 s [150]; models 234 s [240, its runs stop 10 s before]; memory not measured yet [45]; compiled 29 s [60]; host 36 s
# [70, with the Triton GEMM's two runs added]; layer 22 s [70]; model 29 s [60]; probe 22 s [90]; contract_meta 47 s [120] gets what is
# left. A step stopped at its cap gets SIGINT (pytest then reports the failures so far), SIGKILL
# 10 s later.
#
# OUTPUT_DIR (default runs/benchmarks/gpu-<UTC time>) receives two files: gpu_run.tar.gz (all of the
# above, and each step's log) and summary.txt (one line per step: passed / failed / timed out, and
# seconds). The device machine returns at most 8 files: these two leave room.
#
# --device cpu rehearses the same command on a CPU (tests/benchmarks/test_gpu_run.py runs it): the probe on
# CPU, the contract suite on meta tensors in step 2, the layer and model steps at CPU sizes.
#
# PYTHON picks the interpreter (default python3); BUDGET_S the whole command's limit (default 560,
# under the device machine's 600 s per command); CONTRACT_TESTS the contract suite's tests (default
# tests/cuda_contract), LAYER_SHAPES the layer shapes of steps 6 and 4 (MxKxN,...; the last one is
# compiled), COMPILE_VARIANTS the layers compiled in step 4 (default bf16,delayed,current) and
# MODEL_RUNS the model table's runs (precision:mode,...; default all): the test suite's rehearsal
# narrows them.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
CONTRACT_TESTS=${CONTRACT_TESTS:-tests/cuda_contract}
COMPILE_VARIANTS=${COMPILE_VARIANTS:-bf16,delayed,current}
LAYER_SHAPES=${LAYER_SHAPES:-}
MODEL_RUNS=${MODEL_RUNS:-}
HOST_RECIPES=${HOST_RECIPES:-delayed,current,blockwise,mxfp8}
TORCHAO_WHEEL_DIR=${TORCHAO_WHEEL_DIR:-wheels}
DEVICE=cuda
OUTPUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:-}; shift 2 ;;
        --device=*) DEVICE=${1#--device=}; shift ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        -*) echo "gpu_run.sh: unknown option $1; valid: --device cuda|cpu" >&2; exit 2 ;;
        *) OUTPUT=$1; shift ;;
    esac
done
case "$DEVICE" in
    cuda|cpu) ;;
    *) echo "gpu_run.sh: --device $DEVICE is not a device; valid: cuda, cpu" >&2; exit 2 ;;
esac
OUTPUT=${OUTPUT:-runs/benchmarks/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUTPUT"
WORK=$(mktemp -d)
TORCHAO_SITE=$(mktemp -d)  # torchao's carried-in wheel, on PYTHONPATH for the models step alone
trap 'rm -rf "$WORK" "$TORCHAO_SITE"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
START=$(date +%s)
: > "$OUTPUT/summary.txt"
failures=0

# step NAME CAP_S COMMAND...: run COMMAND under `timeout` (CAP_S, or what is left of the budget
# if less), its output to $WORK/NAME.log and the screen, one summary line.
step() {
    local name=$1 cap=$2; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    local limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 5 ]; then
        echo "$name: not run (budget of ${BUDGET_S} s spent)" | tee -a "$OUTPUT/summary.txt"
        failures=$((failures + 1))
        return
    fi
    echo "== $name (at most ${limit} s)"
    local began=$(date +%s)
    # bash -c: a step may be one of this script's functions (exported below); STEP_LIMIT_S tells
    # a step that keeps its own budget (the model table) how long it has.
    # SIGINT at the limit, not SIGTERM: pytest then prints the failures so far and writes its
    # report (the H100 run of 2026-11-27 lost the contract step's failures to a SIGTERM).
    STEP_LIMIT_S=$limit timeout --signal=INT --kill-after=10 "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee "$WORK/$name.log"
    local status=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - began ))
    local verdict
    case $status in
        0) verdict=passed ;;
        124|137) verdict="TIMED OUT after ${limit} s" ;;
        *) verdict="FAILED (exit $status)" ;;
    esac
    [ "$status" = 0 ] || failures=$((failures + 1))
    echo "$name: $verdict in ${took} s" | tee -a "$OUTPUT/summary.txt"
}

device_report() {
    echo "date (UTC): $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if git rev-parse --short HEAD >/dev/null 2>&1; then
        echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ' (uncommitted changes)')"
    else
        echo "commit: unknown (no git checkout here: record the commit the tree was copied from)"
    fi
    "$PYTHON" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError as err:
    print(f"triton: not importable ({err})")
for i in range(torch.cuda.device_count()):
    major, minor = torch.cuda.get_device_capability(i)
    print(f"cuda:{i}: {torch.cuda.get_device_name(i)} (sm{major}{minor})")
from fp8_plugin.numerics.device import describe_device
print(describe_device())
EOF
    if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
}

contract() {
    # --confcutdir tests: the root conftest.py (the docs' examples, Sybil) is not needed here.
    # -n 0: in one process, as the GPU is one (pyproject's addopts would start two workers).
    FP8_CONTRACT_DEVICE=$1 "$PYTHON" -m pytest -q -ra -n 0 -p no:cacheprovider --confcutdir tests \
        --junitxml "$WORK/contract_$1.xml" $CONTRACT_TESTS
}

# The model table, torchao from the carried-in wheel where there is one and torchao is not installed.
models() {
    local wheel
    wheel=$(ls "$TORCHAO_WHEEL_DIR"/torchao-0.18.0-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ] && ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchao') is None)"; then
        if "$PYTHON" -m pip install --quiet --no-deps --target "$TORCHAO_SITE" "$wheel"; then
            export PYTHONPATH="$TORCHAO_SITE${PYTHONPATH:+:$PYTHONPATH}"
            echo "torchao: installed from $wheel for this step"
        else
            echo "torchao: installing $wheel failed; its runs are recorded as not installed"
        fi
    fi
    "$PYTHON" benchmarks/model_table.py --device "$DEVICE" --budget $((STEP_LIMIT_S - 10)) \
        ${MODEL_RUNS:+--runs "$MODEL_RUNS"} --output "$WORK/models.json"
}

# The host profile of an FP8Linear step (benchmarks/host_profile.py): on the GPU at a shape where
# it waits for the host, and at 4096 x 2048 x 2048; on the CPU rehearsal, on meta tensors.
host_profiles() {
    if [ "$DEVICE" = cuda ]; then
        "$PYTHON" benchmarks/host_profile.py --device cuda --recipes "$HOST_RECIPES" --steps 100 --repeats 3 \
            --output "$WORK/host.json" &&
        "$PYTHON" benchmarks/host_profile.py --device cuda --recipes "$HOST_RECIPES" --shape 4096x2048x2048 \
            --steps 50 --repeats 3 --output "$WORK/host_4096.json" &&
        "$PYTHON" benchmarks/host_profile.py --device cuda --recipes delayed,current --gemm-kernel triton \
            --steps 100 --repeats 3 --output "$WORK/host_triton.json" &&
        "$PYTHON" benchmarks/host_profile.py --device cuda --recipes delayed,current --gemm-kernel triton \
            --shape 4096x2048x2048 --steps 50 --repeats 3 --output "$WORK/host_triton_4096.json" &&
        "$PYTHON" benchmarks/host_profile.py --device cuda --recipes delayed,current --gemm-kernel triton \
            --precision bf16-mixed --steps 100 --repeats 3 --output "$WORK/host_triton_mixed.json"
    else
        "$PYTHON" benchmarks/host_profile.py --device meta --recipes "$HOST_RECIPES" --steps 20 --repeats 2 \
            --output "$WORK/host.json"
    fi
}

export -f device_report contract models host_profiles
export PYTHON WORK CONTRACT_TESTS DEVICE MODEL_RUNS TORCHAO_WHEEL_DIR TORCHAO_SITE HOST_RECIPES

if [ "$DEVICE" = cuda ]; then
    SHAPES=4096x2048x2048,16384x8192x8192; BIG=16384x8192x8192; MODEL="--models 125m --batch-size 4 --seq-len 1024"
    CONTRACT=cuda; MEMORY="--device cuda"
else
    # The rehearsal checks the command, not its figures: 16 tokens a row in the model step (its
    # BF16 runs took 1.7 s a step at 64 on a CPU without AVX512-BF16).
    SHAPES=128x128x128,256x256x256; BIG=256x256x256; MODEL="--models tiny --seq-len 16"; CONTRACT=meta
    MEMORY="--device meta --models suite-125m"
fi
if [ -n "$LAYER_SHAPES" ]; then SHAPES=$LAYER_SHAPES; BIG=${LAYER_SHAPES##*,}; fi

# Most valuable first. The contract suite on the GPU holds the GPU-only tests (CUDA graphs
# against eager bit for bit, cached launches); the model table answers issue 43's targets; the
# compiled layer names where torch.compile breaks the graph; the host profile, the layer step and
# the suite's model section were measured on the H100 on 2026-11-27, and the probe's GEMM variants
# all passed on four GPU runs.
step device 45 device_report
cp "$WORK/device.log" "$WORK/device.txt"
step contract 150 contract "$CONTRACT"
cp "$WORK/contract.log" "$WORK/contract.txt"
step models 240 models
# shellcheck disable=SC2086  # MEMORY holds several arguments
step memory 45 "$PYTHON" benchmarks/memory_fit.py check $MEMORY --output "$WORK/memory.json"
step compiled 60 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections layer --shapes "$BIG" \
    --steps 5 --warmup 2 --compile --compile-variants "$COMPILE_VARIANTS" --output "$WORK/compiled.json"
step host 70 host_profiles
step layer 70 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections layer --shapes "$SHAPES" \
    --steps 5 --warmup 2 --output "$WORK/layer.json"
# shellcheck disable=SC2086  # MODEL holds several arguments
step model 60 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections model $MODEL \
    --steps 3 --warmup 1 --output "$WORK/model.json"
step probe 90 "$PYTHON" benchmarks/gpu_probe.py --device "$DEVICE" --timeout 20 --output "$WORK/probe.txt"
if [ "$DEVICE" = cuda ]; then
    step contract_meta 120 contract meta
fi

took=$(( $(date +%s) - START ))
echo "total: ${took} s of a ${BUDGET_S}-s budget; ${failures} step(s) not passed" | tee -a "$OUTPUT/summary.txt"
cp "$OUTPUT/summary.txt" "$WORK/summary.txt"
tar -czf "$OUTPUT/gpu_run.tar.gz" -C "$WORK" .
echo "results: $OUTPUT/gpu_run.tar.gz, $OUTPUT/summary.txt"
[ "$failures" = 0 ]
