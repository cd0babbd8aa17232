"""``linear_token_logprobs(top_k=, top_p=)``: truncated log-probs from hidden states, in chunks.

Oracle: float64, written here from the rules ``fused_rl.truncated_logprobs`` documents: the
logits ``F.linear(h, W, b)`` materialised in float64, divided by the temperature; top-k keeps
``z >=`` the k-th largest (counted with multiplicity, ties kept); top-p then keeps ``z >= v*``,
``v*`` the largest kept value whose ``{z >= v*}`` holds at least ``top_p`` of the top-k set's
mass; the log-prob is ``z_y - logsumexp(z over the kept set)``, ``-inf`` for a target outside
it. The kept set is a discontinuous function of the logits, so the oracle also asserts that
every cut it makes is decided with a margin far above the rounding of the op's GEMM (fp32:
1e-4 in logits, 1e-5 in probability; bf16: 5e-2 and 5e-3; exact ties, from zero lm_head rows
with equal biases, are exact in any precision). Values and gradients of hidden / weight /
bias under random upstream gradients, both backends, several chunks, ``(B, S, H)`` hidden
with ``S > T``, ignored tokens, fp32 and bf16, cut targets, ties, gradcheck,
``torch.compile``, the cost per chunk, bad arguments.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import F64_TOL, FP32_TOL, assert_rel, bf16_tol, gradcheck

import fused_rl
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
NEG_INF = float("-inf")
# the least gap a cut must have: (in tempered logits at the k-th value, in probability at
# the top-p crossing); bf16 logits of magnitude <= 4 round by <= 0.008
FP32_MARGIN, BF16_MARGIN = (1e-4, 1e-5), (5e-2, 5e-3)


# ----------------------------------------------------------------------------- oracle


def keep_row(z: list[float], top_k, top_p, margin: tuple[float, float]) -> list[bool]:
    """The kept set of one row of float64 tempered logits, by the documented rules, and a
    check that no cut sits within ``margin`` of flipping (a gap in ``z`` at the k-th value, a
    gap in probability at the top-p crossing)."""
    z_gap, p_gap = margin
    distinct = sorted(set(z), reverse=True)
    count = {v: z.count(v) for v in distinct}
    thr = NEG_INF
    if top_k is not None and top_k < len(z):
        seen = 0
        for i, v in enumerate(distinct):
            seen += count[v]
            if seen >= top_k:  # the k-th largest, with multiplicity
                thr = v
                if i + 1 < len(distinct):
                    assert v - distinct[i + 1] > z_gap, "top-k cut within the margin"
                break
    kept = [v for v in distinct if v >= thr]
    if top_p is not None and top_p < 1.0:
        mass = [count[v] * math.exp(v - kept[0]) for v in kept]
        total = math.fsum(mass)
        above = 0.0  # mass of {z > v}
        for v, m in zip(kept, mass):
            if (above + m) / total >= top_p:  # {z >= v} holds top_p: v is v*
                assert (above + m) / total - top_p > p_gap, "top-p cut within the margin"
                assert top_p - above / total > p_gap, "top-p cut within the margin"
                thr = v
                break
            above += m
    return [v >= thr for v in z]


def oracle(h, w, b, targets, *, top_k=None, top_p=None, temperature=1.0, margin=FP32_MARGIN,
           dtype=torch.float64, ignore_index=-100):  # fmt: skip
    """``(N,)`` log-probs of ``(N, H)`` rows, differentiable in ``h``, ``w``, ``b``: the
    arithmetic in ``dtype`` (``float64``: the oracle; ``bfloat16``: eager PyTorch in bf16),
    the kept set always from the float64 logits."""
    exact = F.linear(h.detach().double(), w.detach().double(), None if b is None else b.double())
    rows = (exact / temperature).tolist()
    keep = torch.tensor([keep_row(r, top_k, top_p, margin) for r in rows], device=h.device)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    z = F.linear(cast(h), cast(w), cast(b)) / temperature
    ignored = targets == ignore_index
    t = torch.where(ignored, 0, targets).long()[:, None]
    lse = torch.logsumexp(z.masked_fill(~keep, NEG_INF), -1)
    logp = torch.where(keep.gather(-1, t)[:, 0], z.gather(-1, t)[:, 0] - lse, NEG_INF)
    return torch.where(ignored, 0.0, logp)


def value_and_grads(fn, leaves, upstream):
    """``fn(*leaves)`` and the gradients of ``sum(out * upstream)`` over its finite entries."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out = fn(*leaves)
    loss = (torch.where(torch.isfinite(out), out, 0.0) * upstream.to(out.dtype)).sum()
    return out.detach(), torch.autograd.grad(loss, leaves)


