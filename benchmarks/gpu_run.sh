#!/usr/bin/env bash
# The first command to run on a GPU: at most 5.5 minutes, the most valuable answers first, every
# step under its own time limit, all results in one archive (benchmarks/README.md, "GPU protocol").
#
#   benchmarks/gpu_run.sh [OUTPUT_DIR] [--device cuda|cpu]
#
#   1. device.txt     date, commit, torch / CUDA / Triton versions, the GPU as torch reports it,
#                     describe_device() (which recipes run natively), nvidia-smi;
#   2. probe.txt      benchmarks/gpu_probe.py: every GEMM variant the project can call, native
#                     against the emulation, one line each (crash-isolated);
#   3. contract.txt   the CUDA contract suite on the GPU itself (FP8_CONTRACT_DEVICE=cuda);
#   4. layer.md/json  FP8Linear forward + backward against BF16 at 2 shapes, every recipe, eagerly;
#   5. model.md/json  a 125M Llama model's training steps, Lightning and Accelerate, FP8 against BF16;
#   6. compiled.md/json  the larger layer shape compiled (BF16, delayed and current scaling);
#   7. contract_meta.log  the contract suite on meta tensors against this machine's torch, with the
#                     time left (GPU run only).
#
# OUTPUT_DIR (default runs/benchmarks/gpu-<UTC time>) receives two files: gpu_run.tar.gz (all of the
# above, and each step's log) and summary.txt (one line per step: passed / failed / timed out, and
# seconds). The device machine returns at most 8 files: these two leave room.
#
# --device cpu rehearses the same command on a CPU (tests/test_gpu_run.py runs it): the probe on
# CPU, the contract suite on meta tensors in step 3, the layer and model steps at CPU sizes.
#
# PYTHON picks the interpreter (default python3); BUDGET_S the whole command's limit (default 330);
# CONTRACT_TESTS the contract suite's tests (default tests/cuda_contract), LAYER_SHAPES the layer
# shapes of steps 4 and 6 (MxKxN,...; the last one is compiled) and COMPILE_VARIANTS the layers
# compiled in step 6 (default bf16,delayed,current): the test suite's rehearsal narrows them.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-330}
CONTRACT_TESTS=${CONTRACT_TESTS:-tests/cuda_contract}
COMPILE_VARIANTS=${COMPILE_VARIANTS:-bf16,delayed,current}
LAYER_SHAPES=${LAYER_SHAPES:-}
DEVICE=cuda
OUTPUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:-}; shift 2 ;;
        --device=*) DEVICE=${1#--device=}; shift ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
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
trap 'rm -rf "$WORK"' EXIT
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
    # bash -c: a step may be one of this script's functions (exported below).
    timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee "$WORK/$name.log"
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
    FP8_CONTRACT_DEVICE=$1 "$PYTHON" -m pytest -q -ra -p no:cacheprovider --confcutdir tests \
        --junitxml "$WORK/contract_$1.xml" $CONTRACT_TESTS
}

export -f device_report contract
export PYTHON WORK CONTRACT_TESTS

if [ "$DEVICE" = cuda ]; then
    SHAPES=4096x2048x2048,16384x8192x8192; BIG=16384x8192x8192; MODEL="--models 125m --batch-size 4 --seq-len 1024"
    CONTRACT=cuda
else
    SHAPES=128x128x128,256x256x256; BIG=256x256x256; MODEL="--models tiny"; CONTRACT=meta
fi
if [ -n "$LAYER_SHAPES" ]; then SHAPES=$LAYER_SHAPES; BIG=${LAYER_SHAPES##*,}; fi

step device 45 device_report
cp "$WORK/device.log" "$WORK/device.txt"
step probe 90 "$PYTHON" benchmarks/gpu_probe.py --device "$DEVICE" --timeout 20 --output "$WORK/probe.txt"
step contract 120 contract "$CONTRACT"
cp "$WORK/contract.log" "$WORK/contract.txt"
step layer 70 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections layer --shapes "$SHAPES" \
    --steps 5 --warmup 2 --output "$WORK/layer.json"
# shellcheck disable=SC2086  # MODEL holds several arguments
step model 60 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections model $MODEL \
    --steps 3 --warmup 1 --output "$WORK/model.json"
step compiled 100 "$PYTHON" benchmarks/suite.py --device "$DEVICE" --sections layer --shapes "$BIG" \
    --steps 5 --warmup 2 --compile --compile-variants "$COMPILE_VARIANTS" --output "$WORK/compiled.json"
if [ "$DEVICE" = cuda ]; then
    step contract_meta 120 contract meta
fi

took=$(( $(date +%s) - START ))
echo "total: ${took} s of a ${BUDGET_S}-s budget; ${failures} step(s) not passed" | tee -a "$OUTPUT/summary.txt"
cp "$OUTPUT/summary.txt" "$WORK/summary.txt"
tar -czf "$OUTPUT/gpu_run.tar.gz" -C "$WORK" .
echo "results: $OUTPUT/gpu_run.tar.gz, $OUTPUT/summary.txt"
[ "$failures" = 0 ]
