"""TRL's ``RLOOTrainer`` loss through one :func:`fused_rl.linear_policy_loss` call (TRL 1.16).

``RLOOTrainer(..., fused_rl_loss=True)`` / ``patch(loss=True)``: the trainer's
``_compute_loss`` is :func:`compute_loss` below, which runs the policy through the model's
own forward (``model(..., fused_rl_loss=request)``, as the GRPO route of
:mod:`._trl_loss`) and computes TRL's loss from the last hidden states: the log-probs,
the entropies, the loss and its gradients in one pass over the vocabulary.

TRL 1.16's RLOO loss, read against ``RLOOTrainer._compute_loss``: one ratio per sequence
of its summed log-probs, ``r = exp(sum_t m logp - old_logps)`` (``old_logps``: the old
policy's summed log-probs, from generation), clipped to ``[1 - epsilon, 1 + epsilon_high]``,
``loss = mean_b -min(r A, clip(r) A)`` over every sequence of the micro-batch, not divided
by the accumulation steps (the Trainer does that). In fused_rl:
``importance_sampling="sequence-sum"``, ``loss_agg="seq-mean-token-mean"`` (each token of
a sequence carries its sequence's loss), the summed old log-probs as the ``old_logprobs``
of each sequence's first counted token (0 elsewhere: the sum is the same). A sequence with
no counted token weighs 0 in fused_rl's mean and ``-A`` in TRL's (its ratio is 1): added
here, a constant (the clip metrics count it as unclipped, its ratio being 1). The MoE
load-balancing loss is added unscaled, as TRL adds it. The metrics TRL logs, under its
names: ``entropy`` (the masked mean, reduced over the
processes), ``clip_ratio/low_mean``, ``high_mean``, ``region_mean`` (one flag per sequence,
over every sequence), ``low_min`` / ``high_max``, and ``aux_loss`` for a MoE policy.
"""

from __future__ import annotations

import types

import torch

from . import _trl_loss

RLOO = _trl_loss.LossType("ppo", "seq-mean-token-mean", "trainer", "clip")


def policy_options(trainer) -> dict:
    """The ``linear_policy_loss`` options of a constructed ``trl.RLOOTrainer``, or a
    ``ValueError`` naming what does not map."""
    import trl
    from packaging.version import Version
    from trl.trainer import rloo_trainer

    if Version(trl.__version__).release[:2] != (1, 16):
        raise ValueError(
            "fused_rl_loss=True computes RLOOTrainer's loss as TRL 1.16 defines it; found TRL "
            f"{trl.__version__}. Use fused_rl_loss=False (fused_rl's log-probs, TRL's loss)"
        )
    if type(trainer)._compute_loss is not rloo_trainer.RLOOTrainer._compute_loss:
        raise ValueError(
            "fused_rl_loss=True computes RLOOTrainer's loss with one fused_rl.linear_policy_loss "
            f"call; not for a _compute_loss overridden by {type(trainer).__name__}. Use "
            "fused_rl_loss=False (fused_rl's log-probs, TRL's loss)"
        )
    options = dict(
        surrogate=RLOO.surrogate,
        importance_sampling="sequence-sum",
        eps_low=float(trainer.epsilon_low),
        eps_high=float(trainer.epsilon_high),
        loss_agg=RLOO.loss_agg,
    )
    try:  # checked now, not at the first step
        from ..policy_config import PolicyConfig

        PolicyConfig(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fused_rl_loss=True: TRL's options do not map: {exc}") from exc
    return options


def route(trainer) -> None:
    """Make a constructed ``trl.RLOOTrainer`` compute its loss with :func:`compute_loss`."""
    trainer.fused_rl_policy_options = policy_options(trainer)
    trainer._compute_loss = types.MethodType(compute_loss, trainer)


def _old_on_first_token(old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` per-token old log-probs whose ``mask``-weighted sum is ``old_logps``
    ``(B,)``: the whole sum (over the token's weight) on each sequence's first counted
    token, 0 elsewhere."""
    counted = mask != 0
    first = counted & (counted.cumsum(-1) == 1)
    weight = torch.where(first, mask.to(torch.float32), 1.0)
    return torch.where(first, old_logps[:, None].to(torch.float32) / weight, 0.0)


def _empty_sequences_loss(old_logps, advantages, mask, options) -> torch.Tensor:
    """TRL's mean is over every sequence: one with no counted token has the ratio
    ``exp(0 - old_logps)`` (1, as TRL computes ``old_logps`` over the same mask) and the
    loss ``-min(r A, clip(r) A)``, a constant; fused_rl's mean gives it 0. Its share."""
    empty = mask.sum(-1) == 0
    ratio = torch.exp(-torch.where(empty, old_logps.float(), 0.0))  # 1 where not empty
    adv = advantages.float()
    clipped = ratio.clamp(1.0 - options["eps_low"], 1.0 + options["eps_high"])
    per_seq = -torch.minimum(ratio * adv, clipped * adv)
    return torch.where(empty, per_seq, 0.0).sum() / mask.shape[0]


def compute_loss(trainer, model, inputs):
    """``trl.RLOOTrainer._compute_loss`` with one fused_rl call: the same loss (value and
    gradient) and the same metrics, under TRL's names."""
    completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], mask], dim=1)
    mode = "train" if trainer.model.training else "eval"
    options = dict(trainer.fused_rl_policy_options)
    advantages = inputs["advantages"]
    request = _trl_loss.LossRequest(
        targets=completion_ids, advantages=advantages, mask=mask,
        old_logprobs=_old_on_first_token(inputs["old_logps"], mask), rollout_logprobs=None,
        ref_logprobs=None, is_weights=None, num_items=None, options=options,
    )  # fmt: skip
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    model_inputs.update({k: inputs[k] for k in _trl_loss.MODEL_INPUTS
                         if inputs.get(k) is not None})  # fmt: skip
    if trainer.aux_loss_enabled:  # the MoE load-balancing loss, from the same forward
        model_inputs["output_router_logits"] = True
    with trainer.accelerator.autocast():
        out = model(**model_inputs, fused_rl_loss=request)
    loss = out.loss + _empty_sequences_loss(inputs["old_logps"], advantages, mask, options)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * out.aux_loss
        log = trainer._metrics[mode]["aux_loss"]
        log.append(trainer.accelerator.gather_for_metrics(out.aux_loss).mean().item())
    _trl_loss.log_metrics(trainer, mode, RLOO, loss.detach(), out.metrics, mask, options)
    return loss
