"""Reference per-token KL estimators (Schulman's k1/k2/k3 and verl's variants).

Convention: estimate KL(pi || pi_ref) from samples of pi, ``log_ratio = logp - ref_logp``.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate, differentiable w.r.t. both arguments.

    * ``k1``: ``logp - ref``
    * ``k2``: ``(logp - ref)^2 / 2``
    * ``k3``: ``exp(ref - logp) - (ref - logp) - 1``
    * ``low_var_kl``: k3 with ``ref - logp`` clamped to [-20, 20], result clamped to [-10, 10]
    * ``abs``: ``|logp - ref|``
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = -log_ratio
        return torch.exp(neg) - neg - 1.0
    if kind == "low_var_kl":
        neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
