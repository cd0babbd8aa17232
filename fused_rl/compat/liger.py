"""Drop-in replacements for Liger-Kernel's Triton GRPO loss, on fused_rl's fused policy loss,
and for its JSD losses (``liger_jsd`` / ``LigerJSD``, ``liger_fused_linear_jsd`` /
``LigerFusedLinearJSD``), on :func:`fused_rl.distill_loss` /
:func:`fused_rl.linear_distill_loss` (see "The JSD losses" below).

Change ``from liger_kernel.transformers.grpo_loss import triton_grpo_loss`` to
``from fused_rl.compat.liger import triton_grpo_loss``. Liger is not imported (nor needed).

Mirrors ``liger_kernel/transformers/grpo_loss.py::triton_grpo_loss`` of Liger-Kernel 0.8.5
(and its op, ``liger_kernel/ops/grpo_loss.py::GrpoLossFunction``): the signature and defaults,
the logits layout, the loss types ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``,
``cispo``, ``sapo``, ``vespo``, token- and sequence-level importance sampling,
``vllm_is_ratio``, ``delta``, ``use_bias_correction_kl``, ``num_items_in_batch``, ``reduce``
and the return values.

What Liger does, and so the adapter does:

* ``logits`` are the model's ``(B, L + 1, V)`` output for ``(B, L)`` ``completion_ids``:
  position ``t`` predicts ``completion_ids[:, t]``, the last position is not used (its
  gradient is 0). ``log p = log_softmax(logits / temperature)`` (default ``0.9``).
* Per token, ``r = exp(log p - old_logp)`` (``old_logp=None``: on-policy, ``r = 1`` with the
  policy gradient), ``A`` the sequence's advantage:

  - ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo`` / ``luspo``: ``-min(min(r, delta) A,
    clamp(r, 1 - eps_low, 1 + eps_high) A)`` (``delta=None``: no cap);
  - ``cispo``: ``-sg(min(r, eps_high)) A log p``: ``eps_high`` is the absolute cap (Liger's
    and TRL's CISPO; verl's is a band around 1);
  - ``sapo``: ``-A sigmoid(tau (r - 1)) 4 / tau``, ``tau = sapo_temperature_pos`` where
    ``A > 0``, else ``sapo_temperature_neg``;
  - ``vespo``: ``-sg(phi_i) A log p`` with TRL's / Liger's ``get_gamma_weights``:
    ``S_i = sum_t clamp(d_t, -20, 20) m_t + sum_t clamp(log v_t, ln 1e-8, 20)`` (``d`` the
    log-ratio, ``v`` the vLLM ratio over every position of its row; a ``(B,)`` / ``(B, 1)``
    one once), ``ln w = clamp(S_i, ln 1e-8, 20)``, ``phi = exp(lam + k ln w - lam w)``
    (NaN / inf as 0), ``(k, lam)`` the ``vespo_*_pos`` pair where ``A >= 0``, else
    ``_neg``, ``lam >= 1e-4``; the vLLM ratio is folded into ``phi`` only;

  times ``vllm_is_ratio`` (``(B, L)``, ``(B, 1)`` or ``(B,)``; not ``vespo``), plus
  ``beta * k3`` with ``k3 = exp(ref - log p) - (ref - log p) - 1`` (times ``r``, not detached, with
  ``use_bias_correction_kl``: DeepSeek-V3.2).
* ``importance_sampling_level="sequence"`` (GSPO; PPO types only): ``r`` is the sequence's
  ``exp(sum_t (log p - old) m / max(sum_t m, 1))``, differentiated through every token.
* Aggregation (``reduce=True``), ``m`` the completion mask: ``grpo`` / ``sapo``
  ``mean_i sum_t L m / max(n_i, 1)``; ``bnpo`` ``sum L m / max(sum m, 1)``; ``dr_grpo``
  ``sum L m / (B * max_completion_length)`` (default ``L``); ``luspo`` TRL's
  ``mean(L * n_i)`` (below); ``dapo`` / ``cispo`` / ``vespo``
  ``sum L m / max(N / world_size, 1)`` with ``N = num_items_in_batch``, or, when None, the
  mask's sum all-reduced over the default process group when ``torch.distributed`` is
  initialised (Liger's ``_compute_dapo_normalizer``).
* Returns, with ``reduce=True``: ``(loss, [kl_mean, clip_ratio])`` (``kl_mean`` only when
  ``beta != 0``): 0-dim fp32 tensors, the metrics ``sum x m / max(sum m, 1)`` of the
  per-token KL (the bias-corrected one when corrected) and the clip indicator (PPO types:
  ``r < 1 - eps_low`` where ``A < 0`` or ``r > 1 + eps_high`` where ``A > 0``, ``r`` before
  ``delta``; ``cispo``: ``r > eps_high`` where ``A > 0``; ``sapo``, ``vespo``: 0). With
  ``reduce=False`` (Liger's default): ``(per_token_loss, per_token_kl, is_clipped)``, each
  ``(B, L)`` fp32 times the mask (``per_token_kl`` None when ``beta == 0``).
* Errors as Liger: ``AssertionError`` for missing ``logits`` / ``completion_ids`` /
  ``advantages``, an unknown ``importance_sampling_level`` or ``beta != 0`` without
  ``ref_logp``; ``ValueError`` for an unknown ``loss_type``, ``delta`` with ``cispo`` /
  ``sapo`` / ``vespo``, sequence level with ``cispo`` / ``sapo`` / ``vespo`` (for
  ``vespo`` Liger's wrapper message, first), a SAPO temperature ``<= 0``.

How it runs: with ``reduce=True``, one :func:`fused_rl.policy_loss` call on the logits (one
pass over them forward with the loss as its epilogue, one backward; the metrics from its
reduction). The outputs fused_rl's fused loss does not give (the per-token losses of
``reduce=False``; the bias-corrected ``kl_mean``) and ``luspo`` / ``vespo`` (which need
the log-probs first, as Liger's VESPO does) take :func:`fused_rl.token_logprobs` (the same
one pass each way), then the per-token math on ``(B, L)`` tensors or
:func:`fused_rl.policy_loss_from_logprobs`: ``vespo`` as ``surrogate="gpg"`` with the
advantage ``phi_i A_i`` (the value ``-phi A log p``, the gradient ``-phi A``); ``luspo`` with
per-token weights ``m n_i / L`` over ``B``, a sequence-shaped policy term given ``L / n_i``
back through ``is_weights``.

Where it departs (docs/compat.md, "Liger"):

* ``loss_type="luspo"`` with ``reduce=True`` follows TRL's ``mean(L * n_i)`` (``n_i`` the
  row's token count), not Liger's Triton op, which under padding scales the forward by
  ``n_i^2`` at sequence level and its backward by ``1 / L`` (VARIANTS.md 3.3): per
  sequence ``n_i l_i / B`` when TRL's loss is ``(B, 1)`` (sequence level, no token-shaped
  term), else ``(1 / (B L)) sum_t n_i L_t``; the token-shaped terms (the KL, the token-level
  loss, a ``(B, L)`` vLLM ratio) are left out at padding positions, where TRL's mean adds
  whatever sits there. With an all-ones mask this is TRL's formula, and Liger's forward.
* ``inplace`` is accepted and has no effect: Liger's ``inplace=True`` writes the gradient over
  the ``logits`` tensor itself during the backward (its memory saving); fused_rl's backward
  writes one gradient buffer and never modifies ``logits``.
* Liger 0.8.5's sequence-level bias-corrected KL gradient is exact, as here and in TRL
  (Liger <= 0.8.4's Triton op used an approximation that drops the shared ratio's term).
* Liger's own checks are asserts and shapes it does not check read out of bounds: here
  ``logits`` must be ``(B, L + 1, V)`` with ``(B, L)`` ``completion_ids`` and ``(B,)``
  ``advantages`` (``ValueError``), an id outside ``[0, V)`` at a counted token raises
  ``ValueError`` (eager mode), ``delta`` must be ``> 1 + eps_high`` (``ValueError``: below
  that, Liger's ``min(r, delta)`` also flattens the loss inside the clip band for ``A > 0``),
  ``cispo`` needs a cap ``eps_high > 0``, ``eps_low`` / ``eps_high`` ``>= 0``.
* Values at masked positions never matter (Liger does not read them either); inputs need
  not be contiguous; ``logits`` of dtype fp64 are computed in fp64 (the outputs are still
  fp32, as Liger's).

The JSD losses (``liger_kernel/ops/jsd.py``, ``liger_kernel/ops/fused_linear_jsd.py``,
``liger_kernel/transformers/{jsd,fused_linear_jsd,functional}.py`` of Liger-Kernel 0.8.5):

* ``liger_jsd(input, target, shift_labels=None, beta=0.5, ignore_index=-100)``: ``input``
  ``X = log Q`` the student's and ``target`` ``Y = log P`` the teacher's ``(BT, V)``
  log-probabilities. Per row: ``beta == 0``: ``KL(P || Q) = sum P (Y - X)``;
  ``beta == 1``: ``KL(Q || P) = sum Q (X - Y)``; otherwise ``beta KL(P || M) +
  (1 - beta) KL(Q || M)`` with ``M = beta P + (1 - beta) Q``. That is TRL's
  ``generalized_jsd_loss`` and so :func:`fused_rl.distill_loss` with the SAME ``beta`` (its
  ``m = (1 - beta) p + beta q``, ``p`` the student's): no mirroring. Reduction: the sum over
  the rows whose label is not ``ignore_index`` (every row without labels) over their count
  (0 when none counts): ``loss_agg="token-mean"`` with ``targets=shift_labels``. The result
  has ``input``'s dtype (Liger's ``loss.to(_input.dtype)``); ``target`` gets no gradient.
  A log-probability row is its own ``log_softmax``, so passing both as logits gives Liger's
  value. Liger's gradient ``dX`` is the partial derivative with ``X`` as free coordinates
  (``-P``; ``Q (X - Y) + Q``; ``(1 - beta) Q (X - log M)``), not the gradient through a
  softmax: the distill kernel's ``FREE`` form gives exactly it (the two differ by
  ``Q`` times a per-row constant and agree once the gradient goes back through a
  ``log_softmax``).
* ``liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight,
  shift_labels=None, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None)``:
  ``log_softmax(x W^T / temperature)`` of each model (``(BT, H)`` / ``(BT, H')`` inputs, no
  bias), the same divergence and reduction, the gradient through the student's
  ``log_softmax`` to ``student_input`` and ``student_weight`` (the teacher gets none): exactly
  :func:`fused_rl.linear_distill_loss` with ``beta=jsd_beta``. The loss is fp32 (Liger's).
  ``accum_dtype`` (Liger: the dtype ``dW`` accumulates in, None: the weight's) is accepted:
  fused_rl accumulates ``dW`` in fp32 always (fp64 for fp64) and returns it in the weight's
  dtype.

Where the JSD adapters depart from Liger 0.8.5 (docs/compat.md): inputs that are not
log-probabilities (Liger exponentiates them as given, fused_rl normalises each row first:
the same value on log-probabilities); ``-inf`` entries of both rows give 0 (Liger: NaN);
``beta`` outside ``[0, 1]`` and ``temperature <= 0`` raise ``ValueError``; 16-bit heads give
16-bit logits (as Liger off CUDA; Liger 0.8.5 on an sm_80+ GPU asks the GEMM for fp32
logits); a teacher tensor that requires grad is detached (Liger ignores it too); inputs need
not be contiguous, and ``BT = 0`` gives 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _validation as V
from ..distill import _distill_loss
from ..linear_distill import linear_distill_loss
from ..logprobs import token_logprobs
from ..losses import policy_loss, policy_loss_from_logprobs
from ._checks import NO_IGNORE, check_index_range

# Liger's ``_str_to_loss_type`` keys, in its order (the list its ValueError prints)
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")
PPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SUPPORTED_LOSS_TYPES = LOSS_TYPES  # every one (the name kept for callers)
_LN_1E_8 = math.log(1e-8)  # VESPO's floor on the log-weights
_ORIGINAL = "Liger's triton_grpo_loss"


def _validate(loss_type, importance_sampling_level, delta, beta, ref_logp, tau_pos, tau_neg):
    """Liger's checks, in its order and with its exception types."""
    if importance_sampling_level not in ("token", "sequence"):
        raise AssertionError(
            "importance_sampling_level must be 'token' or 'sequence', got "
            f"{importance_sampling_level}"
        )
    if loss_type == "vespo" and importance_sampling_level == "sequence":  # Liger's wrapper
        raise ValueError("loss_type='vespo' requires importance_sampling_level='token'.")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type '{loss_type}'. Supported types: {list(LOSS_TYPES)}")
    if beta != 0.0 and ref_logp is None:
        raise AssertionError(f"beta = {beta} needs ref_logp (the reference policy's log-probs)")
    if delta is not None and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(
            f"delta (two-sided clipping) is not supported for loss_type='{loss_type}'."
        )
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(
            f"Sequence-level importance sampling is not supported for loss_type='{loss_type}'. "
            "Use importance_sampling_level='token' instead."
        )
    if loss_type == "sapo":
        for name, value in (("sapo_temperature_pos", tau_pos), ("sapo_temperature_neg", tau_neg)):
            V.check_number(value, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")


def _check_shapes(logits, completion_ids, advantages, **per_token) -> tuple[int, int]:
    V.check_float(logits, "logits")
    V.check_tensor(completion_ids, "completion_ids")
    if completion_ids.dtype not in V.INDEX_DTYPES:
        raise TypeError(
            f"completion_ids must be an int64 or int32 tensor, got {completion_ids.dtype}"
        )
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be (B, L), got shape {tuple(completion_ids.shape)}")
    batch, length = completion_ids.shape
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (batch, length + 1) or logits.shape[2] == 0:
        raise ValueError(
            f"logits must be the model's (B, L + 1, V) = ({batch}, {length + 1}, V) output for "
            f"(B, L) = {(batch, length)} completion_ids (position t predicts completion_ids[:, t]; "
            f"the last position is dropped, as in Liger), got shape {tuple(logits.shape)}"
        )
    V.check_float(advantages, "advantages")
    if tuple(advantages.shape) != (batch,):
        raise ValueError(
            f"advantages must be (B,) = ({batch},), one per sequence (Liger reads one per "
            f"sequence), got shape {tuple(advantages.shape)}"
        )
    for name, t in per_token.items():
        if t is None:
            continue
        if name == "completion_mask":
            V.check_mask_dtype(t, name)
        else:
            V.check_float(t, name)
        V.check_shape(t, (batch, length), name, "(B, L)")
    V.check_same_device(logits=logits, completion_ids=completion_ids, advantages=advantages,
                        **per_token)  # fmt: skip
    return batch, length


def _check_clip(loss_type, eps_low, eps_high, delta) -> None:
    """fused_rl's checks of the clip arguments, run up front whichever path computes."""
    V.check_nonnegative(eps_low, "eps_low")
    V.check_nonnegative(eps_high, "eps_high")
    if delta is not None:
        V.check_number(delta, "delta")
        if not delta > 1.0 + eps_high:
            raise ValueError(
                f"delta must be > 1 + eps_high = {1.0 + eps_high}, got {delta} (below it the "
                "cap would cut the unclipped branch where A > 0 too)"
            )


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dapo_normalizer(count: Tensor, num_items_in_batch) -> Tensor:
    """Liger's ``_compute_dapo_normalizer``: ``max(N / world_size, 1)``, ``N`` the given
    ``num_items_in_batch`` or this micro-batch's mask sum all-reduced over the ranks."""
    world = _world_size()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            n = num_items_in_batch.to(device=count.device, dtype=torch.float32).reshape(())
        else:
            n = torch.as_tensor(float(num_items_in_batch), device=count.device, dtype=torch.float32)
        return torch.clamp(n / world, min=1.0)
    n = count.clone()
    if world > 1:
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.SUM)
    return torch.clamp(n / world, min=1.0)


