"""Drop-in replacements for the verl functions an actor / critic update calls, fused where
the vocabulary is involved.

Change ``import verl.utils.torch_functional as verl_F`` and
``from verl.trainer.ppo import core_algos`` to ``from fused_rl.compat import verl as verl_F``
and ``from fused_rl.compat import verl as core_algos``. verl is not imported (nor needed).

**Mirrors verl 0.9.x** (checked against 0.9.1, ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py``, by ``scripts/compat_live/verl/check.py``): signatures,
defaults, return tuples, output dtypes and numerics, quirks included. **The v0.5 line** (2025)
is :data:`legacy_v05`: ``from fused_rl.compat.verl import legacy_v05 as core_algos``.

What 0.9.x changed, and so the adapter does:

* :func:`agg_loss` (and :func:`compute_value_loss`, which forwards them) takes ``dp_size``,
  ``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor`` for global-batch
  normalisation, and a fifth mode, ``"token-sum"``. ``"token-mean"`` divides by the token
  count with no ``+ 1e-8`` (an all-masked batch gives NaN); the ``seq-mean-*`` modes divide
  by the number of sequences with at least one valid token (a fully masked sequence neither
  counts nor gives NaN); ``"seq-mean-token-sum-norm"`` is that seq-mean divided by
  ``loss_scale_factor`` (default: the response length).
* :func:`kl_penalty` accepts the straight-through kinds ``"k1+"``, ``"kl+"``, ``"abs+"``,
  ``"k3+"``, ``"low_var_kl+"``, ``"k2+"``, ``"mse+"``: the base estimator's value with the
  gradient of ``k2 = (logprob - ref_logprob)^2 / 2``; :func:`kl_penalty_forward` is the
  estimator without it.
* :func:`compute_policy_loss` is deprecated (a ``FutureWarning``, as in verl) in favour of
  :func:`compute_policy_loss_vanilla`, which reads the clip ranges and the global-batch
  information from an actor config and returns ``(loss, metrics)``.
* GRPO keeps the scores' dtype and device for each group's statistics.

Unchanged since v0.5: the NaN-safe :func:`masked_sum`, :func:`masked_mean` with ``+ 1e-8``,
:func:`masked_var` raising on a mask count of 0 or 1, :func:`masked_whiten` returning zero
mean by default, ``low_var_kl`` = ``k3`` (clamped), GAE that skips masked (observation)
tokens, and GRPO's per-group ``(s - mean) / (std + eps)`` where a group of one counts as
mean 0, std 1.

Fused: :func:`logprobs_from_logits`, :func:`entropy_from_logits` and
:func:`compute_entropy_loss` stream the logits through :func:`fused_rl.token_logprobs` /
:func:`fused_rl.token_entropy` (no ``(..., V)`` temporary); :func:`kl_penalty` runs
:func:`fused_rl.kl_estimate`; :func:`compute_gae_advantage_return` runs :func:`fused_rl.gae`
(no loop over time). The rest is O(B*T) PyTorch on per-token tensors, as in verl.

Half precision (``fused_rl.compat.half_precision``): by default (``"accurate"``) an fp16 /
bf16 input is computed in fp32 and each output is rounded once to the dtype verl returns for
those inputs (verl rounds every intermediate); ``"original"`` reproduces verl's own
half-precision op sequence, bit for bit (its PyTorch path: the flash-attn cross-entropy verl
uses on a GPU when installed is not reproduced). fp32 / fp64 inputs are never affected.

Deliberate differences (docs/compat.md, "verl"): labels outside ``[0, V)`` raise
``ValueError`` (verl's ``gather`` raises ``RuntimeError``); GAE takes a bool mask (verl's
``1 - mask`` raises) and NaN / inf at masked positions of the rewards or values do not reach
the advantages (verl's ``x * 0`` spreads them to every earlier step; ``"original"`` mode
keeps that); a tensor GRPO ``index`` groups by value (verl hashes its elements by identity,
so every sample is its own group).
"""

from __future__ import annotations

import numbers
import sys
import types
import warnings
from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validation as V
from ..advantages import gae
from ..kl import kl_estimate
from ..logprobs import token_entropy
from ._checks import gather_logprobs
from ._precision import half_precision_mode, original_half_precision

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# verl's names for the KL estimators -> fused_rl's (``fused_rl.kl_estimate``)
_KL_NAMES = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}
KL_PENALTIES = (*_KL_NAMES, *(f"{name}+" for name in _KL_NAMES))

_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- half precision


def _describe(x):
    """What decides the dtype an op sequence returns: a tensor's dtype and rank, a Python
    scalar's type, a mode string's (or flag's) value."""
    if isinstance(x, Tensor):
        return ("tensor", x.dtype, x.dim())
    if x is None or isinstance(x, (bool, str)):
        return x
    return type(x)


def _meta(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Tensor) else x


def _fp32(x):
    return x.float() if isinstance(x, Tensor) and x.dtype in _HALF else x


_OUT_DTYPES: dict = {}


def _out_dtypes(impl, args, kwargs):
    """The dtype(s) ``impl`` returns for these inputs: run once on meta tensors, cached."""
    key = (impl, tuple(map(_describe, args)), tuple((k, _describe(v)) for k, v in kwargs.items()))
    dtypes = _OUT_DTYPES.get(key)
    if dtypes is None:
        with torch.no_grad():
            probe = impl(*map(_meta, args), **{k: _meta(v) for k, v in kwargs.items()})
        dtypes = tuple(t.dtype for t in probe) if isinstance(probe, tuple) else probe.dtype
        _OUT_DTYPES[key] = dtypes
    return dtypes


def _run(impl, *args, **kwargs):
    """Run ``impl``, a plain-PyTorch op sequence written as verl computes, under the
    half-precision mode: with an fp16 / bf16 input in ``"accurate"`` mode, on fp32 copies of
    the half-precision tensors, each output cast to the dtype verl returns; otherwise as is."""
    floating = [x for x in (*args, *kwargs.values()) if isinstance(x, Tensor)]
    if half_precision_mode() == "original" or not any(t.dtype in _HALF for t in floating):
        return impl(*args, **kwargs)
    dtypes = _out_dtypes(impl, args, kwargs)
    out = impl(*map(_fp32, args), **{k: _fp32(v) for k, v in kwargs.items()})
    if isinstance(out, tuple):
        return tuple(o.to(d) for o, d in zip(out, dtypes))
    return out.to(dtypes)


# ----------------------------------------------------------------------------- torch_functional


def _check_labels(logits: Tensor, labels: Tensor) -> None:
    V.check_logits(logits, "logits")
    V.check_targets(labels, logits, "labels")
    vocab = logits.shape[-1]
    if V.value_checks_enabled(labels):
        bad = (labels < 0) | (labels >= vocab)
        if bool(bad.any()):
            first = labels[bad].reshape(-1)[0].item()
            raise ValueError(
                f"labels holds {first}, outside [0, V) = [0, {vocab}); verl's "
                "logprobs_from_logits has no ignore index: replace ignored labels (e.g. -100) "
                "by a valid id and mask them out"
            )


def logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.logprobs_from_logits``.

    ``log_softmax(logits, -1)`` gathered at ``labels``, fused.

    Args:
        logits: ``(..., V)`` float logits, any strides (``logits[:, -L - 1:-1]`` is not copied).
        labels: ``logits.shape[:-1]`` int64/int32 ids in ``[0, V)`` (out of range raises
            ``ValueError``).
        inplace_backward: accepted for compatibility; the fused backward writes one fresh
            gradient and never keeps a ``(..., V)`` activation.

    Returns:
        ``labels.shape`` log-probs in ``logits.dtype``; differentiable. In ``"original"``
        half-precision mode, fp16 / bf16 logits take verl's PyTorch path (a log-softmax in the
        logits' dtype per leading row).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> labels = torch.zeros(2, 3, dtype=torch.long)
        >>> verl_F.logprobs_from_logits(torch.zeros(2, 3, 4), labels)[0]
        tensor([-1.3863, -1.3863, -1.3863])
    """
    if original_half_precision(logits):
        _check_labels(logits, labels)
        if logits.dim() < 2:
            return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        rows = [
            F.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
            for z, y in zip(logits, labels)
        ]
        return torch.stack(rows)
    return gather_logprobs(
        logits, labels, temperature=1.0, name="labels", original="verl's logprobs_from_logits"
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.entropy_from_logits``.

    Entropy of ``softmax(logits)`` per position (``logsumexp - sum p z``), fused.

    Args:
        logits: ``(..., V)`` float logits, any strides.

    Returns:
        ``logits.shape[:-1]`` tensor in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.entropy_from_logits(torch.zeros(1, 2))
        tensor([0.6931])
    """
    V.check_logits(logits, "logits")
    if original_half_precision(logits):
        probs = torch.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)
    return token_entropy(logits).to(logits.dtype)


def clip_by_value(x: Tensor, tensor_min: Tensor, tensor_max: Tensor) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.clip_by_value``: ``max(min(x, hi), lo)`` with
    tensor bounds.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.clip_by_value(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor(-1.0),
        ...                      torch.tensor(1.0))
        tensor([-1.0000,  0.5000,  1.0000])
    """
    return torch.max(torch.min(x, tensor_max), tensor_min)


def _masked_sum(values, mask, axis=None):
    kept = torch.where(mask.bool(), values, 0.0)
    return (kept * mask).sum(axis=axis)


def _masked_mean(values, mask, axis=None):
    return _masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _masked_var(values, mask, unbiased=True):
    mean = _masked_mean(values, mask)
    variance = _masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if not count.is_meta:  # a dtype probe has no values
            if count == 0:
                raise ValueError("At least one element in the mask has to be 1.")
            if count == 1:
                raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        variance = variance * (count / (count - 1))
    return variance


def _masked_whiten(values, mask, shift_mean=True):
    mean, var = _masked_mean(values, mask), _masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def masked_sum(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_sum``.

    ``sum(values * mask)`` where values outside the mask (even NaN) count as 0; ``axis``: an
    int, a tuple of ints or None (all).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_sum(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0]))
        tensor(1.)
    """
    return _run(_masked_sum, values, mask, axis)


