#!/usr/bin/env bash
# Installs the Liger-Kernel release the adapter mirrors into the live check's venv.
# $1: the venv's python (made by ../venv.sh: torch, triton, pytest and fused_rl come from
# this machine and must stay as they are; pins.py's constraints make pip fail rather than
# replace them).
set -euo pipefail
PY=${1:?usage: install.sh VENV_PYTHON}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" "$(dirname "$0")/../pins.py" >"$constraints"
"$PY" -m pip install -q -c "$constraints" "liger-kernel==0.8.5"
"$PY" - <<'PYEOF'
import importlib.metadata as md

import liger_kernel.transformers.functional  # noqa: F401
import torch

print("liger-kernel", md.version("liger-kernel"), "torch", torch.__version__)
PYEOF