def _aggregation(loss_type, count, batch, length, max_completion_length, num_items_in_batch):
    """``(loss_agg, num_items)`` of :func:`fused_rl.policy_loss` giving Liger's reduction."""
    if loss_type in ("grpo", "sapo"):
        return "seq-mean-token-mean", None
    if loss_type == "bnpo":
        return "token-mean", torch.clamp(count, min=1.0)
    if loss_type == "dr_grpo":
        max_len = length if max_completion_length is None else max_completion_length
        return "token-mean", torch.as_tensor(float(batch * max_len), device=count.device)
    return "token-mean", _dapo_normalizer(count, num_items_in_batch)


def _cispo_scale(cap) -> float:
    """CISPO's ``min(r, C) = C * min(r / C, 1)``: fused_rl's CISPO weight is the band
    ``clamp(r, 1 - eps_low, 1 + eps_high)``, so ``C >= 1`` is ``eps_low=1, eps_high=C - 1``
    and a cap below 1 (TRL's and Liger's default is below 1) is the ratio ``r / C`` (old
    log-probs shifted by ``log C``) with the advantage times ``C``. Returns the scale: 1.0,
    or ``C`` when ``C < 1``."""
    V.check_number(cap, "eps_high")  # finite
    if not cap > 0:
        raise ValueError(f"eps_high is CISPO's cap on the ratio and must be > 0, got {cap}")
    return 1.0 if cap >= 1.0 else float(cap)


