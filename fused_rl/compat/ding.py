"""Drop-in replacements for DI-engine's PPO / GRPO losses (``ding.rl_utils.ppo`` and
``ding.rl_utils.grpo``), fused over the vocabulary.

Mirrors DI-engine main at commit ``d0b21d065b2d`` (Dec 2025). This one module exports what
DI-engine spreads over three import paths (DI-engine is not imported, nor needed)::

    # DI-engine main                                   # fused_rl
    from ding.rl_utils import ppo_data, ppo_error      from fused_rl.compat.ding import ...
    from ding.rl_utils.ppo import calculate_kl_div     from fused_rl.compat.ding import ...
    from ding.rl_utils.grpo import grpo_policy_data, \\
        grpo_policy_error                              from fused_rl.compat.ding import ...

``ding.rl_utils`` itself does not export the GRPO names nor ``calculate_kl_div``: with
DI-engine they come from ``ding.rl_utils.grpo`` / ``ding.rl_utils.ppo``. The only DI-engine
release on PyPI, 0.5.3, predates the KL terms and GRPO: its 8- / 5-field ``ppo_data`` /
``ppo_policy_data`` and 3- / 2-field ``ppo_loss`` / ``ppo_policy_loss`` are in
:mod:`fused_rl.compat.ding_v053`.

The same namedtuples (fields in the same order, no defaults: ``logit_pretrained`` must be
passed, ``None`` included), argument names, defaults and return values, quirks included:

* masked terms are ``(x * weight).mean()``: divided by the number of elements, not by
  ``weight.sum()`` (an all-zero weight gives 0); ``grpo_policy_error`` takes the
  per-sequence ``sum(w x) / sum(w)`` and then the batch mean (an all-zero row gives NaN);
* ``approx_kl = mean(logp_old - logp_new)`` and ``clipfrac`` = "ratio outside
  ``[1 - c, 1 + c]``" are unmasked Python floats (one host sync each, as in DI-engine);
* the discrete dual clip applies only where ``adv < 0``; the continuous one is NOT gated on
  the sign of ``adv`` (DI-engine's defect, reproduced by default; ``fix_dual_clip=True`` gates
  it on ``adv < 0``);
* ``kl_div`` = ``calculate_kl_div(logp_new - logp_pretrained, kl_type)``, an unmasked mean;
  without ``logit_pretrained`` a 0-dim zero (the Python int ``0`` in
  ``ppo_policy_error_continuous``); ``entropy_bonus=False`` gives ``torch.tensor(0.)``;
* value clipping reuses ``clip_ratio`` in the form ``old + clamp(new - old, -c, c)``;
* if the discrete ``ratio`` and ``adv`` (or the entropy and ``weight``) differ in shape, the
  ratio (the entropy) is averaged over dim 1 (DI-engine's multi-agent path);
* nothing is detached: gradients also flow into ``logit_old`` / ``logit_ref`` /
  ``logit_pretrained`` when they require grad.

Fused: every log-prob and entropy of a logits tensor comes from :func:`fused_rl.token_logprobs`
(one streaming pass forward, one backward, no ``(..., V)`` normalised copy), and the
continuous densities from :func:`fused_rl.gaussian_logprob` / :func:`fused_rl.gaussian_entropy`.
Per-token math runs in fp32 (fp64 if an input is fp64) and each output is cast to the dtype
DI-engine's type promotion gives it (bf16 logits with fp32 ``adv``: fp32 losses, bf16
``kl_div``). :func:`ppo_value_error` and :func:`calculate_kl_div` are DI-engine's eager
expressions: bit-identical in every dtype.

Half precision (``fused_rl.compat.half_precision``): by default (``"accurate"``) the math
runs in fp32 and each output is rounded once, so with fp16 / bf16 inputs the losses (and the
``approx_kl`` / ``clipfrac`` floats, which DI-engine computes from bf16 ratios) are closer to
the exact values than DI-engine's, not equal to them; ``half_precision("original")`` runs
DI-engine's own computation (``torch.distributions``, the chosen ``log_prob_fn``) whenever
an input is fp16 / bf16, bit for bit.

Differences from DI-engine, all deliberate (docs/compat.md):

* actions outside ``[0, V)`` (``-100`` included) and ``sigma <= 0`` raise ``ValueError``;
  NaN logits propagate instead of ``torch.distributions``' ``ValueError``;
* ``grpo_policy_error`` rejects a ``(B, 1)`` ``adv`` (DI-engine broadcasts it to
  ``(B, B, S)`` silently) and, with ``beta == 0``, does not read ``logit_ref``;
* the ``hpc_wrapper`` decorator (a no-op by default) is not reproduced.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributions import Categorical, Independent, Normal

from .. import _validation as V
from ..continuous import _check_sigma_positive, gaussian_entropy, gaussian_logprob
from ._checks import check_index_range, checked_logprobs
from ._precision import original_half_precision

__all__ = [
    "KL_TYPES",
    "calculate_kl_div",
    "efficient_method",
    "grpo_info",
    "grpo_policy_data",
    "grpo_policy_error",
    "less_efficient_method",
    "naive_method",
    "ppo_data",
    "ppo_data_continuous",
    "ppo_error",
    "ppo_error_continuous",
    "ppo_info",
    "ppo_loss",
    "ppo_policy_data",
    "ppo_policy_data_continuous",
    "ppo_policy_error",
    "ppo_policy_error_continuous",
    "ppo_policy_loss",
    "ppo_value_data",
    "ppo_value_error",
]

# ``ding.rl_utils.ppo`` (main): no field has a default
ppo_data = namedtuple(
    "ppo_data",
    ["logit_new", "logit_old", "action", "value_new", "value_old", "adv", "return_", "weight",
     "logit_pretrained"],
)  # fmt: skip
ppo_data_continuous = namedtuple(
    "ppo_data_continuous",
    ["mu_sigma_new", "mu_sigma_old", "action", "value_new", "value_old", "adv", "return_",
     "weight", "logit_pretrained"],
)  # fmt: skip
ppo_policy_data = namedtuple(
    "ppo_policy_data", ["logit_new", "logit_old", "action", "adv", "weight", "logit_pretrained"]
)
ppo_policy_data_continuous = namedtuple(
    "ppo_policy_data_continuous",
    ["mu_sigma_new", "mu_sigma_old", "action", "adv", "weight", "logit_pretrained"],
)
ppo_value_data = namedtuple("ppo_value_data", ["value_new", "value_old", "return_", "weight"])
ppo_loss = namedtuple("ppo_loss", ["policy_loss", "value_loss", "entropy_loss", "kl_div"])
ppo_policy_loss = namedtuple("ppo_policy_loss", ["policy_loss", "entropy_loss", "kl_div"])
ppo_info = namedtuple("ppo_info", ["approx_kl", "clipfrac"])
# ``ding.rl_utils.grpo``
grpo_policy_data = namedtuple(
    "grpo_policy_data", ["logit_new", "logit_old", "logit_ref", "action", "adv", "weight"]
)
grpo_info = namedtuple("grpo_info", ["approx_kl", "clipfrac"])

KL_TYPES = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- helpers


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64, else fp32: the dtype the per-token math runs in."""
    present = [t for t in tensors if t is not None]
    return torch.float64 if any(t.dtype == torch.float64 for t in present) else torch.float32


