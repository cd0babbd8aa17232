"""Reference log-probs under top-k / top-p truncation (plain PyTorch; it sorts).

The rules (``fused_rl.truncated_logprobs``'s docstring states them for users), on the
tempered logits ``z = x / T`` of one row:

* top-k: ``keep = z >= tau_k``, ``tau_k`` the k-th largest ``z`` (ties at ``tau_k`` kept);
* top-p over the kept set, probabilities renormalised over it: sorted descending, the
  crossing position ``c`` is the first whose cumulative probability reaches ``p``
  (``cumsum >= p``); ``keep &= z >= z_sorted[c]`` (a threshold: every token tied with
  the crossing one is kept, whatever order the sort gave the ties).

The log-prob is ``z_y - logsumexp(z[keep])`` where the target is kept, ``-inf`` with zero
gradient where it is not; autograd through the masked ``logsumexp`` gives the gradient
``(onehot - p_trunc) / T`` on the kept set and 0 elsewhere (the mask is a constant).
"""

from __future__ import annotations

import torch

from .logprobs import scaled
from .reductions import acc_dtype


@torch.no_grad()
def kth_largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest of each row of ``(..., V)`` logits, counted with multiplicity, as
    ``(...)`` fp32 (fp64 for fp64 logits); NaN for a row holding a NaN (``torch.topk`` would
    rank NaN above everything)."""
    kth = logits.topk(k, dim=-1).values[..., -1].to(acc_dtype(logits))
    return torch.where(logits.isnan().any(-1), float("nan"), kth)


@torch.no_grad()
def keep_mask(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Boolean ``(..., V)`` mask of the tokens the sampler keeps, from tempered logits
    ``z`` (rows without NaN / ``+inf``). ``top_k`` None or ``>= V``, ``top_p`` None or 1:
    that cut is off."""
    vocab = z.shape[-1]
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None and top_k < vocab:
        keep = z >= kth_largest(z, top_k).unsqueeze(-1)
    if top_p is not None and top_p < 1.0:
        zk = z.masked_fill(~keep, float("-inf"))
        z_sorted = zk.sort(dim=-1, descending=True).values
        cum = torch.softmax(z_sorted, dim=-1).cumsum(dim=-1)
        crossing = (cum < top_p).sum(-1, keepdim=True).clamp(max=vocab - 1)
        keep = keep & (zk >= z_sorted.gather(-1, crossing))
    return keep


def truncated_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    top_k: int | None,
    top_p: float | None,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """``log p_trunc(target)`` of ``targets.shape``, fp32 (fp64 for fp64 logits),
    differentiable w.r.t. ``logits``; ``softcap``: the soft cap ``c`` (``z = c tanh(x / c) /
    T``), None for none. Ignored targets: 0 with exactly 0 gradient (their
    row never enters the arithmetic); a row with a NaN / ``+inf`` logit or only ``-inf``
    ones: NaN with a NaN gradient row; a target outside ``[0, V)``: NaN."""
    dtype = acc_dtype(logits)
    vocab = logits.shape[-1]
    ignored = (targets == ignore_index)[..., None]
    x = torch.where(ignored, torch.zeros((), dtype=dtype, device=logits.device), logits.to(dtype))
    z = scaled(x, temperature, softcap)
    row_max = z.detach().amax(-1, keepdim=True)
    bad = ~torch.isfinite(row_max)  # NaN (amax keeps it), +inf, or only -inf
    keep = keep_mask(torch.where(bad, 0.0, z.detach()), top_k, top_p) | bad
    z = z + torch.where(bad, float("nan"), 0.0)  # a bad row is NaN through, gradient too
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    t = targets.long()
    in_range = (t >= 0) & (t < vocab)
    idx = t.clamp(0, vocab - 1)[..., None]
    z_y = z.gather(-1, idx)[..., 0]
    logp = torch.where(keep.gather(-1, idx)[..., 0], z_y - lse, float("-inf"))
    logp = torch.where(in_range, logp, float("nan"))
    return torch.where(ignored[..., 0], 0.0, logp)