def _vespo_phi(logp, old, advantages, mask_f, vllm_is_ratio, k_pos, lam_pos, k_neg, lam_neg):
    """Liger's (and TRL's) ``get_gamma_weights``, detached, ``(B, 1)`` in ``logp``'s dtype:
    ``S_i = sum_t clamp(d_t, -20, 20) m_t + sum_t clamp(log v_t, ln 1e-8, 20)`` (the vLLM
    ratio's logs over **every** position of its row, unmasked; a ``(B,)`` / ``(B, 1)`` ratio
    once), ``ln w = clamp(S_i, ln 1e-8, 20)``, ``(k, lam)`` by ``A_i >= 0``, ``lam >= 1e-4``,
    ``phi = exp(lam + k ln w - lam w)`` with NaN / inf as 0. Masked log-ratios never matter."""
    with torch.no_grad():
        acc = logp.dtype
        m = mask_f.to(acc)
        d = torch.where(m != 0, logp - old.to(acc), 0.0)
        total = (torch.clamp(d, -20.0, 20.0) * m).sum(-1, keepdim=True)
        if vllm_is_ratio is not None:
            v = vllm_is_ratio.detach().to(acc)
            v = v[:, None] if v.dim() == 1 else v
            total = total + torch.clamp(torch.log(v), _LN_1E_8, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(total, _LN_1E_8, 20.0)
        nonneg = advantages.detach().to(acc)[:, None] >= 0
        k = torch.where(nonneg, float(k_pos), float(k_neg)).to(acc)
        lam = torch.where(nonneg, float(lam_pos), float(lam_neg)).to(acc).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def _luspo_weights(mask_f, level, vllm_is_ratio, batch, length, dtype):
    """TRL's LUSPO ``mean(L * n)`` over ``(B, L)``, padding left out, as fused_rl's
    ``(mask weights, is_weights, num_items)``: every counted token weighs ``n_i / L`` over
    ``B``; a sequence-shaped policy term (sequence level with no or a per-sequence vLLM ratio:
    TRL's ``(B, 1)`` loss) takes ``L / n_i`` back through ``is_weights``, so it weighs
    ``n_i / B`` per sequence, as TRL's."""
    m = mask_f.to(dtype)
    n = m.sum(-1, keepdim=True)
    weights = m * (n / length)
    v = None if vllm_is_ratio is None else vllm_is_ratio.detach().to(dtype)
    if v is not None and v.dim() == 1:
        v = v[:, None]
    if level == "sequence" and (v is None or v.shape[-1] == 1):
        back = torch.where(n > 0, length / torch.where(n > 0, n, 1.0), 0.0)
        v = back if v is None else back * v
    return weights, v, torch.as_tensor(float(batch), dtype=dtype, device=m.device)


def triton_grpo_loss(
    logits,
    old_logp,
    ref_logp,
    completion_ids,
    advantages,
    completion_mask=None,
    temperature=0.9,
    beta=0.04,
    eps_low=0.2,
    eps_high=0.4,
    inplace=True,
    loss_type="dapo",
    max_completion_length=None,
    importance_sampling_level="token",
    reduce=False,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vllm_is_ratio=None,
    delta=None,
    use_bias_correction_kl=False,
    num_items_in_batch=None,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
):
    """Mirrors ``liger_kernel.transformers.grpo_loss.triton_grpo_loss`` (Liger-Kernel 0.8.5).

    The GRPO-family loss straight from the logits; see the module docstring for the math of
    each ``loss_type`` and what departs from Liger.

    Args:
        logits: ``(B, L + 1, V)`` model output (the last position is not used).
        old_logp: ``(B, L)`` sampling-policy log-probs, or None (on-policy).
        ref_logp: ``(B, L)`` reference log-probs; required when ``beta != 0``.
        completion_ids: ``(B, L)`` int64 / int32 token ids.
        advantages: ``(B,)``, one per sequence.
        completion_mask: ``(B, L)`` mask (bool, integer or float) or None (all count).
        temperature: the logits are divided by it.
        beta: KL coefficient (k3 to ``ref_logp``).
        eps_low, eps_high: the clip band ``[1 - eps_low, 1 + eps_high]``; for ``cispo``
            ``eps_high`` is the absolute cap on the ratio.
        inplace: accepted, no effect (fused_rl never writes over ``logits``).
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"luspo"``,
            ``"cispo"``, ``"sapo"``, ``"vespo"``.
        max_completion_length: ``dr_grpo``'s length (default ``L``).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        reduce: True: ``(loss, metrics)``; False: per-token outputs.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's temperatures (``> 0``).
        vllm_is_ratio: ``(B, L)``, ``(B, 1)`` or ``(B,)`` rollout IS correction: multiplies
            the policy term, before the KL.
        delta: cap on the unclipped ratio (PPO types), ``> 1 + eps_high``, or None.
        use_bias_correction_kl: multiply the KL by the (not detached) ratio.
        num_items_in_batch: ``dapo`` / ``cispo``'s token count over the whole generation
            batch (a number or a tensor), or None.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's shape
            (``k``) and rate (``lam``) for ``A >= 0`` and ``A < 0``.

    Returns:
        ``reduce=True``: ``(loss, metrics)``, ``loss`` a 0-dim fp32 tensor differentiable
        w.r.t. ``logits``, ``metrics`` the list ``[kl_mean, clip_ratio]`` (``[clip_ratio]``
        when ``beta == 0``) of detached 0-dim fp32 tensors. ``reduce=False``:
        ``(per_token_loss, per_token_kl, is_clipped)``, ``(B, L)`` fp32 each, times the mask;
        ``per_token_loss`` differentiable, ``per_token_kl`` None when ``beta == 0``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.liger import triton_grpo_loss
        >>> logits = torch.zeros(2, 4, 8, requires_grad=True)  # (B, L + 1, V)
        >>> ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
        >>> old = torch.full((2, 3), -2.0)  # log(1/8) = -2.079: every ratio is 0.924
        >>> adv = torch.tensor([1.0, -0.5])
        >>> loss, metrics = triton_grpo_loss(logits, old, None, ids, adv, beta=0.0,
        ...                                  eps_low=0.05, reduce=True)  # dapo: token mean
        >>> round(loss.item(), 4), [round(m.item(), 4) for m in metrics]  # [clip_ratio]
        (-0.2243, [0.5])
        >>> loss.backward(); logits.grad[:, -1].abs().max().item()  # last position unused
        0.0
        >>> per_token, kl, clipped = triton_grpo_loss(logits, old, None, ids, adv, beta=0.0)
        >>> per_token.shape, kl
        (torch.Size([2, 3]), None)
    """
    del inplace
    if logits is None or completion_ids is None or advantages is None:
        raise AssertionError("must provide logits, completion_ids and advantages")
    _validate(loss_type, importance_sampling_level, delta, beta, ref_logp,
              sapo_temperature_pos, sapo_temperature_neg)  # fmt: skip
    batch, length = _check_shapes(
        logits, completion_ids, advantages, old_logp=old_logp, ref_logp=ref_logp,
        completion_mask=completion_mask,
    )  # fmt: skip
    V.check_positive(temperature, "temperature")
    _check_clip(loss_type, eps_low, eps_high, delta)
    mask = completion_mask
    keep = None if mask is None else mask != 0
    check_index_range(completion_ids, logits.shape[-1], "completion_ids", _ORIGINAL, keep,
                      "mask the token out (completion_mask = 0) or pass a valid id")  # fmt: skip
    # masked tokens are never read (as in Liger's kernel): their ids become the ignore index
    targets = completion_ids if keep is None else torch.where(keep, completion_ids, NO_IGNORE)

    scale = _cispo_scale(eps_high) if loss_type == "cispo" else 1.0
    clip_low, clip_high = eps_low, eps_high
    if loss_type == "cispo":
        clip_low, clip_high = 1.0, (eps_high - 1.0 if scale == 1.0 else 0.0)
    surrogate = {"cispo": "cispo", "sapo": "sapo"}.get(loss_type, "ppo")
    options = dict(
        ref_logprobs=ref_logp if beta != 0.0 else None, eps_low=clip_low, eps_high=clip_high,
        delta=delta, beta=float(beta) * scale if use_bias_correction_kl else float(beta),
        kl_estimator="k3", importance_sampling=importance_sampling_level, surrogate=surrogate,
        sapo_tau_pos=sapo_temperature_pos, sapo_tau_neg=sapo_temperature_neg,
        is_weights=vllm_is_ratio, kl_bias_correction=bool(use_bias_correction_kl),
    )  # fmt: skip
    adv = advantages if scale == 1.0 else advantages * scale
    shift = math.log(scale)  # old' = old + log C: the ratio r / C (cispo with C < 1)

    with torch.no_grad():
        mask_f = (
            torch.ones(batch, length, device=logits.device)
            if mask is None else mask.detach().to(torch.float32)
        )  # fmt: skip
        count = mask_f.sum()
        to_liger = count / torch.clamp(count, min=1.0)  # fused_rl's masked means -> Liger's
    bias_kl = beta != 0.0 and bool(use_bias_correction_kl)
    fused = reduce and not bias_kl and not (shift != 0.0 and old_logp is None)
    fused = fused and loss_type not in ("luspo", "vespo")  # they need the log-probs first

    if fused:  # one fused pass over the logits each way
        old = old_logp if shift == 0.0 else old_logp.detach() + shift
        loss_agg, num_items = _aggregation(loss_type, count, batch, length,
                                           max_completion_length, num_items_in_batch)  # fmt: skip
        loss, metrics = policy_loss(
            logits, targets, adv, old_logprobs=old, mask=mask, temperature=temperature,
            loss_agg=loss_agg, num_items=num_items, ignore_index=NO_IGNORE, **options,
        )  # fmt: skip
        out = []
        if beta != 0.0:
            out.append((metrics["kl"] * to_liger).float())
        out.append(_clip_metric(loss_type, metrics, to_liger))
        return loss.float(), out

    logp = token_logprobs(logits, targets, temperature=temperature, ignore_index=NO_IGNORE)
    old = old_logp.detach().to(logp.dtype) if old_logp is not None else logp.detach()
    phi = None
    if loss_type == "vespo":  # the rollout IS ratio is folded into phi, nothing else
        phi = _vespo_phi(logp.detach(), old, advantages, mask_f, vllm_is_ratio, vespo_k_pos,
                         vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)  # fmt: skip
    per_token = dict(
        level=importance_sampling_level, loss_type=loss_type, eps_low=eps_low,
        eps_high=eps_high, delta=delta, tau_pos=sapo_temperature_pos,
        tau_neg=sapo_temperature_neg, vllm_is_ratio=vllm_is_ratio, beta=beta,
        bias_kl=bool(use_bias_correction_kl), phi=phi,
    )  # fmt: skip
    if reduce and loss_type in ("luspo", "vespo"):
        if loss_type == "vespo":  # -sg(phi) A logp: GPG with the advantage phi A
            weights, is_w = mask, None
            adv = advantages.detach().to(logp.dtype) * phi[:, 0]
            num_items = _dapo_normalizer(count, num_items_in_batch)
            options.update(surrogate="gpg", is_weights=None)
        else:
            weights, is_w, num_items = _luspo_weights(mask_f, importance_sampling_level,
                                                      vllm_is_ratio, batch, length,
                                                      logp.dtype)  # fmt: skip
            options.update(is_weights=is_w)
        loss, _ = policy_loss_from_logprobs(
            logp, adv, old_logprobs=old, mask=weights, loss_agg="token-mean",
            num_items=num_items, **options,
        )  # fmt: skip
        with torch.no_grad():  # Liger's metrics, sum x m / max(sum m, 1)
            _, kl, clipped = _token_terms(logp.detach(), old, ref_logp, advantages, mask_f,
                                          **per_token)  # fmt: skip
            denominator = torch.clamp(count, min=1.0)
            out = [] if kl is None else [(kl.sum() / denominator).float()]
            out.append((clipped.sum() / denominator).float())
        return loss.float(), out
    if reduce:
        loss_agg, num_items = _aggregation(loss_type, count, batch, length,
                                           max_completion_length, num_items_in_batch)  # fmt: skip
        loss, metrics = policy_loss_from_logprobs(
            logp, adv, old_logprobs=old + shift if shift != 0.0 else old, mask=mask,
            loss_agg=loss_agg, num_items=num_items, **options,
        )  # fmt: skip
        out = []
        if beta != 0.0:  # Liger's per-token KL is the bias-corrected one: k3 * r
            with torch.no_grad():
                _, kl, _ = _token_terms(logp.detach(), old, ref_logp, advantages, mask_f,
                                        **per_token)  # fmt: skip
                out.append((kl.sum() / torch.clamp(count, min=1.0)).float())
        out.append(_clip_metric(loss_type, metrics, to_liger))
        return loss.float(), out
    # reduce=False: the per-token outputs, from the log-probs on (B, L) tensors
    loss, kl, clipped = _token_terms(logp, old, ref_logp, advantages, mask_f, **per_token)
    return loss.float(), None if kl is None else kl.detach().float(), clipped.float()


def _token_terms(logp, old, ref_logp, advantages, mask_f, *, level, loss_type, eps_low,
                 eps_high, delta, tau_pos, tau_neg, vllm_is_ratio, beta, bias_kl,
                 phi=None):  # fmt: skip
    """Liger's per-token ``(loss, kl, is_clipped)``, each times the mask (``kl`` None when
    ``beta == 0``); ``loss`` differentiable w.r.t. ``logp`` (``old`` is a constant). Values
    at masked tokens never matter (log-prob 0, ratio 1). ``phi``: VESPO's ``(B, 1)``
    weights (the vLLM ratio already folded in)."""
    acc = logp.dtype
    m = mask_f.to(acc)
    counted = m != 0
    logp = torch.where(counted, logp, 0.0)
    old = torch.where(counted, old.to(acc), logp.detach())
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(acc)[:, None]
    if loss_type == "cispo":  # the absolute cap, detached
        loss = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
        clipped = (ratio > eps_high) & (adv > 0)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, float(tau_pos), float(tau_neg)).to(acc)
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    elif loss_type == "vespo":  # -sg(phi) A logp, no clip
        loss = -phi.to(acc) * adv * logp
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
        vllm_is_ratio = None  # folded into phi
    else:
        low, high = 1.0 - eps_low, 1.0 + eps_high
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        loss = -torch.minimum(capped * adv, torch.clamp(ratio, low, high) * adv)
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    loss = loss.expand_as(logp)
    if vllm_is_ratio is not None:
        w = vllm_is_ratio.detach().to(acc)
        loss = loss * (w[:, None] if w.dim() == 1 else w)
    kl = None
    if beta != 0.0:
        neg = torch.where(counted, ref_logp.detach().to(acc), logp.detach()) - logp
        kl = torch.exp(neg) - neg - 1.0
        if bias_kl:
            kl = kl * ratio
        loss = loss + beta * kl
        kl = torch.where(counted, kl * m, 0.0)
    zero = torch.zeros_like(loss)
    return (torch.where(counted, loss * m, zero), kl,
            torch.where(counted, clipped.expand_as(logp).to(acc) * m, zero))  # fmt: skip