def _promoted(*tensors: Tensor | None) -> torch.dtype:
    """The dtype DI-engine's eager chain would give an output computed from ``tensors``."""
    dtypes = [t.dtype for t in tensors if t is not None]
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


class _Precision:
    """How one call computes: ``up(t)`` brings an input to the math dtype (fp32 / fp64 in
    ``"accurate"`` mode, unchanged in ``"original"`` mode) and ``down(t, *sources)`` gives an
    output DI-engine's dtype (a no-op in ``"original"`` mode, where the dtypes come out of
    DI-engine's own arithmetic)."""

    def __init__(self, original: bool, *inputs: Tensor | None):
        self.original = original
        self.acc = _acc_dtype(*inputs)

    def up(self, t: Tensor) -> Tensor:
        return t if self.original else t.to(self.acc)

    def down(self, t: Tensor, *sources: Tensor | None) -> Tensor:
        return t if self.original else t.to(_promoted(*sources))


def _check_action(logits: Tensor, action: Tensor, name: str, action_name: str = "action") -> Tensor:
    """Validate ``logits`` and its integer ids (float ids are cast, as ``Categorical.log_prob``
    does); ids outside ``[0, V)`` raise ``ValueError`` naming ``action_name``."""
    V.check_logits(logits, name)
    V.check_tensor(action, action_name)
    if action.dtype not in V.INDEX_DTYPES:
        action = action.long()  # Categorical.log_prob calls .long()
    V.check_targets(action, logits, action_name)
    check_index_range(action, logits.shape[-1], action_name, "DI-engine's Categorical")
    return action


