"""Rollout (behaviour-policy / vLLM) importance-sampling correction: ``rollout_is_weights``.

The weights correct for tokens sampled by a rollout engine (vLLM, SGLang) whose
log-probabilities differ from the trainer's: ``w = pi_old / pi_rollout``, truncated or used
to reject tokens / sequences (VARIANTS.md section 6). They are constants (no gradient) that
multiply the per-token policy term only (a policy loss's ``is_weights=``), never the KL or
entropy terms.

Why a Triton kernel (``kernels/token_ops/rollout.py``) rather than a few torch ops: the torch
version costs 5 launches at best (token level, truncate: difference, ``where`` on the mask,
exp, clamp, the padding ``where``) and about 12 for a sequence-level mask (the sum, the
count and division for the mean, two comparisons, their ``or``, the rejection ``where``,
``keep``'s ``and``), plus two casts for 16-bit inputs; the reference as written launches 8
to 24 (``fused_rl.profiling.LaunchCounter``, ``tests/test_rollout.py::test_one_launch``).
Each is a full pass over ``(B, T)``. The kernel is ONE launch for every level and mode,
reads each input once (the mask twice at a sequence level) and writes the weights (and
``keep``) once, with nothing around it (no cast, no ``.contiguous()``: strides are
passed). The launcher is a ``fused_rl._ops.FusedOp`` (``fused_rl::rollout_is_weights_fwd``)
with a fake implementation, so ``torch.compile(fullgraph=True)`` traces through it; no
autograd (the inputs are detached). No host syncs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, f32_pair, next_power_of_2, triton_acc
from ._ops import FusedOp
from .reference import rollout as ref
from .reference.reductions import acc_dtype
from .reference.rollout import LEVELS, MODES

MAX_BLOCK_T = 1024

# ----------------------------------------------------------------------------- launcher


def rollout_is_weights_fwd(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor | None,
    level: int,
    reject: bool,
    clip_min: float,
    clip_max: float,
) -> tuple[Tensor, Tensor]:
    """Launch the rollout-IS kernel on ``(B, T)`` tensors (any strides). ``level`` indexes
    ``LEVELS``; ``clip_min`` 0.0 / ``clip_max`` inf mean no bound. Returns contiguous
    ``(weights, keep)``; ``keep`` is ``(B, T)`` bool with ``reject``, else empty ``(0,)``."""
    from .kernels.token_ops.rollout import _rollout_is_weights_fwd_kernel

    n_rows, length = old_logprobs.shape
    dtype = acc_dtype(old_logprobs, rollout_logprobs)
    device = old_logprobs.device
    weights = torch.empty((n_rows, length), dtype=dtype, device=device)
    keep = torch.empty((n_rows, length) if reject else (0,), dtype=torch.bool, device=device)
    if n_rows == 0 or length == 0:
        return weights, keep
    block = max(16, min(next_power_of_2(length), MAX_BLOCK_T))
    token = level == 0
    m = mask if mask is not None else old_logprobs
    k = keep if reject else weights
    _rollout_is_weights_fwd_kernel[(n_rows, -(-length // block) if token else 1)](
        old_logprobs, rollout_logprobs, m, weights, k, length,
        old_logprobs.stride(0), old_logprobs.stride(1),
        rollout_logprobs.stride(0), rollout_logprobs.stride(1), m.stride(0), m.stride(1),
        *f32_pair(clip_min), *f32_pair(clip_max),
        HAS_MASK=mask is not None, SEQUENCE=not token, MEAN=level == 2, REJECT=reject,
        BLOCK_T=block, ACC=triton_acc(dtype), **COMPILE_OPTIONS,
    )  # fmt: skip
    return weights, keep


def _fake(old_logprobs, rollout_logprobs, mask, level, reject, clip_min, clip_max):
    dtype = acc_dtype(old_logprobs, rollout_logprobs)
    weights = old_logprobs.new_empty(old_logprobs.shape, dtype=dtype)
    keep_shape = old_logprobs.shape if reject else (0,)
    return weights, old_logprobs.new_empty(keep_shape, dtype=torch.bool)


_rollout_is_op = FusedOp("rollout_is_weights_fwd", rollout_is_weights_fwd)
_rollout_is_op.register_fake(_fake)


# ----------------------------------------------------------------------------- public API


def _check_2d(x: Tensor, name: str) -> None:
    V.check_float(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a (B, T) tensor, got shape {tuple(x.shape)}")


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor | None = None,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip_min: float | None = None,
    clip_max: float | None = 2.0,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Behaviour-policy (rollout / vLLM) importance-sampling correction weights.

    Per token ``lam_t = old_logprobs - rollout_logprobs`` (``log pi_old / pi_rollout``);
    ``counted = mask != 0``. The log-weight ``log_w`` is, by ``level``:

    * ``"token"``: ``lam_t`` (verl ``rollout_is="token"``, TRL ``token_*``);
    * ``"sequence"``: ``sum_t lam_t`` over the sequence's counted tokens, the product
      ratio, broadcast to its tokens (verl ``rollout_is="sequence"`` and RS ``seq_sum_k1``,
      TRL ``sequence_*``: both libraries SUM);
    * ``"geometric"``: the MEAN of the counted ``lam_t`` (0 for a row with none): the
      geometric-mean ratio of verl's RS ``seq_mean_k1`` and of verl v0.6's
      ``rollout_is_level="geometric"``.

    Then ``ratio = exp(log_w)`` and, by ``mode``:

    * ``"truncate"``: returns ``weights = clamp(ratio, clip_min, clip_max)``;
    * ``"mask"``: returns ``(weights, keep)``. A token (or, at a sequence level, every
      token of the sequence) is *rejected* when ``ratio < clip_min`` or ``ratio >
      clip_max``. ``weights`` is 0 where rejected and the raw, untruncated ``ratio``
      where not (TRL's ``*_mask``: ``ratio * 1[clip_min <= ratio <= clip_max]``);
      ``keep`` (bool) is ``counted & ~rejected``, so it is the new loss mask of verl's
      rejection sampling.

    ``clip_min=None`` is no lower bound, ``clip_max=None`` no upper bound (TRL's ``None``
    bounds, -inf / +inf). A NaN log-ratio in a counted token gives NaN weights (the token,
    or the whole sequence at a sequence level) and is never rejected (``keep`` True), so a
    loss that uses them is NaN, never silently finite.

    Tokens that do not count (``mask`` 0 / False) never matter: their log-probs are not
    read (NaN or inf there cannot reach a sequence sum), their weight is exactly 1 (neutral
    for a ``(B, T)`` multiplier of a masked loss) and their ``keep`` is False. A row with
    no counted token has ``log_w = 0``.

    How to get each library's behaviour (the caller applies ``weights`` as the policy
    loss's per-token ``is_weights``, the only term they multiply):

    * **verl TIS** (``rollout_is="token"|"sequence"``, ``rollout_is_threshold=u``):
      ``weights = rollout_is_weights(old, roll, mask, level=..., clip_max=u)`` (upper-only,
      ``clip_min=None``, the default). verl clamps ``log_w`` to ``[-20, 20]`` before
      ``exp`` for safety; here there is no such clamp: its upper half never matters for a
      finite ``clip_max`` (an overflowed ratio, inf, truncates to ``clip_max``), its lower
      half lifts weights below ``e^-20`` (2.1e-9) to ``e^-20``: pass
      ``clip_min=math.exp(-20)`` to reproduce it to the ulp (the absolute difference
      without it is < 2.1e-9). verl's weights at padding are 0 (``w * m``), here 1: both
      are multiplied by a masked term.
    * **verl rejection sampling** (``rollout_rs="token_k1"|"seq_sum_k1"|"seq_mean_k1"``,
      threshold ``"a_b"``; a single ``u`` means ``a = 1/u, b = u``): verl's k1 bounds are
      on ``pi_rollout / pi_old`` (``k1 = -lam``), so ``_, keep = rollout_is_weights(old,
      roll, mask, level="token"|"sequence"|"geometric", mode="mask", clip_min=1/b,
      clip_max=1/a)``, then the loss mask becomes ``mask & keep`` (float mask: ``mask *
      keep``): rejected tokens leave every denominator. The survivors' weights are what
      ``rollout_is`` gives them: a second call with ``mode="truncate"`` (e.g. the preset
      ``decoupled_seq_is_rs``), or none. verl clamps each token's ``lam`` to ``[-20, 20]``
      before the RS sum / mean, which changes a decision only for a sequence holding a token
      with ``|lam| > 20``; verl rejects a NaN statistic, here it stays NaN. The k2 / k3 /
      ``seq_max`` statistics are not covered.
    * **verl v0.6** ``rollout_is_mode="mask"``: the same ``keep`` as the loss mask, and
      ``weights`` (raw ratio) as the IS weights.
    * **TRL** ``vllm_importance_sampling_mode="token_truncate"|"sequence_truncate"``:
      ``rollout_is_weights(old, roll, mask, level="token"|"sequence", clip_min=C_min,
      clip_max=C_max)`` (TRL defaults ``C_min=None``, ``C_max=3.0``).
    * **TRL** ``"token_mask"|"sequence_mask"`` (TRL's default mode):
      ``weights, _ = rollout_is_weights(..., mode="mask", clip_min=C_min, clip_max=C_max)``
      and ``weights`` as the IS weights, the mask unchanged: rejected tokens stay in the
      denominators with weight 0 (``weights * keep`` is the same tensor except at padding,
      where it is 0 instead of 1). TRL computes no safety clamp either.
    * **Liger** ``vllm_is_ratio``: TRL's tensor, any of the above.
    * Bypass mode (verl ``bypass_mode``): pass the current policy's log-probs, detached,
      as ``old_logprobs``.

    Args:
        old_logprobs: ``(B, T)`` float, the trainer's (old / proximal) policy log-probs.
        rollout_logprobs: ``(B, T)`` float, the rollout engine's log-probs of the same
            tokens (any float dtype; the two may differ).
        mask: optional ``(B, T)`` bool / integer / float tensor, nonzero where the token
            counts: an indicator, not a weight (a fraction does not scale a log-ratio).
        level: ``"token"`` | ``"sequence"`` | ``"geometric"``.
        mode: ``"truncate"`` | ``"mask"``.
        clip_min: None, or a finite number ``> 0``: the lower bound.
        clip_max: None, or a finite number ``> 0`` (and ``> clip_min``): the upper bound.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``weights`` (``mode="truncate"``) or ``(weights, keep)`` (``mode="mask"``):
        ``weights`` a contiguous ``(B, T)`` fp32 tensor (fp64 if an input is fp64),
        ``keep`` ``(B, T)`` bool; both detached (no gradient flows through the weights).

    Example:
        >>> import torch
        >>> from fused_rl.rollout import rollout_is_weights
        >>> old = torch.tensor([[-1.0, -0.5, -2.0]])
        >>> roll = torch.tensor([[-1.0, -1.5, float("nan")]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> rollout_is_weights(old, roll, mask, clip_max=2.0).tolist()
        [[1.0, 2.0, 1.0]]
        >>> w, keep = rollout_is_weights(old, roll, mask, mode="mask", clip_min=0.5,
        ...                              clip_max=2.0)
        >>> w.tolist(), keep.tolist()
        ([[1.0, 0.0, 1.0]], [[True, False, False]])
    """
    _check_2d(old_logprobs, "old_logprobs")
    _check_2d(rollout_logprobs, "rollout_logprobs")
    V.check_shape(rollout_logprobs, old_logprobs.shape, "rollout_logprobs", "old_logprobs.shape")
    V.check_mask(mask, "mask", old_logprobs.shape, "(B, T)", weights=False)
    V.check_choice(level, LEVELS, "level")
    V.check_choice(mode, MODES, "mode")
    V.check_positive(clip_min, "clip_min", allow_none=True)
    V.check_positive(clip_max, "clip_max", allow_none=True)
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"clip_min ({clip_min!r}) must be < clip_max ({clip_max!r})")
    V.check_same_device(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    which = resolve_backend(backend, old_logprobs, rollout_logprobs, mask)
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    if mask is not None:
        mask = mask.detach()
    if which == "reference":
        return ref.rollout_is_weights(
            old_logprobs, rollout_logprobs, mask, level, mode, clip_min, clip_max
        )
    weights, keep = _rollout_is_op(
        old_logprobs,
        rollout_logprobs,
        mask,
        LEVELS.index(level),
        mode == "mask",
        0.0 if clip_min is None else float(clip_min),
        math.inf if clip_max is None else float(clip_max),
    )
    return (weights, keep) if mode == "mask" else weights
