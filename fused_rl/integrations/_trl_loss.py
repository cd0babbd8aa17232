"""The trainer's loss through one :func:`fused_rl.linear_policy_loss` call (TRL >= 1.15).

``GRPOTrainer(..., fused_rl_loss=True)`` / ``patch(loss=True)``: the trainer's
``_compute_loss`` is :func:`compute_loss` below. It runs the policy through the model's own
forward (``model(..., fused_rl_loss=request)``, so wrappers and hooks run as for TRL's
``fused_lm_head=True`` call), whose patched forward (:func:`loss_forward`) runs the backbone
and hands the last hidden states to ``linear_policy_loss``: the log-probs, the entropies, the
loss and its gradients in one pass over the vocabulary, the ``(N, V)`` logits never whole.

The options map exactly (checked against TRL 1.16's ``GRPOTrainer._compute_loss``):

* ``loss_type`` (:data:`LOSS_TYPES`): the surrogate and the aggregation. ``grpo`` and
  ``sapo`` -> ``seq-mean-token-mean``, ``bnpo`` -> ``token-mean``, ``dr_grpo`` ->
  ``seq-mean-token-sum-norm`` with ``max_length=max_completion_length``, ``luspo`` ->
  ``seq-mean-token-sum``, all divided by the accumulation steps afterwards as TRL does;
  ``dapo``, ``cispo``, ``vespo`` -> ``token-mean`` with ``num_items`` = TRL's normaliser
  (``num_items_in_batch`` over the processes, times the accumulation steps over
  ``steps_per_generation`` in training), which already holds the accumulation. ``cispo``'s
  absolute cap ``C = epsilon_high`` is fused_rl's band ``[0, C]`` (``eps_low=1``,
  ``eps_high=C - 1``); ``sapo``'s and ``vespo``'s parameters pass as they are.
* ``importance_sampling_level="sequence"`` -> ``importance_sampling="sequence"`` (GSPO's
  ratio, with the ratio surrogates: every loss type but ``cispo`` and ``vespo``).
* ``epsilon`` / ``epsilon_high`` -> ``eps_low`` / ``eps_high``; ``delta`` (PPO-type losses;
  TRL ignores it elsewhere); ``beta`` with the reference log-probs, ``kl_estimator="k3"``
  (TRL's ``exp(ref - logp) - (ref - logp) - 1`` is fused_rl's k3 of ``logp - ref``);
  ``use_bias_correction_kl`` -> ``kl_bias_correction``.
* ``entropy_coef`` -> ``entropy_coef`` with ``entropy_agg="token-mean"`` (TRL's bonus: the
  token-mean entropy, divided by the accumulation steps only: under a ``num_items`` loss the
  coefficient passed is ``entropy_coef / accumulation``); ``use_adaptive_entropy``: TRL's
  controller, run here on the entropy sums fused_rl returns (the coefficient of a step is
  known before it).
* ``top_entropy_quantile`` -> ``top_entropy_quantile`` (one process, no entropy bonus: TRL
  gathers the entropies of every process, and restricts its bonus to the kept tokens).
* vLLM's importance-sampling correction (``use_vllm`` with
  ``vllm_importance_sampling_correction``, any ``vllm_importance_sampling_mode``): TRL's
  ``importance_sampling_ratio`` -> ``is_weights`` (the policy term only; VESPO folds them
  into its weight, as TRL does).
* ``off_policy_mask_threshold`` -> ``off_policy_mask_threshold`` (DeepSeek-V3.2's
  off-policy sequence mask) with TRL's ``sampling_per_token_logps`` (vLLM's log-probs; else
  the old ones, else the current ones) as ``rollout_logprobs``.
* The MoE load-balancing loss (``output_router_logits`` with ``router_aux_loss_coef``):
  computed from the same backbone forward and added as TRL adds it.

``fused_rl_kl_estimator="full"`` (``patch(kl_estimator="full")``) puts the exact per-token
``KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v)`` over the whole vocabulary in place of
TRL's k3 estimate, at the same ``beta`` and aggregation (``kl_estimator="full"`` of
``linear_policy_loss``, from both models' last hidden states, the reference's logits
streamed beside the policy's and never whole). The reference model's backbone then runs
(no gradient) in each loss call (:func:`reference_hidden`: the reference model, or under
PEFT the policy with its adapter off, as TRL picks it) instead of TRL's reference
log-prob forward at generation, which is skipped; the logged ``kl`` is the exact KL's
token mean. ``use_bias_correction_kl`` (TRL's default) has nothing to correct there: it
re-weights the k3 estimate of the one sampled token by the ratio ``pi / pi_old`` so that its
gradient is the KL's, while the exact KL is already the sum over every token of the
vocabulary at each position (the states are still the rollout's, as with the correction).
It needs ``beta != 0`` and a reference model whose logit scale and soft cap are the
policy's (checked at construction).

A ``_compute_loss`` overridden by a subclass raises ``ValueError`` at construction
(:func:`policy_options`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import torch

_PPO, _ACCUMULATION, _NUM_ITEMS = "ppo", "accumulation", "num_items"


@dataclasses.dataclass(frozen=True)
class LossType:
    """How one TRL ``loss_type`` runs in fused_rl."""

    surrogate: str
    loss_agg: str
    # _ACCUMULATION: divide by the accumulation steps; _NUM_ITEMS: num_items; "trainer":
    # neither (RLOO: the Trainer divides by the accumulation steps)
    normaliser: str
    metrics: str  # which metrics TRL logs: "clip" (the clip ratios), "cispo", "vespo", ""


LOSS_TYPES = {
    "grpo": LossType(_PPO, "seq-mean-token-mean", _ACCUMULATION, "clip"),
    "bnpo": LossType(_PPO, "token-mean", _ACCUMULATION, "clip"),
    "dr_grpo": LossType(_PPO, "seq-mean-token-sum-norm", _ACCUMULATION, "clip"),
    "dapo": LossType(_PPO, "token-mean", _NUM_ITEMS, "clip"),
    "luspo": LossType(_PPO, "seq-mean-token-sum", _ACCUMULATION, "clip"),
    "cispo": LossType("cispo", "token-mean", _NUM_ITEMS, "cispo"),
    "sapo": LossType("sapo", "seq-mean-token-mean", _ACCUMULATION, ""),
    "vespo": LossType("vespo", "token-mean", _NUM_ITEMS, "vespo"),
}
# the multimodal inputs TRL's _get_per_token_logps_and_entropies passes on (one chunk: whole)
MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _uses_vllm_is(trainer) -> bool:
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def _problems(trainer, kind: LossType | None, kl_estimator: str) -> list[str]:
    """Every option of the trainer's loss fused_rl does not map exactly, as TRL names it."""
    from trl.trainer import grpo_trainer

    problems = []
    if kind is None:
        problems.append(f"loss_type={trainer.loss_type!r} (mapped: {', '.join(LOSS_TYPES)})")
    level = trainer.importance_sampling_level
    if level != "token" and not (level == "sequence" and kind and kind.surrogate != "cispo"):
        problems.append(f"importance_sampling_level={level!r} with loss_type={trainer.loss_type!r}")
    if trainer.top_entropy_quantile < 1.0:
        if trainer.accelerator.num_processes > 1:
            problems.append(
                f"top_entropy_quantile={trainer.top_entropy_quantile} on "
                f"{trainer.accelerator.num_processes} processes (TRL's quantile is over every "
                "process's entropies, fused_rl's over the call's)"
            )
        if trainer._entropy_bonus_enabled:
            problems.append(
                f"top_entropy_quantile={trainer.top_entropy_quantile} with an entropy bonus "
                "(TRL's bonus then averages over the kept tokens only)"
            )
    if kind is not None and kind.surrogate == "vespo" and _uses_vllm_is(trainer):
        low = trainer.vllm_importance_sampling_clip_min
        high = trainer.vllm_importance_sampling_clip_max
        if not ((low is None or low <= 1.0) and (high is None or high >= 1.0)):
            # TRL sums the logs of the ratios over every position, padding included, where
            # the ratio is 1 unless the clip range excludes it; fused_rl over counted tokens
            problems.append(
                f"loss_type='vespo' with a vLLM importance-sampling clip range [{low}, {high}] "
                "that excludes 1"
            )
    if type(trainer)._compute_loss is not grpo_trainer.GRPOTrainer._compute_loss:
        problems.append(f"a _compute_loss overridden by {type(trainer).__name__}")
    return problems


