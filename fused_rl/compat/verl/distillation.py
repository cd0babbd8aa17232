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
the overlap diagnostic (no gradient) needs only the value that ranks K-th in each student
row, found by a streamed radix select (``fused_rl._select_ops.kth_largest``: 2 reads of a
bf16 row, 4 of fp32, 4 bytes written a row) where verl's ``torch.topk`` selects and writes
K values and K ids a row.

verl's Megatron path (``verl.trainer.distillation.megatron.losses``: the student's logits
split over the vocabulary across the tensor-parallel ranks) materialises each shard's fp32
log-softmax and softmax; :func:`compute_forward_kl_topk_megatron` streams each shard as
above (``fused_rl.distributed.sharded_logprobs_k``: three all-reduces forward, none
backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from ..._backend import resolve_backend
from ..._select_ops import kth_largest
from ...distributed import group_shard, sharded_kth_largest, sharded_logprobs_k
from .._checks import check_index_range, checked_logprobs_k
from .core_algos import _config_value

__all__ = ["compute_forward_kl_topk", "compute_forward_kl_topk_megatron"]

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


def _checked(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format,
             vocab: int) -> tuple[float | None, int]:  # fmt: skip
    """The argument checks of both functions (``vocab``: the global vocabulary size);
    returns the clamp and ``K``."""
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
    if k > vocab:  # verl's torch.topk of the student raises there
        raise ValueError(
            f"teacher_topk_ids holds K = {k} ids a position, more than the student's vocabulary "
            f"V = {vocab} (the overlap diagnostic ranks the student's top K)"
        )
    check_index_range(teacher_topk_ids, vocab, "teacher_topk_ids", _ORIGINAL)
    return clamp, k


def _overlap(token_kl: Tensor, id_logits: Tensor, kth: Tensor) -> tuple[Tensor, Tensor]:
    """verl's diagnostics from the teacher's ids' logits ``(..., K)`` and the student's K-th
    largest ``(...)``: the count of the ids among the student's top K (a logit at least the
    K-th largest) and the mean of ``-token_kl`` over them (0 where none). A student row
    holding a NaN (``kth`` NaN) ranks nothing: count 0, mean NaN (as its loss)."""
    overlap = id_logits.to(kth.dtype) >= kth.unsqueeze(-1)
    overlap_count = overlap.sum(-1)
    advantage = (-token_kl.detach() * overlap).sum(-1) / overlap_count.clamp_min(1)
    advantage = torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage))
    return overlap_count, torch.where(kth.isnan(), float("nan"), advantage)


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
    the student's own top K (the ids whose logit is at least the row's K-th largest, verl's
    ranking by ``torch.topk`` of the logits) and the mean of ``-exp(lt_k) (lt_k - ls_k)``
    over them (a teacher id whose logit ties the student's K-th largest counts:
    ``torch.topk`` keeps an arbitrary one of tied values); a student row holding a NaN
    ranks nothing: an overlap count of 0 and a NaN mean, as its loss (verl's
    ``torch.topk`` ranks NaN above every number).

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
    clamp, k = _checked(student_logits, teacher_topk_log_probs, teacher_topk_ids, config,
                        data_format, student_logits.shape[-1])  # fmt: skip
    student = checked_logprobs_k(student_logits, teacher_topk_ids)  # fp32, (bsz, seqlen, K)
    teacher = teacher_topk_log_probs.float()
    student_mass = student.exp().sum(-1).to(student_logits.dtype)
    teacher_mass = teacher_topk_log_probs.exp().sum(-1)
    if clamp is not None:
        student, teacher = student.clamp_min(clamp), teacher.clamp_min(clamp)
    token_kl = teacher.exp() * (teacher - student)
    with torch.no_grad():  # verl's diagnostics: the teacher's ids among the student's top K
        logits = student_logits.detach()
        kth = kth_largest(logits, k)  # streamed: no (N, K) values and ids, no (N, K, K) test
        id_logits = logits.gather(-1, teacher_topk_ids.long())
        overlap_count, advantage = _overlap(token_kl, id_logits, kth)
    return {
        "distillation_losses": token_kl.sum(-1),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": overlap_count,
        "overlap_token_advantage": advantage,
    }


def _megatron_split(teacher_topk_log_probs: Tensor, teacher_topk_ids: Tensor, data_format: str):
    """verl's Megatron context-parallel packing of the teacher's nested ``(bsz, seqlen, K)``
    tensors (``preprocess_thd_engine`` / ``preprocess_bshd_engine``, verl's own, so the rows
    line up with the student's); plain tensors are taken as they are."""
    if not (teacher_topk_log_probs.is_nested or teacher_topk_ids.is_nested):
        return teacher_topk_log_probs, teacher_topk_ids
    try:
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
    except ImportError as exc:
        raise ImportError(
            "nested teacher tensors are packed by verl's Megatron preprocessing "
            f"(verl.models.mcore.util, needs verl >= 0.9.1 and Megatron-Core): {exc}"
        ) from exc
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    return split(teacher_topk_log_probs, pre_process=True)[0], split(
        teacher_topk_ids, pre_process=True
    )[0]


