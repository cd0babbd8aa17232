#!/usr/bin/env bash
# The main job: set up, then run the benchmark / accuracy demo (quick suite by default).
# Results go to bench/results/local/<device>/ (git-ignored), never over committed figures;
# write those explicitly: bash scripts/bench.sh --suite full --out bench/results/<gpu>.
# Exit status 1 when a provider disagrees with the float64 oracle (or raises).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" bench/run.py "${@:---suite=quick}"
# the host cost per call (microseconds, launches, fused_rl functions, dispatcher ops)
"$PY" bench/run.py host
