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
"""

from __future__ import annotations

from torch import Tensor

from ._accurate import _run
from .core_algos import LOSS_AGG_MODES_V05 as LOSS_AGG_MODES
from .core_algos import (
    _agg_v05,
    _check_clip_ratio_c,
    _entropy_loss,
    _policy,
    _value,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
)
from .core_algos import kl_penalty_forward as _kl_penalty_forward  # not a v0.5 name
from .torch_functional import (
    clip_by_value,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
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
    """Mirrors verl v0.5's ``core_algos.compute_policy_loss``: 0.9's
    :func:`~fused_rl.compat.verl.core_algos.compute_policy_loss`
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


def compute_value_loss(
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


def compute_entropy_loss(
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


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors verl v0.5's ``core_algos.kl_penalty``:
    :func:`~fused_rl.compat.verl.core_algos.kl_penalty_forward` (a ``"+"``
    kind raises ``NotImplementedError``, as it did there).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import legacy_v05
        >>> legacy_v05.kl_penalty(torch.tensor([0.5]), torch.tensor([0.0]), "k1")
        tensor([0.5000])
    """
    return _kl_penalty_forward(logprob, ref_logprob, kl_penalty)
