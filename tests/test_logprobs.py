"""Tests for ``fused_rl.token_logprobs`` / ``fused_rl.token_entropy``.

Both backends are compared with a float64 oracle (``helpers.oracle_token_stats``) on values
and on gradients under a random upstream gradient for BOTH outputs. On CPU the Triton path
runs the real kernels through the Triton interpreter (tests/conftest.py), so shapes stay
small but awkward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, assert_rel, bf16_tol, gradcheck, oracle_token_stats

import fused_rl._backend as B
from fused_rl import config, token_entropy, token_logprobs

BACKENDS = ("triton", "reference")


def _fused(logits, targets, *, backend, **kw):
    return token_logprobs(logits, targets, return_entropy=True, backend=backend, **kw)


def _value_and_grad(fn, base, view, targets, upstream, **kw):
    """``fn(view(leaf), targets)`` and ``d(sum_i out_i * upstream_i) / d leaf``, ``leaf = base``."""
    leaf = base.detach().clone().requires_grad_(True)
    outs = fn(view(leaf), targets, **kw)
    (grad,) = torch.autograd.grad(outs, leaf, grad_outputs=upstream)
    return [o.detach() for o in outs], grad


def _randn_like_targets(targets, n=2):
    return [torch.randn(targets.shape, device=targets.device) for _ in range(n)]


def _check_parity(base, targets, backend, *, view=lambda x: x, tol=FP32_TOL, **kw):
    """Values and gradients of ``(logp, entropy)`` against the float64 oracle.

    Returns the fused outputs and gradient for extra checks.
    """
    up = _randn_like_targets(targets)
    (lp, ent), grad = _value_and_grad(_fused, base, view, targets, up, backend=backend, **kw)
    (o_lp, o_ent), o_grad = _value_and_grad(
        oracle_token_stats, base.double(), view, targets, [u.double() for u in up], **kw
    )
    out_dtype = torch.float64 if base.dtype == torch.float64 else torch.float32
    assert lp.dtype == ent.dtype == out_dtype
    assert grad.dtype == base.dtype
    assert lp.shape == ent.shape == targets.shape
    assert_rel(lp, o_lp, tol, f"{backend} logp")
    assert_rel(ent, o_ent, tol, f"{backend} entropy")
    assert_rel(grad, o_grad, tol, f"{backend} grad")
    return lp, ent, grad


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "vocab, lead",
    [(1, (3, 5)), (7, (2, 9)), (1000, (2, 5)), (4099, (2, 3)), (32000, (1, 2))],
    ids=["V1", "V7", "V1000", "V4099", "V32000"],
)
def test_parity_vocab_sizes(backend, vocab, lead, device):
    torch.manual_seed(vocab)
    logits = torch.randn(*lead, vocab, device=device) * 2
    targets = torch.randint(0, vocab, lead, device=device)
    lp, ent, grad = _check_parity(logits, targets, backend)
    if vocab == 1:  # one token: probability 1, no entropy, no gradient
        assert (lp == 0).all() and (ent == 0).all() and (grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.7, 0.5, 2.5])
def test_parity_temperature(backend, temperature, device):
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 97, device=device) * 3
    targets = torch.randint(0, 97, (3, 4), device=device)
    _check_parity(logits, targets, backend, temperature=temperature)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_position(backend, device):
    torch.manual_seed(2)
    logits = torch.randn(3, 1, 37, device=device)
    targets = torch.randint(0, 37, (3, 1), device=device)
    _check_parity(logits, targets, backend)


# (base shape, view, targets shape, whether the view is non-contiguous)
LAYOUTS = {
    "slice_time": ((2, 8, 53), lambda x: x[:, :-1], (2, 7), True),
    "vocab_stride": ((2, 5, 2 * 41), lambda x: x[..., ::2], (2, 5), True),
    "transposed_TBV": ((6, 3, 41), lambda x: x.transpose(0, 1), (3, 6), True),
    "rows_2d": ((9, 41), lambda x: x, (9,), False),
    "rows_2d_strided": ((10, 60), lambda x: x[::2, 5:46], (5,), True),
    "single_row_1d": ((41,), lambda x: x, (), False),
    "strided_1d": ((82,), lambda x: x[::2], (), True),
    "4d": ((2, 3, 4, 41), lambda x: x, (2, 3, 4), False),
    "4d_unmergeable": ((2, 3, 5, 41), lambda x: x[:, :, 1:], (2, 3, 4), True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_layouts(backend, layout, device):
    base_shape, view, t_shape, strided = LAYOUTS[layout]
    torch.manual_seed(3)
    base = torch.randn(base_shape, device=device)
    assert view(base).is_contiguous() != strided
    vocab = view(base).shape[-1]
    targets = torch.randint(0, vocab, t_shape, device=device)
    _check_parity(base, targets, backend, view=view)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shifted_targets_view(backend, device):
    """The usual call: ``logits[:, :-1]`` against ``input_ids[:, 1:]`` (both views)."""
    torch.manual_seed(4)
    base = torch.randn(3, 9, 50, device=device)
    ids = torch.randint(0, 50, (3, 9), device=device)
    targets = ids[:, 1:]
    assert not targets.is_contiguous()
    _check_parity(base, targets, backend, view=lambda x: x[:, :-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_targets(backend, device):
    torch.manual_seed(5)
    logits = torch.randn(2, 6, 300, device=device)
    targets = torch.randint(0, 300, (2, 6), device=device, dtype=torch.int32)
    targets[0, 2] = -100
    lp, ent, grad = _check_parity(logits, targets, backend)
    assert lp[0, 2] == 0 and ent[0, 2] == 0 and (grad[0, 2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "ignore_index", [-100, -1, 5], ids=["default", "custom_negative", "custom_in_vocab"]
)
def test_ignored_tokens_exact_zero(backend, ignore_index, device):
    torch.manual_seed(6)
    logits = torch.randn(3, 7, 64, device=device) * 2
    targets = torch.randint(6, 64, (3, 7), device=device)  # 5 appears only where ignored
    ignored = torch.zeros(3, 7, dtype=torch.bool, device=device)
    ignored[0, ::2] = True
    ignored[2] = True  # a fully ignored sequence
    targets[ignored] = ignore_index
    lp, ent, grad = _check_parity(logits, targets, backend, ignore_index=ignore_index)
    # the upstream gradient is nonzero everywhere, yet ignored rows stay exactly 0
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert (grad[ignored] == 0).all()
    assert (grad[~ignored] != 0).any(dim=-1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_ignored(backend, device):
    logits = torch.randn(2, 3, 11, device=device, requires_grad=True)
    targets = torch.full((2, 3), -100, device=device)
    lp, ent = _fused(logits, targets, backend=backend)
    (grad,) = torch.autograd.grad((lp, ent), logits, _randn_like_targets(targets))
    assert (lp == 0).all() and (ent == 0).all() and (grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [(0, 4), (2, 0)])
def test_empty_batch(backend, lead, device):
    logits = torch.randn(*lead, 13, device=device, requires_grad=True)
    targets = torch.zeros(lead, dtype=torch.long, device=device)
    lp, ent = _fused(logits, targets, backend=backend)
    assert lp.shape == ent.shape == lead
    (grad,) = torch.autograd.grad((lp, ent), logits, _randn_like_targets(targets))
    assert grad.shape == logits.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_vs_eager(backend, dtype, temperature, device):
    """bf16/fp16 logits: no worse than 2x the error of eager same-dtype ``log_softmax``."""
    torch.manual_seed(7)
    logits = (torch.randn(3, 5, 1000, device=device) * 3).to(dtype)
    targets = torch.randint(0, 1000, (3, 5), device=device)
    up = _randn_like_targets(targets)

    def eager(x, y, temperature):
        z = torch.log_softmax(x / temperature, dim=-1)
        return z.gather(-1, y[..., None])[..., 0], -(z.exp() * z).sum(-1)

    ident = lambda x: x
    (lp, ent), grad = _value_and_grad(
        _fused, logits, ident, targets, up, backend=backend, temperature=temperature
    )
    (e_lp, e_ent), e_grad = _value_and_grad(
        eager, logits, ident, targets, [u.to(dtype) for u in up], temperature=temperature
    )
    (o_lp, o_ent), o_grad = _value_and_grad(
        oracle_token_stats,
        logits.double(),
        ident,
        targets,
        [u.double() for u in up],
        temperature=temperature,
    )
    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    assert_rel(lp, o_lp, bf16_tol(e_lp, o_lp), "logp")
    assert_rel(ent, o_ent, bf16_tol(e_ent, o_ent), "entropy")
    assert_rel(grad, o_grad, bf16_tol(e_grad, o_grad), "grad")


# ----------------------------------------------------------------------------- extreme values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_neg_inf_logits(backend, temperature, device):
    """Masked-out vocabulary entries (-inf): finite entropy, no NaN, zero gradient there."""
    torch.manual_seed(8)
    logits = torch.randn(2, 4, 300, device=device)
    blocked = torch.rand(2, 4, 300, device=device) < 0.3
    blocked[1, 3, :299] = True  # a row with a single finite logit
    targets = torch.randint(0, 300, (2, 4), device=device)
    targets[1, 3] = 299
    blocked.scatter_(-1, targets[..., None], False)
    logits = logits.masked_fill(blocked, float("-inf"))
    up = _randn_like_targets(targets)
    ident = lambda x: x
    (lp, ent), grad = _value_and_grad(
        _fused, logits, ident, targets, up, backend=backend, temperature=temperature
    )
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert (grad[blocked] == 0).all()
    assert lp[1, 3] == 0 and ent[1, 3] == 0
    # the oracle's own autograd turns 0 * -inf into NaN: give it a huge finite stand-in
    finite = logits.double().masked_fill(blocked, -1e30)
    (o_lp, o_ent), o_grad = _value_and_grad(
        oracle_token_stats,
        finite,
        ident,
        targets,
        [u.double() for u in up],
        temperature=temperature,
    )
    assert_rel(lp, o_lp, FP32_TOL, "logp")
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    assert_rel(grad, o_grad, FP32_TOL, "grad")
    ent_only = token_entropy(logits, temperature=temperature, backend=backend)
    assert_rel(ent_only, o_ent, FP32_TOL, "token_entropy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logit_scale(backend, device):
    """Logits spread over +-1e4 in fp32: near one-hot rows, still exact to fp32."""
    torch.manual_seed(9)
    logits = torch.randn(3, 4, 77, device=device) * 1e4
    targets = torch.randint(0, 77, (3, 4), device=device)
    targets[0] = logits[0].argmax(-1)  # some targets on the peak, the rest far below it
    lp, ent, grad = _check_parity(logits, targets, backend)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_logit_offset(backend, offset, device):
    """Logits ``+-1e4 + O(1)`` in fp32: values and gradients as accurate as at offset 0.

    A saved fp32 ``lse`` of magnitude 1e4 would be off by up to half an ulp (2**-11) and so
    would every recomputed ``p``; the kernels keep the row max and ``log s`` apart instead.
    """
    torch.manual_seed(10)
    logits = torch.randn(3, 4, 77, device=device) * 3 + offset
    targets = torch.randint(0, 77, (3, 4), device=device)
    up = _randn_like_targets(targets)
    ident = lambda x: x
    (lp, ent), grad = _value_and_grad(_fused, logits, ident, targets, up, backend=backend)
    (o_lp, o_ent), o_grad = _value_and_grad(
        oracle_token_stats, logits.double(), ident, targets, [u.double() for u in up]
    )
    assert_rel(lp, o_lp, FP32_TOL, "logp")
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    assert_rel(grad, o_grad, FP32_TOL, "grad")


# ----------------------------------------------------------------------------- API behaviour


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_saves_nothing(backend, device):
    logits = torch.randn(2, 3, 17, device=device, requires_grad=True)
    targets = torch.randint(0, 17, (2, 3), device=device)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            lp, ent = _fused(logits, targets, backend=backend)
            lp_only = token_logprobs(logits, targets, backend=backend)
            ent_only = token_entropy(logits, backend=backend)
        assert packed == []
        for out in (lp, ent, lp_only, ent_only):
            assert out.grad_fn is None and not out.requires_grad
        # the same call with grad enabled does record a graph (the hook above is live)
        lp_grad, _ = _fused(logits, targets, backend=backend)
        assert lp_grad.grad_fn is not None and packed
    assert torch.equal(lp, lp_grad.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_without_grad(backend, device):
    logits = torch.randn(2, 3, 17, device=device)
    targets = torch.randint(0, 17, (2, 3), device=device)
    lp, ent = _fused(logits, targets, backend=backend)
    assert lp.grad_fn is None and ent.grad_fn is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_is_float64_exact(backend, device):
    """fp64 logits at T = 0.7: 1/T reaches the kernels as two fp32 halves, so values and
    gradients agree with the float64 oracle to ~1e-13, not to fp32's 1e-8."""
    torch.manual_seed(12)
    logits = torch.randn(3, 4, 53, device=device, dtype=torch.float64) * 3
    targets = torch.randint(0, 53, (3, 4), device=device)
    _check_parity(logits, targets, backend, tol=1e-12, temperature=0.7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str
)
def test_return_types_and_dtypes(backend, dtype, device):
    torch.manual_seed(11)
    logits = torch.randn(2, 3, 29, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 29, (2, 3), device=device)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    lp = token_logprobs(logits, targets, backend=backend)
    assert isinstance(lp, torch.Tensor)
    both = token_logprobs(logits, targets, return_entropy=True, backend=backend)
    assert isinstance(both, tuple) and len(both) == 2
    ent = token_entropy(logits, backend=backend)
    for out in (lp, *both, ent):
        assert out.dtype == out_dtype and out.shape == (2, 3)
    assert torch.equal(lp, both[0])
    assert torch.equal(ent, both[1])
    g = torch.randn(2, 3, device=device)
    for out in (lp, *both, ent):
        (grad,) = torch.autograd.grad(out, logits, g, retain_graph=True)
        assert grad.dtype == dtype and grad.shape == logits.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_output_gradients(backend, device):
    """Gradient through only one output: ``logp`` alone, or the entropy alone."""
    torch.manual_seed(12)
    logits = torch.randn(2, 5, 123, device=device) * 2
    targets = torch.randint(0, 123, (2, 5), device=device)
    targets[1, 1] = -100
    (g,) = _randn_like_targets(targets, 1)
    g64, zero64 = g.double(), torch.zeros_like(g, dtype=torch.float64)
    ident = lambda x: x
    lp_fn = lambda x, y: (token_logprobs(x, y, temperature=0.7, backend=backend),)
    ent_fn = lambda x, y: (_fused(x, y, backend=backend, temperature=0.7)[1],)
    (lp,), grad = _value_and_grad(lp_fn, logits, ident, targets, (g,))
    _, grad_ent = _value_and_grad(
        lambda x, y: _fused(x, y, backend=backend, temperature=0.7),
        logits,
        ident,
        targets,
        (torch.zeros_like(g), g),
    )
    (_,), grad_ent_only = _value_and_grad(ent_fn, logits, ident, targets, (g,))
    (o_lp, _), o_grad = _value_and_grad(
        oracle_token_stats,
        logits.double(),
        ident,
        targets,
        (g64, zero64),
        temperature=0.7,
    )
    _, o_grad_ent = _value_and_grad(
        oracle_token_stats,
        logits.double(),
        ident,
        targets,
        (zero64, g64),
        temperature=0.7,
    )
    assert_rel(lp, o_lp, FP32_TOL, "logp")
    assert_rel(grad, o_grad, FP32_TOL, "grad of logp")
    assert_rel(grad_ent, o_grad_ent, FP32_TOL, "grad of entropy")
    assert_rel(grad_ent_only, o_grad_ent, FP32_TOL, "grad of entropy (logp unused)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_parity(backend, temperature, device):
    torch.manual_seed(13)
    base = torch.randn(3, 8, 515, device=device) * 2
    view = lambda x: x[:, 1:]
    g = torch.randn(3, 7, device=device)
    fused = lambda x, _: (token_entropy(x, temperature=temperature, backend=backend),)
    oracle = lambda x, _: (oracle_token_stats(x, None, temperature=temperature)[1],)
    (ent,), grad = _value_and_grad(fused, base, view, None, (g,))
    (o_ent,), o_grad = _value_and_grad(oracle, base.double(), view, None, (g.double(),))
    assert ent.shape == (3, 7) and ent.dtype == torch.float32
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    assert_rel(grad, o_grad, FP32_TOL, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_matches_explicit(backend, device, monkeypatch):
    """``backend="auto"`` runs what ``resolve_backend`` picks, bit for bit."""
    monkeypatch.setattr(B, "interpreter_enabled", lambda: backend == "triton")
    if device == "cuda" and backend == "reference":
        pytest.skip("auto always picks Triton for CUDA tensors")
    logits = torch.randn(2, 4, 33, device=device)
    targets = torch.randint(0, 33, (2, 4), device=device)
    auto = _fused(logits, targets, backend="auto")
    explicit = _fused(logits, targets, backend=backend)
    assert all(torch.equal(a, e) for a, e in zip(auto, explicit))


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend, device):
    torch.manual_seed(14)
    logits = torch.randn(2, 3, 4099, device=device) * 2
    targets = torch.randint(0, 4099, (2, 3), device=device)
    targets[0, 1] = -100
    up = _randn_like_targets(targets)
    runs = [
        _value_and_grad(_fused, logits, lambda x: x, targets, up, backend=backend) for _ in range(2)
    ]
    (lp1, ent1), g1 = runs[0]
    (lp2, ent2), g2 = runs[1]
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2) and torch.equal(g1, g2)


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    torch.manual_seed(15)
    base = torch.randn(2, 6, 57, device=device)
    targets = torch.randint(0, 57, (2, 5), device=device)
    targets[1, 0] = -100

    def loss_terms(x, y):
        lp, ent = token_logprobs(x[:, :-1], y, temperature=0.7, return_entropy=True)
        return lp, ent, token_entropy(x)

    compiled = torch.compile(loss_terms, fullgraph=True, backend="aot_eager")
    up = [*_randn_like_targets(targets), torch.randn(2, 6, device=device)]
    ident = lambda x: x
    outs, grad = _value_and_grad(loss_terms, base, ident, targets, up)
    c_outs, c_grad = _value_and_grad(compiled, base, ident, targets, up)
    names = ("logp", "entropy", "token_entropy", "grad")
    for name, a, b in zip(names, [*outs, grad], [*c_outs, c_grad]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    (o_lp, o_ent), _ = _value_and_grad(
        oracle_token_stats,
        base.double(),
        lambda x: x[:, :-1],
        targets,
        [u.double() for u in up[:2]],
        temperature=0.7,
    )
    assert_rel(c_outs[0], o_lp, FP32_TOL, "compiled logp")
    assert_rel(c_outs[1], o_ent, FP32_TOL, "compiled entropy")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gradcheck_float64(backend, temperature, device):
    torch.manual_seed(16)
    logits = torch.randn(2, 3, 7, device=device, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), device=device)
    targets[0, 1] = -100
    fn = lambda x: _fused(x, targets, backend=backend, temperature=temperature)
    assert gradcheck(fn, (logits,))
    # a strided view, and the entropy-only entry point
    base = torch.randn(2, 4, 9, device=device, dtype=torch.float64, requires_grad=True)
    ent = lambda x: token_entropy(x[:, 1:, ::2], temperature=temperature, backend=backend)
    assert gradcheck(ent, (base,))


