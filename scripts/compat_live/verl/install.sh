#!/usr/bin/env bash
# Install verl 0.9.1 into the live-check venv ($1 = its python; the venv is created with
# ../venv.sh, so it already sees this machine's torch, triton and fused_rl).
#
# verl itself goes in with --no-deps; then only what `verl.trainer.ppo.core_algos`,
# `verl.utils.torch_functional` and the actor's loss module `verl.workers.utils.losses` import
# at module level (verl/__init__ pulls in ray, tensordict, transformers and omegaconf;
# core_algos codetiming through verl.workers.config; the losses module datasets and pillow
# through verl.utils.dataset), with verl 0.9.1's own version pins, and Megatron-Core (no deps). A constraints file pins torch, triton and numpy to the versions the
# venv already sees, so pip can never replace them: it fails instead.
#
# verl's CPU unit tests are not in the wheel: they come from the sdist
# (`pip download --no-binary :all: --no-deps verl==0.9.1`) into <venv>/verl-0.9.1-tests/tests,
# where check.py runs them.
set -euo pipefail
PY=${1:?usage: install.sh VENV_PYTHON}
VERSION=0.9.1
venv=$(cd "$(dirname "$PY")/.." && pwd)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" "$(dirname "$0")/../pins.py" >"$constraints"
pip_install() {
    "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" "$@"
}
pip_install --no-deps "verl==$VERSION"
pip_install \
    "ray>=2.41.0" \
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
    "transformers>=5.5.3,<5.11,!=5.6.0" \
    "omegaconf" \
    "codetiming" \
    "datasets" \
    "pillow" \
    "packaging>=20.0" \
    "pytest"
# Megatron-Core: verl's Megatron top-k distillation (verl.trainer.distillation.megatron)
# and its context-parallel packing, compared with fused_rl's on gloo ranks
pip_install --no-deps "megatron-core==0.16.1"

tests="$venv/verl-$VERSION-tests"
if [ ! -f "$tests/tests/trainer/ppo/test_core_algos_on_cpu.py" ]; then
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
        "verl==$VERSION" -d "$tmp"
    tar xzf "$tmp/verl-$VERSION.tar.gz" -C "$tmp"
    rm -rf "$tests"
    mkdir -p "$tests"
    cp -r "$tmp/verl-$VERSION/tests" "$tests/"
    rm -rf "$tmp"
fi

"$PY" - <<'PYEOF'
import importlib.metadata as md

import torch
import verl.trainer.ppo.core_algos  # noqa: F401
import verl.utils.torch_functional  # noqa: F401

print(f"verl {md.version('verl')} importable; torch {torch.__version__} (unchanged)")
PYEOF
