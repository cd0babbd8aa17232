"""Advantage estimation on token/sequence tensors: ``gae``, ``kl_penalized_rewards``,
``group_advantages`` (GRPO / Dr. GRPO) and ``rloo_advantages``.

None of these is differentiable: RL computes advantages from detached rollouts, so inputs
are detached and the outputs carry no graph. Each Triton path is one kernel launch
(``fused_rl::gae_fwd``, ``fused_rl::kl_penalized_rewards_fwd``,
``fused_rl::group_advantages_fwd``), each a ``fused_rl._ops.FusedOp``: a custom op with a
fake implementation so ``torch.compile(fullgraph=True)`` traces through it, a direct call in
eager mode. No host syncs, except the optional eager-mode range check of ``score_index``
(see ``fused_rl.config.check_values``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, f32_pair, next_power_of_2, triton_acc
from ._ops import FusedOp
from .reference import advantages as ref
from .reference.kl import KL_KINDS, refuse_full

MAX_BLOCK_T = 1024
MAX_BLOCK_N = 1024


def _time_block(length: int) -> int:
    return max(16, min(next_power_of_2(length), MAX_BLOCK_T))


def _new_out(shape, dtype, device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- launchers


def gae_fwd(
    rewards: Tensor, values: Tensor, mask: Tensor | None, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Launch the GAE kernel on ``(B, T)`` tensors (any strides); contiguous outputs."""
    from .kernels.token_ops.advantages import _gae_fwd_kernel

    n_rows, length = rewards.shape
    dtype = ref.acc_dtype(rewards, values)
    adv = _new_out((n_rows, length), dtype, rewards.device)
    ret = _new_out((n_rows, length), dtype, rewards.device)
    if n_rows == 0 or length == 0:
        return adv, ret
    m = mask if mask is not None else rewards
    _gae_fwd_kernel[(n_rows,)](
        rewards,
        values,
        m,
        adv,
        ret,
        length,
        rewards.stride(0),
        rewards.stride(1),
        values.stride(0),
        values.stride(1),
        m.stride(0),
        m.stride(1),
        *f32_pair(gamma),
        *f32_pair(gamma * lam),
        HAS_MASK=mask is not None,
        BLOCK_T=_time_block(length),
        ACC=triton_acc(dtype),
        **COMPILE_OPTIONS,
    )
    return adv, ret


def kl_penalized_rewards_fwd(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor | None,
    score_index: Tensor | None,
    kl_coef: float,
    kl_estimator: str,
) -> Tensor:
    """Launch the KL-penalised-rewards kernel; ``(B, T)`` contiguous output."""
    from .kernels.token_ops.advantages import _kl_penalized_rewards_fwd_kernel

    n_rows, length = logprobs.shape
    dtype = ref.acc_dtype(scores, logprobs, ref_logprobs)
    out = _new_out((n_rows, length), dtype, logprobs.device)
    if n_rows == 0 or length == 0:
        return out
    m = mask if mask is not None else logprobs
    idx = score_index if score_index is not None else scores
    _kl_penalized_rewards_fwd_kernel[(n_rows,)](
        scores,
        logprobs,
        ref_logprobs,
        m,
        idx,
        out,
        length,
        scores.stride(0),
        logprobs.stride(0),
        logprobs.stride(1),
        ref_logprobs.stride(0),
        ref_logprobs.stride(1),
        m.stride(0),
        m.stride(1),
        idx.stride(0),
        *f32_pair(kl_coef),
        HAS_MASK=mask is not None,
        HAS_INDEX=score_index is not None,
        KIND=KL_KINDS.index(kl_estimator),
        BLOCK_T=_time_block(length),
        ACC=triton_acc(dtype),
        **COMPILE_OPTIONS,
    )
    return out


_GROUP_MODES = {"std": 0, "none": 1, "rloo": 2}


