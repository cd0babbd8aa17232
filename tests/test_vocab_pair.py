"""``kernels/vocab/pair.py``'s scalar helpers on their own: ``expm1_near`` and
``expm1_small`` (the polynomials the two-row kernels use on their near-equal columns),
``expm1`` and ``log1p_unit`` (the
``logaddexp`` forms' polynomial) against float64, on the test's device (the interpreter on a
CPU-only machine, compiled on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE
from fused_rl.kernels.vocab.pair import expm1, expm1_near, expm1_small, log1p_unit

U32 = 2.0**-24  # fp32 unit roundoff


@triton.jit
def _apply(x_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    if FN == 0:
        y = expm1(x)
    elif FN == 1:
        y = expm1_near(x)
    elif FN == 3:
        y = expm1_small(x)
    else:
        y = log1p_unit(x)
    tl.store(out_ptr + cols, y, mask=cols < n)


def _run(x: torch.Tensor, near: bool, fn: int | None = None) -> torch.Tensor:
    """``expm1_near`` (``near``) or ``expm1`` of ``x``; ``fn=2``: ``log1p_unit``, ``fn=3``:
    ``expm1_small``."""
    x = x.to(DEVICE).contiguous()
    out = torch.empty_like(x)
    block = 1024
    fn = int(near) if fn is None else fn
    _apply[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), FN=fn, BLOCK=block)
    return out.cpu()


def _near_points(dtype, edge=1.0) -> torch.Tensor:
    tiny = [2.0**-e for e in range(1, 130, 3) if 2.0**-e <= edge]
    grid = torch.linspace(-edge, edge, 20001, dtype=torch.float64)
    points = torch.cat([grid, torch.tensor(tiny + [-t for t in tiny], dtype=torch.float64)])
    return points.to(dtype)


@pytest.mark.parametrize("near", [True, False], ids=["expm1_near", "expm1"])
def test_fp32_within_a_few_units_of_roundoff_on_the_near_range(near):
    """fp32 over ``[-1, 1]`` (subnormal-free tiny values included): within 4 units of fp32
    roundoff of float64's ``expm1`` of the same input (the polynomial measured 2.3 with FMA
    and 2.8 without; the old exp / log / division form 6)."""
    x = _near_points(torch.float32)
    got = _run(x, near).double()
    want = torch.expm1(x.double())
    rel = ((got - want).abs() / want.abs().clamp_min(1e-300)).max().item()
    assert rel <= 4 * U32, rel


def test_expm1_small_on_its_range():
    """``expm1_small`` over ``[-0.35, 0.35]`` (the exact KL's forward on its near-equal
    columns): fp32 within 4 units of fp32 roundoff of float64 (measured 2.1 with fused
    multiply-adds), fp64 the log form to a few fp64 ulps; NaN stays NaN."""
    for dtype, tol in ((torch.float32, 4 * U32), (torch.float64, 1e-13)):
        x = _near_points(dtype, edge=0.35)
        got = _run(x, False, fn=3).double()
        want = torch.expm1(x.double())
        rel = ((got - want).abs() / want.abs().clamp_min(1e-300)).max().item()
        assert rel <= tol, (dtype, rel)
    assert math.isnan(_run(torch.tensor([float("nan")]), False, fn=3)[0])


def test_fp64_is_the_log_form():
    """fp64: the exp / log / division form, accurate to a few fp64 ulps."""
    x = _near_points(torch.float64)
    for near in (True, False):
        got = _run(x, near)
        rel = ((got - torch.expm1(x)).abs() / torch.expm1(x).abs().clamp_min(1e-300)).max()
        assert rel.item() <= 1e-13, (near, rel.item())


def test_expm1_special_values():
    """``expm1`` beyond the near range and at the edges: ``+inf`` -> ``inf``, ``-inf`` ->
    ``-1``, NaN -> NaN, ``-0.0`` keeps its sign, beyond ``|v| = 1`` ``exp(v) - 1``."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3.5, -20.0, 80.0])
    got = _run(x, near=False)
    assert math.isinf(got[0]) and got[0] > 0
    assert got[1] == -1.0
    assert math.isnan(got[2])
    assert got[3] == 0.0 and math.copysign(1.0, got[3].item()) == -1.0
    assert got[4] == 0.0 and math.copysign(1.0, got[4].item()) == 1.0
    want = torch.expm1(x[5:].double())
    assert ((got[5:].double() - want).abs() / want.abs()).max() <= 4 * U32 * 80  # exp's |v|
    assert math.isnan(_run(torch.tensor([float("nan")]), near=True)[0])


def test_log1p_unit_on_its_range():
    """``log1p_unit`` over ``[0, 1]`` (tiny values down to ``2^-124`` included): fp32 within 4
    units of fp32 roundoff of float64's ``log1p`` of the same input (measured 1.2 with fused
    multiply-adds, as compiled, 2.9 without, as interpreted); fp64 is ``log1p``, to a few
    fp64 ulps; 0 -> 0, NaN -> NaN."""
    tiny = [2.0**-e for e in range(1, 127, 3)]
    x = torch.cat([torch.linspace(0.0, 1.0, 20001, dtype=torch.float64),
                   torch.tensor(tiny, dtype=torch.float64)])  # fmt: skip
    got = _run(x.float(), False, fn=2).double()
    want = torch.log1p(x.float().double())
    nz = want != 0
    assert ((got - want).abs()[nz] / want[nz]).max() <= 4 * U32
    assert got[0] == 0
    got64 = _run(x, False, fn=2)
    assert ((got64 - torch.log1p(x)).abs()[nz] / torch.log1p(x)[nz]).max() <= 1e-13
    assert math.isnan(_run(torch.tensor([float("nan")]), False, fn=2)[0])
