#!/usr/bin/env bash
# One command on a GPU answers both "does it run" and "how fast":
#   1. the machine: torch, CUDA, the GPU torch reports, which FP8 recipes run natively there;
#   2. the CUDA contract suite (tests/cuda_contract) -- the project's CUDA code paths -- twice:
#      a. on the GPU itself (FP8_CONTRACT_DEVICE=cuda): the tests of this GPU's compute capability,
#         on real cuda tensors, every host sync caught by the suite's op recorder;
#      b. on meta tensors treated as a GPU (the default mode): every compute capability the suite
#         presents (sm80 to sm120), checked against this machine's torch;
#   3. the benchmark suite (benchmarks/suite.py) -- FP8 against BF16, layer to model.
# Everything goes under one folder (default runs/benchmarks/gpu-<UTC time>); each step runs even
# when an earlier one fails, and the exit status is non-zero if any failed. Without a GPU step 2a
# stops at collection ("FP8_CONTRACT_DEVICE=cuda but torch.cuda.is_available() is False").
#
#   benchmarks/gpu_run.sh                          # on one H100 / H200: about 6 minutes by estimate
#   benchmarks/gpu_run.sh OUTPUT_DIR --batch-size 4   # arguments after the folder go to suite.py
#   PYTHON=.venv/bin/python benchmarks/gpu_run.sh /tmp/check --device cpu --quick --sections memory
#
# Needs torch, transformers, lightning and accelerate (and pytest for step 2; without it step 2
# is reported as not run); downloads nothing.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
OUTPUT=${1:-runs/benchmarks/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$OUTPUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "== 1. machine -> $OUTPUT/device.txt"
{
    echo "date (UTC): $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (uncommitted changes)')"
    "$PYTHON" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    major, minor = torch.cuda.get_device_capability(i)
    print(f"cuda:{i}: {torch.cuda.get_device_name(i)} (sm{major}{minor})")
from fp8_plugin.numerics.device import describe_device
print(describe_device())
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi
} > "$OUTPUT/device.txt" 2>&1
cat "$OUTPUT/device.txt"

# The contract suite in one mode: $1 = cuda or meta; its exit status.
contract_suite() {
    local mode=$1
    echo "== 2$([ "$mode" = cuda ] && echo a || echo b). CUDA contract suite, FP8_CONTRACT_DEVICE=$mode -> $OUTPUT/cuda_contract_$mode.txt"
    if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
        echo "not run: pytest is not installed for $PYTHON" | tee "$OUTPUT/cuda_contract_$mode.txt"
        return 127
    fi
    # --confcutdir tests: the repository root's conftest.py (the docs' examples, Sybil) is not
    # needed here, and Sybil may not be installed on the GPU machine. -ra lists every skip with
    # its reason (on the GPU: the tests of other compute capabilities).
    FP8_CONTRACT_DEVICE=$mode "$PYTHON" -m pytest -q -ra -p no:cacheprovider --confcutdir tests \
        --junitxml "$OUTPUT/cuda_contract_$mode.xml" tests/cuda_contract 2>&1 | tee "$OUTPUT/cuda_contract_$mode.txt"
    return "${PIPESTATUS[0]}"
}
contract_suite cuda; contract_cuda=$?
contract_suite meta; contract_meta=$?

echo "== 3. benchmark suite -> $OUTPUT/suite.md, suite.json, suite.log"
"$PYTHON" benchmarks/suite.py --output "$OUTPUT/suite.json" "$@" 2>&1 | tee "$OUTPUT/suite.log"
suite=${PIPESTATUS[0]}

passed() { [ "$1" = 0 ] && echo passed || echo "FAILED or not run (exit $1)"; }
summary="contract suite on the GPU: $(passed "$contract_cuda"); contract suite on meta: $(passed "$contract_meta"); \
benchmark suite: $([ "$suite" = 0 ] && echo ran || echo "FAILED (exit $suite)")"
echo "$summary" | tee "$OUTPUT/summary.txt"
echo "results: $OUTPUT"
[ "$contract_cuda" = 0 ] && [ "$contract_meta" = 0 ] && [ "$suite" = 0 ]
