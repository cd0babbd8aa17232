"""Reference per-token KL estimators (Schulman's k1/k2/k3 and verl's variants).

Convention: estimate KL(pi || pi_ref) from samples of pi, ``log_ratio = logp - ref_logp``.
"""

from __future__ import annotations

import torch

from ..kernels.modes import KL_KINDS  # noqa: F401  (re-exported: the list's old home)
from .clamp import clamp


def k3(n: torch.Tensor) -> torch.Tensor:
    """``exp(n) - n - 1`` without its cancellation near ``n = 0`` (as the kernels compute it):
    ``n^2/2 (1 + n/3 (1 + n/4 (...)))`` to ``n^18`` for |n| < 1/2, the direct formula beyond.
    Differentiable; the series only ever sees small arguments (no inf * 0 in its gradient)."""
    small = n.abs() < 0.5
    t = torch.where(small, n, torch.zeros_like(n))
    q = 1.0 + t / 18.0
    for k in range(17, 2, -1):
        q = 1.0 + t / k * q
    return torch.where(small, 0.5 * t * t * q, torch.exp(n) - n - 1.0)


def refuse_full(kl_estimator: str, where: str = "an estimate from two log-probs") -> None:
    """``kl_estimator="full"`` needs both models' logits: raise where only log-probs are."""
    if kl_estimator == "full":
        raise ValueError(
            f"kl_estimator='full' is the exact KL over the vocabulary, not {where}: it needs "
            "both models' logits (fused_rl.policy_loss(..., ref_logits=) or "
            "fused_rl.linear_policy_loss(..., ref_hidden=, ref_weight=))"
        )


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    """Elementwise KL estimate (``kl_estimator``), differentiable w.r.t. both arguments.

    * ``k1``: ``logp - ref``
    * ``k2``: ``(logp - ref)^2 / 2``
    * ``k3``: ``exp(ref - logp) - (ref - logp) - 1``
    * ``low_var_kl``: k3 with ``ref - logp`` clamped to [-20, 20], result clamped to [-10, 10]
    * ``abs``: ``|logp - ref|``
    """
    log_ratio = logp - ref_logp
    if kl_estimator == "k1":
        return log_ratio
    if kl_estimator == "k2":
        return 0.5 * log_ratio.square()
    if kl_estimator == "k3":
        return k3(-log_ratio)
    if kl_estimator == "low_var_kl":
        neg = clamp(-log_ratio, -20.0, 20.0)
        return clamp(k3(neg), -10.0, 10.0)
    if kl_estimator == "abs":
        return log_ratio.abs()
    refuse_full(kl_estimator)
    raise ValueError(f"kl_estimator must be one of {KL_KINDS}, got {kl_estimator!r}")
