"""Prints pip constraints pinning this python's torch, triton and numpy (one per line).

Each live check's install.sh installs its library under these constraints, so that no
dependency (accelerate, torchtune, verl ask for torch) can replace the machine's torch.
Exits with an error when this python does not see torch or fused_rl: its venv was not made
by venv.sh, and pip would download a torch of its own.
"""

import importlib.metadata as md
import importlib.util
import sys

for needed in ("torch", "fused_rl"):
    if importlib.util.find_spec(needed) is None:
        sys.exit(
            f"{sys.executable} does not see {needed}: delete its venv and make it again with "
            "scripts/compat_live/venv.sh from the python that has torch and fused_rl"
        )
for name in ("torch", "triton", "numpy"):
    try:
        print(f"{name}=={md.version(name).split('+')[0]}")
    except md.PackageNotFoundError:
        pass