# ----------------------------------------------------------------------------- inputs


def _inputs(batch=2, positions=9, length=7, hdim=8, vocab=53, seed=0, dtype=torch.float32,
            scale=2.0, spaced=False):  # fmt: skip
    """``(B, S, H)`` hidden, ``(V, H)`` lm_head, ``(V,)`` bias and ``(B, T)`` targets with
    ``T < S`` (the causal shift): one ignored, every other one among its row's 3 largest
    logits (so most cuts keep it), the rest random. ``spaced``: biases 0.3 apart and a small
    lm_head (hidden part of the logits ~0.05), so every cut has a margin that bf16 logits
    keep."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, positions, hdim, generator=g)
    w = torch.randn(vocab, hdim, generator=g) * scale / hdim**0.5
    b = torch.randn(vocab, generator=g) * 0.5
    if spaced:
        w *= 0.05 / scale
        b = -torch.randperm(vocab, generator=g) * 0.3
    t = torch.randint(0, vocab, (batch, length), generator=g)
    z = F.linear(h[:, positions - length - 1 : positions - 1], w, b)
    top3 = z.topk(3, dim=-1).indices
    pick = torch.randint(0, 3, (batch, length, 1), generator=g)
    t[:, ::2] = top3.gather(-1, pick)[..., 0][:, ::2]
    t[0, 1] = -100
    cast = lambda x: x.to(DEVICE, dtype)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(DEVICE)


def _rows(h, t):
    """The ``(N, H)`` hidden rows that predict ``(B, T)`` targets (rows ``S-T-1 ... S-2``)."""
    positions, length = h.shape[1], t.shape[1]
    return h[:, positions - length - 1 : positions - 1].reshape(-1, h.shape[-1])


def check_against_oracle(backend, h, w, b, t, *, tol, chunk_tokens=4, **kw):
    """Values and the gradients of hidden, weight and bias against the float64 oracle (the
    same ``-inf`` pattern), under a random upstream gradient; at ``tol`` (None: bf16, twice
    eager bf16's error, floor 1e-3). Returns the log-probs."""
    g = torch.Generator().manual_seed(7)
    up = torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEVICE)
    leaves = [x for x in (h, w, b) if x is not None]
    bias = b is not None

    def fused(hh, ww, *bb):
        return fused_rl.linear_token_logprobs(
            hh, ww, t, bias=bb[0] if bias else None, chunk_tokens=chunk_tokens,
            backend=backend, **kw,
        )  # fmt: skip

    def reference(dtype, margin):
        def fn(hh, ww, *bb):
            return oracle(_rows(hh, t), ww, bb[0] if bias else None, t.reshape(-1),
                          dtype=dtype, margin=margin, **kw).view(t.shape)  # fmt: skip

        return fn

    out, grads = value_and_grads(fused, leaves, up)
    margin = FP32_MARGIN if tol is not None else BF16_MARGIN
    o_out, o_grads = value_and_grads(
        reference(torch.float64, margin), [x.double() for x in leaves], up
    )
    assert out.shape == t.shape
    assert out.dtype == (torch.float64 if h.dtype == torch.float64 else torch.float32)
    assert torch.equal(torch.isinf(out), torch.isinf(o_out)), (out, o_out)
    fin = torch.isfinite(o_out)
    if tol is None:  # eager PyTorch in the inputs' dtype, the same kept sets
        e_out, e_grads = value_and_grads(reference(h.dtype, margin), leaves, up)
        tols = [bf16_tol(e_out[fin], o_out[fin])] + [
            bf16_tol(e, o) for e, o in zip(e_grads, o_grads)
        ]
        if backend == "triton" and DEVICE == "cpu":
            # the Triton interpreter truncates fp32 -> bf16 stores (compiled kernels round to
            # nearest): up to one more bf16 step in dz, 2^-7 relative, and the same bias in
            # every row adds up in dW / db (tests/test_continuous.py)
            tols[1:] = [t_ + 2.0**-7 for t_ in tols[1:]]
    else:
        tols = [tol] * (1 + len(leaves))
    assert_rel(out[fin], o_out[fin], tols[0], "logp")
    for name, a, e, tl in zip(("hidden", "weight", "bias"), grads, o_grads, tols[1:]):
        assert a.dtype == h.dtype and a.shape == e.shape, name
        assert_rel(a, e, tl, name)
    return out