def _clip_metric(loss_type: str, metrics: dict, to_liger: Tensor) -> Tensor:
    """Liger's ``clip_ratio`` from fused_rl's metrics (masked means, rescaled to Liger's
    ``max(sum m, 1)`` denominator)."""
    if loss_type == "sapo":
        return torch.zeros((), dtype=torch.float32, device=to_liger.device)
    name = "cispo_clip_frac" if loss_type == "cispo" else "clip_frac"
    return (metrics[name] * to_liger).float()


# ----------------------------------------------------------------------------- JSD


def _check_labels(shift_labels, n_rows: int) -> None:
    """Liger's own check of ``shift_labels`` (an ``AssertionError`` with its words)."""
    if shift_labels is None:
        return
    V.check_tensor(shift_labels, "shift_labels")
    if tuple(shift_labels.shape) != (n_rows,):
        raise AssertionError(f"the shape of shift_labels must be (BT,). Got: {shift_labels.shape}")


def _check_rows(x, name: str, what: str) -> None:
    V.check_float(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")


def liger_jsd(input, target, shift_labels=None, beta=0.5, ignore_index=-100):
    """Mirrors ``liger_kernel.transformers.functional.liger_jsd`` (Liger-Kernel 0.8.5): the
    generalized JSD between the student's and the teacher's distributions given as
    log-probabilities, on :func:`fused_rl.distill_loss` (module docstring).

    Args:
        input: ``(BT, V)`` the student's log-probabilities ``log Q`` (Liger's "predictions").
        target: ``(BT, V)`` the teacher's log-probabilities ``log P``; no gradient.
        shift_labels: optional ``(BT,)`` labels: a row counts where it is not
            ``ignore_index`` (``AssertionError`` for another shape, as Liger).
        beta: in ``[0, 1]``: ``0`` forward KL ``KL(P || Q)``, ``1`` reverse KL
            ``KL(Q || P)``, between: ``beta KL(P || M) + (1 - beta) KL(Q || M)``,
            ``M = beta P + (1 - beta) Q`` (TRL's and fused_rl's ``beta``).
        ignore_index: see ``shift_labels``.

    Returns:
        The 0-dim loss in ``input``'s dtype: the counted rows' divergences summed over their
        count (0 when none counts); its gradient w.r.t. ``input`` is Liger's ``dX`` (the
        partial derivatives on the log-probabilities).

    Example:
        >>> import torch
        >>> from fused_rl.compat.liger import liger_jsd
        >>> x = torch.randn(4, 6).log_softmax(-1).requires_grad_()
        >>> y = torch.randn(4, 6).log_softmax(-1)
        >>> loss = liger_jsd(x, y, beta=0.0)  # forward KL, sum P (Y - X) per row, mean
        >>> bool(torch.allclose(loss, (y.exp() * (y - x)).sum(-1).mean()))
        True
        >>> loss.backward(); bool(torch.allclose(x.grad, -y.exp() / 4))  # Liger's dX = -P / n
        True
    """
    _check_rows(input, "input", "(BT, V) log-probabilities")
    V.check_float(target, "target")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"target must have input's shape (BT, V) = {tuple(input.shape)}, got "
            f"{tuple(target.shape)}"
        )
    _check_labels(shift_labels, input.shape[0])
    loss, _ = _distill_loss(
        input, target.detach(), beta, 1.0, None, shift_labels, ignore_index, "token-mean",
        None, None, "auto", True,
    )  # fmt: skip
    return loss.to(input.dtype)


