#!/usr/bin/env bash
# Creates a live check's venv that sees this machine's torch, triton, pytest and fused_rl.
# $1: the python whose packages the venv must see; $2: the venv's folder.
# `python -m venv --system-site-packages` run from a venv's python links the BASE
# interpreter's site-packages, not the venv's: pip would then resolve a torch of its own
# for accelerate / torchtune (the multi-GB CUDA build). So the parent's site-packages are
# added explicitly, processed as a site folder (its .pth files included: the editable
# fused_rl install is one).
set -euo pipefail
PY=${1:?usage: venv.sh PYTHON VENV}
VENV=${2:?usage: venv.sh PYTHON VENV}
"$PY" -m venv --system-site-packages "$VENV"
dirs=$("$PY" -c "import site; print(repr(site.getsitepackages()))")
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; list(map(site.addsitedir, $dirs))" >"$site/_fused_rl_parent.pth"
if ! "$VENV/bin/python" "$(dirname "$0")/pins.py" >/dev/null; then
    rm -rf "$VENV"  # not left behind half made
    exit 1
fi
