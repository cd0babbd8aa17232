#!/usr/bin/env bash
# Installs the DI-engine release fused_rl.compat.ding_v053 mirrors (0.5.3, the latest on PyPI)
# into the live check's venv; DI-engine main (fused_rl.compat.ding) is checked from its
# sources by check.py. $1: the venv's python (made by ../venv.sh: torch,
# triton, numpy, pytest and fused_rl come from this machine and must stay as they are).
#
# DI-engine 0.5.3's requirements cannot be installed here (numpy < 2, setuptools <= 66,
# gym == 0.25.1, flask / werkzeug <= 2.0.3, wandb <= 0.19: pip finds no resolution next to
# torch 2.13), and `ding.rl_utils` needs few of them. So: DI-engine itself with --no-deps,
# then what `import ding.rl_utils` imports (ding.torch_utils and ding.utils pull in
# DI-toolkit, DI-treetensor, easydict, URLObject, enum-tools, tabulate, tensorboardX, gym),
# each with its own requirements, under a constraints file pinning this machine's torch,
# triton and numpy so that pip can never replace them.
set -euo pipefail
PY=${1:?usage: install.sh VENV_PYTHON}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" "$(dirname "$0")/../pins.py" >"$constraints"
"$PY" -m pip install -q --no-deps "DI-engine==0.5.3"
"$PY" -m pip install -q -c "$constraints" DI-toolkit DI-treetensor easydict URLObject \
    enum-tools tabulate tensorboardX gym
"$PY" - <<'PYEOF'
import importlib.metadata as md
import logging

logging.disable(logging.WARNING)  # ding.utils: "Please install pyecharts first"
import torch
import ding.rl_utils  # noqa: F401

print("DI-engine", md.version("DI-engine"), "torch", torch.__version__)
PYEOF
