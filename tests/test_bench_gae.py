"""CPU benchmark: the reference ``gae`` (blocked matmul scan) against seed 004's Python loop.

With ``--benchmark-disable`` (CI) each benchmarked call runs once and only the parity checks
hold. With benchmarking on, pytest-benchmark times both in the group ``gae-cpu-T1024`` and
``test_gae_reference_far_faster_than_loop`` asserts the reference is >= 10x faster.
"""

from __future__ import annotations

import timeit

import pytest
import torch
from helpers import FP32_TOL, assert_rel, seed_gae_loop

from fused_rl.advantages import gae

# an integration test (subprocess / CLI / compile): `pytest -m 'not integration'` skips it
pytestmark = pytest.mark.integration

GAMMA, LAM = 0.99, 0.95
SHAPE = (8, 1024)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


def _reference(rewards, values):
    return gae(rewards, values, gamma=GAMMA, lam=LAM, backend="reference")


def _loop(rewards, values):
    return seed_gae_loop(rewards, values, GAMMA, LAM)


@pytest.mark.no_poison
@pytest.mark.parametrize("impl", ["seed_loop", "reference"])
def test_gae_cpu_t1024(benchmark, impl):
    """Both implementations side by side in one benchmark group, checked against fp64."""
    benchmark.group = "gae-cpu-T1024"
    rewards, values = _inputs()
    adv, ret = benchmark(_loop if impl == "seed_loop" else _reference, rewards, values)
    o_adv, o_ret = seed_gae_loop(rewards.double(), values.double(), GAMMA, LAM)
    assert_rel(adv, o_adv, FP32_TOL, f"{impl} advantages")
    assert_rel(ret, o_ret, FP32_TOL, f"{impl} returns")


@pytest.mark.no_poison
def test_gae_reference_far_faster_than_loop(benchmark):
    rewards, values = _inputs()
    adv, ret = benchmark(_reference, rewards, values)
    loop_adv, loop_ret = _loop(rewards, values)
    assert_rel(adv, loop_adv, FP32_TOL, "reference vs seed loop")
    assert_rel(ret, loop_ret, FP32_TOL, "reference vs seed loop returns")
    if benchmark.disabled:
        return
    loop_s = min(timeit.repeat(lambda: _loop(rewards, values), number=1, repeat=5))
    ref_s = benchmark.stats.stats.min
    assert loop_s >= 10 * ref_s, f"seed loop {loop_s * 1e3:.2f} ms, reference {ref_s * 1e3:.3f} ms"
