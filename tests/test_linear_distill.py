"""fused_rl.linear_distill_loss (on-policy distillation from both models' hidden states,
chunk by chunk) against a float64 oracle (the materialised logits of both heads through the
formulas of TRL's ``generalized_jsd_loss``, ``tests/test_distill.py``) and against
``distill_loss(F.linear(...), F.linear(...))``: values, metrics and the gradients of hidden,
weight and bias under a random upstream gradient, on both backends, fp32 and bf16; chunkings,
masks, NaN, a teacher of another width, bad inputs, gradcheck, torch.compile, batch
invariance, GEMMs per chunk and the allocations (nothing of N * V elements)."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import BATCH_INVARIANT_BACKENDS, F64_TOL, FP32_TOL, gradcheck, rel_err
from test_distill import SPLIT_CASES, oracle_call

import fused_rl
import fused_rl.linear_distill as mod
from fused_rl._agg import LOSS_AGG_MODES
from fused_rl._backend import interpreter_enabled
from fused_rl.profiling import AllocationTracker

BACKENDS = ("triton", "reference")
B, T, H, H_T, V = 2, 7, 8, 12, 37


def make(lead=(B, T), hdim=H, t_hdim=H_T, vocab=V, dtype=torch.float32, seed=0, bias=True,
         t_dtype=None):  # fmt: skip
    """Student (hidden, weight, bias) requiring grad and a teacher (hidden, weight, bias) of
    width ``t_hdim``, logits of scale ~2."""
    g = torch.Generator().manual_seed(seed)
    t_dtype = t_dtype or dtype
    rand = lambda *s, sc=1.0, dt=dtype: (torch.randn(*s, generator=g) * sc).to(DEVICE, dt)  # noqa: E731
    h = rand(*lead, hdim).requires_grad_()
    w = rand(vocab, hdim, sc=2 / hdim**0.5).requires_grad_()
    b = rand(vocab, sc=0.5).requires_grad_() if bias else None
    th = rand(*lead, t_hdim, dt=t_dtype)
    tw = rand(vocab, t_hdim, sc=2 / t_hdim**0.5, dt=t_dtype)
    tb = rand(vocab, sc=0.5, dt=t_dtype) if bias else None
    return (h, w, b), (th, tw, tb), g


def student_params(student):
    return [x for x in student if x is not None]


def oracle(student, teacher, up, **kw):
    """float64 ``(loss, metrics, grads of the student's params)`` of the materialised
    logits."""
    leaves = [x.detach().double().requires_grad_() for x in student_params(student)]
    h, w, *b = leaves
    # the teacher's logits as its head computes them (a 16-bit teacher's are rounded: an
    # input of the loss), then float64
    zt = F.linear(*(None if x is None else x.detach() for x in teacher)).double()
    loss, metrics = oracle_call(F.linear(h, w, b[0] if b else None), zt, **kw)
    grads = torch.autograd.grad(loss, leaves, up.double()) if loss.requires_grad else None
    return loss, metrics, grads


def ours(student, teacher, up, **kw):
    h, w, b = student
    th, tw, tb = teacher
    loss, metrics = fused_rl.linear_distill_loss(h, w, th, tw, bias=b, teacher_bias=tb, **kw)
    grads = torch.autograd.grad(loss, student_params(student), up.to(loss.dtype))
    return loss, metrics, grads


def materialised(student, teacher, up, **kw):
    """``distill_loss`` on the heads' logits in the inputs' dtype (what the op replaces)."""
    h, w, b = student
    th, tw, tb = teacher
    kw.pop("chunk_tokens", None)
    loss, metrics = fused_rl.distill_loss(F.linear(h, w, b), F.linear(th, tw, tb), **kw)
    grads = torch.autograd.grad(loss, student_params(student), up.to(loss.dtype))
    return loss, metrics, grads


def check(student, teacher, *, dtype=torch.float32, seed=1, **kw):
    """Ours against the float64 oracle: fp32 at ``FP32_TOL`` (fp64 at ``F64_TOL``), 16-bit
    no worse than twice the materialised call in the same dtype (floor 1e-3)."""
    up = torch.randn((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    up = up.to(DEVICE)
    got = ours(student, teacher, up, **kw)
    okw = {k: v for k, v in kw.items() if k not in ("chunk_tokens", "backend")}
    want = oracle(student, teacher, up, **okw)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got[0].shape == () and not any(m.requires_grad for m in got[1].values())
    if dtype in (torch.float32, torch.float64):
        tol = F64_TOL if dtype == torch.float64 else FP32_TOL
        tols = [tol] * (2 + len(got[2]))
    else:
        mat = materialised(student, teacher, up, **kw)
        tols = [max(2 * rel_err(mat[0], want[0]), 1e-3), mat[1]]
        tols += [max(2 * rel_err(a, e), 1e-3) for a, e in zip(mat[2], want[2], strict=True)]
    assert rel_err(got[0], want[0]) <= tols[0], (float(got[0]), float(want[0]))
    for name, value in want[1].items():
        assert got[1][name].dtype == torch.float32 and got[1][name].shape == ()
        if isinstance(tols[1], dict):  # the materialised call's metrics
            tol = max(2 * rel_err(tols[1][name], value), 1e-3)
        else:
            tol = max(tols[1], 1e-6)
        assert rel_err(got[1][name], value) <= tol, name
    for name, a, e, tol in zip(("hidden", "weight", "bias"), got[2], want[2], tols[2:]):
        assert a.dtype == dtype and a.shape == e.shape, name
        half = dtype in (torch.bfloat16, torch.float16)
        if half and kw.get("backend") == "triton" and interpreter_enabled():
            # the backward's in-place scale by the upstream gradient rounds toward zero in
            # the interpreter (on a GPU, as torch, to nearest even): one more unit there
            tol += torch.finfo(dtype).eps
        assert rel_err(a, e) <= tol, (name, rel_err(a, e), tol)
    return got


# ----------------------------------------------------------------------------- values, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9999, 1.0])
def test_matches_oracle(beta, dtype, backend):
    """A float mask with a zero, ignored targets, temperature, biases, a teacher wider than
    the student (H_t != H), chunks of 4 rows over 14 (not dividing). ``beta = 0.9999``: the
    mixture near the teacher, where the fp32 JSD's terms cancel by ``1 / (1 - beta)`` unless
    formed as ``kernels/vocab/distill.py`` ``mixture_terms`` does (the fp32 loss was 1.7e-3
    off on the reference backend, the gradients 1.7e-4 on Triton's)."""
    student, teacher, g = make(dtype=dtype, seed=int(beta * 10))
    mask = torch.rand(B, T, generator=g).to(DEVICE)
    mask[0, 2] = 0.0
    targets = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    targets[1, :2] = -100
    check(student, teacher, dtype=dtype, beta=beta, temperature=0.7, mask=mask,
          targets=targets, chunk_tokens=4, backend=backend)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_softcap(beta, backend):
    """``softcap``: each chunk's logits of both models capped, ``c tanh(z / c)``; the float64
    oracle differentiates through the cap on the materialised logits (chunks of 4 over 14)."""
    student, teacher, g = make(seed=5)
    cap = 1.5
    mask = (torch.rand(B, T, generator=g) > 0.2).to(DEVICE)
    up = torch.tensor(0.7, dtype=torch.float64, device=DEVICE)
    got = ours(student, teacher, up, beta=beta, softcap=cap, mask=mask, chunk_tokens=4,
               backend=backend)  # fmt: skip
    leaves = [x.detach().double().requires_grad_() for x in student_params(student)]
    h, w, b = leaves
    zt = F.linear(*(x.detach().double() for x in teacher))
    want, want_metrics = oracle_call(cap * torch.tanh(F.linear(h, w, b) / cap),
                                     cap * torch.tanh(zt / cap), beta=beta, mask=mask)  # fmt: skip
    want_grads = torch.autograd.grad(want, leaves, up)
    assert rel_err(got[0], want) <= FP32_TOL
    for name, value in want_metrics.items():
        assert rel_err(got[1][name], value) <= 1e-5, name
    for a, e in zip(got[2], want_grads, strict=True):
        assert rel_err(a, e) <= FP32_TOL


# every case at a generalized JSD; the two KLs (beta 0 and 1, their own branches of the
# kernels) with every transform differing
TRANSFORM_BETAS = [
    *((case, 0.3) for case in ("student_scaled", "teacher_capped", "caps_differ", "all_differ",
                               "scaled_alike")),
    ("all_differ", 0.0),
    ("all_differ", 1.0),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case, beta", TRANSFORM_BETAS)
def test_each_model_its_own_transform(case, beta, dtype, backend):
    """Each model's chunk logits through its own ``c tanh(s x / c) / T``
    (``tests/test_distill.py`` ``SPLIT_CASES``): the float64 oracle on the materialised
    logits (each model's transform, then TRL's divergence), gradients of hidden, weight and
    bias through the student's scale and cap; a float mask, ignored targets, chunks of 4
    over 14; bf16 against twice the materialised ``distill_loss`` in bf16. (Each beta with
    one transform at a time: ``tests/test_distill.py``, the same kernels on the logits.)"""
    student, teacher, g = make(dtype=dtype, seed=7 + int(beta * 10))
    mask = torch.rand(B, T, generator=g).to(DEVICE)
    mask[0, 2] = 0.0
    targets = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    targets[1, :2] = -100
    check(student, teacher, dtype=dtype, beta=beta, temperature=0.8, mask=mask,
          targets=targets, chunk_tokens=4, backend=backend, **SPLIT_CASES[case])  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_equal_transforms_are_the_call_without_them(cap, backend):
    """The transform keywords spelled out at their defaults give bit-identical values,
    metrics and gradients (the one-transform kernels run)."""
    student, teacher, g = make(seed=8)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(DEVICE)
    up = torch.tensor(0.8, dtype=torch.float64, device=DEVICE)
    for beta in (0.0, 0.5, 1.0):
        kw = dict(beta=beta, softcap=cap, mask=mask, chunk_tokens=4, backend=backend)
        want = ours(student, teacher, up, **kw)
        got = ours(student, teacher, up, teacher_softcap=cap, logit_scale=1,
                   teacher_logit_scale=1.0, **kw)  # fmt: skip
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
        assert all(torch.equal(a, e) for a, e in zip(got[2], want[2], strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunkings_and_packed_rows(backend):
    """Packed (N, H) rows (one sequence), no bias, chunks of 1, 5 (not dividing 13), N and
    more than N rows, and the default; a bool mask."""
    student, teacher, g = make(lead=(13,), bias=False, seed=3)
    mask = torch.rand(13, generator=g).to(DEVICE) > 0.2
    for chunk in (1, 5, 13, 64, None):
        check(student, teacher, beta=0.3, temperature=1.3, mask=mask, chunk_tokens=chunk,
              loss_agg="seq-mean-token-mean", backend=backend)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_loss_agg_and_num_items(backend):
    student, teacher, g = make(lead=(3, 4), seed=4)
    mask = (torch.rand(3, 4, generator=g) > 0.3).to(DEVICE)
    mask[2] = False  # an empty sequence
    for agg in LOSS_AGG_MODES:
        cases = [{}]
        if agg == "token-mean":
            cases += [{"num_items": 7}, {"num_items": torch.tensor(4.5, device=DEVICE)}]
        if agg == "seq-mean-token-sum-norm":
            cases += [{"max_length": 9}]
        for kw in cases:
            check(student, teacher, beta=0.6, mask=mask, loss_agg=agg, chunk_tokens=5,
                  backend=backend, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp64_mixed_dtypes_and_strided_hidden(backend):
    """fp64 student (fp64 results at F64_TOL), a bf16 teacher with an fp32 student, and
    transposed (non-contiguous) hidden states of both models."""
    student, teacher, _ = make(dtype=torch.float64, seed=5)
    check(student, teacher, dtype=torch.float64, beta=0.4, chunk_tokens=3, backend=backend)
    student, teacher, _ = make(seed=6, t_dtype=torch.bfloat16)
    check(student, teacher, beta=1.0, chunk_tokens=3, backend=backend)
    (h, w, b), (th, tw, tb), _ = make(lead=(T, B), seed=7)
    h_t = h.detach().transpose(0, 1).requires_grad_()  # (B, T, H), strided, a leaf
    check((h_t, w, b), (th.transpose(0, 1), tw, tb), beta=0.5, chunk_tokens=4, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_ignored_nan_and_empty(backend):
    """Uncounted rows never matter: NaN / inf teacher hidden states there, and a NaN
    student hidden state, whose hidden-gradient row is 0 (its ``dW`` term ``0 * NaN`` is NaN,
    as through ``F.linear``'s backward); a NaN in a counted row's teacher makes the loss NaN;
    a batch where nothing counts gives 0 for the loss, every metric and every gradient; an
    empty batch gives 0 (NaN with a num_items tensor <= 0)."""
    (h, w, b), (th, tw, tb), g = make(seed=8)
    targets = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    targets[0, 3] = -100
    mask = torch.ones(B, T, device=DEVICE)
    mask[1, 5] = 0.0
    th[0, 3] = float("nan")
    th[1, 5] = float("inf")
    up = torch.tensor(0.7, device=DEVICE)
    kw = dict(targets=targets, mask=mask, chunk_tokens=4, backend=backend)
    for beta in (0.0, 0.5, 1.0):
        loss, metrics, (dh, dw, db) = ours((h, w, b), (th, tw, tb), up, beta=beta, **kw)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        assert torch.isfinite(dw).all() and torch.isfinite(db).all()
        assert (dh[0, 3] == 0).all() and (dh[1, 5] == 0).all() and torch.isfinite(dh).all()
    h_nan = h.detach().clone()
    h_nan[1, 5, 2] = float("nan")
    h_nan.requires_grad_()
    loss, _, (dh, _, db) = ours((h_nan, w, b), (th, tw, tb), up, beta=0.5, **kw)
    assert torch.isfinite(loss) and torch.isfinite(db).all()
    assert (dh[1, 5] == 0).all() and torch.isfinite(dh).all()
    bad = th.clone()
    bad[1, 1, 0] = float("nan")
    loss, metrics, _ = ours((h, w, b), (bad, tw, tb), up, beta=0.5, **kw)
    assert loss.isnan() and metrics["jsd"].isnan()
    nothing = torch.zeros(B, T, device=DEVICE)
    for agg in LOSS_AGG_MODES:
        loss, metrics, grads = ours((h, w, b), (th, tw, tb), up, mask=nothing, loss_agg=agg,
                                    chunk_tokens=4, backend=backend)  # fmt: skip
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
        assert all(bool((x == 0).all()) for x in grads)
    empty = torch.zeros(0, T, H, device=DEVICE)
    t_empty = torch.zeros(0, T, H_T, device=DEVICE)
    loss, metrics = fused_rl.linear_distill_loss(empty, w, t_empty, tw, backend=backend)
    assert loss.item() == 0.0 and metrics["jsd"].item() == 0.0
    loss, _ = fused_rl.linear_distill_loss(empty, w, t_empty, tw, num_items=torch.tensor(0.0),
                                           backend=backend)  # fmt: skip
    assert loss.isnan()


def test_no_grad_and_frozen_parts(device):
    """Under no_grad (or with nothing requiring grad) the forward runs no gradient kernel and
    gives the same values; a frozen lm_head gets no gradient while hidden does."""
    student, teacher, _ = make(seed=9)
    h, w, b = student
    th, tw, tb = teacher
    want, want_m = fused_rl.linear_distill_loss(h, w, th, tw, bias=b, teacher_bias=tb,
                                                chunk_tokens=4)  # fmt: skip
    with torch.no_grad():
        got, got_m = fused_rl.linear_distill_loss(h, w, th, tw, bias=b, teacher_bias=tb,
                                                  chunk_tokens=4)  # fmt: skip
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    for k in want_m:
        torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=0)
    w_frozen = w.detach()
    loss, _ = fused_rl.linear_distill_loss(h, w_frozen, th, tw, chunk_tokens=4)
    (dh,) = torch.autograd.grad(loss, h)
    ref, _ = fused_rl.linear_distill_loss(h, w, th, tw, chunk_tokens=4)
    torch.testing.assert_close(dh, torch.autograd.grad(ref, h)[0], rtol=0, atol=0)


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case, beta",
    # each model its own transform: the JSD (both KLs and the mixture pass); the KLs alone
    # with split transforms are gradchecked from logits in tests/test_distill.py
    [(None, 0.0), (None, 0.4), (None, 1.0), ("all_differ", 0.4)],
)
def test_gradcheck_float64(case, beta, backend):
    student, teacher, _ = make(lead=(5,), hdim=3, t_hdim=4, vocab=7, dtype=torch.float64,
                               seed=10)  # fmt: skip
    th, tw, tb = teacher
    mask = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0], dtype=torch.float64, device=DEVICE)

    def fn(h, w, b):
        return fused_rl.linear_distill_loss(
            h, w, th, tw, bias=b, teacher_bias=tb, beta=beta, temperature=0.8, mask=mask,
            chunk_tokens=2, backend=backend, **SPLIT_CASES.get(case, {}),
        )[0]  # fmt: skip

    assert gradcheck(fn, tuple(student))


def test_double_backward_raises():
    student, teacher, _ = make(lead=(4,), dtype=torch.float64, seed=11)
    h, w, b = student
    loss, _ = fused_rl.linear_distill_loss(h, w, teacher[0], teacher[1], bias=b, chunk_tokens=3)
    grads = torch.autograd.grad(loss, (h, w), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(sum((x**2).sum() for x in grads), (h, w))


@pytest.mark.no_poison  # Dynamo cannot trace the NaN-filling torch.empty of the fixture
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [None, "all_differ"])  # each model its own transform
def test_torch_compile_fullgraph(case, backend):
    (h, w, b), (th, tw, tb), g = make(seed=12)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(DEVICE)
    targets = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    targets[0, 0] = -100

    def f(h, w, b):
        loss, metrics = fused_rl.linear_distill_loss(
            h, w, th, tw, bias=b, teacher_bias=tb, beta=0.3, temperature=0.7, mask=mask,
            targets=targets, chunk_tokens=4, backend=backend, **SPLIT_CASES.get(case, {}),
        )  # fmt: skip
        return loss, metrics["forward_kl"]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, got_kl = compiled(h, w, b)
    want, want_kl = f(h, w, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_kl, want_kl)
    up = torch.tensor(0.6, device=DEVICE)
    for a, e in zip(torch.autograd.grad(got, (h, w, b), up),
                    torch.autograd.grad(want, (h, w, b), up)):  # fmt: skip
        torch.testing.assert_close(a, e)


@pytest.mark.no_poison
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_fp32_logits(backend):
    """bf16 heads with fp32 chunk logits under ``torch.compile(fullgraph=True)`` (the GEMM
    on fp32 copies while tracing): the eager call's loss and gradients."""
    (h, w, b), (th, tw, tb), _ = make(seed=13, dtype=torch.bfloat16)

    def f(h, w, b):
        loss, _ = fused_rl.linear_distill_loss(h, w, th, tw, bias=b, teacher_bias=tb, beta=0.5,
                                               chunk_tokens=4, logits_dtype=torch.float32,
                                               backend=backend)  # fmt: skip
        return loss

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(h, w, b)
    want = f(h, w, b)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, e in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        torch.testing.assert_close(a, e)


def test_make_fx_records_the_ops(monkeypatch):
    """``make_fx`` with fake tensors (``torch.export``; the AOT trace of a compiled backward)
    records the chunk kernels as custom ops, never the in-place launcher on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(fused_rl.config, "check_values", False)
    (h, w, b), (th, tw, tb), _ = make(seed=16)

    def step(hidden, weight, t_hidden, t_weight):
        hidden = hidden.detach().requires_grad_()
        weight = weight.detach().requires_grad_()
        loss, _ = fused_rl.linear_distill_loss(hidden, weight, t_hidden, t_weight, beta=0.5,
                                               chunk_tokens=4)  # fmt: skip
        return torch.autograd.grad(loss, (hidden, weight))

    graph = make_fx(step, tracing_mode="fake")(h.detach(), w.detach(), th, tw)
    ops = {str(n.target) for n in graph.graph.nodes if "fused_rl" in str(n.target)}
    assert ops == {"fused_rl.distill_rows_fwd.default", "fused_rl.distill_rows_grad_fwd.default",
                   "fused_rl.distill_finalize_fwd.default"}, ops  # fmt: skip


# ----------------------------------------------------------------------------- batch invariance

BI_V, BI_T, BI_H, BI_HT = 77, 5, 48, 40
# batch sizes, the row's position and a seed: 5 to 55 rows, below and across chunks of 16,
# the last one in the ragged last chunk (rows 48-54)
PLACES = ((1, 0, 1), (3, 2, 2), (7, 4, 3), (11, 10, 5))


@pytest.mark.parametrize("backend", BATCH_INVARIANT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_rows_do_not_depend_on_the_batch(backend, dtype):
    """With a fixed normaliser (``token-mean`` over ``num_items`` = 10) a sequence's hidden
    gradient is bitwise the same in every batch: every GEMM has the chunk's rows
    (``fused_rl.config.batch_invariant``) and the vocab kernels run one program per row."""
    g = torch.Generator().manual_seed(13)
    weight = (0.3 * torch.randn(BI_V, BI_H, generator=g)).to(DEVICE, dtype)
    t_weight = (0.3 * torch.randn(BI_V, BI_HT, generator=g)).to(DEVICE, dtype)
    row = torch.randn(BI_T, BI_H, generator=g).to(DEVICE, dtype)
    t_row = torch.randn(BI_T, BI_HT, generator=g).to(DEVICE, dtype)
    seen = []
    for size, at, seed in PLACES:
        gb = torch.Generator().manual_seed(seed)
        hidden = torch.randn(size, BI_T, BI_H, generator=gb).to(DEVICE, dtype)
        t_hidden = torch.randn(size, BI_T, BI_HT, generator=gb).to(DEVICE, dtype)
        hidden[at], t_hidden[at] = row, t_row
        hidden.requires_grad_(True)
        loss, _ = fused_rl.linear_distill_loss(hidden, weight, t_hidden, t_weight, beta=0.5,
                                               num_items=10.0, chunk_tokens=16,
                                               backend=backend)  # fmt: skip
        (d_hidden,) = torch.autograd.grad(loss, hidden)
        seen.append(d_hidden[at])
    for got in seen[1:]:
        assert torch.equal(got, seen[0])


# ----------------------------------------------------------------------------- cost


class _GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (aten mm / addmm / linear / matmul) a call runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "linear", "matmul", "bmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemms_per_chunk_and_no_logits_sized_allocation(backend):
    """N = 32 rows in chunks of 4: four GEMMs per chunk with gradients (both heads' logits,
    dz W, dz^T h; none recomputed in the backward), two without; no allocation of N * V
    elements (forward and backward): at most a chunk's logits, or dW."""
    n, vocab, hdim, t_hdim, chunk = 32, 500, 8, 12, 4  # N V = 4 x max(chunk V, V H)
    student, teacher, _ = make(lead=(n,), hdim=hdim, t_hdim=t_hdim, vocab=vocab, seed=14)
    h, w, b = student
    th, tw, tb = teacher
    call = lambda: fused_rl.linear_distill_loss(h, w, th, tw, bias=b, teacher_bias=tb,  # noqa: E731
                                                chunk_tokens=chunk, backend=backend)  # fmt: skip
    with _GemmCounter() as gemms:
        loss, _ = call()
        loss.backward()
    assert gemms.count == 4 * (n // chunk), gemms.count
    with torch.no_grad(), _GemmCounter() as gemms:
        call()
    assert gemms.count == 2 * (n // chunk), gemms.count
    h.grad = w.grad = b.grad = None
    with AllocationTracker() as a:
        loss, _ = call()
        loss.backward()
    assert a.sizes, "nothing recorded"
    logits_bytes = n * vocab * 4
    assert a.count_at_least(logits_bytes) == 0, sorted(a.sizes)[-5:]
    chunk_bytes, weight_bytes = chunk * vocab * 4, vocab * hdim * 4
    assert max(a.sizes) <= max(chunk_bytes, weight_bytes), sorted(a.sizes)[-5:]


def test_default_chunk_keeps_both_chunks_under_the_budget():
    from fused_rl.linear import CHUNK_BYTES

    rows = mod.default_chunk_tokens(151936, torch.bfloat16, torch.bfloat16)
    assert rows == 441 and rows * 151936 * 4 <= CHUNK_BYTES
    assert mod.default_chunk_tokens(151936, torch.bfloat16, torch.float32) * 151936 * 6 <= (
        CHUNK_BYTES
    )
    assert mod.default_chunk_tokens(10, torch.float32, torch.float32) == 4096
    assert mod.default_chunk_tokens(10**9, torch.float32, torch.float32) == 1
    # with the student's H: up to 2048 rows while both chunks stay under 2 V H bytes
    assert mod.default_chunk_tokens(151936, torch.bfloat16, torch.bfloat16, 4096) == 2048
    assert mod.default_chunk_tokens(151936, torch.float32, torch.float32, 4096) == 1024
    assert mod.default_chunk_tokens(151936, torch.bfloat16, torch.bfloat16, 896) == 448


# ----------------------------------------------------------------------- fp32 logits, autocast


def f64_oracle(student, teacher, up, **kw):
    """:func:`oracle` with the teacher's logits formed in float64 too (not rounded to a
    16-bit head's dtype): what fp32 chunk logits compute."""
    leaves = [x.detach().double().requires_grad_() for x in student_params(student)]
    h, w, *b = leaves
    zt = F.linear(*(None if x is None else x.detach().double() for x in teacher))
    loss, metrics = oracle_call(F.linear(h, w, b[0] if b else None), zt, **kw)
    return loss, metrics, torch.autograd.grad(loss, leaves, up.double())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", [None, "caps_differ"])
def test_fp32_logits_of_16bit_heads(case, beta, backend):
    """bf16 heads with ``logits_dtype=torch.float32``: the logits are the GEMMs' fp32 sums
    (bf16 products are exact in fp32), so the loss and metrics meet the float64 oracle of
    the unrounded logits to fp32 rounding (bf16 logits: ~1e-3); the gradients, formed in
    fp32 and rounded to bf16 for the GEMMs, to bf16 rounding. A bf16 student beside an
    fp32 teacher too."""
    for t_dtype in (torch.bfloat16, torch.float32):
        student, teacher, g = make(dtype=torch.bfloat16, t_dtype=t_dtype, seed=int(beta * 10))
        mask = (torch.rand(B, T, generator=g) > 0.2).to(DEVICE)
        up = torch.tensor(0.7, dtype=torch.float64, device=DEVICE)
        kw = dict(beta=beta, temperature=0.8, mask=mask, **SPLIT_CASES.get(case, {}))
        got = ours(student, teacher, up, chunk_tokens=4, logits_dtype=torch.float32,
                   backend=backend, **kw)  # fmt: skip
        want = f64_oracle(student, teacher, up, **kw)
        assert rel_err(got[0], want[0]) <= 1e-5, (float(got[0]), float(want[0]))
        for name, value in want[1].items():
            assert rel_err(got[1][name], value) <= 1e-5, name
        for name, a, e in zip(("hidden", "weight", "bias"), got[2], want[2], strict=True):
            assert a.dtype == torch.bfloat16 and rel_err(a, e) <= 1e-2, (name, rel_err(a, e))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logits_are_a_no_op_on_fp32_heads(backend):
    student, teacher, g = make(seed=3)
    up = torch.tensor(0.9, device=DEVICE)
    kw = dict(beta=0.5, chunk_tokens=4, backend=backend)
    got = ours(student, teacher, up, logits_dtype=torch.float32, **kw)
    want = ours(student, teacher, up, **kw)
    assert torch.equal(got[0], want[0])
    for a, e in zip(got[2], want[2], strict=True):
        assert torch.equal(a, e)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU autocast")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_autocast_gives_wider_inputs_fp32_accumulated_gradients(logits_dtype, backend):
    """fp32 student and teacher under bf16 autocast: the GEMMs on bf16 copies, and the
    gradients of the fp32 hidden states, head and bias their fp32 accumulators (not bf16
    values). Default logits: the call on bf16 copies of every input (autocast's
    ``F.linear``), whose head gradients are exactly ours rounded; fp32 logits: the float64
    oracle of the bf16-rounded rows and heads with the biases as given (added unrounded)."""
    student, teacher, _ = make(seed=5)
    up = torch.tensor(2.0, device=DEVICE)  # exact: the bf16 call rounds before multiplying
    kw = dict(beta=0.3, chunk_tokens=4, logits_dtype=logits_dtype, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(student, teacher, up, **kw)
    for a in got[2]:
        assert a.dtype == torch.float32
        assert (a != a.bfloat16().float()).float().mean() > 0.5  # most are not bf16 values
    rounded = lambda xs, cast: tuple(  # noqa: E731
        None if x is None else cast(x).detach().requires_grad_(x.requires_grad) for x in xs
    )
    if logits_dtype is None:
        bf16 = lambda x: x.bfloat16()  # noqa: E731
        want = ours(rounded(student, bf16), rounded(teacher, bf16), up, **kw)
        assert torch.equal(got[0], want[0])
        (gh, gw, gb), (wh, ww, wb) = got[2], want[2]
        assert torch.equal(gw.bfloat16(), ww) and torch.equal(gb.bfloat16(), wb)
        assert rel_err(gh, wh) <= 2**-8
        return
    # the rows and heads rounded to bf16 (the GEMMs' operands), the biases as given
    r16 = lambda x: x if x.dim() == 1 else x.bfloat16().float()  # noqa: E731
    want = f64_oracle(rounded(student, r16), rounded(teacher, r16), up.double(), beta=0.3)
    assert rel_err(got[0], want[0]) <= 1e-5
    for a, e in zip(got[2], want[2], strict=True):  # dz rounded to bf16 for the GEMMs
        assert rel_err(a, e) <= 2**-8, rel_err(a, e)


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_name_the_argument():
    (h, w, b), (th, tw, tb), _ = make(seed=15)

    def call(**kw):
        args = [kw.pop(k, d) for k, d in (("h", h), ("w", w), ("th", th), ("tw", tw))]
        return fused_rl.linear_distill_loss(*args, **kw)

    with pytest.raises(
        ValueError, match=r"teacher_weight has a vocabulary of 36 but weight has 37"
    ):
        call(tw=tw[:-1])
    with pytest.raises(ValueError, match=r"teacher_hidden must be shaped as hidden"):
        call(th=th[:, :-1])
    with pytest.raises(ValueError, match=r"teacher_hidden must be shaped as hidden"):
        call(th=th.reshape(B * T, H_T))
    with pytest.raises(ValueError, match=r"teacher_weight must be the teacher's lm_head"):
        call(tw=torch.randn(V, H_T + 1))
    with pytest.raises(ValueError, match=r"\bweight must be the lm_head"):
        call(w=torch.randn(V, H + 1))
    with pytest.raises(ValueError, match=r"teacher_bias must be"):
        call(teacher_bias=torch.randn(V + 1))
    with pytest.raises(TypeError, match=r"teacher_weight .* and teacher_hidden"):
        call(th=th.double())
    for name in ("th", "tw"):
        with pytest.raises(ValueError, match=r"teacher_\w+ requires grad.*detach"):
            call(**{name: {"th": th, "tw": tw}[name].clone().requires_grad_()})
    with pytest.raises(ValueError, match=r"teacher_bias requires grad"):
        call(teacher_bias=tb.clone().requires_grad_())
    with torch.no_grad():  # no gradient flows: a teacher requiring grad is fine
        call(tw=tw.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"\bhidden must be"):
        call(h=h[0, 0], th=th[0, 0])
    with pytest.raises(ValueError, match=r"\bmask must have shape hidden.shape\[:-1\]"):
        call(mask=torch.ones(T, B))
    with pytest.raises(ValueError, match=r"\btargets must have shape hidden.shape\[:-1\]"):
        call(targets=torch.zeros(B, T + 1, dtype=torch.long))
    with pytest.raises(TypeError, match=r"\btargets\b"):
        call(targets=torch.zeros(B, T))
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        call(beta=1.5)
    with pytest.raises(ValueError, match=r"\btemperature\b"):
        call(temperature=0.0)
    for name in ("softcap", "teacher_softcap", "logit_scale", "teacher_logit_scale"):
        for bad in (0.0, -2.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"\b{name}\b"):
                call(**{name: bad})
        with pytest.raises(TypeError, match=rf"\b{name}\b"):
            call(**{name: "2"})
    with pytest.raises(ValueError, match=r"\bchunk_tokens\b"):
        call(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"\bloss_agg\b"):
        call(loss_agg="mean")
    with pytest.raises(TypeError, match=r"\bteacher_hidden\b"):
        call(th=th.long())
    with pytest.raises(TypeError, match=r"\bteacher_weight\b"):
        call(tw=[1.0])
    with pytest.raises(ValueError, match=r"\bbackend\b"):
        call(backend="cuda")
    for bad in (torch.bfloat16, torch.float64, "float32"):
        with pytest.raises(ValueError, match=r"\blogits_dtype\b"):
            call(logits_dtype=bad)
    with pytest.raises(ValueError, match=r"\blogits_dtype\b.*fp64"):
        call(h=h.double(), w=w.double(), th=th.double(), tw=tw.double(),
             logits_dtype=torch.float32)  # fmt: skip


@pytest.mark.no_poison
def test_docstring_example():
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