def _tensor_parallel_group():
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise ImportError(
            "compute_forward_kl_topk_megatron takes Megatron's tensor-parallel group "
            f"(megatron.core.parallel_state) unless process_group= is given: {exc}"
        ) from exc
    return parallel_state.get_tensor_model_parallel_group()


def compute_forward_kl_topk_megatron(
    student_logits: Tensor,
    teacher_topk_log_probs: Tensor,
    teacher_topk_ids: Tensor,
    config,
    data_format: str = "thd",
    *,
    process_group=None,
) -> dict[str, Tensor]:
    """Mirrors ``verl.trainer.distillation.megatron.losses.compute_forward_kl_topk`` (verl
    0.9.1): :func:`compute_forward_kl_topk` with the student's logits split over the
    vocabulary across the tensor-parallel ranks.

    Args:
        student_logits: this rank's ``(bsz, seqlen, V / tp)`` shard (rank ``r`` holds the
            global ids ``[r V / tp, (r + 1) V / tp)``, Megatron's layout; every column is a
            token of the softmax, padding included, as in verl), any float dtype.
        teacher_topk_log_probs, teacher_topk_ids: the same on every rank: verl's nested
            ``(bsz, seqlen, K)`` tensors, packed by verl's own Megatron preprocessing
            (context-parallel split included), or plain tensors already lined up with
            ``student_logits``' ``(bsz, seqlen)``; global ids in ``[0, V)``.
        config, data_format: as :func:`compute_forward_kl_topk`.
        process_group: the vocabulary's group; None: Megatron's tensor-model-parallel group.

    Returns:
        verl's Megatron dict, each ``(bsz, seqlen)`` and the same on every rank:
        ``distillation_losses`` (fp32, differentiable: each rank's gradient is its shard of
        the whole), and, as verl's Megatron function (unlike its FSDP one), the two masses
        of the CLAMPED log-probs in fp32, ``overlap_count`` and ``overlap_token_advantage``
        (the teacher's ids whose logit is at least the student's global K-th largest).

    Cost: the student's log-probs at the teacher's ids by one read of each shard forward
    (three all-reduces: the row max and the rescaled sum, 8 bytes a token in fp32, and the
    ids' logits, ``4 K``) and one read and write backward (no collective), where verl
    writes each shard's fp32 log-softmax and softmax (``8 V / tp`` bytes a token) and keeps
    the softmax for its backward; the overlap diagnostic's K-th largest is a radix select
    over the shards (``fused_rl.distributed.sharded_kth_largest``: two more reads of a bf16
    shard, four of fp32, and one all-reduce of 257 int32 a token a read), where verl sorts
    each shard's top K and gathers ``K`` values and ``K`` ids a token from every rank.
    """
    teacher_topk_log_probs, teacher_topk_ids = _megatron_split(
        teacher_topk_log_probs, teacher_topk_ids, data_format
    )
    V.check_logits(student_logits, "student_logits")
    group = _tensor_parallel_group() if process_group is None else process_group
    shard = group_shard(group, student_logits.shape[-1], None, None, name="student_logits")
    clamp, k = _checked(student_logits, teacher_topk_log_probs, teacher_topk_ids, config,
                        data_format, shard.vocab_size)  # fmt: skip
    which = resolve_backend("auto", student_logits, teacher_topk_ids)
    counted = torch.ones(teacher_topk_ids.shape[:-1], dtype=torch.bool,
                         device=student_logits.device)  # fmt: skip
    student, id_logits = sharded_logprobs_k(student_logits, teacher_topk_ids, counted, shard,
                                            which=which)  # fmt: skip
    teacher = teacher_topk_log_probs.float()
    if clamp is not None:
        student, teacher = student.clamp_min(clamp), teacher.clamp_min(clamp)
    token_kl = teacher.exp() * (teacher - student)
    with torch.no_grad():  # the student's global K-th largest, the shards' histograms summed
        kth = sharded_kth_largest(student_logits, k, shard, which=which)
        overlap_count, advantage = _overlap(token_kl, id_logits, kth)
    return {
        "distillation_losses": token_kl.sum(-1),
        "student_mass": student.detach().exp().sum(-1),
        "teacher_mass": teacher.exp().sum(-1),
        "overlap_count": overlap_count,
        "overlap_token_advantage": advantage,
    }
