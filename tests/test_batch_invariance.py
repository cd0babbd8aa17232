"""Batch invariance: a sequence's log-probs, entropies and policy-loss gradient rows are
bitwise the same whatever else is in the batch (its size, the sequence's position in it, the
padding around it), for each dtype and both backends.

Why it holds: every vocabulary kernel runs one program per row with a block size that
depends on V only (``fused_rl._launch.vocab_launch``), and reduces the row in a fixed order;
the reference walks rows in chunks whose reduction is per row. A change that makes a block
size or a reduction order depend on the batch fails here. (What the loss itself sums over
the batch, its normaliser, depends on the batch by definition: the gradient rows are
compared after dividing it out, as the per-token coefficients are the batch-invariant
part.)"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import fused_rl

BACKENDS = ("triton", "reference")
V, T = 77, 5


def _batch(row: torch.Tensor, row_t: torch.Tensor, size: int, at: int, seed: int):
    """``row`` (``(T, V)`` logits) and its targets placed at ``at`` in a batch of ``size``
    random sequences."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(size, T, V, generator=g).to(DEVICE, row.dtype)
    targets = torch.randint(0, V, (size, T), generator=g).to(DEVICE)
    logits[at], targets[at] = row, row_t
    return logits, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_do_not_depend_on_the_batch(backend, dtype):
    g = torch.Generator().manual_seed(0)
    row = (3 * torch.randn(T, V, generator=g)).to(DEVICE, dtype)
    row_t = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    seen = []
    for size, at, seed in ((1, 0, 1), (3, 2, 2), (7, 4, 3), (16, 0, 4)):
        logits, targets = _batch(row, row_t, size, at, seed)
        logp, ent = fused_rl.token_logprobs(logits, targets, return_entropy=True, backend=backend)
        seen.append((logp[at], ent[at]))
    for logp, ent in seen[1:]:
        assert torch.equal(logp, seen[0][0]) and torch.equal(ent, seen[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_gradient_rows_do_not_depend_on_the_batch(backend, dtype):
    """With ``loss_agg="seq-mean-token-sum"`` the normaliser is ``1 / B``: scaled back by
    ``B``, the row's gradient (and so its per-token coefficients) must be bitwise equal."""
    g = torch.Generator().manual_seed(5)
    row = (2 * torch.randn(T, V, generator=g)).to(DEVICE, dtype)
    row_t = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    row_old = (torch.randn(T, generator=g) * 0.3 - 4.0).to(DEVICE)
    seen = []
    for size, at, seed in ((1, 0, 6), (4, 1, 7), (8, 7, 8)):
        logits, targets = _batch(row, row_t, size, at, seed)
        logits.requires_grad_(True)
        old = torch.randn(size, T, generator=torch.Generator().manual_seed(seed)).to(DEVICE) - 4.0
        old[at] = row_old
        adv = torch.ones(size, device=DEVICE)
        loss, _ = fused_rl.policy_loss(
            logits, targets, adv, old_logprobs=old, eps_high=0.28, beta=0.0,
            loss_agg="seq-mean-token-sum", backend=backend,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss * size, logits)
        seen.append(grad[at])
    for grad in seen[1:]:
        assert torch.equal(grad, seen[0])
