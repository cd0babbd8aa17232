"""``linear_token_logprobs``: log-probs from hidden states in chunks, never the whole logits.

Oracle: float64 ``log_softmax(F.linear(h, W, b) / T)`` with autograd, on both backends;
gradients for hidden, weight and bias under random upstream gradients; awkward chunkings,
ignored tokens, the causal window (S > T), strided hidden states, bf16; the allocation
sizes (no N*V-sized buffer, forward or backward); gradcheck; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import FP32_TOL, assert_rel, gradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import fused_rl
from fused_rl._backend import interpreter_enabled
from fused_rl.linear import (
    CHUNK_BYTES,
    HEAD_CHUNK_ROWS,
    MAX_DEFAULT_CHUNK,
    HeadGrads,
    chunk_rows,
    default_chunk_tokens,
)
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")


def _oracle(h, w, b, targets, temperature, ignore_index=-100):
    """float64 ``(logp, entropy)`` of the materialised logits for ``(N, H)`` rows."""
    z = F.linear(h.double(), w.double(), None if b is None else b.double()) / temperature
    logsm = torch.log_softmax(z, -1)
    ok = targets != ignore_index
    logp = logsm.gather(-1, torch.where(ok, targets, 0)[..., None])[..., 0]
    logp = torch.where(ok, logp, torch.zeros_like(logp))
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, torch.where(ok, entropy, torch.zeros_like(entropy))  # as token_logprobs


def _inputs(n=13, hdim=8, vocab=37, dtype=torch.float32, device=DEVICE, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) / hdim**0.5).to(device, dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(device, dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[1] = -100
    return h, w, b, t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", (1, 4, 5, 13, 64))
@pytest.mark.parametrize("bias", (True, False))
def test_values_and_gradients_match_float64(backend, chunk, bias, device):
    h, w, b, t = _inputs(device=device, bias=bias)
    lp, ent = fused_rl.linear_token_logprobs(
        h, w, t, bias=b, temperature=0.7, return_entropy=True, chunk_tokens=chunk,
        backend=backend,
    )  # fmt: skip
    want_lp, want_ent = _oracle(h, w, b, t, 0.7)
    assert lp.dtype == torch.float32 and lp.shape == t.shape
    assert_rel(lp, want_lp, FP32_TOL)
    assert_rel(ent, want_ent, FP32_TOL)
    assert lp[1] == 0 and ent[1] == 0  # ignored
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = (torch.randn(t.shape, generator=g).to(device) for _ in range(2))
    params = [x for x in (h, w, b) if x is not None]
    got = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), params)
    leaves = [x.detach().double().requires_grad_() for x in params]
    o_lp, o_ent = _oracle(*leaves[:2], leaves[2] if bias else None, t, 0.7)
    want = torch.autograd.grad((o_lp * up_lp).sum() + (o_ent * up_ent).sum(), leaves)
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == params[0].dtype, name
        assert_rel(a, e, FP32_TOL, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_and_strided_hidden(backend, device):
    """(B, S, H) hidden with (B, T) targets, T < S: rows S-T-1 ... S-2 predict them, the
    others get a zero gradient; a strided (transposed) hidden works as is."""
    g = torch.Generator().manual_seed(2)
    leaf = torch.randn(7, 3, 8, generator=g).to(device).requires_grad_()
    hidden = leaf.transpose(0, 1)  # (3, 7, 8), non-contiguous
    w = torch.randn(29, 8, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 29, (3, 4), generator=g).to(device)
    lp = fused_rl.linear_token_logprobs(hidden, w, t, chunk_tokens=5, backend=backend)
    rows = hidden[:, 7 - 4 - 1 : 7 - 1].reshape(-1, 8)
    want, _ = _oracle(rows, w, None, t.reshape(-1), 1.0)
    assert lp.shape == (3, 4)
    assert_rel(lp.reshape(-1), want, FP32_TOL)
    up = torch.randn(3, 4, generator=g).to(device)
    (d_leaf,) = torch.autograd.grad((lp * up).sum(), leaf)
    d_hidden = d_leaf.transpose(0, 1)
    assert torch.count_nonzero(d_hidden[:, :2]) == 0 and torch.count_nonzero(d_hidden[:, 6]) == 0
    leaf64 = leaf.detach().double().requires_grad_()
    o_lp, _ = _oracle(leaf64.transpose(0, 1)[:, 2:6].reshape(-1, 8), w, None, t.reshape(-1), 1.0)
    (want_d,) = torch.autograd.grad((o_lp * up.reshape(-1)).sum(), leaf64)
    assert_rel(d_leaf, want_d, FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_as_accurate_as_materialised(backend, device):
    """bf16 hidden / weight: no worse than the materialised bf16 logits through
    token_logprobs (the same rounding of z), and dW accumulates in fp32 across chunks."""
    h, w, b, t = _inputs(n=24, vocab=53, dtype=torch.bfloat16, device=device)
    lp = fused_rl.linear_token_logprobs(h, w, t, bias=b, chunk_tokens=5, backend=backend)
    mat = fused_rl.token_logprobs(F.linear(h, w, b), t, backend=backend)
    want, _ = _oracle(h, w, b, t, 1.0)
    err = lambda x: ((x.double() - want).norm() / want.norm()).item()
    assert err(lp) <= 1.01 * err(mat) + 1e-7
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(device)
    got = torch.autograd.grad((lp * up).sum(), (h, w, b))
    ref = torch.autograd.grad((mat * up).sum(), (h, w, b))
    leaves = [x.detach().double().requires_grad_() for x in (h, w, b)]
    o_lp, _ = _oracle(*leaves, t, 1.0)
    exact = torch.autograd.grad((o_lp * up).sum(), leaves)
    for name, a, r, e in zip(("hidden", "weight", "bias"), got, ref, exact):
        assert a.dtype == torch.bfloat16, name
        rel = lambda x: ((x.double() - e).norm() / e.norm()).item()  # noqa: B023
        assert rel(a) <= 2 * rel(r) + 1e-3, (name, rel(a), rel(r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_logits_sized_allocation(backend):
    """Forward and backward allocate nothing as large as the N*V logits: one chunk's
    logits (and its fp32 copy or dW) at most."""
    n, vocab, hdim, chunk = 64, 1000, 16, 8
    h, w, b, t = _inputs(n=n, hdim=hdim, vocab=vocab)
    logits_bytes = n * vocab * 4
    with AllocationTracker() as a:
        lp, ent = fused_rl.linear_token_logprobs(
            h, w, t, bias=b, return_entropy=True, chunk_tokens=chunk, backend=backend
        )
        (lp.sum() + ent.sum()).backward()
    assert a.sizes, "nothing recorded"
    assert a.count_at_least(logits_bytes) == 0, sorted(a.sizes)[-5:]
    chunk_bytes = chunk * vocab * 4
    weight_bytes = vocab * hdim * 4
    assert max(a.sizes) <= max(chunk_bytes, weight_bytes), sorted(a.sizes)[-5:]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_head_grads_padded_shard_no_second_weight_copy(dtype):
    """A padded vocabulary shard (the chunks cover its first ``valid`` rows): the lm_head's
    and the bias's gradients over every row, zero on the padding, equal to ``dz^T h``; the
    fp32 accumulator is the one weight-sized buffer of an fp32 head (no padded copy of it),
    a 16-bit head's adds its cast only."""
    n, vocab, valid, hdim, chunk = 11, 13, 9, 6, 4
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(n, hdim, generator=g).to(dtype)
    weight = torch.randn(vocab, hdim, generator=g).to(dtype)
    dz = torch.randn(n, valid, generator=g).to(dtype)
    with AllocationTracker() as a:
        grads = HeadGrads(rows, weight, (False, True, True), valid=valid)
        for start in range(0, n, chunk):
            r = slice(start, min(start + chunk, n))
            grads.add(r, dz[r], None, rows[r], weight[:valid], chunk)
        _, d_weight, d_bias = grads.grads(dtype)
    want_w = torch.zeros(vocab, hdim, dtype=torch.float64)
    want_w[:valid] = dz.double().t() @ rows.double()
    want_b = torch.zeros(vocab, dtype=torch.float64)
    want_b[:valid] = dz.double().sum(0)
    assert d_weight.dtype == d_bias.dtype == dtype
    assert d_weight.shape == weight.shape and d_bias.shape == (vocab,)
    tol = FP32_TOL if dtype == torch.float32 else 1e-2
    assert_rel(d_weight, want_w, tol)
    assert_rel(d_bias, want_b, tol)
    assert (d_weight[valid:] == 0).all() and (d_bias[valid:] == 0).all()
    # weight-sized: at least a 16-bit (V, H); the valid rows' fp32 GEMM output is as large
    weight_sized = a.count_at_least(vocab * hdim * 2)
    assert weight_sized == (1 if dtype == torch.float32 else 2), sorted(a.sizes)[-4:]


