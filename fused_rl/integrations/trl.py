"""fused_rl inside TRL's trainers that compute log-probs with TRL's fused LM head
(``GRPOTrainer``, TRL >= 1.15; TRL 1.16's ``RLOOTrainer``, ``DPOTrainer``, ``KTOTrainer``,
``SFTTrainer``) and inside TRL 1.16's ``DistillationTrainer``.

Since TRL 1.15 ``trl.GRPOTrainer`` computes every per-token log-prob and entropy with its own
chunked fused LM head: ``trl.trainer.utils.add_fused_lm_head`` patches the model's forward so
that ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone and projects the
hidden states through the LM head in chunks. The function-level drop-ins of
``fused_rl.compat.trl`` (``selective_log_softmax``, ``entropy_from_logits``) are never called
there. This module replaces that head::

    from fused_rl.integrations.trl import GRPOTrainer   # was: from trl import GRPOTrainer

or, for a script or a library that constructs ``trl.GRPOTrainer`` itself::

    import fused_rl.integrations.trl as fused_trl
    fused_trl.patch()            # or: with fused_trl.patched(): ...

What runs: every ``fused_lm_head=True`` forward TRL makes (the policy in the training step,
the old policy, the reference model: one code path, so an on-policy ratio is exactly 1)
runs the model's backbone, then :func:`fused_rl.linear_token_logprobs` on the hidden states
of the positions whose label is not ``-100`` (log-probs and, where TRL asks for it, the
entropy, in one pass; the ``(N, V)`` logits never exist whole). TRL's semantics are kept:
the causal shift (or pre-shifted ``shift_labels``), ``-100`` labels ignored and 0 in the
output, ``loss = -sum(log_probs) / num_items_in_batch`` (the number of counted labels when
not given), the MoE load-balancing loss when the config asks for router logits, the
returned ``FusedCausalLMOutput`` fields ``loss``, ``log_probs``, ``entropy``,
``label_mask``, ``aux_loss``. The backbone and the LM head are looked up through the model
at each call, so FSDP / PEFT replacements made after construction are used. By default the
trainer's loss (``_compute_loss``) is TRL's own, fed with fused_rl's log-probs and entropies;
``GRPOTrainer(..., fused_rl_loss=True)`` / ``patch(loss=True)`` computes it, and every
metric TRL logs with it, with one :func:`fused_rl.linear_policy_loss` call from the policy's
last hidden states (every ``loss_type`` of TRL 1.16, sequence-level importance sampling,
the entropy bonus (static or adaptive), top-entropy tokens, vLLM's importance-sampling
correction, the off-policy sequence mask, the MoE load-balancing loss:
:mod:`fused_rl.integrations._trl_loss`); with it, ``fused_rl_kl_estimator="full"`` /
``patch(loss=True, kl_estimator="full")`` puts the exact per-token KL to the reference model
(over the whole vocabulary, from both models' hidden states) in place of TRL's k3 estimate.

What fused_rl cannot do raises at construction (``ValueError`` naming the option), never
a silent fall-back to TRL's head: a logit scale ``<= 0``, a ``final_logit_softcapping``
that is not a finite ``c > 0``, a fused-head output TRL 1.16 does not define, and
DeepSpeed ZeRO-3 (fused_rl's backward recomputes the logits from the ``lm_head``
weight, which ZeRO-3 has released by then). A positive logit scale (the config's
``logit_scale``, ``output_multiplier``, ``lm_head_multiplier`` or ``logits_scaling``, read
as TRL reads them) is exact: ``log_softmax(s z / T) = log_softmax(z / (T / s))``, so it
runs as the temperature ``T / s``; with Gemma 2 / 3's ``final_logit_softcapping = c``
(TRL: ``c tanh(s z / c) / T``) as the soft-cap ``c / s`` with the temperature ``T / s``.
``cast_lm_head_to_fp32=True``: the hidden states (and the head, if it is not already) go
to fp32 and the head runs outside autocast, as in TRL.

TRL 1.16's ``RLOOTrainer`` adds the same head (its policy, old policy and reference model,
whose KL enters the reward): ``from fused_rl.integrations.trl import RLOOTrainer`` (or
``patch()``) puts fused_rl's in its place, with the same checks; its loss (a clipped ratio
per sequence of summed log-probs) is TRL's, fed with fused_rl's log-probs, or with
``fused_rl_loss=True`` / ``patch(loss=True)`` one ``linear_policy_loss`` call
(:mod:`fused_rl.integrations._trl_rloo`).

TRL 1.16's ``DPOTrainer``, ``KTOTrainer`` and ``SFTTrainer`` add the same head and ask it
for per-token statistics too: ``mean_logits`` (the ``logits/*`` metrics), ``is_top1``
(``mean_token_accuracy``) and, for DPO's WPO weights, ``log_sum_sq_probs``. fused_rl's head
computes them with the log-probs and entropies from one read of each chunk's logits
(:func:`fused_rl.linear_token_stats`); ``from fused_rl.integrations.trl import DPOTrainer``
(``KTOTrainer``, ``SFTTrainer``) or ``patch()`` puts it in place, TRL's loss unchanged.

TRL 1.16's experimental ``trl.experimental.async_grpo.AsyncGRPOTrainer`` (rollouts from a
vLLM server, several completions packed into one row as a prefix tree) adds the same head
for its log-probs and entropies: ``from fused_rl.integrations.trl import AsyncGRPOTrainer``
(or ``patch()``) puts fused_rl's in its place (the packed row's pre-shifted
``shift_labels``, ``position_ids`` and tree-attention arguments go to the backbone as they
come), TRL's loss unchanged.

TRL 1.16's ``DistillationTrainer`` likewise: ``from fused_rl.integrations.trl import
DistillationTrainer`` (or ``patch()``, which wraps both trainers) computes its loss, the
divergence of the student's and the teacher's full next-token distributions, with one
:func:`fused_rl.linear_distill_loss` call in place of TRL's chunked divergence
(:mod:`fused_rl.integrations._trl_distill`).

The backend (``"auto"``, ``"triton"``, ``"reference"``: :mod:`fused_rl._backend`) and the
rows per chunk are options: ``GRPOTrainer(..., fused_rl_backend=..., fused_rl_chunk_tokens=...)``
or ``patch(backend=..., chunk_tokens=...)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Iterator

import torch

from .. import _validation as V
from .._backend import BACKENDS
from ..distributed import gather_param, is_dtensor
from ..linear import linear_token_logprobs, linear_token_stats

__all__ = [
    "AsyncGRPOTrainer",  # noqa: F822  (built on first access: __getattr__ below)
    "DistillationTrainer",  # noqa: F822
    "DPOTrainer",  # noqa: F822
    "GRPOTrainer",  # noqa: F822
    "KTOTrainer",  # noqa: F822
    "MIN_TRL_VERSION",
    "RLOOTrainer",  # noqa: F822
    "SFTTrainer",  # noqa: F822
    "add_fused_lm_head",
    "is_patched",
    "patch",
    "patched",
    "unpatch",
]

MIN_TRL_VERSION = (1, 15)
INSTALL_HINT = "pip install 'trl>=1.15'"
# the fused-head outputs fused_rl computes: all of TRL 1.16's
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# the non-differentiable ones (SFT / DPO / KTO metrics, WPO's weights): fused_rl.token_stats'
# fields of the same meaning, from the same read of each chunk's logits
DIAGNOSTICS = {"log_sum_sq_probs": "log_sum_sq_probs", "mean_logits": "mean_logit",
               "is_top1": "is_top1"}  # fmt: skip
# the config fields TRL reads as a multiplier of the logits, in its order of precedence
_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
_MARK = "_fused_rl_lm_head"  # attribute of a model whose forward this module patched
# the trainers whose log-probs come from TRL's fused head, and the TRL module of each
HEAD_TRAINERS = {
    "GRPOTrainer": "trl.trainer.grpo_trainer",
    "RLOOTrainer": "trl.trainer.rloo_trainer",
    "DPOTrainer": "trl.trainer.dpo_trainer",
    "KTOTrainer": "trl.trainer.kto_trainer",
    "SFTTrainer": "trl.trainer.sft_trainer",
    "AsyncGRPOTrainer": "trl.experimental.async_grpo.async_grpo_trainer",
}
# GRPO's KL term with fused_rl_loss=True: TRL's k3 estimate, or the exact KL
KL_ESTIMATORS = ("k3", "full")


def _trl():
    """``(trl, trl.trainer.utils)``, or an ImportError that says what to install."""
    try:
        import trl
        from trl.trainer import utils as trl_utils
    except ImportError as exc:
        raise ImportError(
            f"fused_rl.integrations.trl needs TRL >= 1.15 ({INSTALL_HINT}): {exc}"
        ) from exc
    from packaging.version import Version

    version = Version(trl.__version__)
    if version.release[:2] < MIN_TRL_VERSION or not hasattr(trl_utils, "add_fused_lm_head"):
        raise ImportError(
            f"fused_rl.integrations.trl needs TRL >= 1.15, whose trainers compute log-probs "
            f"with a fused LM head; found TRL {trl.__version__} ({INSTALL_HINT}). With "
            "TRL <= 1.14, use fused_rl.compat.trl's selective_log_softmax / entropy_from_logits"
        )
    return trl, trl_utils


def _trainer_module(name: str):
    """The TRL module that defines the head trainer ``name`` (:data:`HEAD_TRAINERS`) and
    adds its fused heads through its own ``add_fused_lm_head`` global."""
    import importlib

    trl, _ = _trl()
    where = HEAD_TRAINERS[name]
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise ImportError(f"TRL {trl.__version__} has no {name} ({where}): {exc}") from exc
    if not hasattr(module, "add_fused_lm_head") or not hasattr(module, name):
        raise ImportError(
            f"TRL {trl.__version__}'s {name} does not add a fused LM head through "
            f"{where}.add_fused_lm_head; fused_rl.integrations.trl follows TRL 1.15-1.16"
        )
    return module


@dataclasses.dataclass(frozen=True)
class Options:
    """fused_rl's choices for the head: ``backend`` as every fused_rl op takes it, and
    ``chunk_tokens`` (rows per GEMM chunk; None: ``fused_rl.linear.chunk_rows``'s default);
    for GRPO's loss, ``loss`` (one ``fused_rl.linear_policy_loss`` call) and
    ``kl_estimator`` (``"k3"``: TRL's estimate; ``"full"``: the exact KL, needs ``loss``)."""

    backend: str = "auto"
    chunk_tokens: int | None = None
    loss: bool = False  # the trainer's loss through one fused_rl.linear_policy_loss call
    kl_estimator: str = "k3"

    @classmethod
    def checked(cls, backend, chunk_tokens, prefix: str = "", loss: bool = False,
                kl_estimator: str = "k3") -> Options:  # fmt: skip
        """The options, each checked under the name the caller gave it (``prefix`` +)."""
        V.check_choice(backend, BACKENDS, prefix + "backend")
        V.check_positive_int(chunk_tokens, prefix + "chunk_tokens", allow_none=True)
        if not isinstance(loss, bool):
            raise TypeError(f"{prefix}loss must be a bool, got {loss!r}")
        V.check_choice(kl_estimator, KL_ESTIMATORS, prefix + "kl_estimator")
        if kl_estimator == "full" and not loss:
            raise ValueError(
                f"{prefix}kl_estimator='full' needs {prefix}loss=True: the exact KL is "
                "computed inside fused_rl's loss, from both models' hidden states"
            )
        chunk = None if chunk_tokens is None else int(chunk_tokens)
        return cls(backend, chunk, loss, kl_estimator)


@dataclasses.dataclass(frozen=True)
class _Head:
    """What a patched forward needs, fixed when the head is added."""

    temperature: float  # TRL's temperature divided by the config's logit scale
    softcap: float | None  # the config's final_logit_softcapping divided by the logit scale
    cast_fp32: bool
    entropy: bool
    diagnostics: tuple[str, ...]  # the DIAGNOSTICS asked for (fused_rl.linear_token_stats)
    backbone: str  # the model attribute holding the backbone
    router_logits: bool  # the config asks for router logits (MoE)
    options: Options
    original_forward: Callable  # the forward before any fused head


def logit_scale(text_config) -> tuple[float, str | None]:
    """The factor TRL's fused head multiplies the logits by, read from the model's text
    config as TRL >= 1.15 reads it, and the field it came from (None: no field, 1.0)."""
    for name in _SCALE_FIELDS:
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value), name
    value = getattr(text_config, "logits_scaling", None)
    if value is None:
        return 1.0, None
    if getattr(text_config, "model_type", None) == "hyperclovax":  # multiplies by it
        return float(value), "logits_scaling"
    if value == 0:
        raise ValueError("the model config's logits_scaling is 0: the logits are divided by it")
    return 1.0 / float(value), "logits_scaling"  # Granite, MiniCPM3: divide by it


def _check_head(model, text_config, outputs, temperature) -> tuple[float, float | None]:
    """The checks of :func:`add_fused_lm_head`, each a ``ValueError`` naming the option;
    returns the temperature and the soft-cap with the config's logit scale ``s`` folded in:
    TRL's ``c tanh(s z / c) / T`` is ``c' tanh(z / c') / (T / s)`` with ``c' = c / s``."""
    if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
        raise TypeError(f"outputs must be a tuple of field names, got {outputs!r}")
    unknown = [o for o in outputs if o not in OUTPUTS]
    if unknown:
        raise ValueError(
            f"the fused LM head was asked for outputs {unknown}: fused_rl computes "
            f"{', '.join(OUTPUTS)}"
        )
    V.check_positive(temperature, "temperature")
    scale, softcap = model_transform(text_config)
    check_not_zero3()
    _check_lm_head(model)
    return float(temperature) / scale, None if softcap is None else softcap / scale


def model_transform(text_config, whose: str = "the") -> tuple[float, float | None]:
    """The model's logit scale ``s`` and final soft cap ``c`` (None: none), as TRL reads
    them, each checked (``ValueError`` naming the config field, in ``whose`` model config):
    ``s`` finite and > 0, ``c`` finite and > 0."""
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap is not None and not (float(softcap) > 0 and float(softcap) < float("inf")):
        # TRL's kernel reads 0.0 as a cap of 1.0 (`softcap or 1.0`); a cap must be > 0 here
        raise ValueError(
            f"{whose} model config sets final_logit_softcapping={softcap}: fused_rl soft-caps "
            "at a finite c > 0 (None: no cap)"
        )
    scale, field = logit_scale(text_config)
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(
            f"{whose} model config's {field} gives a logit scale of {scale}: fused_rl applies a "
            "logit scale s > 0 only"
        )
    return scale, None if softcap is None else float(softcap)


def check_not_zero3() -> None:
    """``ValueError`` under DeepSpeed ZeRO-3: fused_rl's backward recomputes the logits from
    the lm_head weight, which ZeRO-3 has released by then."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "DeepSpeed ZeRO-3 is enabled: fused_rl's LM head recomputes the logits from the "
            "lm_head weight in its backward, where ZeRO-3 has released it; use ZeRO-2 or "
            "FSDP, or TRL's own trainer"
        )


def _backbone_attribute(model, text_config) -> str:
    """Where the backbone that returns ``last_hidden_state`` lives: ``base_model``, except
    for vision-language models before transformers 5, which keep their language backbone
    under ``model``."""
    import transformers
    from packaging.version import Version

    if text_config is not model.config and Version(transformers.__version__).major < 5:
        return "model"
    return "base_model"


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    backend: str = "auto",
    chunk_tokens: int | None = None,
) -> None:
    """``trl.trainer.utils.add_fused_lm_head`` (TRL >= 1.15) with fused_rl's head:
    ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput``
    with ``log_probs`` (and ``entropy`` if in ``outputs``) from
    :func:`fused_rl.linear_token_logprobs`, or, when ``outputs`` asks for
    ``log_sum_sq_probs``, ``mean_logits`` or ``is_top1`` (TRL 1.16), all of them from
    :func:`fused_rl.linear_token_stats` (the same read of each chunk's logits); without
    ``fused_lm_head`` the forward is the original one (generation is unchanged). Adding it
    again replaces the previous head. Raises ``ValueError`` for what fused_rl cannot do
    (module docstring)."""
    _, trl_utils = _trl()
    options = Options.checked(backend, chunk_tokens)
    text_config = model.config.get_text_config()
    head_temperature, head_softcap = _check_head(model, text_config, outputs, temperature)
    output_type = trl_utils.FusedCausalLMOutput
    fields = {f.name for f in dataclasses.fields(output_type)}
    absent = [o for o in outputs if o not in fields]
    if absent:  # TRL 1.15's output has no field for the diagnostics
        raise ValueError(
            f"the fused LM head was asked for outputs {absent}, which this TRL's "
            "FusedCausalLMOutput has no field for (TRL >= 1.16 has)"
        )
    previous = model.__dict__.get(_MARK)
    head = _Head(
        temperature=head_temperature,
        softcap=head_softcap,
        cast_fp32=bool(cast_lm_head_to_fp32),
        entropy="entropy" in outputs,
        diagnostics=tuple(o for o in DIAGNOSTICS if o in outputs),
        backbone=_backbone_attribute(model, text_config),
        router_logits=bool(getattr(text_config, "output_router_logits", False)),
        options=options,
        original_forward=model.forward if previous is None else previous.original_forward,
    )

    # the class's signature, which generate() checks its keyword arguments against
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, fused_rl_loss=None, fused_rl_hidden=False,
                **kwargs):  # fmt: skip
        if fused_rl_loss is not None:  # the trainer's loss (fused_rl_loss=True)
            return _loss_forward(self, head, args, kwargs, fused_rl_loss)
        if fused_rl_hidden:  # the reference's side of the exact KL
            return _hidden_forward(self, head, args, kwargs)
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels,
                         num_items_in_batch=num_items_in_batch)  # fmt: skip
            kwargs.update({k: v for k, v in extra.items() if v is not None})
            return head.original_forward(*args, **kwargs)
        return _fused_forward(
            self, head, output_type, args, kwargs, labels, shift_labels, num_items_in_batch
        )

    model.forward = types.MethodType(forward, model)
    setattr(model, _MARK, head)


def _head_inputs(model, head: _Head, hidden):
    """The hidden states, the LM head's weight and bias (gathered whole), and the context
    the head runs in (fp32 outside autocast under ``cast_lm_head_to_fp32``)."""
    lm_head = model.get_output_embeddings()
    weight, bias = gather_param(lm_head.weight), gather_param(lm_head.bias)
    hidden = hidden.to(weight.device)
    context = contextlib.nullcontext()
    if head.cast_fp32:
        hidden = hidden.float()
        weight = weight.float()
        bias = None if bias is None else bias.float()
        context = torch.autocast(hidden.device.type, enabled=False)
    return hidden, weight, bias, context


@dataclasses.dataclass(frozen=True)
class HeadInputs:
    """What ``model(..., fused_rl_hidden=True)`` returns: a plain object, not a tuple or a
    mapping, so that accelerate's mixed-precision forward wrapper (which converts tuples'
    and mappings' tensors to fp32) passes it through as it is."""

    hidden: torch.Tensor  # (B, S, H): the backbone's last hidden states
    weight: torch.Tensor  # (V, H): the LM head, gathered whole
    bias: torch.Tensor | None
    lm_head: torch.nn.Module  # where the weight and bias live, for ``kept``

    def kept(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias, readable after the forward has returned. FSDP2 frees the
        parameters it gathered for a forward without gradient as that forward returns (the
        reference model's head among them), so a freed one is gathered again from its
        sharded parameter, in the dtype the forward used: one more all-gather of the head,
        whose whole copy the loss holds until it returns."""
        return _kept(self.weight, self.lm_head.weight), _kept(self.bias, self.lm_head.bias)


def freed(t: torch.Tensor | None) -> bool:
    """Whether a sharding wrapper freed ``t``'s storage (resized it to 0 bytes)."""
    return t is not None and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _kept(used: torch.Tensor | None, param) -> torch.Tensor | None:
    """``used`` if its storage is still there, else ``param`` (a DTensor) gathered whole
    again, on ``used``'s device and in its dtype."""
    if not freed(used):
        return used
    if not is_dtensor(param):
        raise RuntimeError(
            f"the reference model's LM head ({tuple(used.shape)}) was freed when its forward "
            "returned and its parameter at rest is not a DTensor: fused_rl gathers it again "
            "from a DTensor (FSDP2) only; use FSDP2 (fsdp_config version 2)"
        )
    with torch.no_grad():
        whole = gather_param(param)
    return whole.to(device=used.device, dtype=used.dtype)


def _hidden_forward(model, head: _Head, args, kwargs) -> HeadInputs:
    """``model(..., fused_rl_hidden=True)``: the backbone's last hidden states and the LM
    head's weight and bias, as the loss takes them (``_head_inputs``)."""
    kwargs["use_cache"] = False
    hidden = getattr(model, head.backbone)(*args, **kwargs).last_hidden_state
    hidden, weight, bias, _ = _head_inputs(model, head, hidden)
    return HeadInputs(hidden, weight, bias, model.get_output_embeddings())


def _loss_forward(model, head: _Head, args, kwargs, request):
    """``model(..., fused_rl_loss=request)``: the backbone, then the trainer's loss from its
    last hidden states in one ``linear_policy_loss`` call (:mod:`._trl_loss`)."""
    from . import _trl_loss

    kwargs["use_cache"] = False
    backbone_out = getattr(model, head.backbone)(*args, **kwargs)
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing_loss(model, backbone_out, kwargs.get("attention_mask"))
    hidden, weight, bias, context = _head_inputs(model, head, backbone_out.last_hidden_state)
    with context:
        return _trl_loss.loss_forward(hidden, weight, bias, request, head, aux_loss)


def _fused_forward(model, head: _Head, output_type, args, kwargs, labels, shift_labels,
                   num_items_in_batch):  # fmt: skip
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
    kwargs["use_cache"] = False
    if head.router_logits:
        kwargs.setdefault("output_router_logits", True)
    backbone_out = getattr(model, head.backbone)(*args, **kwargs)
    hidden = backbone_out.last_hidden_state
    if shift_labels is None:  # position t predicts label t + 1
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:  # already shifted (context / sequence parallelism)
        targets = shift_labels
    hidden, weight, bias, context = _head_inputs(model, head, hidden)
    targets = targets.to(weight.device)
    mask = targets != -100
    fields = _head_outputs(head, hidden[mask], weight, bias, targets[mask], context)
    # scattered into zeros: the output stays connected to the model when no label counts
    fields = {k: None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v)
              for k, v in fields.items()}  # fmt: skip
    log_probs = fields["log_probs"]
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing_loss(model, backbone_out, kwargs.get("attention_mask"))
        text_config = model.config.get_text_config()
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    fields = {k: v for k, v in fields.items() if v is not None}  # TRL 1.15 has fewer fields
    return output_type(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)


def _head_outputs(head: _Head, rows, weight, bias, targets, context) -> dict:
    """The fused head's per-token fields of the ``(N, H)`` counted rows: ``log_probs``
    (and what else the head was asked for, None otherwise) from one
    ``linear_token_logprobs`` call, or ``linear_token_stats`` when a diagnostic is asked
    for (the same read of each chunk's logits). One host sync for the rows' count."""
    kw = dict(bias=bias, temperature=head.temperature, softcap=head.softcap,
              chunk_tokens=head.options.chunk_tokens, backend=head.options.backend)  # fmt: skip
    fields = dict.fromkeys(OUTPUTS)
    with context:
        if head.diagnostics:
            stats = linear_token_stats(rows, weight, targets, **kw)
            fields["log_probs"] = stats.logp
            fields["entropy"] = stats.entropy if head.entropy else None
            for name in head.diagnostics:
                fields[name] = getattr(stats, DIAGNOSTICS[name])
        elif head.entropy:
            fields["log_probs"], fields["entropy"] = linear_token_logprobs(
                rows, weight, targets, return_entropy=True, **kw
            )
        else:
            fields["log_probs"] = linear_token_logprobs(rows, weight, targets, **kw)
    return fields


def _load_balancing_loss(model, backbone_out, attention_mask):
    """The MoE load-balancing loss of the backbone's router logits (the Mixtral function
    the MoE families share), with the expert counts from the config (else the model)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = model.config.get_text_config()
    counts = []
    for names in (("num_experts", "num_local_experts"), ("num_experts_per_tok",)):
        value = next((getattr(src, n) for src in (text_config, model) for n in names
                      if getattr(src, n, None) is not None), None)  # fmt: skip
        if value is None:
            raise ValueError(f"output_router_logits: the model config has no {names[0]}")
        counts.append(value)
    return load_balancing_loss_func(backbone_out.router_logits, *counts, attention_mask)


# -- the trainer ---------------------------------------------------------------------------

_LOCK = threading.RLock()  # TRL's module global is replaced while one __init__ runs
_STATE = threading.local()  # .options: set while a fused __init__ runs on this thread
_PATCH: dict = {}  # while patched: inits ((class, TRL's __init__) pairs), options


@contextlib.contextmanager
def _fused_heads(options: Options, name: str) -> Iterator[None]:
    """While TRL's ``__init__`` of the head trainer ``name`` runs: the ``add_fused_lm_head``
    its module calls is this module's, with ``options``. An inner fused ``__init__`` on the
    same thread (the subclass calling a patched TRL ``__init__``) keeps the outer options."""
    if getattr(_STATE, "options", None) is not None:
        yield
        return
    module = _trainer_module(name)
    with _LOCK:
        previous = module.add_fused_lm_head
        module.add_fused_lm_head = functools.partial(
            add_fused_lm_head, backend=options.backend, chunk_tokens=options.chunk_tokens
        )
        _STATE.options = options
        try:
            yield
        finally:
            _STATE.options = None
            module.add_fused_lm_head = previous


def _check_installed(trainer, name: str) -> dict[str, _Head]:
    """Every model TRL gave a fused head now has fused_rl's, or a RuntimeError: a TRL that
    adds its head by another route must never run its own head silently. Returns the
    heads (``"policy"``, and ``"reference model"`` where TRL built one)."""
    from accelerate.utils import is_peft_model

    model = trainer.model
    models = {"policy": model.get_base_model() if is_peft_model(model) else model}
    if getattr(trainer, "ref_model", None) is not None:
        models["reference model"] = trainer.accelerator.unwrap_model(trainer.ref_model)
    missing = [who for who, m in models.items() if _MARK not in vars(m)]
    if missing:
        trl, _ = _trl()
        raise RuntimeError(
            f"TRL {trl.__version__} did not add its fused LM head to the {' and '.join(missing)}"
            f" through {HEAD_TRAINERS[name]}.add_fused_lm_head, so fused_rl could "
            "not replace it; fused_rl.integrations.trl follows TRL 1.15-1.16"
        )
    return {who: vars(m)[_MARK] for who, m in models.items()}


def _check_same_transform(heads: dict[str, _Head]) -> None:
    """The exact KL applies one temperature and soft cap to both models' logits: a
    reference model whose logit scale or soft cap differs from the policy's raises."""
    policy, ref = heads["policy"], heads.get("reference model")
    if ref is not None and (ref.temperature, ref.softcap) != (policy.temperature, policy.softcap):
        raise ValueError(
            "fused_rl_kl_estimator='full' needs a reference model whose logit scale and "
            "final_logit_softcapping are the policy's: temperature / scale "
            f"{ref.temperature} vs {policy.temperature}, soft cap {ref.softcap} vs "
            f"{policy.softcap}"
        )


def _fused_init(trainer, trl_init: Callable[[], None], options: Options, name: str) -> None:
    """Run TRL's ``__init__`` (``trl_init``) of the head trainer ``name`` with fused_rl's
    heads, then check them. ``options.loss`` routes the trainer's loss (GRPO's with
    ``options.kl_estimator``; RLOO's has no KL term). An inner fused ``__init__`` on the
    same thread (the subclass over a patched TRL ``__init__``) only runs TRL's: the outer
    one checks and routes, with its options."""
    if getattr(_STATE, "options", None) is not None:
        trl_init()
        return
    with _fused_heads(options, name):
        trl_init()
    heads = _check_installed(trainer, name)
    if options.loss and name == "GRPOTrainer":
        from . import _trl_loss

        if options.kl_estimator == "full":
            _check_same_transform(heads)
        _trl_loss.route(trainer, options.kl_estimator)
    elif options.loss and name == "RLOOTrainer":
        from . import _trl_rloo

        _trl_rloo.route(trainer)
    elif name not in ("GRPOTrainer", "RLOOTrainer"):  # patch(loss=True): their loss is TRL's
        options = dataclasses.replace(options, loss=False, kl_estimator="k3")
    trainer.fused_rl_options = options


def _make_trainer_class():
    trl, _ = _trl()

    class GRPOTrainer(trl.GRPOTrainer):
        """``trl.GRPOTrainer`` with every log-prob and entropy from fused_rl (the policy in
        the training step, the old policy, the reference model): same constructor and
        ``GRPOConfig``, plus four keyword-only options, ``fused_rl_backend`` (``"auto"``,
        ``"triton"``, ``"reference"``), ``fused_rl_chunk_tokens`` (rows per GEMM chunk),
        ``fused_rl_loss`` (the training loss through one ``fused_rl.linear_policy_loss``
        call) and ``fused_rl_kl_estimator`` (``"k3"``, TRL's; ``"full"``: the exact
        per-token KL to the reference model, with ``fused_rl_loss=True``). See
        :mod:`fused_rl.integrations.trl`."""

        def __init__(self, *args, fused_rl_backend: str = "auto",
                     fused_rl_chunk_tokens: int | None = None, fused_rl_loss: bool = False,
                     fused_rl_kl_estimator: str = "k3", **kwargs):  # fmt: skip
            options = Options.checked(
                fused_rl_backend, fused_rl_chunk_tokens, "fused_rl_", loss=fused_rl_loss,
                kl_estimator=fused_rl_kl_estimator,
            )  # fmt: skip
            run = lambda: super(GRPOTrainer, self).__init__(*args, **kwargs)  # noqa: E731
            _fused_init(self, run, options, "GRPOTrainer")

    GRPOTrainer.__module__ = __name__
    return GRPOTrainer


def _make_rloo_class():
    module = _trainer_module("RLOOTrainer")

    class RLOOTrainer(module.RLOOTrainer):
        """``trl.RLOOTrainer`` with every log-prob and entropy from fused_rl (the policy in
        the training step, the old policy, the reference model whose KL enters the reward):
        same constructor and ``RLOOConfig``, plus ``fused_rl_backend``,
        ``fused_rl_chunk_tokens`` and ``fused_rl_loss`` (TRL's loss, a clipped ratio per
        sequence of its summed log-probs, through one ``fused_rl.linear_policy_loss`` call:
        :mod:`fused_rl.integrations._trl_rloo`). See :mod:`fused_rl.integrations.trl`."""

        def __init__(self, *args, fused_rl_backend: str = "auto",
                     fused_rl_chunk_tokens: int | None = None, fused_rl_loss: bool = False,
                     **kwargs):  # fmt: skip
            options = Options.checked(
                fused_rl_backend, fused_rl_chunk_tokens, "fused_rl_", loss=fused_rl_loss
            )
            run = lambda: super(RLOOTrainer, self).__init__(*args, **kwargs)  # noqa: E731
            _fused_init(self, run, options, "RLOOTrainer")

    RLOOTrainer.__module__ = __name__
    return RLOOTrainer


def _make_head_class(name: str):
    """``name`` (``DPOTrainer``, ``KTOTrainer``, ``SFTTrainer``, ``AsyncGRPOTrainer``):
    TRL's trainer with fused_rl's head, TRL's loss, and the options ``fused_rl_backend`` /
    ``fused_rl_chunk_tokens``."""
    module = _trainer_module(name)
    base = getattr(module, name)

    def __init__(self, *args, fused_rl_backend: str = "auto",
                 fused_rl_chunk_tokens: int | None = None, **kwargs):  # fmt: skip
        options = Options.checked(fused_rl_backend, fused_rl_chunk_tokens, "fused_rl_")
        run = lambda: base.__init__(self, *args, **kwargs)  # noqa: E731
        _fused_init(self, run, options, name)

    where = module.__name__.rsplit(".", 1)[0]  # trl.trainer, trl.experimental.async_grpo
    doc = (
        f"``{where}.{name}`` with every log-prob, entropy and logged per-token statistic its "
        "head computes (DPO, KTO, SFT: the mean logit, top-1 accuracy, WPO's ``log sum "
        "p^2``) from fused_rl's head (``fused_rl.linear_token_logprobs`` / "
        "``linear_token_stats``: one read of each chunk's logits), for the policy and the "
        "reference model where there is one; TRL's loss. Same constructor and config, plus "
        "``fused_rl_backend`` and ``fused_rl_chunk_tokens``. See "
        ":mod:`fused_rl.integrations.trl`."
    )
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


def _check_distill_models(trainer) -> None:
    """The checks of :func:`add_fused_lm_head` that apply to the student and the teacher
    (their logit scale and soft cap, an lm_head weight, no ZeRO-3), at construction."""
    from accelerate.utils import is_peft_model

    check_not_zero3()
    model = trainer.model
    models = {"student": model.get_base_model() if is_peft_model(model) else model}
    if getattr(trainer, "teacher_model", None) is not None:
        models["teacher"] = trainer.accelerator.unwrap_model(trainer.teacher_model)
    for who, m in models.items():
        model_transform(m.config.get_text_config(), f"the {who}'s")
        _check_lm_head(m)


def _check_lm_head(model) -> None:
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head) weight")


def _fused_distill_init(trainer, trl_init: Callable[[], None], options: Options) -> None:
    """Run TRL's ``DistillationTrainer.__init__`` (``trl_init``), check both models, and
    route the loss (:mod:`._trl_distill`). An inner fused ``__init__`` on the same thread
    (the subclass over a patched ``trl.DistillationTrainer``) only runs TRL's: the outer one
    routes, with its options. A subclass that computes its loss its own way (its own
    ``compute_loss`` / ``_compute_loss``: TRL's server distillation) is left as it is, with a
    warning."""
    import warnings

    from . import _trl_distill

    if getattr(_STATE, "distill_init", False):
        trl_init()
        return
    _STATE.distill_init = True
    try:
        trl_init()
    finally:
        _STATE.distill_init = False
    base, cls = _trl_distill._module().DistillationTrainer, type(trainer)
    if cls.compute_loss is not base.compute_loss or cls._compute_loss is not base._compute_loss:
        warnings.warn(
            f"{cls.__name__} computes its loss with its own compute_loss / _compute_loss: "
            "fused_rl does not route it (trl.DistillationTrainer's loss path only)",
            stacklevel=3,
        )
        return
    _check_distill_models(trainer)
    _trl_distill.route_compute_loss(trainer, options)
    trainer.fused_rl_options = options


def _make_distill_class():
    from . import _trl_distill

    class DistillationTrainer(_trl_distill._module().DistillationTrainer):
        """``trl.DistillationTrainer`` (TRL >= 1.16) with its loss, the divergence between
        the student's and the teacher's full next-token distributions, from one
        ``fused_rl.linear_distill_loss`` call: same constructor and ``DistillationConfig``,
        plus ``fused_rl_backend`` and ``fused_rl_chunk_tokens``. See
        :mod:`fused_rl.integrations._trl_distill`."""

        def __init__(self, *args, fused_rl_backend: str = "auto",
                     fused_rl_chunk_tokens: int | None = None, **kwargs):  # fmt: skip
            options = Options.checked(fused_rl_backend, fused_rl_chunk_tokens, "fused_rl_")
            run = lambda: super(DistillationTrainer, self).__init__(*args, **kwargs)  # noqa: E731
            _fused_distill_init(self, run, options)

    DistillationTrainer.__module__ = __name__
    return DistillationTrainer


_BUILDERS = {
    "GRPOTrainer": _make_trainer_class,
    "RLOOTrainer": _make_rloo_class,
    "DistillationTrainer": _make_distill_class,
    **{
        name: functools.partial(_make_head_class, name)
        for name in ("DPOTrainer", "KTOTrainer", "SFTTrainer", "AsyncGRPOTrainer")
    },
}


def __getattr__(name: str):
    # the trainers subclass TRL's: built on first use, so importing this module needs no TRL
    if name in _BUILDERS:
        cls = _BUILDERS[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def patch(*, backend: str = "auto", chunk_tokens: int | None = None, loss: bool = False,
          kl_estimator: str = "k3") -> None:  # fmt: skip
    """Make ``trl.GRPOTrainer``, ``trl.RLOOTrainer``, ``trl.DPOTrainer``,
    ``trl.KTOTrainer``, ``trl.SFTTrainer``, ``trl.DistillationTrainer`` and
    ``trl.experimental.async_grpo.AsyncGRPOTrainer`` themselves (and every subclass, for
    scripts and TRL's CLI that construct them) behave as this module's trainers of the same
    names with these options: their ``__init__`` is wrapped (each trainer but GRPO's where
    the installed TRL has it and gives it a fused head, and ``DistillationTrainer`` where it
    has it: TRL >= 1.16). Idempotent (patching again only
    updates the options); :func:`unpatch` restores TRL's ``__init__`` exactly. Trainers
    constructed before keep their head and loss. ``loss=True``: GRPO's and RLOO's training
    loss (not DPO's, KTO's or SFT's: TRL's) through one ``fused_rl.linear_policy_loss`` call
    (the distillation trainer's is always fused_rl's), and with it ``kl_estimator="full"``:
    GRPO's KL term exact (RLOO's KL is in its reward, which it leaves alone)."""
    options = Options.checked(backend, chunk_tokens, loss=loss, kl_estimator=kl_estimator)
    trl, _ = _trl()
    with _LOCK:
        if _PATCH:
            _PATCH["options"] = options
            return
        wraps = [(trl.GRPOTrainer, functools.partial(_fused_init, name="GRPOTrainer"))]
        for name in HEAD_TRAINERS:
            if name == "GRPOTrainer":
                continue
            try:
                cls = getattr(_trainer_module(name), name)
            except ImportError:  # a TRL whose trainer `name` has no fused head
                continue
            wraps.append((cls, functools.partial(_fused_init, name=name)))
        try:
            from . import _trl_distill

            wraps.append((_trl_distill._module().DistillationTrainer, _fused_distill_init))
        except ImportError:  # a TRL without the distillation trainer
            pass
        _PATCH.update(inits=[], options=options)
        for cls, fused in wraps:
            original = cls.__dict__["__init__"]
            cls.__init__ = _patched_init(original, fused)
            _PATCH["inits"].append((cls, original))


def _patched_init(original, fused):
    """``original`` (a TRL trainer's ``__init__``) run through ``fused`` with the options
    :func:`patch` holds at construction."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        run = lambda: original(self, *args, **kwargs)  # noqa: E731
        fused(self, run, _PATCH.get("options", Options()))

    return __init__


def unpatch() -> None:
    """Undo :func:`patch` (nothing to do if not patched)."""
    with _LOCK:
        if not _PATCH:
            return
        for cls, original in _PATCH["inits"]:
            cls.__init__ = original
        _PATCH.clear()
        from . import _trl_distill

        _trl_distill.uninstall()  # a fused trainer's loss call installs it again


def is_patched() -> bool:
    return bool(_PATCH)


@contextlib.contextmanager
def patched(*, backend: str = "auto", chunk_tokens: int | None = None, loss: bool = False,
            kl_estimator: str = "k3") -> Iterator[None]:  # fmt: skip
    """:func:`patch` for the block; on exit the previous state (unpatched, or patched with
    the previous options) comes back."""
    with _LOCK:
        before = _PATCH.get("options")
        patch(backend=backend, chunk_tokens=chunk_tokens, loss=loss, kl_estimator=kl_estimator)
    try:
        yield
    finally:
        with _LOCK:
            if before is None:
                unpatch()
            else:
                _PATCH["options"] = before
