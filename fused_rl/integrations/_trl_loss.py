"""The trainer's loss through one :func:`fused_rl.linear_policy_loss` call (TRL >= 1.15).

``GRPOTrainer(..., fused_rl_loss=True)`` / ``patch(loss=True)``: the trainer's
``_compute_loss`` is :func:`compute_loss` below. It runs the policy through the model's own
forward (``model(..., fused_rl_loss=request)``, so wrappers and hooks run as for TRL's
``fused_lm_head=True`` call), whose patched forward (:func:`loss_forward`) runs the backbone
and hands the last hidden states to ``linear_policy_loss``: the log-probs, the entropies, the
loss and its gradients in one pass over the vocabulary, the ``(N, V)`` logits never whole.

The options map exactly (checked against TRL 1.16's ``GRPOTrainer._compute_loss``):

* ``loss_type``: ``grpo`` -> ``seq-mean-token-mean``, ``bnpo`` -> ``token-mean``,
  ``dr_grpo`` -> ``seq-mean-token-sum-norm`` with ``max_length=max_completion_length``,
  ``dapo`` -> ``token-mean`` with ``num_items`` = TRL's normaliser (``num_items_in_batch``
  over the processes, times the accumulation steps over ``steps_per_generation`` in training).
  The first three are divided by the accumulation steps afterwards, as TRL does; ``dapo``'s
  normaliser already holds them.
* ``epsilon`` / ``epsilon_high`` -> ``eps_low`` / ``eps_high``; ``delta``; ``beta`` with the
  reference log-probs, ``kl_estimator="k3"`` (TRL's ``exp(ref - logp) - (ref - logp) - 1``
  is fused_rl's k3 of ``logp - ref``); ``use_bias_correction_kl`` -> ``kl_bias_correction``.
* ``entropy_coef`` (static) -> ``entropy_coef`` with ``entropy_agg="token-mean"`` (TRL's
  bonus: the token-mean entropy, divided by the accumulation steps only: under ``dapo`` the
  coefficient passed is ``entropy_coef / accumulation``).

Everything else ``_compute_loss`` supports raises ``ValueError`` at construction naming the
option (:func:`policy_options`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

# TRL's loss_type -> fused_rl's loss_agg
LOSS_AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}
# the multimodal inputs TRL's _get_per_token_logps_and_entropies passes on (one chunk: whole)
_MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def policy_options(trainer) -> dict:
    """The ``linear_policy_loss`` options of a constructed ``trl.GRPOTrainer``, or a
    ``ValueError`` naming every option of its loss that fused_rl does not map exactly."""
    from trl.trainer import grpo_trainer

    args = trainer.args
    problems = []
    if trainer.loss_type not in LOSS_AGG:
        problems.append(f"loss_type={trainer.loss_type!r} (mapped: {', '.join(LOSS_AGG)})")
    if trainer.importance_sampling_level != "token":
        problems.append(f"importance_sampling_level={trainer.importance_sampling_level!r}")
    if trainer.top_entropy_quantile < 1.0:
        problems.append(f"top_entropy_quantile={trainer.top_entropy_quantile}")
    if trainer.off_policy_mask_threshold is not None:
        problems.append(f"off_policy_mask_threshold={trainer.off_policy_mask_threshold}")
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        problems.append("vllm_importance_sampling_correction=True (with use_vllm)")
    if trainer.use_adaptive_entropy:
        problems.append("use_adaptive_entropy=True")
    if trainer.aux_loss_enabled:
        problems.append(
            f"the MoE load-balancing loss (output_router_logits, router_aux_loss_coef="
            f"{trainer.router_aux_loss_coef})"
        )
    if type(trainer)._compute_loss is not grpo_trainer.GRPOTrainer._compute_loss:
        problems.append(f"a _compute_loss overridden by {type(trainer).__name__}")
    if problems:
        raise ValueError(
            "fused_rl_loss=True computes TRL's loss with one fused_rl.linear_policy_loss call "
            "for the options that map exactly; not for: "
            + "; ".join(problems)
            + ". Use fused_rl_loss=False (fused_rl's log-probs, TRL's loss)"
        )
    beta = float(trainer.beta)
    options = dict(
        eps_low=float(trainer.epsilon_low),
        eps_high=float(trainer.epsilon_high),
        delta=None if args.delta is None else float(args.delta),
        beta=beta,
        kl_estimator="k3",
        kl_bias_correction=bool(args.use_bias_correction_kl) and beta != 0.0,
        entropy_coef=float(trainer.entropy_coef),
        entropy_agg="token-mean",
        loss_agg=LOSS_AGG[trainer.loss_type],
        max_length=trainer.max_completion_length if trainer.loss_type == "dr_grpo" else None,
    )
    try:  # the options checked now, not at the first step
        from ..policy_config import PolicyConfig

        PolicyConfig(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fused_rl_loss=True: TRL's options do not map: {exc}") from exc
    return options


@dataclasses.dataclass
class LossRequest:
    """What the patched forward needs to compute the loss (passed as ``fused_rl_loss=``)."""

    targets: torch.Tensor  # (B, C): the completion ids
    advantages: torch.Tensor
    mask: torch.Tensor  # (B, C)
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    num_items: torch.Tensor | None
    options: dict


@functools.cache
def _output_type():
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class FusedPolicyLossOutput(ModelOutput):
        """``loss``: the policy loss (0-dim); ``metrics``: ``linear_policy_loss``'s."""

        loss: torch.Tensor | None = None
        metrics: dict | None = None

    return FusedPolicyLossOutput


