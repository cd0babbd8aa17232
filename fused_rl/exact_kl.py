"""The exact per-token KL between two models over the whole vocabulary: ``token_kl``.

``KL(pi || pi_ref)_t = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(logits / T)``,
``q = softmax(ref_logits / T)``, as a differentiable ``(B, T)`` tensor (the gradient reaches
``logits`` only: the reference is a constant). It is what :func:`fused_rl.policy_loss`
(``ref_logits=``, ``kl_estimator="full"``) adds to every token's loss where the loss is
composed from per-token statistics (GSPO / VESPO, the top-entropy selection, vocabulary
parallelism); the token-level fused pass computes the same quantity inside its own kernel.

Triton backend: the reverse-KL kernels of on-policy distillation (``kernels/vocab/distill.py``
with ``beta = 1``, as their custom ops; both rows streamed once forward (plus the distillation
finalize, one small launch whose loss is unused), once backward, every statistic relative to
the running maxima so a reference near the policy keeps its small KL); the reference backend
is plain PyTorch (``reference.distill.token_divergences``).

Vocabulary parallelism (``process_group=``, or ``DTensor`` logits sharded ``Shard(-1)``, the
reference sharded alike): each rank streams its shard's columns into per-token partials
``(M_z, log S_z, M_u, log(S_z / S_u), r)`` (``r = E_p[(z - M_z) - (u - M_u)]`` over the
shard) and two all-reduces merge them: ``MAX`` of both row maxima (8 bytes a token in fp32),
then one ``SUM`` of ``A = S_z e^(M_z,r - M_z)``, the shard's part of ``S_u - S_z`` as its own
small number (``A expm1((M_u,r - M_u) - (M_z,r - M_z) - log(S_z,r / S_u,r))``) and
``A (r + (M_z,r - M_z) - (M_u,r - M_u))`` (12 bytes a token): 20 bytes a token per rank,
fp32 (twice that in fp64). ``KL = R / S_z - log(S_z / S_u)`` with the log-ratio from the
summed difference (``-log1p``), so a reference near the policy keeps its accuracy. The backward
needs no collective: each rank writes its shard's gradient from the global statistics. The
layouts of :func:`fused_rl.token_logprobs`: equal widths (rank ``r`` holding
``[r V_local, (r + 1) V_local)``), a padded vocabulary (``vocab_size``: the padding columns
never read, their gradient 0) or ragged shards (``vocab_start`` and ``vocab_size``), checked
on the first all-reduce (a header of ``2 world + 2`` floats); both models' shards alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._shapes import as_rows3d
from .distill import pair_divergence
from .distributed import check_vocab_limit, is_dtensor, resolve_shard
from .reference import distill as ref


def token_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    mask: Tensor | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Per-token exact ``KL(softmax(logits / T) || softmax(ref_logits / T))``.

    Args:
        logits: ``(..., V)`` the policy's logits (any float dtype and strides);
            differentiable.
        ref_logits: the reference's, the same shape (any float dtype and strides); a
            constant (no gradient).
        temperature: both softmaxes at ``temperature``.
        softcap: Gemma-style soft cap ``c`` of both models' logits (``c tanh(x / c)`` before
            the temperature; None = none).
        mask: optional ``logits.shape[:-1]`` indicator (bool, or integer / float: nonzero
            counts): rows outside it are not read and give 0 (and a zero gradient).
        process_group: vocabulary parallelism: each rank's ``logits`` / ``ref_logits`` are its
            shard of the vocabulary (module docstring); ``DTensor`` inputs sharded on their
            last dim give their own group. A bad layout raises ``ValueError`` on every rank
            (eager with ``fused_rl.config.check_values``: one host sync), else gives NaN.
        vocab_start, vocab_size: the layout, with ``process_group``, as for
            :func:`fused_rl.token_logprobs` (``vocab_size`` alone: Megatron's padded
            vocabulary; both: ragged shards).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``logits.shape[:-1]`` fp32 (fp64 for an fp64 input), differentiable w.r.t.
        ``logits``.

    ``-inf`` logits give the finite limit (``0 log 0 = 0``; a column where ``p == 0`` gets a
    zero gradient). A NaN in a counted row makes its KL NaN; a reference ``-inf`` where the
    policy has mass makes it ``+inf``; either way the row has no finite gradient column
    (where ``p == 0`` NaN, on both backends: CONTRIBUTING.md, "NaN, threads and other
    failure modes"). Rows outside ``mask`` never matter.

    Example:
        >>> import torch, fused_rl
        >>> x = torch.randn(2, 3, 11, requires_grad=True)
        >>> kl = fused_rl.token_kl(x, x.detach() + 0.1 * torch.randn(2, 3, 11))
        >>> kl.shape, bool((kl >= 0).all())
        (torch.Size([2, 3]), True)
        >>> kl.sum().backward()
    """
    if is_dtensor(ref_logits):
        ref_logits = ref_logits.to_local()
    V.check_float(logits, "logits")
    logits, _, shard = resolve_shard(logits, None, process_group, vocab_start, vocab_size)
    empty_ok = shard is not None  # a shard may hold no column (a bad layout: the header's)
    V.check_logits(logits, "logits", empty_ok=empty_ok)  # (..., V), V >= 1 unsharded
    V.check_logits(ref_logits, "ref_logits", empty_ok=empty_ok)
    V.check_positive(temperature, "temperature")
    if softcap is not None:
        V.check_positive(softcap, "softcap")
        softcap = float(softcap)
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"ref_logits must have logits' shape {tuple(logits.shape)} (the same vocabulary, "
            f"sharded alike), got {tuple(ref_logits.shape)}"
        )
    V.check_mask(mask, "mask", tuple(logits.shape[:-1]), "logits.shape[:-1]", weights=False)
    V.check_same_device(logits=logits, ref_logits=ref_logits, mask=mask)
    if mask is not None and mask.dtype != torch.bool:  # an indicator: nonzero counts
        mask = mask != 0
    which = resolve_backend(backend, logits, ref_logits)
    x3d, r3d = as_rows3d(logits), as_rows3d(ref_logits.detach())
    m2d = None if mask is None else mask.reshape(x3d.shape[:2])
    if shard is None and which == "reference":
        x3d, r3d = ref.capped_rows(x3d, m2d, softcap), ref.capped_rows(r3d, m2d, softcap)
        kl = ref.token_divergences(x3d, r3d, beta=1.0, temperature=float(temperature),
                                   counted=m2d)["d"]  # fmt: skip
    else:
        if shard is not None:
            check_vocab_limit(shard)
        kl, _ = pair_divergence(x3d, r3d, m2d, float(temperature), which, shard,
                                softcap=softcap, check=V.value_checks_enabled(logits))  # fmt: skip
    return kl.reshape(logits.shape[:-1])
