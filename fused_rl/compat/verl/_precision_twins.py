"""verl's own half-precision arithmetic, op for op in the inputs' dtypes: what
``half_precision("original")`` runs where the adapters proper stream the vocabulary through
fused_rl's kernels or vectorise a loop (:mod:`fused_rl.compat._precision`).

Each function transcribes verl's PyTorch code path (its ops, their order, its Python-scalar
starts), so that fp16 / bf16 results equal verl's bit for bit. They are kept here, apart from
the adapters, so that what is verl's arithmetic and what is fused_rl's stays visible. Checks
run in the adapters before these are called.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor


def _logprobs_eager(logits: Tensor, labels: Tensor) -> Tensor:
    """verl's PyTorch ``logprobs_from_logits`` (its path without flash-attn) in the logits'
    dtype: a log-softmax per leading row, gathered at ``labels``."""
    if logits.dim() < 2:
        return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    rows = [
        F.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        for z, y in zip(logits, labels)
    ]
    return torch.stack(rows)


def _entropy_eager(logits: Tensor) -> Tensor:
    """verl's ``entropy_from_logits`` in the logits' dtype: ``logsumexp - sum(p z)``, the
    softmax taken first (as verl: it fixes the backward's summation order)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def _kl_eager(logprob, ref_logprob, kind):
    """verl's estimators in the inputs' dtype, op for op (``"original"`` half precision)."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    neg = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(neg) - neg - 1, min=-10, max=10)


def _gae_loop(rewards, values, mask, gamma, lam):
    """verl's GAE recursion, step by step in the inputs' dtypes (``"original"`` mode, and
    ``gamma`` / ``lam`` outside ``[0, 1]``): a masked step passes the next valid step's value
    and advantage through. Returns the advantages before whitening."""
    if mask.dtype == torch.bool:
        mask = mask.long()  # verl's 1 - mask needs a number; an int mask keeps its dtypes
    next_value, last = 0, 0  # Python zeros, as verl starts (they fix its dtype promotion)
    steps = []
    for t in range(rewards.shape[-1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * m + (1 - m) * next_value
        last = candidate * m + (1 - m) * last
        steps.append(last)
    return torch.stack(steps[::-1], dim=1)


def _grpo_loop(scores, ids, epsilon, norm_adv_by_std_in_grpo):
    """verl's per-group loop in the scores' dtype (``"original"`` half precision)."""
    rows: dict = defaultdict(list)
    for i, key in enumerate(ids):
        rows[key].append(i)
    stats = {}
    for key, members in rows.items():
        if len(members) == 1:
            stats[key] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            group = torch.stack([scores[i] for i in members])
            stats[key] = (torch.mean(group), torch.std(group))
    out = scores.clone()
    for i, key in enumerate(ids):
        mean, std = stats[key]
        centred = scores[i] - mean
        out[i] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return out
