"""Drop-in replacements for TRL's vocabulary-sized helpers, fused.

Change ``from trl.trainer.utils import selective_log_softmax, entropy_from_logits`` to
``from fused_rl.compat.trl import selective_log_softmax, entropy_from_logits``. TRL is not
imported (nor needed). :func:`generalized_jsd_loss` mirrors the static method
``GKDTrainer.generalized_jsd_loss`` of ``trl/experimental/gkd/gkd_trainer.py`` (TRL 1.16);
its own docstring says what it keeps and what differs.

Mirrors ``trl/trainer/utils.py`` of TRL >= 1.14 (1.16 current):
``selective_log_softmax(logits, index, temperature=1.0, row_mask=None)``, with its
``(..., K)`` index, and ``entropy_from_logits(logits, chunk_size=128)``. Callers of the
older two-argument ``selective_log_softmax(logits, index)`` get what they always got.

What TRL does, and so the adapter does:

* ``temperature`` divides the logits before the log-softmax (``ValueError`` unless ``> 0``).
* ``row_mask`` (``index``'s shape, or one that broadcasts to it; any dtype): entries where
  ``row_mask == 0`` give exactly 0, with exactly 0 gradient.
* Return dtype: ``logits.dtype``, except where TRL runs its own Triton kernel, which returns
  fp32 (logits on CUDA / XPU in fp16 / bf16 / fp32, 1 to 3 dims, last stride 1; an index of
  ``logits.shape[:-1]`` (int32 / int64); ``row_mask`` None or of ``index``'s exact shape in
  bool / int32 / int64; Triton installed): bf16 logits on a GPU give fp32 log-probs there,
  bf16 ones on a CPU.

Half precision, the one trade (``fused_rl.compat.half_precision``, docs/compat.md):

* ``"accurate"`` (default): the math runs in fp32 (fp64 for fp64 logits) and each output
  is rounded once. TRL's PyTorch path (CPU, and any call its kernel does not take) divides
  by the temperature and takes the log-softmax in fp16 / bf16, and for the entropy also
  rounds ``exp`` and the products: its error against float64 is as large or larger
  (docs/compat.md gives the live check's figures), but its results are not the adapter's
  bit for bit, and tests that compare with ``torch.equal`` fail.
* ``"original"``: fp16 / bf16 logits go through TRL's own PyTorch computation (the same ops,
  order and chunking, autograd through them), so values and gradients equal TRL's bit for
  bit. It costs what TRL costs: a half-precision ``(..., V)`` log-softmax per leading row
  (per ``chunk_size`` rows for the entropy), saved for the backward. Where TRL runs its
  Triton kernel, which computes in fp32, there is no half-precision path to reproduce: both
  modes return fused_rl's fp32 values (equal to TRL's to fp32 rounding, not bit for bit).

Differences from TRL, all deliberate:

* Both functions stream the logits once (forward) and once (backward) through
  :func:`fused_rl.token_logprobs` / :func:`fused_rl.token_entropy`: no ``(..., V)`` temporary,
  whatever the dtype. ``chunk_size`` is checked (an int ``>= 1``) and otherwise has no effect
  in ``"accurate"`` mode.
* An index outside ``[0, V)`` (a ``-100`` label included) raises ``ValueError`` in eager mode
  (TRL's ``gather`` raises ``RuntimeError``); see ``fused_rl.config.check_values``. Entries
  that ``row_mask`` masks are not checked (nor read), as in TRL's kernel.
* ``-inf`` logits give a finite entropy (TRL's ``0 * -inf`` gives NaN); ``"original"`` mode
  keeps TRL's NaN.
* ``temperature`` must be a finite real number, not a tensor (TRL's PyTorch path accepts a
  tensor, NaN and inf). NaN logits at entries that ``row_mask`` masks never reach the
  gradient (TRL's PyTorch path returns a NaN gradient there, its kernel 0).
* 1-D ``(V,)`` logits with a 0-d index give a 0-d log-prob, as TRL's kernel does (TRL's
  PyTorch path returns a wrong ``(V,)`` result in fp32 and raises in fp16 / bf16); empty
  leading dimensions give an empty result (TRL's PyTorch path raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validation as V
from .._agg import check_num_items
from .._backend import resolve_backend, triton_installed
from ..distill import distill_loss
from ..logprobs import token_entropy
from ._checks import check_index_range, checked_logprobs, checked_logprobs_k
from ._precision import original_half_precision

_SELECTIVE = "TRL's selective_log_softmax"
# What an out-of-range label's message tells the caller to do when a row mask is given.
_ROW_MASK_FIX = "pass row_mask = 0 where a label is ignored, or replace it by a valid id"
# Devices on which TRL >= 1.14 runs its own Triton kernel (``_supports_trl_loss_kernel``).
_TRL_KERNEL_DEVICES = ("cuda", "xpu")
_TRL_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRL_KERNEL_MASK_DTYPES = (torch.bool, torch.int32, torch.int64)


def _trl_kernel_path(
    logits: Tensor, index: Tensor | None = None, row_mask: Tensor | None = None
) -> bool:
    """True where TRL 1.16 would run its Triton kernel (and so return fp32 outputs)."""
    takes = (
        logits.device.type in _TRL_KERNEL_DEVICES
        and logits.dtype in _TRL_KERNEL_DTYPES
        and 1 <= logits.dim() <= 3
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
        and triton_installed()
    )
    if index is not None:
        takes = (
            takes
            and tuple(index.shape) == tuple(logits.shape[:-1])
            and index.dtype in V.INDEX_DTYPES
            and index.device == logits.device
        )
    if row_mask is not None:
        takes = (
            takes
            and index is not None
            and tuple(row_mask.shape) == tuple(index.shape)
            and row_mask.dtype in _TRL_KERNEL_MASK_DTYPES
            and row_mask.device == logits.device
        )
    return takes


def _keep_mask(row_mask: Tensor | None, index: Tensor, logits: Tensor) -> Tensor | None:
    """``row_mask != 0`` broadcast to ``index.shape`` (TRL masks ``row_mask == 0``), or None."""
    if row_mask is None:
        return None
    V.check_mask_dtype(row_mask, "row_mask")
    V.check_same_device(logits=logits, row_mask=row_mask)
    try:
        fits = torch.broadcast_shapes(row_mask.shape, index.shape) == index.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"row_mask must have index's shape {tuple(index.shape)} (or broadcast to it), "
            f"got {tuple(row_mask.shape)}"
        )
    return (row_mask != 0).expand(index.shape)


def _check_index(logits: Tensor, index: Tensor) -> bool:
    """Validate ``index`` against ``logits``; True for a ``(..., K)`` index."""
    V.check_tensor(index, "index")
    if index.dim() == logits.dim() - 1:
        V.check_targets(index, logits, "index")
        return False
    if index.dim() != logits.dim() or tuple(index.shape[:-1]) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"index must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])} or "
            f"(*logits.shape[:-1], K), got {tuple(index.shape)}"
        )
    if index.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"index must be an int64 or int32 tensor, got {index.dtype}")
    V.check_same_device(logits=logits, index=index)
    return True


def _original_selective(
    logits: Tensor, index: Tensor, temperature: float, keep: Tensor | None
) -> Tensor:
    """TRL's PyTorch path for fp16 / bf16 logits, op for op (``"original"`` mode): divide by
    the temperature and take the log-softmax in the logits' dtype, one leading row at a time,
    gather, then zero the masked entries."""
    vocab = logits.shape[-1]
    valid = (index >= 0) & (index < vocab)
    # Masked (and, with value checks off, bad) labels gather a valid id instead: the entry is
    # overwritten below, and its zero upstream gradient scatters to any column alike.
    safe = torch.where(valid, index, 0)
    if temperature != 1.0:
        logits = logits / temperature
    squeeze = safe.dim() == logits.dim() - 1
    if squeeze:
        safe = safe.unsqueeze(-1)
    if logits.dim() == 1 or logits.shape[0] == 0:  # TRL's row loop fails on these
        out = F.log_softmax(logits, dim=-1).gather(-1, safe)
    else:
        rows = zip(logits, safe, strict=True)
        out = torch.stack([F.log_softmax(z, dim=-1).gather(-1, i) for z, i in rows])
    if squeeze:
        out = out.squeeze(-1)
    if keep is not None:
        out = out.masked_fill(~keep, 0.0)
    if not V.value_checks_enabled(index):  # unchecked bad labels: NaN, as fused_rl gives
        bad = ~valid if keep is None else ~valid & keep
        out = out.masked_fill(bad, float("nan"))
    return out


def _original_entropy(logits: Tensor, chunk_size: int) -> Tensor:
    """TRL's PyTorch entropy for fp16 / bf16 logits, op for op (``"original"`` mode):
    ``-(exp(log_softmax) * log_softmax).sum(-1)`` in the logits' dtype, ``chunk_size`` rows
    of the flattened logits at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(logp) * logp).sum(-1))
    return torch.cat(parts, dim=0).reshape(logits.shape[:-1])


