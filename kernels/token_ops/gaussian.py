"""Token space, continuous actions: diagonal-Gaussian log-prob and entropy (fwd + bwd).

``Independent(Normal(mu, sigma), 1)`` semantics on ``(R, N)`` row views: each row is one
action of ``N`` dimensions, reduced over ``N`` inside the program (no atomics). Tiles of
``BLOCK_R`` rows x ``BLOCK_N`` action dims; any strides (stride 0 for a broadcast sigma).
"""

import triton
import triton.language as tl

from ..common import cast_for

HALF_LOG_2PI = tl.constexpr(0.9189385332046727)  # 0.5 * log(2 * pi)


@triton.jit
def _tile(row_start, col_start, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 row / column indices of one tile and its in-bounds mask."""
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
    ok = (rows[:, None] < R) & (cols[None, :] < N)
    return rows, cols, ok


@triton.jit(do_not_specialize=["R", "N"])
def _gaussian_logprob_fwd_kernel(
    mu_ptr,
    sigma_ptr,
    act_ptr,
    out_ptr,
    R,
    N,
    stride_mr,
    stride_mn,
    stride_sr,
    stride_sn,
    stride_ar,
    stride_an,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    """``out[r] = sum_n -(a - mu)^2 / (2 sigma^2) - log sigma - 0.5 log(2 pi)``."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_R
    acc = tl.zeros((BLOCK_R,), ACC)
    for col_start in range(0, N, BLOCK_N):
        rows, cols, ok = _tile(row_start, col_start, R, N, BLOCK_R, BLOCK_N)
        mu = tl.load(mu_ptr + rows[:, None] * stride_mr + cols[None, :] * stride_mn, mask=ok)
        sigma = tl.load(
            sigma_ptr + rows[:, None] * stride_sr + cols[None, :] * stride_sn, mask=ok, other=1.0
        )
        act = tl.load(act_ptr + rows[:, None] * stride_ar + cols[None, :] * stride_an, mask=ok)
        z = (act.to(ACC) - mu.to(ACC)) / sigma.to(ACC)
        term = -0.5 * z * z - tl.log(sigma.to(ACC))
        acc += tl.sum(tl.where(ok, term, 0.0), 1)
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    tl.store(out_ptr + rows, acc - N.to(ACC) * HALF_LOG_2PI, mask=rows < R)


@triton.jit(do_not_specialize=["R", "N"])
def _gaussian_logprob_bwd_kernel(
    mu_ptr,
    sigma_ptr,
    act_ptr,
    grad_out_ptr,
    grad_mu_ptr,
    grad_sigma_ptr,
    R,
    N,
    stride_mr,
    stride_mn,
    stride_sr,
    stride_sn,
    stride_ar,
    stride_an,
    stride_g,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    """``dmu = g (a - mu) / sigma^2``, ``dsigma = g ((a - mu)^2 / sigma^3 - 1 / sigma)``;
    contiguous ``(R, N)`` outputs (``d actions = -dmu`` is left to the caller).

    Formed as ``z = (a - mu) / sigma``, ``dmu = (g z) / sigma``, ``dsigma = dmu z - g / sigma``:
    no intermediate overflows where the result fits (``(a - mu) / sigma^2`` alone passes
    3.4e38 at ``sigma = 1e-20``). A row whose ``g`` is 0 writes exact zeros: a zero upstream
    (a ratio ``exp(-inf) = 0``, a clipped sample) never turns an overflowed ``z`` into NaN."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_R
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    g = tl.load(grad_out_ptr + rows * stride_g, mask=rows < R, other=0.0).to(ACC)
    counted = (g != 0)[:, None]
    for col_start in range(0, N, BLOCK_N):
        rows, cols, ok = _tile(row_start, col_start, R, N, BLOCK_R, BLOCK_N)
        mu = tl.load(mu_ptr + rows[:, None] * stride_mr + cols[None, :] * stride_mn, mask=ok)
        sigma = tl.load(
            sigma_ptr + rows[:, None] * stride_sr + cols[None, :] * stride_sn, mask=ok, other=1.0
        )
        act = tl.load(act_ptr + rows[:, None] * stride_ar + cols[None, :] * stride_an, mask=ok)
        inv_sigma = 1.0 / sigma.to(ACC)
        z = (act.to(ACC) - mu.to(ACC)) * inv_sigma
        gz = tl.where(counted, g[:, None] * z * inv_sigma, 0.0)
        dsigma = tl.where(counted, gz * z - g[:, None] * inv_sigma, 0.0)
        dst = rows[:, None] * N + cols[None, :]
        tl.store(grad_mu_ptr + dst, cast_for(gz, grad_mu_ptr), mask=ok)
        tl.store(grad_sigma_ptr + dst, cast_for(dsigma, grad_sigma_ptr), mask=ok)


@triton.jit(do_not_specialize=["R", "N"])
def _gaussian_entropy_fwd_kernel(
    sigma_ptr,
    out_ptr,
    R,
    N,
    stride_sr,
    stride_sn,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    """``out[r] = sum_n 0.5 + 0.5 log(2 pi) + log sigma``."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_R
    acc = tl.zeros((BLOCK_R,), ACC)
    for col_start in range(0, N, BLOCK_N):
        rows, cols, ok = _tile(row_start, col_start, R, N, BLOCK_R, BLOCK_N)
        sigma = tl.load(
            sigma_ptr + rows[:, None] * stride_sr + cols[None, :] * stride_sn, mask=ok, other=1.0
        )
        acc += tl.sum(tl.where(ok, tl.log(sigma.to(ACC)), 0.0), 1)
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    tl.store(out_ptr + rows, acc + N.to(ACC) * (0.5 + HALF_LOG_2PI), mask=rows < R)


@triton.jit(do_not_specialize=["R", "N"])
def _gaussian_entropy_bwd_kernel(
    sigma_ptr,
    grad_out_ptr,
    grad_sigma_ptr,
    R,
    N,
    stride_sr,
    stride_sn,
    stride_g,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    """``dsigma = g / sigma``, contiguous ``(R, N)``."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_R
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    g = tl.load(grad_out_ptr + rows * stride_g, mask=rows < R, other=0.0).to(ACC)
    for col_start in range(0, N, BLOCK_N):
        rows, cols, ok = _tile(row_start, col_start, R, N, BLOCK_R, BLOCK_N)
        sigma = tl.load(
            sigma_ptr + rows[:, None] * stride_sr + cols[None, :] * stride_sn, mask=ok, other=1.0
        )
        tl.store(
            grad_sigma_ptr + rows[:, None] * N + cols[None, :],
            cast_for(g[:, None] / sigma.to(ACC), grad_sigma_ptr),
            mask=ok,
        )
