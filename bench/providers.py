"""The implementations each case is measured with ("providers"), all on the same inputs.

* ``fused_rl``: the package's Triton path (``backend="triton"``; on CPU the Triton interpreter).
* ``fused_rl_ref``: the package's plain-PyTorch path (``backend="reference"``), its CPU fallback.
* ``eager``: the loss written the way the seeds write it: ``log_softmax`` -> ``gather`` -> ratio
  -> clip -> masked mean (logits upcast to fp32 first, as RL trainers do for accuracy), the
  torchtune ``PPOLoss`` body (seed 000), and seed 004's Python GAE loop over T.
* ``compile``: ``torch.compile`` of the eager functions (default mode; on CPU skipped unless
  asked for, compile time does not fit the quick budget).
* ``trl``: TRL's ``selective_log_softmax`` (per-row ``logsumexp`` loop in fp32, per-row
  ``log_softmax`` in bf16) and its chunked ``entropy_from_logits``, after TRL's ``logits / T``.
* ``fused_rl_mat``: the linear ops' MATERIALISED fused path: ``F.linear`` to the whole
  ``(B, T + 1, V)`` logits, then fused_rl's logits op (``policy_loss`` / ``token_logprobs``,
  Triton) on that buffer as it comes; autograd's linear backward forms ``dH`` and ``dW`` from
  the ``(B, T + 1, V)`` logits gradient. What issue 14's time and memory targets compare the
  chunked ``fused_rl`` with. Linear ops (and ``linear_distill_loss``, below) only.
* ``trl`` on the linear ops: TRL's own chunked fused LM head (``trl.kernels.chunked_logprob.
  ChunkedLogProbFunction``, what GRPOTrainer runs since TRL 1.15: cuBLAS tiles of 4096 tokens x
  32768 vocabulary columns folded by a Triton kernel, the logits recomputed in the backward)
  and the benchmark's loss on its log-probs, where ``trl`` is importable; for
  ``linear_token_logprobs[stats]`` the same head asked for every statistic (TRL >= 1.16).
* ``verl``: verl's torch ``FusedLinearForPPO`` (512-token chunks; log-probs and entropy),
  loaded from its file in the installed verl (verl's package ``__init__`` needs Ray), then
  the benchmark's loss. Linear ops only.
* ``liger_inplace``: ``liger`` with Liger's default ``inplace=True`` (the gradient written into
  the logits buffer: here a copy of its own, made outside the measured call). policy_loss only.
* ``fused_rl_inplace``: ``fused_rl`` with ``inplace=True`` (the backward writes the gradient
  into the logits buffer: a copy of its own, as ``liger_inplace``). policy_loss only.
* ``fused_rl_2pass``: ``fused_rl`` with ``grad_in_forward=True`` (the forward writes the
  gradient into a buffer of its own, the backward with an upstream gradient of 1 touches
  none of it: two passes over the logits where ``fused_rl`` makes three), and
  ``fused_rl_2pass_inplace`` with ``inplace=True`` too (the gradient written over the logits
  in the forward: a copy of its own). policy_loss with token-level importance sampling only
  (GSPO / GMPO need every sequence's total first). A case's ``bytes`` (the ``GB/s`` column)
  are the default's three passes for every provider: the two-pass rows' figure is then an
  effective rate, the time to do the same job.
* ``liger``: Liger-Kernel's Triton GRPO loss (``triton_grpo_loss``) and
  ``fused_selective_log_softmax``, where ``liger_kernel`` is importable; for
  ``linear_policy_loss`` its chunked ``LigerFusedLinearGRPOLoss`` (``loss_type="bnpo"``: the
  token mean over the batch's mask, the benchmark's aggregation).

The exact KL to the reference (``policy_loss[grpo+fullkl]``, ``cases.FULL_KL_VARIANTS``):
GRPO plus ``beta`` times the per-token ``KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v)``
from the reference model's ``(B, T + 1, V)`` logits.

* ``fused_rl`` / ``fused_rl_ref``: ``policy_loss(ref_logits=, kl_estimator="full")`` on both
  models' buffers as they come; the :data:`FUSED_VARIANTS` with the same keywords.
* ``fused_rl_k3``: the same Triton call with ``kl_estimator="k3"`` on the same inputs, its
  ``ref_logprobs`` the reference's own log-prob of each target: the call the exact KL
  replaces, so the two rows show what the exact KL costs (one more read of the reference's
  logits forward and one backward). Checked against its own float64 oracle (GRPO with k3).
  The case's ``bytes`` are the exact KL's five passes for every provider: this row's
  ``GB/s`` is then an effective rate, the time to do the exact KL's job.
* ``eager``: :func:`eager_full_kl_policy_loss`, the loss as an RL engineer writes it without
  fused_rl (both log-softmaxes materialised in fp32, ``(p * (logp - logq)).sum(-1)``, the
  surrogate, the masked mean); ``compile``: ``torch.compile`` of it.
* ``trl``, ``liger``, ``liger_inplace``: none (their GRPO losses estimate the KL from two
  log-probs per token; a note says so).

Log-probs under a sampler's truncation (``token_logprobs[k50]``, ``[k1000]``, ``[p0.9]``,
``cases.TRUNCATED_VARIANTS``): the log-prob of each target under the distribution vLLM's
sampler draws from (temperature, then top-k, then top-p over the renormalised top-k set;
ties at either cut kept whole), ``-inf`` for a target cut off (the cases' targets never are).

* ``fused_rl`` / ``fused_rl_ref``: ``fused_rl.token_logprobs(logits, targets, top_k=,
  top_p=)`` (``fused_rl.truncated_logprobs``), streamed on the Triton backend.
* ``eager``: :func:`eager_truncated_logprobs`, what an RL engineer writes without fused_rl,
  in vLLM's order over the fp32 logits: top-k by the k-th largest of ``torch.topk``, top-p
  by sorting the kept logits, then ``log_softmax`` and ``gather``; ``compile``:
  ``torch.compile`` of it.
* ``trl``, ``liger``: none (no truncated log-prob; a note says so).

Linear ops (``linear_token_logprobs``, ``linear_policy_loss``): fused_rl's ops from the hidden
states and the lm_head; eager / compile run ``F.linear`` on ``hidden[:, :-1]`` and then the
eager log-prob / GRPO loss above (logits upcast to fp32).

Distillation ops (``distill_loss`` from both models' logits, ``linear_distill_loss`` from
their hidden states and lm_heads; the variant is the beta of ``cases.DISTILL_BETAS``):

* ``fused_rl`` / ``fused_rl_ref``: ``fused_rl.distill_loss`` / ``fused_rl.linear_distill_loss``
  with the case's mask (token-mean over it).
* ``eager``: :func:`eager_distill_loss`, the loss as TRL's ``GKDTrainer.generalized_jsd_loss``
  computes it (both logits cast to fp32, a ``log_softmax`` of each, the mixture by
  ``logsumexp``, elementwise ``kl_div`` terms), then the mean over the mask's tokens; from
  hidden states ``F.linear`` for each model first (the teacher's under ``no_grad``).
* ``compile``: ``torch.compile`` of those.
* ``fused_rl_mat`` (``linear_distill_loss``): ``F.linear`` to both models' whole logits, then
  fused_rl's Triton ``distill_loss`` on them.
* ``liger``: ``LigerJSD`` on the fp32 ``log_softmax`` of both logits (Liger's JSD takes
  log-probabilities; the student's gradient goes back through that ``log_softmax``), and
  ``LigerFusedLinearJSD`` from hidden states; rows with label -100 (the mask's False) do
  not count, Liger's token mean. Where ``liger_kernel`` is importable.
* ``trl``: from logits none (the eager provider is TRL's computation); from hidden states
  TRL's own chunked divergence (``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``,
  what ``DistillationTrainer`` runs since TRL 1.16: both models projected on tiles of 4096
  tokens x 32768 vocabulary columns in fp32, folded by Triton kernels, the logits recomputed
  in the backward) on the mask's positions, where ``trl`` is importable.

verl's top-k distillation (``topk_distill_loss``: the student's logits, the teacher's top-K
log-probs and ids): every provider computes verl 0.9.1's ``compute_forward_kl_topk``
(``verl/trainer/distillation/fsdp/losses.py``: the per-token loss, the top-K masses and the
overlap diagnostics; ``log_prob_min_clamp`` ``cases.TOPK_CLAMP``), then the loss's mean over
the mask's tokens and the overlap count's (checked too, so no provider can drop the top K).

* ``fused_rl``: ``fused_rl.compat.verl.compute_forward_kl_topk`` (the student's K log-probs
  from one read of the logits forward and one backward, the overlap's K-th largest from a
  streamed radix select: two more reads of a bf16 row); no ``fused_rl_ref`` (the adapter,
  as verl's function, takes no backend).
* ``eager``: :func:`eager_topk_distill_loss`, verl's default path written from its formula
  (the student's ``log_softmax`` in the logits' dtype, materialised); ``compile``: it under
  ``torch.compile``.
* ``verl``: verl's own function on the teacher's tensors nested as verl's batch holds them,
  where ``verl.trainer.distillation`` is importable.
* ``liger``, ``trl``: none (no top-k distillation loss).

``build(provider, case, inp)`` returns a zero-argument callable that runs the measured work
once (forward; or forward + ``torch.autograd.grad`` under the case's random upstream
gradient) and returns the outputs compared with the float64 oracle (``bench/oracle.py``),
named by ``output_names(case)``. A provider that cannot run a case raises ``Unavailable``
with the reason.

Accuracy: every provider must meet the tolerance fused_rl meets (``bench/accuracy.py``)
unless it is listed in ``LESS_ACCURATE`` below, with why it computes in lower precision and
the bound it stays within (then its rows read "less accurate", an expected result).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .cases import (
    CISPO,
    DISTILL_BETAS,
    DISTILL_OPS,
    FULL_KL_VARIANTS,
    GAE,
    HIDDEN_OPS,
    LINEAR_OPS,
    LOSS_AGG,
    POLICY,
    PPO,
    TEMPERATURE,
    TOPK_CLAMP,
    TRUNCATED_VARIANTS,
    VALUE_CLIP,
    Case,
)

PROVIDERS = (
    "fused_rl",
    "fused_rl_ref",
    "fused_rl_mat",
    "fused_rl_k3",
    "eager",
    "compile",
    "trl",
    "liger",
    "liger_inplace",
    "fused_rl_inplace",
    "fused_rl_2pass",
    "fused_rl_2pass_inplace",
    "verl",
)
# fused_rl's policy_loss with call options: the keywords each adds, and the key of the copy
# of the logits buffer it writes into (made at build time, outside the measured call; None:
# it leaves the logits as they are and differentiates the shared buffer, as fused_rl). The
# copies share liger_inplace's key: building the next provider drops the last one's copy,
# so a large case holds one of them, not one per provider
FUSED_VARIANTS = {
    "fused_rl_inplace": ("buf_inplace", dict(inplace=True)),
    "fused_rl_2pass": (None, dict(grad_in_forward=True)),
    "fused_rl_2pass_inplace": ("buf_inplace", dict(grad_in_forward=True, inplace=True)),
}
TWO_PASS_VARIANTS = ("grpo", "grpo+entropy", "cispo", "grpo+is", "grpo+fullkl")  # token IS
# the ops whose fused_rl provider is a drop-in adapter, not a fused_rl.<op> function
# (topk_distill_loss: fused_rl.compat.verl.compute_forward_kl_topk)
ADAPTER_OPS = ("topk_distill_loss",)
# token_logprobs[stats]: token_stats' outputs (the top-1 flag as 0 / 1)
STATS_OUTPUTS = ("logp", "entropy", "mean_logit", "log_sum_sq_probs", "is_top1")
BASELINE = "fused_rl"  # the provider the others' time and memory are compared with
# rows per chunk of fused_rl's ops from hidden states (``linear_*``; ``bench/run.py
# --chunk-tokens``); None: each op's default (``fused_rl.linear.chunk_rows``)
LINEAR_CHUNK_TOKENS: int | None = None
# the package itself: no "less accurate" excuse
MUST_MEET_TOL = ("fused_rl", "fused_rl_ref", "fused_rl_k3", *FUSED_VARIANTS)


@dataclasses.dataclass(frozen=True)
class LessAccurate:
    """A provider that computes in lower precision than fp32 accumulation by design."""

    label: str  # a few words for the verdict column
    why: str  # the reason, in a sentence or two
    bounds: dict[str, tuple[float, float]]  # dtype: (RMS error, worst-row error) vs float64


# Providers whose error against float64 may exceed fused_rl's tolerance, and why: a provider
# on every op, or a (provider, op) pair (``less_accurate``). A dtype not listed (TRL with fp32
# logits) must meet the tolerance like fused_rl.
_VERL_TOPK_BF16 = LessAccurate(
    label="log_softmax in bf16 (verl's default)",
    why=(
        "verl's default top-k path (compute_forward_kl_topk, use_chunked_topk off) takes the "
        "student's log_softmax in the logits' dtype: each log-prob rounded to 8 significant "
        "bits moves the loss and its gradient by ~1% RMS (1.2e-2 measured on an H200 at 8 x "
        "2048 x 151936), and it ranks its top K on those rounded values, whose many ties it "
        "breaks arbitrarily, so its overlap count is ~1% off the exact ranking's (1.1e-2 to "
        "1.3e-2 at V = 151936, K = 128, on CPU)."
    ),
    # (RMS, worst row): about four times the measured (1.2e-2 RMS, rows 0.13)
    bounds={"bf16": (0.05, 0.5)},
)
LESS_ACCURATE: dict[str | tuple[str, str], LessAccurate] = {
    "trl": LessAccurate(
        label="log_softmax in bf16 (as TRL)",
        why=(
            "TRL's selective_log_softmax runs log_softmax row by row in the logits' dtype for "
            "bf16/fp16 logits, and entropy_from_logits its softmax: each log-prob is rounded "
            "to 8 significant bits (~0.03 at |log p| ~ 10), so p and the gradient are off by "
            "2-8% RMS (measured on an H100 up to 32768 x 262144), and a token whose ratio "
            "sits that close to a clip boundary lands on the other side, changing its whole "
            "gradient row (the H100 run measured rows up to 3.6x the RMS row norm off)."
        ),
        # (RMS, worst row): about twice what the H100 run measured (0.083 RMS, rows 3.6)
        bounds={"bf16": (0.15, 8.0), "fp16": (0.05, 8.0)},
    ),
    ("eager", "topk_distill_loss"): _VERL_TOPK_BF16,
    ("compile", "topk_distill_loss"): _VERL_TOPK_BF16,
    ("verl", "topk_distill_loss"): _VERL_TOPK_BF16,
}


def less_accurate(provider: str, op: str | None = None) -> LessAccurate | None:
    """The declaration covering ``provider`` on ``op``: the pair's, else the provider's."""
    return LESS_ACCURATE.get((provider, op)) or LESS_ACCURATE.get(provider)


Runner = Callable[[], tuple]


class Unavailable(Exception):
    """The provider cannot run this case (missing op or package, unsupported variant).

    ``transient=True``: it depends on this machine (a package or feature missing here), so
    a later ``--resume`` on another machine retries it; otherwise it never can run."""

    def __init__(self, reason: str, *, transient: bool = False):
        super().__init__(reason)
        self.transient = transient


def output_names(case: Case) -> list[str]:
    if case.op in ("token_logprobs", "linear_token_logprobs") and case.variant == "stats":
        return list(STATS_OUTPUTS)
    if case.op == "token_logprobs":
        names = ["logp"] + (["entropy"] if case.variant == "logp+entropy" else [])
        return names + (["grad_logits"] if case.mode == "fwd_bwd" else [])
    if case.op == "policy_loss":
        return ["loss", "grad_logits"]
    if case.op == "distill_loss":
        return ["loss"] + (["grad_logits"] if case.mode == "fwd_bwd" else [])
    if case.op == "topk_distill_loss":  # the overlap diagnostic checked: compile keeps it
        return ["loss", "overlap_count"] + (["grad_logits"] if case.mode == "fwd_bwd" else [])
    if case.op == "linear_distill_loss":
        return ["loss"] + (["grad_hidden", "grad_weight"] if case.mode == "fwd_bwd" else [])
    if case.op in ("linear_token_logprobs", "linear_policy_loss"):
        first = ["logp"] if case.op == "linear_token_logprobs" else ["loss"]
        return first + (["grad_hidden", "grad_weight"] if case.mode == "fwd_bwd" else [])
    if case.op == "ppo_loss":
        grads = ["grad_pi_logprobs", "grad_phi_values"] if case.mode == "fwd_bwd" else []
        return ["loss", "policy_loss", "value_loss", "ratios_mean", "clipfrac", *grads]
    if case.op == "value_loss":
        return ["loss"] + (["grad_values"] if case.mode == "fwd_bwd" else [])
    if case.op == "masked_whiten":
        return ["whitened"]
    if case.op == "gae":
        return ["advantages", "returns"]
    raise ValueError(f"unknown op {case.op!r}")


def _runner(case: Case, forward, wrt=(), upstream=(), grad_post=None) -> Runner:
    """Wrap ``forward() -> tuple`` for the case's mode.

    ``fwd_bwd``: gradients of the first ``len(upstream)`` outputs w.r.t. ``wrt`` under
    ``upstream`` (None for a scalar output), returned after the detached outputs.
    """
    if case.mode == "fwd_nograd":

        def run():
            with torch.no_grad():
                return tuple(forward())

    elif case.mode == "fwd":

        def run():
            return tuple(t.detach() for t in forward())

    else:

        def run():
            outs = tuple(forward())
            grads = torch.autograd.grad(outs[: len(upstream)], list(wrt), list(upstream))
            if grad_post is not None:
                grads = grad_post(grads)
            return tuple(t.detach() for t in outs) + tuple(grads)

    return run


# ----------------------------------------------------------------------------- eager (seeds)


def eager_token_logprobs(logits, targets, with_entropy: bool):
    """``log_softmax(logits / T).gather(targets)`` (+ entropy), materialised in fp32."""
    z = logits.float()
    if TEMPERATURE != 1.0:
        z = z / TEMPERATURE
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return (logp,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def eager_truncated_logprobs(logits, targets, top_k: int | None = None,
                             top_p: float | None = None):  # fmt: skip
    """``(logp,)``, ``(B, T)`` fp32: the log-prob of each target under a sampler's truncated
    distribution, written the way an RL engineer would without fused_rl, in vLLM's order over
    the fp32 logits ``z = logits / T``:

    * top-k: the k-th largest ``z`` from ``torch.topk``; everything below it set to ``-inf``
      (every value tied with the k-th is kept; ``None`` or ``k >= V``: no top-k);
    * top-p: the kept logits sorted descending, their softmax's cumulative sum; the
      threshold is the sorted value at the first position whose cumulative mass reaches
      ``p``, and everything below it set to ``-inf`` (so every value tied with it is kept:
      fused_rl's threshold rule; ``None`` or ``1``: no top-p);

    then ``log_softmax`` of what is left and ``gather`` of the targets. Materialises several
    fp32 ``(B, T, V)`` tensors (the masked logits, the sorted values and their int64
    indices, the softmax, its cumulative sum) and the log-softmax autograd keeps."""
    z = logits.float()
    if TEMPERATURE != 1.0:
        z = z / TEMPERATURE
    vocab = z.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        z_sorted = z.sort(dim=-1, descending=True).values
        cum = torch.softmax(z_sorted, dim=-1).cumsum(dim=-1)
        # the first position whose cumulative mass reaches p (the last one where rounding
        # leaves the total short of p)
        first = (cum < top_p).sum(-1, keepdim=True).clamp(max=vocab - 1)
        z = z.masked_fill(z < z_sorted.gather(-1, first), float("-inf"))
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logp,)


def eager_truncated_variant(logits, targets, variant: str):
    """:func:`eager_truncated_logprobs` with the cuts of ``variant``
    (``cases.TRUNCATED_VARIANTS``): under ``torch.compile`` the cuts are constants of each
    variant's graph (the variant, a string, is specialised on)."""
    return eager_truncated_logprobs(logits, targets, **TRUNCATED_VARIANTS[variant])


def eager_token_stats(logits, targets):
    """The log-prob and entropy of :func:`eager_token_logprobs` and the diagnostics the
    ``stats`` variant adds, eager: the mean scaled logit, ``log sum p^2`` and whether the
    target is the argmax (as 0 / 1), each a reduction over the materialised fp32 logits."""
    z = logits.float()
    if TEMPERATURE != 1.0:
        z = z / TEMPERATURE
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    top1 = (logits.argmax(-1) == targets).float()
    return logp, entropy, z.mean(-1), torch.logsumexp(2 * logp_all, -1), top1


def token_policy_loss(
    logp, entropy, advantages, old, ref, mask, variant: str, is_weights=None, kl=None
):
    """The benchmark's policy objective on per-token tensors (every variant of ``policy_loss``;
    ``bench/oracle.py::policy_loss64`` is its float64 twin):

    * ``grpo`` / ``grpo+entropy`` / ``grpo+is``: PPO-clip of the token ratio ``r``;
    * ``gspo``: PPO-clip of the sequence ratio ``exp(masked mean of logp - old)``;
    * ``cispo``: ``-sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp`` on ``CISPO``'s band;
    * ``gmpo``: ``-A exp(masked mean of the token log-ratios d clipped in log space)``,
      ``min(d, clamp(d, -eps_low, eps_high))`` where ``A > 0``, ``max`` where ``A < 0``, 0
      where ``A = 0`` (a token the clip froze gets no gradient);

    the policy term times ``is_weights`` (when given), plus ``beta`` times the KL: the k3
    estimate from ``ref``, or the per-token ``kl`` when given (the exact KL), minus the
    entropy bonus (``grpo+entropy``), aggregated token-mean (``gmpo``:
    seq-mean-token-mean)."""
    m = mask.to(logp.dtype)
    adv = advantages[:, None]
    if variant == "gmpo":
        d = logp - old
        dc = torch.clamp(d, -POLICY["eps_low"], POLICY["eps_high"])
        side = torch.where(adv < 0, torch.maximum(d, dc), torch.zeros_like(d))
        d = torch.where(adv > 0, torch.minimum(d, dc), side)
        seq_log_ratio = (d * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        policy = (-advantages * torch.exp(seq_log_ratio))[:, None].expand_as(logp)
    elif variant == "cispo":
        ratio = torch.exp(logp - old)
        weight = torch.clamp(ratio, 1.0 - CISPO["eps_low"], 1.0 + CISPO["eps_high"]).detach()
        policy = -adv * weight * logp
    else:
        if variant == "gspo":
            seq_log_ratio = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
            ratio = torch.exp(seq_log_ratio)[:, None].expand_as(logp)
        else:
            ratio = torch.exp(logp - old)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - POLICY["eps_low"], 1.0 + POLICY["eps_high"])
        policy = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        policy = policy * is_weights
    if kl is None:
        neg_log_ratio = ref - logp  # k3 estimator of KL(pi || pi_ref)
        kl = torch.exp(neg_log_ratio) - neg_log_ratio - 1.0
    per_token = policy + POLICY["beta"] * kl
    if entropy is not None:
        per_token = per_token - POLICY["entropy_coef"] * entropy
    if LOSS_AGG.get(variant, "token-mean") == "seq-mean-token-mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    return (per_token * m).sum() / m.sum()


def eager_policy_loss(logits, targets, advantages, old, ref, mask, variant: str, is_weights=None):
    with_entropy = variant == "grpo+entropy"
    stats = eager_token_logprobs(logits, targets, with_entropy)
    entropy = stats[1] if with_entropy else None
    return (token_policy_loss(stats[0], entropy, advantages, old, ref, mask, variant, is_weights),)


def eager_full_kl_policy_loss(logits, ref_logits, targets, advantages, old, mask, variant: str):
    """GRPO with the exact KL to the reference, written the way an RL engineer would without
    fused_rl: both models' logits cast to fp32 and divided by the temperature, a
    ``log_softmax`` of each materialised (the reference's under ``no_grad``, as its model
    runs), per token ``KL(pi || pi_ref) = (p * (logp - logq)).sum(-1)`` with
    ``p = logp.exp()``, the target's log-prob gathered from the policy's, then the PPO-clip
    surrogate plus ``beta * KL`` and the masked token mean (:func:`token_policy_loss`)."""
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    with torch.no_grad():
        ref_logp_all = torch.log_softmax(ref_logits.float() / TEMPERATURE, dim=-1)
    kl = (logp_all.exp() * (logp_all - ref_logp_all)).sum(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (token_policy_loss(logp, None, advantages, old, None, mask, variant, kl=kl),)


def eager_linear_token_logprobs(hidden, weight, targets, with_entropy: bool):
    """``F.linear`` on the positions that predict the targets, then the eager log-probs."""
    return eager_token_logprobs(F.linear(hidden[:, :-1], weight), targets, with_entropy)


def eager_linear_token_stats(hidden, weight, targets):
    """``F.linear`` on the positions that predict the targets, then the eager stats."""
    return eager_token_stats(F.linear(hidden[:, :-1], weight), targets)


def eager_linear_policy_loss(hidden, weight, targets, advantages, old, ref, mask, variant: str):
    """``F.linear`` on the positions that predict the targets, then the eager GRPO loss."""
    logits = F.linear(hidden[:, :-1], weight)
    return eager_policy_loss(logits, targets, advantages, old, ref, mask, variant)


def eager_distill_loss(logits, teacher_logits, mask, variant: str):
    """TRL GKD's generalized JSD loss the way ``GKDTrainer.generalized_jsd_loss`` computes it,
    written from its formula: both logits cast to fp32 and divided by the temperature, a
    ``log_softmax`` of each, then per vocabulary entry ``beta == 0``: the forward KL
    ``q (log q - log p)``; ``beta == 1``: the reverse KL ``p (log p - log q)``; otherwise
    ``beta q (log q - log m) + (1 - beta) p (log p - log m)`` with the mixture
    ``log m = logsumexp(log p + log(1 - beta), log q + log beta)`` (``p`` the student's,
    ``q`` the teacher's distribution), summed over the vocabulary and averaged over the
    mask's tokens. TRL keeps the counted rows by boolean indexing (a host sync and one more
    ``(n_counted, V)`` copy); a ``where`` on the per-token sums is the same mean."""
    beta = DISTILL_BETAS[variant]
    log_p = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    log_q = torch.log_softmax(teacher_logits.float() / TEMPERATURE, dim=-1)
    if beta == 0.0:
        terms = F.kl_div(log_p, log_q, reduction="none", log_target=True)
    elif beta == 1.0:
        terms = F.kl_div(log_q, log_p, reduction="none", log_target=True)
    else:
        both = torch.stack([log_p + math.log1p(-beta), log_q + math.log(beta)])
        log_m = torch.logsumexp(both, dim=0)
        kl_teacher = F.kl_div(log_m, log_q, reduction="none", log_target=True)
        kl_student = F.kl_div(log_m, log_p, reduction="none", log_target=True)
        terms = beta * kl_teacher + (1.0 - beta) * kl_student
    per_token = torch.where(mask, terms.sum(-1), 0.0)
    return (per_token.sum() / mask.sum(),)


def eager_topk_distill_loss(logits, teacher_logprobs, teacher_ids, mask):
    """verl 0.9.1's ``compute_forward_kl_topk`` on its default path, written from its
    formula: the student's ``log_softmax`` in the logits' dtype, its top-K ids (the overlap
    diagnostic) and its log-probs at the teacher's ids, the two top-K masses, both log-probs
    clamped below at ``TOPK_CLAMP``, ``sum_k p (lt - ls)`` in fp32 per token, the teacher's
    ids among the student's top K and the mean of ``-p (lt - ls)`` over them; then the loss's
    mean over the mask's tokens, and the mean overlap count (a checked output: returned, so
    ``torch.compile`` cannot drop the top K as dead code, which it did while only the loss
    was returned; the masses and the advantage, ``(N, K)`` work, are computed as verl's
    function does and not returned)."""
    log_q = torch.log_softmax(logits, dim=-1)
    own = torch.topk(log_q, k=teacher_ids.shape[-1], dim=-1).indices
    student = torch.gather(log_q, -1, teacher_ids)
    _masses = student.exp().sum(-1), teacher_logprobs.exp().sum(-1)
    student = student.clamp_min(TOPK_CLAMP).float()
    teacher = teacher_logprobs.clamp_min(TOPK_CLAMP).float()
    token_kl = teacher.exp() * (teacher - student)
    overlap = (teacher_ids.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    _advantage = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
    per_token = torch.where(mask, token_kl.sum(-1), 0.0)
    return per_token.sum() / mask.sum(), _masked_mean(count.float(), mask)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum()


def _topk_token_mean(out: dict, mask: torch.Tensor) -> tuple:
    """The means over the mask's tokens of ``compute_forward_kl_topk``'s per-token loss and
    overlap count."""
    count = out["overlap_count"].view(mask.shape).float()
    return _masked_mean(out["distillation_losses"], mask), _masked_mean(count, mask)


def _topk_config():
    """verl's ``DistillationConfig`` as its function reads it (``distillation_loss``'s
    ``log_prob_min_clamp``, the default path)."""
    from types import SimpleNamespace

    return SimpleNamespace(distillation_loss=SimpleNamespace(
        log_prob_min_clamp=TOPK_CLAMP, use_chunked_topk=False))  # fmt: skip


def _verl_topk_forward(inp: dict):
    """verl's own ``compute_forward_kl_topk`` on the ``(1, B * T, V)`` view of the logits and
    the teacher's tensors nested one sequence a row, as verl's batch holds them."""
    try:
        losses = importlib.import_module("verl.trainer.distillation.fsdp.losses")
    except Exception as exc:  # noqa: BLE001  (absent, or a verl without distillation)
        raise Unavailable(f"verl's distillation losses are not importable ({exc})",
                          transient=True) from exc  # fmt: skip
    logits, mask = inp["logits"], inp["mask"]
    batch, seqlen, vocab = logits.shape
    offsets = torch.arange(0, batch * seqlen + 1, seqlen, device=logits.device)
    nested = [torch.nested.nested_tensor_from_jagged(inp[k].reshape(batch * seqlen, -1),
                                                     offsets=offsets)
              for k in ("teacher_topk_logprobs", "teacher_topk_ids")]  # fmt: skip
    config = _topk_config()

    def forward():
        out = losses.compute_forward_kl_topk(logits.view(1, batch * seqlen, vocab), *nested,
                                             config, "thd")  # fmt: skip
        out["distillation_losses"] = out["distillation_losses"].view(batch, seqlen)
        return _topk_token_mean(out, mask)

    return forward


def eager_linear_distill_loss(hidden, weight, teacher_hidden, teacher_weight, mask, variant: str):
    """``F.linear`` of each model (the teacher's under ``no_grad``, as GKDTrainer runs its
    teacher), then :func:`eager_distill_loss`."""
    logits = F.linear(hidden, weight)
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden, teacher_weight)
    return eager_distill_loss(logits, teacher_logits, mask, variant)


def _masked_mean_tt(x, mask):
    """torchtune's ``rlhf.masked_mean``: ``sum(x * m) / (sum(m) + 1e-8)``."""
    return (x * mask).sum() / (mask.sum() + 1e-8)


def eager_ppo_loss(pi_old, pi, adv, phi_old, phi, returns, pmask, vmask):
    """Seed 000 (torchtune ``PPOLoss.forward``) with masks: the 5-tuple."""
    eps, clip, coeff = PPO["epsilon"], PPO["value_clip_range"], PPO["value_coeff"]
    ratios = torch.exp(pi - pi_old)
    loss_clipped = -adv * torch.clamp(ratios, 1.0 - eps, 1.0 + eps)
    loss_unclipped = -adv * ratios
    clipfrac = _masked_mean_tt((loss_clipped > loss_unclipped).float(), pmask)
    policy_loss = _masked_mean_tt(torch.maximum(loss_clipped, loss_unclipped), pmask)
    values_clipped = torch.clamp(phi, phi_old - clip, phi_old + clip)
    value_terms = torch.maximum((phi - returns) ** 2, (values_clipped - returns) ** 2)
    value_loss = 0.5 * _masked_mean_tt(value_terms, vmask)
    loss = policy_loss + value_loss * coeff
    return loss, policy_loss.detach(), value_loss.detach(), ratios.mean().detach(), clipfrac


def eager_value_loss(values, old_values, returns, mask):
    """Seed 004's clipped value loss, ``0.5 * max(...)``, token-mean over the mask."""
    m = mask.to(values.dtype)
    clipped = torch.clamp(values, old_values - VALUE_CLIP, old_values + VALUE_CLIP)
    terms = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return ((terms * m).sum() / m.sum(),)


def eager_masked_whiten(x, mask):
    """TRL's ``masked_whiten`` (zero mean, Bessel-corrected masked variance)."""
    m = mask.to(x.dtype)
    mean = (x * m).sum() / m.sum()
    centred = x - mean
    n = m.sum()
    var = (centred.square() * m).sum() / n * (n / (n - 1))
    return (centred * torch.rsqrt(var + 1e-8),)


def eager_gae(rewards, values, mask):
    """Seed 004's GAE loop over T (rewards and values zeroed where masked)."""
    gamma, lam = GAE["gamma"], GAE["lam"]
    m = mask.to(rewards.dtype)
    rewards, values = rewards * m, values * m
    length = rewards.shape[1]
    last = 0.0
    reversed_adv = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return advantages * m, returns * m


# ----------------------------------------------------------------------------- TRL style


def trl_selective_log_softmax(logits, index):
    """TRL's memory-lean ``log_softmax(logits).gather(index)``: fp32 takes the gathered logit
    minus a per-row ``logsumexp`` (looped over dim 0); bf16 loops ``log_softmax`` per row."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    rows = [
        torch.log_softmax(row, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        for row, ids in zip(logits, index)
    ]
    return torch.stack(rows)


def trl_entropy_from_logits(logits, chunk_rows: int = 128):
    """TRL's ``entropy_from_logits``: ``-sum p log p`` over chunks of ``chunk_rows`` rows."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_rows, dim=0):
        logp = torch.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def trl_token_stats(logits, targets, with_entropy: bool):
    scaled = logits / TEMPERATURE  # TRL always divides (a copy in the logits' dtype)
    logp = trl_selective_log_softmax(scaled, targets)
    if not with_entropy:
        return (logp,)
    return logp, trl_entropy_from_logits(scaled)


def trl_policy_loss(logits, targets, advantages, old, ref, mask, variant: str, is_weights=None):
    with_entropy = variant == "grpo+entropy"
    stats = trl_token_stats(logits, targets, with_entropy)
    entropy = stats[1] if with_entropy else None
    logp = stats[0].float()
    return (token_policy_loss(logp, entropy, advantages, old, ref, mask, variant, is_weights),)


# ----------------------------------------------------------------------------- fused_rl


def _fused_fn(name: str, backend: str):
    import fused_rl

    if not hasattr(fused_rl, name):
        raise Unavailable(f"fused_rl.{name} does not exist yet")
    fn = getattr(fused_rl, name)
    params = inspect.signature(fn).parameters
    takes_backend = "backend" in params
    if backend == "reference" and not takes_backend:
        raise Unavailable(f"fused_rl.{name} has no backend= argument")
    fixed = {"backend": backend} if takes_backend else {}
    if LINEAR_CHUNK_TOKENS is not None and "chunk_tokens" in params:
        fixed["chunk_tokens"] = LINEAR_CHUNK_TOKENS
    return (lambda *a, **k: fn(*a, **fixed, **k)) if fixed else fn


def _policy_kwargs(inp: dict, variant: str) -> dict:
    """fused_rl's policy-loss keywords for the benchmark's objective of ``variant`` (the
    eager :func:`token_policy_loss`)."""
    kwargs = dict(
        old_logprobs=inp["old_logprobs"],
        ref_logprobs=inp["ref_logprobs"],
        mask=inp["mask"],
        temperature=TEMPERATURE,
        eps_low=POLICY["eps_low"],
        eps_high=POLICY["eps_high"],
        beta=POLICY["beta"],
        kl_estimator=POLICY["kl_estimator"],
        entropy_coef=POLICY["entropy_coef"] if variant == "grpo+entropy" else 0.0,
        importance_sampling="sequence" if variant in ("gspo", "gmpo") else "token",
        loss_agg=LOSS_AGG.get(variant, "token-mean"),
    )
    if variant in ("cispo", "gmpo"):
        kwargs["surrogate"] = variant
    if variant == "cispo":
        kwargs.update(eps_low=CISPO["eps_low"], eps_high=CISPO["eps_high"])
    if variant == "grpo+is":
        kwargs["is_weights"] = inp["is_weights"]
    if variant in FULL_KL_VARIANTS:
        # the reference model's (B, T + 1, V) buffer as it comes, as the policy's
        kwargs.update(ref_logprobs=None, ref_logits=inp["ref_buf"], kl_estimator="full")
    return kwargs


def _k3_kwargs(inp: dict, variant: str) -> dict:
    """``fused_rl_k3``: the exact-KL variant's keywords with the k3 estimate in place of the
    exact KL, from the reference's log-prob of each target (``inp["ref_logprobs"]``)."""
    if variant not in FULL_KL_VARIANTS:
        raise Unavailable(f"fused_rl_k3 is the k3 call beside the exact KL ({FULL_KL_VARIANTS})")
    return _policy_kwargs(inp, variant) | dict(
        ref_logits=None, ref_logprobs=inp["ref_logprobs"], kl_estimator="k3"
    )


def _distill_kwargs(inp: dict, variant: str) -> dict:
    """fused_rl's distillation keywords for ``variant``: its beta, the temperature, the
    case's mask (token-mean over it, as every distillation provider)."""
    return dict(beta=DISTILL_BETAS[variant], temperature=TEMPERATURE, mask=inp["mask"])


def _fused_materialised_forward(case: Case, inp: dict):
    """``fused_rl_mat``: ``F.linear`` over all ``T + 1`` hidden positions (the model's
    ``(B, T + 1, V)`` logits), then fused_rl's Triton logits op on that buffer as it comes
    (its backward writes the whole buffer's gradient, zero at the last position)."""
    if case.op == "linear_token_logprobs" and case.variant == "stats":
        stats = _fused_fn("token_stats", "triton")

        def forward():
            logits = F.linear(inp["hidden"], inp["weight"])
            s = stats(logits, inp["targets"], temperature=TEMPERATURE)
            return (*s[:4], s.is_top1.float())

        return forward
    if case.op == "linear_token_logprobs":
        fn = _fused_fn("token_logprobs", "triton")
        with_entropy = case.variant == "logp+entropy"

        def forward():
            logits = F.linear(inp["hidden"], inp["weight"])
            out = fn(logits, inp["targets"], temperature=TEMPERATURE, return_entropy=with_entropy)
            return out if with_entropy else (out,)

        return forward
    if case.op == "linear_policy_loss":
        fn = _fused_fn("policy_loss", "triton")
        kwargs = _policy_kwargs(inp, case.variant)

        def forward():
            logits = F.linear(inp["hidden"], inp["weight"])
            return (fn(logits, inp["targets"], inp["advantages"], **kwargs)[0],)

        return forward
    if case.op == "linear_distill_loss":
        fn = _fused_fn("distill_loss", "triton")
        kwargs = _distill_kwargs(inp, case.variant)

        def forward():
            logits = F.linear(inp["hidden"], inp["weight"])
            with torch.no_grad():
                teacher_logits = F.linear(inp["teacher_hidden"], inp["teacher_weight"])
            return (fn(logits, teacher_logits, **kwargs)[0],)

        return forward
    raise Unavailable(
        "fused_rl_mat is the linear ops' materialised fused path (F.linear, then fused_rl's "
        "logits op)"
    )


def _fused_variant_forward(case: Case, inp: dict, provider: str):
    """A :data:`FUSED_VARIANTS` provider: fused_rl's Triton ``policy_loss`` with its
    keywords, on the ``(B, T + 1, V)`` buffer (a copy of its own for those that write into
    it: every measured run after the first reads the previous run's gradient as logits, as
    ``liger_inplace``, the same bytes and launches; the first run, checked against the
    oracle, reads the logits)."""
    key, options = FUSED_VARIANTS[provider]
    if case.op != "policy_loss":
        raise Unavailable(f"{provider} is fused_rl's policy_loss with {options}")
    if options.get("grad_in_forward") and case.variant not in TWO_PASS_VARIANTS:
        raise Unavailable(
            f"grad_in_forward needs token-level importance sampling ({case.variant}: every "
            "sequence's total before any token's gradient)"
        )
    fn = _fused_fn(case.op, "triton")
    kwargs = _policy_kwargs(inp, case.variant) | options
    logits = inp["buf_leaf"]
    if key is not None:
        logits = inp[key] = logits.detach().clone().requires_grad_()
    return lambda: (fn(logits, inp["targets"], inp["advantages"], **kwargs)[0],)


def _fused_forward(case: Case, inp: dict, backend: str, k3: bool = False):
    """fused_rl's op of the case on ``backend``; ``k3``: the k3 call beside the exact KL
    (``fused_rl_k3``, policy_loss only)."""
    if k3 and case.op != "policy_loss":
        raise Unavailable("fused_rl_k3 is policy_loss's k3 call beside its exact KL")
    if case.op == "topk_distill_loss":
        if backend != "triton":
            raise Unavailable("the verl adapter, as verl's function, takes no backend")
        from fused_rl.compat.verl import compute_forward_kl_topk

        args = [inp[k] for k in ("logits", "teacher_topk_logprobs", "teacher_topk_ids")]
        config = _topk_config()
        return lambda: _topk_token_mean(compute_forward_kl_topk(*args, config), inp["mask"])
    fn = _fused_fn(case.op, backend)
    if case.op == "distill_loss":
        kwargs = _distill_kwargs(inp, case.variant)
        return lambda: (fn(inp["logits"], inp["teacher_logits"], **kwargs)[0],)
    if case.op == "linear_distill_loss":
        kwargs = _distill_kwargs(inp, case.variant)
        args = [inp[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
        return lambda: (fn(*args, **kwargs)[0],)
    if case.op == "token_logprobs" and case.variant in TRUNCATED_VARIANTS:
        # the (B, T, V) slice: a truncated call takes targets of the logits' leading shape
        cuts = TRUNCATED_VARIANTS[case.variant]
        return lambda: (fn(inp["logits"], inp["targets"], temperature=TEMPERATURE, **cuts),)
    if case.op == "token_logprobs" and case.variant == "stats":
        stats = _fused_fn("token_stats", backend)

        def forward():
            s = stats(inp["logits"], inp["targets"], temperature=TEMPERATURE)
            return (*s[:4], s.is_top1.float())

        return forward
    if case.op == "token_logprobs":
        with_entropy = case.variant == "logp+entropy"

        def forward():
            out = fn(
                inp["logits"], inp["targets"], temperature=TEMPERATURE, return_entropy=with_entropy
            )
            return out if with_entropy else (out,)

        return forward
    if case.op == "policy_loss":
        kwargs = (_k3_kwargs if k3 else _policy_kwargs)(inp, case.variant)
        # the model's (B, T+1, V) buffer as it comes (as Liger gets it): the backward writes
        # its whole gradient, zero in the last position, with no slice backward
        logits = inp["buf_leaf"] if backend == "triton" else inp["logits"]
        return lambda: (fn(logits, inp["targets"], inp["advantages"], **kwargs)[0],)
    if case.op == "linear_token_logprobs" and case.variant == "stats":
        stats = _fused_fn("linear_token_stats", backend)
        args = [inp[k] for k in ("hidden", "weight", "targets")]

        def forward():
            s = stats(*args, temperature=TEMPERATURE)
            return (*s[:4], s.is_top1.float())

        return forward
    if case.op == "linear_token_logprobs":
        with_entropy = case.variant == "logp+entropy"

        def forward():
            out = fn(inp["hidden"], inp["weight"], inp["targets"], temperature=TEMPERATURE,
                     return_entropy=with_entropy)  # fmt: skip
            return out if with_entropy else (out,)

        return forward
    if case.op == "linear_policy_loss":
        if case.variant != "grpo":
            raise ValueError(f"no linear_policy_loss variant {case.variant!r}")
        kwargs = _policy_kwargs(inp, case.variant)
        args = [inp[k] for k in ("hidden", "weight", "targets", "advantages")]
        return lambda: (fn(*args, **kwargs)[0],)
    if case.op == "ppo_loss":
        return lambda: tuple(
            fn(
                *_ppo_args(inp),
                **PPO,
            )
        )
    if case.op == "value_loss":
        return lambda: (
            fn(
                inp["values"],
                inp["old_values"],
                inp["returns"],
                mask=inp["mask"],
                clip=VALUE_CLIP,
                loss_agg="token-mean",
            )[0],
        )
    if case.op == "masked_whiten":
        return lambda: (fn(inp["x"], inp["mask"]),)
    if case.op == "gae":
        return lambda: tuple(fn(inp["rewards"], inp["values"], mask=inp["mask"], **GAE))
    raise ValueError(case.op)


def _ppo_args(inp):
    keys = (
        "pi_old_logprobs",
        "pi_logprobs",
        "advantages",
        "phi_old_values",
        "phi_values",
        "returns",
        "padding_masks",
        "value_padding_masks",
    )
    return [inp[k] for k in keys]


# ----------------------------------------------------------------------------- eager/compile


_COMPILED: dict = {}


def _compiled(key, fn):
    """One ``torch.compile`` object per function: a new shape recompiles (then goes dynamic).

    Dynamo counts recompiles per code object and by default falls back to eager -- silently
    -- after 8; the suite's shapes x variants exceed that, so the limit is raised and hitting
    it is an error, never an eager run reported as "compile"."""
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6 / older name
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), 64))
    if hasattr(dynamo.config, "fail_on_recompile_limit_hit"):
        dynamo.config.fail_on_recompile_limit_hit = True
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn)
    return _COMPILED[key]


