"""Backend dispatch: which implementation runs for a given set of tensors.

Every public op takes ``backend="auto" | "triton" | "reference"``:

* ``"auto"``: Triton for CUDA tensors, and for CPU tensors when the environment sets
  ``TRITON_INTERPRET=1`` (the Triton interpreter, used by the test-suite on machines
  without a GPU); the plain-PyTorch reference otherwise.
* ``"triton"``: the Triton kernels, or a ``RuntimeError`` that says why they cannot run.
  Never a silent fallback.
* ``"reference"``: the plain-PyTorch implementation (the CPU fallback and the tests' twin).
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "reference")


# looked up once at import: torch.compile warns on every lru_cache-wrapped call it traces
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_problem(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device``, or None when it can."""
    if not triton_installed():
        return "the `triton` package is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreter_enabled():
            return None
        return (
            "Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before importing fused_rl (the Triton interpreter) or use backend='reference'"
        )
    return f"Triton kernels do not run on device type {device.type!r}"


def available_backends(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """The concrete backends that can run on ``device``, fastest first.

    >>> "reference" in available_backends("cpu")
    True
    """
    device = torch.device(device)
    names = ["triton"] if _triton_problem(device) is None else []
    return (*names, "reference")


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Return ``"triton"`` or ``"reference"`` for ``backend`` and the given tensors.

    All tensors must share one device (a ``ValueError`` names the mismatch otherwise).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    present = [t for t in tensors if t is not None]
    if not present:
        raise ValueError("resolve_backend needs at least one tensor")
    device = present[0].device
    for t in present[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if backend == "reference":
        return "reference"
    problem = _triton_problem(device)
    if backend == "triton":
        if problem is not None:
            raise RuntimeError(f"backend='triton' cannot run here: {problem}")
        return "triton"
    return "reference" if problem is not None else "triton"