def masked_mean(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_mean``.

    ``masked_sum / (mask.sum() + 1e-8)``: an empty mask gives 0.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([1, 1, 0]))
        tensor(2.)
    """
    return _run(_masked_mean, values, mask, axis)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_var``.

    Masked variance about the masked mean; ``unbiased`` applies Bessel's correction with the
    mask count and raises ``ValueError`` when that count is 0 or 1 (one host sync, as verl).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_var(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
    """
    return _run(_masked_var, values, mask, unbiased)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_whiten``.

    ``(values - mean) * rsqrt(var + 1e-8)`` with masked mean / unbiased variance; the default
    ``shift_mean=True`` gives zero mean, ``False`` adds the mean back (TRL's convention, the
    opposite of torchtune's ``whiten``). Positions outside the mask are transformed too.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
        tensor([-1.,  0.,  1.])
    """
    return _run(_masked_whiten, values, mask, shift_mean)


# ----------------------------------------------------------------------------- loss aggregation


def _agg(
    loss_mat,
    loss_mask,
    loss_agg_mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl 0.9's ``agg_loss``, op for op (the order fixes every rounding and dtype)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return _masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return _masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        counts = torch.sum(loss_mask, dim=-1)
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            per_seq = per_seq / (counts + 1e-8)
        present = (counts > 0).float()  # fully masked sequences do not count
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = present.sum()
        loss = _masked_sum(per_seq, present) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return loss
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES})")


def _agg_v05(loss_mat, loss_mask, loss_agg_mode):
    """verl v0.5's ``agg_loss``, op for op."""
    if loss_agg_mode == "token-mean":
        return _masked_mean(loss_mat, loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES_V05:
        raise ValueError(
            f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES_V05})"
        )
    per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(per_seq)
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(per_seq / torch.sum(loss_mask, dim=-1))
    return torch.sum(per_seq) / loss_mask.shape[-1]


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.agg_loss`` (verl 0.9.x).

    With ``S = masked_sum(loss_mat, loss_mask)`` and per-sequence sums ``s_b``:

    * ``token-mean``: ``S / batch_num_tokens * dp_size`` (``batch_num_tokens`` defaults to
      ``loss_mask.sum()``; no ``+ 1e-8``, so an all-masked batch gives NaN);
    * ``token-sum``: ``S * dp_size``;
    * ``seq-mean-token-sum``: ``sum_b s_b / global_batch_size * dp_size`` over the sequences
      with a valid token (``global_batch_size`` defaults to their number);
    * ``seq-mean-token-mean``: the same with ``s_b / (n_b + 1e-8)``;
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor`` (default:
      ``loss_mask.shape[-1]``, the response length).

    ``dp_size > 1`` needs ``batch_num_tokens`` (token-mean) / ``global_batch_size`` (the
    seq-mean modes): ``ValueError`` otherwise, as in verl. An unknown mode raises
    ``ValueError("Invalid loss_agg_mode: ...")``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> x = torch.arange(1.0, 9.0).reshape(2, 4)
        >>> mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
        >>> core_algos.agg_loss(x, mask, "seq-mean-token-sum")  # the empty row does not count
        tensor(3.)
        >>> core_algos.agg_loss(x, torch.ones(2, 4), "seq-mean-token-sum-norm")
        tensor(4.5000)
        >>> core_algos.agg_loss(x, mask, "token-mean", dp_size=2, batch_num_tokens=6)
        tensor(1.)
    """
    return _run(
        _agg,
        loss_mat,
        loss_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )


# ----------------------------------------------------------------------------- policy / value


def _check_clip_ratio_c(clip_ratio_c) -> None:
    if not clip_ratio_c > 1.0:  # verl asserts this; raised even under python -O
        raise AssertionError(
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
            + f" but get the value: {clip_ratio_c}."
        )


def _policy(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    rollout_is_weights,
    cliprange,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    loss_agg_mode,
    legacy=False,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's vanilla PPO loss, op for op: ``(pg_loss, clipfrac, ppo_kl, clipfrac_lower)``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = _masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = _masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    clipfrac_lower = _masked_mean(torch.gt(loss_ppo, dual_bound) * negative.float(), response_mask)
    per_token = torch.where(negative, torch.min(dual_bound, loss_ppo), loss_ppo)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    if legacy:
        pg_loss = _agg_v05(per_token, response_mask, loss_agg_mode)
    else:
        pg_loss = _agg(
            per_token,
            response_mask,
            loss_agg_mode,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
            loss_scale_factor=loss_scale_factor,
        )
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss`` (vanilla PPO, dual clip):
    deprecated in verl 0.9 in favour of :func:`compute_policy_loss_vanilla`, and so it warns
    (``FutureWarning``) as verl's does.

    Per token: ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``L = max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high))``, and where ``A < 0``
    additionally ``min(L, -A clip_ratio_c)``; aggregated by :func:`agg_loss` with its
    defaults (no global-batch arguments here, as in verl).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        cliprange: symmetric clip range, the default of ``cliprange_low`` / ``cliprange_high``.
        clip_ratio_c: dual-clip constant, must be ``> 1`` (``AssertionError`` otherwise).
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the loss (differentiable
        w.r.t. ``log_prob``), the masked fraction where the clipped branch is strictly larger,
        the masked mean of ``old - new`` (clamped), and the masked fraction where the dual
        clip bound is active.

    Example:
        >>> import torch, warnings
        >>> from fused_rl.compat import verl as core_algos
        >>> old = torch.full((1, 3), -1.0)
        >>> new = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", FutureWarning)
        ...     out = core_algos.compute_policy_loss(old, new, torch.ones(1, 3),
        ...                                          torch.ones(1, 3), cliprange=0.2)
        >>> out[0].backward(); [round(v.item(), 4) for v in out]
        [-0.9355, 0.3333, 0.0, 0.0]
    """
    warnings.warn(
        f"Warning: Function '{__name__}.compute_policy_loss' is deprecated. Please use "
        f"'{__name__}.compute_policy_loss_vanilla' instead.",
        category=FutureWarning,
        stacklevel=2,
    )
    _check_clip_ratio_c(clip_ratio_c)
    return _run(
        _policy, old_log_prob, log_prob, advantages, response_mask, None, cliprange,
        cliprange_low, cliprange_high, clip_ratio_c, loss_agg_mode,
    )  # fmt: skip


_MISSING = object()


def _config_value(config, name: str, default=_MISSING):
    """``config.name`` for verl's ``ActorConfig`` / an OmegaConf ``DictConfig`` / any object
    with attributes, or ``config[name]`` for a plain mapping."""
    if isinstance(config, dict):
        if name in config:
            return config[name]
    elif hasattr(config, name):
        return getattr(config, name)
    if default is _MISSING:
        raise AttributeError(f"config has no {name!r} (verl's ActorConfig field)")
    return default


