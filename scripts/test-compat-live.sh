#!/usr/bin/env bash
# Live compatibility check against the real libraries (needs the package index; NOT part of CI).
#
# For each library, in its own virtual environment (which sees this machine's torch, triton
# and fused_rl, made by scripts/compat_live/venv.sh, so nothing multi-GB is downloaded):
#   1. scripts/compat_live/<lib>/install.sh installs the pinned upstream release(s);
#   2. the project's real-library tests, tests/test_compat_<lib>*.py and, where there are
#      some, the trainer integrations' training runs, tests/test_integration_<lib>*.py (they
#      skip without the library; here they run against it); for verl also its Megatron top-k
#      distillation on gloo ranks, tests/test_distributed_topk.py;
#   3. scripts/compat_live/<lib>/check.py: a differential comparison of every adapter function
#      with the original (values, gradients, dtypes over random shapes, masks, dtypes and edge
#      cases) and, where the release ships them, the library's own unit tests run twice: as
#      released and with its functions monkeypatched to fused_rl's.
# Then scripts/compat_live/summary.py writes the table into docs/compat.md.
#
# Usage: bash scripts/test-compat-live.sh [trl] [verl] [torchtune] [ding] [liger]   (default: all five)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENVS=${COMPAT_VENVS:-.compat-venvs}
OUT=${COMPAT_OUT:-compat-live}
LIBS=("$@")
[ ${#LIBS[@]} -eq 0 ] && LIBS=(trl verl torchtune ding liger)
mkdir -p "$OUT"
status=0
for lib in "${LIBS[@]}"; do
    echo "=== $lib"
    venv="$VENVS/$lib"
    # made anew unless it sees torch and fused_rl (pins.py checks; a venv made otherwise
    # would let pip pull a torch of its own)
    if ! "$venv/bin/python" scripts/compat_live/pins.py >/dev/null 2>&1; then
        rm -rf "$venv"
        bash scripts/compat_live/venv.sh "$PY" "$venv"
    fi
    vpy="$venv/bin/python"
    bash "scripts/compat_live/$lib/install.sh" "$vpy"
    tests=(tests/test_compat_"$lib"*.py)
    # a trainer integration is proven by training: the tiny-model runs against the trainer
    for t in tests/test_integration_"$lib"*.py; do [ -f "$t" ] && tests+=("$t"); done
    # --benchmark-disable only where pytest-benchmark is installed (pytest rejects it else)
    flags=()
    "$vpy" -c "import pytest_benchmark" 2>/dev/null && flags=(--benchmark-disable)
    "$vpy" -m pytest -q -p no:cacheprovider "${flags[@]}" \
        --junitxml "$OUT/$lib.project-tests.xml" "${tests[@]}" || status=1
    if [ "$lib" = verl ]; then  # verl's Megatron top-k distillation on gloo ranks (the kernels
        # through the Triton interpreter, as the vocab-parallel tests run on a CPU)
        TRITON_INTERPRET=1 "$vpy" -m pytest -q -p no:cacheprovider "${flags[@]}" \
            --junitxml "$OUT/$lib.distributed-tests.xml" tests/test_distributed_topk.py || status=1
    fi
    "$vpy" "scripts/compat_live/$lib/check.py" --out "$OUT/$lib.json" || status=1
done
"$PY" scripts/compat_live/summary.py "$OUT" --write docs/compat.md
exit $status