def _categorical_logp(
    logits: Tensor, action: Tensor, name: str, *, entropy: bool = False, original: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """``Categorical(logits=logits).log_prob(action)`` (and ``.entropy()``): fused in fp32
    (fp64 for fp64 logits), or ``torch.distributions`` itself in ``"original"`` mode."""
    action = _check_action(logits, action, name)
    if original:
        dist = Categorical(logits=logits, validate_args=False)
        logp = dist.log_prob(action)
        return (logp, dist.entropy()) if entropy else logp
    return checked_logprobs(logits, action, return_entropy=entropy)


def _gaussian(mu: Tensor, sigma: Tensor, action: Tensor, original: bool) -> Tensor:
    """``Independent(Normal(mu, sigma), 1).log_prob(action)``; ``sigma <= 0`` raises
    ``ValueError`` in both modes."""
    if original:
        _check_sigma_positive(sigma)
        return Independent(Normal(mu, sigma, validate_args=False), 1).log_prob(action)
    return gaussian_logprob(mu, sigma, action)


def _surrogate_terms(ratio: Tensor, adv: Tensor, clip_ratio: float) -> tuple[Tensor, Tensor]:
    return ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv


def _info(logp_old: Tensor, logp_new: Tensor, ratio: Tensor, clip_ratio: float):
    """``(approx_kl, clipfrac)`` as Python floats, unmasked (DI-engine's ``.item()``)."""
    with torch.no_grad():
        approx_kl = (logp_old - logp_new).mean().item()
        outside = ratio.gt(1 + clip_ratio) | ratio.lt(1 - clip_ratio)
        clipfrac = outside.float().mean().item()
    return approx_kl, clipfrac


def _check_dual_clip(dual_clip: float | None) -> None:
    assert dual_clip is None or dual_clip > 1.0, (
        f"dual_clip value must be greater than 1.0, but get value: {dual_clip}"
    )


def calculate_kl_div(log_ratio: Tensor, kl_type: str) -> Tensor:
    """Mirrors ``ding.rl_utils.ppo.calculate_kl_div``.

    Unmasked mean of Schulman's estimator of KL(current || pretrained) with
    ``log_ratio = logp_new - logp_pretrained``: ``k1`` ``r``, ``k2`` ``r^2 / 2``,
    ``k3`` ``exp(-r) - 1 + r``. Differentiable; DI-engine's expressions, bit for bit.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import calculate_kl_div
        >>> calculate_kl_div(torch.tensor([0.0, 2.0]), "k2")
        tensor(1.)
    """
    if kl_type == "k1":
        return log_ratio.mean()
    if kl_type == "k2":
        return (log_ratio**2 / 2).mean()
    if kl_type == "k3":
        return (torch.exp(-log_ratio) - 1 + log_ratio).mean()
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


# ----------------------------------------------------------------------------- discrete


def ppo_policy_error(
    data: ppo_policy_data,
    clip_ratio: float = 0.2,
    dual_clip: float | None = None,
    entropy_bonus: bool = True,
    kl_type: str = "k1",
) -> tuple[ppo_policy_loss, ppo_info]:
    """Mirrors ``ding.rl_utils.ppo.ppo_policy_error``.

    Clipped-surrogate PPO policy loss from categorical logits, fused over the vocabulary.

    Args:
        data: :data:`ppo_policy_data` ``(logit_new, logit_old, action, adv, weight,
            logit_pretrained)``: logits ``(B, N)``, ``(B, A, N)`` or ``(B, S, V)``; ``action``
            ``logits.shape[:-1]`` integer ids; ``adv`` / ``weight`` (None = ones) normally of
            ``action``'s shape (``adv`` ``(B,)`` with ``(B, S)`` actions averages the ratio over
            ``S``, as DI-engine does); ``logit_pretrained`` None or logits, for ``kl_div``.
        clip_ratio: ``c`` of the band ``[1 - c, 1 + c]``.
        dual_clip: ``None`` or a bound ``> 1`` applied where ``adv < 0`` (not checked here,
            as in DI-engine; :func:`ppo_error` asserts it).
        entropy_bonus: compute ``entropy_loss = (H * weight).mean()``; False gives
            ``torch.tensor(0.)``.
        kl_type: ``"k1"``, ``"k2"`` or ``"k3"`` (checked only when ``logit_pretrained`` is
            given).

    Returns:
        ``(ppo_policy_loss(policy_loss, entropy_loss, kl_div), ppo_info(approx_kl, clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import ppo_policy_data, ppo_policy_error
        >>> logits = torch.randn(4, 6, requires_grad=True)
        >>> data = ppo_policy_data(logits, logits.detach() + 0.1 * torch.randn(4, 6),
        ...                        torch.randint(0, 6, (4,)), torch.randn(4), None, None)
        >>> loss, info = ppo_policy_error(data, dual_clip=3.0)
        >>> (loss.policy_loss - 0.01 * loss.entropy_loss).backward()
        >>> type(info.clipfrac)
        <class 'float'>
    """
    logit_new, logit_old, action, adv, weight, logit_pretrained = data
    if weight is None:
        weight = torch.ones_like(adv)
    original = original_half_precision(logit_new, logit_old, logit_pretrained, adv, weight)
    p = _Precision(original, logit_new, logit_old, logit_pretrained, adv, weight)
    adv_a, weight_a = p.up(adv), p.up(weight)

    if entropy_bonus:
        logp_new, entropy = _categorical_logp(
            logit_new, action, "logit_new", entropy=True, original=original
        )
        if entropy.shape != weight.shape:  # DI-engine's multi-agent case
            entropy = entropy.mean(dim=1)
        entropy_loss = p.down((p.up(entropy) * weight_a).mean(), logit_new, weight)
    else:
        logp_new = _categorical_logp(logit_new, action, "logit_new", original=original)
        entropy_loss = torch.tensor(0.0)
    logp_new = p.up(logp_new)
    logp_old = p.up(_categorical_logp(logit_old, action, "logit_old", original=original))

    ratio = torch.exp(logp_new - logp_old)
    if ratio.shape != adv.shape:
        ratio = ratio.mean(dim=1)
    surr1, surr2 = _surrogate_terms(ratio, adv_a, clip_ratio)
    if dual_clip is None:
        policy_loss = (-torch.min(surr1, surr2) * weight_a).mean()
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * adv_a)
        policy_loss = -(torch.where(adv_a < 0, clip2, clip1) * weight_a).mean()
    policy_loss = p.down(policy_loss, logit_new, logit_old, adv, weight)
    approx_kl, clipfrac = _info(logp_old, logp_new, ratio, clip_ratio)

    if logit_pretrained is not None:
        logp_pre = _categorical_logp(
            logit_pretrained, action, "logit_pretrained", original=original
        )
        kl_div = calculate_kl_div(logp_new - p.up(logp_pre), kl_type)
        kl_div = p.down(kl_div, logit_new, logit_pretrained)
    else:
        kl_div = torch.tensor(0.0, dtype=policy_loss.dtype, device=policy_loss.device)
    return ppo_policy_loss(policy_loss, entropy_loss, kl_div), ppo_info(approx_kl, clipfrac)


