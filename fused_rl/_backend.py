"""Backend dispatch: which implementation runs for a given set of tensors.

Every public op takes ``backend="auto" | "triton" | "reference"``:

* ``"auto"``: Triton for CUDA tensors, and for CPU tensors when the environment set
  ``TRITON_INTERPRET=1`` before Triton was imported (the Triton interpreter, used by the
  test-suite on machines without a GPU); the plain-PyTorch reference otherwise, with a
  one-time warning when ``TRITON_INTERPRET=1`` came too late to take effect.
* ``"triton"``: the Triton kernels, or a ``RuntimeError`` that says why they cannot run.
  Never a silent fallback.
* ``"reference"``: the plain-PyTorch implementation (the CPU fallback and the tests' twin).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings

import torch

from ._compile_marks import assume_constant_result

BACKENDS = ("auto", "triton", "reference")


# looked up once at import: torch.compile warns on every lru_cache-wrapped call it traces
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter_requested() -> bool:
    """True when the environment asks for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@assume_constant_result
def _standard_library_interpreted() -> bool | None:
    """Whether Triton's standard library was imported interpreted; None before its import.

    A constant to ``torch.compile``: Dynamo cannot trace ``type()`` of a compiled Triton
    function (torch 2.11 fails ``fullgraph=True`` on "TritonKernelVariable() has no type"),
    and the answer cannot change once Triton is imported."""
    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    return type(std.sigmoid).__name__ == "InterpretedFunction"


def _interpreter_mismatch() -> str | None:
    """Why the interpreter setting and Triton's own state disagree, or None.

    Triton decides at ``import triton`` whether its standard library (``tl.sum``, ``tl.max``,
    ...) is compiled or interpreted. A kernel interpreted against a compiled standard library
    (``TRITON_INTERPRET=1`` set after the import) fails deep inside Triton, so the variable
    must agree with the state Triton was imported in.
    """
    interpreted = _standard_library_interpreted()
    if interpreted is None:  # not imported yet: Triton will follow the environment
        return None
    if interpreter_requested() and not interpreted:
        return (
            "TRITON_INTERPRET=1 was set after `import triton`, so Triton's standard library is "
            "compiled and its interpreter cannot run; set TRITON_INTERPRET=1 before anything "
            "imports triton (in the shell, or first thing in the script)"
        )
    if interpreted and not interpreter_requested():
        return (
            "triton was imported with TRITON_INTERPRET=1 and the variable was unset later; "
            "Triton cannot compile kernels in this process any more (restart it)"
        )
    return None


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the Triton interpreter: the
    environment asks for it and Triton was imported in that mode."""
    return interpreter_requested() and _interpreter_mismatch() is None


def _triton_problem(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device``, or None when it can."""
    if not triton_installed():
        return "the `triton` package is not installed"
    if device.type not in ("cuda", "cpu"):
        return f"Triton kernels do not run on device type {device.type!r}"
    mismatch = _interpreter_mismatch()
    if mismatch is not None:
        return mismatch
    if device.type == "cuda" or interpreter_enabled():
        return None
    return (
        "Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
        "before importing fused_rl (the Triton interpreter) or use backend='reference'"
    )


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
        which = "reference"
    else:
        problem = _triton_problem(device)
        if backend == "triton" and problem is not None:
            raise RuntimeError(f"backend='triton' cannot run here: {problem}")
        which = "triton" if problem is None else "reference"
        if which == "reference" and (device.type == "cuda" or _interpreter_mismatch()):
            _warn_once(f"backend='auto' runs the reference: {problem}")  # not what was asked
    # torch.compile cannot trace logging: the eager calls before and around it log
    if (backend, which, device.type) not in _LOGGED and not torch.compiler.is_compiling():
        _log_choice(backend, which, device)
    return which


logger = logging.getLogger("fused_rl")
_LOGGED: set[tuple[str, str, str]] = set()


def _log_choice(backend: str, which: str, device: torch.device) -> None:
    """INFO, once per process for each (asked, ran, device type): which path a call takes
    (``logging.getLogger("fused_rl").setLevel("INFO")`` to see it)."""
    _LOGGED.add((backend, which, device.type))
    if which == "triton":
        how = "Triton, interpreted (TRITON_INTERPRET=1)" if device.type == "cpu" else "Triton"
    else:
        problem = _triton_problem(device) if backend == "auto" else None
        how = "the PyTorch reference" + (f": {problem}" if problem else "")
    logger.info("backend=%r on %s runs %s", backend, device.type, how)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if torch.compiler.is_compiling():
        _warn_once_traced(message)
    elif message not in _WARNED:
        _WARNED.add(message)
        warn_at_caller(message, RuntimeWarning)


@assume_constant_result
def _warn_once_traced(message: str) -> bool:
    """:func:`_warn_once` while ``torch.compile`` traces: Dynamo runs a function marked
    ``assume_constant_result`` in Python, once per compile (its result a constant of the
    graph), so the warning is shown there too, attributed to the tracer's frame."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return True


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside fused_rl: the user's line,
    however many fused_rl layers (adapters, aliases, autograd) sit in between. Not while
    ``torch.compile`` traces (Dynamo cannot trace the frame walk or ``warnings.warn``): an
    eager call shows it."""
    if torch.compiler.is_compiling():
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
