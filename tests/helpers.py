"""Shared test helpers: error metrics and float64 oracles."""

from __future__ import annotations

import torch

FP32_TOL = 1e-5


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """RMS relative error ``||out - ref|| / ||ref||`` (absolute when ``ref`` is ~0)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all() or not torch.isfinite(ref).all(), "non-finite output"
    diff = (out - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 1e-12 else diff + floor


def assert_rel(out, ref, tol: float, what: str = "") -> None:
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: RMS relative error {err:.3g} > {tol:.3g}"


def bf16_tol(eager_same_dtype: torch.Tensor, oracle: torch.Tensor, slack: float = 2.0) -> float:
    """Tolerance for a low-precision output: the eager same-dtype error times ``slack``,
    with a floor of 1e-3 (bf16 has an 8-bit mantissa)."""
    return max(slack * rel_err(eager_same_dtype, oracle), 1e-3)


def oracle_token_stats(logits, targets, temperature=1.0, ignore_index=-100):
    """float64 ``(logp, entropy)`` via plain autograd-able ``log_softmax``; zeros where ignored."""
    z = torch.log_softmax(logits.double() / temperature, dim=-1)
    entropy = -(z.exp() * z).nan_to_num(0.0).sum(-1)
    if targets is None:
        return None, entropy
    keep = targets != ignore_index
    logp = z.gather(-1, torch.where(keep, targets, 0).long()[..., None])[..., 0]
    zero = torch.zeros_like(logp)
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero)


def seed_gae_loop(rewards, values, gamma, lam):
    """Seed 004's GAE loop as written there (Python loop over T, in the inputs' dtype):
    ``(advantages, returns = advantages + values)``; the oracle every GAE test builds on."""
    last = 0.0
    reversed_adv = []
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values
