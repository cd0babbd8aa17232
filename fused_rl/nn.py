"""``torch.nn`` modules holding the hyper-parameters of the fused losses."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import _validation as V
from ._backend import BACKENDS
from .linear import linear_policy_loss
from .losses import check_policy_options, policy_loss

# the keyword options of policy_loss that configure the loss (not per-batch tensors)
_POLICY_OPTIONS = tuple(
    name
    for name, p in inspect.signature(policy_loss).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
    and name not in ("old_logprobs", "ref_logprobs", "mask", "is_weights", "num_items")
)


def _check_options(config: dict) -> None:
    """The checks ``policy_loss`` would run on these options, at construction: a typo in a
    config fails when the module is built, not at the first training step."""
    defaults = inspect.signature(policy_loss).parameters
    options = {name: config.get(name, defaults[name].default) for name in _POLICY_OPTIONS}
    check_policy_options(**{k: options[k] for k in _TENSOR_FREE_OPTIONS})
    V.check_positive(options["temperature"], "temperature")
    V.check_choice(options["backend"], BACKENDS, "backend")
    if isinstance(options["ignore_index"], bool) or not isinstance(options["ignore_index"], int):
        raise TypeError(
            f"ignore_index must be an int, got {type(options['ignore_index']).__name__}"
        )


_TENSOR_FREE_OPTIONS = tuple(inspect.signature(check_policy_options).parameters)[:-1]


class PolicyLoss(torch.nn.Module):
    """PPO / GRPO policy loss over logits (:func:`fused_rl.policy_loss`) as a module.

    The constructor takes the keyword options of ``policy_loss`` (``eps_low``, ``eps_high``,
    ``dual_clip``, ``delta``, ``beta``, ``kl_estimator``, ``entropy_coef``, ``with_entropy``,
    ``importance_sampling``, ``loss_agg``, ``max_length``, ``temperature``,
    ``ignore_index``, ``process_group``, ``backend``; ``kl=`` is a deprecated alias of
    ``kl_estimator=``, with one ``FutureWarning`` at construction); ``forward`` takes the
    per-batch tensors, as
    :func:`fused_rl.policy_loss` does: ``mask`` is ``(B, T)`` bool, integer or float, a float
    (or integer) mask being per-token weights ``>= 0`` (see :func:`fused_rl.policy_loss`).

    Example:
        >>> import torch
        >>> from fused_rl.nn import PolicyLoss
        >>> loss_fn = PolicyLoss(eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean")
        >>> logits = torch.randn(2, 4, 16, requires_grad=True)
        >>> loss, metrics = loss_fn(logits, torch.randint(0, 16, (2, 4)), torch.randn(2))
        >>> loss.backward()
    """

    OPTIONS = _POLICY_OPTIONS

    def __init__(self, **config):
        super().__init__()
        name = type(self).__name__
        if "kl" in config:
            config = V.renamed_keyword(
                config, old="kl", new="kl_estimator", where=f"fused_rl.nn.{name}"
            )
        unknown = sorted(set(config) - set(self.OPTIONS))
        if unknown:
            raise TypeError(f"{name} got unknown options {unknown}; known: {self.OPTIONS}")
        _check_options({k: v for k, v in config.items() if k in _POLICY_OPTIONS})
        if config.get("chunk_tokens") is not None:
            V.check_number(config["chunk_tokens"], "chunk_tokens")
            if int(config["chunk_tokens"]) != config["chunk_tokens"] or config["chunk_tokens"] < 1:
                raise ValueError(
                    f"chunk_tokens must be a positive integer, got {config['chunk_tokens']}"
                )
        self.config = dict(config)

    def forward(
        self,
        logits: Tensor,
        targets: Tensor,
        advantages: Tensor,
        *,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        mask: Tensor | None = None,
        is_weights: Tensor | None = None,
        num_items: int | float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy_loss(
            logits,
            targets,
            advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            mask=mask,
            is_weights=is_weights,
            num_items=num_items,
            **self.config,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class LinearPolicyLoss(PolicyLoss):
    """:func:`fused_rl.linear_policy_loss` as a module: the policy loss straight from the
    final hidden states and the lm_head, the ``(N, V)`` logits never held whole.

    The constructor takes :class:`PolicyLoss`'s options (``process_group`` included: then
    ``weight`` is this rank's vocabulary slice) plus ``chunk_tokens``, ``vocab_start``,
    ``vocab_size`` and ``reduce_hidden_grad`` (:func:`fused_rl.linear_policy_loss`); ``forward``
    takes ``hidden`` ``(B, S, H)``, the lm_head ``weight`` ``(V, H)``, ``targets``
    ``(B, T)`` and ``advantages``, and the per-batch keywords (``bias`` too).

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

    # process_group: a vocabulary-sharded lm_head (each rank's weight its slice)
    OPTIONS = (*_POLICY_OPTIONS, "chunk_tokens", "vocab_start", "vocab_size",
               "reduce_hidden_grad")  # fmt: skip

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        advantages: Tensor,
        *,
        bias: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
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
            ref_logprobs=ref_logprobs,
            mask=mask,
            is_weights=is_weights,
            num_items=num_items,
            **self.config,
        )
