"""``token_stats`` / ``linear_token_stats``: the log-prob, the entropy and the diagnostics
SFT / DPO / KTO trainers log (mean logit, ``log sum p^2``, the target is the top-1
prediction) from one read of each logits row.

Oracle: float64 from the materialised logits with plain PyTorch (``log_softmax``,
``argmax``), on both backends: values of all five outputs, gradients of ``logp`` and
``entropy`` under random upstream gradients; awkward vocabularies, the causal window
(S > T), strided logits, ignored tokens and fully ignored batches, ties at the maximum,
NaN rows, bf16 / fp16; gradcheck; ``torch.compile(fullgraph=True)``; one layer-1 launch
forward; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FP32_TOL, assert_rel, gradcheck, oracle_token_stats

import fused_rl
from fused_rl.profiling import LaunchCounter

BACKENDS = ("triton", "reference")


def _scaled(x, temperature, softcap):
    x = x.double()
    return (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature


def _oracle(logits, targets, temperature=1.0, softcap=None, ignore_index=-100):
    """float64 ``(logp, entropy, mean_logit, log_sum_sq_probs, is_top1)`` of ``(..., V)``
    logits for ``logits.shape[:-1]`` targets; 0 (False) where ignored."""
    z = _scaled(logits, temperature, softcap)
    logp, entropy = oracle_token_stats(z, targets, 1.0, ignore_index)
    keep = targets != ignore_index
    zero = torch.zeros_like(logp)
    mean = torch.where(keep, z.mean(-1), zero)
    log_sq = torch.where(keep, torch.logsumexp(2 * torch.log_softmax(z, -1), -1), zero)
    top1 = (logits.argmax(-1) == targets) & keep  # argmax of the logits as given
    return logp, entropy, mean, log_sq, top1


def _check(stats, want, tol, what=""):
    names = ("logp", "entropy", "mean_logit", "log_sum_sq_probs")
    for name, got, ref in zip(names, stats[:4], want[:4]):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert_rel(got, ref, tol, f"{what} {name}")
    assert stats.is_top1.dtype == torch.bool
    assert torch.equal(stats.is_top1.cpu(), want[4].cpu()), f"{what} is_top1"


def _grads(outs, leaf, up):
    return torch.autograd.grad(outs, leaf, grad_outputs=up)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "vocab, shape, window",
    [(1, (3, 4), False), (7, (2, 5), True), (37, (4,), False), (1000, (2, 3), True),
     (4099, (1, 2), False), (11, (1, 1), True)],
    ids=["V1", "V7-window", "V37-2d", "V1000-window", "V4099", "T1-window"],
)  # fmt: skip
@pytest.mark.parametrize("transform", [(1.0, None), (0.7, None), (0.8, 2.5)], ids=str)
def test_values_and_gradients_match_float64(backend, vocab, shape, window, transform, device):
    temperature, softcap = transform
    torch.manual_seed(vocab + len(shape))
    positions = shape[:-1] + (shape[-1] + 1,) if window else shape
    base = torch.randn(*positions, vocab, device=device) * 3
    targets = torch.randint(0, vocab, shape, device=device)
    targets.view(-1)[0] = -100 if targets.numel() > 1 else targets.view(-1)[0]
    view = (lambda x: x[..., :-1, :]) if window else (lambda x: x)
    leaf = base.clone().requires_grad_()
    stats = fused_rl.token_stats(
        leaf, targets, temperature=temperature, softcap=softcap, backend=backend
    )
    oleaf = base.double().requires_grad_()
    want = _oracle(view(oleaf), targets, temperature, softcap)
    _check(stats, want, FP32_TOL, backend)
    assert stats.logp.dtype == torch.float32
    up = [torch.randn(shape, device=device) for _ in range(2)]
    got = _grads(stats[:2], leaf, up)
    ref = _grads(want[:2], oleaf, [u.double() for u in up])
    assert got.dtype == base.dtype
    assert_rel(got, ref, FP32_TOL, f"{backend} grad")
    if window:  # the position past the window gets exactly 0
        assert torch.equal(got[..., -1, :], torch.zeros_like(got[..., -1, :]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_count_the_first_maximum(backend, device):
    """``is_top1`` is ``argmax == target`` with ``argmax``'s rule: the lowest id of a tie."""
    logits = torch.zeros(6, 9, device=device)
    logits[:, 2] = logits[:, 6] = 3.0  # tie between ids 2 and 6 in every row
    logits[4, 4] = 5.0  # row 4: a unique maximum at 4
    targets = torch.tensor([2, 6, 0, 8, 4, 2], device=device)
    for softcap in (None, 4.0):
        stats = fused_rl.token_stats(logits, targets, softcap=softcap, backend=backend)
        assert stats.is_top1.tolist() == [True, False, False, False, True, True]
    # the block boundary of the streamed row: the tie split across two blocks
    wide = torch.zeros(2, 3000, device=device)
    wide[:, 10] = wide[:, 2500] = 1.0
    stats = fused_rl.token_stats(wide, torch.tensor([10, 2500], device=device), backend=backend)
    assert stats.is_top1.tolist() == [True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_and_fully_ignored_batch(backend, device):
    torch.manual_seed(3)
    base = torch.randn(2, 4, 13, device=device)
    for targets in (torch.randint(0, 13, (2, 4), device=device), torch.full((2, 4), -7)):
        targets = targets.to(device)
        targets[0, 1] = -7
        leaf = base.clone().requires_grad_()
        stats = fused_rl.token_stats(leaf, targets, ignore_index=-7, backend=backend)
        ignored = targets == -7
        for out in stats[:4]:
            assert torch.equal(out[ignored], torch.zeros_like(out[ignored]))
        assert not stats.is_top1[ignored].any()
        up = [torch.randn(2, 4, device=device) for _ in range(2)]
        grad = _grads(stats[:2], leaf, up)
        assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_gives_nan_and_no_top1(backend, device):
    """NaN in a row is NaN in its float outputs and no top-1 prediction; other rows keep
    their values."""
    torch.manual_seed(4)
    logits = torch.randn(3, 17, device=device)
    targets = logits.argmax(-1)
    logits[1, 5] = float("nan")
    stats = fused_rl.token_stats(logits, targets, backend=backend)
    for out in stats[:4]:
        assert out[1].isnan() and out[[0, 2]].isfinite().all()
    assert stats.is_top1.tolist() == [True, False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_logits_follow_argmax(backend, device):
    """``+inf`` and all-``-inf`` rows: ``is_top1`` is ``torch.argmax``'s answer (the first
    infinite maximum; id 0 of an all-``-inf`` row), on both backends."""
    inf = float("inf")
    logits = torch.randn(5, 9, device=device)
    logits[0, 4] = inf  # the target is the +inf
    logits[1, 2] = logits[1, 6] = inf  # two, the target the later one
    logits[2] = logits[3] = -inf  # all -inf: argmax is 0
    logits[4, :] = -inf
    logits[4, 3] = 1.0
    targets = torch.tensor([4, 6, 0, 5, 3], device=device)
    stats = fused_rl.token_stats(logits, targets, backend=backend)
    assert stats.is_top1.tolist() == (logits.argmax(-1) == targets).tolist()
    assert stats.is_top1.tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", [(3.5, None), (0.3, 1.5)], ids=["T3.5", "T0.3-cap"])
def test_top1_ranks_the_logits_not_their_rounding(backend, transform, device):
    """Two logits one ulp apart stay ordered whatever the temperature or the cap round them
    to (fp32 ``x / T`` or ``c tanh(x / c)`` may make them equal): the flag is the argmax of
    the logits as given, the same on both backends."""
    temperature, softcap = transform
    torch.manual_seed(10)
    x = torch.rand(128, device=device) * 4 + 1
    logits = torch.full((128, 8), -5.0, device=device)
    logits[:, 3] = x
    logits[:, 5] = torch.nextafter(x, torch.full_like(x, 100.0))  # one ulp above
    targets = torch.full((128,), 5, device=device)
    stats = fused_rl.token_stats(
        logits, targets, temperature=temperature, softcap=softcap, backend=backend
    )
    assert stats.is_top1.all()
    stats = fused_rl.token_stats(logits, torch.full_like(targets, 3), temperature=temperature,
                                 softcap=softcap, backend=backend)  # fmt: skip
    assert not stats.is_top1.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(backend, dtype, device):
    """16-bit logits: the statistics of the upcast values (fp32 accumulation), the top-1
    flag exactly ``argmax`` of the stored values (bf16 rounding makes ties common)."""
    torch.manual_seed(5)
    logits = (torch.randn(3, 6, 301, device=device) * 4).to(dtype)
    targets = logits.float().argmax(-1)
    targets[:, ::2] = torch.randint(0, 301, (3, 3), device=device)
    logits[0, 0, :5] = logits[0, 0].max()  # a five-way tie at the top
    targets[0, 0] = 3
    stats = fused_rl.token_stats(logits, targets, backend=backend)
    _check(stats, _oracle(logits, targets), 2e-6, str(dtype))
    assert not stats.is_top1[0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_logits(backend, device):
    torch.manual_seed(6)
    base = torch.randn(9, 3, 40, device=device)
    logits = base.transpose(0, 1)[:, ::2, 1:]  # (3, 5, 39), every stride unusual
    targets = torch.randint(0, 39, (3, 5), device=device)
    stats = fused_rl.token_stats(logits, targets, backend=backend)
    _check(stats, _oracle(logits, targets), FP32_TOL, "strided")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    torch.manual_seed(7)
    logits = torch.randn(2, 4, 7, device=device, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), device=device)
    targets[1, 0] = -100
    w = torch.randn(2, 3, device=device, dtype=torch.float64)

    def fn(x):
        s = fused_rl.token_stats(x, targets, temperature=0.6, softcap=3.0, backend=backend)
        return s.logp, s.entropy * w

    assert gradcheck(fn, (logits,))


@pytest.mark.no_poison
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    torch.manual_seed(8)
    base = torch.randn(2, 5, 23, device=device)
    targets = torch.randint(0, 23, (2, 4), device=device)
    targets[0, 2] = -100
    h = torch.randn(2, 5, 6, device=device)
    w = torch.randn(23, 6, device=device)

    def fn(x, hidden, weight):
        s = fused_rl.token_stats(x[:, :-1], targets, temperature=0.9, backend=backend)
        ls = fused_rl.linear_token_stats(hidden, weight, targets, chunk_tokens=3, backend=backend)
        loss = (s.logp + 0.1 * s.entropy).sum() + (ls.logp - 0.1 * ls.entropy).sum()
        return loss, s.mean_logit, s.is_top1, ls.log_sum_sq_probs, ls.is_top1

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (base, h, w)]
        out = f(*leaves)
        grads = torch.autograd.grad(out[0], leaves)
        results.append((out, grads))
    (eager, eager_g), (comp, comp_g) = results
    for a, b in zip([*eager, *eager_g], [*comp, *comp_g]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_one_launch_forward_one_backward(device):
    torch.manual_seed(9)
    logits = torch.randn(2, 6, 50, device=device, requires_grad=True)
    targets = torch.randint(0, 50, (2, 5), device=device)
    with LaunchCounter() as c:
        s = fused_rl.token_stats(logits, targets, backend="triton")
        (s.logp.sum() + s.entropy.sum()).backward()
    assert c.kernels == ["_token_stats_fwd_kernel", "_token_stats_bwd_kernel"], c.kernels
    h = torch.randn(13, 8, device=device, requires_grad=True)
    w = torch.randn(50, 8, device=device, requires_grad=True)
    t = torch.randint(0, 50, (13,), device=device)
    with LaunchCounter() as c:  # one layer-1 launch a chunk: 13 rows in chunks of 5
        fused_rl.linear_token_stats(h, w, t, chunk_tokens=5, backend="triton")
    assert c.kernels == ["_token_stats_fwd_kernel"] * 3, c.kernels


def test_errors_name_the_argument(device):
    logits = torch.randn(2, 3, 7, device=device)
    targets = torch.randint(0, 7, (2, 3), device=device)
    bad = targets.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match="targets"):
        fused_rl.token_stats(logits, bad)
    with pytest.raises(ValueError, match="temperature"):
        fused_rl.token_stats(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        fused_rl.token_stats(logits, targets, softcap=-1.0)
    with pytest.raises(TypeError, match="logits"):
        fused_rl.token_stats(logits.long(), targets)
    with pytest.raises(ValueError, match="targets"):
        fused_rl.linear_token_stats(torch.randn(6, 4, device=device),
                                    torch.randn(7, 4, device=device), bad.view(-1))  # fmt: skip
    with pytest.raises(ValueError, match="backend"):
        fused_rl.token_stats(logits, targets, backend="cuda")


# ----------------------------------------------------------------------------- linear


def _linear_inputs(n, hdim, vocab, dtype, device, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 3).to(device, dtype)
    b = torch.randn(vocab, generator=g).to(device, dtype) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    return h, w, b, t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", (1, 4, 13, 64))
@pytest.mark.parametrize("bias", (True, False))
def test_linear_values_and_gradients_match_float64(backend, chunk, bias, device):
    h, w, b, t = _linear_inputs(13, 8, 37, torch.float32, device, chunk, bias)
    t[1] = -100
    t[5] = F.linear(h[5], w, b).argmax()  # at least one top-1 hit
    leaves = [x.clone().requires_grad_() for x in (h, w, b) if x is not None]
    hl, wl = leaves[:2]
    bl = leaves[2] if bias else None
    stats = fused_rl.linear_token_stats(
        hl, wl, t, bias=bl, temperature=0.7, softcap=5.0, chunk_tokens=chunk, backend=backend
    )
    oleaves = [x.double().requires_grad_() for x in leaves]
    logits = F.linear(oleaves[0], oleaves[1], oleaves[2] if bias else None)
    want = _oracle(logits, t, 0.7, 5.0)
    _check(stats, want, FP32_TOL, f"{backend} linear")
    assert stats.is_top1[5]
    up = [torch.randn(t.shape, device=device) for _ in range(2)]
    got = torch.autograd.grad(stats[:2], leaves, grad_outputs=up)
    ref = torch.autograd.grad(want[:2], oleaves, grad_outputs=[u.double() for u in up])
    for name, a, r in zip(("hidden", "weight", "bias"), got, ref):
        assert_rel(a, r, FP32_TOL, f"{backend} d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_causal_window_and_bf16(backend, device):
    """``(B, S, H)`` hidden states with ``(B, T)`` targets, T < S (the causal shift), in
    bf16: the statistics of the bf16 logits, exact top-1 of them."""
    h, w, _, _ = _linear_inputs(2 * 7, 16, 301, torch.bfloat16, device, 11, bias=False)
    h = h.view(2, 7, 16)
    targets = torch.randint(0, 301, (2, 5), device=device)
    logits = F.linear(h[:, 1:6], w)  # rows S - T - 1 ... S - 2, rounded to bf16
    targets[:, 1] = logits[:, 1].float().argmax(-1)
    stats = fused_rl.linear_token_stats(h, w, targets, chunk_tokens=4, backend=backend)
    want = _oracle(logits, targets)
    _check(stats, want, 2e-6, f"{backend} bf16 window")
    assert stats.is_top1[:, 1].all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_gradcheck_float64(backend, device):
    h, w, b, t = _linear_inputs(5, 3, 7, torch.float64, device, 12)
    t[2] = -100
    leaves = [x.requires_grad_() for x in (h, w, b)]

    def fn(hh, ww, bb):
        s = fused_rl.linear_token_stats(hh, ww, t, bias=bb, chunk_tokens=2, backend=backend)
        return s.logp, s.entropy

    assert gradcheck(fn, leaves)
