"""The exact per-token KL between two models over the whole vocabulary: ``token_kl``.

``KL(pi || pi_ref)_t = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(logits / T)``,
``q = softmax(ref_logits / T)``, as a differentiable ``(B, T)`` tensor (the gradient reaches
``logits`` only: the reference is a constant). It is what :func:`fused_rl.policy_loss`
(``ref_logits=``, ``kl_estimator="full"``) adds to every token's loss where the loss is
composed from per-token statistics (GSPO / VESPO, the top-entropy selection, vocabulary
parallelism); the token-level fused pass computes the same quantity inside its own kernel.

Triton backend: the reverse-KL kernels of on-policy distillation (``kernels/vocab/distill.py``
with ``beta = 1``, as their custom ops; both rows streamed once forward (plus the distillation
finalize, one small launch whose loss is unused), once backward, every statistic relative to
the running maxima so a reference near the policy keeps its small KL); the reference backend
is plain PyTorch (``reference.distill.token_divergences``).

Vocabulary parallelism (``process_group=``, or ``DTensor`` logits sharded ``Shard(-1)``, the
reference sharded alike): each rank streams its shard's columns into per-token partials
``(M_z, log S_z, M_u, log(S_z / S_u), r)`` (``r = E_p[(z - M_z) - (u - M_u)]`` over the
shard) and two all-reduces merge them: ``MAX`` of both row maxima (8 bytes a token in fp32),
then one ``SUM`` of ``A = S_z e^(M_z,r - M_z)``, the shard's part of ``S_u - S_z`` as its own
small number (``A expm1((M_u,r - M_u) - (M_z,r - M_z) - log(S_z,r / S_u,r))``) and
``A (r + (M_z,r - M_z) - (M_u,r - M_u))`` (12 bytes a token): 20 bytes a token per rank,
fp32 (twice that in fp64). ``KL = R / S_z - log(S_z / S_u)`` with the log-ratio from the
summed difference (``-log1p``), so a reference near the policy keeps its accuracy. The backward
needs no collective: each rank writes its shard's gradient from the global statistics. Shards
as :func:`fused_rl.token_logprobs`'s default layout (equal widths, rank ``r`` holding
``[r V_local, (r + 1) V_local)``); both models' shards must have the same width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import stats_dtype
from ._shapes import as_rows3d
from .distill import COLUMNS, N_STATS, distill_bwd_op, distill_fwd_op
from .distributed import _dist, is_dtensor, resolve_shard
from .reference import distill as ref
from .reference.logprobs import differentiable_once

_COL_KL = COLUMNS.index("reverse_kl")
_COL_COUNT = COLUMNS.index("count")
# kernels/vocab/distill.py STAT_*: max_z, log S_z, max_u, log(S_z / S_u), c (= KL)
_MAX_Z, _LOG_S_Z, _MAX_U, _LOG_RATIO, _C = range(N_STATS)


def token_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    process_group=None,
    backend: str = "auto",
) -> Tensor:
    """Per-token exact ``KL(softmax(logits / T) || softmax(ref_logits / T))``.

    Args:
        logits: ``(..., V)`` the policy's logits (any float dtype and strides);
            differentiable.
        ref_logits: the reference's, the same shape (any float dtype and strides); a
            constant (no gradient).
        temperature: both softmaxes at ``temperature``.
        mask: optional bool ``logits.shape[:-1]``: rows outside it are not read and give 0
            (and a zero gradient).
        process_group: vocabulary parallelism: each rank's ``logits`` / ``ref_logits`` are its
            equal-width shard of the vocabulary (module docstring); ``DTensor`` inputs
            sharded on their last dim give their own group.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``logits.shape[:-1]`` fp32 (fp64 for an fp64 input), differentiable w.r.t.
        ``logits``.

    Example:
        >>> import torch, fused_rl
        >>> x = torch.randn(2, 3, 11, requires_grad=True)
        >>> kl = fused_rl.token_kl(x, x.detach() + 0.1 * torch.randn(2, 3, 11))
        >>> kl.shape, bool((kl >= 0).all())
        (torch.Size([2, 3]), True)
        >>> kl.sum().backward()
    """
    V.check_float(logits, "logits")
    V.check_float(ref_logits, "ref_logits")
    V.check_positive(temperature, "temperature")
    if is_dtensor(ref_logits):
        ref_logits = ref_logits.to_local()
    logits, _, shard = resolve_shard(logits, None, process_group, None, None)
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"ref_logits must have logits' shape {tuple(logits.shape)} (the same vocabulary, "
            f"sharded alike), got {tuple(ref_logits.shape)}"
        )
    V.check_same_device(logits=logits, ref_logits=ref_logits, mask=mask)
    if mask is not None:
        V.check_tensor(mask, "mask")
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"mask must be a bool tensor of shape {tuple(logits.shape[:-1])}, got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
    which = resolve_backend(backend, logits, ref_logits)
    x3d, r3d = as_rows3d(logits), as_rows3d(ref_logits.detach())
    m2d = None if mask is None else mask.reshape(x3d.shape[:2])
    if shard is None and which == "reference":
        kl = ref.token_divergences(x3d, r3d, beta=1.0, temperature=float(temperature),
                                   counted=m2d)["d"]  # fmt: skip
    else:
        kl = _TokenKL.apply(x3d, r3d, m2d, float(temperature), which, shard)
    return kl.reshape(logits.shape[:-1])


class _TokenKL(torch.autograd.Function):
    """``(outer, inner)`` exact KL of ``(outer, inner, V)`` rows; ``shard`` None: the whole
    vocabulary here (Triton only), else this rank's shard (either backend)."""

    @staticmethod
    def forward(ctx, x3d, r3d, mask, temperature, which, shard):
        stats, kl = _local_stats(x3d, r3d, mask, temperature, which)
        if shard is not None:
            stats, kl = _merge(stats, shard)
            kl = kl.view(x3d.shape[:2])
        if mask is not None:
            kl = torch.where(mask, kl, 0.0)
        ctx.save_for_backward(x3d, r3d, stats, mask)
        ctx.temperature, ctx.which = temperature, which
        ctx.set_materialize_grads(False)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        x3d, r3d, stats, mask = ctx.saved_tensors
        if grad_kl is None:
            return (None,) * 6
        with torch.no_grad():
            g = grad_kl if mask is None else torch.where(mask, grad_kl, 0.0)  # rows not read
            grad = _backward(x3d, r3d, stats, g, ctx.temperature, ctx.which)
        return differentiable_once(grad, x3d, grad_kl), None, None, None, None, None


