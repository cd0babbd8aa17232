#!/usr/bin/env bash
# The test command: set up, lint, then run the suite (Triton interpreter on CPU-only machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest -q --benchmark-disable -n auto "$@"  # pytest-xdist: one worker per core