def group_advantages_fwd(scores: Tensor, group_size: int, mode: str, eps: float) -> Tensor:
    """Launch the group-baseline kernel on flat ``(B,)`` scores; ``(B,)`` output."""
    from .kernels.token_ops.advantages import _group_advantages_fwd_kernel

    dtype = ref.acc_dtype(scores)
    out = _new_out(scores.shape, dtype, scores.device)
    if scores.numel() == 0:
        return out
    _group_advantages_fwd_kernel[(scores.shape[0] // group_size,)](
        scores,
        out,
        group_size,
        scores.stride(0),
        *f32_pair(eps),  # fp64-exact for fp64 scores (a bare float is fp32 on a GPU)
        MODE=_GROUP_MODES[mode],
        BLOCK_N=max(16, min(next_power_of_2(group_size), MAX_BLOCK_N)),
        ACC=triton_acc(dtype),
        **COMPILE_OPTIONS,
    )
    return out


# ----------------------------------------------------------------------------- fused ops
# (no autograd: advantages are computed from detached rollouts)


def _gae_fake(rewards, values, mask, gamma, lam):
    dtype = ref.acc_dtype(rewards, values)
    return tuple(rewards.new_empty(rewards.shape, dtype=dtype) for _ in range(2))


def _kl_rewards_fake(scores, logprobs, ref_logprobs, mask, score_index, kl_coef, kl_estimator):
    return logprobs.new_empty(logprobs.shape, dtype=ref.acc_dtype(scores, logprobs, ref_logprobs))


def _group_fake(scores, group_size, mode, eps):
    return scores.new_empty(scores.shape, dtype=ref.acc_dtype(scores))


_gae_op = FusedOp("gae_fwd", gae_fwd)
_gae_op.register_fake(_gae_fake)
_kl_rewards_op = FusedOp("kl_penalized_rewards_fwd", kl_penalized_rewards_fwd)
_kl_rewards_op.register_fake(_kl_rewards_fake)
_group_op = FusedOp("group_advantages_fwd", group_advantages_fwd)
_group_op.register_fake(_group_fake)


# ----------------------------------------------------------------------------- validation


def _check_2d(x: Tensor, name: str) -> None:
    V.check_float(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a (B, T) tensor, got shape {tuple(x.shape)}")


def _check_group_size(group_size, n: int, minimum: int) -> None:
    V.check_positive_int(group_size, "group_size", minimum=minimum)
    if n % group_size != 0:
        raise ValueError(f"group_size ({group_size}) must divide the number of scores ({n})")


def _check_scores_1d(scores: Tensor) -> None:
    V.check_float(scores, "scores")
    if scores.dim() != 1:
        raise ValueError(f"scores must be a flat (B,) tensor, got shape {tuple(scores.shape)}")


# ----------------------------------------------------------------------------- public API


def gae(
    rewards: Tensor,
    values: Tensor,
    *,
    gamma: float,
    lam: float,
    mask: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over time (dim 1), TRL / seed-004 semantics.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_T = 0`` past the end),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``.

    Args:
        rewards, values: ``(B, T)`` float tensors, any strides.
        gamma, lam: real numbers in ``[0, 1]``.
        mask: optional ``(B, T)`` bool (or 0/1) tensor, True where the step counts: an
            indicator, not a weight (a float / integer mask counts where it is nonzero, a
            fraction does not scale the step). Masked steps count as zero reward and zero
            value (TRL's ``values * mask``), so the recursion runs through them, and get
            advantage 0 and return 0.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` fp32 (fp64 if an input is fp64), detached.
        Whitening is left to ``fused_rl.masked_whiten``.

    Triton: one program per sequence, a blocked reverse ``associative_scan``; no loop over T
    on the host. Reference: a blocked matmul formulation (``fused_rl.reference.advantages``).

    Example:
        >>> import torch, fused_rl
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.zeros(1, 3)
        >>> adv, ret = fused_rl.gae(r, v, gamma=1.0, lam=0.5)
        >>> adv.tolist()
        [[0.25, 0.5, 1.0]]
    """
    _check_2d(rewards, "rewards")
    _check_2d(values, "values")
    V.check_shape(values, rewards.shape, "values", "rewards.shape")
    V.check_mask(mask, "mask", rewards.shape, "(B, T)", weights=False)
    V.check_unit_interval(gamma, "gamma")
    V.check_unit_interval(lam, "lam")
    V.check_same_device(rewards=rewards, values=values, mask=mask)
    which = resolve_backend(backend, rewards, values, mask)
    rewards, values = rewards.detach(), values.detach()
    if which == "reference":
        return ref.gae(rewards, values, float(gamma), float(lam), mask)
    return _gae_op(rewards, values, mask, float(gamma), float(lam))


@V.deprecated_keyword("kind", "kl_estimator")
def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    *,
    kl_coef: float,
    mask: Tensor | None = None,
    kl_estimator: str = "k1",
    score_index: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Per-token RLHF rewards ``score - kl_coef * kl`` (seed 004 / TRL / torchtune).

    ``rewards[b, t] = -kl_coef * kl(logprobs, ref_logprobs)[b, t]`` (0 where ``mask`` is
    False), plus ``scores[b]`` at one step per row: the last counted step (the last True of
    ``mask``; ``T - 1`` without a mask; no step for an all-False row), or ``score_index[b]``
    when given (placed there even if that step is masked, e.g. TRL's "one past the end").

    Args:
        scores: ``(B,)`` float sequence-level rewards (reward-model outputs).
        logprobs, ref_logprobs: ``(B, T)`` float, policy and reference log-probs.
        kl_coef: real number ``>= 0``.
        mask: optional ``(B, T)`` bool (or 0/1) tensor, True where the token counts: an
            indicator, not a weight (a float / integer mask counts where it is nonzero).
        kl_estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"low_var_kl"``, ``"abs"``
            (:func:`fused_rl.kl_estimate`, ``log_ratio = logprobs - ref_logprobs``); ``kind=``
            is a deprecated alias (``FutureWarning``).
        score_index: optional ``(B,)`` int tensor of steps in ``[0, T)``. Out-of-range
            entries raise ``ValueError`` in eager mode (one host sync, see
            ``fused_rl.config.check_values``); otherwise they drop that row's score.

    Returns:
        ``(B, T)`` fp32 (fp64 if an input is fp64), detached. The last counted step is found
        on the device, no host sync.

    Example:
        >>> import torch, fused_rl
        >>> lp = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> ref_lp = torch.tensor([[-1.5, -1.0, -0.5]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> fused_rl.kl_penalized_rewards(torch.tensor([2.0]), lp, ref_lp, kl_coef=0.1,
        ...                               mask=mask).tolist()
        [[-0.05000000074505806, 2.0, 0.0]]
    """
    V.check_float(scores, "scores")
    _check_2d(logprobs, "logprobs")
    _check_2d(ref_logprobs, "ref_logprobs")
    V.check_shape(ref_logprobs, logprobs.shape, "ref_logprobs", "logprobs.shape")
    V.check_shape(scores, logprobs.shape[:1], "scores", "(B,)")
    V.check_mask(mask, "mask", logprobs.shape, "(B, T)", weights=False)
    V.check_choice(kl_estimator, KL_KINDS, "kl_estimator")
    refuse_full(kl_estimator)
    V.check_nonnegative(kl_coef, "kl_coef")
    if score_index is not None:
        V.check_tensor(score_index, "score_index")
        if score_index.dtype not in V.INDEX_DTYPES:
            raise TypeError(
                f"score_index must be an int64 or int32 tensor, got {score_index.dtype}"
            )
        V.check_shape(score_index, logprobs.shape[:1], "score_index", "(B,)")
    V.check_same_device(
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        scores=scores,
        mask=mask,
        score_index=score_index,
    )
    if score_index is not None and V.value_checks_enabled(score_index):
        length = logprobs.shape[1]
        bad = (score_index < 0) | (score_index >= length)
        if bool(bad.any()):
            raise ValueError(
                f"score_index holds {score_index[bad][0].item()}, outside [0, T) = [0, {length})"
            )
    which = resolve_backend(backend, logprobs, ref_logprobs, scores, mask, score_index)
    scores, logprobs, ref_logprobs = scores.detach(), logprobs.detach(), ref_logprobs.detach()
    if which == "reference":
        return ref.kl_penalized_rewards(
            scores, logprobs, ref_logprobs, float(kl_coef), mask, kl_estimator, score_index
        )
    return _kl_rewards_op(
        scores, logprobs, ref_logprobs, mask, score_index, float(kl_coef), kl_estimator
    )


def group_advantages(
    scores: Tensor,
    *,
    group_size: int,
    normalize: str = "std",
    eps: float = 1e-6,
    backend: str = "auto",
) -> Tensor:
    """GRPO outcome advantages over consecutive groups of ``group_size`` responses.

    ``normalize="std"``: ``(s - mean_g) / (std_g + eps)`` with the unbiased sample std (GRPO;
    a group of one has std 0); ``normalize="none"``: ``s - mean_g`` (Dr. GRPO). A constant
    group gives exactly 0, never NaN: scores are shifted by the group's first score before the
    mean is taken.

    Args:
        scores: flat ``(B,)`` float tensor; group ``g`` is ``scores[g*n:(g+1)*n]``.
        group_size: ``n >= 1`` dividing ``B``.
        eps: real number ``>= 0`` added to the std.

    Returns:
        ``(B,)`` fp32 (fp64 for fp64 scores), detached.

    Example:
        >>> import torch, fused_rl
        >>> s = torch.tensor([1.0, 0.0, 1.0, 1.0])
        >>> fused_rl.group_advantages(s, group_size=2, normalize="none").tolist()
        [0.5, -0.5, 0.0, 0.0]
    """
    _check_scores_1d(scores)
    _check_group_size(group_size, scores.shape[0], 1)
    V.check_choice(normalize, ref.GROUP_NORMALIZE, "normalize")
    V.check_nonnegative(eps, "eps")
    which = resolve_backend(backend, scores)
    scores = scores.detach()
    if which == "reference":
        return ref.group_advantages(scores, group_size, normalize, float(eps))
    return _group_op(scores, group_size, normalize, float(eps))


def rloo_advantages(scores: Tensor, *, group_size: int, backend: str = "auto") -> Tensor:
    """REINFORCE leave-one-out advantages: ``s_i - mean_{j != i} s_j`` within each group.

    Args:
        scores: flat ``(B,)`` float tensor of consecutive groups of ``group_size``.
        group_size: ``>= 2``, dividing ``B``.

    Returns:
        ``(B,)`` fp32 (fp64 for fp64 scores), detached.

    Example:
        >>> import torch, fused_rl
        >>> fused_rl.rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), group_size=3).tolist()
        [1.5, -1.5, 0.0]
    """
    _check_scores_1d(scores)
    _check_group_size(group_size, scores.shape[0], 2)
    which = resolve_backend(backend, scores)
    scores = scores.detach()
    if which == "reference":
        return ref.rloo_advantages(scores, group_size)
    return _group_op(scores, group_size, "rloo", 0.0)