def test_no_grad_computes_statistics_only():
    h, w, b, t = _inputs()
    with torch.no_grad():
        lp = fused_rl.linear_token_logprobs(h, w, t, bias=b, chunk_tokens=4, backend="triton")
    assert not lp.requires_grad
    assert_rel(lp, _oracle(h, w, b, t, 1.0)[0], FP32_TOL)


def test_tied_weight_accumulates():
    """A weight tied to the input embedding gets both gradients."""
    h, w, _, t = _inputs(bias=False)
    ids = torch.tensor([3, 5, 5], device=DEVICE)
    emb = F.embedding(ids, w).sum()
    lp = fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=4, backend="triton")
    (got,) = torch.autograd.grad(lp.sum() + emb, w)
    w2 = w.detach().double().requires_grad_()
    o_lp, _ = _oracle(h, w2, None, t, 1.0)
    (want,) = torch.autograd.grad(o_lp.sum() + F.embedding(ids, w2).sum(), w2)
    assert_rel(got, want, FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    h, w, b, t = _inputs(n=5, hdim=3, vocab=7, dtype=torch.float64)
    fn = lambda h, w, b: fused_rl.linear_token_logprobs(  # noqa: E731
        h, w, t, bias=b, temperature=1.3, return_entropy=True, chunk_tokens=2, backend=backend
    )
    assert gradcheck(fn, (h, w, b))


def test_default_chunk_keeps_a_chunk_under_the_budget():
    """256 MiB of logits, or up to HEAD_CHUNK_ROWS rows under 2 V H bytes (a 16-bit lm_head's
    size): fewer read-writes of the fp32 dW; never more than MAX_DEFAULT_CHUNK rows."""
    rows = default_chunk_tokens(151936, torch.bfloat16)
    assert rows == 883 and rows * 151936 * 2 <= CHUNK_BYTES
    assert default_chunk_tokens(10, torch.float32) * 40 <= CHUNK_BYTES
    assert default_chunk_tokens(10**9, torch.float32) == 1
    # with the lm_head's H: Qwen2.5-7B's head in bf16 / fp32, a 0.5B-sized head, a 70B one
    assert default_chunk_tokens(151936, torch.bfloat16, 4096) == HEAD_CHUNK_ROWS == 2048
    assert default_chunk_tokens(151936, torch.float32, 4096) == 2048
    assert default_chunk_tokens(151936, torch.bfloat16, 896) == 896  # 2 V H bytes
    assert default_chunk_tokens(151936, torch.bfloat16, 512) == 883  # 256 MiB: more
    assert default_chunk_tokens(128256, torch.bfloat16, 8192) == 2048
    assert default_chunk_tokens(10, torch.bfloat16, 4096) == MAX_DEFAULT_CHUNK
    for vocab, hdim in ((151936, 4096), (151936, 896), (262144, 2560), (32000, 4096)):
        rows = default_chunk_tokens(vocab, torch.bfloat16, hdim)
        assert rows * vocab * 2 <= max(CHUNK_BYTES, 2 * vocab * hdim)
        # the two models' logits of the exact KL / distillation: half the rows
        assert chunk_rows(vocab, 4, hdim) * vocab * 4 <= max(CHUNK_BYTES, 2 * vocab * hdim)


class _WeightSizedOps(TorchDispatchMode):
    """The aten ops that return a fresh ``shape``-sized tensor (views left out)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        view = func._schema.is_mutable or any(r.alias_info for r in func._schema.returns)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape and not view:
            self.ops.append(func.overloadpacket.__name__)
        elif func._schema.is_mutable and any(
            isinstance(a, torch.Tensor) and tuple(a.shape) == self.shape for a in args[:1]
        ):
            self.ops.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_policy_loss",
                                "linear_distill_loss"])  # fmt: skip
def test_weight_gradient_is_made_by_the_first_chunk(op, backend):
    """The lm_head's fp32 gradient is the first chunk's GEMM output, and each later chunk
    adds to it in place: no zero fill of a ``(V, H)`` buffer and no read of zeros (``8 V H``
    bytes a call). Three chunks of 4 rows of 10: one ``mm``, two ``addmm_``; the cast to
    the weight's dtype is none here (fp32), and a loss whose gradients were formed in the
    forward (``linear_distill_loss``) has them scaled in place by the backward, a Triton
    launch or ``mul_``, never a fresh copy."""
    h, w, b, t = _inputs(n=10, hdim=6, vocab=29, bias=False)
    chunks = dict(chunk_tokens=4, backend=backend)
    teacher = (h.detach().flip(0), w.detach() * 0.5)
    adv, old = torch.ones(1, device=h.device), torch.full((1, 10), -3.0, device=h.device)
    with _WeightSizedOps(w.shape) as seen:
        if op == "linear_token_logprobs":
            out = fused_rl.linear_token_logprobs(h, w, t, **chunks).sum()
        elif op == "linear_policy_loss":
            out = fused_rl.linear_policy_loss(h[None], w, t[None], adv, old_logprobs=old,
                                              **chunks)[0]  # fmt: skip
        else:
            out = fused_rl.linear_distill_loss(h, w, *teacher, **chunks)[0]
        out.backward(torch.tensor(0.5, device=h.device))
    scaled = ["mul_"] if (op, backend) == ("linear_distill_loss", "reference") else []
    assert seen.ops == ["mm", "addmm_", "addmm_", *scaled]
    assert w.grad is not None and torch.isfinite(w.grad).all()


def _formed_loss(op, backend, dtype):
    """A loss of ``op`` whose gradients are formed in its forward, and its leaves."""
    h, w, _, t = _inputs(n=10, hdim=6, vocab=29, dtype=dtype, bias=False)
    if op == "linear_policy_loss":
        old = torch.full((1, 10), -3.0, device=h.device)
        adv = torch.ones(1, device=h.device)
        loss = fused_rl.linear_policy_loss(h[None], w, t[None], adv, old_logprobs=old,
                                           chunk_tokens=4, backend=backend)[0]  # fmt: skip
    else:
        loss = fused_rl.linear_distill_loss(h, w, h.detach().flip(0), w.detach() * 0.5,
                                            chunk_tokens=4, backend=backend)[0]  # fmt: skip
    return loss, (h, w)


FORMED = [("linear_policy_loss", "triton"), ("linear_distill_loss", "triton"),
          ("linear_distill_loss", "reference")]  # fmt: skip


@pytest.mark.parametrize(("op", "backend"), FORMED)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_formed_gradients_scaled_in_place_once(op, backend, dtype):
    """The gradients formed in the forward are scaled in place by the backward and handed
    to autograd: with an upstream gradient of 1 they are the forward's bits; with 0.37 the
    forward's times 0.37, computed in fp32 and rounded once. A second backward through the
    same call (``retain_graph=True``) forms them again: the values a fresh call gives, the
    first backward's results untouched."""
    loss, leaves = _formed_loss(op, backend, dtype)
    ones = torch.autograd.grad(loss, leaves, retain_graph=True)
    kept = [g.clone() for g in ones]
    up = torch.tensor(0.37, device=loss.device)
    again = torch.autograd.grad(loss, leaves, up)
    fresh_loss, fresh_leaves = _formed_loss(op, backend, dtype)
    scaled = torch.autograd.grad(fresh_loss, fresh_leaves, up)
    # a second backward run under autocast forms them as the forward did (autocast off)
    loss, leaves = _formed_loss(op, backend, dtype)
    torch.autograd.grad(loss, leaves, retain_graph=True)
    with torch.autocast(loss.device.type, dtype=torch.bfloat16):
        under = torch.autograd.grad(loss, leaves, up)
    for got, other in zip(scaled, under):
        assert torch.equal(got, other)
    for one, first, got, other in zip(ones, kept, scaled, again):
        assert torch.equal(one, first) and torch.equal(got, other)
        want = (one.float() * up).to(dtype)
        if dtype == torch.bfloat16 and backend == "triton" and interpreter_enabled():
            # the interpreter rounds fp32 -> bf16 toward zero (a GPU, as torch, to nearest
            # even): within one unit in the last place there
            err = (got.double() - want.double()).abs()
            assert (err <= torch.finfo(dtype).eps * want.double().abs()).all()
        else:
            assert torch.equal(got, want)


def test_bad_arguments_name_themselves():
    h, w, b, t = _inputs()
    with pytest.raises(ValueError, match="weight must be the lm_head's"):
        fused_rl.linear_token_logprobs(h, w[:, :5], t)
    with pytest.raises(ValueError, match="bias must be"):
        fused_rl.linear_token_logprobs(h, w, t, bias=b[:3])
    with pytest.raises(TypeError, match="weight .* and hidden .* must share a dtype"):
        fused_rl.linear_token_logprobs(h.double(), w, t)  # a narrower head is not cast up
    with pytest.raises(ValueError, match="targets must be"):
        fused_rl.linear_token_logprobs(h, w, t[:4])
    with pytest.raises(ValueError, match="hidden must be"):
        fused_rl.linear_token_logprobs(h[0], w, t)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="targets"):
        fused_rl.linear_token_logprobs(h, w, torch.full_like(t, 37))
    with pytest.raises(ValueError, match="targets must be"):
        fused_rl.linear_token_logprobs(h.reshape(1, 13, 8), w, t.reshape(1, 13)[:, None])


