"""Reference advantage estimation: GAE, KL-penalised rewards, GRPO / RLOO group baselines.

Plain PyTorch, no Python loop over time. Results are fp32 (fp64 when an input is fp64).

GAE without a time loop
-----------------------
``A_t = delta_t + c * A_{t+1}`` with ``c = gamma * lam`` unrolls to the discounted suffix sum
``A_t = sum_{s >= t} c^(s-t) delta_s``. The tempting closed form ``c^-t * revcumsum(c^s
delta_s)`` overflows for ``c < 1`` (and divides by zero at ``c = 0``), so the sum is blocked
instead: split time into ``n`` chunks of ``K ~ sqrt(T)`` steps and

1. inside each chunk, multiply by the ``K x K`` upper-triangular decay matrix
   ``D[t, s] = c^(s-t)`` (one batched matmul);
2. the chunk heads obey the same recurrence with decay ``c^K``: one ``n x n`` matmul;
3. add each chunk's carry ``c^(K-t) * head_{next chunk}``.

Every power is ``c^k`` with ``k >= 0`` (``0^0 = 1``), so ``c = 0`` and ``c = 1`` are exact
and nothing overflows. Cost ``O(B T sqrt(T))`` flops in a handful of kernels, against ``T``
Python iterations (``~5 T`` kernel launches) for the loop.

A matmul multiplies every entry by every coefficient, the zeros below the diagonal
included, so one inf ``delta_s`` would give ``0 * inf = NaN`` at every later step too. The
blocked sum therefore runs on the finite entries only, and the NaN / inf ones are added
afterwards where the recurrence puts them: at steps ``t <= s``.
"""

from __future__ import annotations

import math

import torch

from .kl import kl_estimate
from .reductions import acc_dtype

GROUP_NORMALIZE = ("std", "none")


def discounted_suffix_sum(x: torch.Tensor, decay: float) -> torch.Tensor:
    """``y_t = sum_{s >= t} decay^(s-t) x_s`` along dim 1 of a ``(B, T)`` tensor, blocked; a
    NaN / inf ``x_s`` reaches ``y_t`` for ``t <= s`` only, as in the recurrence.

    The NaN / inf entries ``nf`` (0 elsewhere) are added back as the recurrence ``y_t = x_t +
    decay * y_{t+1}`` would, step by step: ``nf_t + decay * sum_{s > t} nf_s``. The sum of
    infinities is NaN for opposite signs, and ``decay * inf`` is inf for any ``decay > 0``
    (however small ``decay^(s-t)``) and NaN for ``decay = 0``, exactly as in the loop."""
    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    nf = x - finite  # exactly 0 where x is finite
    y = _blocked_suffix_sum(finite, decay) + nf
    y[:, :-1] += decay * nf.flip(1).cumsum(1).flip(1)[:, 1:]
    return y


def _blocked_suffix_sum(x: torch.Tensor, decay: float) -> torch.Tensor:
    """``discounted_suffix_sum`` of a finite ``x``: the blocked matmuls of the module docs."""
    n_rows, length = x.shape
    if length == 0 or n_rows == 0:
        return x.clone()
    # ceil(sqrt(T)); a fixed 64 while torch.compile traces (T symbolic: no square root of
    # it is an int without a recompile for every length)
    chunk = 64 if torch.compiler.is_compiling() else max(1, math.isqrt(length - 1) + 1)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    # zero steps past the end add nothing to any suffix sum
    xs = torch.nn.functional.pad(x, (0, pad)).view(n_rows, n_chunks, chunk)

    def decay_matrix(size: int, step: int) -> torch.Tensor:
        k = torch.arange(size, device=x.device, dtype=torch.float64)
        lag = k[None, :] - k[:, None]  # s - t
        powers = torch.pow(decay, (lag * step).clamp(min=0))
        return torch.where(lag >= 0, powers, 0.0).to(x.dtype)

    local = xs @ decay_matrix(chunk, 1).T  # suffix sums inside each chunk
    heads = decay_matrix(n_chunks, chunk) @ local[:, :, 0].unsqueeze(-1)  # (B, n, 1)
    nxt = torch.nn.functional.pad(heads[:, 1:, 0], (0, 1))  # head of the following chunk
    k = torch.arange(chunk, device=x.device, dtype=torch.float64)
    tail = torch.pow(decay, chunk - k).to(x.dtype)  # c^(distance to the next chunk's head)
    out = local + nxt[:, :, None] * tail
    return out.reshape(n_rows, n_chunks * chunk)[:, :length]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``(B, T)``; seed 004's recursion, blocked (see above)."""
    dtype = acc_dtype(rewards, values)
    r = rewards.detach().to(dtype)
    v = values.detach().to(dtype)
    if mask is not None:
        m = mask != 0
        r = torch.where(m, r, 0.0)
        v = torch.where(m, v, 0.0)
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))  # next_value = 0 past the end
    delta = r + gamma * v_next - v
    adv = discounted_suffix_sum(delta, gamma * lam)
    ret = adv + v
    if mask is not None:
        adv = torch.where(m, adv, 0.0)
        ret = torch.where(m, ret, 0.0)
    return adv, ret


def last_counted_index(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64: the largest ``t`` with ``mask[b, t]``, or -1 for an empty row."""
    steps = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask != 0, steps, -1).amax(dim=1)


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_coef: float,
    mask: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    score_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T)`` rewards ``-kl_coef * kl_t`` (0 where masked) plus ``scores[b]`` at one step."""
    dtype = acc_dtype(scores, logprobs, ref_logprobs)
    n_rows, length = logprobs.shape
    kl = kl_estimate(logprobs.detach().to(dtype), ref_logprobs.detach().to(dtype), kl_estimator)
    rewards = -kl_coef * kl
    if mask is not None:
        rewards = torch.where(mask != 0, rewards, 0.0)
    if length == 0:
        return rewards
    if score_index is not None:
        where = score_index.to(torch.int64)
    elif mask is not None:
        where = last_counted_index(mask)
    else:
        where = torch.full((n_rows,), length - 1, dtype=torch.int64, device=logprobs.device)
    steps = torch.arange(length, device=logprobs.device)
    hit = steps[None, :] == where[:, None]
    return torch.where(hit, rewards + scores.detach().to(dtype)[:, None], rewards)


def _centred_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(G, group_size)`` scores minus their group mean, shifted by each group's first score
    first so a constant group centres to exactly 0."""
    x = scores.detach().to(acc_dtype(scores)).reshape(-1, group_size)
    d = x - x[:, :1]
    return d - d.mean(dim=1, keepdim=True)


def group_advantages(
    scores: torch.Tensor, group_size: int, normalize: str = "std", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO ``(s - mean_g) / (std_g + eps)`` (unbiased std), or ``s - mean_g`` for "none"."""
    if scores.numel() == 0:
        return scores.detach().to(acc_dtype(scores)).clone()
    c = _centred_groups(scores, group_size)
    if normalize == "std":
        var = c.square().sum(dim=1, keepdim=True) / max(group_size - 1, 1)
        # a score equal to its group mean gives 0, even for a constant group with eps = 0
        c = torch.where(c == 0, torch.zeros_like(c), c / (var.sqrt() + eps))
    return c.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``s_i - mean_{j != i} s_j`` within each group (``= n/(n-1) * (s_i - mean_g)``)."""
    if scores.numel() == 0:
        return scores.detach().to(acc_dtype(scores)).clone()
    c = _centred_groups(scores, group_size)
    return (c / ((group_size - 1) / group_size)).reshape(-1)
