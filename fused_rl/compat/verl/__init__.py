"""Drop-in replacements for the verl functions an actor / critic update calls, fused where
the vocabulary is involved.

Change ``import verl.utils.torch_functional as verl_F`` and
``from verl.trainer.ppo import core_algos`` to ``from fused_rl.compat import verl as verl_F``
and ``from fused_rl.compat import verl as core_algos``. verl is not imported (nor needed).

**Mirrors verl 0.9.x** (checked against 0.9.1, ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py``, by ``scripts/compat_live/verl/check.py``): signatures,
defaults, return tuples, output dtypes and numerics, quirks included. **The v0.5 line** (2025)
is :mod:`~fused_rl.compat.verl.legacy_v05`:
``from fused_rl.compat.verl import legacy_v05 as core_algos``.

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

The package is laid out like verl; this module has every public name of its submodules:

* :mod:`~fused_rl.compat.verl.torch_functional`: ``verl.utils.torch_functional``;
* :mod:`~fused_rl.compat.verl.core_algos`: ``verl.trainer.ppo.core_algos``, and its
  policy-loss registry in :mod:`~fused_rl.compat.verl.policy_loss` (``get_policy_loss_fn``,
  the losses that map onto one fused surrogate) with
  :mod:`~fused_rl.compat.verl.policy_loss_composed` (the losses that add token-space terms);
* :mod:`~fused_rl.compat.verl.kernel_linear_cross_entropy`:
  ``verl.utils.kernel.linear_cross_entropy`` (``linear_cross_entropy``);
  :mod:`~fused_rl.compat.verl.experimental_torch_functional`:
  ``verl.utils.experimental.torch_functional`` (``FusedLinearForPPO``). (Named after the
  path below ``verl.utils``: a module ``linear_cross_entropy`` would be shadowed here by the
  function of that name.)
* :mod:`~fused_rl.compat.verl.legacy_v05`: verl v0.5's ``core_algos``;
* private: ``_accurate`` (the ``"accurate"`` half-precision mode of verl's op sequences),
  ``_precision_twins`` (verl's own half-precision arithmetic, which ``"original"`` mode runs),
  ``_policy_loss_common`` (what the registered losses share). The modules use each other's
  underscore helpers (they are one adapter); nothing outside the package does.

Example:
    >>> from fused_rl.compat import verl
    >>> from fused_rl.compat.verl import core_algos, legacy_v05, torch_functional
    >>> verl.agg_loss is core_algos.agg_loss, verl.masked_mean is torch_functional.masked_mean
    (True, True)
    >>> legacy_v05.masked_whiten is verl.masked_whiten, legacy_v05.agg_loss is verl.agg_loss
    (True, False)
"""

from . import legacy_v05
from .core_algos import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_policy_loss_vanilla,
    compute_value_loss,
    kl_penalty,
    kl_penalty_forward,
)
from .core_algos import LOSS_AGG_MODES_V05 as LOSS_AGG_MODES_V05
from .distillation import compute_forward_kl_topk, compute_forward_kl_topk_megatron
from .experimental_torch_functional import FusedLinearForPPO
from .kernel_linear_cross_entropy import LINEAR_CE_REDUCTIONS, linear_cross_entropy
from .policy_loss import (
    POLICY_LOSS_REGISTRY,
    VERL_POLICY_LOSSES,
    compute_policy_loss_cispo,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    get_policy_loss_fn,
    register_policy_loss,
)
from .policy_loss_composed import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_kl_cov,
)
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
    "KL_PENALTIES",
    "agg_loss",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_forward_kl_topk",
    "compute_forward_kl_topk_megatron",
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
    "FusedLinearForPPO",
    "LINEAR_CE_REDUCTIONS",
    "linear_cross_entropy",
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