def _local_stats(x3d, r3d, mask, temperature, which):
    """``(stats, kl)``: the ``(N_STATS, outer * inner)`` row statistics of this shard's (or
    the whole vocabulary's) columns in the distill kernels' layout, and the ``(outer,
    inner)`` KL over those columns."""
    outer, inner, vocab = x3d.shape
    n = outer * inner
    if which == "triton":  # the distillation forward at beta = 1 (its loss unused)
        m8 = None if mask is None else mask.view(torch.uint8)
        _, _, _, stats, part = distill_fwd_op(
            x3d, r3d, None, m8, None, 1.0, temperature, -100, 0, float(inner), 0.0, False
        )
        return stats, part[_COL_KL].view(outer, inner)
    # the reference: the same statistics in plain PyTorch (the shard may be empty: -inf max)
    acc = stats_dtype(torch.promote_types(x3d.dtype, r3d.dtype))
    z, u = x3d.detach().to(acc) / temperature, r3d.to(acc) / temperature
    if mask is not None:
        keep = mask[..., None]
        z, u = torch.where(keep, z, 0.0), torch.where(keep, u, 0.0)
    if vocab == 0:
        empty = torch.full((outer, inner), -math.inf, dtype=acc, device=x3d.device)
        zero = torch.zeros_like(empty)
        stats = torch.stack((empty, empty, empty, zero, zero)).reshape(N_STATS, n)
        return stats, zero
    m_z, m_u = z.amax(-1), u.amax(-1)
    m_z0 = torch.where(torch.isfinite(m_z), m_z, 0.0)
    m_u0 = torch.where(torch.isfinite(m_u), m_u, 0.0)
    a = z - m_z0[..., None]
    b_minus_a = (u - z) - (m_u0 - m_z0)[..., None]  # the logits' own difference (near-equal)
    e_a = a.exp()
    s_z = e_a.sum(-1)
    log_s_z = s_z.log()
    r = -torch.where(e_a == 0, 0.0, e_a * b_minus_a).sum(-1) / s_z
    log_ratio = _log_ratio(s_z, torch.where(e_a == 0, (a + b_minus_a).exp(),
                                            e_a * torch.expm1(b_minus_a)).sum(-1))  # fmt: skip
    kl = r - log_ratio
    stats = torch.stack((m_z0, log_s_z, m_u0, log_ratio, kl)).reshape(N_STATS, n)
    return stats, kl


