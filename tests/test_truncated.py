"""``truncated_logprobs``: log-probs under a sampler's top-k / top-p truncation.

Every check is against float64 oracles written here: ``oracle_threshold`` (the documented
threshold rule, a Python loop over the sorted row) and ``vllm_keep`` (vLLM's sampler:
ascending sort, ``cumsum <= 1 - p`` dropped, the largest always kept), the latter only
where the two rules agree (no tie at the top-p boundary) and in one test that shows where
they differ. Values and gradients under random upstream gradients, both backends, fp32 and
bf16, temperatures 1 and 0.7, awkward shapes, ties at the k-th value and at the top-p
boundary (in registers and through the search passes), NaN in -> NaN out, gradcheck,
``torch.compile(fullgraph=True)``, bad arguments, launches and passes over a row.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import triton
import triton.language as tl
from fused_rl.kernels.vocab.truncated import _candidates, _input_candidates
from helpers import (
    F64_TOL,
    FP32_TOL,
    assert_rel,
    bf16_tol,
    fp32_neighbours_sharing_z,
    gradcheck,
    sm90_compile_output,
)

import fused_rl
import fused_rl._truncated_ops as T
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
TOP_KS = (1, 2, 7, 64, None)
TOP_PS = (0.1, 0.5, 0.9, 1.0, None)
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- oracles


def oracle_threshold(z_row: torch.Tensor, top_k, top_p) -> float:
    """The kept set's threshold on one row of tempered logits (float64, no NaN): top-k
    keeps ``z >= `` the k-th largest; top-p keeps ``z >= `` the value of the token whose
    cumulative probability (descending, over the top-k set) first reaches ``p``."""
    values = sorted(z_row.tolist(), reverse=True)
    thr = NEG_INF
    if top_k is not None and top_k < len(values):
        thr = values[top_k - 1]
    kept = [v for v in values if v >= thr]
    if top_p is not None and top_p < 1.0:
        weights = [math.exp(v - kept[0]) for v in kept]
        total, cum = math.fsum(weights), 0.0
        for v, w in zip(kept, weights):
            cum += w
            if cum >= top_p * total:
                thr = v
                break
    return thr


def vllm_keep(z_row: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` on one float64 row (its documented semantics, written
    here; a stable sort fixes its order among ties): sort ascending; top-k masks values
    below the k-th largest; top-p masks the positions whose cumulative probability (of
    everything up to and including them) is ``<= 1 - p``, never the last (largest)."""
    s, idx = torch.sort(z_row, stable=True)
    n = s.numel()
    if top_k is not None and top_k < n:
        s = s.masked_fill(s < s[n - top_k], NEG_INF)
    if top_p is not None and top_p < 1.0:
        cum = torch.softmax(s, -1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False
        s = s.masked_fill(drop, NEG_INF)
    keep = torch.zeros(n, dtype=torch.bool, device=z_row.device)
    keep[idx] = s > NEG_INF
    return keep


def tempered(x, temperature, softcap):
    """``z = x / T``, or ``c tanh(x / c) / T`` with the soft cap ``c``."""
    return x / temperature if softcap is None else softcap * torch.tanh(x / softcap) / temperature


def oracle(x, targets, top_k=None, top_p=None, temperature=1.0, ignore_index=-100,
           rule="threshold", dtype=torch.float64, softcap=None):  # fmt: skip
    """float64 log-probs (differentiable in ``x``); ``rule="vllm"`` keeps vLLM's set.
    ``dtype``: the arithmetic's (``x.dtype``: eager PyTorch in that dtype), the kept set
    always the float64 one. On ``x``'s device (vLLM's rule runs on the rows' CPU copy)."""
    rows = tempered(x.detach().double(), temperature, softcap).reshape(-1, x.shape[-1])
    z = tempered(x.to(dtype), temperature, softcap)
    if rule == "threshold":
        thr = [oracle_threshold(r, top_k, top_p) for r in rows]
        thr = torch.tensor(thr, dtype=rows.dtype, device=rows.device)
        keep = (rows >= thr[:, None]).reshape(z.shape)
    else:
        keep = torch.stack([vllm_keep(r, top_k, top_p) for r in rows.cpu()])
        keep = keep.reshape(z.shape).to(z.device)
    ignored = targets == ignore_index
    t = torch.where(ignored, 0, targets).long()[..., None]
    lse = torch.logsumexp(z.masked_fill(~keep, NEG_INF), -1)
    logp = torch.where(keep.gather(-1, t)[..., 0], z.gather(-1, t)[..., 0] - lse, NEG_INF)
    return torch.where(ignored, 0.0, logp)


def value_and_grad(fn, x, upstream):
    """``fn(x)`` and the gradient of ``sum(out * upstream)`` over its finite entries."""
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    loss = (torch.where(torch.isfinite(out), out, 0.0) * upstream.to(out.dtype)).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    return out.detach(), grad


def fused(backend, **kw):
    return lambda leaf, targets: fused_rl.truncated_logprobs(leaf, targets, backend=backend, **kw)


def check_against_oracle(backend, x, targets, view=lambda t: t, tol=None, **kw):
    """Values and gradients of both backends' call against the float64 oracle: the same
    ``-inf`` pattern (the same kept sets), finite values and the gradient at ``tol``, exact
    zero gradient rows for ignored and cut targets."""
    g = torch.Generator().manual_seed(7)
    up = torch.randn(targets.shape, generator=g, dtype=torch.float64).to(x.device)
    out, grad = value_and_grad(lambda leaf: fused(backend, **kw)(view(leaf), targets), x, up)
    o_out, o_grad = value_and_grad(lambda leaf: oracle(view(leaf), targets, **kw), x.double(), up)
    assert out.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert grad.dtype == x.dtype and grad.shape == x.shape
    assert torch.equal(torch.isinf(out), torch.isinf(o_out)), (out, o_out)
    fin = torch.isfinite(o_out)
    if tol is None:  # bf16: no worse than twice the same math in eager bf16 (floor 1e-3)
        eager = lambda leaf: oracle(view(leaf), targets, dtype=x.dtype, **kw)  # noqa: E731
        e_out, e_grad = value_and_grad(eager, x, up)
        tols = (bf16_tol(e_out[fin], o_out[fin]), bf16_tol(e_grad, o_grad))
    else:
        tols = (tol, tol)
    assert_rel(out[fin], o_out[fin], tols[0], "logp")
    assert_rel(grad, o_grad, tols[1], "grad")
    cut = view(grad).detach()[~fin | (targets == -100)]
    assert torch.equal(cut, torch.zeros_like(cut)), "cut / ignored targets: zero gradient"
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    """Pass A in blocks of 64 logits (64 groups of 1; search steps of 64): a row of ~100
    crosses blocks."""
    monkeypatch.setattr(T, "_block", lambda vocab: 64)


@pytest.fixture
def blocks_of_128(monkeypatch):
    """Pass A in blocks of 128 (64 groups of 2: a group's second value follows its first)."""
    monkeypatch.setattr(T, "_block", lambda vocab: 128)


def _rows(shape, seed=0, device="cpu"):
    """Rows from peaked to flat (scales 8 .. 0.5), so top-p resolves both in registers and
    through the search passes; targets: one ignored, one the row max, the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = x.view(-1, shape[-1])
    scales = (8.0, 0.5, 2.0, 1.0, 4.0, 0.7)
    for i in range(rows.shape[0]):
        rows[i] *= scales[i % len(scales)]
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    flat = targets.view(-1)
    flat[0] = -100
    flat[1] = rows[1].argmax()
    return x.to(device), targets.to(device)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("top_k", TOP_KS)
def test_matches_oracle(top_k, top_p, backend, small_blocks, device):
    """fp32, V = 97 over two blocks of pass A; temperature 0.7 on every other case."""
    x, targets = _rows((2, 3, 97), seed=TOP_KS.index(top_k), device=device)
    temperature = 0.7 if (TOP_KS.index(top_k) + TOP_PS.index(top_p)) % 2 else 1.0
    check_against_oracle(backend, x, targets, tol=FP32_TOL, top_k=top_k, top_p=top_p,
                         temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
@pytest.mark.parametrize(("top_k", "top_p"), [(7, None), (None, 0.9), (64, 0.5), (2, 0.9)])
def test_bf16(top_k, top_p, temperature, backend, device):
    x, targets = _rows((2, 3, 97), seed=3, device=device)
    check_against_oracle(backend, x.bfloat16(), targets, top_k=top_k, top_p=top_p,
                         temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("top_k", "top_p"), [(100, None), (None, 0.9), (90, 0.7)])
def test_float64_search_passes(top_k, top_p, backend, device):
    """fp64 logits (int64 keys) through the search passes: the float64 tolerance."""
    x, targets = _rows((2, 3, 150), seed=5, device=device)
    check_against_oracle(backend, x.double(), targets, tol=F64_TOL, top_k=top_k, top_p=top_p)


# (logits shape, targets shape, top_k, top_p, temperature, view, targets dtype)
SHAPES = {
    "odd_V": ((3, 5, 37), None, 7, 0.9, 0.7, None, torch.int64),
    "V_below_k": ((2, 3, 5), None, 7, 0.5, 1.0, None, torch.int64),
    "T1": ((4, 1, 50), None, 2, None, 1.0, None, torch.int64),
    "slice": ((2, 6, 131), (2, 5), 64, 0.9, 0.7, lambda x: x[:, 1:, ::2], torch.int64),
    "1d": ((41,), (), 3, 0.5, 1.0, None, torch.int64),
    "2d_int32": ((7, 41), None, None, 0.5, 0.7, None, torch.int32),
    "two_blocks": ((1, 3, 2100), None, 64, 0.9, 1.0, None, torch.int64),  # 2048 a block
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SHAPES))
def test_awkward_shapes(case, backend, device):
    shape, tshape, top_k, top_p, temperature, view, tdtype = SHAPES[case]
    view = view or (lambda t: t)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=g) * 2).to(device)
    vshape = view(x).shape
    targets = torch.randint(0, vshape[-1], vshape[:-1], generator=g).to(device, tdtype)
    if case == "slice":  # strided targets too (ids[:, 1:])
        targets = torch.randint(0, vshape[-1], (2, 6), generator=g).to(device)[:, 1:]
    if targets.dim():
        targets[(-1,) * targets.dim()] = -100
    check_against_oracle(backend, x, targets, view=view, tol=FP32_TOL, top_k=top_k,
                         top_p=top_p, temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_cut_and_ignored_targets(backend, device):
    """A target cut by top-k or top-p: ``-inf`` and a zero gradient row; ignored: 0."""
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3, device=device)
    targets = torch.tensor([3, 2, -100], device=device)
    leaf = x.clone().requires_grad_()
    out = fused_rl.truncated_logprobs(leaf, targets, top_k=2, backend=backend)
    assert out[0] == NEG_INF and out[1] == NEG_INF and out[2] == 0
    out[2].backward()
    assert torch.equal(leaf.grad, torch.zeros_like(x))
    leaf.grad = None
    out = fused_rl.truncated_logprobs(leaf, targets.clone().fill_(1), top_p=0.5, backend=backend)
    assert torch.isinf(out).all()  # p(3.0) = 0.64 >= 0.5: only the first token is kept
    out.sum().backward()
    assert torch.equal(leaf.grad, torch.zeros_like(x))


# ----------------------------------------------------------------------------- ties


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", (1, 2, 11, 64, 100, 200))
def test_ties_at_the_kth_value(top_k, backend, blocks_of_128, device):
    """Every token tied at the k-th value is kept: a tied maximum (k = 1), ties inside the
    64 register slots, 150 ties spread over three blocks (more than the slots hold:
    counted), and k = 200 below the tie group (the count search)."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 300, generator=g) * 2 - 3.0
    x[:, :10] = 5.0  # top 10 tied
    x[0, torch.randperm(300, generator=g)[:150]] = 2.0  # 150 tied (overwrites some 5s)
    x[1, 20:22] = 7.0  # a tied maximum
    targets = torch.tensor([int((x[0] == 2.0).nonzero()[-1]), 21], device=device)
    if top_k < 11:
        targets[0] = int(x[0].argmax())
    out = check_against_oracle(backend, x.to(device), targets, tol=FP32_TOL, top_k=top_k)
    assert torch.isfinite(out).all()  # a 2.0 (k >= 11) and the second of two maxima (k >= 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_top_p_boundary_in_registers(backend, device):
    """The crossing token is tied: all its ties are kept (the threshold rule), where
    vLLM's sort-position rule keeps one of the two (documented difference)."""
    z = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0, -2.0], dtype=torch.float64)
    q = torch.softmax(z, -1)
    p = float(q[0] + 0.5 * q[1])  # crosses at the first of the tied pair
    x = z.float().repeat(2, 1).to(device)
    targets = torch.tensor([1, 2], device=device)
    out = check_against_oracle(backend, x, targets, tol=FP32_TOL, top_p=p)
    assert torch.isfinite(out).all()  # both tied tokens kept
    assert vllm_keep(z, None, p).tolist() == [True, False, True, False, False, False]
    with_k = check_against_oracle(backend, x, targets, tol=FP32_TOL, top_k=4, top_p=p)
    assert torch.isfinite(with_k).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", (None, 100))
