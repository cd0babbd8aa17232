"""The float64 oracle every provider's outputs are measured against.

Written in plain PyTorch from the math, independent of fused_rl's code (its reference
backend is measured against this like every other provider). The inputs are the case's own
values, possibly bf16, taken exactly into float64; the oracle is the exact math on them.

Vocabulary ops (``token_logprobs``, ``policy_loss``) never hold a float64 copy of the
``(B, T, V)`` logits: rows are streamed in chunks of ``CHUNK`` elements.

1. Per row ``s = z / tau``: ``lse``, the target's log-prob ``logp = s_y - lse`` and the
   entropy ``H = lse - sum_j p_j s_j`` (``p = exp(s - lse)``), saved per token.
2. The token-level loss runs in float64 with autograd on the ``(B, T)`` tensors ``logp`` and
   ``H``, giving ``g = dL/dlogp`` and ``h = dL/dH`` (for ``token_logprobs`` they are the
   case's upstream gradients).
3. A provider's ``dL/dz`` is compared chunk by chunk with the float64 row gradient
   ``dL/dz_j = (g (1[j = y] - p_j) - h p_j (log p_j + H)) / tau``, accumulating the RMS
   numerator / denominator and the worst row.

The exact KL to the reference (``policy_loss[grpo+fullkl]``): step 1 also streams the
reference's rows, giving per token ``KL_t = sum_j p_j (log p_j - log q_j)`` in float64
(:func:`full_kl64`; ``q = softmax(u / tau)`` of the reference's logits ``u``) and the
reference's ``lse``; the loss takes ``beta * KL_t`` as a leaf, so autograd gives
``c = dL/dKL_t`` beside ``g``, and step 3 adds ``c p_j (log p_j - log q_j - KL_t) / tau`` to
each row's gradient. A provider that computes another stated function of the same inputs
(``fused_rl_k3``: GRPO with the k3 estimate) is checked against that function's oracle
(``Oracle.by_provider``), never against the best match of several.

Truncated log-probs (``token_logprobs[k50]`` etc., ``cases.TRUNCATED_VARIANTS``): per block
of rows, the kept set in float64 from the rules' definitions (:func:`truncated_keep64`: top-k
keeps the values at or above the k-th largest; top-p, over the renormalised top-k set, the
values at or above the largest one whose upper set holds mass ``p``, whole tie groups
counted), ``logp = s_y - logsumexp(s over the kept set)`` and the gradient in closed form,
``g (onehot - p_kept) / tau`` on the kept set and 0 elsewhere (:func:`truncated_rows64`).

Linear ops (``linear_token_logprobs``, ``linear_policy_loss``) never hold the ``(N, V)``
logits in float64 either: the rows of ``z = h W^T`` are computed in float64 from float64
copies of ``hidden`` and ``weight``, a block of rows at a time, for steps 1 and 2; then each
block's ``dL/dz`` (the same row formula) gives ``dL/dH = dz W`` and ``dL/dW += dz^T h``, both
kept in float64 (a ``(V, H)`` float64 buffer, the only one the size of the lm_head). From a
16-bit head the oracle answers twice, on the exact logits and on the logits rounded to the
head's dtype (``LOGITS_DEFINITIONS``), and in the policy loss a token whose target logit
rounds either way in an fp32-accumulating GEMM (:func:`rounding_ambiguous64`) has its
hidden row left out, as a kink's.

Distillation ops (``distill_loss``, ``linear_distill_loss``): per block of rows, float64
``log_softmax`` of the student's and the teacher's logits (from hidden states: each built as
``h W^T`` in float64 first), the divergence of the case's beta per token and its gradient
in closed form (:func:`distill_rows64`), weighted by the token mean over the mask; from
hidden states the rows' gradient gives ``dL/dH = dz W`` and ``dL/dW += dz^T h`` as above.

The small token ops (``ppo_loss``, ``value_loss``, ``masked_whiten``, ``gae``) run whole in
float64, gradients by autograd.

Kinks. A clipped objective's gradient jumps where a ratio crosses a clip boundary (and a
clipped value loss's where ``|v - v_old|`` crosses the clip range or its ``max`` switches
branches). A token within ``KINK`` (relative) of one has two right answers a rounding apart,
so its gradient row is left out of the gradient comparison (``Comparison.excluded`` counts
them; a correct fp32 computation's ratio is off by ~1e-6 relative, well inside ``KINK``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .cases import (
    CISPO,
    DISTILL_BETAS,
    FULL_KL_VARIANTS,
    GAE,
    LOSS_AGG,
    POLICY,
    PPO,
    TEMPERATURE,
    TOPK_CLAMP,
    TRUNCATED_VARIANTS,
    VALUE_CLIP,
    Case,
    clip_bounds,
)

CHUNK = 1 << 25  # float64 elements per streamed block of logits rows (256 MB each)
SCALAR_FLOOR = 1e-2  # |a - b| / max(|b|, floor) for 0-dim outputs (a loss can sit near 0)
KINK = 1e-4  # relative distance to a clip boundary inside which a gradient is not compared


@dataclasses.dataclass
class Comparison:
    """One output of one provider against the oracle."""

    err: float  # RMS relative error ||out - ref|| / ||ref|| (inf: NaN or wrong shape)
    worst_row: float  # max_row ||out_row - ref_row|| / RMS_row ||ref_row||
    excluded: int = 0  # rows left out: at a kink of the objective
    # where the worst row is: (its index among the output's rows, ||ref_row|| / RMS_row
    # ||ref_row||), for the record (a big row's ordinary rounding, or a wrong one); None for
    # 0-dim outputs and the streamed gradient comparisons
    worst_at: tuple[int, float] | None = None


# ----------------------------------------------------------------------------- metrics


def _ratio(num: float, den: float) -> float:
    if num != num or math.isinf(num):  # NaN / inf anywhere
        return float("inf")
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS relative error ``||out - ref|| / ||ref||`` in float64, in chunks of ``CHUNK``
    elements; 0-dim: ``|out - ref| / max(|ref|, SCALAR_FLOOR)``. NaN or a shape mismatch: inf."""
    if out.shape != ref.shape:
        return float("inf")
    if out.dim() == 0:
        diff = (out.double() - ref.double()).abs().item()
        return float("inf") if diff != diff else diff / max(abs(ref.double().item()), SCALAR_FLOOR)
    flat_out, flat_ref = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for k in range(0, flat_ref.numel(), CHUNK):
        a, b = flat_out[k : k + CHUNK].double(), flat_ref[k : k + CHUNK].double()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    return _ratio(num, den)