# ----------------------------------------------------------------------------- policy loss

_POLICY_CASES = {
    "grpo": dict(eps_high=0.28, beta=0.04, kl_estimator="k3"),
    "ppo+entropy": dict(dual_clip=3.0, entropy_coef=0.01, loss_agg="seq-mean-token-mean"),
    "gspo": dict(importance_sampling="sequence", eps_low=3e-4, eps_high=4e-4),
    "rloo": dict(importance_sampling="sequence-sum", eps_low=2e-3, eps_high=3e-3),
    "dr-grpo": dict(loss_agg="seq-mean-token-sum-norm", with_entropy=True, temperature=0.7),
}


def _rollout(device, dtype=torch.float32, seed=4):
    g = torch.Generator().manual_seed(seed)
    batch, positions, length, hdim, vocab = 3, 7, 5, 8, 41
    h = torch.randn(batch, positions, hdim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) / 2).to(device, dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (batch, length), generator=g).to(device)
    t[0, 2] = -100
    rollout = dict(
        advantages=torch.randn(batch, generator=g).to(device),
        old_logprobs=(torch.randn(batch, length, generator=g) * 0.3 - 3).to(device),
        ref_logprobs=(torch.randn(batch, length, generator=g) * 0.3 - 3).to(device),
        mask=(torch.rand(batch, length, generator=g) > 0.2).to(device),
    )
    return h, w, b, t, rollout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(_POLICY_CASES))
