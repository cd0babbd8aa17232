"""Mirrors ``verl.utils.experimental.torch_functional``: :class:`FusedLinearForPPO`, verl's
chunked PyTorch fused lm_head (hidden states -> per-token log-prob and entropy in the hidden
states' dtype, the ``(N, V)`` logits never whole), running
:func:`fused_rl.linear_token_logprobs`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from .kernel_linear_cross_entropy import (
    _check_lm_head,
    _check_token_range,
    _linear_stats,
    _token_ids,
)

__all__ = ["FusedLinearForPPO"]


class FusedLinearForPPO(torch.nn.Module):
    """Mirrors ``verl.utils.experimental.torch_functional.FusedLinearForPPO``.

    ``log_softmax(hidden_states @ vocab_weights.T / temperature)`` gathered at ``input_ids``,
    and the entropy of that softmax, ``chunk_size`` tokens at a time: the ``(N, V)`` logits
    are never held whole. Runs :func:`fused_rl.linear_token_logprobs` (one GEMM and one pass
    of the vocab kernel per chunk forward; backward: the chunk's logits recomputed, the
    gradient written over them, ``dH = dz W``, ``dW += dz^T h`` in fp32).

    Args:
        chunk_size: tokens per chunk (verl's default 512); a positive int.
        impl_backend: ``"torch"`` or ``"liger"`` (verl 0.9.1's choice of implementation;
            both run fused_rl's op here); anything else raises verl's ``ValueError``.

    ``forward(hidden_states, vocab_weights, input_ids, temperature=1.0)``:

    * ``hidden_states``: ``(B, T, H)`` or ``(N, H)`` final hidden states (any strides);
    * ``vocab_weights``: the lm_head ``(V, H)``, ``hidden_states``' dtype (no bias, as in
      verl);
    * ``input_ids``: ``hidden_states.shape[:-1]`` ids in ``[0, V)``, **already shifted**:
      row ``t`` is scored at ``input_ids[..., t]`` (verl's callers pass
      ``torch.roll(input_ids, -1, dims=-1)``; nothing is rolled here); any integer dtype
      (verl casts to int64); an id outside ``[0, V)`` raises ``ValueError`` naming
      ``input_ids``;
    * ``temperature``: a real number ``> 0`` dividing the logits.

    Returns:
        ``(log_probs, entropy)``, each ``hidden_states.shape[:-1]`` in ``hidden_states``'
        dtype (verl's: it computes in fp32 and casts back); differentiable w.r.t.
        ``hidden_states`` and ``vocab_weights`` (gradients in their dtypes) under any
        upstream gradient on either output.

    Where it departs from verl (docs/compat.md, "verl"): for fp16 / bf16 inputs the gradient
    ``dz`` is not divided by ``temperature`` in that dtype and ``vocab_weights``' gradient
    accumulates over the chunks in fp32 (verl: in the weights' dtype), so it is at least as
    accurate; an fp64 input is computed in fp64 (verl: fp32). ``fused_rl.compat.half_precision``
    does not apply (there is no ``"original"`` op sequence to reproduce here).

    Example:
        >>> import torch
        >>> from fused_rl.compat.verl import FusedLinearForPPO
        >>> h = torch.zeros(2, 3, 8, requires_grad=True)
        >>> w = torch.randn(16, 8, requires_grad=True)
        >>> lp, ent = FusedLinearForPPO(chunk_size=4)(h, w, torch.zeros(2, 3, dtype=torch.long))
        >>> lp.shape, lp.dtype, round(lp[0, 0].item(), 4), round(ent[1, 2].item(), 4)
        (torch.Size([2, 3]), torch.float32, -2.7726, 2.7726)
        >>> (lp.sum() + ent.sum()).backward()
        >>> h.grad.shape, w.grad.shape
        (torch.Size([2, 3, 8]), torch.Size([16, 8]))
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        V.check_positive_int(chunk_size, "chunk_size")
        if impl_backend not in ("torch", "liger"):  # verl's check and message
            raise ValueError(
                f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'."
            )
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, impl_backend={self.impl_backend!r}"

    def forward(
        self,
        hidden_states: Tensor,
        vocab_weights: Tensor,
        input_ids: Tensor,
        temperature: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        V.check_positive_int(self.chunk_size, "chunk_size")  # an attribute: may be reassigned
        _check_lm_head(hidden_states, vocab_weights, "hidden_states", "vocab_weights")
        if hidden_states.dim() not in (2, 3):
            shape = tuple(hidden_states.shape)
            raise ValueError(f"hidden_states must be (B, T, H) or (N, H), got shape {shape}")
        ids = _token_ids(input_ids, "input_ids")
        if tuple(ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                "input_ids must have shape hidden_states.shape[:-1] = "
                f"{tuple(hidden_states.shape[:-1])}, got {tuple(ids.shape)} (one id per row, "
                "already shifted: FusedLinearForPPO does not roll them)"
            )
        V.check_same_device(hidden_states=hidden_states, input_ids=ids)
        V.check_positive(temperature, "temperature")
        _check_token_range(ids, vocab_weights.shape[0], "input_ids", "FusedLinearForPPO")
        logp, entropy = _linear_stats(
            hidden_states, vocab_weights, ids, temperature, self.chunk_size
        )
        return logp.to(hidden_states.dtype), entropy.to(hidden_states.dtype)
