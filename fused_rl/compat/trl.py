"""Drop-in replacements for TRL's vocabulary-sized helpers, fused.

Change ``from trl.trainer.utils import selective_log_softmax, entropy_from_logits`` to
``from fused_rl.compat.trl import selective_log_softmax, entropy_from_logits``. TRL is not
imported (nor needed).

Mirrors ``trl/trainer/utils.py`` of TRL 0.2x (``selective_log_softmax`` with its ``(..., K)``
index, ``entropy_from_logits(logits, chunk_size=128)``).

Differences from TRL, all deliberate:

* Both functions stream the logits once (forward) and once (backward) through
  :func:`fused_rl.token_logprobs` / :func:`fused_rl.token_entropy`: no ``(..., V)`` temporary,
  whatever the dtype. ``chunk_size`` is accepted and has no effect.
* The math runs in fp32 (fp64 for fp64 logits) and the result is cast to the logits' dtype,
  so bf16/fp16 outputs are the correctly rounded fp32 values rather than TRL's bf16 chain.
* An index outside ``[0, V)`` (a ``-100`` label included) raises ``ValueError`` in eager mode
  (TRL's ``gather`` raises ``RuntimeError``); see ``fused_rl.config.check_values``.
* ``-inf`` logits give a finite entropy (TRL's ``0 * -inf`` gives NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as V
from .._backend import resolve_backend
from .._vocab_ops import token_stats_nocheck
from ..logprobs import token_entropy

# Passed as ``ignore_index``: these helpers have no ignore index in the originals, and an
# out-of-range label must not become a 0 log-prob. A label equal to this value is itself out
# of range: the eager range check rejects it, and without that check (``check_values=False``,
# ``torch.compile``) ``_checked_logprobs`` turns its row into NaN like any other bad label.
_NO_IGNORE = -(2**31)


def _check_index_range(index: Tensor, vocab: int, name: str, original: str) -> None:
    """Eager-mode check that ``index`` lies in ``[0, vocab)`` (one host sync)."""
    if not V.value_checks_enabled(index):
        return
    bad = (index < 0) | (index >= vocab)
    if bool(bad.any()):
        first = index[bad].reshape(-1)[0].item()
        raise ValueError(
            f"{name} holds {first}, outside [0, V) = [0, {vocab}); {original} has no ignore "
            "index: replace ignored labels (e.g. -100) by a valid id and mask them out"
        )


def _checked_logprobs(
    logits: Tensor, index: Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`fused_rl.token_logprobs` with no ignore index, for an ``index`` that has passed
    :func:`_check_index_range` (so the eager range check, a host sync, runs once, not twice)."""
    V.check_positive(temperature, "temperature")
    which = resolve_backend("auto", logits, index)
    logp, entropy = token_stats_nocheck(
        logits, index, temperature, _NO_IGNORE, return_entropy, which
    )
    if not V.value_checks_enabled(index):  # the sentinel label went through unchecked
        sentinel = index == _NO_IGNORE
        logp = torch.where(sentinel, float("nan"), logp)
        if return_entropy:
            entropy = torch.where(sentinel, float("nan"), entropy)
    return (logp, entropy) if return_entropy else logp


def _gather_logprobs(
    logits: Tensor, index: Tensor, *, temperature: float, name: str, original: str
) -> Tensor:
    """``log_softmax(logits / T).gather(-1, index[..., None])[..., 0]`` in ``logits.dtype``."""
    V.check_logits(logits)
    V.check_targets(index, logits, name)
    _check_index_range(index, logits.shape[-1], name, original)
    logp = _checked_logprobs(logits, index, temperature=temperature)
    return logp.to(logits.dtype)


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """Mirrors ``trl.trainer.utils.selective_log_softmax(logits, index)``.

    ``log_softmax(logits, -1)`` gathered at ``index``, without the ``(..., V)`` log-softmax.

    Args:
        logits: ``(..., V)`` float logits, any strides.
        index: ``(...)`` = ``logits.shape[:-1]`` (one id per position), or ``(..., K)`` with
            ``index.shape[:-1] == logits.shape[:-1]`` (``K`` ids per position, e.g. top-K;
            one fused pass over the logits per ``k``). int64 or int32.

    Returns:
        Log-probabilities of ``index``'s shape, in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat.trl import selective_log_softmax
        >>> logits = torch.randn(2, 3, 7)
        >>> selective_log_softmax(logits, torch.randint(0, 7, (2, 3))).shape
        torch.Size([2, 3])
        >>> selective_log_softmax(logits, torch.randint(0, 7, (2, 3, 4))).shape
        torch.Size([2, 3, 4])
    """
    V.check_logits(logits, "logits")
    V.check_tensor(index, "index")
    original = "TRL's selective_log_softmax"
    if index.dim() == logits.dim() - 1:
        return _gather_logprobs(logits, index, temperature=1.0, name="index", original=original)
    if index.dim() != logits.dim() or tuple(index.shape[:-1]) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"index must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])} or "
            f"(*logits.shape[:-1], K), got {tuple(index.shape)}"
        )
    columns = [
        _gather_logprobs(logits, index[..., k], temperature=1.0, name="index", original=original)
        for k in range(index.shape[-1])
    ]
    if not columns:
        return logits.new_empty(index.shape)
    return torch.stack(columns, dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Mirrors ``trl.trainer.utils.entropy_from_logits(logits, chunk_size=128)``.

    Shannon entropy (nats) of ``softmax(logits)`` per position, one fused pass.

    Args:
        logits: ``(..., V)`` float logits, any strides.
        chunk_size: accepted for compatibility; the fused kernel never materialises a chunk.

    Returns:
        ``logits.shape[:-1]`` tensor in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat.trl import entropy_from_logits
        >>> entropy_from_logits(torch.zeros(2, 4)).tolist()  # log(4)
        [1.3862943649291992, 1.3862943649291992]
    """
    V.check_logits(logits, "logits")
    return token_entropy(logits).to(logits.dtype)