def test_ties_at_the_top_p_boundary_searched(top_k, backend, small_blocks, device):
    """The 64 largest hold less than p, so the threshold is searched (top-k = 100: the
    k-th value too); it falls inside a group of 200 tied tokens below them (more than a
    collect pass holds: the one-value bracket). (Ties AT the 64th value need no search:
    pass A counts them, test_ties_at_the_kth_value.)"""
    g = torch.Generator().manual_seed(4)
    x = torch.full((300,), -2.0)
    order = torch.randperm(300, generator=g)
    x[order[:70]] = torch.linspace(0.5, 1.5, 70)  # 70 distinct above, 200 tied, 30 below
    x[order[70:270]] = 0.0
    x = x.repeat(2, 1).to(device)
    tie = int((x[0] == 0.0).nonzero()[-1])
    targets = torch.tensor([tie, int((x[0] == -2.0).nonzero()[0])], device=device)
    out = check_against_oracle(backend, x, targets, tol=FP32_TOL, top_k=top_k, top_p=0.5)
    assert torch.isfinite(out[0]) and out[1] == NEG_INF
    if backend == "triton":
        launch = T.truncated_logprobs_fwd_op.launcher
        _, _, passes = launch(x[None], targets[None], top_k or 0, 0.5, 1.0, None, -100)
        assert (passes > 1).all(), passes


