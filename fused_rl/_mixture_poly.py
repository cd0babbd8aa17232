"""The generalized JSD's near-equal columns as two polynomials in ``delta`` (the fp32 form of
``kernels/vocab/distill.py`` ``near_mixture``).

Per column, with ``delta = log q - log p`` and ``m = (1 - beta) p + beta q``, the JSD's
mixture pass and its backward need ``L = log(m / p) = log(1 - beta + beta e^delta)`` and the
forward the column's term ``f / p = beta delta e^delta - e^L L``, of order ``delta^2``:
its ``O(delta)`` parts cancel. Both are analytic in ``delta`` wherever ``m != 0``, that is
for complex ``|delta| < pi`` at least (``m`` vanishes first at
``delta = log((1 - beta) / beta) +- i pi``), so on ``|delta| <= 1`` ``L / delta`` and
``f / (p delta^2)`` are each a polynomial of degree ``MIX_NEAR_DEGREE`` (8) to well within
fp32 rounding: the truncation is at most 2.2e-8 relative (5.0e-9 for ``f``) over ``beta`` in
``k / 40`` and ``1e-3``, ``1 - 1e-3`` (degree 7: 1.5e-7), and evaluated in fp32 with fused
multiply-adds both are within about 4 units of fp32 roundoff of float64 (``delta`` on a grid
of ``[-1, 1]``, ``beta`` from ``1e-7`` to ``1 - 1e-7``: 4.1 for ``f`` at ``beta = 1e-7``).
The kernel evaluates ``delta A(delta)`` and ``delta^2 H(delta)``, eight multiply-adds each,
where the series forms took an ``expm1``, a ``log1p`` and two Taylor series; no
``O(delta)`` terms cancel.

The coefficients depend on ``beta`` alone: computed here once per ``beta`` (the Taylor
series of both to degree ``_TAYLOR`` by power-series recurrences in exact rationals, whose
truncation is below ``pi^-28`` on ``[-1, 1]``, then Chebyshev economisation down to degree 8
in float64), and passed to the kernels as fp32 launch constants
(``fused_rl.distill.mixture_constants``); the reference backend evaluates the same ``H`` in
fp32 (``fused_rl.reference.distill`` ``mixture_terms``). Exact rationals because each of
``f``'s coefficients is a difference of order-1 terms that is of order ``1 - beta``: in
float64 they lost ``2^-53 / (1 - beta)``, 2e-3 of ``H`` at ``beta = 1 - 1e-13`` (the exact
series: about 9 ms a ``beta``, once). Plain Python, no Triton and no torch.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ._compile_marks import assume_constant_result
from .kernels.modes import MIX_NEAR_DEGREE

_TAYLOR = 30


def _taylor(beta: float) -> tuple[list[float], list[float]]:
    """The Taylor coefficients at ``delta = 0`` of ``L / delta`` and ``f / (p delta^2)``
    (degree ``_TAYLOR - 2``), computed exactly (``beta`` as the rational it is) and rounded
    to float64."""
    n, b = _TAYLOR, Fraction(beta)
    w = [Fraction(1)] + [b / math.factorial(k) for k in range(1, n + 1)]  # 1 + beta expm1
    # L = log w from w L' = w' (w_0 = 1): the coefficients of L' one degree at a time
    dl = []
    for k in range(n):
        dl.append((k + 1) * w[k + 1] - sum(w[j] * dl[k - j] for j in range(1, k + 1)))
    log_w = [Fraction(0)] + [dl[k - 1] / k for k in range(1, n + 1)]
    # f / p = beta delta e^delta - w L
    f = [Fraction(0)] + [b / math.factorial(k - 1) for k in range(1, n + 1)]
    f = [f[k] - sum(w[j] * log_w[k - j] for j in range(k + 1)) for k in range(n + 1)]
    return [float(c) for c in log_w[1:-1]], [float(c) for c in f[2:]]


def _economize(coeffs: list[float], degree: int) -> list[float]:
    """The monomial coefficients (lowest first) of the Chebyshev truncation to ``degree`` on
    ``[-1, 1]`` of the polynomial ``coeffs``: ``x^m = 2^(1-m) sum_j C(m, j) T_(m-2j)`` (the
    ``T_0`` term halved), the terms above ``degree`` dropped (each below its Chebyshev
    coefficient on ``[-1, 1]``), then back through ``T_k = 2 x T_(k-1) - T_(k-2)``."""
    cheb = [0.0] * len(coeffs)
    for m, c in enumerate(coeffs):
        for j in range(m // 2 + 1):
            cheb[m - 2 * j] += c * math.comb(m, j) * 2.0 ** (1 - m) * (0.5 if 2 * j == m else 1.0)
    basis = [[1.0], [0.0, 1.0]]
    while len(basis) <= degree:
        twice = [0.0] + [2.0 * v for v in basis[-1]]
        basis.append([a - b for a, b in zip(twice, basis[-2] + [0.0, 0.0])])
    out = [0.0] * (degree + 1)
    for k in range(degree + 1):
        for i, v in enumerate(basis[k]):
            out[i] += cheb[k] * v
    return out


_NEAR: dict[float, tuple[tuple[float, ...], tuple[float, ...]]] = {}


@assume_constant_result  # traced (the reference under torch.compile): a constant
def near_polynomials(beta: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(A, H)``: the degree-``MIX_NEAR_DEGREE`` coefficients (lowest first, float64) with
    ``L ~ delta A(delta)`` and ``f / p ~ delta^2 H(delta)`` on ``|delta| <= 1``, for
    ``0 < beta < 1``. ``H(0) = beta (1 - beta) / 2``.

    >>> a, h = near_polynomials(0.3)
    >>> len(a), round(a[0], 6), round(h[0], 6)  # L'(0) = beta, H(0) = beta (1 - beta) / 2
    (9, 0.3, 0.105)
    """
    hit = _NEAR.get(beta)
    if hit is None:  # computed once a beta (a few betas in a run: a schedule's steps at most)
        log_m, f = _taylor(beta)
        hit = tuple(_economize(log_m, MIX_NEAR_DEGREE)), tuple(_economize(f, MIX_NEAR_DEGREE))
        _NEAR[beta] = hit
    return hit