# ----------------------------------------------------------------------------- parity

CUTS = [
    (1, None, 1.0),
    (5, None, 0.7),
    (None, 0.8, 1.0),
    (None, 0.3, 0.7),
    (8, 0.6, 1.3),
    (64, 0.9, 1.0),
    (100, None, 1.0),  # k >= V: no cut, the plain log-softmax
    (None, 1.0, 0.7),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("top_k", "top_p", "temperature"), CUTS)
def test_matches_float64_oracle(top_k, top_p, temperature, backend):
    """fp32, 14 target rows in chunks of 4 (the last one short), bias, ``S > T``."""
    h, w, b, t = _inputs(seed=CUTS.index((top_k, top_p, temperature)))
    check_against_oracle(backend, h, w, b, t, tol=FP32_TOL, top_k=top_k, top_p=top_p,
                         temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("top_k", "top_p", "chunk"), [(None, 0.95, 3), (100, None, 16), (90, 0.7, 5)]
)
def test_search_passes(top_k, top_p, chunk, backend):
    """V = 150 with flat rows: the top-p threshold is searched (the 64 largest hold less than
    ``p``) and top-k above 64 counts its way to the k-th value; no bias; chunks of 3 and 5,
    and one chunk holding every row."""
    h, w, _, t = _inputs(vocab=150, seed=5, scale=1.0)
    check_against_oracle(backend, h, w, None, t, tol=FP32_TOL, chunk_tokens=chunk,
                         top_k=top_k, top_p=top_p)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("top_k", "top_p", "temperature"), [(7, None, 1.0), (None, 0.9, 0.7),
                                                            (12, 0.75, 1.0)])  # fmt: skip