# ----------------------------------------------------------------------------- vLLM


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"),
    [(5, None, 1.0), (None, 0.8, 0.7), (20, 0.6, 1.3), (1, 0.3, 1.0), (64, 0.95, 0.7)],
)
def test_matches_vllm_without_boundary_ties(top_k, top_p, temperature, backend, device):
    """Continuous random logits (no ties): the kept sets, values and gradients are those of
    vLLM's sampler (its sort-based rule, float64) as well as of the threshold rule."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(4, 80, generator=g) * 2).to(device)
    targets = torch.stack([torch.randperm(80, generator=g)[0] for _ in range(4)]).to(device)
    targets[0] = x[0].argmax()
    kw = dict(top_k=top_k, top_p=top_p, temperature=temperature)
    vllm = oracle(x, targets, rule="vllm", **kw)
    assert torch.equal(vllm, oracle(x, targets, **kw))
    out = check_against_oracle(backend, x, targets, tol=FP32_TOL, **kw)
    assert torch.equal(torch.isinf(out), torch.isinf(vllm))


# ----------------------------------------------------------------------------- soft cap


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", (2.0, 30.0))
@pytest.mark.parametrize(("top_k", "top_p"), [(7, None), (64, 0.9), (None, 0.9), (100, 0.7)])
def test_softcap(top_k, top_p, softcap, backend, small_blocks, device):
    """``softcap=c``: both cuts and the log-prob on ``c tanh(x / c) / T``, the gradient
    through the cap; a cap of 2 squeezes the row's top together (the search passes run on
    the capped values), 30 barely touches it. Temperature 0.7."""
    x, targets = _rows((2, 3, 150), seed=9, device=device)
    check_against_oracle(backend, x * 2, targets, tol=FP32_TOL, top_k=top_k, top_p=top_p,
                         temperature=0.7, softcap=softcap)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_bf16_and_infinite_logits(backend, device):
    """bf16 with the cap; a ``-inf`` logit is capped to ``-c`` (finite: kept when top-k
    reaches it, as the capped model samples it), a ``+inf`` one to ``+c`` -- with the cap
    an infinite logit is not a NaN row."""
    x, targets = _rows((2, 3, 97), seed=4, device=device)
    check_against_oracle(backend, x.bfloat16(), targets, top_k=9, top_p=0.9, softcap=3.0)
    x = torch.tensor([[NEG_INF, 0.5, 1.0, float("inf")], [NEG_INF, NEG_INF, 0.0, 2.0]])
    targets = torch.tensor([0, 1], device=device)
    out = check_against_oracle(backend, x.to(device), targets, tol=FP32_TOL, top_k=4,
                               softcap=3.0)  # fmt: skip
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (3, None), (None, 0.5), (100, 0.9)])
def test_nan_in_nan_out(top_k, top_p, backend, device):
    """A NaN (in the first block, or a later one beside the row's largest value), a ``+inf``
    or an all ``-inf`` row: NaN and a NaN gradient row; the other rows exact; an ignored NaN
    row: 0 and zero gradient."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 1300, generator=g)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = NEG_INF
    x[4, 7] = float("nan")
    x[5, 1201], x[5, 1202] = float("nan"), 9.0  # one group of a later block: NaN and the max
    x = x[[0, 1, 2, 5, 3, 4]].to(device).requires_grad_()
    targets = torch.tensor([1, 2, 3, 1202, int(x[4].argmax()), -100], device=device)
    out = fused_rl.truncated_logprobs(x, targets, top_k=top_k, top_p=top_p, backend=backend)
    assert out[:4].isnan().all() and torch.isfinite(out[4]) and out[5] == 0
    out.backward(torch.ones(6, device=device))
    assert x.grad[:4].isnan().all() and torch.isfinite(x.grad[4]).all()
    assert torch.equal(x.grad[5], torch.zeros_like(x.grad[5]))
    want = oracle(x[4:5].detach(), targets[4:5], top_k=top_k, top_p=top_p)
    assert_rel(out[4:5], want, FP32_TOL, "the clean row")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    torch.manual_seed(16)
    x = torch.randn(1, 3, 8, device=device, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 1, -100]], device=device)
    targets[0, 0] = x[0, 0].argmax()  # kept
    fn = lambda t: fused_rl.truncated_logprobs(  # noqa: E731
        t, targets, top_k=5, top_p=0.8, temperature=0.7, backend=backend
    ).nan_to_num(neginf=0.0)
    assert gradcheck(fn, (x,))


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    x, targets = _rows((2, 4, 37), seed=1, device=device)

    def f(logits, y):
        return fused_rl.truncated_logprobs(logits, y, top_k=5, top_p=0.9, temperature=0.7)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    up = torch.randn(targets.shape, device=device)
    eager, e_grad = value_and_grad(lambda leaf: f(leaf, targets), x, up)
    comp, c_grad = value_and_grad(lambda leaf: compiled(leaf, targets), x, up)
    torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    torch.testing.assert_close(c_grad, e_grad, rtol=0, atol=0)


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
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap="3"), TypeError, "softcap"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(backend="bogus"), ValueError, "backend"),
    ],
)
def test_bad_arguments(kwargs, error, name):
    x, targets = torch.randn(2, 3, 11), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(error, match=rf"\b{name}\b"):
        fused_rl.truncated_logprobs(x, targets, **kwargs)


