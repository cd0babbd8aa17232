"""``torch.nn`` modules holding the hyper-parameters of the fused losses."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import BACKENDS
from .distributed import check_layout_keywords
from .linear import linear_policy_loss
from .losses import policy_loss
from .policy_config import OPTION_NAMES, PolicyConfig

# what a call needs besides the policy options and the per-batch tensors
_CALL_OPTIONS = (
    "temperature", "softcap", "with_entropy", "ignore_index", "process_group", "vocab_start",
    "vocab_size", "backend",
)  # fmt: skip
# what only a call on materialised logits takes (fused_rl.policy_loss)
_LOGITS_OPTIONS = ("inplace", "grad_in_forward", "loss_scale")


def _check_call_options(options: dict) -> None:
    """The call options :func:`fused_rl.policy_loss` would check, at construction: a typo in
    a config fails when the module is built, not at the first training step."""
    if "temperature" in options:
        V.check_positive(options["temperature"], "temperature")
    for name in ("inplace", "grad_in_forward"):
        if not isinstance(options.get(name, False), bool):
            raise TypeError(f"{name} must be a bool, got {options[name]!r}")
    loss_scale = options.get("loss_scale")
    if loss_scale is not None:
        V.check_number(loss_scale, "loss_scale")  # finite
    V.check_positive(options.get("softcap"), "softcap", allow_none=True)
    V.check_choice(options.get("backend", "auto"), BACKENDS, "backend")
    ignore_index = options.get("ignore_index", -100)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, minimum in (("vocab_start", 0), ("vocab_size", 1)):
        V.check_positive_int(options.get(name), name, allow_none=True, minimum=minimum)
    check_layout_keywords(
        options.get("process_group"), options.get("vocab_start"), options.get("vocab_size")
    )
    chunk = options.get("chunk_tokens")
    if chunk is not None:
        V.check_number(chunk, "chunk_tokens")
        if int(chunk) != chunk or chunk < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk}")


class PolicyLoss(torch.nn.Module):
    """PPO / GRPO policy loss over logits (:func:`fused_rl.policy_loss`) as a module.

    The constructor takes the policy options (every :class:`fused_rl.PolicyConfig` field,
    or a whole ``policy_config``; held as ``self.policy_config``) and the call options
    ``temperature``, ``softcap`` (Gemma-style logit soft-capping, see
    :func:`fused_rl.policy_loss`), ``with_entropy``, ``ignore_index``, ``process_group``
    (with ``vocab_start`` / ``vocab_size`` for a padded or ragged vocabulary), ``backend``,
    and ``inplace``, ``grad_in_forward``, ``loss_scale`` (the gradient written into the
    logits, formed in the forward, the loss's constant factor: see
    :func:`fused_rl.policy_loss`) (``self.call_options``), all checked at construction;
    ``kl=`` is a deprecated alias of ``kl_estimator=``, with one ``FutureWarning`` at
    construction.
    ``forward`` takes the per-batch tensors, as :func:`fused_rl.policy_loss` does: ``mask``
    is ``(B, T)`` bool, integer or float, a float (or integer) mask being per-token weights
    ``>= 0`` (see :func:`fused_rl.policy_loss`).

    Example:
        >>> import torch
        >>> from fused_rl.nn import PolicyLoss
        >>> loss_fn = PolicyLoss(eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean")
        >>> logits = torch.randn(2, 4, 16, requires_grad=True)
        >>> loss, metrics = loss_fn(logits, torch.randint(0, 16, (2, 4)), torch.randn(2))
        >>> loss.backward()
    """

    OPTIONS = (*OPTION_NAMES, *_CALL_OPTIONS, *_LOGITS_OPTIONS)

    def __init__(self, policy_config: PolicyConfig | None = None, **options):
        super().__init__()
        name = type(self).__name__
        if "kl" in options:
            options = V.renamed_keyword(
                options, old="kl", new="kl_estimator", where=f"fused_rl.nn.{name}"
            )
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise TypeError(f"{name} got unknown options {unknown}; known: {self.OPTIONS}")
        fields = {k: v for k, v in options.items() if k in OPTION_NAMES}
        if policy_config is not None and fields:
            raise TypeError(f"{name} got policy_config and the options {sorted(fields)}")
        if policy_config is not None and not isinstance(policy_config, PolicyConfig):
            raise TypeError(
                f"policy_config must be a fused_rl.PolicyConfig, got {type(policy_config).__name__}"
            )
        self.policy_config = PolicyConfig(**fields) if policy_config is None else policy_config
        self.call_options = {k: v for k, v in options.items() if k not in OPTION_NAMES}
        self._given = dict(options)
        _check_call_options(self.call_options)

    @property
    def config(self) -> dict:
        """The options as given to the constructor (``kl=`` under its new name)."""
        return dict(self._given)

    def forward(
        self,
        logits: Tensor,
        targets: Tensor,
        advantages: Tensor,
        *,
        old_logprobs: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        ref_logits: Tensor | None = None,
        mask: Tensor | None = None,
        is_weights: Tensor | None = None,
        num_items: int | float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy_loss(
            logits,
            targets,
            advantages,
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            ref_logprobs=ref_logprobs,
            ref_logits=ref_logits,
            mask=mask,
            is_weights=is_weights,
            num_items=num_items,
            policy_config=self.policy_config,
            **self.call_options,
        )

    def extra_repr(self) -> str:
        default = PolicyConfig()
        changed = {k: getattr(self.policy_config, k) for k in OPTION_NAMES
                   if getattr(self.policy_config, k) != getattr(default, k)}  # fmt: skip
        return ", ".join(f"{k}={v!r}" for k, v in {**changed, **self.call_options}.items())


class LinearPolicyLoss(PolicyLoss):
    """:func:`fused_rl.linear_policy_loss` as a module: the policy loss straight from the
    final hidden states and the lm_head, the ``(N, V)`` logits never held whole.

    The constructor takes :class:`PolicyLoss`'s options (``process_group`` included: then
    ``weight`` is this rank's vocabulary slice, with ``vocab_start`` / ``vocab_size``) plus
    ``chunk_tokens`` and ``reduce_hidden_grad`` (:func:`fused_rl.linear_policy_loss`);
    ``forward`` takes ``hidden`` ``(B, S, H)``, the lm_head ``weight`` ``(V, H)``,
    ``targets`` ``(B, T)`` and ``advantages``, and the per-batch keywords (``bias`` too).

    Example:
        >>> import torch
        >>> from fused_rl.nn import LinearPolicyLoss
        >>> loss_fn = LinearPolicyLoss(eps_high=0.28, chunk_tokens=4)
        >>> lm_head = torch.nn.Linear(8, 32, bias=False)
        >>> hidden = torch.randn(2, 6, 8, requires_grad=True)
        >>> loss, metrics = loss_fn(hidden, lm_head.weight, torch.randint(0, 32, (2, 5)),
        ...                         torch.randn(2))
        >>> loss.backward()
    """

    # process_group: a vocabulary-sharded lm_head (each rank's weight its slice); none of
    # the logits options: the chunks' logits are the op's own, turned into their gradient
    # in the forward already
    OPTIONS = (*OPTION_NAMES, *_CALL_OPTIONS, "chunk_tokens", "reduce_hidden_grad")

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        advantages: Tensor,
        *,
        bias: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        ref_hidden: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
        mask: Tensor | None = None,
        is_weights: Tensor | None = None,
        num_items: int | float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return linear_policy_loss(
            hidden,
            weight,
            targets,
            advantages,
            bias=bias,
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            ref_logprobs=ref_logprobs,
            ref_hidden=ref_hidden,
            ref_weight=ref_weight,
            ref_bias=ref_bias,
            mask=mask,
            is_weights=is_weights,
            num_items=num_items,
            policy_config=self.policy_config,
            **self.call_options,
        )
