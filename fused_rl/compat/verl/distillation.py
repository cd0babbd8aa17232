"""verl 0.9's top-k distillation loss, streamed: ``compute_forward_kl_topk``.

verl's on-policy distillation (``distillation_loss.loss_mode="forward_kl_topk"``) scores the
student on the teacher's top-k tokens: per token ``sum_k p_k (log p_k - log q_k)`` with
``log p_k`` the teacher's top-k log-probs (as the teacher sent them, not renormalised) and
``log q_k`` the student's full-vocabulary log-probs at the teacher's ids, both clamped below
at ``log_prob_min_clamp``. verl's FSDP path (``verl.trainer.distillation.fsdp.losses``) takes
the student's ``(1, N, V)`` log-softmax in the logits' dtype (or, with ``use_chunked_topk``,
an fp32 log-sum-exp chunk by chunk) and its backward writes the ``(N, V)`` softmax again.
Here the student's ``K`` log-probs come from one read of the logits forward and one read and
write backward (:class:`fused_rl._vocab_ops.MultiTargetLogprobs`), in fp32, whatever ``K``;
the overlap diagnostic's top K (no gradient) reads the logits once more, as verl's does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from .._checks import check_index_range, checked_logprobs_k
from .core_algos import _config_value

__all__ = ["compute_forward_kl_topk"]

_ORIGINAL = "verl's compute_forward_kl_topk"


def _ulysses_slice(*tensors: Tensor) -> tuple[Tensor, ...]:
    """verl's Ulysses sequence-parallel split of ``(bsz, seqlen, K)`` tensors along the
    sequence (a no-op without sequence parallelism, or without verl)."""
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
    except ImportError:
        return tensors
    if get_ulysses_sequence_parallel_world_size() <= 1:
        return tensors
    return tuple(slice_input_tensor(t, dim=1) for t in tensors)


def compute_forward_kl_topk(
    student_logits: Tensor,
    teacher_topk_log_probs: Tensor,
    teacher_topk_ids: Tensor,
    config,
    data_format: str = "thd",
) -> dict[str, Tensor]:
    """Mirrors ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`` (verl 0.9.1):
    the forward KL from the teacher's top-k log-probs, per token.

    Per token, with ``lt_k`` the teacher's log-probs and ``ls_k`` the student's
    full-vocabulary log-probs at the teacher's ids ``id_k``, each clamped below at
    ``config.distillation_loss.log_prob_min_clamp`` (None: not clamped):
    ``loss = sum_k exp(lt_k) (lt_k - ls_k)``. The diagnostics as verl's: the two top-k masses
    ``sum_k exp(ls_k)`` / ``sum_k exp(lt_k)`` (unclamped), the count of the teacher's ids among
    the student's own top K (``torch.topk`` of the logits, as verl's ranking) and the mean of
    ``-exp(lt_k) (lt_k - ls_k)`` over them (a teacher id whose logit ties the student's
    K-th largest counts: ``torch.topk`` keeps an arbitrary one of tied values).

    Args:
        student_logits: ``(bsz, seqlen, V)`` (verl: ``(1, total_nnz, V)``), any float dtype.
        teacher_topk_log_probs: ``(bsz, seqlen, K)`` float, or verl's nested (jagged) tensor,
            whose values are taken as ``(1, total_nnz, K)``.
        teacher_topk_ids: the ids ``(bsz, seqlen, K)`` (or nested), int32 / int64 in
            ``[0, V)``.
        config: verl's ``DistillationConfig`` (or any object / mapping with
            ``distillation_loss.log_prob_min_clamp``).
        data_format: ``"thd"`` or ``"bshd"``, accepted as verl does (neither changes the math).

    Returns:
        ``{"distillation_losses", "student_mass", "teacher_mass", "overlap_count",
        "overlap_token_advantage"}``, each ``(bsz, seqlen)``; the loss fp32 and
        differentiable w.r.t. ``student_logits``.

    Departures from verl: the student's log-probs are computed in fp32 and never held as a
    ``(N, V)`` tensor (verl's default path rounds them to the logits' dtype, bf16, first), so
    the loss is not verl's bit for bit in bf16; an id outside ``[0, V)`` raises
    ``ValueError`` in eager mode (verl's ``gather`` raises ``RuntimeError``).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import compute_forward_kl_topk
        >>> logits = torch.randn(1, 3, 10, requires_grad=True)
        >>> ids = torch.tensor([[[0, 1], [2, 3], [4, 5]]])
        >>> teacher = torch.log(torch.tensor([0.6, 0.3]).expand(1, 3, 2))
        >>> cfg = {"distillation_loss": {"log_prob_min_clamp": -10.0}}
        >>> out = compute_forward_kl_topk(logits, teacher, ids, cfg)
        >>> out["distillation_losses"].sum().backward()
        >>> out["distillation_losses"].shape, logits.grad.shape
        (torch.Size([1, 3]), torch.Size([1, 3, 10]))
    """
    if teacher_topk_log_probs.is_nested:
        teacher_topk_log_probs = teacher_topk_log_probs.values().unsqueeze(0)
    if teacher_topk_ids.is_nested:
        teacher_topk_ids = teacher_topk_ids.values().unsqueeze(0)
    teacher_topk_log_probs, teacher_topk_ids = _ulysses_slice(
        teacher_topk_log_probs, teacher_topk_ids
    )
    V.check_logits(student_logits, "student_logits")
    V.check_float(teacher_topk_log_probs, "teacher_topk_log_probs")
    V.check_tensor(teacher_topk_ids, "teacher_topk_ids")
    if teacher_topk_ids.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"teacher_topk_ids must be int64 or int32, got {teacher_topk_ids.dtype}")
    lead = tuple(student_logits.shape[:-1])
    if student_logits.dim() != 3 or tuple(teacher_topk_ids.shape[:-1]) != lead:
        raise ValueError(
            f"student_logits must be (bsz, seqlen, V) and teacher_topk_ids (bsz, seqlen, K) with "
            f"the same (bsz, seqlen), got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_topk_ids.shape)}"
        )
    V.check_shape(teacher_topk_log_probs, teacher_topk_ids.shape, "teacher_topk_log_probs",
                  "teacher_topk_ids.shape")  # fmt: skip
    V.check_same_device(student_logits=student_logits, teacher_topk_ids=teacher_topk_ids,
                        teacher_topk_log_probs=teacher_topk_log_probs)  # fmt: skip
    if data_format not in ("thd", "bshd"):
        raise ValueError(f"data_format must be 'thd' or 'bshd', got {data_format!r}")
    clamp = _config_value(_config_value(config, "distillation_loss"), "log_prob_min_clamp", None)
    k = teacher_topk_ids.shape[-1]
    if k > student_logits.shape[-1]:  # verl's torch.topk of the student raises there
        raise ValueError(
            f"teacher_topk_ids holds K = {k} ids a position, more than the student's vocabulary "
            f"V = {student_logits.shape[-1]} (the overlap diagnostic ranks the student's top K)"
        )
    check_index_range(teacher_topk_ids, student_logits.shape[-1], "teacher_topk_ids", _ORIGINAL)

    student = checked_logprobs_k(student_logits, teacher_topk_ids)  # fp32, (bsz, seqlen, K)
    teacher = teacher_topk_log_probs.float()
    student_mass = student.exp().sum(-1).to(student_logits.dtype)
    teacher_mass = teacher_topk_log_probs.exp().sum(-1)
    if clamp is not None:
        student, teacher = student.clamp_min(clamp), teacher.clamp_min(clamp)
    token_kl = teacher.exp() * (teacher - student)
    with torch.no_grad():  # verl's diagnostics: the teacher's ids among the student's top K
        logits = student_logits.detach()
        kth = torch.topk(logits, k=k, dim=-1).values[..., -1:]  # no (N, K, K) comparison
        overlap = logits.gather(-1, teacher_topk_ids.long()) >= kth
        overlap_count = overlap.sum(-1)
        advantage = (-token_kl.detach() * overlap).sum(-1) / overlap_count.clamp_min(1)
        advantage = torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage))
    return {
        "distillation_losses": token_kl.sum(-1),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": overlap_count,
        "overlap_token_advantage": advantage,
    }
