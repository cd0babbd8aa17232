"""Reference on-policy distillation divergences per token (plain PyTorch, autograd).

The same math as ``kernels/vocab/distill.py`` written the direct way: both log-softmaxes in
fp32 (fp64 when an input is fp64), the divergence of TRL's ``generalized_jsd_loss`` per row,
and autograd for the student's gradient. It materialises ``(N, V)`` temporaries; it is the
CPU fallback and the readable twin, not the fast path.

``0 * log 0`` terms are 0 (a ``where`` whose untaken branch is also made finite, so its
zero gradient never meets an infinite factor); a NaN logit in a counted row makes that row's
values NaN. A row whose divergence is not finite (NaN, or a reverse KL of ``+inf``) has no
finite gradient column: autograd through the softmax gives ``p_v (g_v - sum_w p_w g_w)``,
``0 * inf`` = NaN where ``p_v == 0``, as the kernels (``kernels/vocab/pair.py``
``reverse_kl_grad``). Rows that do not count are replaced by zeros before anything is computed, so
NaN / inf logits there never reach a value or a gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._mixture_poly import near_polynomials
from .reductions import acc_dtype


def capped_rows(
    x: Tensor, counted: Tensor | None, softcap: float | None, scale: float = 1.0
) -> Tensor:
    """``c tanh(x / c)`` (Gemma's soft cap, before the temperature) of the rows that count,
    zeros elsewhere (``counted``: ``x.shape[:-1]`` bool, None: all), so a NaN row that does
    not count never meets the cap's gradient (``0 * sech^2(NaN)`` would be NaN); ``x`` as it
    is without a cap. A logit ``scale`` ``s != 1`` (a model's own, as TRL's distillation
    applies it) makes it ``c tanh(s x / c)`` (``s x`` uncapped). Computed in fp32 at least,
    as the kernels (a 16-bit ``tanh`` would round every capped logit)."""
    return capped_rows_and_slope(x, counted, softcap, scale)[0]


def capped_rows_and_slope(
    x: Tensor, counted: Tensor | None, softcap: float | None, scale: float = 1.0
) -> tuple[Tensor, Tensor | float | None]:
    """:func:`capped_rows` and its derivative ``dz/dx`` (``s sech^2(s x / c)``, the number
    ``s`` uncapped, None without a scale or a cap: ``x`` itself)."""
    if softcap is None and scale == 1.0:
        return x, None
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if counted is not None:
        x = torch.where(counted[..., None], x, 0.0)
    if scale != 1.0:
        x = scale * x
    if softcap is None:
        return x, scale
    t = torch.tanh(x / softcap)
    sech2 = 1 - t * t
    return softcap * t, sech2 if scale == 1.0 else scale * sech2


def _xlogy_terms(p: Tensor, log_ratio: Tensor) -> Tensor:
    """``p * log_ratio`` with ``0`` where ``p == 0`` (also when ``log_ratio`` is infinite or
    NaN there), differentiable with a zero gradient through the untaken branch."""
    zero = p == 0
    return p * torch.where(zero, torch.zeros_like(log_ratio), log_ratio)


# Taylor coefficients (``d^2`` to ``d^13``) of ``g1(d) = d e^d - expm1(d)`` and
# ``g2(x) = (1 + x) log1p(x) - x``, the two non-negative pieces of a near-equal column's JSD
# term in fp64 (``kernels/vocab/distill.py`` ``near_mixture``; fp32 takes a polynomial)
_G1 = tuple((k - 1) / math.factorial(k) for k in range(2, 14))
_G2 = tuple((-1) ** k / (k * (k - 1)) for k in range(2, 14))


def _series(coefs: tuple[float, ...], x: Tensor) -> Tensor:
    acc = torch.full_like(x, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = c + x * acc
    return x * x * acc


def _small(x: Tensor, bound: float) -> Tensor:
    return (x <= bound) & (x >= -bound)


def _near_delta(z: Tensor, u: Tensor, temperature: float, free: bool = False):
    """``(delta, near)``: ``delta = log q - log p`` per column, as the kernel forms it
    (``logit_gap`` + ``log(S_z / S_u)`` from the gap's own sum ``S_u - S_z``; differentiable
    in ``z``; ``free``: ``log(S_z / S_u)`` detached, as ``log S_z`` is), where ``|delta| <= 1``
    (``near``; ``delta`` is 0 elsewhere, where ``log q - log p`` is used)."""
    zs, us = z / temperature, u / temperature
    m_z = zs.detach().amax(-1, keepdim=True)
    m_u = us.amax(-1, keepdim=True)
    m_z = torch.where(torch.isfinite(m_z), m_z, torch.zeros_like(m_z))
    m_u = torch.where(torch.isfinite(m_u), m_u, torch.zeros_like(m_u))
    a, b = zs - m_z, us - m_u
    w, dm = (u - z) / temperature, m_u - m_z
    big = torch.maximum(a.abs(), b.abs())
    direct = (w.abs() <= big) & (dm.abs() <= big)
    gap_ab = torch.where(direct, w - dm, b - a)
    e_a, e_b = a.exp(), b.exp()
    s_z = e_a.sum(-1, keepdim=True)
    close = _small(gap_ab, 1.0) & (e_a != 0)
    terms = torch.where(close, e_a * torch.expm1(torch.where(close, gap_ab, 0.0)), e_b - e_a)
    r = terms.sum(-1, keepdim=True) / s_z
    ok = _small(r, 0.5) & torch.isfinite(s_z) & (s_z > 0)
    log_zu = torch.where(ok, -torch.log1p(torch.where(ok, r, 0.0)), torch.zeros_like(r))
    if free:
        log_zu = log_zu.detach()
    delta = gap_ab + log_zu
    near = _small(delta, 1.0) & ok
    return torch.where(near, delta, torch.zeros_like(delta)), near


def mixture_terms(delta, near, p, q, log_p, log_q, beta):
    """``(L, f)`` per column as ``kernels/vocab/distill.py`` ``mixture_terms``: ``L = log(m /
    p)``, ``f`` the column's JSD term; the near form where ``near`` (``delta`` is 0 off it),
    the ``logaddexp`` form elsewhere (columns where both ``p`` and ``q`` are 0 take finite
    stand-ins: their terms are 0 whatever ``m`` is there). The near ``f`` in fp32 is
    ``p delta^2 H(delta)`` (``fused_rl._mixture_poly``), as the kernel's: the series form
    ``p (beta g1 - g2)`` cancels by up to ``1 / (1 - beta)``; in fp64 the series. The far
    form's ``log(q / m)`` comes from ``logaddexp``'s own ``log1p`` term, as the kernel's
    (``log q - log m`` of two log-probabilities cancels where ``m`` is near ``q``). Both
    cancellations left the fp32 loss 8e-4 off at ``beta = 0.9999``."""
    x = beta * torch.expm1(delta)
    if delta.dtype == torch.float64:
        g1 = torch.where(
            _small(delta, 0.25), _series(_G1, delta), delta * delta.exp() - torch.expm1(delta)
        )
        small = _small(x, 0.0625)  # g2's series (the direct form cancels by 2 / |x| above)
        x_s = torch.where(small, x, torch.zeros_like(x))
        x_d = torch.where(small, torch.ones_like(x), x)
        g2 = torch.where(small, _series(_G2, x_s), (1.0 + x_d) * torch.log1p(x_d) - x_d)
        near_f = p * (beta * g1 - g2)
    else:
        near_f = p * _series(near_polynomials(beta)[1], delta)
    both_zero = ((p == 0) & (q == 0)) | near
    d = torch.where(both_zero, torch.zeros_like(log_q), log_q - log_p)  # log q - log p
    # L = logaddexp(log(1 - beta), log(beta) + d) = hi + l1, and log(q / m) from the same
    # l1 (not d - L, which cancels when q is near m: beta near 1)
    log_1m_beta = math.log1p(-beta)
    k = d + math.log(beta)
    above = k > log_1m_beta  # (a where, not a clamp: a tie's gradient goes to one side)
    hi, lo = torch.where(above, k, log_1m_beta), torch.where(above, log_1m_beta, k)
    l1 = torch.log1p(torch.exp(lo - hi))
    far_l = hi + l1
    log_q_over_m = torch.where(above, -math.log(beta) - l1, (d - log_1m_beta) - l1)
    far_f = beta * _xlogy_terms(q, log_q_over_m) - (1.0 - beta) * _xlogy_terms(p, far_l)
    return torch.where(near, torch.log1p(x), far_l), torch.where(near, near_f, far_f)


def token_divergences(
    logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float,
    temperature: float,
    counted: Tensor | None = None,
    free_logprobs: bool = False,
) -> dict[str, Tensor]:
    """Per-row divergences of ``softmax(logits / T)`` (student ``p``) and
    ``softmax(teacher_logits / T)`` (teacher ``q``), ``(..., V)`` each.

    Returns a dict of ``logits.shape[:-1]`` tensors (fp32, fp64 for an fp64 input):
    ``d`` (the divergence used: ``KL(q || p)`` for ``beta == 0``, ``KL(p || q)`` for
    ``beta == 1``, else ``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = (1 - beta) p +
    beta q``), differentiable w.r.t. ``logits``; and, detached, ``forward_kl``,
    ``reverse_kl``, ``student_entropy``, ``teacher_entropy``. ``counted`` (bool,
    ``logits.shape[:-1]``): rows outside it give 0 everywhere, with 0 gradient.
    ``free_logprobs``: the same values, differentiated with ``log p`` as free coordinates
    (``log p = z / T - sg(logsumexp(z / T))``: Liger's JSD, whose inputs are log-probabilities
    and whose gradient is the partial derivative on them, not through the softmax).
    """
    acc = acc_dtype(logits, teacher_logits)
    z = logits.to(acc)
    u = teacher_logits.detach().to(acc)
    if counted is not None:
        keep = counted[..., None]
        z = torch.where(keep, z, torch.zeros_like(z))
        u = torch.where(keep, u, torch.zeros_like(u))
    if free_logprobs:  # the value of log_softmax, the gradient of the identity
        zs = z / temperature
        log_p = zs - torch.logsumexp(zs, dim=-1, keepdim=True).detach()
    else:
        log_p = F.log_softmax(z / temperature, dim=-1)
    log_q = F.log_softmax(u / temperature, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    delta, near = _near_delta(z, u, temperature, free_logprobs)
    log_ratio = torch.where(near, delta, log_q - log_p)  # log q - log p
    forward_kl = _xlogy_terms(q, log_ratio).sum(-1)
    reverse_kl = _xlogy_terms(p, -log_ratio).sum(-1)
    if beta == 0:
        d = forward_kl
    elif beta == 1:
        d = reverse_kl
    else:
        # per column f = beta q log(q / m) + (1 - beta) p log(p / m) >= 0, near-equal
        # columns from delta = log q - log p without cancellation (``mixture_terms``)
        d = mixture_terms(delta, near, p, q, log_p, log_q, beta)[1].sum(-1)
    with torch.no_grad():
        student_entropy = -_xlogy_terms(p, log_p).sum(-1)
        teacher_entropy = -_xlogy_terms(q, log_q).sum(-1)
    out = {
        "d": d,
        "forward_kl": forward_kl.detach(),
        "reverse_kl": reverse_kl.detach(),
        "student_entropy": student_entropy,
        "teacher_entropy": teacher_entropy,
    }
    if counted is not None:
        for name, value in out.items():
            out[name] = torch.where(counted, value, torch.zeros_like(value))
    return out


def student_grad(
    logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float,
    temperature: float,
    counted: Tensor | None = None,
) -> Tensor:
    """``dD/dlogits`` of :func:`token_divergences`' ``d`` per row, written out (no autograd:
    the chunks of ``fused_rl.linear_distill_loss`` form it inside their forward, where
    ``torch.compile`` traces plain tensor code): with ``z = logits / T``,

    * forward KL: ``(p - q) / T``;
    * reverse KL: ``p ((log p - log q) - KL(p || q)) / T``;
    * JSD: ``-(1 - beta) p (L - sum_w p_w L_w) / T`` with ``L = log(m / p) =
      logaddexp(log(1 - beta), log(beta) + log q - log p)``.

    On near-equal columns (``|log q - log p| <= 1``) ``delta = log q - log p`` comes from the
    logits' difference (``_near_delta``), ``p - q = -p expm1(delta)`` and ``L =
    log1p(beta expm1(delta))``: each exact to rounding relative to itself, as the kernel's
    (whose fp32 ``L`` there is the polynomial ``delta A(delta)``, ``fused_rl._mixture_poly``).

    Columns where ``p = 0`` get 0 (NaN stays NaN elsewhere), NaN in a row whose reverse KL /
    ``sum_w p_w L_w`` is not finite (``0 * inf``, as autograd and the kernel); rows outside
    ``counted`` are zeroed before anything is computed. Returns ``logits``' shape in fp32
    (fp64 for an fp64 input).
    """
    acc = acc_dtype(logits, teacher_logits)
    z = logits.detach().to(acc)
    u = teacher_logits.detach().to(acc)
    if counted is not None:
        keep = counted[..., None]
        z = torch.where(keep, z, torch.zeros_like(z))
        u = torch.where(keep, u, torch.zeros_like(u))
    log_p = F.log_softmax(z / temperature, dim=-1)
    log_q = F.log_softmax(u / temperature, dim=-1)
    p = log_p.exp()
    zero = p == 0
    delta, near = _near_delta(z, u, temperature)
    if beta == 0:  # p - q = -p expm1(delta), relative to itself on near columns
        g = torch.where(near, -p * torch.expm1(delta), p - log_q.exp())
    elif beta == 1:
        r = torch.where(near, -delta, log_p - log_q)
        r = torch.where(zero, torch.zeros_like(r), r)
        g = p * (r - (p * r).sum(-1, keepdim=True))
    else:
        far = torch.where(zero, torch.zeros_like(log_p), log_q - log_p)
        big = torch.logaddexp(
            torch.full_like(far, math.log1p(-beta)), math.log(beta) + far
        )  # L = log(m / p)
        big = torch.where(near, torch.log1p(beta * torch.expm1(delta)), big)
        big = torch.where(zero, torch.zeros_like(big), big)
        g = -(1.0 - beta) * p * (big - (p * big).sum(-1, keepdim=True))
    g = g / temperature
    if counted is not None:
        g = torch.where(counted[..., None], g, torch.zeros_like(g))
    return g