def test_bad_tensors():
    x = torch.randn(2, 3, 11)
    with pytest.raises(ValueError, match="targets must have shape"):
        fused_rl.truncated_logprobs(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="targets must be an int64 or int32"):
        fused_rl.truncated_logprobs(x, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="logits must be a floating"):
        fused_rl.truncated_logprobs(x.long(), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets holds 11, outside \[0, V\)"):
        fused_rl.truncated_logprobs(x, torch.full((2, 3), 11))
    assert fused_rl.truncated_logprobs(x, torch.zeros(2, 3, dtype=torch.long), top_p=1.0,
                                       top_k=11).isfinite().all()  # fmt: skip


# ----------------------------------------------------------------------------- cost

# launches: forward ONE kernel; backward ONE kernel (+ the caller's sum and the autograd seed)
FORWARD_LAUNCHES, FORWARD_BACKWARD_LAUNCHES = 1, 4


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
@pytest.mark.parametrize(("top_k", "top_p"), [(7, None), (None, 0.9), (100, 0.5)])
def test_launches_and_allocations(top_k, top_p, device, monkeypatch):
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    x = torch.randn(3, 5, 257, device=device, requires_grad=True)
    targets = torch.randint(0, 257, (3, 5), device=device)
    call = lambda: fused_rl.truncated_logprobs(x, targets, top_k=top_k, top_p=top_p,  # noqa: E731
                                               backend="triton")  # fmt: skip
    with torch.no_grad(), LaunchCounter() as c:
        call()
    assert (c.total, c.kernels) == (FORWARD_LAUNCHES, ["_truncated_logprobs_fwd_kernel"])
    with LaunchCounter() as c:
        call().sum().backward()
    assert c.total == FORWARD_BACKWARD_LAUNCHES, (c.ops, c.kernels)
    nv_bytes = x.numel() * x.element_size()
    with AllocationTracker() as a:
        out = call()
    assert a.count_at_least(nv_bytes // 4) == 0  # nothing of size (N, V) forward
    with AllocationTracker() as a:
        out.sum().backward()
    assert a.count_at_least(nv_bytes) == 1  # the gradient


def test_passes_over_a_row(device):
    """Reads of each row (bytes = passes x V x element size): one for top-k <= 64 with or
    without top-p, and for top-p where the 64 largest hold p; at most 1 + 11 + 1 otherwise,
    fp32 (pass A, search passes, one collect pass), even for logits spread over every
    octave; 0 for an ignored row."""
    g = torch.Generator().manual_seed(8)
    peaked = (torch.randn(1, 4, 400, generator=g) * 6).to(device)
    flat = torch.randn(1, 4, 400, generator=g).to(device)
    octaves = (torch.sign(torch.randn(1, 4, 400, generator=g)) * 10 ** (
        torch.rand(1, 4, 400, generator=g) * 40 - 39)).to(device)  # fmt: skip
    targets = torch.zeros(1, 4, dtype=torch.long, device=device)
    targets[0, 3] = -100
    runs = lambda x, k, p: T.truncated_logprobs_fwd_op.launcher(x, targets, k, p, 1.0, None, -100)  # noqa: E731
    for k, p in [(1, 1.0), (64, 1.0), (64, 0.9), (7, 0.5), (0, 1.0)]:
        assert runs(flat, k, p)[2].tolist() == [1, 1, 1, 0]
    assert runs(peaked, 0, 0.9)[2].tolist() == [1, 1, 1, 0]
    for x, k, p in [(flat, 0, 0.9), (flat, 200, 1.0), (octaves, 0, 0.99), (octaves, 300, 1.0)]:
        logp, _, passes = runs(x, k, p)
        assert 1 < passes[:3].min() and passes[:3].max() <= 1 + 11 + 1, passes
        want = oracle(x, targets, top_k=k or None, top_p=p)
        assert_rel(logp[torch.isfinite(want)], want[torch.isfinite(want)], FP32_TOL, "logp")
        assert torch.equal(torch.isinf(logp), torch.isinf(want))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32, torch.float64))
