"""The generalized JSD's near-form polynomials (``fused_rl._mixture_poly``) against float64,
and the fp32 kernel helpers that use them (``kernels/vocab/distill.py`` ``mixture_terms``,
``mixture_log``) against float64 per column, near and far forms and the edge between them,
on the test's device (the interpreter on a CPU-only machine, compiled on a GPU)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE
from fused_rl.kernels.modes import MIX_NEAR_DEGREE, N_MIX
from fused_rl.kernels.vocab.distill import mixture_log, mixture_terms

from fused_rl._mixture_poly import _taylor, near_polynomials
from fused_rl._ops import _serialised_when_interpreting
from fused_rl.distill import mixture_constants

U32 = 2.0**-24  # fp32 unit roundoff
BETAS = [k / 40 for k in range(1, 40)] + [1e-3, 1 - 1e-3]


def _exact(delta: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(L, f / p)`` from their definitions: ``L = log1p(beta expm1(delta))``,
    ``f / p = beta delta e^delta - (1 + x) L``, which cancels by ``~1 / |delta|``: below
    ``|delta| = 1/8`` ``f / p`` is its Taylor series instead (``_taylor``, to degree 30:
    the terms past it are below ``8^-28``)."""
    x = beta * torch.expm1(delta)
    big_l = torch.log1p(x)
    f = beta * delta * delta.exp() - (1.0 + x) * big_l
    series = delta * delta * _polyval(_taylor(beta)[1], delta)
    return big_l, torch.where(delta.abs() < 0.125, series, f)


def _polyval(coeffs, v: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(v)
    for c in reversed(coeffs):
        out = out * v + c
    return out


@pytest.mark.parametrize("beta", BETAS, ids=lambda b: f"{b:g}")
def test_polynomials_are_the_functions_on_the_near_range(beta):
    """In float64 the two polynomials are ``L / delta`` and ``f / (p delta^2)`` within 3e-8
    relative over ``0.02 <= |delta| <= 1`` (the fit: at most 2.2e-8 and 5e-9, a third of
    fp32's unit roundoff), and at ``delta = 0`` their limits ``beta`` and
    ``beta (1 - beta) / 2``."""
    a, h = near_polynomials(beta)
    assert len(a) == len(h) == MIX_NEAR_DEGREE + 1
    d = torch.cat([torch.linspace(-1, -0.02, 3000), torch.linspace(0.02, 1, 3000)]).double()
    big_l, f = _exact(d, beta)
    assert ((d * _polyval(a, d) - big_l).abs() / big_l.abs()).max() <= 3e-8
    assert ((d * d * _polyval(h, d) - f).abs() / f.abs()).max() <= 3e-8
    assert a[0] == pytest.approx(beta, rel=3e-8)
    assert h[0] == pytest.approx(beta * (1 - beta) / 2, rel=3e-8)


@pytest.mark.parametrize("gap", [1e-7, 1e-11, 1e-15], ids=lambda g: f"1-{g:g}")
def test_polynomials_next_to_one(gap):
    """``beta = 1 - gap``: each of ``f``'s Taylor coefficients is a difference of order-1
    terms that is of order ``gap``, so they are formed in exact rationals (float64 lost
    ``2^-53 / gap``: 19% of ``H`` at ``1 - 1e-15``). Against 60-digit arithmetic (mpmath,
    which torch's sympy brings) at a few ``delta``: within 3e-8, as at any ``beta``."""
    import mpmath

    mpmath.mp.dps = 60
    beta = 1.0 - gap
    a, h = near_polynomials(beta)
    b = mpmath.mpf(beta)
    for delta in (-1.0, -0.3, 0.01, 0.5, 1.0):
        d = mpmath.mpf(delta)
        m = 1 - b + b * mpmath.exp(d)
        big_l, f = mpmath.log(m), b * d * mpmath.exp(d) - m * mpmath.log(m)
        got_l = delta * sum(c * delta**i for i, c in enumerate(a))
        got_f = delta * delta * sum(c * delta**i for i, c in enumerate(h))
        assert abs(got_l - float(big_l)) <= 3e-8 * abs(float(big_l)), delta
        assert abs(got_f - float(f)) <= 3e-8 * abs(float(f)), delta


def test_constants_layout():
    """``mixture_constants``: ``N_MIX`` values, the four fp32 pairs summing to ``beta``,
    ``1 - beta``, ``log beta``, ``log(1 - beta)``, then ``A`` and ``H``; at ``beta`` 0 and 1
    (no mixture) the logs and polynomials are 0. Cached per ``beta``."""
    beta = 0.3
    mix = mixture_constants(beta)
    assert len(mix) == N_MIX
    for k, want in enumerate((beta, 1 - beta, math.log(beta), math.log1p(-beta))):
        assert mix[2 * k] + mix[2 * k + 1] == pytest.approx(want, rel=1e-13)
    a, h = near_polynomials(beta)
    assert mix[8:] == a + h
    for edge in (0.0, 1.0):
        mix = mixture_constants(edge)
        assert len(mix) == N_MIX and mix[0] + mix[1] == edge and mix[2] + mix[3] == 1 - edge
        assert not any(mix[4:])
    assert near_polynomials(beta) is near_polynomials(beta)


def test_a_constant_under_torch_compile():
    """The reference calls ``near_polynomials`` inside code ``torch.compile`` traces: marked
    ``assume_constant_result`` (its own cache, no ``lru_cache`` wrapper, which Dynamo traces
    through with a warning), it is called once while tracing and its numbers are constants
    of the graph (``fullgraph``: no break), with no warning."""

    def f(x):
        return x * near_polynomials(0.37)[1][0]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lru_cache")
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), near_polynomials(0.37)[1][0]))