def _hvp(fn, logits, w, v):
    """``d/dlogits [v . dL/dlogits + |logits|^2]`` with ``L = sum(w * fn(logits))``: a
    Hessian-vector product. The extra term keeps the outer backward valid when the inner
    gradient is cut from the graph, so a dropped Hessian shows up as a wrong value."""
    (g,) = torch.autograd.grad((fn(logits) * w).sum(), logits, create_graph=True)
    return torch.autograd.grad((g * v).sum() + logits.square().sum(), logits)[0]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("output", ["logp", "entropy"])
def test_double_backward_exact_or_raises(backend, output, device):
    """A second derivative is either float64 autograd's of plain ``log_softmax`` or a clear
    RuntimeError, never silently wrong (the reference once treated its saved row statistics
    as constants: off by tenths)."""
    torch.manual_seed(21)
    logits = torch.randn(2, 3, 7, device=device, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), device=device)
    w = torch.randn(2, 3, device=device, dtype=torch.float64)
    v = torch.randn_like(logits)
    pick = 0 if output == "logp" else 1
    fused = lambda x: _fused(x, targets, backend=backend)[pick]
    oracle = lambda x: oracle_token_stats(x, targets)[pick]
    try:
        got = _hvp(fused, logits, w, v)
    except RuntimeError as err:
        assert "differentiable once" in str(err)
        return
    assert_rel(got, _hvp(oracle, logits, w, v), F64_TOL, "Hessian-vector product")