def selective_log_softmax(
    logits: Tensor, index: Tensor, temperature: float = 1.0, row_mask: Tensor | None = None
) -> Tensor:
    """Mirrors ``trl.trainer.utils.selective_log_softmax(logits, index, temperature=1.0,
    row_mask=None)`` (TRL >= 1.14).

    ``log_softmax(logits / temperature, -1)`` gathered at ``index``, without the ``(..., V)``
    log-softmax.

    Args:
        logits: ``(..., V)`` float logits, any strides.
        index: ``(...)`` = ``logits.shape[:-1]`` (one id per position), or ``(..., K)`` with
            ``index.shape[:-1] == logits.shape[:-1]`` (``K`` ids per position, e.g. top-K;
            one read of the logits forward and one backward, whatever ``K``). int64 or
            int32.
        temperature: the logits are divided by it; a finite number ``> 0``.
        row_mask: None, or ``index``'s shape (or broadcastable to it), any dtype: entries
            where ``row_mask == 0`` give 0 with 0 gradient, and their logits and labels are
            not read.

    Returns:
        Log-probabilities of ``index``'s shape, in ``logits.dtype`` (fp32 where TRL's
        Triton kernel would run, see the module docstring); differentiable. Under
        ``half_precision("original")``, fp16 / bf16 results equal TRL's bit for bit.

    Example:
        >>> import torch
        >>> from fused_rl.compat.trl import selective_log_softmax
        >>> logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]])
        >>> index = torch.tensor([[1, 0]])
        >>> out = selective_log_softmax(logits, index)  # log(1/4), log(e^2 / (e^2 + 3))
        >>> [round(v, 5) for v in out[0].tolist()]
        [-1.38629, -0.34075]
        >>> selective_log_softmax(logits, index, 2.0, row_mask=torch.tensor([[1, 0]])).tolist()
        [[-1.3862943649291992, 0.0]]
        >>> selective_log_softmax(logits, torch.randint(0, 4, (1, 2, 3))).shape
        torch.Size([1, 2, 3])
    """
    V.check_logits(logits, "logits")
    V.check_positive(temperature, "temperature")
    multi = _check_index(logits, index)
    keep = _keep_mask(row_mask, index, logits)
    check_index_range(index, logits.shape[-1], "index", _SELECTIVE, keep, _ROW_MASK_FIX)
    kernel_path = _trl_kernel_path(logits, index, row_mask)
    if original_half_precision(logits) and not kernel_path:
        return _original_selective(logits, index, float(temperature), keep)
    out_dtype = torch.float32 if kernel_path else logits.dtype
    if not multi:
        logp = checked_logprobs(logits, index, temperature=temperature, keep=keep)
        return logp.to(out_dtype)
    if index.shape[-1] == 0:
        return logits.new_empty(index.shape, dtype=out_dtype)
    return checked_logprobs_k(logits, index, temperature=temperature, keep=keep).to(out_dtype)


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Mirrors ``trl.trainer.utils.entropy_from_logits(logits, chunk_size=128)``.

    Shannon entropy (nats) of ``softmax(logits)`` per position, one fused pass.

    Args:
        logits: ``(..., V)`` float logits, any strides.
        chunk_size: an int ``>= 1``; rows per chunk of TRL's loop, used only to reproduce it
            under ``half_precision("original")`` (the fused kernel never materialises a chunk).

    Returns:
        ``logits.shape[:-1]`` tensor in ``logits.dtype`` (fp32 where TRL's Triton kernel would
        run, see the module docstring); differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat.trl import entropy_from_logits
        >>> entropy_from_logits(torch.zeros(2, 4)).tolist()  # log(4)
        [1.3862943649291992, 1.3862943649291992]
        >>> import fused_rl.compat as compat
        >>> with compat.half_precision("original"):  # TRL's bf16 arithmetic, bit for bit
        ...     entropy_from_logits(torch.zeros(2, 4, dtype=torch.bfloat16)).tolist()
        [1.3828125, 1.3828125]
    """
    V.check_logits(logits, "logits")
    V.check_positive_int(chunk_size, "chunk_size")
    kernel_path = _trl_kernel_path(logits)
    if original_half_precision(logits) and not kernel_path:
        return _original_entropy(logits, chunk_size)
    entropy = token_entropy(logits, backend=resolve_backend("auto", logits))
    return entropy.to(torch.float32 if kernel_path else logits.dtype)


# ----------------------------------------------------------------------------- GKD

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _trl_jsd_terms(student_logits: Tensor, teacher_logits: Tensor, beta: float,
                   temperature: float) -> Tensor:  # fmt: skip
    """TRL 1.16's elementwise ``jsd`` (``(..., V)``: ``F.kl_div(..., reduction="none")``
    terms), op for op in the inputs' dtype."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture_log_probs = torch.logsumexp(
        torch.stack(
            [student_log_probs + torch.log1p(-beta_t), teacher_log_probs + torch.log(beta_t)]
        ),
        dim=0,
    )
    kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
    return beta_t * kl_teacher + (1 - beta_t) * kl_student