def _eager_forward(case: Case, inp: dict, compiled: bool, flavour: str = "eager"):
    """The eager (or TRL-style) function of the case, optionally through torch.compile."""
    op, variant = case.op, case.variant
    if op == "token_logprobs" and variant == "stats":
        if flavour == "trl":
            raise Unavailable("TRL computes these inside its fused head only (e2e_trl_pref)")
        fn = _compiled((flavour, op, variant), eager_token_stats) if compiled else eager_token_stats
        return lambda: fn(inp["logits"], inp["targets"])
    if op == "token_logprobs" and variant in TRUNCATED_VARIANTS:
        if flavour == "trl":
            raise Unavailable("TRL has no truncated (top-k / top-p) log-prob")
        base = eager_truncated_variant
        fn = _compiled((flavour, op, variant), base) if compiled else base
        return lambda: fn(inp["logits"], inp["targets"], variant)
    if op == "token_logprobs":
        with_entropy = variant == "logp+entropy"
        base = trl_token_stats if flavour == "trl" else eager_token_logprobs
        fn = _compiled((flavour, op, with_entropy), base) if compiled else base
        return lambda: fn(inp["logits"], inp["targets"], with_entropy)
    if op == "policy_loss" and variant in FULL_KL_VARIANTS:
        if flavour == "trl":
            raise Unavailable("TRL's GRPO loss has no exact KL (k3 from two log-probs a token)")
        fn = eager_full_kl_policy_loss
        fn = _compiled((flavour, op, variant), fn) if compiled else fn
        args = [inp[k] for k in ("logits", "ref_logits", "targets", "advantages")]
        args += [inp[k] for k in ("old_logprobs", "mask")]
        return lambda: fn(*args, variant)
    if op == "policy_loss":
        base = trl_policy_loss if flavour == "trl" else eager_policy_loss
        fn = _compiled((flavour, op, variant), base) if compiled else base
        args = [inp[k] for k in ("logits", "targets", "advantages")]
        args += [inp[k] for k in ("old_logprobs", "ref_logprobs", "mask")]
        is_weights = inp.get("is_weights")  # grpo+is only
        return lambda: fn(*args, variant, is_weights)
    if op == "linear_token_logprobs" and variant == "stats":
        base = eager_linear_token_stats
        fn = _compiled((flavour, op, variant), base) if compiled else base
        return lambda: fn(inp["hidden"], inp["weight"], inp["targets"])
    if op == "linear_token_logprobs":
        with_entropy = variant == "logp+entropy"
        base = eager_linear_token_logprobs
        fn = _compiled((flavour, op, with_entropy), base) if compiled else base
        return lambda: fn(inp["hidden"], inp["weight"], inp["targets"], with_entropy)
    if op == "linear_policy_loss":
        base = eager_linear_policy_loss
        fn = _compiled((flavour, op, variant), base) if compiled else base
        args = [inp[k] for k in ("hidden", "weight", "targets", "advantages")]
        args += [inp[k] for k in ("old_logprobs", "ref_logprobs", "mask")]
        return lambda: fn(*args, variant)
    if op in DISTILL_OPS and flavour == "eager":
        if op == "topk_distill_loss":
            fn = _compiled((flavour, op), eager_topk_distill_loss) if compiled else (
                eager_topk_distill_loss)  # fmt: skip
            keys = ("logits", "teacher_topk_logprobs", "teacher_topk_ids", "mask")
            args = [inp[k] for k in keys]
            return lambda: fn(*args)
        if op == "distill_loss":
            base, keys = eager_distill_loss, ("logits", "teacher_logits", "mask")
        else:
            base = eager_linear_distill_loss
            keys = ("hidden", "weight", "teacher_hidden", "teacher_weight", "mask")
        fn = _compiled((flavour, op, variant), base) if compiled else base
        args = [inp[k] for k in keys]
        return lambda: fn(*args, variant)
    if flavour == "trl":
        raise Unavailable("TRL-style provider covers the logits ops only")
    table = {
        "ppo_loss": (eager_ppo_loss, lambda: _ppo_args(inp)),
        "value_loss": (
            eager_value_loss,
            lambda: [inp["values"], inp["old_values"], inp["returns"], inp["mask"]],
        ),
        "masked_whiten": (eager_masked_whiten, lambda: [inp["x"], inp["mask"]]),
        "gae": (eager_gae, lambda: [inp["rewards"], inp["values"], inp["mask"]]),
    }
    base, args = table[op]
    if compiled and op == "gae":
        raise Unavailable(
            "torch.compile of the seed's GAE loop unrolls all T steps (minutes of compile "
            "time per shape); not measured"
        )
    fn = _compiled((flavour, op), base) if compiled else base
    return lambda: fn(*args())