def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` (verl 0.9's
    ``"vanilla"`` policy loss, the one ``get_policy_loss_fn("vanilla")`` returns).

    The loss of :func:`compute_policy_loss` with the clip ranges read from ``config``
    (``clip_ratio``; ``clip_ratio_low`` / ``clip_ratio_high`` when not None; ``clip_ratio_c``,
    default 3.0), per-token losses multiplied by ``rollout_is_weights`` when given, and
    :func:`agg_loss` called with ``config.global_batch_info`` (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``; empty by default).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        loss_agg_mode: see :func:`agg_loss`.
        config: verl's ``ActorConfig``, an OmegaConf config or any object (or dict) with those
            fields; required (``AssertionError`` when None, as in verl).
        rollout_is_weights: optional ``(B, T)`` rollout-correction weights.

    Returns:
        ``(pg_loss, metrics)``: the loss (differentiable w.r.t. ``log_prob``) and
        ``{"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}`` as Python floats
        (host syncs, as in verl).

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from fused_rl.compat import verl as core_algos
        >>> config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28,
        ...                          clip_ratio_c=3.0, global_batch_info={})
        >>> old = torch.full((1, 3), -1.0)
        >>> new = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
        >>> loss, metrics = core_algos.compute_policy_loss_vanilla(
        ...     old, new, torch.ones(1, 3), torch.ones(1, 3), config=config)
        >>> round(loss.item(), 4), round(metrics["actor/pg_clipfrac"], 4)
        (-0.9622, 0.3333)
    """
    if config is None:
        raise AssertionError("compute_policy_loss_vanilla needs config (verl's ActorConfig)")
    clip_ratio = _config_value(config, "clip_ratio")
    low = _config_value(config, "clip_ratio_low", None)
    high = _config_value(config, "clip_ratio_high", None)
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    clip_ratio_c = _config_value(config, "clip_ratio_c", 3.0)
    _check_clip_ratio_c(clip_ratio_c)
    batch_info = dict(_config_value(config, "global_batch_info", {}) or {})
    unknown = set(batch_info) - {
        "dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor",
    }  # fmt: skip
    if unknown:
        raise TypeError(f"config.global_batch_info has unknown keys {sorted(unknown)}")
    pg_loss, clipfrac, ppo_kl, lower = _run(
        _policy, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        clip_ratio, low, high, clip_ratio_c, loss_agg_mode, **batch_info,
    )  # fmt: skip
    metrics = {
        "actor/pg_clipfrac": clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": lower.detach().item(),
    }
    return pg_loss, metrics


def _value(
    vpreds,
    returns,
    values,
    response_mask,
    cliprange_value,
    loss_agg_mode,
    legacy=False,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's clipped value loss, op for op: ``(vf_loss, vf_clipfrac)``."""
    clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    worst = torch.max(err_unclipped, err_clipped)
    if legacy:
        agg = _agg_v05(worst, response_mask, loss_agg_mode)
    else:
        agg = _agg(
            worst,
            response_mask,
            loss_agg_mode,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
            loss_scale_factor=loss_scale_factor,
        )
    clipfrac = _masked_mean(torch.gt(err_clipped, err_unclipped).float(), response_mask)
    return 0.5 * agg, clipfrac


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_value_loss`` (clipped value loss).

    ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))`` with verl's
    ``clip_by_value`` (``max(min(v, old + c), old - c)``); the global-batch arguments go to
    :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: the loss (differentiable w.r.t. ``vpreds``) and the masked
        fraction where the clipped error is strictly larger (never affected by the
        global-batch arguments).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> v = torch.tensor([[1.0, 0.0]])
        >>> loss, frac = core_algos.compute_value_loss(v, torch.ones(1, 2), torch.zeros(1, 2),
        ...                                             torch.ones(1, 2), 0.5)
        >>> loss.item(), frac.item()
        (0.3125, 0.5)
    """
    return _run(
        _value, vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode,
        dp_size=dp_size, batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
    )  # fmt: skip


def _entropy_loss(logits, response_mask, loss_agg_mode, aggregate):
    if original_half_precision(logits):
        return aggregate(entropy_from_logits(logits), response_mask, loss_agg_mode)
    V.check_logits(logits, "logits")
    entropy = token_entropy(logits)  # fp32 (fp64 for fp64 logits)
    if logits.dtype not in _HALF:
        return aggregate(entropy.to(logits.dtype), response_mask, loss_agg_mode)
    # verl aggregates a half-precision entropy: aggregate the fp32 one, return verl's dtype
    nominal = torch.empty(entropy.shape, dtype=logits.dtype, device="meta")
    dtype = _out_dtypes(aggregate, (nominal, response_mask, loss_agg_mode), {})
    return aggregate(entropy, _fp32(response_mask), loss_agg_mode).to(dtype)


def compute_entropy_loss(
    logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"
) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_entropy_loss``.

    :func:`agg_loss` (with its defaults) of the per-token entropy of ``(B, T, V)`` logits,
    fused (differentiable).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.compute_entropy_loss(torch.zeros(1, 2, 4), torch.ones(1, 2))
        tensor(1.3863)
    """
    return _entropy_loss(logits, response_mask, loss_agg_mode, _agg)


# ----------------------------------------------------------------------------- KL


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


def _kl_kind(kl_penalty, allowed) -> str:
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty must be a str (one of {allowed}), got {kl_penalty!r}")
    kind = _KL_NAMES.get(kl_penalty)
    if kind is None:  # "full" included: verl raises NotImplementedError for both
        raise NotImplementedError(
            f"kl_penalty {kl_penalty!r} is not implemented (verl accepts {allowed})"
        )
    return kind


def kl_penalty_forward(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.kl_penalty_forward``: the KL estimators.

    Per token with ``d = logprob - ref_logprob``: ``"kl"``/``"k1"`` ``d``, ``"abs"`` ``|d|``,
    ``"mse"``/``"k2"`` ``d^2 / 2``, ``"low_var_kl"``/``"k3"`` ``exp(-d) + d - 1`` with ``-d``
    clamped to ``[-20, 20]`` and the result to ``[-10, 10]`` (zero gradient where clamped).
    ``"full"`` and unknown names raise ``NotImplementedError``, as in verl. Fused
    (:func:`fused_rl.kl_estimate`), differentiable w.r.t. both inputs; the inputs broadcast
    and the result has their promoted dtype, as verl's arithmetic gives.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.kl_penalty_forward(torch.tensor([0.5]), torch.tensor([0.0]), "k2")
        tensor([0.1250])
    """
    kind = _kl_kind(kl_penalty, tuple(_KL_NAMES))
    V.check_float(logprob, "logprob")
    V.check_float(ref_logprob, "ref_logprob")
    if original_half_precision(logprob, ref_logprob):
        return _kl_eager(logprob, ref_logprob, kind)
    out_dtype = torch.result_type(logprob, ref_logprob)
    if logprob.shape != ref_logprob.shape:
        logprob, ref_logprob = torch.broadcast_tensors(logprob, ref_logprob)
    return kl_estimate(logprob, ref_logprob, kl_estimator=_KL_NAMES[kl_penalty]).to(out_dtype)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.kl_penalty`` (verl 0.9.x).

    :func:`kl_penalty_forward` of the named estimator. A ``"+"`` suffix (``"k1+"``, ``"kl+"``,
    ``"abs+"``, ``"k3+"``, ``"low_var_kl+"``, ``"k2+"``, ``"mse+"``) is verl's straight-through
    form ``k2 - k2.detach() + value.detach()``: the base estimator's value with the gradient of
    ``k2 = d^2 / 2`` (``d`` w.r.t. ``logprob``, ``-d`` w.r.t. ``ref_logprob``, unclamped),
    the unbiased KL gradient. Where ``k2`` overflows to inf (``|d| > 1.8e19``) or ``d`` is
    infinite, the value is NaN, as in verl.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> kl = core_algos.kl_penalty(lp, torch.tensor([-1.5, -1.0]), "k3+")
        >>> kl.sum().backward()
        >>> [round(v, 4) for v in kl.tolist()], lp.grad.tolist()
        ([0.1065, 0.7183], [0.5, -1.0])
    """
    straight = isinstance(kl_penalty, str) and kl_penalty.endswith("+")
    value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1] if straight else kl_penalty)
    if not straight:
        return value
    k2 = kl_penalty_forward(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


def _kl_penalty_v05(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors verl v0.5's ``core_algos.kl_penalty``: :func:`kl_penalty_forward` (a ``"+"``
    kind raises ``NotImplementedError``, as it did there).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> legacy_v05.kl_penalty(torch.tensor([0.5]), torch.tensor([0.0]), "k1")
        tensor([0.5000])
    """
    return kl_penalty_forward(logprob, ref_logprob, kl_penalty)


# ----------------------------------------------------------------------------- advantages


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


def _as_unit(x) -> float | None:
    """``x`` as a float when the fused kernel takes it (a real number in ``[0, 1]``)."""
    if isinstance(x, Tensor):
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            return None
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if 0.0 <= x <= 1.0 else None


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float | Tensor,
    lam: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``.

    GAE over the tokens where ``response_mask`` is set, skipping the others (verl's
    multi-turn form: a masked token passes the next valid token's value and advantage
    through), then ``returns = advantages + values`` and ``advantages`` whitened by
    :func:`masked_whiten` (zero masked mean; masked positions are not zeroed).

    Runs :func:`fused_rl.gae` on the valid tokens gathered to the front of each row: no
    Python loop over time (``gamma`` / ``lam`` outside ``[0, 1]`` take a step-by-step loop).
    No gradient (verl runs it under ``torch.no_grad``).

    Args:
        token_level_rewards, values: ``(B, T)`` float tensors.
        response_mask: ``(B, T)`` 0/1 mask: float, integer or bool (verl raises on bool).
        gamma, lam: real numbers (0-dim tensors are accepted).

    Returns:
        ``(advantages, returns)``, ``(B, T)`` each, in verl's dtype: the promotion of the
        rewards', values' and (floating) mask's dtypes (bf16 rewards and values with an fp32
        mask give fp32).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> adv, ret = core_algos.compute_gae_advantage_return(
        ...     r, torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]]), 1.0, 1.0)
        >>> ret.tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    """
    V.check_float(token_level_rewards, "token_level_rewards")
    V.check_float(values, "values")
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (B, T), got shape {tuple(token_level_rewards.shape)}"
        )
    V.check_shape(values, token_level_rewards.shape, "values", "token_level_rewards.shape")
    V.check_mask_dtype(response_mask, "response_mask")
    V.check_shape(
        response_mask, token_level_rewards.shape, "response_mask", "token_level_rewards.shape"
    )
    V.check_same_device(
        token_level_rewards=token_level_rewards, values=values, response_mask=response_mask
    )
    dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    if response_mask.is_floating_point():  # verl's x * mask: a floating mask promotes
        dtype = torch.promote_types(dtype, response_mask.dtype)
    with torch.no_grad():
        if original_half_precision(token_level_rewards, values, response_mask):
            advantages = _gae_loop(token_level_rewards, values, response_mask, gamma, lam)
            returns = advantages + values
            return _masked_whiten(advantages, response_mask), returns
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        rewards, vals = token_level_rewards.to(acc), values.to(acc)
        gamma_f, lam_f = _as_unit(gamma), _as_unit(lam)
        if gamma_f is None or lam_f is None:
            advantages = _gae_loop(rewards, vals, response_mask, gamma, lam).to(acc)
        else:
            valid = response_mask.bool()
            length = valid.shape[-1]
            steps = torch.arange(length, device=valid.device)
            # valid tokens first, in order: GAE on them is verl's skip-the-masked recursion
            order = torch.argsort(torch.where(valid, steps, steps + length), dim=-1)
            n_valid = valid.sum(dim=-1, keepdim=True)
            packed, _ = gae(
                rewards.gather(-1, order),
                vals.gather(-1, order),
                gamma=gamma_f,
                lam=lam_f,
                mask=steps < n_valid,
            )
            # a masked token carries the advantage of the next valid one (0 past the last):
            # its packed index is the number of valid tokens before it
            before = torch.cumsum(valid, dim=-1) - valid.long()
            advantages = packed.gather(-1, before)
        returns = (advantages + vals).to(dtype)
        advantages = _masked_whiten(advantages, _fp32(response_mask)).to(dtype)
    return advantages, returns


def _group_ids(index, n: int) -> list:
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != n:
        raise ValueError(f"index must hold {n} group ids (one per sample), got {len(ids)}")
    return ids


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


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage``.

    ``s = token_level_rewards.sum(-1)``; within each group of equal ``index`` (any hashable
    ids, e.g. verl's uid strings, in any order): ``(s - mean) / (std + epsilon)`` with the
    unbiased std (``s - mean`` when ``norm_adv_by_std_in_grpo=False``: Dr. GRPO); a group of
    one keeps ``s / (1 + epsilon)`` (verl's mean 0, std 1, with ``1 + epsilon`` rounded to
    fp32 as verl's ``torch.tensor(1.0) + epsilon`` is). Broadcast over the response by
    ``* response_mask``. Vectorised over groups (no Python loop over samples).

    Args:
        token_level_rewards: ``(B, T)`` float rewards.
        response_mask: ``(B, T)`` mask.
        index: ``B`` group ids (numpy array, list or tensor).
        config: accepted for compatibility, unused (as in verl's GRPO estimator).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, as verl returns it, in
        the dtype of ``scores * response_mask`` (the scores rounded to the rewards' dtype).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
        >>> adv, _ = core_algos.compute_grpo_outcome_advantage(r, torch.ones(3, 2),
        ...                                                    ["a", "a", "b"])
        >>> [round(v, 4) for v in adv[:, 0].tolist()]
        [0.7071, -0.7071, 1.0]
    """
    V.check_float(token_level_rewards, "token_level_rewards")
    V.check_mask_dtype(response_mask, "response_mask")
    ids = _group_ids(index, token_level_rewards.shape[0])
    with torch.no_grad():
        if original_half_precision(token_level_rewards):
            scores = _grpo_loop(
                token_level_rewards.sum(dim=-1), ids, epsilon, norm_adv_by_std_in_grpo
            )
            advantages = scores.unsqueeze(-1) * response_mask
            return advantages, advantages
        dtype = token_level_rewards.dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scores = token_level_rewards.to(acc).sum(dim=-1)
        groups: dict = {}
        group = torch.tensor([groups.setdefault(i, len(groups)) for i in ids], dtype=torch.long)
        group = group.to(scores.device)
        count = torch.zeros(len(groups), dtype=acc, device=scores.device)
        count.index_add_(0, group, torch.ones_like(scores))
        mean = torch.zeros_like(count).index_add_(0, group, scores) / count
        centred = scores - mean[group]
        sq = torch.zeros_like(count).index_add_(0, group, centred**2)
        std = torch.sqrt(sq / (count - 1))
        single = count[group] == 1
        centred = torch.where(single, scores, centred)  # a group of one: mean 0 ...
        if norm_adv_by_std_in_grpo:
            one_eps = (torch.tensor(1.0) + epsilon).to(acc)  # ... std 1, plus eps in fp32
            divisor = torch.where(single, one_eps.to(scores.device), std[group] + epsilon)
            centred = centred / divisor
        advantages = centred.to(dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


# ----------------------------------------------------------------------------- verl v0.5


LOSS_AGG_MODES_V05 = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _agg_loss_v05(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """Mirrors verl v0.5's ``core_algos.agg_loss``.

    * ``token-mean``: :func:`masked_mean` over all tokens (``+ 1e-8``: an empty batch gives 0);
    * ``seq-mean-token-sum``: mean over all ``B`` sequences of the masked token sum;
    * ``seq-mean-token-mean``: mean over all sequences of ``sum / mask.sum(-1)`` (a sequence
      with no valid token gives NaN);
    * ``seq-mean-token-sum-norm``: ``sum of all masked tokens / loss_mask.shape[-1]`` (not
      divided by the batch size).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> x = torch.arange(1.0, 9.0).reshape(2, 4)
        >>> legacy_v05.agg_loss(x, torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]),
        ...                     "seq-mean-token-sum")
        tensor(1.5000)
        >>> legacy_v05.agg_loss(x, torch.ones(2, 4), "seq-mean-token-sum-norm")
        tensor(9.)
    """
    return _run(_agg_v05, loss_mat, loss_mask, loss_agg_mode)


def _compute_policy_loss_v05(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mirrors verl v0.5's ``core_algos.compute_policy_loss``: :func:`compute_policy_loss`
    aggregated by v0.5's ``agg_loss``, without the deprecation warning.

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> out = legacy_v05.compute_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2),
        ...                                      torch.ones(1, 2), torch.zeros(1, 2), 0.2)
        >>> out[0]  # an empty batch: 0 (verl 0.9 gives NaN)
        tensor(0.)
    """
    _check_clip_ratio_c(clip_ratio_c)
    return _run(
        _policy, old_log_prob, log_prob, advantages, response_mask, None, cliprange,
        cliprange_low, cliprange_high, clip_ratio_c, loss_agg_mode, legacy=True,
    )  # fmt: skip


def _compute_value_loss_v05(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor]:
    """Mirrors verl v0.5's ``core_algos.compute_value_loss`` (no global-batch arguments).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> v = torch.tensor([[1.0, 0.0]])
        >>> legacy_v05.compute_value_loss(v, torch.ones(1, 2), torch.zeros(1, 2),
        ...                               torch.ones(1, 2), 0.5)[0]
        tensor(0.3125)
    """
    return _run(
        _value, vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode,
        legacy=True,
    )  # fmt: skip


def _compute_entropy_loss_v05(
    logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"
) -> Tensor:
    """Mirrors verl v0.5's ``core_algos.compute_entropy_loss`` (v0.5's ``agg_loss``).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> legacy_v05.compute_entropy_loss(torch.zeros(1, 2, 4), torch.zeros(1, 2))
        tensor(0.)
    """
    return _entropy_loss(logits, response_mask, loss_agg_mode, _agg_v05)


legacy_v05 = types.ModuleType(
    f"{__name__}.legacy_v05",
    """verl's v0.5 line (2025: ``core_algos.py`` at commit ``012be9d9``, release 0.5.0).

Use it where a v0.5 behaviour is still wanted:
``from fused_rl.compat.verl import legacy_v05 as core_algos``. What differs from 0.9.x:
``agg_loss`` (four modes, no global-batch arguments; ``token-mean`` is ``masked_mean`` with
``+ 1e-8``, so an all-masked batch gives 0; ``seq-mean-*`` average over all ``B`` sequences,
so an empty one counts as 0 or, for ``seq-mean-token-mean``, NaN;
``seq-mean-token-sum-norm`` divides the token sum by the response length only),
``compute_value_loss`` and ``compute_policy_loss`` with that ``agg_loss`` (no deprecation
warning), ``compute_entropy_loss`` likewise, and ``kl_penalty`` without the ``"+"``
straight-through kinds. GAE, GRPO and the ``torch_functional`` helpers are the same
functions as in :mod:`fused_rl.compat.verl` (their values did not change).
""",
)
for _name, _fn in {
    "agg_loss": _agg_loss_v05,
    "compute_policy_loss": _compute_policy_loss_v05,
    "compute_value_loss": _compute_value_loss_v05,
    "compute_entropy_loss": _compute_entropy_loss_v05,
    "kl_penalty": _kl_penalty_v05,
    "compute_gae_advantage_return": compute_gae_advantage_return,
    "compute_grpo_outcome_advantage": compute_grpo_outcome_advantage,
    "logprobs_from_logits": logprobs_from_logits,
    "entropy_from_logits": entropy_from_logits,
    "clip_by_value": clip_by_value,
    "masked_sum": masked_sum,
    "masked_mean": masked_mean,
    "masked_var": masked_var,
    "masked_whiten": masked_whiten,
    "LOSS_AGG_MODES": LOSS_AGG_MODES_V05,
}.items():
    setattr(legacy_v05, _name, _fn)
del _name, _fn
# ``import fused_rl.compat.verl.legacy_v05`` / ``from fused_rl.compat.verl.legacy_v05 import``
sys.modules[legacy_v05.__name__] = legacy_v05

__all__ = [
    "LOSS_AGG_MODES",
    "KL_PENALTIES",
    "agg_loss",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "entropy_from_logits",
    "kl_penalty",
    "kl_penalty_forward",
    "legacy_v05",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


# ----------------------------------------------------------------------------- fused linear
#
# verl's two fused lm_head ops (hidden states -> per-token log-prob and entropy, the logits
# never whole): ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (chunked
# PyTorch, outputs in the hidden states' dtype) and
# ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (Triton, fp32 outputs).
# Both run :func:`fused_rl.linear_token_logprobs`.

LINEAR_CE_REDUCTIONS = ("none", "sum", "mean")


def _token_ids(ids, name: str) -> Tensor:
    """verl's token ids as the kernels take them: int64 / int32 as they come, any other
    integer dtype as int64 (verl casts to int64); bool / floating ids raise ``TypeError``."""
    V.check_tensor(ids, name)
    if ids.dtype in V.INDEX_DTYPES:
        return ids
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must be an integer tensor of token ids, got {ids.dtype}")
    return ids.long()


def _check_lm_head(hidden, weight, hidden_name: str, weight_name: str) -> None:
    """``hidden`` ``(..., H)`` and ``weight`` ``(V, H)``, floating, one dtype (unless autocast
    casts them, as ``hidden @ weight.T`` would), one device; messages name verl's arguments."""
    V.check_float(hidden, hidden_name)
    V.check_float(weight, weight_name)
    if hidden.dim() < 2:
        raise ValueError(
            f"{hidden_name} must be (..., H) hidden states, got shape {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} must be the lm_head's (V, H) with V >= 1 and H = "
            f"{hidden_name}.shape[-1] = {hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise TypeError(
            f"{weight_name} ({weight.dtype}) and {hidden_name} ({hidden.dtype}) must share a "
            "dtype (verl's hidden @ weight.T needs it outside autocast)"
        )
    V.check_same_device(**{hidden_name: hidden, weight_name: weight})


def _check_token_range(ids: Tensor, vocab: int, name: str, original: str) -> None:
    """Eager check (one host sync; off with ``fused_rl.config.check_values``) that every id
    is in ``[0, V)``: verl has no ignore index (its gather raises, its kernel reads garbage)."""
    if not V.value_checks_enabled(ids):
        return
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        first = ids[bad].reshape(-1)[0].item()
        raise ValueError(
            f"{name} holds {first}, outside [0, V) = [0, {vocab}); verl's {original} has no "
            "ignore index: replace ignored ids (e.g. -100) by a valid id and mask them out"
        )


def _linear_stats(hidden, weight, ids, temperature, chunk_tokens):
    """``(logp, entropy)`` of ``hidden @ weight.T / temperature`` at ``ids`` (fp32; fp64 for
    fp64 inputs), through :func:`fused_rl.linear_token_logprobs`."""
    from ..linear import linear_token_logprobs

    return linear_token_logprobs(
        hidden, weight, ids, temperature=float(temperature), return_entropy=True,
        chunk_tokens=chunk_tokens,
    )  # fmt: skip


class FusedLinearForPPO(torch.nn.Module):
    """Mirrors ``verl.utils.experimental.torch_functional.FusedLinearForPPO``.

    ``log_softmax(hidden_states @ vocab_weights.T / temperature)`` gathered at ``input_ids``,
    and the entropy of that softmax, ``chunk_size`` tokens at a time: the ``(N, V)`` logits
    are never held whole. Runs :func:`fused_rl.linear_token_logprobs` (one GEMM and one pass
    of the vocab kernel per chunk forward; backward: the chunk's logits recomputed, the
    gradient written over them, ``dH = dz W``, ``dW += dz^T h`` in fp32).

    Args:
        chunk_size: tokens per chunk (verl's default 512); a positive int.

    ``forward(hidden_states, vocab_weights, input_ids, temperature=1.0)``:

    * ``hidden_states``: ``(B, T, H)`` or ``(N, H)`` final hidden states (any strides);
    * ``vocab_weights``: the lm_head ``(V, H)``, ``hidden_states``' dtype (no bias, as in
      verl);
    * ``input_ids``: ``hidden_states.shape[:-1]`` ids in ``[0, V)``, **already shifted**:
      row ``t`` is scored at ``input_ids[..., t]`` (verl's callers pass
      ``torch.roll(input_ids, -1, dims=-1)``; nothing is rolled here); any integer dtype
      (verl casts to int64); an id outside ``[0, V)`` raises ``ValueError`` naming
      ``input_ids``;
    * ``temperature``: a real number ``> 0`` dividing the logits.

    Returns:
        ``(log_probs, entropy)``, each ``hidden_states.shape[:-1]`` in ``hidden_states``'
        dtype (verl's: it computes in fp32 and casts back); differentiable w.r.t.
        ``hidden_states`` and ``vocab_weights`` (gradients in their dtypes) under any
        upstream gradient on either output.

    Where it departs from verl (docs/compat.md, "verl"): for fp16 / bf16 inputs the gradient
    ``dz`` is not divided by ``temperature`` in that dtype and ``vocab_weights``' gradient
    accumulates over the chunks in fp32 (verl: in the weights' dtype), so it is at least as
    accurate; an fp64 input is computed in fp64 (verl: fp32). ``fused_rl.compat.half_precision``
    does not apply (there is no ``"original"`` op sequence to reproduce here).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import FusedLinearForPPO
        >>> h = torch.zeros(2, 3, 8, requires_grad=True)
        >>> w = torch.randn(16, 8, requires_grad=True)
        >>> lp, ent = FusedLinearForPPO(chunk_size=4)(h, w, torch.zeros(2, 3, dtype=torch.long))
        >>> lp.shape, lp.dtype, round(lp[0, 0].item(), 4), round(ent[1, 2].item(), 4)
        (torch.Size([2, 3]), torch.float32, -2.7726, 2.7726)
        >>> (lp.sum() + ent.sum()).backward()
        >>> h.grad.shape, w.grad.shape
        (torch.Size([2, 3, 8]), torch.Size([16, 8]))
    """

    def __init__(self, chunk_size: int = 512):
        super().__init__()
        V.check_positive_int(chunk_size, "chunk_size")
        self.chunk_size = chunk_size

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"

    def forward(
        self,
        hidden_states: Tensor,
        vocab_weights: Tensor,
        input_ids: Tensor,
        temperature: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        V.check_positive_int(self.chunk_size, "chunk_size")  # an attribute: may be reassigned
        _check_lm_head(hidden_states, vocab_weights, "hidden_states", "vocab_weights")
        if hidden_states.dim() not in (2, 3):
            shape = tuple(hidden_states.shape)
            raise ValueError(f"hidden_states must be (B, T, H) or (N, H), got shape {shape}")
        ids = _token_ids(input_ids, "input_ids")
        if tuple(ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                "input_ids must have shape hidden_states.shape[:-1] = "
                f"{tuple(hidden_states.shape[:-1])}, got {tuple(ids.shape)} (one id per row, "
                "already shifted: FusedLinearForPPO does not roll them)"
            )
        V.check_same_device(hidden_states=hidden_states, input_ids=ids)
        V.check_positive(temperature, "temperature")
        _check_token_range(ids, vocab_weights.shape[0], "input_ids", "FusedLinearForPPO")
        logp, entropy = _linear_stats(
            hidden_states, vocab_weights, ids, temperature, self.chunk_size
        )
        return logp.to(hidden_states.dtype), entropy.to(hidden_states.dtype)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (verl's Triton
    fused lm_head + log-prob / entropy op, vocab-parallel with ``dist_process_group``).

    Per token, with ``z = hidden @ weight.T / temperature``: ``log_softmax(z)[label]`` (the
    log-prob, not its negative, despite the name) and the entropy of ``softmax(z)``. Runs
    :func:`fused_rl.linear_token_logprobs` (chunked; the ``(N, V)`` logits are never whole).

    Args:
        hidden: ``(..., H)`` hidden states, flattened to ``(N, H)`` (typically ``(B, T, H)``;
            any strides, verl needs them contiguous).
        weight: the lm_head ``(V, H)``, ``hidden``'s dtype.
        labels: ``N`` ids in ``[0, V)`` (any shape holding one per hidden row, e.g.
            ``(B, T)``), **already shifted** (verl's callers roll them by -1); any integer
            dtype. An id outside ``[0, V)`` raises ``ValueError`` naming ``labels``.
        temperature: a real number ``> 0`` (verl asserts a Python float; an int is accepted).
        reduction: ``"none"`` (per-token log-probs), ``"sum"`` (their sum) or ``"mean"``
            (their sum over ``N``), case-insensitive as verl's ``reduction.lower()``; anything
            else raises ``ValueError`` naming ``reduction`` (a non-str ``TypeError``). The
            entropy is per token whatever the reduction, as in verl.
        dist_process_group: None, or verl's vocab-parallel form (Megatron's tensor-parallel
            group): ``weight`` is this rank's ``(V_local, H)`` slice, rank ``r`` holding ids
            ``[r V_local, (r + 1) V_local)`` of ``V = P V_local``; ``hidden`` and the global
            ``labels`` are the same on every rank. Every rank gets the unsharded log-probs
            and entropy and its slice of the weight gradient; as in verl, ``hidden``'s
            gradient is this rank's PARTIAL ``dz W_local`` (not all-reduced: verl's callers
            reduce it, Megatron's sequence-parallel gather by its reduce-scatter). Runs
            :func:`fused_rl.linear_token_logprobs` with ``process_group=``,
            ``reduce_hidden_grad=False``: two all-reduces forward, none backward.

    Returns:
        ``(logprobs, entropy)`` in fp32 whatever the inputs' dtype, as verl allocates them:
        ``logprobs`` ``(N,)`` (flat, even for ``(B, T, H)`` hidden) or 0-dim for ``"sum"`` /
        ``"mean"``; ``entropy`` ``(N,)``. Differentiable w.r.t. ``hidden`` (gradient in its
        shape) and ``weight``, gradients in their dtypes.

    Where it departs from verl (docs/compat.md, "verl"): runs on CPU (the reference or the
    Triton interpreter) as well as CUDA, for any ``H`` (verl asserts ``H % 128 == 0``);
    fp64 inputs are computed in fp64 (the outputs are still fp32); each gradient element is
    rounded to the inputs' dtype once (verl's default backward adds ``hidden``'s gradient over
    vocabulary slices of 9504 in that dtype).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl
        >>> h = torch.zeros(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(16, 8, dtype=torch.bfloat16)
        >>> lp, ent = verl.linear_cross_entropy(h, w, torch.zeros(2, 3, dtype=torch.long))
        >>> lp.shape, lp.dtype, round(lp[0].item(), 4), round(ent[5].item(), 4)
        (torch.Size([6]), torch.float32, -2.7726, 2.7726)
        >>> total, _ = verl.linear_cross_entropy(h, w, torch.zeros(6, dtype=torch.long),
        ...                                      reduction="sum")
        >>> total.shape, round(total.item(), 3)
        (torch.Size([]), -16.636)
    """
    if not isinstance(reduction, str):
        raise TypeError(
            f"reduction must be a str, one of {LINEAR_CE_REDUCTIONS}, got "
            f"{type(reduction).__name__}"
        )
    mode = reduction.lower()
    if mode not in LINEAR_CE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LINEAR_CE_REDUCTIONS}, got {reduction!r}")
    V.check_positive(temperature, "temperature")
    _check_lm_head(hidden, weight, "hidden", "weight")
    rows = hidden.reshape(-1, hidden.shape[-1])
    ids = _token_ids(labels, "labels")
    if ids.numel() != rows.shape[0]:
        raise ValueError(
            f"labels must hold one id per hidden row, N = {rows.shape[0]} for hidden of shape "
            f"{tuple(hidden.shape)}, got shape {tuple(ids.shape)}"
        )
    ids = ids.reshape(-1)
    V.check_same_device(hidden=hidden, labels=ids)
    if dist_process_group is None:
        _check_token_range(ids, weight.shape[0], "labels", "linear_cross_entropy")
        logp, entropy = _linear_stats(rows, weight, ids, temperature, None)
    else:  # verl's equal slices; the labels are the same on every rank: all raise, or none
        import torch.distributed as dist

        from ..linear import linear_token_logprobs

        if not isinstance(dist_process_group, dist.ProcessGroup):
            raise TypeError(
                "dist_process_group must be None or a torch.distributed ProcessGroup (the "
                f"tensor-parallel group), got {type(dist_process_group).__name__}"
            )
        world = dist.get_world_size(dist_process_group)
        _check_token_range(ids, world * weight.shape[0], "labels", "linear_cross_entropy")
        logp, entropy = linear_token_logprobs(
            rows, weight, ids, temperature=float(temperature), return_entropy=True,
            process_group=dist_process_group, reduce_hidden_grad=False,
        )  # fmt: skip
    logp, entropy = logp.float(), entropy.float()
    if mode == "sum":
        logp = logp.sum()
    elif mode == "mean":
        logp = logp.mean()
    return logp, entropy


__all__ += ["FusedLinearForPPO", "LINEAR_CE_REDUCTIONS", "linear_cross_entropy"]


# ----------------------------------------------------------------------------- policy-loss registry
#
# verl's ``POLICY_LOSS_REGISTRY`` / ``get_policy_loss_fn`` (``core_algos.py``): every entry has
# the signature ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
# rollout_is_weights) -> (loss, metrics)``. ``vanilla`` is :func:`compute_policy_loss_vanilla`
# above (verl's op sequence); ``gspo``, ``sapo``, ``gpg`` and ``cispo`` run
# :func:`fused_rl.policy_loss_from_logprobs` (one token-layer kernel and one reduction forward,
# two elementwise ops backward) with verl's ``agg_loss`` expressed as per-token weights and a
# divisor, and compute verl's metrics beside it. These four compute in fp32 (fp64 for fp64
# log-probs) and round the loss once to verl's dtype in both ``half_precision`` modes: no verl
# half-precision op sequence is reproduced for them (``vanilla`` keeps its ``"original"``).
# ``clip_cov``, ``kl_cov``, ``geo_mean``, ``dppo_tv``, ``dppo_kl`` and ``dro`` run the same op
# with their token-space terms (selections, trust-region masks, truncated ratios, weights)
# computed in plain PyTorch beside it.

# verl 0.9.1's registry, in its order (the list its ValueError prints)
VERL_POLICY_LOSSES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
    "dro", "cispo", "bypass_mode",
)  # fmt: skip
_NOT_BUILT = {
    "bypass_mode": "bypass mode (rollout correction computed inside the loss)",
}
_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_LOG_RATIO_CLAMP = 20.0  # verl's clamp of log_prob - old_log_prob (vanilla, sapo, cispo)
_GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of GSPO's log sequence ratio (upper only)
# verl 0.9.1 ``ActorConfig`` defaults, for fields a config object or dict leaves out
_ACTOR_DEFAULTS = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}
# verl 0.9.1 ``PolicyLossConfig`` defaults (``config.policy_loss.*``) and the fallbacks its
# functions use when a field is None (``ppo_kl_coef``: 0.1 in the dataclass, 1.0 when None)
_POLICY_LOSS_DEFAULTS = {
    "clip_cov_ratio": (0.0002, 0.0002),
    "clip_cov_lb": (1.0, 1.0),
    "clip_cov_ub": (5.0, 5.0),
    "kl_cov_ratio": (0.0002, 0.0002),
    "ppo_kl_coef": (0.1, 1.0),
}
_BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def _actor_field(config, name: str):
    return _config_value(config, name, _ACTOR_DEFAULTS[name])


def _clip_band(config) -> tuple[float, float]:
    """verl's ``clip_ratio_low`` / ``clip_ratio_high``, each ``clip_ratio`` when None."""
    ratio = _actor_field(config, "clip_ratio")
    low, high = _actor_field(config, "clip_ratio_low"), _actor_field(config, "clip_ratio_high")
    return (ratio if low is None else low), (ratio if high is None else high)


def _global_batch_info(config) -> dict:
    info = dict(_config_value(config, "global_batch_info", {}) or {})
    unknown = set(info) - set(_BATCH_INFO_KEYS)
    if unknown:
        raise TypeError(f"config.global_batch_info has unknown keys {sorted(unknown)}")
    return info


def _agg_as_weights(
    mask: Tensor,
    loss_agg_mode: str,
    dtype: torch.dtype,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> tuple[Tensor, Tensor]:
    """verl 0.9's ``agg_loss`` as ``(w, n)`` with ``agg_loss(L) = sum(w * L) / n``: ``w`` the
    per-token weights (``fused_rl``'s float mask) and ``n`` a 0-dim divisor (its
    ``num_items``, never read on the host: a zero count gives NaN, as verl's ``0 / 0``)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES})"
        )
    weights = mask.detach().to(dtype)

    def divisor(x) -> Tensor:
        return torch.as_tensor(x, device=weights.device).to(dtype).reshape(()) / dp_size

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = weights.sum()
        return weights, divisor(batch_num_tokens)
    if loss_agg_mode == "token-sum":
        return weights, divisor(1.0)
    counts = weights.sum(dim=-1, keepdim=True)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = (counts > 0).sum()  # sequences with a valid token
    n = divisor(global_batch_size)
    if loss_agg_mode == "seq-mean-token-mean":
        weights = weights / (counts + 1e-8)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        n = n * (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return weights, n


def _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights) -> None:
    V.check_float(log_prob, "log_prob")
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(log_prob.shape)}")
    shape = tuple(log_prob.shape)
    V.check_float(old_log_prob, "old_log_prob")
    V.check_float(advantages, "advantages")
    V.check_mask_dtype(response_mask, "response_mask")
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("response_mask", response_mask)):  # fmt: skip
        V.check_shape(t, shape, name, "log_prob.shape")
    if weights is not None:
        V.check_float(weights, "rollout_is_weights")
        if tuple(weights.shape) not in (shape, (shape[0], 1), (shape[0],)):
            raise ValueError(
                f"rollout_is_weights must have shape (B, T) = {shape}, (B, 1) or (B,), got "
                f"{tuple(weights.shape)}"
            )


def _verl_loss_dtype(name, old_log_prob, log_prob, advantages, response_mask, weights, mode,
                     batch_info) -> torch.dtype:  # fmt: skip
    """The dtype verl's loss comes out in: its per-token loss's (the promotion of the inputs
    its arithmetic touches), then through ``agg_loss`` (probed on meta tensors)."""
    dtype = torch.promote_types(log_prob.dtype, advantages.dtype)
    if name != "gpg":
        dtype = torch.promote_types(dtype, old_log_prob.dtype)
    if name == "gspo" and response_mask.is_floating_point():  # the sequence mean's mask
        dtype = torch.promote_types(dtype, response_mask.dtype)
    if weights is not None:
        dtype = torch.promote_types(dtype, weights.dtype)
    nominal = torch.empty(log_prob.shape, dtype=dtype, device="meta")
    return _out_dtypes(_agg, (nominal, response_mask, mode), batch_info)


def _registered_policy_loss(
    name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights,
):  # fmt: skip
    """verl's ``compute_policy_loss_<name>`` for ``name`` in gspo | sapo | gpg | cispo."""
    from ..losses import policy_loss_from_logprobs

    if config is None:
        raise AssertionError(f"compute_policy_loss_{name} needs config (verl's ActorConfig)")
    weights = rollout_is_weights
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    batch_info = _global_batch_info(config)
    if name == "sapo":  # verl aggregates SAPO per sequence whatever loss_agg_mode says
        loss_agg_mode = "seq-mean-token-mean"
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        name, old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    low, high = _clip_band(config)
    if name in ("gspo", "cispo"):
        V.check_nonnegative(low, "config.clip_ratio_low (or clip_ratio)")
        V.check_nonnegative(high, "config.clip_ratio_high (or clip_ratio)")
    kwargs = {"surrogate": "ppo" if name == "gspo" else name}
    metrics: dict[str, float] = {}
    with torch.no_grad():
        mask = _fp32(response_mask)
        valid = response_mask.bool()
        lp, old = log_prob.detach().to(acc), old_log_prob.detach().to(acc)
        log_ratio = lp - old
        clamped = torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        outside = log_ratio.abs() > _LOG_RATIO_CLAMP  # where verl's clamp is active
    if name == "gspo":
        with torch.no_grad():
            m = mask.to(acc)
            seq = (torch.where(valid, log_ratio, 0.0) * m).sum(-1) / m.sum(-1).clamp(min=1)
            seq = seq[:, None].expand_as(log_ratio)
            log_s = torch.clamp(seq, max=_GSPO_LOG_RATIO_MAX)
        # verl's GSPO-token ratio exp(logp - sg(logp) + sg(log s)): the sequence's value,
        # each token's own gradient, none where the clamp at 10 is active
        active = seq > _GSPO_LOG_RATIO_MAX
        logp_in = torch.where(active, log_s, log_prob - log_prob.detach() + log_s)
        old_in = torch.zeros_like(log_s)
        kwargs.update(eps_low=low, eps_high=high)
        with torch.no_grad():
            s = torch.exp(log_s)
            adv = _fp32(advantages).to(acc)
            unclipped, clipped = -adv * s, -adv * torch.clamp(s, 1 - low, 1 + high)
            metrics = {
                "actor/pg_clipfrac": _masked_mean(torch.gt(clipped, unclipped).float(), mask),
                "actor/ppo_kl": _masked_mean(-log_ratio, mask),
                "actor/pg_clipfrac_lower": 0.0,
            }
    elif name == "sapo":
        # the ratio is exp(clamp(logp - old, -20, 20)): its value exactly, the gradient 0
        # where the clamp is active (as verl's clamp)
        logp_in = torch.where(outside, clamped, log_prob - log_prob.detach() + clamped)
        old_in = torch.zeros_like(clamped)
        tau_pos, tau_neg = _actor_field(config, "tau_pos"), _actor_field(config, "tau_neg")
        V.check_positive(tau_pos, "config.tau_pos")  # verl divides by them
        V.check_positive(tau_neg, "config.tau_neg")
        kwargs.update(sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
        metrics = {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0}
        with torch.no_grad():
            metrics["actor/ppo_kl"] = _masked_mean(-clamped, mask)
    elif name == "cispo":
        # the loss holds logp itself (-sg(w) A logp): keep it, and move old_log_prob where the
        # clamp is active so that the ratio is exp(clamped); w is detached, so the gradient
        # (-w A) is verl's either way
        logp_in = log_prob
        old_in = torch.where(outside, lp - clamped, old)
        kwargs.update(eps_low=low, eps_high=high)
        with torch.no_grad():
            ratio = torch.exp(clamped)
            out = (ratio != torch.clamp(ratio, 1 - low, 1 + high)).float()
            metrics = {
                "actor/pg_clipfrac": _masked_mean(out, mask),
                "actor/ppo_kl": _masked_mean(-clamped, mask),
                "actor/pg_clipfrac_lower": 0.0,
            }
    else:  # gpg: -A logp, no ratio, no metric
        logp_in, old_in = log_prob, None
    loss, _ = policy_loss_from_logprobs(
        logp_in, advantages, old_logprobs=old_in, mask=agg_w, is_weights=weights,
        loss_agg="token-mean", num_items=divisor, **kwargs,
    )  # fmt: skip
    metrics = {k: v if isinstance(v, float) else v.detach().item() for k, v in metrics.items()}
    return loss.to(out_dtype), metrics


def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_gspo`` (verl 0.9.x, the
    ``"gspo"`` entry of :func:`get_policy_loss_fn`; GSPO, arXiv 2507.18071).

    Per sequence ``i``, ``d_i = sum_t (log_prob - old_log_prob) m / max(sum_t m, 1)``; per
    token the "GSPO-token" ratio ``s = exp(min(logp - sg(logp) + sg(d_i), 10))`` (the
    sequence's value ``exp(min(d_i, 10))``, the gradient through the token's own log-prob
    only, zero where ``d_i > 10``), ``L = max(-A s, -A clip(s, 1 - clip_ratio_low,
    1 + clip_ratio_high))`` (no dual clip), times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` (default ``"seq-mean-token-mean"``) and
    ``config.global_batch_info``. Runs :func:`fused_rl.policy_loss_from_logprobs`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        loss_agg_mode: see :func:`agg_loss`. (verl's main branch before 0.9 always used
            ``"seq-mean-token-mean"``.)
        config: verl's ``ActorConfig``, an OmegaConf config, any object with attributes or a
            dict: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (``ActorConfig``'s
            0.2 where absent) and ``global_batch_info``. Required (``AssertionError``).
        rollout_is_weights: optional ``(B, T)`` (or ``(B, 1)``, ``(B,)``) constant weights.

    Returns:
        ``(pg_loss, metrics)``: the loss in verl's dtype, differentiable w.r.t. ``log_prob``;
        ``{"actor/pg_clipfrac": masked mean of [clipped branch strictly larger],
        "actor/ppo_kl": masked mean of old - new (unclamped), "actor/pg_clipfrac_lower": 0.0}``
        as Python floats (host syncs, as in verl).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> fn = core_algos.get_policy_loss_fn("gspo")
        >>> old = torch.zeros(2, 3)
        >>> new = torch.tensor([[0.3, 0.3, 0.3], [-0.1, 0.0, 0.1]], requires_grad=True)
        >>> adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
        >>> loss, metrics = fn(old, new, adv, torch.ones(2, 3), config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]
        (-0.1, 0.5)
    """
    return _registered_policy_loss(
        "gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_sapo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_sapo`` (the ``"sapo"``
    entry; SAPO, arXiv 2511.20347).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``, ``tau = config.tau_pos``
    where ``A > 0`` else ``config.tau_neg``, ``L = -A sigmoid(tau (r - 1)) 4 / tau``, times
    ``rollout_is_weights``, aggregated by :func:`agg_loss` with ``"seq-mean-token-mean"``
    **whatever** ``loss_agg_mode`` says (as verl), and ``config.global_batch_info``. The
    gradient is ``-4 A sigma (1 - sigma) r``, zero where the ``+-20`` clamp is active.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, with ``tau_pos`` (1.0) and
            ``tau_neg`` (1.05), each ``> 0`` (``ValueError``; verl divides by them).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": masked mean of the clamped
        old - new, "actor/pg_clipfrac_lower": 0.0})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> loss, metrics = core_algos.compute_policy_loss_sapo(
        ...     torch.zeros(1, 2), torch.zeros(1, 2, requires_grad=True), torch.ones(1, 2),
        ...     torch.ones(1, 2), config={})
        >>> loss.item(), metrics["actor/ppo_kl"]  # sigmoid(0) * 4 / tau_pos = 2
        (-2.0, 0.0)
    """
    return _registered_policy_loss(
        "sapo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_gpg(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_gpg`` (the ``"gpg"`` entry).

    ``L = -log_prob * A`` per token, times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``;
    ``old_log_prob`` is not used.

    Returns:
        ``(pg_loss, {})``: verl reports no metric for GPG.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> loss, metrics = core_algos.compute_policy_loss_gpg(
        ...     torch.zeros(1, 2), logp, torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> loss.item(), metrics
        (1.5, {})
    """
    return _registered_policy_loss(
        "gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_cispo`` (the ``"cispo"``
    entry; CISPO, MiniMax-M1, arXiv 2506.13585).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``L = -sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) A log_prob`` (verl's band,
    two-sided and relative to 1; TRL's and Liger's CISPO cap the ratio at an absolute
    ``epsilon_high`` instead), times ``rollout_is_weights``, aggregated by :func:`agg_loss`
    with ``loss_agg_mode`` and ``config.global_batch_info``. The gradient is
    ``-sg(clamp(r)) A w``.

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [r outside the band, either side],
        "actor/ppo_kl": masked mean of the clamped old - new, "actor/pg_clipfrac_lower":
        0.0})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> config = {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}  # verl's example band
        >>> logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.5]])  # ratios 1 and e^0.5 (capped at 1.2)
        >>> loss, metrics = core_algos.compute_policy_loss_cispo(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2), config=config)
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]
        (1.1, 0.5)
    """
    return _registered_policy_loss(
        "cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def _policy_loss_field(config, name: str):
    """``config.policy_loss.<name>`` (verl's ``PolicyLossConfig``): its default where the
    field (or ``policy_loss`` itself) is absent, verl's fallback where it is None; an explicit
    ``policy_loss=None`` fails verl's assert."""
    default, fallback = _POLICY_LOSS_DEFAULTS[name]
    sub = _config_value(config, "policy_loss", {})
    if sub is None:
        raise AssertionError("config.policy_loss is None (verl asserts it is set)")
    value = _config_value(sub, name, default)
    return fallback if value is None else value


def _rollout_weights_2d(weights, like: Tensor):
    """rollout IS weights ``(B, T)`` / ``(B, 1)`` / ``(B,)`` as a tensor broadcasting to
    ``(B, T)`` (detached)."""
    if weights is None:
        return None
    w = weights.detach()
    return w[:, None] if w.dim() == 1 else w


def _registry_prologue(name, old_log_prob, log_prob, advantages, response_mask, config, weights):
    if config is None:
        raise AssertionError(f"compute_policy_loss_{name} needs config (verl's ActorConfig)")
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    low, high = _clip_band(config)
    V.check_nonnegative(low, "config.clip_ratio_low (or clip_ratio)")
    V.check_nonnegative(high, "config.clip_ratio_high (or clip_ratio)")
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    return low, high, acc


def _as_floats(metrics: dict) -> dict:
    return {k: v if isinstance(v, float) else v.detach().item() for k, v in metrics.items()}


def _clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, low, high, ratio,
                        lb, ub) -> Tensor:  # fmt: skip
    """verl 0.9.1's Clip-Cov token choice, as its op sequence (in the inputs' dtypes, so the
    same tokens are candidates): ``corr``, 0 on the chosen tokens, 1 elsewhere, in the
    advantages' dtype. Consumes the global CPU RNG as verl does (one ``torch.randperm`` when
    there is a candidate)."""
    with torch.no_grad():
        lp = log_prob.detach()
        r = torch.exp(lp - old_log_prob)
        pg1 = -advantages * r
        pg2 = -advantages * torch.clamp(r, 1 - low, 1 + high)
        clip_by_origin = (pg2 > pg1) & (response_mask > 0)
        cov = (advantages - _masked_mean(advantages, response_mask)) * (
            lp - _masked_mean(lp, response_mask)
        )
        cov[response_mask == 0] = -torch.inf
        cov[clip_by_origin] = -torch.inf
        clip_num = max(int(ratio * response_mask.sum().item()), 1)
        chosen = torch.nonzero((cov < ub) & (cov > lb) & (response_mask > 0))
        corr = torch.ones_like(advantages)
        if len(chosen) > 0:
            perm = torch.randperm(len(chosen))  # verl's call: the global CPU generator
            chosen = chosen[perm[: min(clip_num, len(chosen))]]
            corr[chosen[:, 0], chosen[:, 1]] = 0
    return corr


def compute_policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_clip_cov`` (the
    ``"clip_cov"`` entry; Clip-Cov, arXiv 2505.22617).

    Per token ``r = exp(log_prob - old_log_prob)`` (no clamp),
    ``L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * corr`` (no dual
    clip), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``corr`` is 0 on at most
    ``max(int(clip_cov_ratio * sum(m)), 1)`` tokens drawn at random (``torch.randperm`` on
    the global CPU generator, as verl: the same seed picks the same tokens) among the
    counted, not PPO-clipped tokens whose covariance ``(A - mean A) (logp - mean logp)``
    (masked means over this micro-batch, ``+ 1e-8`` as verl) lies strictly inside
    ``(clip_cov_lb, clip_cov_ub)``: they get loss and gradient 0 (and still count in the
    aggregation's denominator). Runs :func:`fused_rl.policy_loss_from_logprobs` with
    ``corr`` (times the rollout weights) as its ``is_weights``.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, plus ``config.policy_loss``'s
            ``clip_cov_ratio`` (0.0002, ``> 0``), ``clip_cov_lb`` (1.0), ``clip_cov_ub``
            (5.0) (verl's ``PolicyLossConfig`` defaults, also where None).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [corr == 0] (the covariance-chosen
        tokens only), "actor/ppo_kl": masked mean of old - new})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], requires_grad=True)
        >>> adv = torch.tensor([[2.0, 0.0, 0.0, -2.0]])  # covariances 3, 0, 0, 3
        >>> _ = torch.manual_seed(0)
        >>> loss, metrics = core_algos.compute_policy_loss_clip_cov(
        ...     logp.detach(), logp, adv, torch.ones(1, 4), config={})
        >>> metrics["actor/pg_clipfrac"]  # one of the two candidates dropped
        0.25
    """
    from ..losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        "clip_cov", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    ratio = _policy_loss_field(config, "clip_cov_ratio")
    if not ratio > 0:
        raise AssertionError("clip_ratio should be larger than 0.")  # verl's message
    lb, ub = _policy_loss_field(config, "clip_cov_lb"), _policy_loss_field(config, "clip_cov_ub")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "clip_cov", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    corr = _clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, low, high,
                               ratio, lb, ub)  # fmt: skip
    w = _rollout_weights_2d(weights, corr)
    is_w = corr.to(acc) if w is None else corr.to(acc) * w.to(acc)
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, mask=agg_w, is_weights=is_w,
        eps_low=low, eps_high=high, loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {
            "actor/pg_clipfrac": _masked_mean((corr == 0).float(), mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
        }
    return loss.to(out_dtype), _as_floats(metrics)


def _kl_cov_selection(log_prob, advantages, response_mask, ratio) -> Tensor:
    """verl 0.9.1's KL-Cov token choice (bool ``(B, T)``): the ``max(1, int(N ratio))``
    largest covariances ``(A - mean A) (logp - mean logp)`` over the ``N`` counted tokens
    (plain means, on the CPU, ``torch.topk``, as verl; none when ``N == 0``)."""
    with torch.no_grad():
        valid = response_mask > 0
        valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        adv = advantages[valid].detach().reshape(-1).cpu()
        lp = log_prob[valid].detach().reshape(-1).cpu()
        chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if min(ratio, len(adv)) != 0:
            cov = (adv - adv.mean()) * (lp - lp.mean())
            k = max(1, int(len(cov) * ratio))
            top = torch.topk(cov, k, largest=True).indices
            if len(top) != 0:
                chosen[valid_idx[top.to(valid_idx.device)]] = True
    return chosen.reshape(valid.shape)


def compute_policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_kl_cov`` (the ``"kl_cov"``
    entry; KL-Cov, arXiv 2505.22617).

    Per token ``r = exp(log_prob - old_log_prob)`` (no clamp, no clipping), ``L = -A r``,
    plus ``ppo_kl_coef * |log_prob - old_log_prob|`` on the ``max(1, int(N kl_cov_ratio))``
    counted tokens of largest covariance ``(A - mean A) (logp - mean logp)`` (``N`` counted
    tokens, plain means, ``torch.topk`` as verl), times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``. Runs
    :func:`fused_rl.policy_loss_from_logprobs`: the PPO surrogate with a band that never
    binds (``eps_low=1``, ``eps_high`` the dtype's largest number) and ``beta=ppo_kl_coef,
    kl_estimator="abs"`` against ``where(chosen, old_log_prob, log_prob.detach())`` (0,
    gradient 0, off the chosen tokens; ``sign(0) = 0`` as ``torch.abs``); the rollout
    weights weigh the penalty too (as verl), through the aggregation's per-token weights.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, plus ``config.policy_loss``'s
            ``kl_cov_ratio`` (0.0002, ``> 0``) and ``ppo_kl_coef`` (0.1, verl's
            ``PolicyLossConfig`` default; 1.0 where it is None, verl's fallback).
        rollout_is_weights: ``>= 0`` (``ValueError`` otherwise).

    Returns:
        ``(pg_loss, {"actor/ppo_kl": masked mean of |log_prob - old_log_prob|})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.5, -2.0, -3.0]])
        >>> adv = torch.tensor([[2.0, 0.0, -1.0]])  # token 0 has the largest covariance
        >>> loss, metrics = core_algos.compute_policy_loss_kl_cov(
        ...     old, logp, adv, torch.ones(1, 3), config={"policy_loss": {"ppo_kl_coef": 1.0}})
        >>> loss.backward(); [round(g, 4) for g in logp.grad[0].tolist()]  # (-A r + sign) / 3
        [-0.7658, 0.0, 0.3333]
    """
    from ..losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    _, _, acc = _registry_prologue(
        "kl_cov", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    ratio = _policy_loss_field(config, "kl_cov_ratio")
    if not ratio > 0:
        raise AssertionError("kl_cov_ratio should be larger than 0.")  # verl's message
    coef = _policy_loss_field(config, "ppo_kl_coef")
    V.check_number(coef, "config.policy_loss.ppo_kl_coef")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "kl_cov", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    w = _rollout_weights_2d(weights, log_prob)
    if w is not None:  # verl weighs the whole per-token loss, penalty included
        if bool((w < 0).any()):
            raise ValueError("rollout_is_weights must be >= 0 for kl_cov")
        agg_w = agg_w * w.to(acc)
    chosen = _kl_cov_selection(log_prob, advantages, response_mask, ratio)
    ref = torch.where(chosen, old_log_prob.detach().to(acc), log_prob.detach().to(acc))
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, ref_logprobs=ref, mask=agg_w,
        eps_low=1.0, eps_high=float(torch.finfo(acc).max), beta=float(coef),
        kl_estimator="abs", loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {"actor/ppo_kl": _masked_mean(d.abs(), _fp32(response_mask))}
    return loss.to(out_dtype), _as_floats(metrics)


def compute_policy_loss_geo_mean(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_geo_mean`` (the
    ``"geo_mean"`` entry; GMPO, arXiv 2507.20673).

    Per token ``d = log_prob - old_log_prob`` (no clamp), ``dc = clamp(d, -clip_ratio_low,
    clip_ratio_high)`` (log-space bounds), ``d* = min(d, dc)`` where ``A > 0``, ``max`` where
    ``A < 0``, 0 where ``A = 0``; per sequence ``rho_i = exp(sum_t d* m / n_i)``,
    ``A_i = sum_t A m / (n_i + 1e-8)``, ``L_i = -A_i rho_i`` times, with rollout weights,
    their geometric mean ``exp(sum_t log(w + 1e-10) m / (n_i + 1e-8))``; the loss is the
    mean of ``L_i`` over **all** ``B`` sequences (a fully masked one counts, with
    ``L_i = 0``); ``loss_agg_mode`` and ``config.global_batch_info`` are not used (as verl).
    A token the clip froze (``A > 0, d > high`` or ``A < 0, d < -low``) gets no gradient.
    Runs :func:`fused_rl.policy_loss_from_logprobs` (``surrogate="gmpo",
    importance_sampling="sequence"``, per-token weights ``m / (n_i + 1e-8)``, divisor ``B``,
    the geometric-mean weight as ``(B, 1)`` ``is_weights``). The exponent's denominator is
    ``n_i`` where verl's is ``n_i + 1e-8``: a relative difference of ``1e-8 / n_i`` in
    ``log rho_i``, below fp32 rounding (at ``n_i = 0`` both give ``rho = 1`` and ``L_i = 0``).

    Args:
        config: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (0.2; ``>= 0``).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [d != dc and A > 0] (verl's: also
        counts A > 0 tokens below -low, which are not frozen), "actor/ppo_kl": masked mean
        of old - new, "actor/pg_clipfrac_lower": masked mean of [d != dc and A < 0]})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[0.1, 0.5], [0.0, 0.0]], requires_grad=True)
        >>> adv = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
        >>> loss, metrics = core_algos.compute_policy_loss_geo_mean(
        ...     torch.zeros(2, 2), logp, adv, torch.ones(2, 2), config={})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]  # -exp((0.1 + 0.2) / 2) / 2
        (-0.5809, 0.25)
    """
    from ..losses import policy_loss_from_logprobs

    del loss_agg_mode  # verl's GMPO ignores it
    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        "geo_mean", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    dtype = torch.promote_types(
        torch.promote_types(log_prob.dtype, old_log_prob.dtype), advantages.dtype
    )
    if response_mask.is_floating_point():
        dtype = torch.promote_types(dtype, response_mask.dtype)
    with torch.no_grad():
        valid = response_mask.bool()
        m = response_mask.detach().to(acc)
        n = m.sum(-1, keepdim=True)
        agg_w = m / (n + 1e-8)
        seq_w = None
        w = _rollout_weights_2d(weights, log_prob)
        if w is not None:
            dtype = torch.promote_types(dtype, w.dtype)
            log_w = torch.where(valid, torch.log(w.to(acc) + 1e-10), 0.0)
            seq_w = torch.exp((log_w * m).sum(-1, keepdim=True) / (n + 1e-8))
        batch = torch.as_tensor(float(log_prob.shape[0]), dtype=acc, device=log_prob.device)
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, mask=agg_w, is_weights=seq_w,
        eps_low=low, eps_high=high, surrogate="gmpo", importance_sampling="sequence",
        loss_agg="token-mean", num_items=batch,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        adv = advantages.detach().to(acc)
        frozen = torch.ne(d, torch.clamp(d, -low, high))
        metrics = {
            "actor/pg_clipfrac": _masked_mean((frozen & (adv > 0)).float(), mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
            "actor/pg_clipfrac_lower": _masked_mean((frozen & (adv < 0)).float(), mask),
        }
    return loss.to(dtype), _as_floats(metrics)


_DPPO_CLIP_RATIO_C = 20.0  # verl's ``config.get("clip_ratio_c", 20.0)`` in the DPPO losses


def _dppo(kind, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights):  # fmt: skip
    """verl 0.9.1's DPPO-Binary-TV / -KL (``kind`` "tv" | "kl") on the native op."""
    from ..losses import policy_loss_from_logprobs

    name = f"dppo_{kind}"
    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        name, old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    c = _config_value(config, "clip_ratio_c", _DPPO_CLIP_RATIO_C)
    V.check_positive(c, "config.clip_ratio_c")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        name, old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    with torch.no_grad():
        # the trust-region test in the inputs' dtypes, as verl (the same tokens pass)
        lp, old = log_prob.detach(), old_log_prob.detach()
        prob, old_prob = torch.exp(lp), torch.exp(old)
        if kind == "tv":
            pos = (prob - old_prob) <= high
            neg = (prob - old_prob) >= -low
        else:
            binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            pos = (binary_kl <= high) | (prob <= old_prob)
            neg = (binary_kl <= low) | (prob >= old_prob)
        valid = torch.where(advantages > 0, pos, neg).to(acc)
        d = torch.clamp(lp.to(acc) - old.to(acc), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(d)
        trunc = torch.clamp(ratio, max=c)  # TIS: the detached, truncated ratio
        is_w = trunc * valid
        w = _rollout_weights_2d(weights, is_w)
        if w is not None:
            is_w = is_w * w.to(acc)
    # -A logp (GPG's surrogate) times sg(min(r, c)) [valid] w: verl's loss and gradient
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, mask=agg_w, is_weights=is_w, surrogate="gpg",
        loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        metrics = {
            "actor/pg_clipfrac": _masked_mean(1.0 - valid, mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
            "actor/pg_clipfrac_lower": _masked_mean((ratio > c).to(acc) * valid, mask),
        }
    return loss.to(out_dtype), _as_floats(metrics)


def compute_policy_loss_dppo_tv(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dppo_tv`` (the ``"dppo_tv"``
    entry; DPPO-Binary-TV, arXiv 2602.04879).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and
    ``L = -A sg(min(r, clip_ratio_c)) log_prob * valid`` (truncated importance sampling
    instead of the dual clip; ``clip_ratio_c`` is ``config.get("clip_ratio_c", 20.0)`` as
    verl reads it: verl's ``ActorConfig`` carries 3.0, a dict without the key gives 20.0; it
    must be ``> 0``), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``valid`` (detached, computed in the
    inputs' dtypes as verl, so the same tokens pass) is ``p - p_old <= clip_ratio_high``
    where ``A > 0`` and ``p - p_old >= -clip_ratio_low`` where ``A <= 0``
    (``p = exp(log_prob)``, the total-variation bound); ``clip_ratio_low`` /
    ``clip_ratio_high`` (each ``clip_ratio`` when None) are the divergence thresholds, not a
    ratio band. The gradient is ``-A sg(min(r, c)) valid w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    ``sg(min(r, c)) valid w`` as its ``is_weights`` (those weights computed in plain PyTorch on
    the ``(B, T)`` log-probs, no gradient).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [not valid], "actor/ppo_kl": masked
        mean of the clamped old - new, "actor/pg_clipfrac_lower": masked mean of
        [r > clip_ratio_c and valid]})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.5]])  # ratios 1 and e^-0.5, both in the region
        >>> loss, metrics = core_algos.compute_policy_loss_dppo_tv(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]  # (1 + 2 e^-0.5) / 2
        (1.1065, 0.0)
    """
    return _dppo(
        "tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dppo_kl(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dppo_kl`` (the ``"dppo_kl"``
    entry; DPPO-Binary-KL, arXiv 2602.04879).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and
    ``L = -A sg(min(r, clip_ratio_c)) log_prob * valid`` (truncated importance sampling
    instead of the dual clip; ``clip_ratio_c`` is ``config.get("clip_ratio_c", 20.0)`` as
    verl reads it: verl's ``ActorConfig`` carries 3.0, a dict without the key gives 20.0; it
    must be ``> 0``), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``valid`` (detached, computed in the
    inputs' dtypes as verl, so the same tokens pass) is
    ``kl <= clip_ratio_high or p <= p_old`` where ``A > 0`` and
    ``kl <= clip_ratio_low or p >= p_old`` where ``A <= 0``, with ``p = exp(log_prob)`` and
    the binary KL
    ``kl = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``;
    ``clip_ratio_low`` /
    ``clip_ratio_high`` (each ``clip_ratio`` when None) are the divergence thresholds, not a
    ratio band. The gradient is ``-A sg(min(r, c)) valid w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    ``sg(min(r, c)) valid w`` as its ``is_weights`` (those weights computed in plain PyTorch on
    the ``(B, T)`` log-probs, no gradient).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [not valid], "actor/ppo_kl": masked
        mean of the clamped old - new, "actor/pg_clipfrac_lower": masked mean of
        [r > clip_ratio_c and valid]})``.
    """
    return _dppo(
        "kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dro(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dro`` (the ``"dro"`` entry;
    Direct Reward Optimization with a quadratic log-ratio penalty).

    Per token ``L = -(A log_prob - beta / 2 (log_prob - old_log_prob)^2)`` (no clamp),
    times ``rollout_is_weights`` (the whole term, penalty included, as verl), aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``; ``beta`` is
    ``config.policy_loss.dro_beta`` (verl's ``PolicyLossConfig``: None by default, which
    raises verl's ``ValueError``, as does ``beta <= 0``). The gradient is
    ``(-A + beta (log_prob - old_log_prob)) w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    its KL term ``beta * k2`` against ``ref_logprobs=old_log_prob``; the rollout weights go
    into its per-token ``mask`` (with the aggregation's weights) rather than ``is_weights``,
    which would leave the penalty unweighted (so they must be ``>= 0``).

    Returns:
        ``(pg_loss, {"actor/ppo_kl": masked mean of old - new})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.0]])
        >>> loss, metrics = core_algos.compute_policy_loss_dro(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"policy_loss": {"dro_beta": 1.0}})
        >>> round(loss.item(), 4), metrics["actor/ppo_kl"]  # (1 + 2.5) / 2
        (1.75, 0.5)
    """
    from ..losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    if config is None:
        raise AssertionError("compute_policy_loss_dro needs config (verl's ActorConfig)")
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    sub = _config_value(config, "policy_loss", {})
    if sub is None:
        raise AssertionError("config.policy_loss is None (verl asserts it is set)")
    beta = _config_value(sub, "dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "dro", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    w = _rollout_weights_2d(weights, agg_w)
    if w is not None:
        counted = torch.where(agg_w != 0, w.to(acc).expand_as(agg_w), 0.0)
        if bool((counted < 0).any()):  # they weigh the mask: no negative weight there
            raise ValueError("rollout_is_weights must be >= 0 on counted tokens for DRO")
        agg_w = agg_w * counted
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, ref_logprobs=old_log_prob, mask=agg_w, surrogate="gpg",
        beta=float(beta), kl_estimator="k2", loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {"actor/ppo_kl": _masked_mean(-d, mask)}
    return loss.to(out_dtype), _as_floats(metrics)


POLICY_LOSS_REGISTRY: dict = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "dro": compute_policy_loss_dro,
}


def register_policy_loss(name: str):
    """Mirrors ``verl.trainer.ppo.core_algos.register_policy_loss``: a decorator adding
    ``func`` to :data:`POLICY_LOSS_REGISTRY` under ``name`` (replacing any entry), so that
    :func:`get_policy_loss_fn` returns it.

    Example:
        >>> from fused_rl.compat import verl as core_algos
        >>> @core_algos.register_policy_loss("my_loss")
        ... def my_loss(old_log_prob, log_prob, advantages, response_mask,
        ...             loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
        ...     return -(log_prob * advantages).mean(), {}
        >>> core_algos.get_policy_loss_fn("my_loss") is my_loss
        True
        >>> del core_algos.POLICY_LOSS_REGISTRY["my_loss"]
    """

    def decorator(func):
        POLICY_LOSS_REGISTRY[name] = func
        return func

    return decorator


def get_policy_loss_fn(name: str):
    """Mirrors ``verl.trainer.ppo.core_algos.get_policy_loss_fn``: the policy loss registered
    under ``name``.

    ``"vanilla"``, ``"gspo"``, ``"sapo"``, ``"gpg"``, ``"clip_cov"``, ``"kl_cov"``,
    ``"geo_mean"``, ``"cispo"``, ``"dppo_tv"``, ``"dppo_kl"``, ``"dro"`` (and whatever
    :func:`register_policy_loss` added) are here. verl 0.9's ``"bypass_mode"`` is not built
    yet: ``NotImplementedError`` naming the variant and the losses that are.
    Any other name raises verl's ``ValueError("Unsupported loss mode: ...")`` listing the
    known names.

    Example:
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.get_policy_loss_fn("geo_mean").__name__
        'compute_policy_loss_geo_mean'
        >>> core_algos.get_policy_loss_fn("bypass_mode")
        Traceback (most recent call last):
        ...
        NotImplementedError: verl's policy loss 'bypass_mode' (bypass mode ...) is not built ...
    """
    if name in POLICY_LOSS_REGISTRY:
        return POLICY_LOSS_REGISTRY[name]
    if name in _NOT_BUILT:
        built = ", ".join(repr(n) for n in POLICY_LOSS_REGISTRY)
        raise NotImplementedError(
            f"verl's policy loss {name!r} ({_NOT_BUILT[name]}) is not built in fused_rl yet; "
            f"fused_rl.compat.verl has {built}"
        )
    known = [
        *POLICY_LOSS_REGISTRY,
        *(n for n in VERL_POLICY_LOSSES if n not in POLICY_LOSS_REGISTRY),
    ]
    raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {known}")


__all__ += [
    "POLICY_LOSS_REGISTRY",
    "VERL_POLICY_LOSSES",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "get_policy_loss_fn",
    "register_policy_loss",
]
