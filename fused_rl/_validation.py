"""Argument checks run up front, in Python, with messages that name the argument.

Nothing here runs inside a kernel. Checks that need the tensor's *values* (a host sync)
run only in eager mode and only while :data:`fused_rl.config.check_values` is True; under
``torch.compile`` or CUDA-graph capture they are skipped and the kernels turn such inputs
into NaN instead of reading out of bounds.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence

import torch

from . import config
from ._backend import warn_at_caller

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_float(x: torch.Tensor, name: str) -> None:
    check_tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")


def check_logits(
    logits: torch.Tensor, name: str = "logits", min_dim: int = 1, empty_ok: bool = False
) -> None:
    """A float ``(..., V)`` tensor with ``V >= 1`` (``empty_ok``: a ragged vocabulary shard,
    which may hold no column)."""
    check_float(logits, name)
    if logits.dim() < min_dim:
        dims = "dim" if min_dim == 1 else "dims"
        raise ValueError(
            f"{name} must have at least {min_dim} {dims} (..., V), got shape {tuple(logits.shape)}"
        )
    if logits.shape[-1] < 1 and not empty_ok:
        raise ValueError(f"{name} has an empty vocabulary dimension (V = 0)")


def check_targets(targets: torch.Tensor, logits: torch.Tensor, name: str = "targets") -> None:
    check_tensor(targets, name)
    if targets.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{name} must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    check_same_device(logits=logits, **{name: targets})


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    if not present:
        return
    (first_name, first), *rest = present.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )


def check_shape(x: torch.Tensor | None, shape: Sequence[int], name: str, expected: str) -> None:
    if x is None:
        return
    check_tensor(x, name)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {expected} = {tuple(shape)}, got {tuple(x.shape)}"
        )


def _check_number_type(value, name: str) -> None:
    """A real scalar: a Python int / float or a NumPy one (``np.float32(0.7)``), not a bool
    (``True`` is an int), not a tensor (reading it would sync), not a string. The launchers
    pass hyper-parameters on as Python floats (``float(x)`` / ``f32_pair``)."""
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


# Finiteness by comparisons (False for NaN), inline: under ``torch.compile`` a number that
# changed between calls is symbolic, which comparisons accept and ``math.isfinite`` does not
_INF = math.inf


def check_number(value, name: str, *, allow_none: bool = False) -> None:
    """A finite Python int / float (a hyper-parameter; a NaN bound would silently drop a clip)."""
    if value is None and allow_none:
        return
    _check_number_type(value, name)
    if not -_INF < value < _INF:
        raise ValueError(f"{name} must be finite, got {value!r}")


def check_nonnegative(value, name: str, *, allow_none: bool = False) -> None:
    """A finite real number ``>= 0`` (``None`` too when ``allow_none``)."""
    if value is None and allow_none:
        return
    _check_number_type(value, name)
    if not (-_INF < value < _INF and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_positive(value, name: str, *, allow_none: bool = False) -> None:
    """A finite real number ``> 0`` (``None`` too when ``allow_none``)."""
    if value is None and allow_none:
        return
    _check_number_type(value, name)
    if not (-_INF < value < _INF and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_unit_interval(value, name: str) -> None:
    """A real number in ``[0, 1]`` (a discount factor)."""
    _check_number_type(value, name)
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_positive_int(value, name: str, *, allow_none: bool = False, minimum: int = 1) -> None:
    """A Python int ``>= minimum`` (default 1), not a bool (``None`` too when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_mask_dtype(mask: torch.Tensor | None, name: str = "mask") -> None:
    """``mask``: None, or a bool / integer / floating tensor (True / nonzero = counts)."""
    if mask is None:
        return
    check_tensor(mask, name)
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or floating tensor, got {mask.dtype}")


class NegativeMaskWeightError(ValueError):
    """A mask holding a negative weight (:func:`check_mask_weights`). A ``ValueError``; its
    own class lets a compat adapter whose original accepts such masks take another path."""


def check_mask_weights(mask: torch.Tensor | None, name: str = "mask") -> None:
    """Eager-mode check that a mask used as per-token weights holds none ``< 0``.

    A float (or integer) mask is a weight: ``sum(m * L) / sum(m)``; a negative one cannot
    be rejected without reading the mask on the host, so this is a value check (one host
    sync, :func:`value_checks_enabled`: eager mode with ``fused_rl.config.check_values``
    on). Unchecked, a negative weight makes the result NaN (``kernels/common.py``
    ``as_weight``, ``reference.reductions.mask_weights``). Bool and unsigned masks cannot be
    negative: nothing to read."""
    if mask is None or not mask.dtype.is_signed or not value_checks_enabled(mask):
        return
    negative = mask < 0
    if bool(negative.any()):
        index = tuple(negative.nonzero()[0].tolist())
        kind = "a float" if mask.is_floating_point() else "an integer"
        raise NegativeMaskWeightError(
            f"{name} has a negative weight ({mask[index].item()} at index {index}); {kind} "
            f"mask is a per-token weight and must be >= 0"
        )


def check_mask(
    mask: torch.Tensor | None,
    name: str,
    shape: Sequence[int],
    expected: str,
    *,
    weights: bool = True,
) -> None:
    """``mask``: None, or a bool / integer / floating tensor of ``shape`` (named ``expected``
    in the message). ``weights``: a float / integer mask is a per-token weight (every loss and
    masked reduction), so a negative one raises in eager mode (:func:`check_mask_weights`);
    False for an indicator mask (nonzero counts: ``gae``, ``kl_penalized_rewards``). Devices
    are checked with the other tensors (:func:`check_same_device`)."""
    if mask is None:
        return
    check_mask_dtype(mask, name)
    check_shape(mask, shape, name, expected)
    if weights:
        check_mask_weights(mask, name)


def renamed_keyword(kwargs: dict, *, old: str, new: str, where: str) -> dict:
    """``kwargs`` with the deprecated keyword ``old`` renamed ``new``: one ``FutureWarning``
    naming ``new``; ``TypeError`` when both are given. Call it only when ``old in kwargs``
    (callers test that first, so the common path costs one dict lookup). The warning points
    at the user's line (the first frame outside fused_rl)."""
    if new in kwargs:
        raise TypeError(
            f"{where}() got both {new}= and its deprecated alias {old}=; pass {new}= only"
        )
    warn_at_caller(
        f"{where}({old}=...) is deprecated; use {new}= (same values and default)", FutureWarning
    )
    kwargs = dict(kwargs)
    kwargs[new] = kwargs.pop(old)
    return kwargs


def deprecated_keyword(old: str, new: str) -> Callable[[Callable], Callable]:
    """Decorator: the public function accepts its former keyword ``old`` as an alias of
    ``new`` (:func:`renamed_keyword`). The signature shown (``inspect.signature``, docs) is
    the function's own, without the alias."""

    def decorate(fn: Callable) -> Callable:
        where = f"fused_rl.{fn.__name__}"

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs = renamed_keyword(kwargs, old=old, new=new, where=where)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def check_choice(value: str, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    """True when data-dependent checks (which sync with the host) may run."""
    return config.check_values and host_sync_allowed(*tensors)


def host_sync_allowed(*tensors: torch.Tensor) -> bool:
    """True in eager mode on real tensors: not tracing, not capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    if any(t.is_meta for t in tensors):  # shape-only tensors: no values to read
        return False
    modes = torch._C._TorchDispatchModeKey
    if any(torch._C._get_dispatch_mode(k) is not None for k in (modes.FAKE, modes.PROXY)):
        return False  # fake tensors (make_fx, a memory model): no values either
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int, name: str) -> None:
    """Eager-mode check that every target is in ``[0, V)`` or equals ``ignore_index``."""
    if not value_checks_enabled(targets):
        return
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        first = targets[bad].reshape(-1)[0].item()
        raise ValueError(
            f"{name} holds {first}, outside [0, V) = [0, {vocab}) and not ignore_index "
            f"({ignore_index})"
        )