class LigerJSD(torch.nn.Module):
    """Mirrors ``liger_kernel.transformers.LigerJSD`` (Liger-Kernel 0.8.5):
    ``LigerJSD(beta=0.5, ignore_index=-100)(log_q, log_p, shift_labels=None)`` is
    :func:`liger_jsd` (``log_q`` the student's log-probabilities, ``log_p`` the teacher's).

    Example:
        >>> import torch
        >>> from fused_rl.compat.liger import LigerJSD
        >>> x = torch.randn(4, 6).log_softmax(-1).requires_grad_()
        >>> y = torch.randn(4, 6).log_softmax(-1)
        >>> labels = torch.tensor([1, -100, 2, 3])
        >>> LigerJSD(beta=0.3)(x, y, labels).shape
        torch.Size([])
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, log_q, log_p, shift_labels=None):
        return liger_jsd(log_q, log_p, shift_labels, self.beta, self.ignore_index)


def liger_fused_linear_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    shift_labels=None,
    jsd_beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    accum_dtype=None,
):
    """Mirrors ``liger_kernel.transformers.functional.liger_fused_linear_jsd`` (Liger-Kernel
    0.8.5): the generalized JSD of ``log_softmax(student_input @ student_weight.T /
    temperature)`` and the teacher's, its lm_head fused, on
    :func:`fused_rl.linear_distill_loss` (chunks of tokens; neither model's ``(BT, V)``
    logits held whole).

    Args:
        student_input: ``(BT, H)`` the student's final hidden states.
        student_weight: ``(V, H)`` the student's lm_head (no bias, as Liger).
        teacher_input: ``(BT, H')`` the teacher's hidden states (``H'`` may differ); no
            gradient.
        teacher_weight: ``(V, H')`` the teacher's lm_head; no gradient.
        shift_labels: optional ``(BT,)``: rows whose label is ``ignore_index`` do not count
            (``AssertionError`` for another shape, as Liger).
        jsd_beta: ``beta`` of :func:`liger_jsd`.
        ignore_index: see ``shift_labels``.
        temperature: both models' logits are divided by it (``> 0``; the loss is not
            rescaled).
        accum_dtype: accepted (None or a floating dtype): ``dW`` accumulates in fp32 (fp64
            for fp64) whatever it is, and comes back in ``student_weight``'s dtype.

    Returns:
        The 0-dim fp32 loss (Liger's dtype): the counted rows' divergences over their count.

    Example:
        >>> import torch
        >>> from fused_rl.compat.liger import liger_fused_linear_jsd
        >>> h = torch.randn(4, 8, requires_grad=True)
        >>> w = torch.randn(16, 8, requires_grad=True)
        >>> th, tw = torch.randn(4, 12), torch.randn(16, 12)  # a wider teacher
        >>> loss = liger_fused_linear_jsd(h, w, th, tw, jsd_beta=0.5, temperature=2.0)
        >>> loss.dtype, loss.shape
        (torch.float32, torch.Size([]))
        >>> loss.backward(); w.grad.shape
        torch.Size([16, 8])
    """
    _check_rows(student_input, "student_input", "(BT, H)")
    _check_rows(teacher_input, "teacher_input", "(BT, H')")
    _check_rows(student_weight, "student_weight", "the student's lm_head (V, H)")
    _check_rows(teacher_weight, "teacher_weight", "the teacher's lm_head (V, H')")
    if student_weight.shape[1] != student_input.shape[1]:
        raise ValueError(
            f"student_weight must be (V, H) with H = student_input.shape[1] = "
            f"{student_input.shape[1]}, got shape {tuple(student_weight.shape)}"
        )
    if teacher_weight.shape[1] != teacher_input.shape[1]:
        raise ValueError(
            f"teacher_weight must be (V, H') with H' = teacher_input.shape[1] = "
            f"{teacher_input.shape[1]}, got shape {tuple(teacher_weight.shape)}"
        )
    if teacher_input.shape[0] != student_input.shape[0]:
        raise ValueError(
            f"teacher_input must have student_input's BT = {student_input.shape[0]} rows, got "
            f"{teacher_input.shape[0]}"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight must have the student's vocabulary size: student_weight has "
            f"V = {student_weight.shape[0]}, teacher_weight V = {teacher_weight.shape[0]}"
        )
    _check_labels(shift_labels, teacher_input.shape[0])
    if accum_dtype is not None and not (
        isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point
    ):
        raise TypeError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
    loss, _ = linear_distill_loss(
        student_input, student_weight, teacher_input.detach(), teacher_weight.detach(),
        beta=jsd_beta, temperature=temperature, targets=shift_labels,
        ignore_index=ignore_index,
    )  # fmt: skip
    return loss.float()


class LigerFusedLinearJSD(torch.nn.Module):
    """Mirrors ``liger_kernel.transformers.LigerFusedLinearJSD`` (Liger-Kernel 0.8.5):
    ``LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0,
    accum_dtype=None)(student_input, student_weight, teacher_input, teacher_weight,
    shift_labels)`` is :func:`liger_fused_linear_jsd`; ``temperature=0`` raises Liger's
    ``AssertionError``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.liger import LigerFusedLinearJSD
        >>> h, w = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8)
        >>> jsd = LigerFusedLinearJSD(jsd_beta=0.1, temperature=2.0)
        >>> jsd(h, w, torch.randn(4, 12), torch.randn(16, 12), None).backward()
        >>> h.grad.shape
        torch.Size([4, 8])
    """

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None):
        super().__init__()
        if temperature == 0:
            raise AssertionError("temperature cannot be 0.")
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype

    def forward(self, student_input, student_weight, teacher_input, teacher_weight,
                shift_labels):  # fmt: skip
        return liger_fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, shift_labels,
            self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype,
        )  # fmt: skip


__all__ = [
    "LOSS_TYPES",
    "PPO_LOSS_TYPES",
    "SUPPORTED_LOSS_TYPES",
    "LigerFusedLinearJSD",
    "LigerJSD",
    "liger_fused_linear_jsd",
    "liger_jsd",
    "triton_grpo_loss",
]
