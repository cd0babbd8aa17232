#!/usr/bin/env bash
# Installs the torchtune release fused_rl.compat.torchtune mirrors into the live check's venv.
# $1: the venv's python (made by ../venv.sh: torch, triton, pytest and
# fused_rl come from this machine and must stay as they are).
#
# torchtune 0.6.1 with its own requirements (torchdata, datasets, huggingface_hub, ...: none
# of them pins torch, and `import torchtune.rlhf` needs datasets through torchtune.data) and
# torchao 0.16.0 (torchtune imports it at start-up). A constraints file pins what this machine
# already has, so pip can never replace torch.
set -euo pipefail
PY=${1:?usage: install.sh VENV_PYTHON}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" "$(dirname "$0")/../pins.py" >"$constraints"
"$PY" -m pip install -q -c "$constraints" "torchtune==0.6.1" "torchao==0.16.0"
"$PY" - <<'PYEOF'
import importlib.metadata as md
import warnings

warnings.filterwarnings("ignore")  # torchao: no C++ extensions for this torch (not needed)
import torch
import torchtune.rlhf  # noqa: F401
from torchtune.rlhf.loss import PPOLoss  # noqa: F401

print("torchtune", md.version("torchtune"), "torchao", md.version("torchao"), "torch", torch.__version__)
PYEOF