def ppo_value_error(
    data: ppo_value_data, clip_ratio: float = 0.2, use_value_clip: bool = True
) -> Tensor:
    """Mirrors ``ding.rl_utils.ppo.ppo_value_error``.

    ``0.5 * (max((R - v)^2, (R - v_clip)^2) * weight).mean()`` with
    ``v_clip = old + clamp(v - old, -clip_ratio, clip_ratio)`` (the clip range reuses
    ``clip_ratio``); without clipping ``0.5 * ((R - v)^2 * weight).mean()``. DI-engine's
    expressions: the same values and dtype, bit for bit.

    Returns:
        One 0-dim tensor (DI-engine's docstring promising ``(loss, info)`` is wrong).

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import ppo_value_data, ppo_value_error
        >>> data = ppo_value_data(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]),
        ...                       None)
        >>> ppo_value_error(data, clip_ratio=0.5)
        tensor(0.1250)
    """
    value_new, value_old, return_, weight = data
    if weight is None:
        weight = torch.ones_like(value_old)
    if use_value_clip:
        value_clip = value_old + (value_new - value_old).clamp(-clip_ratio, clip_ratio)
        v1 = (return_ - value_new).pow(2)
        v2 = (return_ - value_clip).pow(2)
        return 0.5 * (torch.max(v1, v2) * weight).mean()
    return 0.5 * ((return_ - value_new).pow(2) * weight).mean()


