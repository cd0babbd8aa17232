"""Per-token log-probs and entropy over the vocabulary: ``token_logprobs``, ``token_entropy``.

The Triton path is the two vocab-stream ops of ``fused_rl._vocab_ops`` (one pass over the
logits forward, one backward); they are ``torch.library`` custom ops with fake and autograd
registrations, so ``torch.compile(fullgraph=True)`` traces straight through them, and
eager mode calls them directly.
"""

from __future__ import annotations

from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._shapes import as_rows3d
from ._vocab_ops import check_targets_window, token_stats_fwd_op, token_stats_nocheck
from .reference import logprobs as ref

# ----------------------------------------------------------------------------- public API


def _check_common(logits: Tensor, temperature: float) -> None:
    V.check_logits(logits)
    V.check_positive(temperature, "temperature")


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each target token, ``log_softmax(logits / T)[target]``, fused.

    Args:
        logits: ``(..., V)`` fp32 / bf16 / fp16 (fp64 for gradcheck), any strides. Pass the
            model's whole ``(B, S, V)`` buffer with ``(B, T)`` targets, ``S > T``: positions
            ``S - T - 1 ... S - 2`` predict the targets (the causal-LM shift that TRL, verl
            and torchtune slice out) and the backward writes the buffer's gradient itself,
            zero elsewhere. A slice such as ``logits[:, :-1]`` also works (read in place,
            never copied), but autograd's slice backward then costs a second full-size
            gradient buffer and a copy.
        targets: ``(...)`` = ``logits.shape[:-1]``, or ``(..., T)`` for ``(..., S, V)``
            logits with ``S > T``; int64 or int32, any strides.
        temperature: logits are divided by it (``> 0``), as torchtune / verl do.
        ignore_index: targets equal to it give 0 for every output and exactly 0 gradient.
        return_entropy: also return ``H = -sum p log p`` of ``softmax(logits / T)``,
            differentiable (an entropy bonus), at no extra pass over the logits.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"`` (see ``fused_rl._backend``).

    Returns:
        ``logp`` fp32 of shape ``targets.shape`` (fp64 for fp64 logits), or ``(logp, entropy)``.
        Gradients w.r.t. ``logits`` have the logits' dtype.

    Out-of-range targets raise ``ValueError`` in eager mode (one host sync, see
    ``fused_rl.config.check_values``); under ``torch.compile`` they yield NaN.

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> targets = torch.randint(0, 11, (2, 5))
        >>> logp, ent = fused_rl.token_logprobs(logits, targets, return_entropy=True)
        >>> (logp.sum() + 0.01 * ent.sum()).backward()
        >>> logp.shape, logits.grad.shape
        (torch.Size([2, 5]), torch.Size([2, 5, 11]))
    """
    _check_common(logits, temperature)
    check_targets_window(targets, logits)
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, ignore_index, return_entropy, which
    )
    return (logp, entropy) if return_entropy else logp


def token_entropy(logits: Tensor, *, temperature: float = 1.0, backend: str = "auto") -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / T)`` per row, fp32, differentiable.

    Args:
        logits: ``(..., V)`` float, any strides.

    Returns:
        ``logits.shape[:-1]`` fp32 tensor (fp64 for fp64 logits).

    Example:
        >>> import torch, fused_rl
        >>> fused_rl.token_entropy(torch.zeros(3, 4)).tolist()  # log(4) each
        [1.3862943649291992, 1.3862943649291992, 1.3862943649291992]
    """
    _check_common(logits, temperature)
    which = resolve_backend(backend, logits)
    if which == "reference":
        return ref.token_stats(logits, None, temperature=temperature)[1]
    logits3d = as_rows3d(logits)
    _, entropy, _, _ = token_stats_fwd_op(logits3d, None, float(temperature), -100, True)
    return entropy.reshape(logits.shape[:-1])