def _trl_jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction,
                  num_items_in_batch):  # fmt: skip
    """TRL 1.16's ``generalized_jsd_loss`` transcribed (the ``"none"`` reduction, and every
    reduction under ``half_precision("original")``)."""
    jsd = _trl_jsd_terms(student_logits, teacher_logits, beta, temperature)
    mask = None
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        jsd_sum = jsd.sum()
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(jsd_sum.device)
        return jsd_sum / num_items_in_batch
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | float | Tensor | None = None,
) -> Tensor:
    """Mirrors ``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`` (TRL 1.16, a static
    method there): the GKD loss from student and teacher logits without TRL's two fp32
    ``(..., V)`` log-softmaxes, through :func:`fused_rl.distill_loss`.

    Per position, of ``softmax(logits / temperature)`` (student ``p``, teacher ``q``):
    ``beta == 0``: ``KL(q || p)``; ``beta == 1``: ``KL(p || q)``; else ``beta KL(q || m) +
    (1 - beta) KL(p || m)``, ``m = (1 - beta) p + beta q``. Positions whose ``labels`` are
    -100 do not count. TRL's reductions, exactly:

    * ``num_items_in_batch`` given: the sum over counted positions divided by it, whatever
      ``reduction`` (``"none"`` included, as in TRL);
    * ``"batchmean"``: the sum over the number of counted positions (0 when none counts);
      without ``labels``, over ``student_logits.shape[0]`` (TRL's ``jsd.size(0)``: the
      batch size of ``(B, T, V)`` logits, not the number of tokens);
    * ``"sum"``: the sum;
    * ``"mean"``: TRL's ``jsd.mean()`` over its per-vocabulary-entry terms: the sum over
      ``counted positions * V`` (NaN when none counts, as TRL's empty mean);
    * ``"none"``: TRL's elementwise ``(..., V)`` terms (``(n_counted, V)`` with ``labels``),
      computed in plain PyTorch (the result is itself ``(N, V)``): in fp32 (fp64 for fp64
      inputs) and rounded once, or TRL's own arithmetic under ``half_precision("original")``.

    Args:
        student_logits, teacher_logits: ``(B, T, V)`` (or ``(N, V)``; any number of leading
            dims), float, any strides; the teacher must not require grad (``ValueError``: TRL
            computes it under ``no_grad``; pass ``.detach()``).
        labels: ``student_logits.shape[:-1]`` int labels, -100 where a position does not count.
        beta: in ``[0, 1]``. temperature: ``> 0``, divides both logits.
        reduction: one of ``"batchmean"``, ``"sum"``, ``"mean"``, ``"none"`` (another
            string raises ``ValueError``; TRL returns the unreduced terms for it).
        num_items_in_batch: a number ``> 0`` or a one-element tensor (its value is not read
            on the host: ``<= 0`` gives NaN).

    Returns:
        A 0-dim loss (the unreduced terms for ``"none"``) in the promoted dtype of the two
        logits, as TRL's; differentiable w.r.t. ``student_logits``.

    Differences from TRL, deliberate: ``-inf`` logits give the finite limit ``0 log 0 = 0``
    in every reduction but ``"none"`` (TRL's ``F.kl_div`` gives NaN there); fp16 / bf16
    logits are computed in fp32 and the loss rounded once (``half_precision("original")``
    runs TRL's own arithmetic, bit for bit); ``num_items_in_batch`` as a number must be
    ``> 0`` (TRL divides by 0).

    Example:
        >>> import torch
        >>> from fused_rl.compat.trl import generalized_jsd_loss
        >>> student = torch.randn(2, 4, 9, requires_grad=True)
        >>> teacher = torch.randn(2, 4, 9)
        >>> labels = torch.tensor([[-100, 3, 1, 2], [-100, -100, 5, 0]])
        >>> loss = generalized_jsd_loss(student, teacher, labels, beta=0.1, temperature=0.9)
        >>> loss.backward()
        >>> generalized_jsd_loss(student, teacher, labels, reduction="none").shape
        torch.Size([5, 9])
    """
    V.check_logits(student_logits, "student_logits")
    V.check_logits(teacher_logits, "teacher_logits")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits must have student_logits' shape {tuple(student_logits.shape)}, "
            f"got {tuple(teacher_logits.shape)}"
        )
    V.check_unit_interval(beta, "beta")
    V.check_positive(temperature, "temperature")
    V.check_choice(reduction, _REDUCTIONS, "reduction")
    if labels is not None:
        V.check_targets(labels, student_logits, "labels")
    if num_items_in_batch is not None:
        check_num_items(num_items_in_batch)
    if teacher_logits.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "teacher_logits requires grad: the teacher gets no gradient (TRL computes it "
            "under torch.no_grad()); pass teacher_logits.detach()"
        )
    out_dtype = torch.promote_types(student_logits.dtype, teacher_logits.dtype)
    if original_half_precision(student_logits, teacher_logits):
        return _trl_jsd_loss(student_logits, teacher_logits, labels, float(beta),
                             float(temperature), reduction, num_items_in_batch)  # fmt: skip
    if reduction == "none" and num_items_in_batch is None:
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        jsd = _trl_jsd_terms(student_logits.to(acc), teacher_logits.to(acc), float(beta),
                             float(temperature))  # fmt: skip
        return (jsd if labels is None else jsd[labels != -100]).to(out_dtype)
    vocab = student_logits.shape[-1]
    student, teacher, targets = student_logits, teacher_logits, labels
    if student.dim() not in (2, 3):  # distill_loss takes (N, V) or (B, T, V)
        student, teacher = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
        targets = None if labels is None else labels.reshape(-1)
    num_items = num_items_in_batch
    if isinstance(num_items, Tensor):
        num_items = num_items.to(student.device)
    elif num_items is None and reduction == "batchmean" and labels is None:
        lead = student_logits.shape[0] if student_logits.dim() > 1 else vocab
        num_items = max(lead, 1)
    elif num_items is None and reduction == "sum":
        num_items = 1
    elif num_items is None and reduction == "mean":
        if labels is not None:
            num_items = (labels != -100).sum() * vocab  # on device: no host sync
        else:
            n = student_logits.numel()
            num_items = n if n > 0 else torch.zeros((), device=student.device)  # NaN, as TRL
    loss, _ = distill_loss(
        student, teacher, beta=beta, temperature=temperature, targets=targets,
        num_items=num_items, backend=resolve_backend("auto", student),
    )  # fmt: skip
    return loss.to(out_dtype)