def ppo_error(
    data: ppo_data,
    clip_ratio: float = 0.2,
    use_value_clip: bool = True,
    dual_clip: float | None = None,
    kl_type: str = "k1",
) -> tuple[ppo_loss, ppo_info]:
    """Mirrors ``ding.rl_utils.ppo.ppo_error``.

    :func:`ppo_policy_error` (with the entropy) plus :func:`ppo_value_error`. Asserts
    ``dual_clip is None or dual_clip > 1`` (``AssertionError``, 1.0 included).

    Returns:
        ``(ppo_loss(policy_loss, value_loss, entropy_loss, kl_div), ppo_info(approx_kl,
        clipfrac))``. DI-engine's policy combines them as ``policy_loss + 0.5 * value_loss -
        entropy_weight * entropy_loss + kl_beta * kl_div``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import ppo_data, ppo_error
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> value = torch.randn(2, 5, requires_grad=True)
        >>> data = ppo_data(logits, logits.detach(), torch.randint(0, 11, (2, 5)), value,
        ...                 value.detach(), torch.randn(2, 5), torch.randn(2, 5), None, None)
        >>> loss, info = ppo_error(data)
        >>> (loss.policy_loss + 0.5 * loss.value_loss).backward()
    """
    _check_dual_clip(dual_clip)
    logit_new, logit_old, action, value_new, value_old, adv, return_, weight, pretrained = data
    policy, info = ppo_policy_error(
        ppo_policy_data(logit_new, logit_old, action, adv, weight, pretrained),
        clip_ratio,
        dual_clip,
        kl_type=kl_type,
    )
    value_loss = ppo_value_error(
        ppo_value_data(value_new, value_old, return_, weight), clip_ratio, use_value_clip
    )
    return ppo_loss(policy.policy_loss, value_loss, policy.entropy_loss, policy.kl_div), info


# ----------------------------------------------------------------------------- continuous


def _continuous_policy(data, clip_ratio, dual_clip, kl_type, fix_dual_clip):
    """Shared body of the continuous errors: ``(policy_loss, entropy_loss, kl_div | None,
    info)``."""
    _check_dual_clip(dual_clip)
    mu_sigma_new, mu_sigma_old, action, adv, weight, pretrained = data
    if weight is None:
        weight = torch.ones_like(adv)
    mu_new, sigma_new = mu_sigma_new["mu"], mu_sigma_new["sigma"]
    mu_old, sigma_old = mu_sigma_old["mu"], mu_sigma_old["sigma"]
    if mu_old.dim() == 1:
        mu_old, sigma_old = mu_old.unsqueeze(-1), sigma_old.unsqueeze(-1)
    pre = () if pretrained is None else (pretrained["mu"], pretrained["sigma"])
    original = original_half_precision(
        mu_new, sigma_new, mu_old, sigma_old, action, adv, weight, *pre
    )
    p = _Precision(original, mu_new, sigma_new, mu_old, sigma_old, action, adv, weight, *pre)
    adv_a, weight_a = p.up(adv), p.up(weight)

    logp_new = p.up(_gaussian(mu_new, sigma_new, action, original))
    logp_old = p.up(_gaussian(mu_old, sigma_old, action, original))
    if original:
        entropy = Independent(Normal(mu_new, sigma_new, validate_args=False), 1).entropy()
    else:  # Normal's entropy has the broadcast shape of (mu, sigma)
        shape = torch.broadcast_shapes(mu_new.shape, sigma_new.shape)
        entropy = gaussian_entropy(sigma_new.expand(shape))
    entropy_loss = p.down((p.up(entropy) * weight_a).mean(), sigma_new, weight)

    ratio = torch.exp(logp_new - logp_old)
    surr1, surr2 = _surrogate_terms(ratio, adv_a, clip_ratio)
    per_sample = torch.min(surr1, surr2)
    if dual_clip is not None:
        capped = torch.max(per_sample, dual_clip * adv_a)
        per_sample = torch.where(adv_a < 0, capped, per_sample) if fix_dual_clip else capped
    policy_loss = (-per_sample * weight_a).mean()
    policy_loss = p.down(policy_loss, mu_new, sigma_new, mu_old, sigma_old, action, adv, weight)
    info = ppo_info(*_info(logp_old, logp_new, ratio, clip_ratio))

    kl_div = None
    if pretrained is not None:
        logp_pre = p.up(_gaussian(*pre, action, original))
        kl_div = p.down(calculate_kl_div(logp_new - logp_pre, kl_type), mu_new, sigma_new, *pre)
    return policy_loss, entropy_loss, kl_div, info