def test_bf16(top_k, top_p, temperature, backend):
    """bf16 hidden / lm_head / bias: no worse than twice eager bf16 (floor 1e-3); ``dW``
    accumulates in fp32 over the chunks."""
    h, w, b, t = _inputs(seed=4, dtype=torch.bfloat16, spaced=True)
    check_against_oracle(backend, h, w, b, t, tol=None, top_k=top_k, top_p=top_p,
                         temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_and_gradcheck(backend):
    """fp64 inputs: fp64 log-probs, and gradcheck of hidden, weight and bias (cut targets'
    ``-inf`` read as 0)."""
    h, w, b, t = _inputs(batch=1, positions=6, length=5, hdim=3, vocab=11, seed=0,
                         dtype=torch.float64)  # fmt: skip
    kw = dict(top_k=6, top_p=0.8, temperature=1.3)
    out = check_against_oracle(backend, h, w, b, t, tol=F64_TOL, chunk_tokens=2, **kw)
    assert torch.isinf(out).any() and torch.isfinite(out).sum() >= 3

    def fn(hh, ww, bb):
        out = fused_rl.linear_token_logprobs(hh, ww, t, bias=bb, chunk_tokens=2, backend=backend,
                                             **kw)  # fmt: skip
        return out.nan_to_num(neginf=0.0)

    leaves = [x.detach().requires_grad_() for x in (h, w, b)]
    assert gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_targets_and_flat_rows(backend):
    """``(N, H)`` hidden with ``(N,)`` int32 targets."""
    h, w, b, t = _inputs(seed=6)
    rows, flat = _rows(h, t), t.reshape(-1).to(torch.int32)
    out = fused_rl.linear_token_logprobs(rows, w, flat, bias=b, top_k=9, top_p=0.7,
                                         chunk_tokens=5, backend=backend)  # fmt: skip
    want = oracle(rows, w, b, flat.long(), top_k=9, top_p=0.7)
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    assert_rel(out[torch.isfinite(want)], want[torch.isfinite(want)], FP32_TOL)


# ----------------------------------------------------------------------------- cut targets


@pytest.mark.parametrize("backend", BACKENDS)
def test_cut_and_ignored_targets_have_zero_gradient(backend):
    """A target outside the kept set: ``-inf``, and its log-prob sends exactly zero gradient
    to hidden, weight and bias (whatever the upstream value, NaN included); an ignored
    target: 0 and zero gradient."""
    h, w, b, t = _inputs(seed=8)
    rows = _rows(h, t)
    z = F.linear(rows, w, b)
    flat = t.reshape(-1).clone()
    flat[0] = int(z[0].argmin())  # cut by top-k = 3
    flat[1] = -100
    flat[2] = int(z[2].argmax())  # kept
    t = flat.view(t.shape)
    leaves = [x.detach().requires_grad_() for x in (h, w, b)]
    out = fused_rl.linear_token_logprobs(*leaves[:2], t, bias=leaves[2], top_k=3,
                                         chunk_tokens=4, backend=backend).reshape(-1)  # fmt: skip
    assert out[0] == NEG_INF and out[1] == 0 and torch.isfinite(out[2])
    up = torch.zeros_like(out)
    up[0], up[1] = float("nan"), 5.0
    grads = torch.autograd.grad(out, leaves, up, retain_graph=True)
    for name, g in zip(("hidden", "weight", "bias"), grads):
        assert torch.equal(g, torch.zeros_like(g)), name
    grads = torch.autograd.grad(out[2], leaves)  # the kept one does reach them
    assert all(torch.count_nonzero(g) > 0 for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_outside_the_window_get_zero_gradient(backend):
    """``(B, S, H)`` hidden with ``T < S`` targets: positions outside ``S-T-1 ... S-2`` get
    exactly zero gradient (a transposed, strided hidden as well)."""
    h, w, b, t = _inputs(seed=9)
    leaf = h.transpose(0, 1).contiguous().requires_grad_()
    out = fused_rl.linear_token_logprobs(leaf.transpose(0, 1), w, t, bias=b, top_p=0.9,
                                         chunk_tokens=3, backend=backend)  # fmt: skip
    (grad,) = torch.autograd.grad(torch.where(torch.isfinite(out), out, 0.0).sum(), leaf)
    assert torch.count_nonzero(grad[0]) == 0 and torch.count_nonzero(grad[-1]) == 0
    assert torch.count_nonzero(grad[1:-1]) > 0


# ----------------------------------------------------------------------------- ties


def _tied_head(n_above: int, n_tied: int, seed: int = 0):
    """Inputs whose lm_head starts with ``n_above`` zero rows with biases 4.0, 4.5, ... and
    ``n_tied`` zero rows with bias 3.0: those logits are exact in every precision and
    chunking (``0 * h`` sums to 0), so the tokens after the first ``n_above`` tie exactly
    at the next value; the other tokens' logits are small (about ``+-2``, below 3 by far
    more than the margins: the oracle checks)."""
    h, w, b, t = _inputs(seed=seed, vocab=40, scale=0.5)
    w, b = w.clone(), b.clone()
    w[: n_above + n_tied] = 0.0
    b[:n_above] = 4.0 + 0.5 * torch.arange(n_above, device=b.device)
    b[n_above : n_above + n_tied] = 3.0
    return h, w, b, t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("top_k", "n_above"), [(1, 0), (3, 2), (5, 1), (8, 4), (4, 3)])
def test_ties_at_the_kth_value_kept_whole(top_k, n_above, backend):
    """Five tokens tie at the k-th value: all five are kept, more than ``k`` tokens in all
    (the target is the last tied token, the tokens below are cut)."""
    h, w, b, t = _tied_head(n_above, 5)
    t = torch.full_like(t, n_above + 4)
    t[1, ::3] = 30  # below the tie: cut
    out = check_against_oracle(backend, h, w, b, t, tol=FP32_TOL, top_k=top_k)
    assert torch.isfinite(out[0]).all() and torch.isinf(out[1, ::3]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", (None, 12))
def test_ties_at_the_top_p_boundary_kept_whole(top_k, backend):
    """``top_p`` crosses inside a group of four tied tokens on every row: all four are kept
    (the threshold rule; a sort-position rule would keep only some), the tokens below cut."""
    h, w, b, t = _tied_head(2, 4)
    z = F.linear(_rows(h, t).double(), w.double(), b.double())
    if top_k is not None:  # the top-k set is the renormalisation's support
        z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], NEG_INF)
    p = torch.softmax(z, -1)
    above, tied = p[:, :2].sum(-1), p[:, 2:6].sum(-1)
    low, high = float(above.max()), float((above + tied).min())
    assert low + 0.01 < high, "the tied group's mass overlaps across rows"
    top_p = (low + high) / 2
    t = torch.full_like(t, 5)  # the last tied token
    t[1, ::3] = 30
    out = check_against_oracle(backend, h, w, b, t, tol=FP32_TOL, top_k=top_k, top_p=top_p)
    assert torch.isfinite(out[0]).all() and torch.isinf(out[1, ::3]).all()


