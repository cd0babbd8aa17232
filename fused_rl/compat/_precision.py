"""How the adapters treat fp16 / bf16 inputs: ``"accurate"`` (default) or ``"original"``.

* ``"accurate"``: the math runs in fp32 and each output is rounded once to the dtype the
  original returns. Its error against float64 is at most the original's, usually smaller.
* ``"original"``: the adapter reproduces the original library's own half-precision
  computation (its roundings included), so its outputs equal the original's bit for bit.
  For tests or checkpoints that compare with ``torch.equal``; it costs the original's speed
  and memory on the paths where the original rounds to half precision in between.

Example:
    >>> import fused_rl.compat as compat
    >>> compat.half_precision_mode()
    'accurate'
    >>> with compat.half_precision("original"):
    ...     compat.half_precision_mode()
    'original'
"""

from __future__ import annotations

import contextlib
import threading

MODES = ("accurate", "original")
_state = threading.local()


def half_precision_mode() -> str:
    """The mode in force in this thread."""
    return getattr(_state, "mode", "accurate")


def set_half_precision(mode: str) -> None:
    """Set the mode for this thread (``"accurate"`` or ``"original"``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _state.mode = mode


@contextlib.contextmanager
def half_precision(mode: str):
    """Context manager: run the enclosed adapter calls in ``mode``, then restore."""
    previous = half_precision_mode()
    set_half_precision(mode)
    try:
        yield
    finally:
        set_half_precision(previous)


def original_half_precision(*tensors) -> bool:
    """True when an adapter must reproduce the original's half-precision arithmetic: the
    mode is ``"original"`` and a floating input is fp16 / bf16."""
    import torch

    if half_precision_mode() != "original":
        return False
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) for t in tensors
    )