def ppo_policy_error_continuous(
    data: ppo_policy_data_continuous,
    clip_ratio: float = 0.2,
    dual_clip: float | None = None,
    kl_type: str = "k1",
    *,
    fix_dual_clip: bool = False,
) -> tuple[ppo_policy_loss, ppo_info]:
    """Mirrors ``ding.rl_utils.ppo.ppo_policy_error_continuous``.

    PPO policy loss of ``Independent(Normal(mu, sigma), 1)`` policies (log-densities summed
    over the action dim ``N``).

    DI-engine's dual clip here is ``max(min(surr1, surr2), dual_clip * adv)`` for EVERY
    sample: with ``adv > 0`` and ``dual_clip > 1 + clip_ratio`` the loss is the constant
    ``-dual_clip * adv`` and its policy gradient is exactly zero. That defect is reproduced
    by default; ``fix_dual_clip=True`` applies the dual clip only where ``adv < 0`` (the
    discrete version's behaviour).

    Args:
        data: :data:`ppo_policy_data_continuous` ``(mu_sigma_new, mu_sigma_old, action, adv,
            weight, logit_pretrained)``: ``mu_sigma_*`` dicts ``{"mu": (B, N), "sigma":
            (B, N)}`` (a 1-D old ``mu`` / ``sigma`` is unsqueezed to ``(B, 1)``); ``action``
            ``(B, N)`` float; ``adv``, ``weight`` (None = ones) ``(B,)``; ``logit_pretrained``
            None or a mu/sigma dict for ``kl_div``.
        dual_clip: ``None`` or ``> 1`` (``AssertionError`` otherwise).
        fix_dual_clip: keyword-only, fused_rl's addition (see above).

    Returns:
        ``(ppo_policy_loss(policy_loss, entropy_loss, kl_div), ppo_info(approx_kl,
        clipfrac))``; ``kl_div`` is the Python int ``0`` without ``logit_pretrained``, as in
        DI-engine.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import (ppo_policy_data_continuous,
        ...                                   ppo_policy_error_continuous)
        >>> mu = torch.zeros(3, 2, requires_grad=True)
        >>> ms = {"mu": mu, "sigma": torch.ones(3, 2)}
        >>> old = {"mu": torch.zeros(3, 2), "sigma": torch.ones(3, 2)}
        >>> data = ppo_policy_data_continuous(ms, old, torch.randn(3, 2), torch.randn(3), None,
        ...                                   None)
        >>> loss, info = ppo_policy_error_continuous(data)
        >>> loss.kl_div
        0
    """
    policy_loss, entropy_loss, kl_div, info = _continuous_policy(
        data, clip_ratio, dual_clip, kl_type, fix_dual_clip
    )
    return ppo_policy_loss(policy_loss, entropy_loss, 0 if kl_div is None else kl_div), info


def ppo_error_continuous(
    data: ppo_data_continuous,
    clip_ratio: float = 0.2,
    use_value_clip: bool = True,
    dual_clip: float | None = None,
    kl_type: str = "k1",
    *,
    fix_dual_clip: bool = False,
) -> tuple[ppo_loss, ppo_info]:
    """Mirrors ``ding.rl_utils.ppo.ppo_error_continuous``.

    :func:`ppo_policy_error_continuous` (same dual-clip defect by default, same
    ``fix_dual_clip`` keyword) plus the value loss of :func:`ppo_value_error`. Without
    ``logit_pretrained``, ``kl_div`` is a 0-dim zero tensor here (not the int ``0``).

    Returns:
        ``(ppo_loss(policy_loss, value_loss, entropy_loss, kl_div), ppo_info(approx_kl,
        clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import ppo_data_continuous, ppo_error_continuous
        >>> ms = {"mu": torch.zeros(3, 2, requires_grad=True), "sigma": torch.ones(3, 2)}
        >>> old = {"mu": torch.zeros(3, 2), "sigma": torch.ones(3, 2)}
        >>> v = torch.zeros(3, requires_grad=True)
        >>> data = ppo_data_continuous(ms, old, torch.randn(3, 2), v, v.detach(),
        ...                            torch.randn(3), torch.randn(3), None, None)
        >>> loss, info = ppo_error_continuous(data, dual_clip=2.0)
        >>> loss.kl_div
        tensor(0.)
    """
    mu_sigma_new, mu_sigma_old, action, value_new, value_old, adv, return_, weight, pre = data
    policy_loss, entropy_loss, kl_div, info = _continuous_policy(
        ppo_policy_data_continuous(mu_sigma_new, mu_sigma_old, action, adv, weight, pre),
        clip_ratio,
        dual_clip,
        kl_type,
        fix_dual_clip,
    )
    if kl_div is None:
        kl_div = torch.tensor(0.0, dtype=policy_loss.dtype, device=policy_loss.device)
    value_loss = ppo_value_error(
        ppo_value_data(value_new, value_old, return_, weight), clip_ratio, use_value_clip
    )
    return ppo_loss(policy_loss, value_loss, entropy_loss, kl_div), info


# ----------------------------------------------------------------------------- GRPO log-probs
# ``ding.rl_utils.log_prob_utils``' three methods (re-exported by ``ding.rl_utils.grpo``):
# the same values computed three ways. Here each is the fused pass, in the logits' dtype; the
# eager twins below are DI-engine's own arithmetic, for ``"original"`` mode.