def _log_ratio(s_z: Tensor, gap: Tensor) -> Tensor:
    """``log(S_z / S_u)`` from ``S_z`` and ``gap = S_u - S_z`` summed as its own terms:
    ``-log1p(gap / S_z)`` near 1 (two separately rounded logs would leave an error of
    ``ulp(log V)`` in a KL of order ``delta^2``), the plain logs elsewhere."""
    ratio = gap / s_z
    near = ratio.abs() <= 0.5
    return torch.where(near, -torch.log1p(torch.where(near, ratio, 0.0)),
                       s_z.log() - (s_z + gap).log())  # fmt: skip


def _merge(stats: Tensor, shard) -> tuple[Tensor, Tensor]:
    """The two all-reduces over ``shard.group``: per-token partials of every rank into the
    whole vocabulary's statistics (same layout) and KL."""
    dist = _dist()
    n = stats.shape[1]
    m_z_l, log_s_z_l, m_u_l = stats[_MAX_Z], stats[_LOG_S_Z], stats[_MAX_U]
    log_ratio_l = stats[_LOG_RATIO]
    r_l = stats[_C] + log_ratio_l  # E_p[(z - M_z) - (u - M_u)] over the shard
    # an empty shard's partial: no mass (its max taken as -inf so it never wins)
    empty = log_s_z_l == -math.inf
    maxima = torch.cat((torch.where(empty, -math.inf, m_z_l), torch.where(empty, -math.inf, m_u_l)))
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=shard.group)
    m_z, m_u = maxima[:n], maxima[n:]
    d_z = torch.where(empty, 0.0, m_z_l - m_z)
    a = torch.where(empty, 0.0, (d_z + log_s_z_l).exp())  # S_z,r e^(M_z,r - M_z)
    # d_z - d_u from the two differences of maxima, each small and exact for near-equal
    # rows (not from d_z and d_u, each rounded at the size of the maxima)
    dd = torch.where(empty, 0.0, (m_z_l - m_u_l) - (m_z - m_u))
    # S_u,r e^(M_u,r - M_u) - a: the shard's part of S_u - S_z, as its own small number
    gap = torch.where(a == 0, 0.0, a * torch.expm1(-dd - log_ratio_l))
    rel = torch.where(a == 0, 0.0, a * (r_l + dd))
    sums = torch.cat((a, gap, rel))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)
    s_z, gap, big_r = sums[:n], sums[n : 2 * n], sums[2 * n :]
    log_ratio = _log_ratio(s_z, gap)
    kl = big_r / s_z - log_ratio
    merged = torch.stack((m_z, s_z.log(), m_u, log_ratio, kl))
    return merged, kl


def _backward(x3d, r3d, stats, grad_kl, temperature, which) -> Tensor:
    """``dL/dlogits`` of this rank's (or the whole) ``(outer, inner, V)`` logits from the
    global statistics: ``g_t p_v (-delta_v - KL_t) / T``."""
    outer, inner, vocab = x3d.shape
    if vocab == 0:
        return torch.zeros(x3d.shape, dtype=x3d.dtype, device=x3d.device)
    g = grad_kl.reshape(-1).to(stats.dtype)
    if which == "triton":
        part = torch.zeros((len(COLUMNS), outer * inner), dtype=stats.dtype, device=x3d.device)
        part[_COL_COUNT] = g  # the kernel's per-row coefficient: the upstream gradient
        one = torch.ones((1,), dtype=stats.dtype, device=x3d.device)
        return distill_bwd_op(x3d, r3d, stats, part, one, one[0], 1.0, temperature, False)
    z = x3d.to(stats.dtype) / temperature
    u = r3d.to(stats.dtype) / temperature
    st = stats.view(N_STATS, outer, inner, 1)
    p = ((z - st[_MAX_Z]) - st[_LOG_S_Z]).exp()
    # log q - log p from the logits' own difference (as the kernel's near_delta): exact for
    # a reference near the policy, where two logs of size log V would cancel
    delta = ((u - z) - (st[_MAX_U] - st[_MAX_Z])) + st[_LOG_RATIO]
    terms = torch.where(p == 0, 0.0, p * (-delta - st[_C]))
    keep = (g != 0).view(outer, inner, 1)  # rows that do not count: exact zeros
    grad = torch.where(keep, g.view(outer, inner, 1) * terms, 0.0) / temperature
    return grad.to(x3d.dtype)