def route(trainer, kl_estimator: str = "k3") -> None:
    """Make a constructed ``trl.GRPOTrainer`` compute its loss with :func:`compute_loss`
    (its options checked now: :func:`policy_options`); with ``kl_estimator="full"`` its
    generation no longer computes the reference log-probs (the loss computes the KL)."""
    if kl_estimator == "full" and trainer.beta == 0.0:
        raise ValueError(
            "fused_rl_kl_estimator='full' with beta=0.0: there is no KL term to compute; set "
            "beta != 0, or leave fused_rl_kl_estimator='k3'"
        )
    trainer.fused_rl_policy_options = policy_options(trainer, kl_estimator)
    trainer._compute_loss = types.MethodType(compute_loss, trainer)
    if kl_estimator == "full":
        trainer._generate_and_score_completions = _without_reference_logprobs(
            trainer, trainer._generate_and_score_completions
        )


def _without_reference_logprobs(trainer, generate):
    """``trainer``'s ``_generate_and_score_completions`` (``generate``) run with
    ``beta = 0``: the one place it reads ``beta`` is the reference log-prob forward, which
    the exact KL does not use (TRL 1.15-1.16)."""

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        beta, trainer.beta = trainer.beta, 0.0
        try:
            return generate(*args, **kwargs)
        finally:
            trainer.beta = beta

    return wrapped