def row_errors(out: torch.Tensor, ref: torch.Tensor, own_rows: bool = False):
    """``(worst, index, norm)`` over the last dimension's rows: ``worst`` as
    :func:`worst_row_err` (``own_rows``: :func:`worst_own_row_err`), the worst row's index
    and its ``||ref_row||`` over the RMS row norm."""
    if out.dim() == 0:
        return 0.0, -1, 0.0
    if out.shape != ref.shape:
        return float("inf"), -1, 0.0
    a2d, b2d = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    step = max(1, CHUNK // max(a2d.shape[1], 1))
    rows = max(a2d.shape[0], 1)
    mean_sq = sum(b2d[k : k + step].double().square().sum().item()
                  for k in range(0, b2d.shape[0], step)) / rows  # fmt: skip
    worst, at, at_sq = 0.0, -1, 0.0
    for k in range(0, a2d.shape[0], step):
        a, b = a2d[k : k + step].double(), b2d[k : k + step].double()
        ref_sq = b.square().sum(-1)
        err_sq = (a - b).square().sum(-1)
        if own_rows:
            err_sq = err_sq / ref_sq.clamp(min=max(mean_sq, 1e-300))
        j = int(err_sq.argmax())
        if at < 0 or not err_sq[j].item() <= worst:  # NaN is the worst
            worst, at, at_sq = err_sq[j].item(), k + j, ref_sq[j].item()
    norm = math.sqrt(at_sq / mean_sq) if mean_sq > 0 else 0.0
    return _ratio(worst, 1.0 if own_rows else mean_sq), at, norm


def worst_row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max_row ||out_row - ref_row|| / RMS_row ||ref_row||`` over the last dimension's rows:
    one wrong token among 32768 moves :func:`rel_err` by only 0.5%, but this by ~100%.
    0 for 0-dim outputs (``rel_err`` covers them)."""
    return row_errors(out, ref)[0]


def worst_own_row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max_row ||out_row - ref_row|| / max(||ref_row||, RMS_row ||ref_row||)``: each row
    against its own norm, floored at the RMS row norm. For rows of very different norms by
    nature: ``grad_weight``'s vocabulary rows, of which a target token's is ~1/p larger than
    the rest (with fewer tokens than V most rows get none), where :func:`worst_row_err`
    would hold a big row's ordinary rounding against the typical row's norm."""
    return row_errors(out, ref, own_rows=True)[0]


def compare(
    out: torch.Tensor, ref: torch.Tensor, kink: torch.Tensor | None = None, own_rows=False
) -> Comparison:
    """``out`` against the float64 ``ref``; positions where ``kink`` is True are left out;
    ``own_rows``: the worst row by :func:`worst_own_row_err`."""
    excluded = 0
    if kink is not None and out.shape == ref.shape and bool(kink.any()):
        excluded = int(kink.sum())
        out, ref = out.double().masked_fill(kink, 0.0), ref.masked_fill(kink, 0.0)
    row, at, norm = row_errors(out, ref, own_rows and out.dim() > 0)
    return Comparison(rel_err(out, ref), row, excluded, (at, norm) if at >= 0 else None)


def _near(x: torch.Tensor, points, tol: float = KINK) -> torch.Tensor:
    """``x`` within ``tol`` (absolute) of any of ``points``."""
    hit = torch.zeros_like(x, dtype=torch.bool)
    for p in points:
        hit |= (x - p).abs() < tol
    return hit


# ----------------------------------------------------------------------------- vocab ops


def _copy64(x: torch.Tensor) -> torch.Tensor:
    """A float64 copy (never the input itself, even when it is float64: it is written to)."""
    return x.to(torch.float64, copy=True)


def _row_blocks(logits: torch.Tensor):
    """``(b, t0, t1)`` blocks of rows of the ``(B, T, V)`` logits, ~``CHUNK`` elements each
    (a row per block at least); ``logits[b, t0:t1]`` is a view, never a copy."""
    batch, seqlen, vocab = logits.shape
    rows = max(1, CHUNK // max(vocab, 1))
    for b in range(batch):
        for t0 in range(0, seqlen, rows):
            yield b, t0, min(seqlen, t0 + rows)


def token_stats64(logits: torch.Tensor, targets: torch.Tensor, tau: float = TEMPERATURE):
    """Per-token float64 ``(logp, entropy, lse)`` of ``softmax(logits / tau)``, ``(B, T)``
    each, streaming the logits in blocks of rows."""
    batch, seqlen, _ = logits.shape
    shape = dict(dtype=torch.float64, device=logits.device)
    logp, entropy, lse = (torch.empty(batch, seqlen, **shape) for _ in range(3))
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            s = _copy64(logits[b, t0:t1])
            if tau != 1.0:
                s /= tau
            top = s.amax(-1, keepdim=True)
            s -= top  # shifted: s_j - max_j s_j (two float64 blocks at most below)
            p = s.exp()
            log_sum = p.sum(-1, keepdim=True).log()
            p /= log_sum.exp()
            lse[b, t0:t1] = (top + log_sum)[:, 0]
            logp[b, t0:t1] = (s.gather(-1, targets[b, t0:t1, None]) - log_sum)[:, 0]
            entropy[b, t0:t1] = log_sum[:, 0] - p.mul_(s).sum(-1)  # shift-invariant
    return logp, entropy, lse


def diagnostics64(logits: torch.Tensor, targets: torch.Tensor, tau: float = TEMPERATURE):
    """Per-token float64 ``(mean logit, log sum p^2, is_top1 as 0 / 1)`` of
    ``softmax(logits / tau)``, ``(B, T)`` each (the top-1 flag: the argmax of the logits
    as given, the lowest id of a tie), streaming the logits in blocks of rows."""
    batch, seqlen, _ = logits.shape
    shape = dict(dtype=torch.float64, device=logits.device)
    mean, log_sq, top1 = (torch.empty(batch, seqlen, **shape) for _ in range(3))
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            x = logits[b, t0:t1]
            top1[b, t0:t1] = (x.argmax(-1) == targets[b, t0:t1]).double()
            s = _copy64(x)
            if tau != 1.0:
                s /= tau
            mean[b, t0:t1] = s.mean(-1)
            log_sq[b, t0:t1] = torch.logsumexp(2 * torch.log_softmax(s, -1), -1)
    return mean, log_sq, top1


def full_kl64(logits: torch.Tensor, ref_logits: torch.Tensor, tau: float = TEMPERATURE):
    """Per-token float64 ``(KL(p || q), lse of q)``, ``(B, T)`` each, of the policy's
    ``p = softmax(logits / tau)`` and the reference's ``q = softmax(ref_logits / tau)``,
    ``KL = sum_j p_j (log p_j - log q_j)``, streaming both in blocks of rows."""
    batch, seqlen, _ = logits.shape
    kl, ref_lse = (torch.empty(batch, seqlen, dtype=torch.float64, device=logits.device)
                   for _ in range(2))  # fmt: skip
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            log_p = torch.log_softmax(_copy64(logits[b, t0:t1]).div_(tau), dim=-1)
            u = _copy64(ref_logits[b, t0:t1]).div_(tau)
            lse_u = torch.logsumexp(u, dim=-1, keepdim=True)
            ref_lse[b, t0:t1] = lse_u[:, 0]
            log_ratio = u.sub_(lse_u).neg_().add_(log_p)  # log p - log q
            kl[b, t0:t1] = log_p.exp_().mul_(log_ratio).sum(-1)
    return kl, ref_lse


def compare_vocab_grad(out, logits, targets, lse, entropy, g, h, kink=None, tau=TEMPERATURE,
                       full_kl=None):  # fmt: skip
    """A provider's ``(B, T, V)`` gradient ``out`` against the float64 one,
    ``(g (onehot - p) - h p (log p + H)) / tau`` per row, block by block (never a float64
    copy of the whole); rows where ``kink`` is True are left out. ``full_kl``: ``(ref_logits,
    ref_lse, kl, c)`` of a loss with ``c_t KL_t`` (:func:`full_kl64`), whose row gradient
    ``c p (log p - log q - KL) / tau`` is added."""
    if out.shape != logits.shape:
        return Comparison(float("inf"), float("inf"))
    num = den = worst = 0.0
    excluded = 0 if kink is None else int(kink.sum())
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            s = _copy64(logits[b, t0:t1])
            if tau != 1.0:
                s /= tau
            logp_all = s.sub_(lse[b, t0:t1, None])
            p = logp_all.exp()
            kl_term = None
            if full_kl is not None:
                ref_logits, ref_lse, kl, c = full_kl
                log_q = _copy64(ref_logits[b, t0:t1])
                if tau != 1.0:
                    log_q /= tau
                log_q.sub_(ref_lse[b, t0:t1, None])
                kl_term = log_q.neg_().add_(logp_all).sub_(kl[b, t0:t1, None])
                kl_term.mul_(p).mul_(c[b, t0:t1, None])
            gb, hb = g[b, t0:t1, None], h[b, t0:t1, None]
            ref = logp_all.add_(entropy[b, t0:t1, None]).mul_(-hb).sub_(gb).mul_(p)
            del p
            if kl_term is not None:
                ref.add_(kl_term)
                del kl_term
            ref.scatter_add_(-1, targets[b, t0:t1, None], gb)
            if tau != 1.0:
                ref /= tau
            if kink is not None:
                ref.masked_fill_(kink[b, t0:t1, None], 0.0)
            diff = _copy64(out[b, t0:t1]).sub_(ref)
            if kink is not None:
                diff.masked_fill_(kink[b, t0:t1, None], 0.0)
            row_sq = diff.square_().sum(-1)
            num += row_sq.sum().item()
            worst = max(worst, row_sq.max().item())
            den += ref.square_().sum().item()
    rows = logits.shape[0] * logits.shape[1]
    return Comparison(_ratio(num, den), _ratio(worst, den / max(rows, 1)), excluded)


def _window64(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The ``(N, H)`` rows of the ``(B, S, H)`` hidden states that predict the ``(B, T)``
    targets (positions ``S-T-1 ... S-2``), in float64."""
    batch, positions, size = hidden.shape
    length = targets.shape[1]
    rows = hidden.detach()[:, positions - length - 1 : positions - 1]
    return rows.to(torch.float64).reshape(batch * length, size)


def _linear_blocks(n_rows: int, vocab: int):
    """Slices of ~``CHUNK`` logits elements (a row at least) over ``n_rows`` rows."""
    step = max(1, CHUNK // max(vocab, 1))
    for r0 in range(0, n_rows, step):
        yield slice(r0, min(n_rows, r0 + step))


def _logits64(h64: torch.Tensor, w64: torch.Tensor, logits_dtype=None) -> torch.Tensor:
    """A block of float64 logits ``h W^T``, rounded to ``logits_dtype`` when given (what a
    16-bit GEMM returns; :data:`LOGITS_DEFINITIONS`)."""
    z = h64 @ w64.T
    return z if logits_dtype is None else z.to(logits_dtype).to(torch.float64)


def _linear_rows64(hidden, weight, targets, per_block, logits_dtype=None):
    """``per_block(z, t)`` (a tuple of ``(n,)`` float64 tensors) over blocks of the float64
    logits ``z = hidden W^T`` (rounded to ``logits_dtype`` when given) of the rows that
    predict the ``(B, T)`` targets (``t``: the block's targets), assembled into ``(B, T)``
    tensors."""
    h64, w64 = _window64(hidden, targets), weight.detach().to(torch.float64)
    flat = targets.reshape(-1)
    out = None
    with torch.no_grad():
        for rows in _linear_blocks(h64.shape[0], w64.shape[0]):
            parts = per_block(_logits64(h64[rows], w64, logits_dtype), flat[rows])
            if out is None:
                out = [torch.empty(flat.shape[0], dtype=torch.float64, device=h64.device)
                       for _ in parts]  # fmt: skip
            for dst, src in zip(out, parts):
                dst[rows] = src
    return tuple(x.view(targets.shape) for x in out)


def linear_stats64(hidden, weight, targets, tau: float = TEMPERATURE, logits_dtype=None):
    """Per-token float64 ``(logp, entropy, lse)`` of ``softmax(hidden W^T / tau)`` for the
    ``(B, T)`` targets, block by block of rows (see :func:`token_stats64`); the logits
    rounded to ``logits_dtype`` when given."""

    def per_block(z, t):
        return [x[0] for x in token_stats64(z[None], t[None], tau)]

    return _linear_rows64(hidden, weight, targets, per_block, logits_dtype)


def linear_diagnostics64(hidden, weight, targets, tau: float = TEMPERATURE):
    """:func:`diagnostics64` of ``hidden W^T`` for the ``(B, T)`` targets, block by block of
    rows; the top-1 flag ranks those logits rounded to the hidden states' dtype, as every
    provider's GEMM returns them (a near-tie the rounding makes a tie is one in all)."""

    def per_block(z, t):
        mean, log_sq, _ = diagnostics64(z[None], t[None], tau)
        return mean[0], log_sq[0], (z.to(hidden.dtype).argmax(-1) == t).double()

    return _linear_rows64(hidden, weight, targets, per_block)


def linear_grads64(hidden, weight, targets, lse, entropy, g, h, tau: float = TEMPERATURE,
                   logits_dtype=None):  # fmt: skip
    """Float64 ``(dL/dhidden, dL/dweight)`` given ``g = dL/dlogp`` and ``h = dL/dentropy``:
    per block of rows ``dz = (g (onehot - p) - h p (log p + H)) / tau`` (``z`` recomputed,
    rounded to ``logits_dtype`` when given), ``dH = dz W``, ``dW += dz^T h``. ``dL/dhidden``
    has ``hidden``'s shape (zero at the positions that predict no target)."""
    h64, w64 = _window64(hidden, targets), weight.detach().to(torch.float64)
    flat = targets.reshape(-1)
    lse, entropy, g, h = (x.reshape(-1, 1) for x in (lse, entropy, g, h))
    d_rows = torch.empty_like(h64)
    d_weight = torch.zeros_like(w64)
    with torch.no_grad():
        for rows in _linear_blocks(h64.shape[0], w64.shape[0]):
            logp_all = _logits64(h64[rows], w64, logits_dtype).div_(tau).sub_(lse[rows])
            p = logp_all.exp()
            dz = logp_all.add_(entropy[rows]).mul_(-h[rows]).sub_(g[rows]).mul_(p)
            del p
            dz.scatter_add_(-1, flat[rows, None], g[rows])
            dz /= tau
            d_rows[rows] = dz @ w64
            d_weight.addmm_(dz.T, h64[rows])
            del dz
    batch, positions, size = hidden.shape
    length = targets.shape[1]
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float64, device=h64.device)
    d_hidden[:, positions - length - 1 : positions - 1] = d_rows.view(batch, length, size)
    return d_hidden, d_weight


AMBIGUOUS_SPREAD = 4  # fp32 accumulation spreads within which a rounding can go either way


def rounding_ambiguous64(hidden, weight, targets, dtype) -> torch.Tensor:
    """``(B, T)`` bool: the tokens whose target logit ``z = h . w_y`` has two right roundings
    to the 16-bit ``dtype``: its float64 value within ``AMBIGUOUS_SPREAD`` times an fp32
    accumulation's spread (``2^-24 sqrt(H) ||h * w_y||``) of the midpoint between two
    ``dtype`` values, where ``|z| >= 1``. A GEMM accumulating in fp32 may round such a logit
    either way, a unit in the last place apart (0.03 at ``|z|`` = 4 in bf16), which moves
    the token's log-prob by that much and so its whole policy-gradient row through the
    ratio; below ``|z|`` = 1 a unit moves it by at most ``eps(dtype)``."""
    h64, w = _window64(hidden, targets), weight.detach()
    flat = targets.reshape(-1)
    eps = torch.finfo(dtype).eps  # a unit in the last place of [1, 2)
    out = torch.empty(flat.shape[0], dtype=torch.bool, device=h64.device)
    step = max(1, CHUNK // max(h64.shape[1], 1))
    for r0 in range(0, flat.shape[0], step):
        rows = slice(r0, r0 + step)
        prod = h64[rows] * w[flat[rows].clamp(min=0)].to(torch.float64)
        mag = prod.sum(-1).abs()
        spread = AMBIGUOUS_SPREAD * 2.0**-24 * math.sqrt(h64.shape[1]) * prod.norm(dim=-1)
        ulp = torch.exp2(torch.floor(torch.log2(mag.clamp(min=1.0)))) * eps
        to_midpoint = ((mag / ulp).remainder(1.0) - 0.5).abs() * ulp
        out[rows] = (mag >= 1.0) & (to_midpoint < spread) & (flat[rows] >= 0)
    return out.view(targets.shape)


def policy_loss64(
    logp, entropy, advantages, old, ref, mask, variant: str, is_weights=None, kl=None
):
    """The benchmark's policy objective in float64 from the math, per variant:

    * ``grpo`` / ``grpo+entropy`` / ``grpo+is``: ``max(-A r, -A clip(r, 1 - eps_low,
      1 + eps_high))`` of the token ratio ``r``, per-sequence advantages ``A``;
    * ``gspo``: the same of the sequence ratio (the exp of the sequence's mean log-ratio);
    * ``cispo``: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp``, ``CISPO``'s band;
    * ``gmpo``: ``-A exp(mean over the sequence of c)``, ``c`` each token's log-ratio ``d``
      clipped in log space on its advantage's side: ``min(d, clip(d, -eps_low, eps_high))``
      where ``A > 0``, ``max(...)`` where ``A < 0``, 0 where ``A = 0``;

    times ``is_weights`` when given (the policy term only), plus ``beta`` times the k3
    estimate of KL(pi || pi_ref) from ``ref`` or, given ``kl`` (``grpo+fullkl``), that exact
    per-token KL, minus ``entropy_coef`` times the entropy
    (``grpo+entropy``); token-mean over the mask (``gmpo``: the mean over sequences of each
    one's token mean). Returns ``(loss, log_ratio)``: the log-ratio whose crossing of
    :func:`bench.cases.clip_bounds` is a kink (GSPO's: the sequence's)."""
    m = mask.bool()
    count = m.sum()
    adv = advantages[:, None]
    log_ratio = logp - old
    if variant == "gmpo":
        c = log_ratio.clamp(-POLICY["eps_low"], POLICY["eps_high"])
        # c where the clip binds on the advantage's side (frozen: no gradient), else d
        frozen = torch.where(adv > 0, log_ratio > c, torch.where(adv < 0, log_ratio < c, False))
        c = torch.where(frozen, c.detach(), log_ratio)
        c = torch.where(adv == 0, 0.0, c)
        n = m.sum(-1).clamp(min=1)
        seq = torch.where(m, c, 0.0).sum(-1) / n
        policy = (-advantages * seq.exp())[:, None].expand_as(logp)
    elif variant == "cispo":
        low, high = 1.0 - CISPO["eps_low"], 1.0 + CISPO["eps_high"]
        policy = -adv * log_ratio.exp().clamp(low, high).detach() * logp
    else:
        if variant == "gspo":
            per_seq = torch.where(m, log_ratio, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
            log_ratio = per_seq[:, None].expand_as(logp)
        ratio = log_ratio.exp()
        low, high = 1.0 - POLICY["eps_low"], 1.0 + POLICY["eps_high"]
        policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    if is_weights is not None:
        policy = policy * is_weights
    if kl is None:
        d = ref - logp
        kl = d.exp() - d - 1.0
    per_token = policy + POLICY["beta"] * kl
    if variant == "grpo+entropy":
        per_token = per_token - POLICY["entropy_coef"] * entropy
    if LOSS_AGG.get(variant, "token-mean") == "seq-mean-token-mean":
        per_seq = torch.where(m, per_token, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.mean(), log_ratio
    return torch.where(m, per_token, 0.0).sum() / count, log_ratio


# ----------------------------------------------------------------------------- distillation


def distill_rows64(s: torch.Tensor, u: torch.Tensor, beta: float, tau: float = TEMPERATURE):
    """``(d, grad)`` for float64 rows of student logits ``s`` and teacher logits ``u``
    (``(n, V)`` each): per row the divergence ``d`` of TRL's ``generalized_jsd_loss`` between
    the student's ``p = softmax(s / tau)`` and the teacher's ``q = softmax(u / tau)``, and
    ``grad = dd/ds`` (``(n, V)``):

    * ``beta == 0``: ``d = KL(q || p) = sum q (log q - log p)``, ``grad = (p - q) / tau``;
    * ``beta == 1``: ``d = KL(p || q) = sum p r`` with ``r = log p - log q``,
      ``grad = p (r - d) / tau``;
    * else, with ``m = (1 - beta) p + beta q`` and ``a = log p - log m``:
      ``d = beta KL(q || m) + (1 - beta) KL(p || m)``; ``dd/dp_j = (1 - beta) a_j`` (the
      mixture's own terms cancel), so through the softmax
      ``grad = (1 - beta) p (a - KL(p || m)) / tau``."""
    log_p = torch.log_softmax(s / tau, dim=-1)
    log_q = torch.log_softmax(u / tau, dim=-1)
    p = log_p.exp()
    if beta == 0.0:
        q = log_q.exp()
        return (q * (log_q - log_p)).sum(-1), (p - q) / tau
    if beta == 1.0:
        r = log_p - log_q
        d = (p * r).sum(-1)
        return d, p * (r - d[:, None]) / tau
    log_m = torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
    a = log_p - log_m
    kl_pm = (p * a).sum(-1)
    d = beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1.0 - beta) * kl_pm
    return d, (1.0 - beta) * p * (a - kl_pm[:, None]) / tau


# The ops from 16-bit hidden states have two exact definitions, and a provider is checked
# against the one its outputs match best (the record's note names it): the loss of the
# logits the inputs define, and the loss of those logits rounded to the inputs' dtype, which
# is what ``F.linear`` returns and so what fused_rl's ops (by their definition, the logits
# op of ``F.linear(...)``), the materialised and the eager paths compute. The two differ by
# far more than the bf16 tolerance in places: the rounding of a logit, ``2^-9 |z|``
# relative, moves a token's probability (``linear_distill_loss``: ~1.7% at z = 9, the
# largest of 151936 logits of deviation 2, and nothing in the divergence's gradient dwarfs
# it) and a target's log-prob, which scales the token's whole policy-gradient row through
# the ratio (``linear_policy_loss``: one row 2.2% off its own norm at 16384 tokens on an
# H200, fused_rl and the materialised path alike, with cuBLAS's exact reductions too).
# Either match is exact math of a stated function; wrong math matches neither.
LOGITS_DEFINITIONS = {
    None: "the exact logits",
    torch.bfloat16: "the logits rounded to bf16, as F.linear returns them",
    torch.float16: "the logits rounded to fp16, as F.linear returns them",
}


# what ``Oracle.by_provider``'s functions are, for the record's note ("the loss of ...")
PROVIDER_DEFINITIONS = {
    "fused_rl_k3": "GRPO with the k3 estimate of the KL from the reference's log-prob of "
    "each target, on the same inputs",
}


def _token_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """float64 ``m_t / sum(m)``: the token mean over the mask as per-token weights."""
    m = mask.to(torch.float64)
    return m / m.sum()


def topk_distill_rows64(s: torch.Tensor, lt: torch.Tensor, ids: torch.Tensor, clamp: float):
    """``(d, grad)`` for float64 rows of student logits ``s`` ``(n, V)``, the teacher's top-K
    log-probs ``lt`` and ids ``ids`` ``(n, K)``: verl's top-k forward KL
    ``d = sum_k p_k (lt_k - ls_k)`` with ``ls = log_softmax(s)`` at ``ids``, both clamped
    below at ``clamp``, ``p = exp(clamped lt)``; ``grad = dd/ds = q W - scatter(w)`` with
    ``q = softmax(s)``, ``w_k = p_k`` where ``ls_k >= clamp`` (``clamp_min`` passes the
    gradient there) else 0, ``W = sum_k w_k``."""
    log_q = torch.log_softmax(s, dim=-1)
    ls = log_q.gather(-1, ids)
    lt = lt.clamp_min(clamp)
    p = lt.exp()
    d = (p * (lt - ls.clamp_min(clamp))).sum(-1)
    w = torch.where(ls >= clamp, p, 0.0)
    grad = log_q.exp_().mul_(w.sum(-1, keepdim=True)).scatter_add_(-1, ids, -w)
    return d, grad


def topk_overlap64(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """``sum_t weights[t] c_t``: ``c_t`` the count of the teacher's ids ``ids[t]`` ``(K,)``
    whose student logit reaches the row's K-th largest (verl's overlap diagnostic; a tie
    with the K-th counts), row block by row block."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            s = _copy64(logits[b, t0:t1])
            kth = s.topk(ids.shape[-1], dim=-1).values[..., -1:]
            count = (s.gather(-1, ids[b, t0:t1]) >= kth).sum(-1).to(torch.float64)
            total += (count * weights[b, t0:t1]).sum()
    return total


def compare_distill_grad(out, logits, weights, rows64):
    """A provider's ``(B, T, V)`` gradient of a row-local objective ``out`` (a distillation
    loss, truncated log-probs under their upstream gradient) against the float64 one,
    ``weights[t] * grad`` of ``rows64(b, t0, t1) -> (d, grad)`` (the rows ``t0:t1`` of
    sequence ``b``: :func:`distill_rows64`, :func:`topk_distill_rows64`,
    :func:`truncated_rows64`), block by block (never a float64 copy of the whole)."""
    if out.shape != logits.shape:
        return Comparison(float("inf"), float("inf"))
    num = den = worst = 0.0
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            _, ref = rows64(b, t0, t1)
            ref.mul_(weights[b, t0:t1, None])
            row_sq = _copy64(out[b, t0:t1]).sub_(ref).square_().sum(-1)
            num += row_sq.sum().item()
            worst = max(worst, row_sq.max().item())
            den += ref.square_().sum().item()
    rows = logits.shape[0] * logits.shape[1]
    return Comparison(_ratio(num, den), _ratio(worst, den / max(rows, 1)))


def truncated_keep64(s: torch.Tensor, top_k: int | None = None, top_p: float | None = None):
    """Boolean ``(n, V)`` mask of the tokens a sampler keeps of float64 rows ``s`` ``(n, V)``
    of tempered logits, from the rules' definitions (``fused_rl.truncated_logprobs``):

    * top-k: ``s >= tau_k``, ``tau_k`` the k-th largest value counted with multiplicity
      (``None`` or ``k >= V``: no cut);
    * top-p, over the top-k set renormalised: ``s >= v*``, ``v*`` the largest kept value
      whose upper set ``{s >= v*}`` holds probability ``>= p`` (``None`` or ``1``: no cut).
      Each sorted position's upper-set mass is the cumulative sum at the LAST position tied
      with it, so a tie group counts whole and no sort order of ties decides."""
    vocab = s.shape[-1]
    keep = torch.ones_like(s, dtype=torch.bool)
    cut_k = top_k is not None and top_k < vocab
    cut_p = top_p is not None and top_p < 1.0
    if not (cut_k or cut_p):
        return keep
    desc = s.sort(dim=-1, descending=True).values
    if cut_k:
        kth = desc[:, top_k - 1 : top_k]
        keep = s >= kth
        desc.masked_fill_(desc < kth, float("-inf"))  # still descending
    if cut_p:
        cum = torch.softmax(desc, dim=-1).cumsum_(dim=-1)
        ascending = desc.neg_()  # -s ascending: the ties of a value end where it is passed
        last_tied = torch.searchsorted(ascending, ascending, right=True).sub_(1)
        upper = cum.gather(-1, last_tied)
        first = (upper < top_p).sum(-1, keepdim=True).clamp_(max=vocab - 1)
        keep &= s >= ascending.gather(-1, first).neg_()
    return keep


def truncated_rows64(x: torch.Tensor, targets: torch.Tensor, top_k: int | None = None,
                     top_p: float | None = None, tau: float = TEMPERATURE):  # fmt: skip
    """``(logp, grad)`` of float64 logits rows ``x`` ``(n, V)`` and ``targets`` ``(n,)``
    under the sampler's truncation, ``s = x / tau``: ``logp = s_y - logsumexp(s over the
    kept set)`` ``(n,)`` (``-inf`` for a target cut off) and ``grad = d logp / dx``
    ``(n, V)``, ``(onehot_y - p_kept) / tau`` on the kept set, 0 elsewhere (the kept set is
    piecewise constant in the logits), and 0 for a row whose target is cut off (its log-prob
    is the constant -inf)."""
    s = x / tau if tau != 1.0 else x
    keep = truncated_keep64(s, top_k, top_p)
    log_p = s.masked_fill(~keep, float("-inf"))
    log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
    t = targets[:, None]
    kept = keep.gather(-1, t)
    logp = torch.where(kept, log_p.gather(-1, t), float("-inf"))[:, 0]
    grad = log_p.exp_().neg_().scatter_add_(-1, t, torch.ones_like(log_p[:, :1]))
    grad.masked_fill_(~kept, 0.0)
    return logp, grad / tau if tau != 1.0 else grad


def distill_loss64(logits, weights, rows64):
    """The float64 distillation loss ``sum_t weights[t] d_t`` over ``(B, T, V)`` logits,
    streamed in blocks of rows (``rows64`` as :func:`compare_distill_grad`'s)."""
    batch, seqlen, _ = logits.shape
    d = torch.empty(batch, seqlen, dtype=torch.float64, device=logits.device)
    with torch.no_grad():
        for b, t0, t1 in _row_blocks(logits):
            d[b, t0:t1] = rows64(b, t0, t1)[0]
    return torch.where(weights != 0, d * weights, 0.0).sum()


def linear_distill64(hidden, weight, t_hidden, t_weight, weights, beta, grads: bool,
                     tau: float = TEMPERATURE, logits_dtype=None):  # fmt: skip
    """``(loss, dL/dhidden, dL/dweight)`` in float64 of the distillation loss of
    ``hidden W^T`` against ``t_hidden W_t^T`` (no causal shift: row t of each), a block of
    rows at a time: the logits in float64 (rounded to ``logits_dtype`` when given, as a GEMM
    with outputs in that dtype returns them), :func:`distill_rows64`, ``dz = weights[t] *
    grad``, ``dH = dz W``, ``dW += dz^T h``. Without ``grads`` the two are None."""
    size, t_size = hidden.shape[-1], t_hidden.shape[-1]
    h64 = hidden.detach().to(torch.float64).reshape(-1, size)
    th64 = t_hidden.detach().to(torch.float64).reshape(-1, t_size)
    w64, tw64 = weight.detach().to(torch.float64), t_weight.detach().to(torch.float64)
    w_flat = weights.reshape(-1)
    loss = torch.zeros((), dtype=torch.float64, device=h64.device)
    d_rows = torch.zeros_like(h64) if grads else None
    d_weight = torch.zeros_like(w64) if grads else None
    with torch.no_grad():
        for rows in _linear_blocks(h64.shape[0], w64.shape[0]):
            z, u = h64[rows] @ w64.T, th64[rows] @ tw64.T
            if logits_dtype is not None:
                z, u = (x.to(logits_dtype).to(torch.float64) for x in (z, u))
            d, g = distill_rows64(z, u, beta, tau)
            del z, u
            wr = w_flat[rows]
            loss += torch.where(wr != 0, d * wr, 0.0).sum()
            if grads:
                dz = g.mul_(wr[:, None])
                d_rows[rows] = dz @ w64
                d_weight.addmm_(dz.T, h64[rows])
            del d, g
    d_hidden = None if d_rows is None else d_rows.view(hidden.shape)
    return loss, d_hidden, d_weight


# ----------------------------------------------------------------------------- token ops


def _f64(x: torch.Tensor, grad: bool = False) -> torch.Tensor:
    return x.detach().double().requires_grad_(grad)


def _clipped_value_sq(v, v_old, ret, clip):
    """``max((v - R)^2, (clip(v) - R)^2)`` and where its gradient has a kink."""
    clipped = torch.clamp(v, v_old - clip, v_old + clip)
    a, b = (v - ret).square(), (clipped - ret).square()
    gap = (v - v_old).abs().detach()
    was_clipped = gap > clip
    switch = (a - b).abs().detach() < KINK * torch.maximum(a, b).detach().clamp(min=1e-30)
    return torch.maximum(a, b), _near(gap, [clip]) | (was_clipped & switch)


def ppo_loss64(inp: dict, fwd_bwd: bool):
    """torchtune's ``PPOLoss`` with padding masks (the 5-tuple) and the gradients w.r.t. the
    policy log-probs and values, plus the kinks of each gradient."""
    eps, clip, coeff = PPO["epsilon"], PPO["value_clip_range"], PPO["value_coeff"]
    pi_old, adv = _f64(inp["pi_old_logprobs"]), _f64(inp["advantages"])
    pi, phi = _f64(inp["pi_logprobs"], fwd_bwd), _f64(inp["phi_values"], fwd_bwd)
    phi_old, ret = _f64(inp["phi_old_values"]), _f64(inp["returns"])
    pm, vm = inp["padding_masks"].bool(), inp["value_padding_masks"].bool()

    def masked_mean(x, m):  # torchtune: sum(x * m) / (sum(m) + 1e-8)
        return torch.where(m, x, 0.0).sum() / (m.sum() + 1e-8)

    ratios_mean = (pi - pi_old).exp().mean()
    log_ratio = torch.where(pm, pi - pi_old, 0.0)
    ratio = log_ratio.exp()
    a = torch.where(pm, adv, 0.0)
    clipped, unclipped = -a * ratio.clamp(1.0 - eps, 1.0 + eps), -a * ratio
    clipfrac = masked_mean((clipped > unclipped).double(), pm)
    policy = masked_mean(torch.maximum(clipped, unclipped), pm)
    zero = lambda x: torch.where(vm, x, 0.0)  # noqa: E731
    sq, value_kink = _clipped_value_sq(zero(phi), zero(phi_old), zero(ret), clip)
    value = 0.5 * masked_mean(sq, vm)
    loss = policy + coeff * value
    outs = {"loss": loss, "policy_loss": policy, "value_loss": value,
            "ratios_mean": ratios_mean, "clipfrac": clipfrac}  # fmt: skip
    kinks = {}
    if fwd_bwd:
        g_pi, g_phi = torch.autograd.grad(loss, [pi, phi])
        outs.update(grad_pi_logprobs=g_pi, grad_phi_values=g_phi)
        bounds = [math.log(1.0 - eps), math.log(1.0 + eps)]
        kinks = {"grad_pi_logprobs": pm & _near(log_ratio.detach(), bounds),
                 "grad_phi_values": vm & value_kink}  # fmt: skip
    return outs, kinks


def value_loss64(inp: dict, fwd_bwd: bool):
    """Seed 004's clipped value loss, ``0.5 * max(...)`` token-mean over the mask."""
    m = inp["mask"].bool()
    v = _f64(inp["values"], fwd_bwd)
    zero = lambda x: torch.where(m, x, 0.0)  # noqa: E731
    sq, kink = _clipped_value_sq(zero(v), zero(_f64(inp["old_values"])),
                                 zero(_f64(inp["returns"])), VALUE_CLIP)  # fmt: skip
    loss = 0.5 * torch.where(m, sq, 0.0).sum() / m.sum()
    outs, kinks = {"loss": loss}, {}
    if fwd_bwd:
        outs["grad_values"] = torch.autograd.grad(loss, [v])[0]
        kinks["grad_values"] = m & kink
    return outs, kinks


def masked_whiten64(inp: dict):
    """``(x - mean) / sqrt(var + 1e-8)``: masked mean, Bessel-corrected masked variance,
    applied at every position."""
    x, m = _f64(inp["x"]), inp["mask"].bool()
    n = m.sum()
    mean = torch.where(m, x, 0.0).sum() / n
    var = torch.where(m, (x - mean).square(), 0.0).sum() / (n - 1)
    return {"whitened": (x - mean) / torch.sqrt(var + 1e-8)}, {}


def gae64(inp: dict):
    """GAE by its recursion ``A_t = delta_t + gamma lam A_{t+1}``, ``delta_t = r_t +
    gamma V_{t+1} - V_t`` (``V_T = 0``), rewards and values zeroed where masked; returns
    ``A + V``; both zero where masked."""
    m = inp["mask"].bool()
    r = torch.where(m, _f64(inp["rewards"]), 0.0)
    v = torch.where(m, _f64(inp["values"]), 0.0)
    gamma, lam = GAE["gamma"], GAE["lam"]
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = r + gamma * v_next - v
    adv = torch.empty_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running
        adv[:, t] = running
    return {"advantages": torch.where(m, adv, 0.0),
            "returns": torch.where(m, adv + v, 0.0)}, {}  # fmt: skip


# ----------------------------------------------------------------------------- the oracle


class Oracle:
    """The float64 answer to one case; :meth:`compare` measures a provider's outputs."""

    def __init__(self, case: Case, inp: dict):
        self.case = case
        self.values: dict[str, torch.Tensor] = {}
        # (label, values) of each exact definition a provider may compute (see
        # LOGITS_DEFINITIONS); empty: one, ``values``
        self.definitions: list[tuple[str, dict[str, torch.Tensor]]] = []
        self.matched: str | None = None  # the definition compare_all last matched
        self.kinks: dict[str, torch.Tensor] = {}
        self._vocab = None  # (logits, targets, lse, entropy, g, h, kink) for grad_logits
        self._full_kl = None  # (ref_logits, ref_lse, kl, c): the exact KL's gradient term
        # (logits, weights, rows64) of a row-local objective's gradient (compare_distill_grad)
        self._row_grad = None
        # providers that compute another stated function of the same inputs, each with the
        # oracle of that function (the k3 call beside the exact KL)
        self.by_provider: dict[str, Oracle] = {}
        fwd_bwd = case.mode == "fwd_bwd"
        if case.op == "token_logprobs":
            self._token_logprobs(inp, fwd_bwd)
        elif case.op == "policy_loss":
            self._policy_loss(inp)
        elif case.op in ("linear_token_logprobs", "linear_policy_loss"):
            self._linear(inp, fwd_bwd)
        elif case.op in ("distill_loss", "topk_distill_loss"):
            self._distill(inp)
        elif case.op == "linear_distill_loss":
            self._linear_distill(inp, fwd_bwd)
        elif case.op == "ppo_loss":
            self.values, self.kinks = ppo_loss64(inp, fwd_bwd)
        elif case.op == "value_loss":
            self.values, self.kinks = value_loss64(inp, fwd_bwd)
        elif case.op == "masked_whiten":
            self.values, self.kinks = masked_whiten64(inp)
        elif case.op == "gae":
            self.values, self.kinks = gae64(inp)
        else:
            raise ValueError(f"no oracle for {case.op!r}")
        self.values = {k: v.detach() for k, v in self.values.items()}

    def _token_logprobs(self, inp: dict, fwd_bwd: bool) -> None:
        logits, targets = inp["logits"].detach(), inp["targets"]
        if self.case.variant in TRUNCATED_VARIANTS:
            self._truncated(logits, targets, inp["g_logp"] if fwd_bwd else None)
            return
        logp, entropy, lse = token_stats64(logits, targets)
        self.values["logp"] = logp
        if self.case.variant == "stats":
            self.values["entropy"] = entropy
            self.values.update(zip(("mean_logit", "log_sum_sq_probs", "is_top1"),
                                   diagnostics64(logits, targets)))  # fmt: skip
            return
        with_entropy = self.case.variant == "logp+entropy"
        if with_entropy:
            self.values["entropy"] = entropy
        if fwd_bwd:
            g = inp["g_logp"].double()
            h = inp["g_entropy"].double() if with_entropy else torch.zeros_like(g)
            self._vocab = (logits, targets, lse, entropy, g, h, None)

    def _truncated(self, logits, targets, g_logp) -> None:
        """The truncated log-probs (the variant's cuts), block by block; with the upstream
        gradient ``g_logp`` (forward + backward) the logits' gradient ``g_logp * grad`` of
        :func:`truncated_rows64`."""
        cuts = TRUNCATED_VARIANTS[self.case.variant]

        def rows64(b, t0, t1):
            return truncated_rows64(_copy64(logits[b, t0:t1]), targets[b, t0:t1], **cuts)

        logp = torch.empty(logits.shape[:2], dtype=torch.float64, device=logits.device)
        with torch.no_grad():
            for b, t0, t1 in _row_blocks(logits):
                logp[b, t0:t1] = rows64(b, t0, t1)[0]
        self.values["logp"] = logp
        if g_logp is not None:
            self._row_grad = (logits, g_logp.double(), rows64)

    def _policy_loss(self, inp: dict) -> None:
        logits, targets = inp["logits"].detach(), inp["targets"]
        logp, entropy, lse = token_stats64(logits, targets)
        logp_leaf, entropy_leaf = logp.requires_grad_(), entropy.requires_grad_()
        args = [_f64(inp[k]) for k in ("advantages", "old_logprobs", "ref_logprobs")]
        is_weights = inp.get("is_weights")  # grpo+is only
        is_weights = None if is_weights is None else _f64(is_weights)
        kl_leaf = None
        if self.case.variant in FULL_KL_VARIANTS:
            ref_logits = inp["ref_logits"]
            kl, ref_lse = full_kl64(logits, ref_logits)
            kl_leaf = kl.requires_grad_()
            args[2] = None  # the exact KL reads the reference's logits, not its log-probs
            # the same call with k3 on the same inputs (``fused_rl_k3``): GRPO's oracle
            self.by_provider["fused_rl_k3"] = Oracle(
                dataclasses.replace(self.case, variant="grpo"), inp
            )
        loss, log_ratio = policy_loss64(logp_leaf, entropy_leaf, *args, inp["mask"],
                                        self.case.variant, is_weights, kl_leaf)  # fmt: skip
        leaves = [logp_leaf, entropy_leaf] + ([kl_leaf] if kl_leaf is not None else [])
        g, h, *c = torch.autograd.grad(loss, leaves, allow_unused=True)
        h = torch.zeros_like(g) if h is None else h
        if kl_leaf is not None:
            self._full_kl = (ref_logits, ref_lse, kl_leaf.detach(), c[0])
        bounds = clip_bounds(self.case.variant)
        kink = inp["mask"].bool() & _near(log_ratio.detach(), bounds)
        self.values["loss"] = loss
        self._vocab = (logits, targets, lse.detach(), entropy.detach(), g, h, kink)

    def _linear(self, inp: dict, fwd_bwd: bool) -> None:
        """The float64 answer on the exact logits and, for a 16-bit lm_head, a second one on
        the logits rounded to its dtype (:data:`LOGITS_DEFINITIONS`); in the policy loss a
        token whose target logit rounds either way (:func:`rounding_ambiguous64`: its ratio,
        which scales its row) or whose ratio sits at a clip boundary under either has its
        hidden row left out of the gradient comparison."""
        hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
        dtype = hidden.dtype
        rounded = [dtype] if dtype in (torch.bfloat16, torch.float16) else []
        row_kink = None
        if fwd_bwd and rounded and self.case.op == "linear_policy_loss":  # ratio-scaled rows
            row_kink = rounding_ambiguous64(hidden, weight, targets, dtype)
        for logits_dtype in [None, *rounded]:
            values, kink = self._linear_values(inp, fwd_bwd, logits_dtype)
            if kink is not None:
                row_kink = kink if row_kink is None else row_kink | kink
            self.definitions.append((LOGITS_DEFINITIONS[logits_dtype], values))
        self.values = self.definitions[0][1]
        if row_kink is not None and bool(row_kink.any()):
            # a token at a kink: its hidden row is left out (grad_weight sums every token's
            # row: the inputs keep the log-ratios away from the boundaries, cases.CLIP_MARGIN)
            hidden_kink = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
            length = targets.shape[1]
            hidden_kink[:, hidden.shape[1] - length - 1 : hidden.shape[1] - 1] = row_kink
            self.kinks["grad_hidden"] = hidden_kink[..., None]

    def _linear_values(self, inp: dict, fwd_bwd: bool, logits_dtype):
        """One definition's float64 outputs of a linear op (the logits rounded to
        ``logits_dtype`` when given) and its ``(B, T)`` clip kinks (None without)."""
        hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
        values = {}
        logp, entropy, lse = linear_stats64(hidden, weight, targets, logits_dtype=logits_dtype)
        kink = None
        if self.case.op == "linear_token_logprobs":
            values["logp"] = logp
            if self.case.variant in ("logp+entropy", "stats"):
                values["entropy"] = entropy
            if self.case.variant == "stats":
                values.update(zip(("mean_logit", "log_sum_sq_probs", "is_top1"),
                                  linear_diagnostics64(hidden, weight, targets)))  # fmt: skip
                return values, None
            if not fwd_bwd:
                return values, None
            g = inp["g_logp"].double()
            h = inp["g_entropy"].double() if "entropy" in values else torch.zeros_like(g)
        else:
            logp_leaf, entropy_leaf = logp.requires_grad_(), entropy.requires_grad_()
            args = [_f64(inp[k]) for k in ("advantages", "old_logprobs", "ref_logprobs")]
            loss, log_ratio = policy_loss64(logp_leaf, entropy_leaf, *args, inp["mask"],
                                            self.case.variant)  # fmt: skip
            g, h = torch.autograd.grad(loss, [logp_leaf, entropy_leaf], allow_unused=True)
            h = torch.zeros_like(g) if h is None else h
            bounds = [math.log(1.0 - POLICY["eps_low"]), math.log(1.0 + POLICY["eps_high"])]
            kink = inp["mask"].bool() & _near(log_ratio.detach(), bounds)
            values["loss"] = loss
        d_hidden, d_weight = linear_grads64(hidden, weight, targets, lse.detach(),
                                            entropy.detach(), g, h,
                                            logits_dtype=logits_dtype)  # fmt: skip
        values.update(grad_hidden=d_hidden, grad_weight=d_weight)
        return values, kink

    def _linear_distill(self, inp: dict, fwd_bwd: bool) -> None:
        """The float64 answer on the exact logits and, for 16-bit heads, a second one on the
        logits rounded to the heads' dtype (:data:`LOGITS_DEFINITIONS`)."""
        weights = _token_mean_weights(inp["mask"])
        args = [inp[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
        dtype = inp["hidden"].dtype
        rounded = [dtype] if dtype in (torch.bfloat16, torch.float16) else []
        for logits_dtype in [None, *rounded]:
            loss, d_hidden, d_weight = linear_distill64(
                *args, weights, DISTILL_BETAS[self.case.variant], fwd_bwd,
                logits_dtype=logits_dtype,
            )  # fmt: skip
            values = {"loss": loss}
            if fwd_bwd:
                values.update(grad_hidden=d_hidden, grad_weight=d_weight)
            self.definitions.append((LOGITS_DEFINITIONS[logits_dtype], values))
        self.values = self.definitions[0][1]

    def _distill(self, inp: dict) -> None:
        """``distill_loss`` (the case's beta) or ``topk_distill_loss`` (verl's top-k forward
        KL), row block by row block."""
        logits = inp["logits"].detach()
        weights = _token_mean_weights(inp["mask"])
        if self.case.op == "topk_distill_loss":
            lt, ids = inp["teacher_topk_logprobs"], inp["teacher_topk_ids"]

            def rows64(b, t0, t1):
                return topk_distill_rows64(_copy64(logits[b, t0:t1]), _copy64(lt[b, t0:t1]),
                                           ids[b, t0:t1], TOPK_CLAMP)  # fmt: skip

        else:
            teacher, beta = inp["teacher_logits"], DISTILL_BETAS[self.case.variant]

            def rows64(b, t0, t1):
                return distill_rows64(_copy64(logits[b, t0:t1]), _copy64(teacher[b, t0:t1]),
                                      beta)  # fmt: skip

        self.values["loss"] = distill_loss64(logits, weights, rows64)
        if self.case.op == "topk_distill_loss":
            self.values["overlap_count"] = topk_overlap64(logits, inp["teacher_topk_ids"], weights)
        self._row_grad = (logits, weights, rows64)

    def compare(self, name: str, out: torch.Tensor) -> Comparison:
        if name == "grad_logits" and self._row_grad is not None:
            return compare_distill_grad(out, *self._row_grad)
        if name == "grad_logits":
            logits, targets, lse, entropy, g, h, kink = self._vocab
            return compare_vocab_grad(out, logits, targets, lse, entropy, g, h, kink,
                                      full_kl=self._full_kl)  # fmt: skip
        own_rows = name == "grad_weight"  # vocabulary rows: see worst_own_row_err
        return compare(out, self.values[name], self.kinks.get(name), own_rows)

    def compare_all(self, names, outs, provider: str | None = None) -> dict[str, Comparison]:
        """Every output of ``provider`` against the oracle: that provider's own function's
        when it computes another one (:attr:`by_provider`, named in ``matched``). With more
        than one definition (the 16-bit ops from hidden states) the one the outputs match
        best, named in ``matched``."""
        from .accuracy import ROW_TOL_FACTOR  # (accuracy imports this module)

        self.matched = None
        if provider in self.by_provider:
            comps = self.by_provider[provider].compare_all(names, outs)
            self.matched = PROVIDER_DEFINITIONS[provider]
            return comps
        if not self.definitions:
            return {name: self.compare(name, out) for name, out in zip(names, outs)}
        best = None
        for label, values in self.definitions:
            self.values = values
            comps = {name: self.compare(name, out) for name, out in zip(names, outs)}
            # the judge's measure: the RMS error, or a row's over its own limit
            worst = max(max(c.err, c.worst_row / ROW_TOL_FACTOR) for c in comps.values())
            if best is None or worst < best[0]:
                best = (worst, label, comps)
        self.values = self.definitions[0][1]
        if len(self.definitions) > 1:
            self.matched = best[1]
        return best[2]