# ----------------------------------------------------------------------------- liger


def liger_version() -> str | None:
    try:
        importlib.import_module("liger_kernel")
    except Exception:
        return None
    return package_version("liger-kernel")


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(provider: str, device, compile_on_cpu: bool) -> str:
    """What this machine offers ``provider`` (a package version, a compile switch): a note
    that it could not run here is retried by ``--resume`` only where this has changed."""
    if provider in ("liger", "liger_inplace"):
        return f"liger_kernel {liger_version()}"
    if provider in ("trl", "verl"):
        return f"{provider} {package_version(provider)}, torch {torch.__version__}"
    if provider == "compile":
        return f"torch {torch.__version__} on {torch.device(device).type}, cpu {compile_on_cpu}"
    return f"torch {torch.__version__}"


def _liger_import(module: str, name: str):
    """``module.name``, or ``Unavailable``: importing Liger's submodules runs all of their
    imports, which can fail where the top-level package imports fine."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:
        reason = f"{module}.{name}: {type(exc).__name__}: {exc}"[:200]
        raise Unavailable(reason, transient=True) from exc


def _liger_linear_forward(case: Case, inp: dict):
    """``LigerFusedLinearGRPOLoss`` on the ``(B, T, H)`` hidden rows that predict the
    targets (a contiguous leaf of their own, ``inp["hidden_window"]``, made here outside the
    measured call), with the benchmark's hyper-parameters. Its ``bnpo`` aggregation is the
    benchmark's token mean: ``sum(per_token * mask) / mask.sum()``; its per-token loss is
    ``-min(r A, clip(r) A) + beta k3(ref, logp)``, the same objective."""
    if case.op != "linear_policy_loss":
        raise Unavailable("Liger has no public fused-linear per-token log-prob op")
    loss_cls = _liger_import("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
    params = inspect.signature(loss_cls.__init__).parameters
    needed = ("beta", "epsilon_low", "epsilon_high", "loss_type", "temperature", "use_ref_model")
    missing = [name for name in needed if name not in params]
    if missing:  # an older Liger: its aggregation and clipping cannot be set to match
        raise Unavailable(
            f"this LigerFusedLinearGRPOLoss has no {', '.join(missing)}: its semantics "
            "cannot be matched to the benchmark's (token-mean, beta, eps_low/eps_high)",
            transient=True,
        )
    kwargs = dict(
        beta=POLICY["beta"],
        epsilon_low=POLICY["eps_low"],
        epsilon_high=POLICY["eps_high"],
        loss_type="bnpo",  # token mean over the whole batch's mask
        temperature=TEMPERATURE,
        use_ref_model=True,  # the k3 KL against the given ref_per_token_logps
    )
    if "importance_sampling_level" in params:
        kwargs["importance_sampling_level"] = "token"
    loss_fn = loss_cls(**kwargs)
    window = inp["hidden"][:, :-1].detach().contiguous().requires_grad_()
    inp["hidden_window"] = window
    mask = inp["mask"].to(torch.float32)

    def forward():
        out = loss_fn(
            window,
            inp["weight"],
            inp["targets"],
            mask,
            inp["advantages"],
            ref_per_token_logps=inp["ref_logprobs"],
            old_per_token_logps=inp["old_logprobs"],
        )
        return (out[0] if isinstance(out, (tuple, list)) else out,)

    return forward


def _liger_distill_forward(case: Case, inp: dict):
    """Liger's JSD losses with the case's beta (Liger's ``beta`` is TRL's: 0 the forward KL,
    1 the reverse KL) and temperature; ``labels`` (-100 off the mask) as ``shift_labels``,
    so Liger's mean over the counted rows is the benchmark's token mean. ``distill_loss``:
    ``LigerJSD`` on fp32 log-probabilities, ``log_softmax(logits.float() / T)`` of each model
    (the student's gradient goes back through its ``log_softmax``); ``linear_distill_loss``:
    ``LigerFusedLinearJSD`` on the ``(B*T, H)`` rows (views of the hidden-state leaves)."""
    beta = DISTILL_BETAS[case.variant]
    labels = inp["labels"].reshape(-1)
    if case.op == "distill_loss":
        loss_fn = _liger_import("liger_kernel.transformers.jsd", "LigerJSD")(beta=beta)
        logits, teacher = inp["logits"], inp["teacher_logits"]
        vocab = logits.shape[-1]

        def forward():
            log_q = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).view(-1, vocab)
            with torch.no_grad():
                log_p = torch.log_softmax(teacher.float() / TEMPERATURE, dim=-1).view(-1, vocab)
            return (loss_fn(log_q, log_p, labels),)

        return forward
    loss_cls = _liger_import("liger_kernel.transformers.fused_linear_jsd", "LigerFusedLinearJSD")
    loss_fn = loss_cls(jsd_beta=beta, temperature=TEMPERATURE)
    rows = lambda x: x.view(-1, x.shape[-1])  # noqa: E731
    student, teacher = rows(inp["hidden"]), rows(inp["teacher_hidden"])
    weight, t_weight = inp["weight"], inp["teacher_weight"]
    return lambda: (loss_fn(student, weight, teacher, t_weight, labels),)


def _liger_forward(case: Case, inp: dict, inplace: bool = False):
    if case.op == "topk_distill_loss":
        raise Unavailable("Liger has no top-k distillation loss")
    if case.op == "token_logprobs" and case.variant in TRUNCATED_VARIANTS:
        raise Unavailable("Liger has no truncated (top-k / top-p) log-prob")
    if liger_version() is None:
        raise Unavailable("liger_kernel is not importable", transient=True)
    if case.op in DISTILL_OPS:
        return _liger_distill_forward(case, inp)
    if case.op in ("linear_token_logprobs", "linear_policy_loss"):
        return _liger_linear_forward(case, inp)
    if case.op == "token_logprobs":
        if case.mode != "fwd_nograd" or case.variant != "logp":
            raise Unavailable("Liger has a no-grad fused log-prob only (no entropy, no backward)")
        fused_selective_log_softmax = _liger_import("liger_kernel.ops.grpo_loss",
                                                    "fused_selective_log_softmax")  # fmt: skip

        buf, targets = inp["buf"], inp["targets"]
        return lambda: (fused_selective_log_softmax(buf, targets, TEMPERATURE),)
    if case.op != "policy_loss":
        raise Unavailable(f"Liger has no {case.op}")
    if case.variant in FULL_KL_VARIANTS:
        raise Unavailable("Liger's GRPO loss has no exact KL (k3 from two log-probs a token)")
    if case.variant == "grpo+entropy":
        raise Unavailable("Liger's GRPO loss has no entropy bonus")
    if case.variant == "gmpo":
        raise Unavailable("Liger has no GMPO (geometric-mean) loss")
    triton_grpo_loss = _liger_import("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")

    params = inspect.signature(triton_grpo_loss).parameters
    kwargs = dict(
        temperature=TEMPERATURE,
        beta=POLICY["beta"],
        eps_low=POLICY["eps_low"],
        eps_high=POLICY["eps_high"],
        # Liger's default inplace=True writes the gradient into the logits buffer: then it
        # gets a copy of its own (every provider reuses the logits)
        inplace=inplace,
    )
    if "reduce" in params:
        kwargs["reduce"] = False  # per-token loss; we aggregate token-mean like the others
    if case.variant == "gspo":
        if "importance_sampling_level" not in params:
            raise Unavailable(
                "this liger_kernel has no importance_sampling_level (GSPO)", transient=True
            )
        kwargs["importance_sampling_level"] = "sequence"
    if case.variant == "cispo":
        if "loss_type" not in params:
            raise Unavailable("this liger_kernel has no loss_type (CISPO)", transient=True)
        # Liger's CISPO weight is sg(min(r, eps_high)), eps_high the absolute cap C: the
        # benchmark's band [1 - 1, 1 + 0.28] is exactly min(r, 1.28) (r > 0)
        kwargs.update(loss_type="cispo", eps_high=1.0 + CISPO["eps_high"])
    if case.variant == "grpo+is":
        if "vllm_is_ratio" not in params:
            raise Unavailable("this liger_kernel has no vllm_is_ratio (IS weights)", transient=True)
        # Liger multiplies the per-token PPO term by it before adding the KL, as fused_rl
        kwargs["vllm_is_ratio"] = inp["is_weights"]
    mask = inp["mask"]
    mask_int = mask.to(torch.int32)
    m = mask.float()
    buf = inp["buf_leaf"]
    if inplace:
        if case.op != "policy_loss":
            raise Unavailable("liger_inplace is Liger's GRPO loss with inplace=True")
        buf = inp["buf_inplace"] = buf.detach().clone().requires_grad_()

    def forward():
        per_token = triton_grpo_loss(
            buf,
            inp["old_logprobs"],
            inp["ref_logprobs"],
            inp["targets"],
            inp["advantages"],
            mask_int,
            **kwargs,
        )[0]
        return ((per_token * m).sum() / m.sum(),)

    return forward


# ----------------------------------------------------------------------------- TRL, verl

# GRPOTrainer's vocabulary tile (``_CHUNKED_LOGPROB_CHUNK_SIZE``, TRL 1.16)
TRL_VOCAB_CHUNK = 32768
VERL_TOKEN_CHUNK = 512  # FusedLinearForPPO's default chunk_size


def _trl_chunked_logprob():
    try:  # the kernels module needs transformers only (trl.trainer.utils also needs datasets)
        module = importlib.import_module("trl.kernels.chunked_logprob")
    except Exception as exc:
        raise Unavailable(f"trl.kernels.chunked_logprob: {type(exc).__name__}: {exc}"[:200],
                          transient=True) from exc  # fmt: skip
    return module.ChunkedLogProbFunction


def _verl_fused_linear():
    """verl's ``FusedLinearForPPO`` class, loaded from its file in the installed verl: the
    module imports torch only, but verl's package ``__init__`` imports Ray and more."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("verl is not installed", transient=True)
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "utils", "experimental", "torch_functional.py")
    if not os.path.exists(path):
        raise Unavailable("this verl has no utils/experimental/torch_functional.py", transient=True)
    file_spec = importlib.util.spec_from_file_location("_bench_verl_torch_functional", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module.FusedLinearForPPO


def _linear_loss_forward(case: Case, inp: dict, logprobs):
    """``logprobs(with_entropy) -> (logp (B, T), entropy or None)`` of a peer's fused head,
    then the case's output: the log-probs, or the benchmark's GRPO loss on them."""
    with_entropy = case.variant == "logp+entropy"
    if case.op == "linear_token_logprobs":

        def forward():
            logp, entropy = logprobs(with_entropy)
            return (logp, entropy) if with_entropy else (logp,)

        return forward
    args = [inp[k] for k in ("advantages", "old_logprobs", "ref_logprobs", "mask")]
    return lambda: (token_policy_loss(logprobs(False)[0], None, *args, case.variant),)


def _trl_linear_forward(case: Case, inp: dict):
    """TRL's fused head as GRPOTrainer calls it: for the loss, on the valid positions only
    (``hidden[mask]``, then ``masked_scatter`` back), with the entropy GRPOTrainer logs; for
    the log-probs, on every position (the case's output), as TRL does off Triton devices."""
    fn = _trl_chunked_logprob()
    window, weight, targets, mask = (
        inp["hidden"][:, :-1],
        inp["weight"],
        inp["targets"],
        inp.get("mask"),
    )
    hidden_size = window.shape[-1]
    if case.variant == "stats":  # TRL 1.16's head computes every output of the case

        def forward():  # the rows' copy (a strided window) measured, as in logprobs below
            rows = (window.reshape(-1, hidden_size), weight, None, targets.reshape(-1))
            out = fn.apply(*rows, TEMPERATURE, TRL_VOCAB_CHUNK, None, 1.0,
                           ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))  # fmt: skip
            logp, entropy, log_sq, mean, top1 = (x.view(targets.shape) for x in out)
            return logp, entropy, mean, log_sq, top1.float()

        return forward

    def logprobs(with_entropy: bool):
        if case.op == "linear_policy_loss":
            out = fn.apply(window[mask], weight, None, targets[mask], TEMPERATURE, TRL_VOCAB_CHUNK,
                           None, 1.0, ("entropy",))  # fmt: skip
            logp = out[0].new_zeros(mask.shape).masked_scatter(mask, out[0])
            return logp, None
        outputs = ("entropy",) if with_entropy else ()
        out = fn.apply(window.reshape(-1, hidden_size), weight, None, targets.reshape(-1),
                       TEMPERATURE, TRL_VOCAB_CHUNK, None, 1.0, outputs)  # fmt: skip
        entropy = out[1].view(targets.shape) if with_entropy else None
        return out[0].view(targets.shape), entropy

    return _linear_loss_forward(case, inp, logprobs)