def policy_options(trainer, kl_estimator: str = "k3") -> dict:
    """The ``linear_policy_loss`` options of a constructed ``trl.GRPOTrainer``, or a
    ``ValueError`` naming every option of its loss that fused_rl does not map exactly."""
    args = trainer.args
    kind = LOSS_TYPES.get(trainer.loss_type)
    problems = _problems(trainer, kind, kl_estimator)
    if problems:
        raise ValueError(
            "fused_rl_loss=True computes TRL's loss with one fused_rl.linear_policy_loss call "
            "for the options that map exactly; not for: "
            + "; ".join(problems)
            + ". Use fused_rl_loss=False (fused_rl's log-probs, TRL's loss)"
        )
    beta = float(trainer.beta)
    eps_low, eps_high = float(trainer.epsilon_low), float(trainer.epsilon_high)
    if kind.surrogate == "cispo":  # TRL's sg(min(r, C)): the band [1 - 1, 1 + (C - 1)]
        if eps_high < 1.0:
            raise ValueError(
                f"fused_rl_loss=True: loss_type='cispo' with epsilon_high={eps_high} caps the "
                "ratio below 1 (TRL falls back to epsilon when epsilon_high is unset); fused_rl "
                "maps a cap C >= 1: set epsilon_high (ScaleRL uses 5.0)"
            )
        eps_low, eps_high = 1.0, eps_high - 1.0
    options = dict(
        surrogate=kind.surrogate,
        importance_sampling=trainer.importance_sampling_level,
        eps_low=eps_low,
        eps_high=eps_high,
        delta=None if args.delta is None or kind.surrogate != _PPO else float(args.delta),
        beta=beta,
        kl_estimator=kl_estimator,
        # the exact KL sums over the vocabulary: no sampled token's estimate to re-weight
        kl_bias_correction=bool(args.use_bias_correction_kl)
        and beta != 0.0
        and kl_estimator != "full",
        entropy_coef=float(trainer.entropy_coef),
        entropy_agg="token-mean",
        top_entropy_quantile=float(trainer.top_entropy_quantile),
        off_policy_mask_threshold=(
            None
            if trainer.off_policy_mask_threshold is None
            else float(trainer.off_policy_mask_threshold)
        ),
        loss_agg=kind.loss_agg,
        max_length=trainer.max_completion_length if trainer.loss_type == "dr_grpo" else None,
    )
    if kind.surrogate == "sapo":
        options.update(sapo_tau_pos=float(args.sapo_temperature_pos),
                       sapo_tau_neg=float(args.sapo_temperature_neg))  # fmt: skip
    if kind.surrogate == "vespo":
        options.update({f"vespo_{name}": float(getattr(args, f"vespo_{name}"))
                        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")})  # fmt: skip
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
    rollout_logprobs: torch.Tensor | None  # vLLM's, for the off-policy mask
    ref_logprobs: torch.Tensor | None
    is_weights: torch.Tensor | None  # vLLM's importance-sampling ratios
    num_items: torch.Tensor | None
    options: dict
    # the exact KL: the reference's last hidden states (B, S, H_ref), lm_head weight, bias
    ref_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


@functools.cache
def _output_type():
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class FusedPolicyLossOutput(ModelOutput):
        """``loss``: the policy loss (0-dim); ``metrics``: ``linear_policy_loss``'s;
        ``aux_loss``: the MoE load-balancing loss when router logits were asked for."""

        loss: torch.Tensor | None = None
        metrics: dict | None = None
        aux_loss: torch.Tensor | None = None

    return FusedPolicyLossOutput


def loss_forward(hidden, weight, bias, request: LossRequest, head, aux_loss=None):
    """The loss from the backbone's last hidden states ``(B, S, H)``: rows ``S - C - 1 ...
    S - 2`` predict the ``C`` completion tokens (``linear_policy_loss``'s causal shift)."""
    from ..linear import linear_policy_loss

    ref_hidden, ref_weight, ref_bias = request.ref_head or (None, None, None)
    loss, metrics = linear_policy_loss(
        hidden, weight, request.targets, request.advantages, bias=bias,
        old_logprobs=request.old_logprobs, rollout_logprobs=request.rollout_logprobs,
        ref_logprobs=request.ref_logprobs, ref_hidden=ref_hidden, ref_weight=ref_weight,
        ref_bias=ref_bias, mask=request.mask, is_weights=request.is_weights,
        num_items=request.num_items,
        temperature=head.temperature, softcap=head.softcap, with_entropy=True,
        chunk_tokens=head.options.chunk_tokens,
        backend=head.options.backend, **request.options,
    )  # fmt: skip
    return _output_type()(loss=loss, metrics=metrics, aux_loss=aux_loss)


def _entropy_coef(trainer) -> float:
    """The coefficient this micro-batch applies: TRL's, gated by the adaptive controller on
    the window entropy of the previous optimizer step."""
    if trainer.use_adaptive_entropy:
        gate = trainer._last_world_entropy <= trainer.args.entropy_target
        return trainer.entropy_coef if gate else 0.0
    return trainer.entropy_coef


def compute_loss(trainer, model, inputs):
    """``trl.GRPOTrainer._compute_loss`` with one fused_rl call: the same loss (value and
    gradient) and the same metrics, logged under TRL's names, gathered as TRL gathers them."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    kind = LOSS_TYPES[trainer.loss_type]
    options = dict(trainer.fused_rl_policy_options)
    options["entropy_coef"] = _entropy_coef(trainer) if trainer._entropy_bonus_enabled else 0.0
    num_items = None
    if kind.normaliser == _NUM_ITEMS:  # TRL's normaliser: one accumulation window's share
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / trainer.args.steps_per_generation
        # the entropy bonus is divided by the accumulation steps only, never by num_items
        options["entropy_coef"] = options["entropy_coef"] / accumulation
    request = LossRequest(
        targets=completion_ids, advantages=inputs["advantages"], mask=mask,
        old_logprobs=inputs.get("old_per_token_logps"),
        rollout_logprobs=(
            inputs.get("sampling_per_token_logps")
            if options["off_policy_mask_threshold"] is not None else None
        ),
        ref_logprobs=(
            inputs["ref_per_token_logps"]
            if options["beta"] != 0.0 and options["kl_estimator"] != "full" else None
        ),
        is_weights=inputs["importance_sampling_ratio"] if _uses_vllm_is(trainer) else None,
        num_items=num_items, options=options,
    )  # fmt: skip
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    model_inputs.update({k: inputs[k] for k in MODEL_INPUTS if inputs.get(k) is not None})
    with trainer.accelerator.autocast():
        if options["kl_estimator"] == "full":
            request.ref_head = reference_hidden(trainer, model_inputs)
        if trainer.aux_loss_enabled:  # the MoE load-balancing loss, from the same forward
            model_inputs["output_router_logits"] = True
        out = model(**model_inputs, fused_rl_loss=request)
    loss, metrics = out.loss, out.metrics
    if kind.normaliser == _ACCUMULATION:
        loss = loss / accumulation
    log_metrics(trainer, mode, kind, out.loss.detach(), metrics, mask, options)
    if trainer._entropy_bonus_enabled:
        if trainer.use_adaptive_entropy and mode == "train":
            _adapt_entropy_coef(trainer, metrics["entropy"], mask)
        if mode == "train" and trainer.accelerator.sync_gradients:  # the coef of the next step
            trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * out.aux_loss / accumulation
        log = trainer._metrics[mode]["aux_loss"]
        log.append(trainer.accelerator.gather_for_metrics(out.aux_loss).mean().item())
    return loss


def reference_hidden(trainer, model_inputs):
    """The reference model's last hidden states, lm_head weight and bias on
    ``model_inputs`` (no gradient): ``trainer.ref_model``, or under PEFT the policy with
    its adapter off (the ``"ref"`` adapter where one is loaded), as TRL picks it; under
    FSDP2 the head gathered again after the forward (``HeadInputs.kept``)."""
    with torch.no_grad():
        if trainer.ref_model is not None:
            out = trainer.ref_model(**model_inputs, fused_rl_hidden=True)
        else:
            from trl.trainer.utils import use_adapter

            peft_model = trainer.accelerator.unwrap_model(trainer.model)
            adapter = "ref" if "ref" in peft_model.peft_config else None
            with use_adapter(peft_model, adapter_name=adapter):
                out = trainer.model(**model_inputs, fused_rl_hidden=True)
        return out.hidden, *out.kept()


def _adapt_entropy_coef(trainer, entropy, mask):
    """TRL's adaptive entropy controller: the window's entropy sum and token count, reduced
    over the processes at the optimizer-step boundary, move the coefficient of the next
    step by ``entropy_coef_delta`` within ``[entropy_coef_min, entropy_coef_max]``."""
    count = mask.sum().float()
    stats = torch.stack([entropy.float() * count, count]).detach()
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    args = trainer.args
    totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    if world_entropy <= args.entropy_target:
        trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta,
                                   args.entropy_coef_max)  # fmt: skip
    else:
        trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta,
                                   args.entropy_coef_min)  # fmt: skip
    trainer._last_world_entropy = world_entropy
    trainer._entropy_window_stats = None


def log_metrics(trainer, mode, kind: LossType, fused_loss, metrics, mask, options):
    """TRL's metrics from fused_rl's: the token means as TRL's global masked means (sums and
    counts reduced over the processes), the per-sequence extremes gathered then
    NaN-ignoring min / max, ``policy_loss`` when the bonus is on.
    At TRL's sequence level (and for VESPO's ``phi``) a ratio is one value per sequence and
    TRL's means weigh every sequence of the batch, empty ones included (where the ratio is
    1, so nothing clips and ``phi`` is 1)."""
    from trl.trainer.utils import nanmax, nanmin

    accelerator, log = trainer.accelerator, trainer._metrics[mode]
    if getattr(trainer, "_entropy_bonus_enabled", False):  # GRPO's (RLOO has no bonus)
        # the policy term alone: fused_rl's loss holds -coef * (the token-mean entropy)
        policy_loss = fused_loss + options["entropy_coef"] * metrics["entropy"]
        log["policy_loss"].append(accelerator.gather(policy_loss).nanmean().item())
    count = mask.sum().float()
    n_seq = torch.full_like(count, mask.shape[0])
    counted = mask.sum(-1) > 0
    n_counted = counted.sum().float()
    sequence_level = options["importance_sampling"] in ("sequence", "sequence-sum")
    sums = {"entropy": (metrics["entropy"] * count, count)}  # name: (sum, count)
    if options.get("beta", 0.0) != 0.0:
        kl = metrics["kl_bias_corrected" if options["kl_bias_correction"] else "kl"]
        sums["kl"] = (kl * count, count)
    if kind.metrics == "clip":
        if sequence_level:  # each sequence clipped or not; the empty ones are not
            low = metrics["clip_frac_low_seq_mean"] * n_counted
            high = metrics["clip_frac_high_seq_mean"] * n_counted
            total = n_seq
        else:
            low, high = metrics["clip_frac_low"] * count, metrics["clip_frac_high"] * count
            total = count
        # TRL's low and high clips exclude each other (A < 0, A > 0): region = low + high
        sums.update({"clip_ratio/low_mean": (low, total), "clip_ratio/high_mean": (high, total),
                     "clip_ratio/region_mean": (low + high, total)})  # fmt: skip
    elif kind.metrics == "cispo":
        sums["cispo_clip_ratio"] = (metrics["cispo_clip_frac"] * count, count)
    elif kind.metrics == "vespo":  # phi per sequence over all of them (1 where empty)
        phi = metrics["vespo_phi_seq_mean"] * n_counted + (n_seq - n_counted)
        sums["vespo/phi_seq_mean"] = (phi, n_seq)
    stacked = torch.stack([torch.stack([x.float(), n.float()]) for x, n in sums.values()])
    totals = accelerator.reduce(stacked, reduction="sum")
    values = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
    for name, value in zip(sums, values):
        log[name].append(value)
    if kind.metrics != "clip":
        return
    # per-sequence extremes over the sequences with a counted token, NaN where none counts
    # (TRL's per-sequence means are NaN there); at the sequence level TRL's ratio of an
    # empty sequence is 1, its share 0, and it joins the extremes
    nan = torch.full((), math.nan, device=count.device)
    low_min = torch.where(counted.any(), metrics["clip_frac_low_seq_min"].float(), nan)
    high_max = torch.where(counted.any(), metrics["clip_frac_high_seq_max"].float(), nan)
    if sequence_level:  # an empty sequence's share is 0
        empty = ~counted.all()
        low_min = torch.where(empty, torch.zeros_like(low_min), low_min)
        high_max = torch.where(empty, high_max.nan_to_num(0.0), high_max)
    log["clip_ratio/low_min"].append(nanmin(accelerator.gather(low_min.reshape(1))).item())
    log["clip_ratio/high_max"].append(nanmax(accelerator.gather(high_max.reshape(1))).item())
