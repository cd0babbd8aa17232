#!/usr/bin/env bash
# Install fused_rl (editable) and everything its tests and benchmarks need into the
# current Python. Safe to re-run; installs nothing that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch" 2>/dev/null; then
    # A machine without torch: the CPU build (2.13.0 resolves from the local wheel cache),
    # never the multi-GB CUDA build. A GPU machine already has its CUDA torch.
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[test,bench]"
