"""Reference on-policy distillation divergences per token (plain PyTorch, autograd).

The same math as ``kernels/vocab/distill.py`` written the direct way: both log-softmaxes in
fp32 (fp64 when an input is fp64), the divergence of TRL's ``generalized_jsd_loss`` per row,
and autograd for the student's gradient. It materialises ``(N, V)`` temporaries; it is the
CPU fallback and the readable twin, not the fast path.

``0 * log 0`` terms are 0 (a ``where`` whose untaken branch is also made finite, so its
zero gradient never meets an infinite factor); a NaN logit in a counted row makes that row's
values NaN. Rows that do not count are replaced by zeros before anything is computed, so
NaN / inf logits there never reach a value or a gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .reductions import acc_dtype


def _xlogy_terms(p: Tensor, log_ratio: Tensor) -> Tensor:
    """``p * log_ratio`` with ``0`` where ``p == 0`` (also when ``log_ratio`` is infinite or
    NaN there), differentiable with a zero gradient through the untaken branch."""
    zero = p == 0
    return p * torch.where(zero, torch.zeros_like(log_ratio), log_ratio)


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
    forward_kl = _xlogy_terms(q, log_q - log_p).sum(-1)
    reverse_kl = _xlogy_terms(p, log_p - log_q).sum(-1)
    if beta == 0:
        d = forward_kl
    elif beta == 1:
        d = reverse_kl
    else:
        # log m = logaddexp(log(1 - beta) + log p, log(beta) + log q); columns where both p
        # and q are 0 take finite stand-ins (their terms are 0 whatever m is there)
        both_zero = (p == 0) & (q == 0)
        safe_p = torch.where(both_zero, torch.zeros_like(log_p), log_p)
        safe_q = torch.where(both_zero, torch.zeros_like(log_q), log_q)
        log_m = torch.logaddexp(safe_p + math.log1p(-beta), safe_q + math.log(beta))
        d = beta * _xlogy_terms(q, log_q - log_m).sum(-1)
        d = d + (1.0 - beta) * _xlogy_terms(p, log_p - log_m).sum(-1)
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

    Columns where ``p = 0`` get 0 (NaN stays NaN elsewhere); rows outside ``counted`` are
    zeroed before anything is computed. Returns ``logits``' shape in fp32 (fp64 for an fp64
    input).
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
    if beta == 0:
        g = p - log_q.exp()
    elif beta == 1:
        r = torch.where(zero, torch.zeros_like(log_p), log_p - log_q)
        g = p * (r - (p * r).sum(-1, keepdim=True))
    else:
        delta = torch.where(zero, torch.zeros_like(log_p), log_q - log_p)
        big = torch.logaddexp(
            torch.full_like(delta, math.log1p(-beta)), math.log(beta) + delta
        )  # L = log(m / p)
        big = torch.where(zero, torch.zeros_like(big), big)
        g = -(1.0 - beta) * p * (big - (p * big).sum(-1, keepdim=True))
    g = g / temperature
    if counted is not None:
        g = torch.where(counted[..., None], g, torch.zeros_like(g))
    return g
