#!/usr/bin/env bash
# Installs the TRL release the adapter mirrors into the live check's venv.
# $1: the venv's python (made by ../venv.sh: torch, triton, pytest and
# fused_rl come from this machine and must stay as they are).
set -euo pipefail
PY=${1:?usage: install.sh VENV_PYTHON}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" "$(dirname "$0")/../pins.py" >"$constraints"
# trl.trainer.utils imports transformers, accelerate, datasets, huggingface_hub and pandas
# at module level: TRL's own requirements, and PEFT (TRL's `peft` extra) for the LoRA runs
# of the trainer integration (its reference model is the policy with the adapter off).
"$PY" -m pip install -q -c "$constraints" "trl==1.16.0" "peft==0.21.2"
"$PY" -c "import trl, trl.trainer.utils; print('trl', trl.__version__)"
