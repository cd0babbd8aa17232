"""Log-probs under a sampler's top-k / top-p truncation: ``truncated_logprobs``.

The log-prob of each target under the distribution vLLM's sampler draws from (temperature,
then top-k, then top-p over the renormalised top-k set), streamed: on the Triton backend a
forward is ONE kernel (``kernels/vocab/truncated.py``; one pass over each row for top-k
with ``k <= MAX_STREAMED_K``, more for top-p alone, stated there) and a backward is one
kernel that reads each row once and writes its gradient. No row is sorted in memory and
nothing of size ``(N, V)`` is allocated but the gradient. Both are
:class:`fused_rl._ops.FusedOp` (``torch.library`` custom ops for ``torch.compile``, a
direct call in eager mode; their launchers are ``fused_rl._truncated_ops``). The
``reference`` backend sorts (``fused_rl.reference.truncated``). Vocabulary-parallel logits go
through ``fused_rl.truncated_parallel``.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._shapes import as_rows3d
from ._truncated_ops import MAX_STREAMED_K, truncated_logprobs_fwd_op
from .distributed import MAX_VOCAB, is_dtensor, resolve_shard
from .reference import truncated as ref
from .truncated_parallel import sharded_truncated_logprobs

# ----------------------------------------------------------------------------- public API


def _check_top_k(top_k) -> None:
    if top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be None or an int >= 1, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def _check_top_p(top_p) -> None:
    if top_p is None:
        return
    if isinstance(top_p, (bool, torch.Tensor)) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be None or a real number in (0, 1], got "
                        f"{type(top_p).__name__}")  # fmt: skip
    if not 0.0 < top_p <= 1.0:  # NaN too
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def check_options(top_k, top_p, temperature, softcap, ignore_index) -> None:
    """The checks of :func:`truncated_logprobs`'s non-tensor arguments (messages naming
    them), shared with ``linear_token_logprobs(top_k=, top_p=)``."""
    _check_top_k(top_k)
    _check_top_p(top_p)
    V.check_positive(temperature, "temperature")
    if softcap is not None:
        V.check_positive(softcap, "softcap")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def cuts(top_k: int | None, top_p: float | None, vocab: int) -> tuple[int, float]:
    """The launchers' ``(top_k, top_p)`` for checked options over ``vocab`` tokens: 0 for no
    top-k (None or ``k >= V``), 1.0 for no top-p."""
    k = 0 if top_k is None or top_k >= vocab else int(top_k)
    return k, 1.0 if top_p is None else float(top_p)


def truncated_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Log-prob of each target under the sampler's truncated distribution (vLLM's order:
    temperature, then top-k, then top-p over the renormalised top-k set), fused, streamed.

    With ``z = logits / temperature`` per row (``z = c tanh(logits / c) / temperature`` with
    ``softcap=c``, the sampler's view of a soft-capped model):

    * **top-k** keeps ``{z >= tau_k}``, ``tau_k`` the k-th largest ``z`` (counted with
      multiplicity). Every token tied AT ``tau_k`` is kept, so more than ``k`` tokens may be
      (vLLM's sampler thresholds on the k-th value the same way). ``None`` or ``k >= V``:
      no top-k.
    * **top-p** then keeps, of those, the smallest set of the most probable tokens whose
      probability (renormalised over the top-k set) sums to at least ``top_p``: in
      descending order the token whose cumulative probability reaches ``top_p`` is kept
      (at least one token always is), **and every token tied with it** -- precisely,
      ``{z >= v*}`` with ``v*`` the largest kept ``z`` such that the tokens with ``z >=
      v*`` hold probability ``>= top_p``. This threshold rule never depends on the order a
      sort gives tied tokens. vLLM's sampler cuts at a position of its (ascending) sort
      (it drops a token when the cumulative probability of it and everything below is
      ``<= 1 - top_p``), so of several tokens tied in probability at the boundary it may
      keep some and drop others; without ties at the boundary the two rules keep the same
      set. ``None`` or ``1.0``: no top-p.

    The result is ``z_y - logsumexp(z over the kept set)`` for a kept target and ``-inf``
    (with zero gradient) for a target outside it; the gradient w.r.t. ``logits`` is
    ``(onehot_y - p_trunc) dz/dx`` on the kept set and 0 elsewhere (the kept set is piecewise
    constant in the logits, as autograd of the masked log-softmax gives).

    Args:
        logits: ``(..., V)`` fp32 / bf16 / fp16 (fp64 for gradcheck), any strides.
        targets: ``logits.shape[:-1]``, int64 or int32, any strides.
        top_k: None or an int ``>= 1``.
        top_p: None or a real number in ``(0, 1]``.
        temperature: logits are divided by it (``> 0``) before both cuts.
        softcap: Gemma-style soft cap ``c`` (a finite ``c > 0``; None = none), applied
            before the temperature, as in :func:`fused_rl.token_logprobs`.
        ignore_index: targets equal to it give 0 and exactly 0 gradient.
        process_group, vocab_start, vocab_size: vocabulary parallelism, as
            :func:`fused_rl.token_logprobs` takes it (``logits`` this rank's shard, or a
            ``DTensor`` placed ``Shard(-1)``; ``targets`` global ids, the same on every
            rank): every rank returns the unsharded call's values and gets its columns of
            the gradient. Collectives (``fused_rl.truncated_parallel``): a MAX all-reduce of
            the layout header, one all-gather of ``kk + 7`` floats a token per rank (``kk =
            min(k, 64)``, or 64 for top-p alone and ``k > 64``); where those values do not
            decide a row's cut: for ``k > 64`` the radix select's ``B / 8`` passes (2 for
            bf16, 4 fp32), one all-reduce each of the digit's histogram (256 int32 a token,
            258 floats after the first pass; one more of one float with ``softcap``); for
            top-p search passes of one all-reduce of 32 floats a token each (at most 11 in
            fp32, 7 for bf16 / fp16), then one all-gather of 64. Under
            ``torch.compile`` one custom op each way (``fullgraph=True`` holds): the host
            reads (to skip a step no row needs, once a search pass to stop early) run
            inside it.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"`` (see ``fused_rl._backend``).

    Returns:
        fp32 tensor of ``targets.shape`` (fp64 for fp64 logits). A row with a NaN or ``+inf``
        logit, or only ``-inf`` ones, gives NaN (and a NaN gradient row); an out-of-range
        target gives NaN (eager mode raises first, see ``fused_rl.config.check_values``).

    Cost on the Triton backend (``E`` bytes per logit), one launch each way: top-k with
    ``k <= MAX_STREAMED_K`` (64), with or without top-p: one read of each row (``V E``), as
    ``token_logprobs``; top-k > 64: a radix select of the k-th largest on the logits' bits,
    2 reads of a bf16 / fp16 row, 4 fp32, 8 fp64 (one more with ``softcap``; one in all
    where ties at the 64th largest settle it); top-p alone (or after top-k > 64): one
    read when the row's 64 largest values already hold ``top_p``, else a search on the
    threshold (typically 3-6 reads of a flat row at V = 32K-152K, at most 13;
    ``kernels/vocab/truncated.py``). Backward: one read and one write per row.

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
        >>> lp = fused_rl.truncated_logprobs(logits, torch.tensor([1]), top_k=2)
        >>> round(lp.item(), 4)  # tokens 1 and 2 tie at the 2nd value: three are kept
        -1.5514
        >>> fused_rl.truncated_logprobs(logits, torch.tensor([3]), top_k=2).item()
        -inf
    """
    sharded = process_group is not None or vocab_start is not None or vocab_size is not None
    if sharded or is_dtensor(logits):
        return _sharded(logits, targets, top_k, top_p, temperature, softcap, ignore_index,
                        process_group, vocab_start, vocab_size, backend)  # fmt: skip
    V.check_logits(logits)
    V.check_targets(targets, logits)
    check_options(top_k, top_p, temperature, softcap, ignore_index)
    vocab = logits.shape[-1]
    V.check_target_range(targets, vocab, ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    k, p = cuts(top_k, top_p, vocab)
    cap = None if softcap is None else float(softcap)
    if which == "reference":
        return ref.truncated_logprobs(
            logits, targets, top_k=k or None, top_p=p, temperature=float(temperature),
            softcap=cap, ignore_index=int(ignore_index),
        )  # fmt: skip
    logits3d = as_rows3d(logits)
    t2d = targets.reshape(logits3d.shape[:2])
    logp, _, _ = truncated_logprobs_fwd_op(
        logits3d, t2d, k, p, float(temperature), cap, int(ignore_index)
    )
    return logp.reshape(targets.shape)


def _sharded(logits, targets, top_k, top_p, temperature, softcap, ignore_index, process_group,
             vocab_start, vocab_size, backend) -> Tensor:  # fmt: skip
    """:func:`truncated_logprobs` of a vocabulary shard (``fused_rl.truncated_parallel``)."""
    logits, targets, shard = resolve_shard(logits, targets, process_group, vocab_start, vocab_size)
    if shard is None:  # a DTensor replicated over the vocabulary: an ordinary call
        return truncated_logprobs(
            logits, targets, top_k=top_k, top_p=top_p, temperature=temperature,
            softcap=softcap, ignore_index=ignore_index, backend=backend,
        )  # fmt: skip
    if logits.dim() >= 1 and logits.shape[-1] == 0:  # a vocabulary shard may be empty
        V.check_float(logits, "logits")
    else:
        V.check_logits(logits)
    V.check_targets(targets, logits)
    check_options(top_k, top_p, temperature, softcap, ignore_index)
    # top_k as given (not against this rank's vocab_size): every rank must run the same
    # collectives; they agree on V from the checked header (truncated_parallel.agreed_cut)
    k, p = cuts(top_k, top_p, MAX_VOCAB)
    return sharded_truncated_logprobs(
        logits, targets, shard, top_k=k, top_p=p, temperature=float(temperature),
        softcap=softcap, ignore_index=int(ignore_index),
        which=resolve_backend(backend, logits, targets),
    )  # fmt: skip


__all__ = ["MAX_STREAMED_K", "truncated_logprobs"]