def test_reference_gradgradcheck_raises(device):
    logits = torch.randn(2, 3, 7, device=device, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), device=device)
    for fn in (
        lambda x: _fused(x, targets, backend="reference"),
        lambda x: token_entropy(x, backend="reference"),
    ):
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.gradgradcheck(fn, (logits,))


# ----------------------------------------------------------------------------- bad input


def _good(device, vocab=11):
    return torch.randn(2, 3, vocab, device=device), torch.randint(0, vocab, (2, 3), device=device)


@pytest.mark.parametrize("backend", ("auto", *BACKENDS))
def test_errors_name_the_argument(backend, device):
    logits, targets = _good(device)
    call = lambda *a, **k: token_logprobs(*a, backend=backend, **k)
    with pytest.raises(ValueError, match="targets must have shape"):
        call(logits, targets[:1])  # batch mismatch
    with pytest.raises(ValueError, match="targets must have shape"):
        call(logits, torch.cat([targets, targets], 1))  # more targets than positions
    with pytest.raises(ValueError, match="targets must have shape"):
        call(logits, targets[..., None])
    with pytest.raises(TypeError, match="targets must be an int64 or int32"):
        call(logits, targets.float())
    with pytest.raises(TypeError, match="targets must be a torch.Tensor"):
        call(logits, targets.tolist())
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        call(logits.long(), targets)
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        token_entropy(logits > 0, backend=backend)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        call(logits.tolist(), targets)
    with pytest.raises(
        ValueError, match=r"logits must have at least 1 dim \(\.\.\., V\), got shape \(\)"
    ):
        call(torch.tensor(1.0, device=device), targets[0, 0])
    with pytest.raises(ValueError, match="logits has an empty vocabulary"):
        call(logits[..., :0], targets)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            call(logits, targets, temperature=bad)
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            token_entropy(logits, temperature=bad, backend=backend)
    with pytest.raises(TypeError, match="temperature must be a real number"):
        call(logits, targets, temperature=torch.tensor(0.7))