def loss_forward(hidden, weight, bias, request: LossRequest, head):
    """The loss from the backbone's last hidden states ``(B, S, H)``: rows ``S - C - 1 ...
    S - 2`` predict the ``C`` completion tokens (``linear_policy_loss``'s causal shift)."""
    from ..linear import linear_policy_loss

    loss, metrics = linear_policy_loss(
        hidden, weight, request.targets, request.advantages, bias=bias,
        old_logprobs=request.old_logprobs, ref_logprobs=request.ref_logprobs,
        mask=request.mask, num_items=request.num_items, temperature=head.temperature,
        with_entropy=True, chunk_tokens=head.options.chunk_tokens,
        backend=head.options.backend, **request.options,
    )  # fmt: skip
    return _output_type()(loss=loss, metrics=metrics)


def compute_loss(trainer, model, inputs):
    """``trl.GRPOTrainer._compute_loss`` with one fused_rl call: the same loss (value and
    gradient) and the same metrics, logged under TRL's names, gathered as TRL gathers them."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    options = dict(trainer.fused_rl_policy_options)
    num_items = None
    if trainer.loss_type == "dapo":  # TRL's normaliser: one accumulation window's share
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / trainer.args.steps_per_generation
        # the entropy bonus is divided by the accumulation steps only, never by num_items
        options["entropy_coef"] = options["entropy_coef"] / accumulation
    request = LossRequest(
        targets=completion_ids, advantages=inputs["advantages"], mask=mask,
        old_logprobs=inputs.get("old_per_token_logps"),
        ref_logprobs=inputs["ref_per_token_logps"] if options["beta"] != 0.0 else None,
        num_items=num_items, options=options,
    )  # fmt: skip
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    model_inputs.update({k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None})
    with trainer.accelerator.autocast():
        out = model(**model_inputs, fused_rl_loss=request)
    loss, metrics = out.loss, out.metrics
    if trainer.loss_type != "dapo":
        loss = loss / accumulation
    _log(trainer, mode, out.loss.detach(), metrics, mask, options)
    return loss


def _log(trainer, mode, fused_loss, metrics, mask, options):
    """TRL's metrics from fused_rl's: the token means as TRL's global masked means (sums and
    counts reduced over the processes), the per-sequence extremes gathered then
    NaN-ignoring min / max, ``policy_loss`` and ``entropy_coef`` when the bonus is on."""
    from trl.trainer.utils import nanmax, nanmin

    accelerator, log = trainer.accelerator, trainer._metrics[mode]
    if trainer._entropy_bonus_enabled:
        # the policy term alone: fused_rl's loss holds -coef * (the token-mean entropy)
        policy_loss = fused_loss + options["entropy_coef"] * metrics["entropy"]
        log["policy_loss"].append(accelerator.gather(policy_loss).nanmean().item())
        if mode == "train" and accelerator.sync_gradients:
            log["entropy_coef"].append(trainer.entropy_coef)
    count = mask.sum().float()
    low, high = metrics["clip_frac_low"], metrics["clip_frac_high"]
    means = {"entropy": metrics["entropy"]}
    if options["beta"] != 0.0:
        means["kl"] = metrics["kl_bias_corrected" if options["kl_bias_correction"] else "kl"]
    # TRL's low and high clips exclude each other (A < 0, A > 0): region = low + high
    means.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                  "clip_ratio/region_mean": low + high})  # fmt: skip
    sums = torch.stack([m.float() * count for m in means.values()] + [count])
    totals = accelerator.reduce(sums, reduction="sum")
    values = (totals[:-1] / totals[-1].clamp(min=1.0)).tolist()
    for name, value in zip(means, values):
        log[name].append(value)
    # fused_rl's extremes are 0 where no sequence counts; TRL's per-sequence means are NaN
    counted = (mask.sum(-1) > 0).any()
    nan = torch.full((), math.nan, device=count.device)
    extremes = (("clip_ratio/low_min", "clip_frac_low_seq_min", nanmin),
                ("clip_ratio/high_max", "clip_frac_high_seq_max", nanmax))  # fmt: skip
    for name, key, reduce in extremes:
        local = torch.where(counted, metrics[key].float(), nan).reshape(1)
        log[name].append(reduce(accelerator.gather(local)).item())