def test_linear_policy_loss_matches_policy_loss(case, backend, device):
    """Same loss, metrics and gradients as policy_loss on the materialised logits (the
    oracle: the reference policy_loss in float64 on float64 logits)."""
    h, w, b, t, r = _rollout(device)
    kw = _POLICY_CASES[case]
    adv = r.pop("advantages")
    if case == "gspo":  # GSPO's ratio is near 1: old log-probs near the current ones
        with torch.no_grad():
            r["old_logprobs"] = fused_rl.linear_token_logprobs(h, w, t, bias=b) - 1e-4
    loss, metrics = fused_rl.linear_policy_loss(
        h, w, t, adv, bias=b, chunk_tokens=4, backend=backend, **r, **kw
    )
    leaves = [x.detach().double().requires_grad_() for x in (h, w, b)]
    want, want_metrics = fused_rl.policy_loss(
        F.linear(*leaves), t, adv.double(), backend="reference",
        **{k: v.double() if v.is_floating_point() else v for k, v in r.items()}, **kw,
    )  # fmt: skip
    assert_rel(loss, want, FP32_TOL, "loss")
    assert set(metrics) == set(want_metrics)
    for name in metrics:  # near-cancelling means (approx_kl ~ 1e-4): an absolute floor
        torch.testing.assert_close(
            metrics[name].double(), want_metrics[name].double().to(metrics[name].device),
            rtol=1e-4, atol=1e-6, msg=name,
        )  # fmt: skip
    upstream = torch.tensor(0.37)  # the gradients are formed forward and scaled backward
    got = torch.autograd.grad(loss, (h, w, b), upstream.to(loss))
    exact = torch.autograd.grad(want, leaves, upstream.to(want))
    for name, a, e in zip(("hidden", "weight", "bias"), got, exact):
        assert_rel(a, e, FP32_TOL, name)
    assert torch.count_nonzero(got[0][:, :1]) == 0 and torch.count_nonzero(got[0][:, -1]) == 0