def _eager_efficient(logits: Tensor, index: Tensor) -> Tensor:
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = [
        torch.log_softmax(row, dim=-1).gather(dim=-1, index=i.unsqueeze(-1)).squeeze(-1)
        for row, i in zip(logits, index, strict=True)
    ]
    return torch.stack(rows)


def _eager_naive(logits: Tensor, index: Tensor) -> Tensor:
    return torch.gather(F.log_softmax(logits, dim=-1), -1, index.unsqueeze(-1)).squeeze(-1)


def _eager_less_efficient(logits: Tensor, index: Tensor) -> Tensor:
    return Categorical(logits=logits, validate_args=False).log_prob(index)


def _method_logprobs(eager, logits: Tensor, index: Tensor) -> Tensor:
    index = _check_action(logits, index, "logits", "index").long()
    if original_half_precision(logits):
        return eager(logits, index)
    return checked_logprobs(logits, index).to(logits.dtype)


def efficient_method(logits: Tensor, index: Tensor) -> Tensor:
    """Mirrors ``ding.rl_utils.log_prob_utils.efficient_method``: per-token log-probs
    ``log_softmax(logits)[index]`` of ``(B, S, V)`` logits, fused, in ``logits.dtype``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import efficient_method
        >>> efficient_method(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))
        tensor([[-1.3863, -1.3863]])
    """
    return _method_logprobs(_eager_efficient, logits, index)


def naive_method(logits: Tensor, index: Tensor) -> Tensor:
    """Mirrors ``ding.rl_utils.log_prob_utils.naive_method``: :func:`efficient_method`'s
    values (DI-engine computes them with one ``(B, S, V)`` log-softmax).

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import naive_method
        >>> naive_method(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))
        tensor([[-1.3863, -1.3863]])
    """
    return _method_logprobs(_eager_naive, logits, index)


def less_efficient_method(logits: Tensor, index: Tensor) -> Tensor:
    """Mirrors ``ding.rl_utils.log_prob_utils.less_efficient_method``: :func:`efficient_method`'s
    values (DI-engine computes them with ``Categorical(logits=logits).log_prob``).

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import less_efficient_method
        >>> less_efficient_method(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))
        tensor([[-1.3863, -1.3863]])
    """
    return _method_logprobs(_eager_less_efficient, logits, index)


_EAGER_METHODS = {
    efficient_method: _eager_efficient,
    naive_method: _eager_naive,
    less_efficient_method: _eager_less_efficient,
}
_METHOD_NAMES = {fn.__name__: fn for fn in _EAGER_METHODS}


def _known_method(log_prob_fn):
    """fused_rl's twin of ``log_prob_fn`` when it is one of DI-engine's three methods (or one
    of ours), else None (a caller's own function, which is then called as given)."""
    if log_prob_fn is None:
        return efficient_method
    if log_prob_fn in _EAGER_METHODS:
        return log_prob_fn
    if getattr(log_prob_fn, "__module__", None) == "ding.rl_utils.log_prob_utils":
        return _METHOD_NAMES.get(getattr(log_prob_fn, "__name__", None))
    return None


# ----------------------------------------------------------------------------- GRPO


def _grpo_eager(data: grpo_policy_data, log_prob_fn, clip_ratio: float, beta: float):
    """DI-engine's ``grpo_policy_error`` body in eager PyTorch, in the inputs' own dtypes:
    ``"original"`` mode and callers' own ``log_prob_fn``."""
    logp_new = log_prob_fn(data.logit_new, data.action)
    logp_ref = log_prob_fn(data.logit_ref, data.action)
    logp_old = log_prob_fn(data.logit_old, data.action)
    per_token_kl = torch.exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1
    ratio = torch.exp(logp_new - logp_old)
    ratio_clipped = torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    advantages = data.adv.unsqueeze(1)
    per_token_loss = -torch.min(ratio * advantages, ratio_clipped * advantages)
    per_token_loss = per_token_loss + beta * per_token_kl
    weight = data.weight if data.weight is not None else torch.ones_like(per_token_loss)
    loss = ((per_token_loss * weight).sum(dim=1) / weight.sum(dim=1)).mean()
    return loss, grpo_info(*_info(logp_old, logp_new, ratio, clip_ratio))


