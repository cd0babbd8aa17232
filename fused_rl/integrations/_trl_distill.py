"""TRL's ``DistillationTrainer`` (TRL >= 1.16), its loss from ``linear_distill_loss``.

TRL's trainer runs both backbones, then hands the last hidden states of the student and the
teacher, both ``lm_head`` weights (and biases), the completion mask, ``beta``,
``num_items_in_batch``, each model's logit scale and final soft cap and the temperature to
the module-level ``trl.trainer.distillation_trainer._chunked_divergence_loss``, which
returns ``(loss, entropy_sum, n_valid)``. For a fused trainer that call runs
:func:`divergence_loss` instead: the same arguments, the same three results, through one
``linear_distill_loss`` call (the divergence of both models' full next-token distributions
and the student's entropy from one pass over each chunk's logits, the ``(N, V)`` logits of
neither model ever whole).

The semantics are TRL's: ``beta`` 0 the forward KL(teacher || student), 1 the reverse KL,
between them the generalized JSD; each model's logits ``c tanh(s x / c) / T`` (its own
scale ``s`` and cap ``c``, the shared temperature ``T``); only positions where the
completion mask is nonzero are projected (one host sync for their count, as TRL's compact
path); ``loss = sum / num_items_in_batch``, or over the valid count (at least 1: a rank
with no completion token gives 0); the entropy of the student's tempered distribution,
summed over the valid positions. The hidden states and heads run in the autocast dtype
(else each model's hidden states'), as TRL projects them, and the chunk logits stay in fp32
(``logits_dtype=torch.float32``: the GEMMs' fp32 accumulators, as TRL's fp32 tiles); under
autocast wider (fp32) hidden states and heads get fp32-accumulated gradients and the biases
are added unrounded, as TRL's.

The route: the trainer's ``_compute_loss`` runs TRL's own with this module's function in
place of ``_chunked_divergence_loss`` for the call (a thread-local switch; another trainer
calling it meanwhile gets TRL's), and raises ``RuntimeError`` if TRL computed the loss
without calling it (a TRL whose trainer no longer goes through that function must never
train with TRL's loss silently).
"""

from __future__ import annotations

import threading

import torch

from ..distributed import gather_param
from ..linear_distill import linear_distill_loss

_ROUTE = threading.local()  # .options while a fused trainer computes its loss on this thread
_LOCK = threading.Lock()
_ORIGINAL: list = []  # TRL's _chunked_divergence_loss, recorded once by install()


def _module():
    """``trl.trainer.distillation_trainer``, or an ImportError naming what to install."""
    try:
        from trl.trainer import distillation_trainer
    except ImportError as exc:
        raise ImportError(
            f"fused_rl's DistillationTrainer needs TRL >= 1.16 (pip install 'trl>=1.16'): {exc}"
        ) from exc
    if not hasattr(distillation_trainer, "_chunked_divergence_loss"):
        raise ImportError(
            "fused_rl's DistillationTrainer follows TRL 1.16, whose DistillationTrainer "
            "computes its loss with trl.trainer.distillation_trainer._chunked_divergence_loss;"
            " the installed TRL has no such function"
        )
    return distillation_trainer


