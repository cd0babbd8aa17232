"""Tests for ``fused_rl.reductions``: ``masked_sum``, ``masked_mean``, ``masked_var``,
``masked_whiten``.

Both backends are compared with float64 oracles written here (boolean indexing and
``torch.var`` for 0/1 masks, explicit weighted formulas for fractional ones). On CPU the
Triton path runs the real kernels through the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import FP32_TOL, assert_rel, bf16_tol, gradcheck

from fused_rl.reductions import masked_mean, masked_sum, masked_var, masked_whiten

BACKENDS = ("triton", "reference")
F64_TOL = 1e-12


# ----------------------------------------------------------------------------- oracles


def o_stats(x, w, dim=None):
    """float64 ``(n, sum, mean)`` with explicit weights (no masking tricks)."""
    x, w = x.double(), w.double()
    terms = torch.where(w != 0, x * w, torch.zeros_like(x))
    n = w.sum() if dim is None else w.sum(dim)
    s = terms.sum() if dim is None else terms.sum(dim)
    mean = torch.where(n > 0, s / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(s))
    return n, s, mean


def o_var(x, w, unbiased=True):
    """Weighted variance; for a 0/1 mask it is ``torch.var(x[mask])``."""
    x, w = x.double(), w.double()
    if bool(((w == 0) | (w == 1)).all()):
        picked = x[w.bool()]
        if picked.numel() <= int(unbiased):
            return torch.zeros((), dtype=torch.float64, device=x.device)
        return torch.var(picked, correction=int(unbiased))
    n, _, mean = o_stats(x, w)
    dev = torch.where(w != 0, w * (x - mean) ** 2, torch.zeros_like(x))
    return dev.sum() / (n - float(unbiased))


def o_whiten(x, w, keep_mean=False, eps=1e-8):
    x64 = x.double()
    _, _, mean = o_stats(x64, w)
    y = (x64 - mean) / torch.sqrt(o_var(x64, w) + eps)
    return y + mean if keep_mean else y


def _weights(x, mask):
    return torch.ones_like(x, dtype=torch.float64) if mask is None else mask.double()


# ----------------------------------------------------------------------------- inputs


def _case(name, device, dtype=torch.float32):
    """``(x, mask)`` for awkward layouts: strided views, size 1, empty rows, float weights."""
    g = torch.Generator().manual_seed(CASES.index(name))
    rnd = lambda *s: (torch.randn(*s, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    if name == "plain":
        x = rnd(5, 7)
        m = torch.rand(5, 7, generator=g) > 0.4
        m[2] = False  # an empty row
    elif name == "strided":
        x = rnd(6, 19)[1:, 2:17:2]  # (5, 8), both strides != natural
        m = (torch.rand(8, 5, generator=g) > 0.3).t()  # transposed mask view
    elif name == "one":
        x = rnd(1, 1)
        m = torch.ones(1, 1, dtype=torch.bool)
    elif name == "row":
        x = rnd(1, 13)
        m = torch.rand(1, 13, generator=g) > 0.5
    elif name == "weights":
        x = rnd(4, 6)
        m = torch.rand(4, 6, generator=g) * (torch.rand(4, 6, generator=g) > 0.3)
    elif name == "nomask":
        x = rnd(3, 11)
        m = None
    else:
        raise ValueError(name)
    return x, None if m is None else m.to(device)


CASES = ("plain", "strided", "one", "row", "weights", "nomask")


def _grad(out, x, up):
    (g,) = torch.autograd.grad(out, x, up)
    return g


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_sum_mean_parity(backend, case, device):
    x, mask = _case(case, device)
    w = _weights(x, mask)
    for dim in (None, 0, 1, -1):
        if dim is not None and x.shape[dim % 2] == 0:
            continue
        n, s, mean = o_stats(x, w, dim)
        for fn, oracle in ((masked_sum, s), (masked_mean, mean)):
            xg = x.clone().requires_grad_(True)
            out = fn(xg, mask, dim=dim, backend=backend)
            assert out.dtype == torch.float32 and out.shape == oracle.shape
            assert_rel(out, oracle, FP32_TOL, f"{fn.__name__} dim={dim}")
            up = torch.randn_like(oracle)
            scale = 1.0 if fn is masked_sum else torch.where(n > 0, 1.0 / n, 0.0)
            if dim is None:
                g_oracle = up * scale * w
            else:
                g_oracle = (up * scale).unsqueeze(dim % 2) * w
            g = _grad(out, xg, up.float())
            assert g.dtype == x.dtype
            assert_rel(g, g_oracle, FP32_TOL, f"{fn.__name__} grad dim={dim}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_var_whiten_parity(backend, case, device):
    x, mask = _case(case, device)
    w = _weights(x, mask)
    x64 = x.double().requires_grad_(True)
    for unbiased in (True, False):
        xg = x.clone().requires_grad_(True)
        out = masked_var(xg, mask, unbiased=unbiased, backend=backend)
        oracle = o_var(x64, w, unbiased)
        assert out.shape == () and out.dtype == torch.float32
        assert_rel(out, oracle, FP32_TOL, f"var unbiased={unbiased}")
        up = torch.randn(())
        g_oracle = _grad(oracle, x64, up.double()) if oracle.requires_grad else 0 * x64
        assert_rel(_grad(out, xg, up), g_oracle, FP32_TOL, "var grad")
    for keep_mean in (False, True):
        xg = x.clone().requires_grad_(True)
        out = masked_whiten(xg, mask, keep_mean=keep_mean, backend=backend)
        oracle = o_whiten(x64, w, keep_mean)
        assert out.shape == x.shape and out.dtype == torch.float32
        up = torch.randn_like(out)
        assert_rel(out, oracle, FP32_TOL, f"whiten keep_mean={keep_mean}")
        # one counted element (variance 0, rsqrt(eps) = 1e4): fp32 autograd in the reference
        # cancels two 1e4-sized terms; the kernel centres gy first and keeps 1e-5
        degenerate = backend == "reference" and o_var(x, w).item() == 0.0
        tol = 1e-3 if degenerate else FP32_TOL
        assert_rel(_grad(out, xg, up), _grad(oracle, x64, up.double()), tol, "whiten grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_parity_and_multi_block(backend, device):
    """Several programs (R*C > BLOCK) and long rows (C > BLOCK) in float64."""
    torch.manual_seed(0)
    x = (torch.randn(3, 1500, device=device, dtype=torch.float64) + 100.0).requires_grad_(True)
    mask = torch.rand(3, 1500, device=device) > 0.2
    w = mask.double()
    for dim in (None, 1):  # (dim=0 would run 1500 one-program rows in the interpreter)
        _, s, mean = o_stats(x.detach(), w, dim)
        assert_rel(masked_sum(x, mask, dim=dim, backend=backend), s, F64_TOL, f"sum dim={dim}")
        assert_rel(masked_mean(x, mask, dim=dim, backend=backend), mean, F64_TOL, f"mean dim={dim}")
    # large offset: Chan's merge keeps the variance free of cancellation
    assert_rel(masked_var(x, mask, backend=backend), o_var(x.detach(), w), 1e-10, "var")
    up = torch.randn_like(x)
    out = masked_whiten(x, mask, keep_mean=True, backend=backend)
    x64 = x.detach().clone().requires_grad_(True)
    oracle = o_whiten(x64, w, keep_mean=True)
    assert_rel(out, oracle, F64_TOL, "whiten")
    assert_rel(_grad(out, x, up), _grad(oracle, x64, up), 1e-10, "whiten grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_input(backend, device):
    torch.manual_seed(1)
    x = (torch.randn(4, 37, device=device) * 3).to(torch.bfloat16)
    mask = torch.rand(4, 37, device=device) > 0.3
    w = mask.double()
    _, _, mean = o_stats(x, w)
    eager = (x * mask).sum() / mask.sum()  # bf16 eager
    out = masked_mean(x, mask, backend=backend)
    assert out.dtype == torch.float32
    assert_rel(out, mean, bf16_tol(eager, mean), "bf16 mean")
    y = masked_whiten(x.requires_grad_(True), mask, backend=backend)
    assert_rel(y, o_whiten(x, w), 1e-3, "bf16 whiten")
    y.backward(torch.randn_like(y))
    assert x.grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mask_gives_zero(backend, device):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool, device=device)
    for out in (
        masked_sum(x, mask, backend=backend),
        masked_mean(x, mask, backend=backend),
        masked_mean(x, mask, dim=1, backend=backend),
        masked_var(x, mask, backend=backend),
        masked_var(x, mask, unbiased=False, backend=backend),
    ):
        assert torch.equal(out.detach(), torch.zeros_like(out))
        (g,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(g, torch.zeros_like(g))
    # one counted element: unbiased variance has no degree of freedom -> 0, not NaN
    one = mask.clone()
    one[1, 2] = True
    assert masked_var(x, one, backend=backend).item() == 0.0
    y = masked_whiten(x, one, backend=backend)
    assert torch.isfinite(y).all() and y[1, 2].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_values_never_leak(backend, device):
    """NaN / inf under a zero mask contribute 0 and get 0 gradient."""
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 4.0]], device=device)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], device=device)
    x.requires_grad_(True)
    total = masked_sum(x, mask, backend=backend) + masked_var(x, mask, backend=backend)
    assert total.item() == pytest.approx(10.0 + torch.tensor([1.0, 2, 3, 4]).var().item())
    (g,) = torch.autograd.grad(total, x)
    assert g[0, 2].item() == 0.0 and g[1, 1].item() == 0.0 and torch.isfinite(g).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtune_and_trl_fixtures(backend, device):
    # torchtune test_masked_var: valid [1, 2, 3] -> 1.0 (centred internally here)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=device)
    mask = torch.tensor([True, True, True, False, False], device=device)
    assert masked_var(x, mask, backend=backend).item() == pytest.approx(1.0, abs=1e-6)
    # whiten without a mask uses the unbiased x.var(); keep_mean adds the mean back
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], device=device)
    zero_mean = masked_whiten(x, backend=backend, eps=0.0)
    std = x.std()
    torch.testing.assert_close(zero_mean, (x - 3.0) / std)
    kept = masked_whiten(x, keep_mean=True, backend=backend, eps=0.0)
    torch.testing.assert_close(kept, (x - 3.0) / std + 3.0)
    assert masked_mean(kept, backend=backend).item() == pytest.approx(3.0, abs=1e-6)
    assert abs(masked_mean(zero_mean, backend=backend).item()) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_shapes(backend, device):
    torch.manual_seed(2)
    x3 = torch.randn(2, 3, 5, device=device, dtype=torch.float64)
    m3 = torch.rand(2, 3, 5, device=device) > 0.3
    w3 = m3.double()
    for dim in (0, 1, 2, -1):
        _, s, _ = o_stats(x3, w3, dim)
        assert_rel(masked_sum(x3, m3, dim=dim, backend=backend), s, F64_TOL, f"3-D dim={dim}")
    assert_rel(masked_mean(x3, m3, backend=backend), o_stats(x3, w3)[2], F64_TOL, "3-D all")
    x1 = torch.randn(9, device=device, dtype=torch.float64)
    assert_rel(masked_mean(x1, dim=0, backend=backend), x1.mean(), F64_TOL, "1-D")
    assert masked_sum(x1[:0], backend=backend).item() == 0.0
    assert masked_sum(torch.zeros(0, 4, device=device), dim=1, backend=backend).shape == (0,)


def test_gradcheck_float64_triton(device):
    torch.manual_seed(3)
    x = torch.randn(3, 5, device=device, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5, device=device) > 0.3
    weights = torch.rand(3, 5, device=device, dtype=torch.float64)
    xt = torch.randn(5, 3, device=device, dtype=torch.float64).t().requires_grad_(True)

    def fn(a, b):
        return (
            masked_sum(a, mask, dim=1, backend="triton"),
            masked_mean(b, weights, dim=0, backend="triton"),
            masked_var(a, weights, backend="triton"),
            masked_whiten(b, mask, backend="triton"),
            masked_whiten(a, weights, keep_mean=True, eps=0.1, backend="triton"),
        )

    assert gradcheck(fn, (x, xt))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keep_mean", [False, True])
def test_whiten_eps_fp64_exact(backend, keep_mean, device):
    """fp64 whitening with an eps that fp32 cannot hold (0.1) and a variance of the same
    order: eps must reach the kernel as an fp32 pair, not one fp32 float (off by ~1e-9)."""
    torch.manual_seed(9)
    x = torch.randn(4, 7, device=device, dtype=torch.float64) * 0.3
    mask = torch.rand(4, 7, device=device) > 0.3
    up = torch.randn(4, 7, device=device, dtype=torch.float64)
    xg = x.clone().requires_grad_(True)
    y = masked_whiten(xg, mask, keep_mean=keep_mean, eps=0.1, backend=backend)
    (grad,) = torch.autograd.grad(y, xg, up)
    xo = x.clone().requires_grad_(True)
    o_y = o_whiten(xo, mask.double(), keep_mean=keep_mean, eps=0.1)
    (o_grad,) = torch.autograd.grad(o_y, xo, up)
    assert_rel(y, o_y, F64_TOL, "value")
    assert_rel(grad, o_grad, F64_TOL, "grad")


_SECOND_ORDER = {  # op: (fused, float64 oracle written here)
    "sum": (lambda x, m, b: masked_sum(x, m, dim=1, backend=b), lambda x, w: o_stats(x, w, 1)[1]),
    "mean": (lambda x, m, b: masked_mean(x, m, backend=b), lambda x, w: o_stats(x, w)[2]),
    "var": (lambda x, m, b: masked_var(x, m, backend=b), o_var),
    "whiten": (
        lambda x, m, b: masked_whiten(x, m, eps=0.1, backend=b),
        lambda x, w: o_whiten(x, w, eps=0.1),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(_SECOND_ORDER))
def test_double_backward_exact_or_raises(backend, op, device):
    """A Hessian-vector product is float64 autograd's of the oracle or a clear RuntimeError,
    never silently wrong: the Triton backward takes the saved statistics as constants, which
    is exact only for sum / mean (Hessian 0)."""
    torch.manual_seed(8)
    x = torch.randn(3, 5, device=device, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5, device=device) > 0.3
    v = torch.randn_like(x)
    fused, oracle = _SECOND_ORDER[op]

    def hvp(fn):
        y = fn(x)
        w = torch.linspace(-1.0, 2.0, y.numel(), device=device, dtype=y.dtype).reshape(y.shape)
        (g,) = torch.autograd.grad((y * w).sum(), x, create_graph=True)
        # + |x|^2: a gradient cut from the graph gives a wrong value here, not an error
        return torch.autograd.grad((g * v).sum() + x.square().sum(), x)[0]

    expected = hvp(lambda a: oracle(a, mask.double()))
    try:
        got = hvp(lambda a: fused(a, mask, backend))
    except RuntimeError as err:
        assert backend == "triton" and op in ("var", "whiten")
        assert "differentiable once" in str(err)
        return
    assert_rel(got, expected, F64_TOL, f"{backend} {op} Hessian-vector product")
    if backend == "triton":  # d(grad)/d(upstream) is not implemented: it raises
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.gradgradcheck(lambda a: fused(a, mask, backend), (x,))
    else:
        assert torch.autograd.gradgradcheck(lambda a: fused(a, mask, backend), (x,))


def test_deterministic(device):
    torch.manual_seed(4)
    x = torch.randn(5, 700, device=device, requires_grad=True)
    mask = torch.rand(5, 700, device=device) > 0.5
    up = torch.randn(5, 700, device=device)

    def run():
        v = masked_var(x, mask, backend="triton")
        y = masked_whiten(x, mask, backend="triton")
        return (v, y, *torch.autograd.grad((v, y), x, (torch.ones(()), up)))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    torch.manual_seed(5)
    x = torch.randn(4, 9, device=device)
    mask = torch.rand(4, 9, device=device) > 0.3

    def f(a):
        mean_rows = masked_mean(a, mask, dim=1, backend="triton")
        return (
            mean_rows.sum()
            + masked_var(a, mask, backend="triton")
            + masked_whiten(a, mask, backend="triton").square().mean()
        )

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for fn in (f, compiled):
        xg = x.clone().requires_grad_(True)
        out = fn(xg)
        out.backward()
        if fn is f:
            eager = (out.detach(), xg.grad)
        else:
            torch.testing.assert_close(out.detach(), eager[0], rtol=0, atol=0)
            torch.testing.assert_close(xg.grad, eager[1], rtol=0, atol=0)


def test_errors(device):
    x = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="mask"):
        masked_sum(x, torch.ones(3, 5, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="mask"):
        masked_mean(x, torch.ones(3, 4, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="x"):
        masked_mean(torch.ones(3, 4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="mask"):
        masked_mean(x, torch.ones(3, 4, dtype=torch.complex64, device=device))
    with pytest.raises(ValueError, match="dim"):
        masked_sum(x, dim=2)
    with pytest.raises(TypeError, match="dim"):
        masked_sum(x, dim=(0, 1))
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, eps=-1.0)
    with pytest.raises(ValueError, match="backend"):
        masked_var(x, backend="cuda")


@pytest.mark.gpu
def test_no_host_sync_cuda():
    x, mask = _case("plain", "cuda")
    x.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = masked_mean(x, mask, dim=1).sum() + masked_var(x, mask) + masked_sum(x, mask)
        (out + masked_whiten(x, mask, keep_mean=True).square().sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_is_a_constant(backend, device):
    """A float mask that requires grad gets none, on either backend (as documented)."""
    x = torch.randn(3, 6, device=device, requires_grad=True)
    w = torch.rand(3, 6, device=device, requires_grad=True)
    outs = [
        masked_sum(x, w, backend=backend),
        masked_mean(x, w, dim=1, backend=backend).sum(),
        masked_var(x, w, backend=backend),
        (masked_whiten(x, w, backend=backend) * torch.arange(6.0, device=device)).sum(),
    ]
    for out in outs:
        g_x, g_w = torch.autograd.grad(out, [x, w], allow_unused=True)
        assert g_x is not None and g_w is None