# ----------------------------------------------------------------------------- cost


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", (None, 2.0))
def test_matches_materialised_truncated_logprobs(softcap, backend):
    """The same values and gradients as ``token_logprobs(F.linear(...), top_k=, top_p=)``
    on the materialised logits, within fp32 rounding (the GEMMs differ in shape); with the
    soft cap too (the cuts on the capped logits; that op's cap is checked against a float64
    oracle in test_truncated.py)."""
    h, w, b, t = _inputs(seed=11)
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(top_k=10, top_p=0.8, temperature=0.9, softcap=softcap, backend=backend)
    got, g_got = value_and_grads(
        lambda hh, ww, bb: fused_rl.linear_token_logprobs(hh, ww, t, bias=bb, chunk_tokens=4, **kw),
        (h, w, b), up)  # fmt: skip
    want, g_want = value_and_grads(
        lambda hh, ww, bb: fused_rl.token_logprobs(F.linear(_rows(hh, t), ww, bb).view(
            *t.shape, -1), t, **kw), (h, w, b), up)  # fmt: skip
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert_rel(got[fin], want[fin], FP32_TOL)
    for a, e in zip(g_got, g_want):
        assert_rel(a, e, FP32_TOL)


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


@pytest.mark.no_poison  # counts only
def test_one_gemm_and_one_vocab_kernel_per_chunk_each_way():
    """Forward: per chunk one GEMM and the truncated forward kernel. Backward: the logits
    recomputed (one GEMM), the truncated backward kernel, ``dH`` and ``dW`` (two GEMMs)."""
    h, w, b, t = _inputs(seed=12)
    chunks = -(-t.numel() // 4)
    leaves = [x.detach().requires_grad_() for x in (h, w, b)]

    def call():
        return fused_rl.linear_token_logprobs(
            *leaves[:2], t, bias=leaves[2], top_k=5, chunk_tokens=4, backend="triton"
        )

    with _GemmCounter() as fwd, LaunchCounter() as k_fwd:
        out = call()
    loss = torch.where(torch.isfinite(out), out, 0.0).sum()
    with _GemmCounter() as bwd, LaunchCounter() as k_bwd:
        loss.backward()
    assert (fwd.count, bwd.count) == (chunks, 3 * chunks)
    assert k_fwd.kernels == ["_truncated_logprobs_fwd_kernel"] * chunks, k_fwd.kernels
    assert k_bwd.kernels == ["_truncated_logprobs_bwd_kernel"] * chunks, k_bwd.kernels


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_logits_sized_allocation(backend):
    """Nothing as large as the ``(N, V)`` logits, forward or backward; on the Triton
    backend nothing larger than one chunk's logits or the lm_head (the backward writes
    ``dz`` over the recomputed chunk)."""
    g = torch.Generator().manual_seed(13)
    n, vocab, hdim, chunk = 48, 400, 16, 8
    h = torch.randn(n, hdim, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) / 4).to(DEVICE).requires_grad_()
    b = torch.randn(vocab, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    with AllocationTracker() as a:
        out = fused_rl.linear_token_logprobs(h, w, t, bias=b, top_k=20, top_p=0.9,
                                             chunk_tokens=chunk, backend=backend)  # fmt: skip
        torch.where(torch.isfinite(out), out, 0.0).sum().backward()
    assert a.sizes, "nothing recorded"
    assert a.count_at_least(n * vocab * 4) == 0, sorted(a.sizes)[-5:]
    if backend == "triton":
        assert max(a.sizes) <= max(chunk * vocab * 4, vocab * hdim * 4), sorted(a.sizes)[-5:]


# ----------------------------------------------------------------------------- modes


@pytest.mark.no_poison  # Dynamo cannot trace the NaN-filling torch.empty of the fixture
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    """``torch.compile(fullgraph=True)`` traces the chunked op forward and backward and gives
    the eager values and gradients."""
    h, w, b, t = _inputs(seed=14)

    def f(hh, ww, bb):
        return fused_rl.linear_token_logprobs(
            hh, ww, t, bias=bb, top_k=6, top_p=0.9, temperature=0.8, chunk_tokens=4,
            backend=backend,
        )  # fmt: skip

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    eager, e_grads = value_and_grads(f, (h, w, b), up)
    comp, c_grads = value_and_grads(compiled, (h, w, b), up)
    torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    for a, e in zip(c_grads, e_grads):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_and_no_grad(backend):
    """Under ``torch.autocast`` the call is the one on the autocast dtype's inputs (the
    backward recomputes the forward's bf16 logits); under ``no_grad`` the same values."""
    h, w, b, t = _inputs(seed=15)
    kw = dict(top_k=8, top_p=0.9, chunk_tokens=4, backend=backend)
    h16 = h.bfloat16().requires_grad_()
    w32 = w.detach().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = fused_rl.linear_token_logprobs(h16, w32, t, **kw)
    w16 = w.bfloat16().requires_grad_()
    want = fused_rl.linear_token_logprobs(h16, w16, t, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    up = torch.where(torch.isfinite(want), torch.randn(t.shape, device=DEVICE), 0.0)
    g_got = torch.autograd.grad(got, (h16, w32), up)
    g_want = torch.autograd.grad(want, (h16, w16), up)
    torch.testing.assert_close(g_got[0], g_want[0], rtol=0, atol=0)
    assert g_got[1].dtype == torch.float32
    torch.testing.assert_close(g_got[1], g_want[1].float(), rtol=0, atol=0)
    with torch.no_grad():
        plain = fused_rl.linear_token_logprobs(h, w, t, bias=b, **kw)
    assert not plain.requires_grad
    torch.testing.assert_close(
        plain, fused_rl.linear_token_logprobs(h, w, t, bias=b, **kw).detach()
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises(backend):
    h, w, b, t = _inputs(batch=1, positions=6, length=5, hdim=4, vocab=11, seed=3,
                         dtype=torch.float64)  # fmt: skip
    leaves = [x.detach().requires_grad_() for x in (h, w, b)]
    out = fused_rl.linear_token_logprobs(*leaves[:2], t, bias=leaves[2], top_k=6,
                                         chunk_tokens=2, backend=backend)  # fmt: skip
    loss = torch.where(torch.isfinite(out), out, 0.0).sum()
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(sum((g**2).sum() for g in grads), leaves)


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=-3), ValueError, "top_k"),
        (dict(top_k=True), TypeError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(top_k="3"), TypeError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=-0.1), ValueError, "top_p"),
        (dict(top_p=float("nan")), ValueError, "top_p"),
        (dict(top_p="0.5"), TypeError, "top_p"),
        (dict(top_p=True), TypeError, "top_p"),
        (dict(top_p=torch.tensor(0.5)), TypeError, "top_p"),
        (dict(top_k=3, temperature=0.0), ValueError, "temperature"),
        (dict(top_k=3, ignore_index=1.5), TypeError, "ignore_index"),
        (dict(top_k=3, chunk_tokens=0), ValueError, "chunk_tokens"),
        (dict(top_k=3, backend="bogus"), ValueError, "backend"),
        (dict(top_k=3, return_entropy=True), ValueError, "return_entropy"),
        (dict(top_p=0.5, softcap=0.0), ValueError, "softcap"),
        (dict(top_k=3, softcap=float("nan")), ValueError, "softcap"),
        (dict(top_k=3, process_group=object()), TypeError, "process_group"),
        (dict(top_k=3, vocab_size=53), ValueError, "vocab_size"),
        (dict(top_p=0.5, vocab_start=0), ValueError, "vocab_start"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, name):
    h, w, b, t = _inputs()
    with pytest.raises(error, match=rf"\b{name}\b"):
        fused_rl.linear_token_logprobs(h, w, t, bias=b, **kwargs)