def test_top_k_over_64_reads(dtype, device):
    """Top-k > 64 by radix select on the logits' bits: ``B / 8`` reads of a ``B``-bit row
    (pass A's included) whatever ``k`` and the data, 0 for an ignored row; the values are
    the oracle's."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(1, 3, 300, generator=g) * 2).to(device, dtype)
    targets = torch.tensor([[0, 1, -100]], device=device)
    reads = torch.finfo(dtype).bits // 8
    tol = F64_TOL if dtype == torch.float64 else FP32_TOL
    for k in (65, 100, 299):
        logp, _, passes = T.truncated_logprobs_fwd_op.launcher(x, targets, k, 1.0, 1.0, None,
                                                               -100)  # fmt: skip
        assert passes.tolist() == [reads, reads, 0], (k, passes)
        want = oracle(x, targets, top_k=k)
        assert torch.equal(torch.isinf(logp), torch.isinf(want))
        fin = torch.isfinite(want)
        assert_rel(logp[fin], want[fin].to(logp.dtype), tol, "logp")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ("signed_zeros", "saturated_cap"))
def test_top_k_over_64_keeps_what_merges_with_the_kth(case, backend, device):
    """A logit below the k-th largest whose ``z`` equals the k-th's is kept and counted in
    the kept mass (one more read): ``-0.0`` beside a k-th value of ``+0.0``, and logits the
    soft cap saturates to the same ``z`` (fp64, where float64's ``tanh`` saturates too)."""
    g = torch.Generator().manual_seed(13)
    if case == "signed_zeros":
        dtype, softcap = torch.float32, None
        row = torch.cat([torch.rand(99, generator=g) + 0.5, torch.tensor([0.0, -0.0, -0.0]),
                         -torch.rand(97, generator=g) - 0.5])  # fmt: skip
    else:
        dtype, softcap = torch.float64, 1.0
        row = torch.cat([torch.linspace(-0.9, 0.9, 99, dtype=torch.float64),
                         -torch.linspace(20.0, 40.0, 200, dtype=torch.float64)])  # fmt: skip
    perm = torch.randperm(row.numel(), generator=g)
    x = row[perm].to(device, dtype)[None].repeat(2, 1)
    kth = int(torch.nonzero(perm == 99)[0])  # the 100th largest logit
    below = int(torch.nonzero(perm == 100)[0])  # merged with it
    targets = torch.tensor([kth, below], device=device)
    out = check_against_oracle(backend, x, targets, tol=FP32_TOL, top_k=100, softcap=softcap)
    assert torch.isfinite(out).all()
    if backend == "triton":
        _, _, passes = T.truncated_logprobs_fwd_op.launcher(
            x[None], targets[None], 100, 1.0, 1.0, softcap, -100
        )
        # the merged logits' mass from the last digit pass; with the soft cap one more pass
        reads = torch.finfo(dtype).bits // 8 + (softcap is not None)
        assert passes.tolist() == [reads] * 2


def test_top_k_over_64_keeps_neighbours_the_temperature_rounds_together(device):
    """fp32 logits at ``T = 0.7``: the k-th logit's neighbour below it (one ulp) has the same
    ``z = x * fp32(1 / T)`` and is kept with it, its mass counted in the last digit pass (no
    more reads); the values are those of the fp32 ``z`` (the kernel's kept set)."""
    inv_t = torch.tensor(1 / 0.7, dtype=torch.float32)
    x_k, below = fp32_neighbours_sharing_z(0.7)
    g = torch.Generator().manual_seed(14)
    row = torch.cat([torch.rand(99, generator=g) + 2.0, x_k[None], below[None],
                     -torch.rand(199, generator=g)])  # fmt: skip
    perm = torch.randperm(row.numel(), generator=g)
    x = row[perm][None, None].to(device)
    targets = torch.tensor([[int(torch.nonzero(perm == 100)[0])]], device=device)  # `below`
    logp, _, passes = T.truncated_logprobs_fwd_op.launcher(x, targets, 100, 1.0, 0.7, None, -100)
    assert passes.tolist() == [4]
    z = (x.double().float() * inv_t.to(device)).double()[0, 0]  # fp32 z, summed in float64
    kept = z >= z[targets[0, 0]]
    assert int(kept.sum()) == 101
    want = z[targets[0, 0]] - torch.logsumexp(z[kept], 0)
    assert_rel(logp[0, 0].double(), want, FP32_TOL, "logp")


@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_top_p_cut_in_a_bf16_tie_group(temperature, device):
    """bf16 logits whose top-p cut falls in a group of 500 tied values below the 64
    largest: the search closes on the group through the logits' own 16-bit keys (at most
    4 reads here; on fp32 keys it took 8), the values the oracle's."""
    g = torch.Generator().manual_seed(22)
    row = torch.cat([torch.full((100,), 3.0), torch.full((500,), 2.0),
                     torch.rand(3496, generator=g) * 6 - 5])  # fmt: skip
    x = row[torch.randperm(row.numel(), generator=g)].to(device, torch.bfloat16)
    x = x[None].repeat(2, 1)
    tie, below = int((x[0] == 2.0).nonzero()[0]), int((x[0] < 1.5).nonzero()[0])
    targets = torch.tensor([tie, below], device=device)
    for backend in BACKENDS:
        out = check_against_oracle(backend, x, targets, top_p=0.5, temperature=temperature)
        assert torch.isfinite(out[0]) and out[1] == NEG_INF
    _, _, passes = T.truncated_logprobs_fwd_op.launcher(
        x[None], targets[None], 0, 0.5, temperature, None, -100
    )
    assert (passes <= 4).all(), passes


@triton.jit
def _candidates_probe(out_ptr, lo_ptr, hi_ptr, frac_ptr, N_CAND: tl.constexpr,
                      INPUT_KEYS: tl.constexpr):  # fmt: skip
    """A key-phase search pass's candidates (pass 3: no value spreading) for bracket ``i``:
    on fp32 ``z`` keys, or (``INPUT_KEYS``) on bf16 logits' own keys at T = 1."""
    i = tl.program_id(0)
    lo = tl.load(lo_ptr + i)
    hi = tl.load(hi_ptr + i)
    frac = tl.load(frac_ptr + i)
    if INPUT_KEYS:
        cand = _input_candidates(lo, hi, 3, frac, 1.0, N_CAND, tl.uint16, tl.bfloat16,
                                 tl.float32)  # fmt: skip
    else:
        cand = _candidates(lo, hi, 3, frac, N_CAND, tl.float32)
    tl.store(out_ptr + i * N_CAND + tl.arange(0, N_CAND), cand)


@pytest.mark.parametrize("keys", ("fp32", "bf16"))
def test_search_candidates_near_the_estimate(keys, device):
    """Brackets of 1 - 139 keys (every size to 19, then those at the edges) and cut
    estimates (NaN, outside [0, 1], 0 ... 1): the candidates lie in the bracket, the
    smallest its ``lo``; the largest gap between them (and ``hi``) at most ``ceil(R / 16)``
    keys, or ``ceil(R / 8) <= 16`` for 17 - 128 keys with a usable estimate, whose
    consecutive keys around the estimate (three below to three above) are each a candidate
    with the next key one too: the next pass closes any such bracket (two passes either
    way), this one where the cut is by the estimate."""
    fracs = [math.nan, -0.1, 0.0, 1e-9, 0.1, 0.37, 0.5, 0.9, 1 - 1e-7, 1.0, 1.1]
    sizes = [*range(1, 20), 31, 32, 33, 60, 63, 64, 65, 100, 127, 128, 129, 130, 139]
    base = torch.tensor(1.0, dtype=torch.float32 if keys == "fp32" else torch.bfloat16)
    int_t = torch.int32 if keys == "fp32" else torch.int16
    k0 = int(base.view(int_t))
    as_value = lambda k: torch.tensor(k, dtype=int_t).view(base.dtype).float()  # noqa: E731
    rows = [(r, f) for r in sizes for f in fracs]
    lo = torch.stack([as_value(k0) for _ in rows]).to(device)
    hi = torch.stack([as_value(k0 + r) for r, _ in rows]).to(device)
    frac = torch.tensor([f for _, f in rows], dtype=torch.float32, device=device)
    out = torch.full((len(rows), 16), math.nan, device=device)
    _candidates_probe[(len(rows),)](out, lo, hi, frac, N_CAND=16, INPUT_KEYS=keys == "bf16")
    cand_keys = out.cpu().to(base.dtype).view(int_t).long() - k0  # exact: bf16 / fp32 values
    for (r, f), ck in zip(rows, cand_keys.tolist(), strict=True):
        got = sorted(set(ck))
        assert got[0] == 0 and got[-1] < r, (r, f, ck)
        gaps = [b - a for a, b in zip(got, [*got[1:], r], strict=True)]
        usable = 16 < r <= 128 and 0.0 <= f <= 1.0
        assert max(gaps) <= (math.ceil(r / 8) if usable else max(1, math.ceil(r / 16))), (r, f)
        if usable:
            est = r - math.ceil(r * f)
            near = [k for k in range(est - 3, est + 4) if 0 < k < r]
            assert all(k in got and (k + 1 in got or k + 1 == r) for k in near[:-1]), (r, f)


def test_top_p_search_closes_on_the_estimated_key(device):
    """A flat bf16 row (Gaussian logits of deviation 2, V = 32768) at p = 0.9: after pass A
    and a pass over evenly spaced values the cut's bracket holds ~60 bf16 keys; the next
    pass puts half its candidates at consecutive keys around the cut estimated from the
    bracket's masses and closes on the cut's key: 3 reads a row (4 with every candidate
    evenly over the keys), the values the oracle's."""
    g = torch.Generator().manual_seed(23)
    x = (torch.randn(1, 2, 32768, generator=g) * 2).to(device, torch.bfloat16)
    targets = x.float().argmax(-1)
    logp, _, passes = T.truncated_logprobs_fwd_op.launcher(x, targets, 0, 0.9, 1.0, None, -100)
    assert passes.tolist() == [3, 3]
    assert_rel(logp, oracle(x, targets, top_p=0.9).to(logp.dtype), FP32_TOL, "logp")


def test_token_logprobs_takes_top_k_and_top_p(device):
    """``token_logprobs(..., top_k=, top_p=)`` is ``truncated_logprobs`` (the same values and
    gradients); the options it does not take with truncation raise naming them."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(2, 3, 37, generator=g).to(device)
    targets = torch.randint(0, 37, (2, 3), generator=g).to(device)
    for kw in (dict(top_k=5), dict(top_p=0.7), dict(top_k=9, top_p=0.5, temperature=0.8),
               dict(top_k=9, top_p=0.9, softcap=2.5)):  # fmt: skip
        a = logits.clone().requires_grad_(True)
        b = logits.clone().requires_grad_(True)
        got = fused_rl.token_logprobs(a, targets, **kw)
        want = fused_rl.truncated_logprobs(b, targets, **kw)
        assert torch.equal(got, want)
        up = torch.randn(want.shape, generator=g).to(device)
        up = torch.where(torch.isfinite(want), up, 0.0)
        got.backward(up)
        want.backward(up)
        assert torch.equal(a.grad, b.grad)
    for bad, name in ((dict(return_entropy=True), "return_entropy"),
                      (dict(inplace=True), "inplace")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            fused_rl.token_logprobs(logits, targets, top_k=5, **bad)


# ----------------------------------------------------------------------------- sm_90 compile

# Run in a subprocess without TRITON_INTERPRET (this process interprets): every variant of
# both truncated kernels (the three cuts' on / off combinations, the soft cap, fp32 and fp64
# accumulation) and of the vocabulary-parallel partials, search and radix kernels through
# Triton's front end, LLVM and ptxas for cuda:90, no GPU needed; the pointer offsets 64-bit
# (``hopper_compile.narrow_offset_products``); a bf16 row's loads (and the backward's stores)
# 128-bit vectors.
_COMPILE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import triton, triton.language as tl
from triton.compiler import ASTSource
from hopper_compile import (SM90, kernel_signature, narrow_offset_products,
                            search_pass_instructions, sm90_options, stack_bytes)
from fused_rl._launch import vocab_launch
from fused_rl._truncated_ops import N_CAND, NUM_WARPS, SEARCH_BLOCK, SOFTCAP_SEARCH_BLOCK, _block
SB16, SB64 = SEARCH_BLOCK[16], SEARCH_BLOCK[64]
import fused_rl.kernels.vocab.truncated as k
import fused_rl.kernels.vocab.truncated_shard as s

FLOATS = {"inv_t_hi", "inv_t_lo", "inv_cap_hi", "inv_cap_lo", "p_hi", "p_lo", "log1mp_hi",
          "log1mp_lo"}

def signature(fn, logits, acc):
    pointers = {"targets_ptr": "*i64", "passes_ptr": "*i32", "logits_ptr": logits,
                "grad_ptr": logits, "hist_ptr": "*i32", "on_ptr": "*i8", "prefix_ptr": "*i64",
                "key_ptr": "*i64"}
    return kernel_signature(fn, FLOATS, pointers, acc)

count = 0
for logits, acc, ACC, passes, sb in (("*bf16", "*fp32", tl.float32, 11, SB16),
                                     ("*fp64", "*fp64", tl.float64, 22, SB64)):
    cuts = [(False, False, False), (True, False, False), (True, False, True),
            (False, False, True), (False, True, False), (False, True, True)]
    for (reg, search, top_p) in cuts:
        for cap in (False, True):
            flags = dict(TOPK_REG=reg, SEARCH_K=search, TOP_P=top_p, HAS_SOFTCAP=cap,
                         BLOCK_V=1024, SEARCH_BLOCK=sb, N_CAND=16,
                         MAX_SEARCH_PASSES=passes, ACC=ACC)
            fn = k._truncated_logprobs_fwd_kernel
            src = ASTSource(fn=fn, signature=signature(fn, logits, acc), constexprs=flags)
            c = triton.compile(src, target=SM90, options=sm90_options(1))
            assert not narrow_offset_products(c.asm["ttir"]), (flags, "narrow offsets")
            count += 1
    for cap, kept in ((False, False), (True, False), (False, True)):
        fn = k._truncated_logprobs_bwd_kernel
        src = ASTSource(fn=fn, signature=signature(fn, logits, acc),
                        constexprs=dict(HAS_SOFTCAP=cap, TARGET_KEPT=kept, BLOCK_V=4096, ACC=ACC))
        c = triton.compile(src, target=SM90, options=sm90_options(8))
        assert not narrow_offset_products(c.asm["ttir"]), ("bwd", cap)
        count += 1
    # the vocabulary-parallel kernels (kernels/vocab/truncated_shard.py)
    for need_sum, hist, cap in ((True, False, False), (False, True, True)):
        fn = s._shard_partials_kernel
        src = ASTSource(fn=fn, signature=signature(fn, logits, acc), constexprs=dict(
            NEED_SUM=need_sum, HIST=hist, HAS_SOFTCAP=cap, BLOCK_V=1024, ACC=ACC))
        c = triton.compile(src, target=SM90, options=sm90_options(1))
        assert not narrow_offset_products(c.asm["ttir"]), ("partials", need_sum)
        count += 1
    for narrow, stream, collect, cap in ((False, True, False, False), (True, True, False, True),
                                         (True, True, False, False),
                                         (False, False, True, True)):
        fn = s._shard_search_kernel
        src = ASTSource(fn=fn, signature=signature(fn, logits, acc), constexprs=dict(
            NARROW=narrow, STREAM=stream, COLLECT=collect, N_CAND=16, SEARCH_BLOCK=sb,
            BLOCK_V=1024, MAX_SEARCH_PASSES=passes, HAS_SOFTCAP=cap, ACC=ACC))
        c = triton.compile(src, target=SM90, options=sm90_options(1))
        assert not narrow_offset_products(c.asm["ttir"]), ("search", narrow, stream)
        count += 1
    for fn, flags in ((s._shard_digit_kernel, dict(LAST=False, HAS_SOFTCAP=False)),
                      (s._shard_digit_kernel, dict(LAST=True, HAS_SOFTCAP=False)),
                      (s._shard_digit_kernel, dict(LAST=True, HAS_SOFTCAP=True)),
                      (s._shard_kth_kernel, dict(HAS_SOFTCAP=False)),
                      (s._shard_kth_kernel, dict(HAS_SOFTCAP=True))):
        src = ASTSource(fn=fn, signature=signature(fn, logits, acc), constexprs=dict(
            BLOCK_V=1024, ACC=ACC, **flags))
        c = triton.compile(src, target=SM90, options=sm90_options(1))
        assert not narrow_offset_products(c.asm["ttir"]), (fn.__name__, flags)
        count += 1
# fn compiled as Triton specialises it at a launch on a row of unit stride with 16-divisible
# pointers, length and row strides (V = 151936)
def as_launched(fn, logits, acc, warps, **flags):
    names = [p.name for p in fn.params if not p.is_constexpr]
    aligned = ("V", "stride_outer", "stride_inner", "grad_stride_outer", "grad_stride_inner")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in aligned}
    sig = dict(signature(fn, logits, acc), stride_v="constexpr")
    ACC = tl.float64 if logits == "*fp64" else tl.float32
    src = ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=dict(
        {"HAS_SOFTCAP": False}, stride_v=1, ACC=ACC, **flags))
    return triton.compile(src, target=SM90, options=sm90_options(warps))

# a bf16 row with unit stride and 16-aligned lengths: 128-bit loads (and stores backward)
for fn, flags, warps in ((k._truncated_logprobs_fwd_kernel,
                          dict(TOPK_REG=True, SEARCH_K=False, TOP_P=True, BLOCK_V=1024,
                               SEARCH_BLOCK=SB16, N_CAND=16, MAX_SEARCH_PASSES=11), 1),
                         (k._truncated_logprobs_bwd_kernel, dict(BLOCK_V=4096, TARGET_KEPT=False),
                          8)):
    ptx = as_launched(fn, "*bf16", "*fp32", warps, **flags).asm["ptx"]
    assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, fn.__name__
    assert fn is k._truncated_logprobs_fwd_kernel or "st.global.v4" in ptx, fn.__name__
    count += 1
# as launched at V = 151936: no register spilled (no stack frame in the cubin); the forward
# in every logits dtype, with and without the soft cap, each with its search block
bwd_launch = vocab_launch(151936, writes=True)
launched = [(k._truncated_logprobs_fwd_kernel, "*bf16", _block(151936), NUM_WARPS,
             dict(TOPK_REG=reg, SEARCH_K=search, TOP_P=True, SEARCH_BLOCK=SB16, N_CAND=16,
                  MAX_SEARCH_PASSES=7)) for reg, search in ((True, False), (False, True))]
launched += [(k._truncated_logprobs_fwd_kernel, logits, _block(151936), NUM_WARPS,
              dict(TOPK_REG=False, SEARCH_K=search, TOP_P=True, N_CAND=16, HAS_SOFTCAP=cap,
                   SEARCH_BLOCK=SOFTCAP_SEARCH_BLOCK if cap else SEARCH_BLOCK[bits],
                   MAX_SEARCH_PASSES=passes))
             for logits, bits, passes in (("*bf16", 16, 11), ("*fp32", 32, 11),
                                          ("*fp64", 64, 22))
             for search in (False, True) for cap in (False, True) if cap or bits > 16]
launched.append((k._truncated_logprobs_bwd_kernel, "*bf16", bwd_launch["BLOCK_V"],
                 bwd_launch["num_warps"], dict(TARGET_KEPT=False)))
launched += [(s._shard_partials_kernel, "*bf16", _block(151936), NUM_WARPS,
              dict(NEED_SUM=False, HIST=True)),
             (s._shard_digit_kernel, "*bf16", _block(151936), NUM_WARPS, dict(LAST=True)),
             (s._shard_kth_kernel, "*bf16", _block(151936), NUM_WARPS, {}),
             (s._shard_search_kernel, "*bf16", _block(151936), NUM_WARPS,
              dict(NARROW=True, STREAM=True, COLLECT=False, N_CAND=16, SEARCH_BLOCK=SB16,
                   MAX_SEARCH_PASSES=7)),
             (s._shard_search_kernel, "*bf16", _block(151936), NUM_WARPS,
              dict(NARROW=True, STREAM=True, COLLECT=False, N_CAND=16, HAS_SOFTCAP=True,
                   SEARCH_BLOCK=SOFTCAP_SEARCH_BLOCK, MAX_SEARCH_PASSES=11))]
for fn, logits, block, warps, flags in launched:
    acc = "*fp64" if logits == "*fp64" else "*fp32"
    c = as_launched(fn, logits, acc, warps, BLOCK_V=block, **flags)
    assert stack_bytes(c.asm["cubin"]) == 0, (fn.__name__, logits, flags, "registers spilled")
# a top-p search pass is compute-bound (16 candidates a logit): its step's instructions
print("search pass", search_pass_instructions(SB16, N_CAND, NUM_WARPS))
print("compiled", count)
"""


@pytest.mark.integration
@pytest.mark.timeout(600)  # a subprocess's minutes of compiling (see test_compile_hopper)
@pytest.mark.no_poison
def test_kernels_compile_for_sm90():
    """Every truncation kernel compiles for sm_90 (64-bit offsets, vector loads, no spills as
    launched), and a top-p search pass costs at most 1.8 SASS instructions a logit (1.70
    with ``kernels.common.widen``, 1.71 before it, summing every value at or above each
    candidate; 1.86 with a test of the bracket's bounds
    a value; 2.2 with one bf16 logit a column a step of 64, not 8 read as one vector; 6.5
    when each step of 128 logits reduced its 32 sums across the warp, 2026-11-29)."""
    pytest.importorskip("triton.backends.compiler")
    out = sm90_compile_output(_COMPILE_SCRIPT)
    assert out.endswith("compiled 54"), out
    per_logit = float(re.search(r"search pass ([0-9.]+)", out).group(1))
    assert per_logit <= 1.8, f"a top-p search pass costs {per_logit:.2f} instructions a logit"