@pytest.mark.parametrize("backend", ("auto", *BACKENDS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bad", [11, 12345, -1, -101])
def test_out_of_range_targets_raise(backend, dtype, bad, device):
    logits, targets = _good(device)
    targets = targets.to(dtype)
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=rf"targets holds {bad}, outside \[0, V\) = \[0, 11\)"):
        token_logprobs(logits, targets, backend=backend)
    # the same value is fine when it is the ignore_index
    lp = token_logprobs(logits, targets, ignore_index=bad, backend=backend)
    assert lp[1, 2] == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bad, dtype",
    [(11, torch.int64), (-1, torch.int64), (2**31 - 1, torch.int32), (-(2**40), torch.int64)],
)
def test_out_of_range_targets_unchecked_give_nan(backend, bad, dtype, device, monkeypatch):
    """With value checks off (as under torch.compile) a bad target is NaN, never a wild read."""
    monkeypatch.setattr(config, "check_values", False)  # restored by monkeypatch
    logits, targets = _good(device)
    logits.requires_grad_(True)
    targets = targets.to(dtype)
    targets[1, 2] = bad
    lp, ent = _fused(logits, targets, backend=backend)
    assert torch.isnan(lp[1, 2])
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[1, 2] = False
    o_lp, o_ent = oracle_token_stats(logits.detach(), torch.where(keep, targets, 0))
    assert_rel(lp[keep], o_lp[keep], FP32_TOL, "logp of valid targets")
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    (grad,) = torch.autograd.grad((lp, ent), logits, _randn_like_targets(targets))
    assert torch.isfinite(grad).all()


