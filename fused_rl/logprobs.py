"""Per-token log-probs and entropy over the vocabulary: ``token_logprobs``, ``token_entropy``.

The Triton path is two ``torch.library`` custom ops, one vocab pass each:

* ``fused_rl::token_stats_fwd`` -- layer 1: ``logp``, ``entropy`` and the softmax
  normaliser (row max ``m`` and ``log s``, ``lse = m + log s``) per token;
* ``fused_rl::token_stats_bwd`` -- layer 3: ``dL/dlogits`` from per-token ``g`` and ``h``.

They carry fake (meta) implementations and an autograd registration, so
``torch.compile(fullgraph=True)`` traces straight through them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import f32_pair, stats_dtype, triton_acc, vocab_block, vocab_warps
from ._shapes import as_rows3d
from .reference import logprobs as ref

# ----------------------------------------------------------------------------- launchers


def token_stats_fwd(
    logits3d: Tensor,
    targets: Tensor | None,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the layer-1 kernel on ``(outer, inner, V)`` logits (any strides).

    Returns ``(logp, entropy, row_max, log_sum)``, each ``(outer, inner)``; ``logp`` /
    ``entropy`` are empty when not asked for (no targets / ``with_entropy=False``).
    """
    from .kernels.vocab_stream_fwd import _token_stats_fwd_kernel

    outer, inner, vocab = logits3d.shape
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on: torch.empty(
        (outer, inner) if on else (0,), dtype=dtype, device=logits3d.device
    )
    logp, entropy = new(targets is not None), new(with_entropy)
    row_max, log_sum = new(True), new(True)
    n_rows = outer * inner
    if n_rows == 0:
        return logp, entropy, row_max, log_sum
    block = vocab_block(vocab)
    _token_stats_fwd_kernel[(n_rows,)](
        logits3d,
        targets if targets is not None else row_max,
        logp,
        entropy,
        row_max,
        log_sum,
        inner,
        vocab,
        logits3d.stride(0),
        logits3d.stride(1),
        logits3d.stride(2),
        *f32_pair(1.0 / temperature),
        ignore_index,
        HAS_TARGETS=targets is not None,
        WITH_ENTROPY=with_entropy,
        BLOCK_V=block,
        ACC=triton_acc(logits3d.dtype),
        num_warps=vocab_warps(block),
    )
    return logp, entropy, row_max, log_sum


def token_stats_bwd(
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    temperature: float,
    ignore_index: int,
) -> Tensor:
    """Launch the layer-3 kernel: the gradient w.r.t. ``logits3d`` (contiguous, its dtype).

    ``row_max``, ``log_sum``: the forward's softmax normaliser; ``entropy``: its ``H`` (needed
    with ``h``); ``g``, ``h``: per-row ``dL/dlogp`` and ``dL/dH`` (None = zero); ``scale``: optional
    0-dim tensor multiplying both (the upstream gradient of a fused scalar loss).
    """
    from .kernels.vocab_stream_bwd import _token_stats_bwd_kernel

    outer, inner, vocab = logits3d.shape
    grad = torch.empty((outer, inner, vocab), dtype=logits3d.dtype, device=logits3d.device)
    n_rows = outer * inner
    if n_rows == 0:
        return grad
    block = vocab_block(vocab)
    dummy = row_max
    _token_stats_bwd_kernel[(n_rows,)](
        logits3d,
        targets if targets is not None else dummy,
        grad,
        row_max,
        log_sum,
        entropy if h is not None else dummy,
        g.contiguous() if g is not None else dummy,
        h.contiguous() if h is not None else dummy,
        scale if scale is not None else dummy,
        inner,
        vocab,
        logits3d.stride(0),
        logits3d.stride(1),
        logits3d.stride(2),
        *f32_pair(1.0 / temperature),
        ignore_index,
        HAS_TARGETS=targets is not None,
        HAS_G=g is not None and targets is not None,
        HAS_H=h is not None,
        HAS_SCALE=scale is not None,
        BLOCK_V=block,
        ACC=triton_acc(logits3d.dtype),
        num_warps=vocab_warps(block),
    )
    return grad


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("fused_rl::token_stats_fwd", mutates_args=())
def _token_stats_fwd_op(
    logits3d: Tensor,
    targets: Tensor | None,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return token_stats_fwd(logits3d, targets, temperature, ignore_index, with_entropy)


@_token_stats_fwd_op.register_fake
def _(logits3d, targets, temperature, ignore_index, with_entropy):
    outer, inner, _ = logits3d.shape
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    return new(targets is not None), new(with_entropy), new(True), new(True)


@torch.library.custom_op("fused_rl::token_stats_bwd", mutates_args=())
def _token_stats_bwd_op(
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    temperature: float,
    ignore_index: int,
) -> Tensor:
    return token_stats_bwd(
        logits3d, targets, row_max, log_sum, entropy, g, h, scale, temperature, ignore_index
    )


@_token_stats_bwd_op.register_fake
def _(logits3d, targets, row_max, log_sum, entropy, g, h, scale, temperature, ignore_index):
    return torch.empty_like(logits3d, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits3d, targets, temperature, ignore_index, with_entropy = inputs
    _, entropy, row_max, log_sum = output
    ctx.save_for_backward(logits3d, targets, row_max, log_sum, entropy)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.with_entropy = with_entropy


def _backward(ctx, grad_logp, grad_entropy, _grad_max, _grad_log_sum):
    logits3d, targets, row_max, log_sum, entropy = ctx.saved_tensors
    if targets is None:
        grad_logp = None
    if not ctx.with_entropy:
        grad_entropy = None
    grad = _token_stats_bwd_op(
        logits3d,
        targets,
        row_max,
        log_sum,
        entropy if grad_entropy is not None else None,
        grad_logp,
        grad_entropy,
        None,
        ctx.temperature,
        ctx.ignore_index,
    )
    return grad, None, None, None, None


_token_stats_fwd_op.register_autograd(_backward, setup_context=_setup_context)


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
        logits: ``(..., V)`` fp32 / bf16 / fp16 (fp64 for gradcheck), any strides; a slice such
            as ``logits[:, :-1]`` is read in place, never copied.
        targets: ``(...)`` = ``logits.shape[:-1]``, int64 or int32.
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
    V.check_targets(targets, logits)
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, ignore_index, return_entropy, which
    )
    return (logp, entropy) if return_entropy else logp


def token_stats_nocheck(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    which: str,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy or None)`` on already validated arguments and a resolved backend
    (the fused losses call this so the eager target-range check, a host sync, runs once)."""
    if which == "reference":
        logp, entropy = ref.token_stats(
            logits, targets, temperature=temperature, ignore_index=ignore_index
        )
        return logp, entropy if with_entropy else None
    logits3d = as_rows3d(logits)
    t3d = targets.reshape(logits3d.shape[:-1]).contiguous()
    logp, entropy, _, _ = _token_stats_fwd_op(
        logits3d, t3d, float(temperature), int(ignore_index), bool(with_entropy)
    )
    logp = logp.reshape(targets.shape)
    return logp, entropy.reshape(targets.shape) if with_entropy else None


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
    _, entropy, _, _ = _token_stats_fwd_op(logits3d, None, float(temperature), -100, True)
    return entropy.reshape(logits.shape[:-1])