def grpo_policy_error(
    data: grpo_policy_data,
    log_prob_fn=efficient_method,
    clip_ratio: float = 0.2,
    beta: float = 0.1,
) -> tuple[Tensor, grpo_info]:
    """Mirrors ``ding.rl_utils.grpo.grpo_policy_error``.

    Per token: ``-min(r A, clip(r, 1 - c, 1 + c) A) + beta * k3`` with
    ``r = exp(logp_new - logp_old)`` and ``k3 = exp(logp_ref - logp_new) - (logp_ref -
    logp_new) - 1``; the loss is ``((loss * w).sum(1) / w.sum(1)).mean()`` (an all-zero
    weight row gives NaN, as in DI-engine).

    Args:
        data: :data:`grpo_policy_data` ``(logit_new, logit_old, logit_ref, action, adv,
            weight)``: logits ``(B, S, V)``, ``action`` ``(B, S)``, ``adv`` ``(B,)`` (one per
            sequence; a ``(B, 1)`` adv, which DI-engine silently broadcasts to ``(B, B, S)``,
            raises ``ValueError`` here), ``weight`` ``(B, S)`` or None.
        log_prob_fn: DI-engine's ``efficient_method`` (the default), ``naive_method`` or
            ``less_efficient_method`` (DI-engine's own or this module's; all three compute
            the same log-probs, so all run the fused kernel), or a caller's own function
            ``(logits, action) -> log-probs``, which is called as given and the rest of the
            loss computed as DI-engine does.
        beta: KL coefficient. With ``beta == 0`` ``logit_ref`` is not read (one vocab pass
            saved; DAPO / Dr. GRPO run this way); an attached ``logit_ref`` still gets a zero
            gradient, as DI-engine's ``0 * k3`` gives it. DI-engine still computes that
            ``0 * k3``, so there a reference probability of exactly 0 turns the loss into NaN
            and an fp64 ``logit_ref`` promotes it to fp64; here neither happens.

    Returns:
        ``(loss, grpo_info(approx_kl, clipfrac))``: a 0-dim tensor and unmasked Python floats.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding import grpo_policy_data, grpo_policy_error
        >>> logits = torch.randn(2, 4, 9, requires_grad=True)
        >>> data = grpo_policy_data(logits, logits.detach(), torch.randn(2, 4, 9),
        ...                         torch.randint(0, 9, (2, 4)), torch.tensor([1.0, -1.0]),
        ...                         None)
        >>> loss, info = grpo_policy_error(data, beta=0.04)
        >>> loss.backward()
    """
    logit_new, logit_old, logit_ref, action, adv, weight = data
    V.check_float(adv, "adv")
    if adv.dim() != 1:
        raise ValueError(
            f"adv must be (B,), one advantage per sequence, got shape {tuple(adv.shape)} "
            "(DI-engine would broadcast a (B, 1) adv to (B, B, S) silently)"
        )
    method = _known_method(log_prob_fn)
    if method is None:  # the caller's own log-prob function
        return _grpo_eager(data, log_prob_fn, clip_ratio, beta)
    if original_half_precision(logit_new, logit_old, logit_ref, adv, weight):
        for name in ("logit_new", "logit_old", "logit_ref"):
            _check_action(getattr(data, name), action, name)
        eager = _EAGER_METHODS[method]
        return _grpo_eager(data._replace(action=action.long()), eager, clip_ratio, beta)
    acc = _acc_dtype(logit_new, logit_old, logit_ref if beta != 0.0 else None, adv, weight)
    logp_new = _categorical_logp(logit_new, action, "logit_new").to(acc)
    logp_old = _categorical_logp(logit_old, action, "logit_old").to(acc)
    ratio = torch.exp(logp_new - logp_old)
    adv_a = adv.to(acc).unsqueeze(1)
    surr1, surr2 = _surrogate_terms(ratio, adv_a, clip_ratio)
    per_token = -torch.min(surr1, surr2)
    if beta != 0.0:
        logp_ref = _categorical_logp(logit_ref, action, "logit_ref").to(acc)
        log_ref_ratio = logp_ref - logp_new
        per_token = per_token + beta * (torch.exp(log_ref_ratio) - log_ref_ratio - 1)
    weight_a = torch.ones_like(per_token) if weight is None else weight.to(acc)
    loss = ((per_token * weight_a).sum(dim=1) / weight_a.sum(dim=1)).mean()
    if beta == 0.0 and logit_ref.requires_grad and torch.is_grad_enabled():
        # DI-engine's ``0 * k3`` gives an attached logit_ref a zero gradient (not None): an
        # empty slice's sum does the same without reading it
        loss = loss + logit_ref.reshape(-1)[:0].sum().to(loss.dtype)
    out_dtype = _promoted(logit_new, logit_old, logit_ref if beta != 0.0 else None, adv, weight)
    return loss.to(out_dtype), grpo_info(*_info(logp_old, logp_new, ratio, clip_ratio))