def test_linear_policy_loss_float_mask_and_ignored_tokens():
    """A float mask weights tokens; an ignored target never counts, whatever its weight."""
    h, w, b, t, r = _rollout(DEVICE)
    weights = torch.rand(t.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    loss, _ = fused_rl.linear_policy_loss(
        h, w, t, r["advantages"], bias=b, mask=weights, old_logprobs=r["old_logprobs"],
        backend="triton",
    )  # fmt: skip
    want, _ = fused_rl.policy_loss(
        F.linear(h, w, b), t, r["advantages"], mask=weights, old_logprobs=r["old_logprobs"],
        backend="reference",
    )  # fmt: skip
    assert_rel(loss, want, FP32_TOL)
    with pytest.raises(ValueError, match="mask must have shape"):
        fused_rl.linear_policy_loss(h, w, t, r["advantages"], mask=weights[:, :2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_no_logits_sized_allocation(backend):
    g = torch.Generator().manual_seed(6)
    batch, length, hdim, vocab = 4, 16, 16, 1000
    h = torch.randn(batch, length + 1, hdim, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(vocab, hdim, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, vocab, (batch, length), generator=g).to(DEVICE)
    adv = torch.randn(batch, generator=g).to(DEVICE)
    ref = torch.zeros(batch, length, device=DEVICE)
    with AllocationTracker() as a:
        loss, _ = fused_rl.linear_policy_loss(
            h, w, t, adv, entropy_coef=0.01, beta=0.1, ref_logprobs=ref, chunk_tokens=8,
            backend=backend,
        )  # fmt: skip
        loss.backward()
    assert a.count_at_least(batch * length * vocab * 4) == 0, sorted(a.sizes)[-5:]


def test_linear_policy_loss_module():
    from fused_rl.nn import LinearPolicyLoss

    h, w, b, t, r = _rollout(DEVICE)
    module = LinearPolicyLoss(eps_high=0.28, beta=0.04, chunk_tokens=3, backend="reference")
    loss, metrics = module(h, w, t, r["advantages"], bias=b, ref_logprobs=r["ref_logprobs"])
    want, _ = fused_rl.linear_policy_loss(
        h, w, t, r["advantages"], bias=b, ref_logprobs=r["ref_logprobs"], eps_high=0.28,
        beta=0.04, chunk_tokens=3, backend="reference",
    )  # fmt: skip
    assert torch.equal(loss, want) and "kl" in metrics
    assert "chunk_tokens=3" in repr(module)
    with pytest.raises(ValueError, match="chunk_tokens"):
        LinearPolicyLoss(chunk_tokens=0)
    with pytest.raises(TypeError, match="unknown options"):
        LinearPolicyLoss(chunk=3)


@pytest.mark.no_poison  # Dynamo cannot trace the NaN-filling torch.empty of the fixture
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    """Both ops trace with ``torch.compile(fullgraph=True)`` and give the eager results."""
    h, w, b, t, r = _rollout(DEVICE)

    def loss_fn(h, w, b):
        lp = fused_rl.linear_token_logprobs(h, w, t, bias=b, chunk_tokens=4, backend=backend)
        loss, metrics = fused_rl.linear_policy_loss(
            h, w, t, r["advantages"], bias=b, old_logprobs=r["old_logprobs"], beta=0.04,
            ref_logprobs=r["ref_logprobs"], entropy_coef=0.01, chunk_tokens=4, backend=backend,
        )  # fmt: skip
        return loss + 0.1 * lp.sum(), metrics["kl"]

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    got, got_kl = compiled(h, w, b)
    want, want_kl = loss_fn(h, w, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_kl, want_kl)
    for a, e in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises(backend):
    """The gradients come from saved statistics: a Hessian-vector product raises instead
    of being silently wrong."""
    h, w, b, t = _inputs(n=5, hdim=4, vocab=7, dtype=torch.float64)
    for wrt in ((w,), (h, w, b)):
        lp = fused_rl.linear_token_logprobs(h, w, t, bias=b, chunk_tokens=2, backend=backend)
        grads = torch.autograd.grad(lp.sum(), wrt, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.grad(sum((g**2).sum() for g in grads), wrt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_matches_eager_autocast(backend):
    """Under autocast, bf16 hidden next to an fp32 lm_head works as F.linear does, and the
    backward recomputes exactly the forward's (bf16) logits."""
    g = torch.Generator().manual_seed(7)
    h = (torch.randn(24, 16, generator=g) * 4).to(DEVICE, torch.bfloat16).requires_grad_()
    w = torch.randn(53, 16, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, 53, (24,), generator=g).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        lp = fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=5, backend=backend)
        eager = fused_rl.token_logprobs(F.linear(h, w), t, backend="reference")
    assert_rel(lp, eager, FP32_TOL)
    up = torch.randn(t.shape, generator=g).to(DEVICE)
    got = torch.autograd.grad((lp * up).sum(), (h, w))
    want = torch.autograd.grad((eager * up).sum(), (h, w))
    for name, a, e in zip(("hidden", "weight"), got, want):
        assert a.dtype == e.dtype, name
        assert_rel(a, e, 1e-2, name)  # both bf16: the same rounding of z, summed apart


class _GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (aten mm / addmm / linear / matmul) a call runs."""

    GEMMS = ("mm", "addmm", "addmm_", "linear", "matmul", "bmm")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("importance_sampling", "grad", "per_chunk"),
    [("token", True, 3), ("sequence", True, 4), ("token", False, 1)],
)
def test_linear_policy_loss_gemms_per_chunk(importance_sampling, grad, per_chunk):
    """Token-level IS with grad: the gradients are formed in the forward, three GEMMs per
    chunk in all (logits, dH, dW) and none in the backward; GSPO needs every sequence total
    before any gradient, so its backward recomputes the logits (four); no_grad: one."""
    h, w, b, t, r = _rollout(DEVICE)
    kw = dict(bias=b, chunk_tokens=4, importance_sampling=importance_sampling,
              old_logprobs=r["old_logprobs"], backend="triton")  # fmt: skip
    chunks = -(-t.numel() // 4)
    with _GemmCounter() as forward, torch.set_grad_enabled(grad):
        loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], **kw)
    with _GemmCounter() as backward:
        if grad:
            loss.backward()
    assert forward.count + backward.count == per_chunk * chunks
    if grad and importance_sampling == "token":
        assert backward.count == 0


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
def test_linear_policy_loss_one_vocab_kernel_per_chunk():
    """The fused path reads each chunk's logits with ONE Triton kernel (statistics, loss
    epilogue and the gradient written in place), plus one reduction for the whole call."""
    h, w, b, t, r = _rollout(DEVICE)
    with LaunchCounter() as c:
        loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], bias=b, chunk_tokens=4,
                                              entropy_coef=0.01, backend="triton")  # fmt: skip
        loss.backward()
    chunks = -(-t.numel() // 4)
    assert c.kernels.count("_policy_loss_fwd_kernel") == chunks, c.kernels
    # and the backward's in-place scale by the upstream gradient (nothing when it is 1)
    assert sorted(set(c.kernels)) == [
        "_policy_finalize_kernel", "_policy_loss_fwd_kernel", "_scale_rows_unless_one_kernel"
    ]  # fmt: skip
    assert c.kernels.count("_policy_finalize_kernel") == 1


@pytest.mark.parametrize("frozen", ("weight", "hidden"))
def test_linear_policy_loss_frozen_input(frozen):
    """A frozen lm_head (or hidden) gets no gradient and costs no GEMM for it."""
    h, w, b, t, r = _rollout(DEVICE)
    (w if frozen == "weight" else h).requires_grad_(False)
    b.requires_grad_(False)
    args = (h, w, t, r["advantages"])
    loss, _ = fused_rl.linear_policy_loss(*args, bias=b, chunk_tokens=4, backend="triton")
    want, _ = fused_rl.linear_policy_loss(*args, bias=b, chunk_tokens=4, backend="reference")
    live = h if frozen == "weight" else w
    (got,) = torch.autograd.grad(loss, (live,))
    (exact,) = torch.autograd.grad(want, (live,))
    assert_rel(got, exact, FP32_TOL)


def test_linear_policy_loss_tied_weight_and_double_backward():
    """A weight used twice (tied embedding) accumulates both gradients; a second backward
    through the fused gradients raises."""
    h, w, b, t, r = _rollout(DEVICE, dtype=torch.float64)
    for backend in BACKENDS:
        loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], chunk_tokens=4,
                                              backend=backend)  # fmt: skip
        (g_tied,) = torch.autograd.grad(loss + (w**2).sum(), (w,))
        (g_loss,) = torch.autograd.grad(
            fused_rl.linear_policy_loss(h, w, t, r["advantages"], chunk_tokens=4,
                                        backend=backend)[0], (w,))  # fmt: skip
        torch.testing.assert_close(g_tied, g_loss + 2 * w.detach())
    loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], backend="triton")
    (gw,) = torch.autograd.grad(loss, (w,), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad((gw**2).sum(), (w,))


def test_linear_policy_loss_bf16_as_accurate_as_materialised():
    """bf16: the fused-linear loss and its gradients are no worse than policy_loss on the
    materialised bf16 logits, against the float64 oracle (dW summed in fp32)."""
    h, w, b, t, r = _rollout(DEVICE, dtype=torch.bfloat16)
    kw = dict(old_logprobs=r["old_logprobs"], mask=r["mask"], entropy_coef=0.01,
              eps_high=0.28)  # fmt: skip
    loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], bias=b, chunk_tokens=5,
                                          backend="triton", **kw)  # fmt: skip
    mat, _ = fused_rl.policy_loss(F.linear(h, w, b), t, r["advantages"], backend="triton", **kw)
    leaves = [x.detach().double().requires_grad_() for x in (h, w, b)]
    exact, _ = fused_rl.policy_loss(F.linear(*leaves), t, r["advantages"].double(),
                                    backend="reference", **kw)  # fmt: skip
    err = lambda x, e: ((x.double() - e).norm() / e.norm()).item()  # noqa: E731
    assert err(loss, exact) <= 1.01 * err(mat, exact) + 1e-6
    got = torch.autograd.grad(loss, (h, w, b))
    ref = torch.autograd.grad(mat, (h, w, b))
    for name, a, m, e in zip(("hidden", "weight", "bias"), got, ref,
                             torch.autograd.grad(exact, leaves)):  # fmt: skip
        assert a.dtype == torch.bfloat16, name
        assert err(a, e) <= 2 * err(m, e) + 1e-3, (name, err(a, e), err(m, e))


def test_linear_policy_loss_num_items_and_empty_batch():
    """A global token count (number or tensor) normalises token-mean; an empty batch with a
    bad count tensor is NaN, never a silent 0."""
    h, w, b, t, r = _rollout(DEVICE)
    for n in (40, torch.tensor(40.0, device=DEVICE)):
        loss, _ = fused_rl.linear_policy_loss(h, w, t, r["advantages"], num_items=n,
                                              backend="triton")  # fmt: skip
        want, _ = fused_rl.policy_loss(F.linear(h, w), t, r["advantages"], num_items=n,
                                       backend="reference")  # fmt: skip
        assert_rel(loss, want, FP32_TOL)
        assert_rel(torch.autograd.grad(loss, (w,))[0], torch.autograd.grad(want, (w,))[0],
                   FP32_TOL)  # fmt: skip
    empty = t[:0]
    bad_count = torch.tensor(0.0, device=DEVICE)
    loss, _ = fused_rl.linear_policy_loss(h[:0], w, empty, r["advantages"][:0],
                                          num_items=bad_count, backend="triton")  # fmt: skip
    assert torch.isnan(loss)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("mask_kind", ["bool", "weights", "none", "nothing_counted"])
def test_linear_policy_loss_skips_padding_rows(loss_agg, mask_kind, monkeypatch, device):
    """``config.skip_padding_rows`` (the default): the GEMMs run on the counted rows only,
    with the loss, every metric (the IS weights' minimum included: a skipped row holds the
    +inf an uncounted one writes) and every gradient those of the run over all rows (padding
    rows' hidden gradient exactly zero), and the GEMMs' row count down by the padding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmRows(TorchDispatchMode):  # rows through the logits GEMM (the (M, V) outputs)
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("addmm", "mm")) and out.shape[-1] == w.shape[0]:
                self.rows += out.shape[0]
            return out

    h, w, b, t, r = _rollout(device)
    adv = r.pop("advantages")
    if mask_kind == "weights":
        r["mask"] = r["mask"] * torch.rand(r["mask"].shape, generator=torch.Generator()
                                           .manual_seed(9)).to(device)  # fmt: skip
    elif mask_kind == "none":
        r.pop("mask")
    elif mask_kind == "nothing_counted":
        r["mask"] = torch.zeros_like(r["mask"])
    is_w = (torch.rand(t.shape, generator=torch.Generator().manual_seed(5)) + 0.5).to(device)
    kw = dict(bias=b, chunk_tokens=4, loss_agg=loss_agg, beta=0.04, entropy_coef=0.01,
              is_weights=is_w, **r)  # fmt: skip
    runs = {}
    for skip in (False, True):
        monkeypatch.setattr(fused_rl.config, "skip_padding_rows", skip)
        for x in (h, w, b):
            x.grad = None
        with GemmRows() as gemm:
            loss, metrics = fused_rl.linear_policy_loss(h, w, t, adv, **kw)
        if loss.requires_grad:
            loss.backward()
        grads = [None if x.grad is None else x.grad.clone() for x in (h, w, b)]
        runs[skip] = (loss.detach(), metrics, grads, gemm.rows)
    (loss0, m0, g0, rows0), (loss1, m1, g1, rows1) = runs[False], runs[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert set(m1) == set(m0)
    for name in m0:
        torch.testing.assert_close(m1[name], m0[name], rtol=1e-6, atol=1e-7, equal_nan=True)
    for a, e in zip(g1, g0):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, equal_nan=True)
    counted = (t != -100) & (r["mask"] != 0 if "mask" in r else True)
    padding = ~counted
    if g1[0] is not None and padding.any():  # the rows S-T-1 ... S-2 predict the targets
        window = g1[0][:, h.shape[1] - t.shape[1] - 1 : -1]
        assert (window[padding] == 0).all()
    # every GEMM has the chunk's 4 rows (config.batch_invariant): the last one padded
    padded = lambda n: -(-n // 4) * 4  # noqa: E731
    assert rows0 == padded(t.numel()) and rows1 == padded(int(counted.sum()))


def test_make_fx_records_the_linear_ops(monkeypatch, device):
    """``make_fx`` with fake tensors (``torch.export``; torch 2.11's AOT trace of a compiled
    backward) records the fused-linear ops' vocab kernels as custom ops instead of running
    their in-place launchers on fake tensors ("Cannot access data pointer")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(fused_rl.config, "check_values", False)
    h, w, b, t, r = _rollout(device)
    adv = r.pop("advantages")

    def step(hidden, weight, targets, advantages, old, ref, mask):
        hidden = hidden.detach().requires_grad_()
        weight = weight.detach().requires_grad_()
        lp = fused_rl.linear_token_logprobs(hidden, weight, targets, chunk_tokens=4)
        loss, _ = fused_rl.linear_policy_loss(
            hidden, weight, targets, advantages, chunk_tokens=4, beta=0.04,
            old_logprobs=old, ref_logprobs=ref, mask=mask,
        )  # fmt: skip
        return torch.autograd.grad(loss + lp.sum(), (hidden, weight))

    inputs = (h, w, t, adv, r["old_logprobs"], r["ref_logprobs"], r["mask"])
    graph = make_fx(step, tracing_mode="fake")(*inputs)
    ops = {str(n.target) for n in graph.graph.nodes if "fused_rl" in str(n.target)}
    assert {"fused_rl.policy_rows_grad_fwd.default", "fused_rl.token_stats_bwd.default"} <= ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_fp32_head_takes_half_precision_hidden_states(backend):
    """An fp32 lm_head with bf16 hidden states (TRL's ``cast_lm_head_to_fp32``): the hidden
    states are cast up, so the result is the fp32 computation on ``hidden.float()``, and
    ``hidden``'s gradient comes back in bf16."""
    h, w, _, t = _inputs()
    h16 = h.to(torch.bfloat16).detach().requires_grad_()
    h32 = h16.detach().float().requires_grad_()
    adv = torch.ones(1, device=t.device)
    old = torch.full((1, t.shape[0]), -3.5, device=t.device)
    for op, view, kw in (
        (fused_rl.linear_token_logprobs, lambda x: x, {}),
        (fused_rl.linear_policy_loss, lambda x: x[None], {"old_logprobs": old}),
    ):
        w32 = w.detach().requires_grad_()
        w_ref = w.detach().requires_grad_()
        args = (view(t), adv) if kw else (t,)
        out = op(view(h16), w32, *args, chunk_tokens=5, backend=backend, **kw)
        want = op(view(h32), w_ref, *args, chunk_tokens=5, backend=backend, **kw)
        out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
        assert out.dtype == want.dtype == torch.float32
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        up = torch.randn_like(out)
        g16 = torch.autograd.grad(out, [h16, w32], up)
        g32 = torch.autograd.grad(want, [h32, w_ref], up)
        assert g16[0].dtype == torch.bfloat16 and g16[1].dtype == torch.float32
        torch.testing.assert_close(g16[0], g32[0].to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(g16[1], g32[1], rtol=0, atol=0)