def divergence_loss(
    options,
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments after ``options``, same
    results) through :func:`fused_rl.linear_distill_loss` (module docstring).

    Shapes: ``(B, K, H_s)`` / ``(B, K, H_t)`` hidden states, ``(V, H_s)`` / ``(V, H_t)``
    heads, ``(B, K)`` completion mask. Returns the 0-dim loss, the student's entropy summed
    over the valid positions (detached) and their count (int64 0-dim)."""
    weight, bias = gather_param(student_lm_head_weight), gather_param(student_lm_head_bias)
    t_weight, t_bias = gather_param(teacher_lm_head_weight), gather_param(teacher_lm_head_bias)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    rows = valid.nonzero().squeeze(1)  # the one host sync (the count of valid positions)
    hidden = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[rows]
    t_hidden = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[rows]
    hidden, weight, bias = _in_compute_dtype(hidden, weight, bias)
    t_hidden, t_weight, t_bias = _in_compute_dtype(t_hidden, t_weight, t_bias)
    if num_items_in_batch is None:
        num_items = n_valid.clamp(min=1)  # a rank with no valid position: 0, not 0 / 0
    elif isinstance(num_items_in_batch, torch.Tensor):
        num_items = num_items_in_batch.to(hidden.device)
    else:
        num_items = num_items_in_batch
    loss, metrics = linear_distill_loss(
        hidden, weight, t_hidden.detach(), t_weight.detach(),
        bias=bias, teacher_bias=None if t_bias is None else t_bias.detach(), beta=beta,
        **_transforms(student_logit_scale, teacher_logit_scale,
                      student_final_logit_softcapping, teacher_final_logit_softcapping,
                      temperature),
        loss_agg="token-mean", num_items=num_items, chunk_tokens=options.chunk_tokens,
        logits_dtype=torch.float32, backend=options.backend,
    )  # fmt: skip
    entropy_sum = metrics["student_entropy"] * n_valid  # the metric: a mean over the valid
    return loss, entropy_sum, n_valid


def _in_compute_dtype(hidden, weight, bias):
    """The rows and the head in the dtype TRL projects in: autocast's where it is on (left
    to ``linear_distill_loss``'s own autocast cast: wider hidden states and head get their
    fp32-accumulated gradients and the bias is added unrounded, as TRL's), else the hidden
    states' (a wider head cast down: its gradient rounded to that dtype)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = hidden.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _transforms(s_scale, t_scale, s_cap, t_cap, temperature) -> dict:
    """``linear_distill_loss``'s keywords for TRL's per-model ``c tanh(s x / c) / T``."""
    return dict(
        temperature=float(temperature), logit_scale=float(s_scale),
        teacher_logit_scale=float(t_scale), softcap=None if s_cap is None else float(s_cap),
        teacher_softcap=None if t_cap is None else float(t_cap),
    )  # fmt: skip


def _dispatch(*args, **kwargs):
    """What TRL's module calls: fused_rl's loss while a fused trainer's ``_compute_loss``
    runs on this thread, TRL's own otherwise."""
    options = getattr(_ROUTE, "options", None)
    if options is None:
        return _ORIGINAL[0](*args, **kwargs)
    _ROUTE.calls += 1
    return divergence_loss(options, *args, **kwargs)


def install() -> None:
    """Put :func:`_dispatch` in place of TRL's ``_chunked_divergence_loss``: where the module
    holds TRL's own function (recorded once, on first use). Idempotent; a function someone
    else put there is left alone (a fused trainer then raises at its first step if its loss
    did not reach fused_rl)."""
    module = _module()
    with _LOCK:
        if not _ORIGINAL:
            _ORIGINAL.append(module._chunked_divergence_loss)
        if module._chunked_divergence_loss is _ORIGINAL[0]:
            module._chunked_divergence_loss = _dispatch


def uninstall() -> None:
    """Restore TRL's function where :func:`_dispatch` is in its place (else nothing)."""
    with _LOCK:
        if _ORIGINAL:
            module = _module()
            if module._chunked_divergence_loss is _dispatch:
                module._chunked_divergence_loss = _ORIGINAL[0]


def route_compute_loss(trainer, options) -> None:
    """Bind the trainer's ``_compute_loss``: TRL's own, run with fused_rl's loss function
    (``options``)."""
    import types

    trainer._fused_rl_trl_compute_loss = trainer._compute_loss
    trainer._fused_rl_route_options = options
    trainer._compute_loss = types.MethodType(_compute_loss, trainer)


def _compute_loss(self, *args, **kwargs):
    """A routed trainer's ``_compute_loss`` (:func:`route_compute_loss`)."""
    install()  # again: an unpatch() since construction may have restored TRL's
    previous = getattr(_ROUTE, "options", None), getattr(_ROUTE, "calls", 0)
    _ROUTE.options, _ROUTE.calls = self._fused_rl_route_options, 0
    try:
        out = self._fused_rl_trl_compute_loss(*args, **kwargs)
        calls = _ROUTE.calls
    finally:
        _ROUTE.options, _ROUTE.calls = previous
    if calls == 0:
        raise RuntimeError(
            "DistillationTrainer._compute_loss did not call "
            "trl.trainer.distillation_trainer._chunked_divergence_loss, so fused_rl could "
            "not compute the loss; fused_rl's DistillationTrainer follows TRL 1.16"
        )
    return out
