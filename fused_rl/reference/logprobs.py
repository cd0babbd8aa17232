"""Reference per-token log-prob / entropy over the vocabulary (plain PyTorch).

Chunked over rows (eager; one chunk while ``torch.compile`` traces, where Inductor fuses
the cast) so that neither the forward nor the backward allocates an fp32 copy of all
logits: autograd saves only the logits themselves and three floats per row, and the
backward recomputes ``softmax`` chunk by chunk with the same closed form as the Triton
kernel (CONTRIBUTING.md, "The three layers"):

    dL/dx_j = (1/T) * [ g (1[j = y] - p_j) - h p_j (z_j - E_p[z]) ]

With the soft cap ``c`` (``softcap``; Gemma's logit soft-capping) ``z = c tanh(x / c) / T``
and the bracket is times ``dz/dx * T = 1 - tanh^2(x / c)``.
"""

from __future__ import annotations

import torch

from .._shapes import as_rows3d
from .reductions import acc_dtype

# Rows per chunk: keeps the transient fp32 copy at (CHUNK_ELEMENTS) floats.
CHUNK_ELEMENTS = 1 << 22


def scaled(x: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor:
    """``z = x / T``, or ``c tanh(x / c) / T`` with the soft cap ``c`` (``x`` in the
    accumulation dtype)."""
    if softcap is None:
        return x / temperature
    return torch.tanh(x / softcap) * (softcap / temperature)


def _chunks(outer: int, inner: int, vocab: int):
    """Index pairs ``(outer_slice, inner_slice)`` covering a ``(outer, inner, V)`` tensor.
    One pair while ``torch.compile`` traces: a loop over the rows would make the graph's
    shapes constants (a recompile for every sequence length), and the compiled graph
    fuses the fp32 copy the chunks bound."""
    if torch.compiler.is_compiling():
        yield slice(None), slice(None)
        return
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if inner <= rows:
        step = max(1, rows // max(inner, 1))
        for o in range(0, outer, step):
            yield slice(o, o + step), slice(None)
    else:
        for o in range(outer):
            for i in range(0, inner, rows):
                yield slice(o, o + 1), slice(i, i + rows)


def row_stats(
    logits3d: torch.Tensor,
    targets: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, row_max, log_sum)`` as fp32 ``(outer, inner)`` tensors (fp64 for
    fp64 logits), no autograd. ``lse = row_max + log_sum``, kept apart as in the kernel.

    Ignored rows give 0 for all four. A target outside ``[0, V)`` gives NaN.
    """
    outer, inner, vocab = logits3d.shape
    dtype = acc_dtype(logits3d)
    logp = torch.zeros(outer, inner, dtype=dtype, device=logits3d.device)
    entropy, row_max, log_sum = (torch.zeros_like(logp) for _ in range(3))
    for idx in _chunks(outer, inner, vocab):
        z = scaled(logits3d[idx].to(dtype), temperature, softcap)
        m = z.amax(-1, keepdim=True)
        d = z - m  # exact (Sterbenz) for the z near the max, which carry the mass
        ls = torch.logsumexp(d, dim=-1, keepdim=True)
        log_p = d - ls  # relative to the row max: ``lse - sum p z`` would cancel
        p = log_p.exp()
        row_max[idx], log_sum[idx] = m[..., 0], ls[..., 0]
        # p == 0 contributes 0 even where log p == -inf; a NaN p (NaN / +inf logit, all -inf
        # row) stays NaN, as in the kernel (``p > 0`` would drop it)
        entropy[idx] = -torch.where(p == 0, torch.zeros_like(z), p * log_p).sum(-1)
        if targets is not None:
            t = targets[idx].long()
            in_range = (t >= 0) & (t < vocab)
            lp_y = log_p.gather(-1, t.clamp(0, vocab - 1)[..., None])[..., 0]
            logp[idx] = torch.where(in_range, lp_y, torch.full_like(lp_y, float("nan")))
    if targets is not None:
        ignored = targets == ignore_index
        zero = torch.zeros_like(logp)
        logp, entropy, row_max, log_sum = (
            torch.where(ignored, zero, v) for v in (logp, entropy, row_max, log_sum)
        )
    return logp, entropy, row_max, log_sum


def row_extras(
    logits3d: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token diagnostics ``(mean_logit, log_sum_sq_probs, is_top1, raw_max)``:
    ``mean_v z_v`` and ``log sum_v p_v^2`` of the scaled logits ``z``, ``argmax_v x_v ==
    target`` of the logits ``x`` as given (the first maximum, as ``torch.argmax``; the
    temperature and the cap keep the order, so none of their rounding makes or breaks a
    tie; False for a row holding a NaN and for a target outside ``[0, V)``) and ``max_v
    x_v`` (NaN for a row holding a NaN), ``(outer, inner)`` fp32 (fp64 for fp64 logits) /
    bool, no autograd. Ignored rows give 0 / 0 / False / 0."""
    outer, inner, vocab = logits3d.shape
    dtype = acc_dtype(logits3d)
    mean = torch.zeros(outer, inner, dtype=dtype, device=logits3d.device)
    log_sq, raw_max = torch.zeros_like(mean), torch.zeros_like(mean)
    top1 = torch.zeros(outer, inner, dtype=torch.bool, device=logits3d.device)
    for idx in _chunks(outer, inner, vocab):
        x = logits3d[idx].to(dtype)
        z = scaled(x, temperature, softcap)
        mean[idx] = z.mean(-1)
        log_sq[idx] = torch.logsumexp(2 * torch.log_softmax(z, -1), -1)
        raw_max[idx] = x.amax(-1)  # NaN when the row holds one
        top1[idx] = (x.argmax(-1) == targets[idx].long()) & ~raw_max[idx].isnan()
    counted = targets != ignore_index
    zero = torch.zeros_like(mean)
    return (torch.where(counted, mean, zero), torch.where(counted, log_sq, zero),
            top1 & counted, torch.where(counted, raw_max, zero))  # fmt: skip


def grad_logits(
    logits3d: torch.Tensor,
    targets: torch.Tensor | None,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor | None,
    h: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits3d`` given per-row ``g = dL/dlogp`` and ``h = dL/dH``."""
    outer, inner, vocab = logits3d.shape
    grad = torch.empty(logits3d.shape, dtype=logits3d.dtype, device=logits3d.device)
    active = torch.ones(outer, inner, dtype=torch.bool, device=logits3d.device)
    if targets is not None:
        active = targets != ignore_index
    # rows with g == h == 0 (padding of a fused loss) have exactly zero gradient: skip them
    needed = torch.zeros_like(active)
    for coef in (g, h):
        if coef is not None:
            needed |= coef != 0
    active = active & needed
    dtype = row_max.dtype
    for idx in _chunks(outer, inner, vocab):
        x = logits3d[idx].to(dtype)
        d = scaled(x, temperature, softcap) - row_max[idx][..., None]
        p = torch.exp(d - log_sum[idx][..., None])
        out = torch.zeros_like(d)
        if g is not None:
            g_rows = g[idx][..., None].to(dtype)
            out -= g_rows * p
            t = targets[idx].long()
            # a target outside [0, V) adds no one-hot term: a vocabulary shard's target
            # that another rank owns (fused_rl.distributed), or a bad id (its logp is NaN)
            one_hot = torch.where(((t >= 0) & (t < vocab))[..., None], g_rows, 0.0)
            out.scatter_add_(-1, t.clamp(0, vocab - 1)[..., None], one_hot)
        if h is not None:
            mean_d = (log_sum[idx] - entropy[idx])[..., None]  # E_p[z] - row max
            centred = torch.where(p == 0, torch.zeros_like(d), p * (d - mean_d))  # NaN stays
            out -= h[idx][..., None].to(dtype) * centred
        if softcap is not None:  # dz/dx * T = sech^2(x / c) (no 1 - tanh^2 cancellation)
            out = out * torch.cosh(x / softcap).pow(-2)
        out = torch.where(active[idx][..., None], out / temperature, torch.zeros_like(out))
        grad[idx] = out.to(grad.dtype)
    return grad


DOUBLE_BACKWARD = (
    "fused_rl: this op is differentiable once; the gradient of its gradient (double backward: "
    "a Hessian-vector product, gradgradcheck) is not implemented. Use plain PyTorch (e.g. "
    "log_softmax) where second derivatives are needed."
)


class _NotTwice(torch.autograd.Function):
    """Identity on ``grad``, linked to ``sources``; differentiating it raises."""

    @staticmethod
    def forward(ctx, grad, *sources):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError(DOUBLE_BACKWARD)


def differentiable_once(grad: torch.Tensor | None, *sources) -> torch.Tensor | None:
    """``grad``, computed with saved statistics treated as constants, marked so that a double
    backward through it raises instead of silently dropping their derivative.

    ``sources``: the tensors the true gradient depends on (the op's inputs, the incoming
    gradients); the mark hangs on them, so that a backward towards any of them meets it.
    Grad mode is on inside a backward only under ``create_graph=True``. (torch's
    ``once_differentiable`` links only the incoming gradients, which in a Hessian-vector
    product do not require grad: the wrong result would go through.)"""
    if grad is None or not torch.is_grad_enabled():
        return grad
    sources = [s for s in sources if isinstance(s, torch.Tensor) and s.requires_grad]
    return _NotTwice.apply(grad, *sources) if sources else grad


def multi_target_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log_softmax(logits / T)`` at ``ids`` ``(..., K)`` (in ``[0, V)``) in fp32 (fp64
    for fp64 logits), differentiable: the reference of ``fused_rl._vocab_ops``'s
    ``MultiTargetLogprobs``. ``rows`` ``(...)`` bool: the rows read; the others give
    meaningless values and a zero gradient (NaN logits there included)."""
    z = torch.where(rows[..., None], logits.to(acc_dtype(logits)), 0.0)
    return torch.log_softmax(z / temperature, dim=-1).gather(-1, ids)


class TokenStats(torch.autograd.Function):
    """Differentiable ``(logp, entropy)`` of ``softmax(z)`` (``z`` the scaled logits:
    :func:`scaled`) for ``(outer, inner, V)``,
    once (``differentiable_once``): the backward treats the saved row statistics as constants.

    ``inplace``: the logits are held as they are, not saved (autograd's version check), for
    :class:`GradIntoInput` downstream in the graph, which checks their version itself and
    takes the gradient into them.
    """

    @staticmethod
    def forward(ctx, logits3d, targets, temperature, ignore_index, softcap=None, inplace=False):
        logp, entropy, row_max, log_sum = row_stats(
            logits3d, targets, temperature, ignore_index, softcap
        )
        if inplace:
            ctx.logits3d = logits3d
            ctx.save_for_backward(targets, row_max, log_sum, entropy)
        else:
            ctx.save_for_backward(logits3d, targets, row_max, log_sum, entropy)
        ctx.inplace = inplace
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.ignore_index = ignore_index
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.inplace:
            logits3d = ctx.logits3d
            targets, row_max, log_sum, entropy = ctx.saved_tensors
        else:
            logits3d, targets, row_max, log_sum, entropy = ctx.saved_tensors
        with torch.no_grad():
            grad = grad_logits(
                logits3d,
                targets,
                row_max,
                log_sum,
                entropy,
                grad_logp if targets is not None else None,
                grad_entropy,
                ctx.temperature,
                ctx.ignore_index,
                ctx.softcap,
            )
        grad = differentiable_once(grad, logits3d, grad_logp, grad_entropy)
        return grad, None, None, None, None, None


INPLACE_MODIFIED = (
    "inplace=True: the logits were modified in place between the forward and the backward "
    "(version {saved} after the forward, {now} at the backward), so their gradient would be "
    "written over values it does not belong to. Nothing may write into the logits before the "
    "backward has run (a second backward, retain_graph=True, finds the first one's gradient "
    "there); or call without inplace=True"
)


def check_inplace_version(logits: torch.Tensor, saved: int) -> None:
    """Raise :data:`INPLACE_MODIFIED` unless ``logits`` are at version ``saved`` still."""
    now = logits._version
    if now != saved:
        raise RuntimeError(INPLACE_MODIFIED.format(saved=saved, now=now))


class GradIntoInput(torch.autograd.Function):
    """``x`` as it is (a view), whose backward copies the gradient arriving for ``x`` into
    ``x``'s own memory and passes that memory on as the gradient: the reference backend's
    ``inplace=True``. The gradient is computed in a buffer of its own first (the reference
    allocates it; the Triton path writes into the logits directly), then copied; the copy
    advances ``x``'s version, so an op that saved ``x`` for a later backward raises."""

    @staticmethod
    def forward(ctx, x):
        ctx.x, ctx.version = x, x._version
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x
        check_inplace_version(x, ctx.version)
        with torch.no_grad():
            x.detach().copy_(grad)
        return differentiable_once(x.detach(), x, grad)


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    softcap: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(logp, entropy)``, fp32 tensors of shape ``logits.shape[:-1]`` (fp64 for
    fp64 logits); ``softcap``: the soft cap ``c`` (``z = c tanh(x / c) / T``), None for none.

    ``targets=None`` gives a zero ``logp`` and the entropy of every row. ``inplace``: the
    logits are not saved for the backward (:class:`GradIntoInput` upstream checks them).
    """
    lead = logits.shape[:-1]
    logits3d = as_rows3d(logits)
    rows_shape = logits3d.shape[:-1]
    t3d = None if targets is None else targets.reshape(rows_shape)
    if torch.is_grad_enabled() and logits.requires_grad:
        if inplace:
            logp, entropy = TokenStats.apply(
                logits3d, t3d, temperature, ignore_index, softcap, True
            )
        else:
            logp, entropy = TokenStats.apply(logits3d, t3d, temperature, ignore_index, softcap)
    else:
        logp, entropy, _, _ = row_stats(logits3d, t3d, temperature, ignore_index, softcap)
    return logp.reshape(lead), entropy.reshape(lead)
