#!/usr/bin/env bash
# The main job: set up, then run the benchmark / parity demo (quick suite by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" bench/run.py "${@:---suite=quick}"
