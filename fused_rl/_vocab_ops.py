"""The vocab-stream ops shared by every public op that reads logits (private).

* ``token_stats_fwd`` -- layer 1: per-token ``logp``, ``entropy`` and the softmax normaliser
  (row max ``m`` and ``log s``, ``lse = m + log s``), one read of the logits;
* ``token_stats_bwd`` -- layer 3: ``dL/dlogits`` from per-token ``g = dL/dlogp`` and
  ``h = dL/dH``, one read of the logits and one write of the gradient.

Each is a :class:`fused_rl._ops.FusedOp` (a ``torch.library`` custom op for
``torch.compile``, a direct call in eager mode).

Positions: the logits may carry more positions than there are targets, ``(B, S, V)`` for
``(B, T)`` targets with ``S > T``: position ``S - T - 1 + t`` predicts target ``t`` (the
causal-LM shift: the last position predicts past the sequence, earlier ones belong to the
prompt). The backward then writes the gradient of the whole buffer, zero outside the
window, so no slice backward (a second full-size gradient plus a copy) ever runs.

Scaling: every op takes ``temperature`` and ``softcap`` (None: no cap): the softmax is over
``z = x / T``, or ``z = c tanh(x / c) / T`` with the soft cap ``c`` (Gemma's logit
soft-capping, applied before the temperature).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._launch import NO_CAP, f32_pair, stats_dtype, triton_acc, vocab_launch
from ._ops import FusedOp
from ._shapes import as_rows3d
from .reference import logprobs as ref


def position_shift(positions: int, n_targets: int) -> int:
    """Offset of the logits position that predicts target 0: ``S - T - 1`` when ``S > T``."""
    return positions - n_targets - 1 if positions > n_targets else 0


def check_targets_window(targets: Tensor, logits: Tensor, name: str = "targets") -> None:
    """``targets`` of shape ``logits.shape[:-1]``, or ``(..., T)`` for ``(..., S, V)`` logits
    with ``S > T`` (the model's whole buffer; see the module docstring)."""
    V.check_tensor(targets, name)
    if targets.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {targets.dtype}")
    shape, lshape = tuple(targets.shape), tuple(logits.shape)
    windowed = (
        len(shape) >= 1
        and len(lshape) == len(shape) + 1
        and lshape[:-2] == shape[:-1]
        and lshape[-2] > shape[-1]
    )
    if shape != lshape[:-1] and not windowed:
        raise ValueError(
            f"{name} must have shape logits.shape[:-1] = {lshape[:-1]}, or (..., T) with "
            f"T < S for logits (..., S, V) carrying the model's whole sequence; got {shape}"
        )
    V.check_same_device(logits=logits, **{name: targets})


def window(logits: Tensor, n_targets: int) -> Tensor:
    """The ``(..., T, V)`` positions that predict ``T`` targets (a view, for the reference)."""
    shift = position_shift(logits.shape[-2], n_targets)
    return logits.narrow(-2, shift, n_targets)


# ----------------------------------------------------------------------------- layer 1


def token_stats_fwd(
    logits3d: Tensor,
    targets: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the layer-1 kernel on ``(outer, S, V)`` logits (any strides) for ``(outer, T)``
    targets (any strides; None: every position, ``T = S``).

    Returns ``(logp, entropy, row_max, log_sum)``, each ``(outer, T)``; ``logp`` /
    ``entropy`` are empty when not asked for (no targets / ``with_entropy=False``).
    """
    from .kernels.vocab.layer1 import _token_stats_fwd_kernel

    outer, positions, vocab = logits3d.shape
    inner = positions if targets is None else targets.shape[1]
    dtype = stats_dtype(logits3d.dtype)
    dev = logits3d.device
    new = lambda on: torch.empty((outer, inner) if on else (0,), dtype=dtype, device=dev)
    logp, entropy = new(targets is not None), new(with_entropy)
    row_max, log_sum = new(True), new(True)
    if outer * inner == 0:
        return logp, entropy, row_max, log_sum
    tgt = targets if targets is not None else row_max
    _token_stats_fwd_kernel[(outer * inner,)](
        logits3d, tgt, logp, entropy, row_max, log_sum,
        inner, position_shift(positions, inner), vocab, *logits3d.stride(), *tgt.stride(),
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)), ignore_index,
        HAS_TARGETS=targets is not None, WITH_ENTROPY=with_entropy,
        HAS_SOFTCAP=softcap is not None, ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=False),
    )  # fmt: skip
    return logp, entropy, row_max, log_sum


def _fwd_fake(logits3d, targets, temperature, softcap, ignore_index, with_entropy):
    outer, positions, _ = logits3d.shape
    inner = positions if targets is None else targets.shape[1]
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    return new(targets is not None), new(with_entropy), new(True), new(True)


# ----------------------------------------------------------------------------- layer 3


def token_stats_bwd(
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    seq_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
) -> Tensor:
    """Launch the layer-3 kernel: the gradient w.r.t. the whole ``(outer, S, V)`` buffer
    (contiguous, its dtype), zero at positions that predict no target.

    ``row_max``, ``log_sum``: the forward's softmax normaliser ``(outer, T)``; ``entropy``: its
    ``H`` (needed with ``h``); ``g``, ``h``: per-token ``dL/dlogp`` and ``dL/dH``, any strides
    (None = zero); ``scale``: optional 0-dim tensor multiplying both (the upstream gradient of
    a fused scalar loss); ``seq_scale``: optional ``(outer,)`` or ``(1,)`` (one for all)
    multiplying both (the loss aggregation's normaliser).
    """
    grad = torch.empty(logits3d.shape, dtype=logits3d.dtype, device=logits3d.device)
    return token_stats_bwd_into(
        grad, logits3d, targets, row_max, log_sum, entropy, g, h, scale, seq_scale,
        temperature, softcap, ignore_index,
    )  # fmt: skip


def token_stats_bwd_into(
    grad: Tensor,
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    seq_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
) -> Tensor:
    """:func:`token_stats_bwd` writing into ``grad`` (contiguous, ``logits3d``'s shape and
    dtype), which may BE ``logits3d`` when that is contiguous: each program reads a block
    of its own row and then overwrites exactly that block, so the logits are consumed in
    place (the fused-linear ops turn a chunk's logits into its gradient this way)."""
    from .kernels.vocab.layer3 import _token_stats_bwd_kernel

    outer, positions, vocab = logits3d.shape
    inner = row_max.shape[1]
    if grad.numel() == 0:
        return grad
    dummy = row_max
    strides = lambda t: t.stride() if t is not None else (0, 0)
    seq_stride = 0 if seq_scale is None or seq_scale.numel() == 1 else seq_scale.stride(0)
    _token_stats_bwd_kernel[(outer * positions,)](
        logits3d,
        targets if targets is not None else dummy,
        grad,
        row_max,
        log_sum,
        entropy if h is not None else dummy,
        g if g is not None else dummy,
        h if h is not None else dummy,
        scale if scale is not None else dummy,
        seq_scale if seq_scale is not None else dummy,
        inner,
        positions,
        position_shift(positions, inner),
        vocab,
        *logits3d.stride(),
        *strides(targets),
        *strides(g),
        *strides(h),
        seq_stride,
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)),
        ignore_index,
        HAS_TARGETS=targets is not None,
        HAS_G=g is not None and targets is not None,
        HAS_H=h is not None,
        HAS_SCALE=scale is not None,
        HAS_SEQ_SCALE=seq_scale is not None,
        HAS_SOFTCAP=softcap is not None,
        ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=True),
    )
    return grad


def _bwd_fake(logits3d, *_args):
    return logits3d.new_empty(logits3d.shape)


token_stats_bwd_op = FusedOp("token_stats_bwd", token_stats_bwd)
token_stats_bwd_op.register_fake(_bwd_fake)


# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    logits3d, targets, temperature, softcap, ignore_index, with_entropy = inputs
    _, entropy, row_max, log_sum = output
    ctx.save_for_backward(logits3d, targets, row_max, log_sum, entropy)
    ctx.temperature, ctx.softcap = temperature, softcap
    ctx.ignore_index, ctx.with_entropy = ignore_index, with_entropy
    ctx.mark_non_differentiable(row_max, log_sum)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_max, _grad_log_sum):
    logits3d, targets, row_max, log_sum, entropy = ctx.saved_tensors
    if targets is None:
        grad_logp = None
    if not ctx.with_entropy:
        grad_entropy = None
    grad = token_stats_bwd_op(
        logits3d, targets, row_max, log_sum,
        entropy if grad_entropy is not None else None, grad_logp, grad_entropy, None, None,
        ctx.temperature, ctx.softcap, ctx.ignore_index,
    )  # fmt: skip
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


token_stats_fwd_op = FusedOp("token_stats_fwd", token_stats_fwd)
token_stats_fwd_op.register_fake(_fwd_fake)
token_stats_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- callers


def token_stats_nocheck(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    which: str,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy or None)`` on already validated arguments and a resolved backend
    (the fused losses call this so the eager target-range check, a host sync, runs once)."""
    if which == "reference":
        if targets.shape != logits.shape[:-1]:
            logits = window(logits, targets.shape[-1])
        logp, entropy = ref.token_stats(
            logits, targets, temperature=temperature, ignore_index=ignore_index, softcap=softcap
        )
        return logp, entropy if with_entropy else None
    logits3d = as_rows3d(logits)
    n_targets = targets.shape[-1] if targets.dim() > 0 else 1
    t2d = targets.reshape(logits3d.shape[0], n_targets if logits.dim() > 1 else 1)
    logp, entropy, _, _ = token_stats_fwd_op(
        logits3d, t2d, float(temperature), None if softcap is None else float(softcap),
        int(ignore_index), bool(with_entropy),
    )  # fmt: skip
    logp = logp.reshape(targets.shape)
    return logp, entropy.reshape(targets.shape) if with_entropy else None