def _trl_linear_distill_forward(case: Case, inp: dict):
    """TRL's chunked divergence from hidden states as ``DistillationTrainer`` (TRL >= 1.16)
    runs it: the mask's positions only (``hidden[mask]``), both models projected tile by tile
    in fp32, the divergence summed over the mask's tokens over their count."""
    try:
        module = importlib.import_module("trl.kernels.chunked_divergence")
    except Exception as exc:
        raise Unavailable(f"trl.kernels.chunked_divergence: {type(exc).__name__}: {exc}"[:200],
                          transient=True) from exc  # fmt: skip
    fn = module.ChunkedDivergenceFunction
    beta = DISTILL_BETAS[case.variant]
    hidden, weight, t_hidden, t_weight, mask = (
        inp[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight", "mask")
    )

    def forward():
        divergence, _ = fn.apply(hidden[mask], weight, None, t_hidden[mask], t_weight, None,
                                 beta, TEMPERATURE)  # fmt: skip
        return (divergence.sum() / mask.sum().clamp(min=1),)

    return forward


def _verl_linear_forward(case: Case, inp: dict):
    """verl's torch ``FusedLinearForPPO`` on the positions that predict the targets."""
    if case.variant == "stats":
        raise Unavailable("verl's fused head computes log-probs and entropy only")
    head = _verl_fused_linear()(chunk_size=VERL_TOKEN_CHUNK, impl_backend="torch")
    window, weight, targets = inp["hidden"][:, :-1], inp["weight"], inp["targets"]
    return _linear_loss_forward(case, inp, lambda _: head(window, weight, targets, TEMPERATURE))


# ----------------------------------------------------------------------------- entry point


def _wrt_upstream(case: Case, inp: dict, provider: str):
    if case.op in ("distill_loss", "topk_distill_loss"):
        return [inp["logits"]], [None], None
    if case.op == "linear_distill_loss":
        return [inp["hidden"], inp["weight"]], [None], None
    if case.op == "token_logprobs":
        ups = [inp["g_logp"]] + ([inp["g_entropy"]] if case.variant == "logp+entropy" else [])
        return [inp["logits"]], ups, None
    if case.op == "policy_loss":
        if provider in FUSED_VARIANTS:  # the shared buffer, or a copy of its own
            key = FUSED_VARIANTS[provider][0] or "buf_leaf"
            return [inp[key]], [None], lambda g: (g[0][:, :-1],)
        if provider in ("liger", "fused_rl", "fused_rl_k3"):  # the whole (B, T+1, V) buffer
            return [inp["buf_leaf"]], [None], lambda g: (g[0][:, :-1],)
        if provider == "liger_inplace":  # its own copy of the buffer
            return [inp["buf_inplace"]], [None], lambda g: (g[0][:, :-1],)
        return [inp["logits"]], [None], None
    if case.op == "linear_token_logprobs":
        ups = [inp["g_logp"]] + ([inp["g_entropy"]] if case.variant == "logp+entropy" else [])
        return [inp["hidden"], inp["weight"]], ups, None
    if case.op == "linear_policy_loss":
        if provider == "liger":  # its own (B, T, H) leaf: the last position gets no gradient
            pad = lambda g: (F.pad(g[0], (0, 0, 0, 1)), g[1])  # noqa: E731
            return [inp["hidden_window"], inp["weight"]], [None], pad
        return [inp["hidden"], inp["weight"]], [None], None
    if case.op == "ppo_loss":
        return [inp["pi_logprobs"], inp["phi_values"]], [None], None
    if case.op == "value_loss":
        return [inp["values"]], [None], None
    return [], [], None


def applies(provider: str, case: Case) -> bool:
    """Whether ``provider`` is one for ``case`` at all: ``fused_rl_mat`` (the materialised
    path of the linear ops) and ``verl`` (a fused head) have no meaning for the other ops,
    nor ``liger_inplace`` and the :data:`FUSED_VARIANTS` beside policy_loss (the two-pass
    ones beside its token-level variants), nor ``trl`` beside the distillation ops (the
    eager provider is TRL's computation), nor ``fused_rl_k3`` beside anything but the
    exact-KL variants: skipped without a 'not measured' note. Every other pairing is up to
    ``build``."""
    if provider == "fused_rl_k3":
        return case.op == "policy_loss" and case.variant in FULL_KL_VARIANTS
    if provider == "fused_rl_mat":
        return case.op in HIDDEN_OPS
    if provider == "verl":
        return case.op in LINEAR_OPS or case.op == "topk_distill_loss"
    if provider == "trl" and case.op in DISTILL_OPS:
        return case.op == "linear_distill_loss"
    if provider in FUSED_VARIANTS and FUSED_VARIANTS[provider][1].get("grad_in_forward"):
        return case.op == "policy_loss" and case.variant in TWO_PASS_VARIANTS
    if provider == "liger_inplace" or provider in FUSED_VARIANTS:
        return case.op == "policy_loss"
    return True


def build(provider: str, case: Case, inp: dict, *, compile_on_cpu: bool = False) -> Runner:
    """A callable running ``case`` once with ``provider``; raises ``Unavailable``."""
    if provider == "fused_rl":
        forward = _fused_forward(case, inp, "triton")
    elif provider == "fused_rl_ref":
        forward = _fused_forward(case, inp, "reference")
    elif provider == "fused_rl_k3":
        forward = _fused_forward(case, inp, "triton", k3=True)
    elif provider == "fused_rl_mat":
        forward = _fused_materialised_forward(case, inp)
    elif provider == "eager":
        forward = _eager_forward(case, inp, compiled=False)
    elif provider == "compile":
        device = next(v.device for v in inp.values() if isinstance(v, torch.Tensor))
        if device.type == "cpu" and not compile_on_cpu:
            raise Unavailable(
                "torch.compile skipped on CPU (compile time; --compile-cpu runs it)",
                transient=True,
            )
        if not case.compile_ok:
            raise Unavailable("torch.compile measured on the suite's compile subset only")
        forward = _eager_forward(case, inp, compiled=True)
    elif provider == "trl":
        if case.op == "linear_distill_loss":
            forward = _trl_linear_distill_forward(case, inp)
        elif case.op in LINEAR_OPS:
            forward = _trl_linear_forward(case, inp)
        else:
            forward = _eager_forward(case, inp, compiled=False, flavour="trl")
    elif provider == "verl":
        if case.op == "topk_distill_loss":
            forward = _verl_topk_forward(inp)
        else:
            forward = _verl_linear_forward(case, inp)
    elif provider == "liger":
        forward = _liger_forward(case, inp)
    elif provider == "liger_inplace":
        forward = _liger_forward(case, inp, inplace=True)
    elif provider in FUSED_VARIANTS:
        forward = _fused_variant_forward(case, inp, provider)
    else:
        raise ValueError(f"unknown provider {provider!r}; one of {PROVIDERS}")
    wrt, upstream, post = _wrt_upstream(case, inp, provider)
    return _runner(case, forward, wrt, upstream, post)