def test_refusals_match_token_logprobs():
    """The options refused with truncation are the ones ``token_logprobs`` refuses."""
    h, w, b, t = _inputs()
    logits = F.linear(h, w, b)
    for bad in (dict(return_entropy=True),):
        zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=DEVICE)
        for op, args in ((fused_rl.token_logprobs, (logits, zeros)),
                         (fused_rl.linear_token_logprobs, (h, w, t))):  # fmt: skip
            with pytest.raises(ValueError, match="with top_k / top_p .* does not take"):
                op(*args, top_k=4, **bad)


def test_bad_tensors_and_targets():
    h, w, b, t = _inputs()
    with pytest.raises(ValueError, match=r"targets holds 53, outside \[0, V\)"):
        fused_rl.linear_token_logprobs(h, w, torch.full_like(t, 53), top_k=3)
    with pytest.raises(TypeError, match="targets must be an int64 or int32"):
        fused_rl.linear_token_logprobs(h, w, t.float(), top_p=0.5)
    with pytest.raises(ValueError, match="weight must be the lm_head's"):
        fused_rl.linear_token_logprobs(h, w[:, :5], t, top_k=3)
    with pytest.raises(ValueError, match="targets must be"):
        fused_rl.linear_token_logprobs(h, w, t[:, None], top_k=3)
