"""``whole_rows``: the ops from hidden states compiled by Inductor for the CPU give the eager
values when a chunk's rows broadcast per-sequence values.

torch 2.13's C++ Inductor splits a loop of ``C`` rows indexed by ``row // T`` into ``C // T``
times ``T`` iterations without checking that ``T`` divides ``C``: a chunk of 32 rows over
sequences of 24 tokens, reading a per-sequence weight, computed 24 rows and read the other 8
from memory nothing wrote (an out-of-bounds target id). Here the chunk loops' per-token
inputs and gradients are whole buffers first (``fused_rl._whole_rows``). Of the three ops
compiled here, the log-probs' backward (a per-sequence weight in its incoming gradient) is
the one that failed without that; the policy and distillation losses, whose sites are
covered the same way, are compiled beside it for their values."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel

import fused_rl
from fused_rl._whole_rows import whole_rows

B, T, V, H, CHUNK = 2, 24, 37, 8, 32  # T > 8 (the pass's threshold), 32 % 24 != 0


def _heads(h, w, targets, adv, old, keep, th, tw):
    """Three linear ops on the reference backend, each with a per-sequence factor in the
    rows it chunks: log-probs weighted per sequence (their gradient broadcasts ``adv``), the
    policy loss with a per-sequence mask and ``seq-mean-token-mean``, the distillation loss
    with the same mask."""
    mask = keep[:, None].expand(B, T)
    common = dict(chunk_tokens=CHUNK, backend="reference")
    logp = fused_rl.linear_token_logprobs(h, w, targets, **common)
    pg = fused_rl.linear_policy_loss(h, w, targets, adv, old_logprobs=old, mask=mask,
                                     loss_agg="seq-mean-token-mean", **common)[0]  # fmt: skip
    kd = fused_rl.linear_distill_loss(h, w, th, tw, mask=mask, loss_agg="seq-mean-token-mean",
                                      **common)[0]  # fmt: skip
    return torch.stack(((logp * adv[:, None]).sum(), pg, kd))


@pytest.mark.no_poison  # the NaN fill traces as a copy into a fresh buffer: Inductor refuses it
def test_inductor_cpu_chunks_of_broadcast_rows_match_eager():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) / 3
    consts = (
        torch.randint(0, V, (B, T), generator=g),  # targets
        torch.randn(B, generator=g),  # one advantage per sequence
        torch.randn(B, T, generator=g) * 0.3 - 3,  # old log-probs
        torch.tensor([0.0, 1.0]),  # a whole sequence masked out
        torch.randn(B, T, 5, generator=g),  # the teacher's hidden states
        torch.randn(V, 5, generator=g),  # and lm_head
    )
    up = torch.tensor([0.7, -1.3, 2.1])  # each loss's upstream gradient

    def value_grads(fn):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        out = fn(*leaves, *consts)
        return (out.detach(), *torch.autograd.grad((out * up).sum(), leaves))

    torch._dynamo.reset()
    got = value_grads(torch.compile(_heads, fullgraph=True, backend="inductor"))
    want = value_grads(_heads)
    for name, a, e in zip(("losses", "d_hidden", "d_weight"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert_rel(a, e, 1e-5, name)


def test_eager_and_other_calls_return_the_tensor_itself():
    x = torch.arange(6.0).view(2, 3).t()  # strided: still no copy outside Inductor
    assert whole_rows(x) is x
    assert whole_rows(None) is None
    traced = torch.compile(lambda t: whole_rows(t) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(traced(x), x * 2)  # the copy, compiled: the values, contiguous or not