def test_config_check_values_default():
    assert config.check_values is True


def test_device_mismatch_names_both(device):
    logits = torch.empty(2, 3, 11, device="meta")
    targets = torch.zeros(2, 3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"targets is on .* but logits is on meta"):
        token_logprobs(logits, targets)


def test_unknown_backend(device):
    logits, targets = _good(device)
    with pytest.raises(ValueError, match=r"backend must be one of .*'cuda'"):
        token_logprobs(logits, targets, backend="cuda")
    with pytest.raises(ValueError, match=r"backend must be one of .*'torch'"):
        token_entropy(logits, backend="torch")


# ----------------------------------------------------------------------------- GPU scale


@pytest.mark.gpu
def test_llama3_vocab_bf16_vs_fp32_reference():
    """(4, 512, 128256) bf16 logits on the GPU against the fp32 reference on the same values."""
    torch.manual_seed(17)
    lead, vocab = (4, 512), 128256
    logits = (torch.randn(*lead, vocab, device="cuda") * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, lead, device="cuda")
    targets[0, :7] = -100
    up = _randn_like_targets(targets)
    ident = lambda x: x
    (lp, ent), grad = _value_and_grad(_fused, logits, ident, targets, up, backend="triton")
    (r_lp, r_ent), r_grad = _value_and_grad(
        _fused, logits.float(), ident, targets, up, backend="reference"
    )
    del logits
    assert grad.dtype == torch.bfloat16
    assert_rel(lp, r_lp, FP32_TOL, "logp")
    assert_rel(ent, r_ent, FP32_TOL, "entropy")
    # bf16 gradient: no worse than 2x the error of rounding the fp32 gradient to bf16
    assert_rel(grad, r_grad, bf16_tol(r_grad.bfloat16(), r_grad), "grad")
    assert (grad[0, :7] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", (1.0, 0.7, 0.3))
def test_entropy_never_negative_on_point_masses(backend, temperature, device):
    """Rows whose softmax is (nearly) a point mass: rounding in ``log s - w / s`` can land a
    hair below 0 (seen on an H100: -5.1e-8 at T = 0.7); entropy is clamped at 0, never < 0."""
    V = 300
    logits = torch.full((6, V), -1e4, device=device)
    logits[:, 7] = 0.0  # exact point mass
    logits[1, :] = torch.linspace(-60.0, 0.0, V)  # nearly one (tiny positive entropy)
    logits[2, 9] = -25.0
    logits[3] = float("-inf")
    logits[3, 123] = 3.0  # a single finite logit
    logits[4, 200:] = -30.0
    logits[5] = torch.randn(V) * 40
    targets = torch.full((6,), 7, device=device)
    _, ent = token_logprobs(
        logits, targets, return_entropy=True, temperature=temperature, backend=backend
    )
    assert (ent >= 0).all(), ent
    assert (token_entropy(logits, temperature=temperature, backend=backend) >= 0).all()


def test_make_fx_records_the_ops_forward_and_backward(device, monkeypatch):
    """``make_fx`` with fake tensors (``torch.export``; the AOT autograd trace of a compiled
    backward, outside Dynamo in torch 2.11) records fused_rl's ops, forward and backward,
    instead of running a launcher on fake tensors ("Cannot access data pointer")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fused_rl import policy_loss

    monkeypatch.setattr(config, "check_values", False)  # reads data: none to read
    logits = torch.randn(2, 4, 7, device=device)
    targets = torch.randint(0, 7, (2, 3), device=device)
    adv = torch.randn(2, device=device)

    def step(x, y, a):
        x = x.detach().requires_grad_()
        loss = policy_loss(x, y, a)[0] + token_logprobs(x[:, :-1], y).sum()
        return torch.autograd.grad(loss, x)[0]

    graph = make_fx(step, tracing_mode="fake")(logits, targets, adv)
    ops = {str(n.target) for n in graph.graph.nodes if "fused_rl" in str(n.target)}
    assert {"fused_rl.policy_loss_fwd.default", "fused_rl.token_stats_bwd.default"} <= ops
    assert "fused_rl.token_stats_fwd.default" in ops


@pytest.mark.parametrize("k", [1, 2, 3, 7, 128])
def test_segment_sums_add_each_run_alone(k):
    """``_vocab_ops._segment_sums`` (K ids a position, the ids a row names twice): every
    slot gets the sum over the slots holding its id, to fp64 rounding of that run alone, even
    after a huge run of another id (a running sum over the row would lose a small run
    behind it: 0.003000006 for 0.003 after 1e8)."""
    from fused_rl._vocab_ops import _segment_sums

    gen = torch.Generator().manual_seed(k)
    ids = torch.randint(0, max(1, k // 3), (40, k), generator=gen).sort(-1).values
    g = torch.randn(40, k, generator=gen, dtype=torch.float64)
    g[:, 0] = 1e8 * (ids[:, 0] != ids[:, -1])  # a huge first run where the row has two ids
    want = torch.stack([torch.stack([g[r][ids[r] == ids[r, i]].sum() for i in range(k)])
                        for r in range(40)])  # fmt: skip
    got = _segment_sums(ids, g)
    small = ids != ids[:, :1]  # the runs behind the huge one: exact to their own size
    assert torch.allclose(got[small], want[small], rtol=1e-15, atol=1e-14)
    assert torch.allclose(got, want, rtol=1e-15, atol=1e-7)
    two = torch.tensor([[0, 1, 2, 2]])
    assert _segment_sums(two, torch.tensor([[1e8, 3.0, 1e-3, 2e-3]], dtype=torch.float64))[
        0, 2:
    ].tolist() == [0.003, 0.003]