@triton.jit
def _columns(d_ptr, p_ptr, q_ptr, l_ptr, f_ptr, lb_ptr, n, mix, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    delta = tl.load(d_ptr + cols, mask=ok, other=0.0)
    p = tl.load(p_ptr + cols, mask=ok, other=0.0)
    q = tl.load(q_ptr + cols, mask=ok, other=0.0)
    big_l, f = mixture_terms(delta, p, q, mix, tl.float32)
    tl.store(l_ptr + cols, big_l, mask=ok)
    tl.store(f_ptr + cols, f, mask=ok)
    tl.store(lb_ptr + cols, mixture_log(delta, mix, tl.float32), mask=ok)


def _run(delta: torch.Tensor, p: torch.Tensor, q: torch.Tensor, beta: float):
    """``(L, f, the backward's L)`` per column, fp32, for ``delta = log q - log p``."""
    delta, p, q = (t.float().to(DEVICE) for t in (delta, p, q))
    outs = [torch.empty_like(delta) for _ in range(3)]
    block = 1024

    @_serialised_when_interpreting  # masked and discarded lanes' 0 * inf warn in NumPy
    def launch():
        _columns[(triton.cdiv(delta.numel(), block),)](
            delta, p, q, *outs, delta.numel(), mixture_constants(beta), BLOCK=block
        )

    launch()
    return [o.cpu().double() for o in outs]


@pytest.mark.parametrize("beta", [0.5, 0.1, 0.9, 1e-3, 1 - 1e-4], ids=lambda b: f"{b:g}")
def test_fp32_columns_match_float64(beta):
    """fp32 per column, ``delta`` over ``[-6, 6]`` (both forms and the edge ``|delta| = 1``
    between them, the tiny ``delta`` of near-equal rows), against float64:

    * ``L`` (the forward's and the backward's ``mixture_log``, the same value) within 24
      units of fp32 roundoff relative to itself (17 measured, 19 before the polynomials, at
      ``beta = 1e-3`` just past the edge: the ``logaddexp`` form's ``log(beta) + delta``, of
      size 6, is rounded to ``2^-24 * 6`` while ``L`` is 2e-3; the near polynomials 2);
    * the column's term ``f``, near (``|delta| <= 1``): within 8 units relative to itself
      (3.2 measured; the series forms before the polynomials: 250 at ``beta = 0.9``, 4e5 at
      ``0.9999``, their two ``O(delta^2)`` parts cancelling by ``1 / (1 - beta)``); beyond:
      within 16 units of the two terms it is the difference of, ``beta q |log(q / m)|`` and
      ``(1 - beta) p |L|`` (7.5 measured; ``1 - beta`` itself from the launch constants: in
      fp32 from ``beta`` it was off by 1.7e-4 at ``0.9999``)."""
    tiny = [2.0**-e for e in range(4, 60, 5)]
    edge = [1 - 2.0**-20, 1.0, 1 + 2.0**-20]
    d = torch.cat(
        [torch.linspace(-6, 6, 4801), torch.tensor(tiny + edge + [-v for v in tiny + edge])]
    )
    d = d.float().double()  # the kernel's fp32 input, exactly
    p = torch.full_like(d, 0.25)
    big_l, f, backward_l = _run(d, p, p * d.exp(), beta)
    want_l, want_f = _exact(d, beta)
    want_f = p * want_f
    assert torch.equal(big_l, backward_l)
    nz = want_l != 0
    assert ((big_l - want_l).abs()[nz] / want_l.abs()[nz]).max() <= 24 * U32
    near = (d.abs() <= 1) & (want_f.abs() > 2.0**-100)  # fp32's normal range, with room
    assert ((f - want_f).abs()[near] / want_f.abs()[near]).max() <= 8 * U32
    scale = p * (beta * d.exp() * (d - want_l).abs() + (1 - beta) * want_l.abs())
    far = d.abs() > 1
    assert ((f - want_f).abs()[far] / scale[far]).max() <= 16 * U32


def test_fp32_columns_special_values():
    """``delta = +inf`` (``p = 0 < q``): ``L = inf``, ``f = -beta q log beta``;
    ``delta = -inf`` (``q = 0``): ``L = log(1 - beta)``, ``f = -(1 - beta) p log(1 - beta)``;
    NaN stays NaN; ``delta = 0``: both 0."""
    beta = 0.25
    d = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    p = torch.tensor([0.0, 0.5, 0.5, 0.5])
    q = torch.tensor([0.5, 0.0, 0.5, 0.5])
    big_l, f, _ = _run(d, p, q, beta)
    assert big_l[0] == math.inf
    assert f[0].item() == pytest.approx(-beta * 0.5 * math.log(beta), rel=8 * U32)
    assert big_l[1].item() == pytest.approx(math.log1p(-beta), rel=4 * U32)
    assert f[1].item() == pytest.approx(-(1 - beta) * 0.5 * math.log1p(-beta), rel=8 * U32)
    assert math.isnan(big_l[2]) and math.isnan(f[2])
    assert big_l[3] == 0 and f[3] == 0
