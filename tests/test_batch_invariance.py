"""Batch invariance: a sequence's log-probs, entropies and policy-loss gradient rows are
bitwise the same whatever else is in the batch (its size, the sequence's position in it, the
padding around it), for each dtype and both backends (on a GPU the Triton backend only:
``helpers.BATCH_INVARIANT_BACKENDS``).

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
from helpers import BATCH_INVARIANT_BACKENDS

import fused_rl

V, T = 77, 5


def _batch(row: torch.Tensor, row_t: torch.Tensor, size: int, at: int, seed: int):
    """``row`` (``(T, V)`` logits) and its targets placed at ``at`` in a batch of ``size``
    random sequences."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(size, T, V, generator=g).to(DEVICE, row.dtype)
    targets = torch.randint(0, V, (size, T), generator=g).to(DEVICE)
    logits[at], targets[at] = row, row_t
    return logits, targets


@pytest.mark.parametrize("backend", BATCH_INVARIANT_BACKENDS)
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


@pytest.mark.parametrize("backend", BATCH_INVARIANT_BACKENDS)
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


# ----------------------------------------------------------------------------- fused-linear

H = 48


def _linear_batch(row, row_t, size: int, at: int, seed: int, dtype):
    """``row`` (``(T + 1, H)`` hidden states) and its targets at ``at`` among ``size``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(size, T + 1, H, generator=g).to(DEVICE, dtype)
    targets = torch.randint(0, V, (size, T), generator=g).to(DEVICE)
    hidden[at], targets[at] = row, row_t
    return hidden.requires_grad_(True), targets


# batch sizes, the row's position and a seed: 1, 3, 7 and 16 sequences of T + 1 rows, so the
# calls hold 5 to 80 rows, below and across a chunk of 16 rows
PLACES = ((1, 0, 1), (3, 2, 2), (7, 4, 3), (16, 0, 4), (16, 15, 5))


@pytest.mark.parametrize("backend", BATCH_INVARIANT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 16], ids=["default-chunk", "chunk16"])
def test_linear_token_logprobs_do_not_depend_on_the_batch(backend, dtype, chunk):
    """Log-prob, entropy and hidden-gradient rows of ``linear_token_logprobs``: every GEMM
    the row goes through has the chunk's shape (``fused_rl.config.batch_invariant``)."""
    g = torch.Generator().manual_seed(10)
    weight = (0.3 * torch.randn(V, H, generator=g)).to(DEVICE, dtype)
    row = torch.randn(T + 1, H, generator=g).to(DEVICE, dtype)
    row_t = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    up = torch.randn(T, generator=g).to(DEVICE)
    seen = []
    for size, at, seed in PLACES:
        hidden, targets = _linear_batch(row, row_t, size, at, seed, dtype)
        logp, ent = fused_rl.linear_token_logprobs(
            hidden, weight, targets, return_entropy=True, chunk_tokens=chunk, backend=backend
        )
        grad_up = torch.zeros_like(logp)
        grad_up[at] = up.to(logp.dtype)
        (d_hidden,) = torch.autograd.grad(logp, hidden, grad_up)
        seen.append((logp[at], ent[at], d_hidden[at]))
    for got in seen[1:]:
        for a, b in zip(got, seen[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BATCH_INVARIANT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_policy_gradient_rows_do_not_depend_on_the_batch(backend, dtype):
    """``linear_policy_loss`` with a fixed normaliser (``token-mean`` over ``num_items``
    = 10, so the per-token weight is the same in every batch; dividing a ``1 / B`` back out
    would round differently for each ``B``): the row's hidden gradient is bitwise the same
    in every batch."""
    g = torch.Generator().manual_seed(11)
    weight = (0.3 * torch.randn(V, H, generator=g)).to(DEVICE, dtype)
    row = torch.randn(T + 1, H, generator=g).to(DEVICE, dtype)
    row_t = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    row_old = (torch.randn(T, generator=g) * 0.3 - 4.0).to(DEVICE)
    seen = []
    for size, at, seed in PLACES:
        hidden, targets = _linear_batch(row, row_t, size, at, seed, dtype)
        old = torch.randn(size, T, generator=torch.Generator().manual_seed(seed)).to(DEVICE) - 4
        old[at] = row_old
        loss, _ = fused_rl.linear_policy_loss(
            hidden, weight, targets, torch.ones(size, device=DEVICE), old_logprobs=old,
            eps_high=0.28, num_items=10.0, chunk_tokens=16, backend=backend,
        )  # fmt: skip
        (d_hidden,) = torch.autograd.grad(loss, hidden)
        seen.append(d_hidden[at])
    for got in seen[1:]:
        assert torch.equal(got, seen[0])


@pytest.mark.parametrize(
    "op", ["linear_token_logprobs", "linear_policy_loss", "linear_policy_loss_full_kl_gspo"]
)
def test_linear_gemm_shapes_do_not_depend_on_the_batch(monkeypatch, op):
    """The guard: every GEMM the fused-linear ops issue for a row (the logits, and the hidden
    gradient ``dz W``) has the chunk's row count, whatever the batch; with
    ``config.batch_invariant = False`` the last chunk's does not (the test can fail)."""
    import torch.nn.functional as F

    import fused_rl.linear as linear

    shapes = []
    real_linear = F.linear
    real_grad = linear._hidden_grad

    def record_linear(x, w, b=None):
        shapes.append(("logits", x.shape[0]))
        return real_linear(x, w, b)

    def record_grad(dz, weight, chunk, dz_full=None, dtype=None):
        out = real_grad(dz, weight, chunk, dz_full, dtype)
        full = dz_full if dz_full is not None and fused_rl.config.batch_invariant else None
        rows = full.shape[0] if full is not None else linear._gemm_rows(dz, chunk).shape[0]
        shapes.append(("dH", rows))
        return out

    monkeypatch.setattr(linear.F, "linear", record_linear)
    monkeypatch.setattr(linear, "_hidden_grad", record_grad)
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(V, H, generator=g).to(DEVICE)
    for invariant in (True, False):
        monkeypatch.setattr(fused_rl.config, "batch_invariant", invariant)
        rows_seen = set()
        for size in (1, 3, 7):
            shapes.clear()
            hidden = torch.randn(size, T + 1, H, generator=g).to(DEVICE).requires_grad_(True)
            targets = torch.randint(0, V, (size, T), generator=g).to(DEVICE)
            if op == "linear_token_logprobs":
                out = fused_rl.linear_token_logprobs(hidden, weight, targets, chunk_tokens=16)
            else:  # the composed exact KL (GSPO): the reference's GEMMs too
                kl = dict(
                    ref_hidden=hidden.detach() * 0.5,
                    ref_weight=weight * 0.5,
                    kl_estimator="full",
                    beta=0.1,
                    importance_sampling="sequence",
                )
                out, _ = fused_rl.linear_policy_loss(
                    hidden, weight, targets, torch.ones(size, device=DEVICE),
                    old_logprobs=torch.full((size, T), -4.0, device=DEVICE), chunk_tokens=16,
                    **(kl if op.endswith("gspo") else {}),
                )  # fmt: skip
            out.sum().backward()
            assert {kind for kind, _ in shapes} == {"logits", "dH"}
            rows_seen |= {rows for _, rows in shapes}
        assert (rows_seen == {16}) == invariant, rows_seen
