"""A thin wrapper, counted: with the Triton kernels stubbed and the value checks off, one
forward+backward makes the host run at most this many of fused_rl's Python functions and
this many dispatcher ops (``bench.host.count_host_work``). Counts, not a timing: a timed
ratio depends on the machine's load, so the microseconds live in ``python bench/run.py
host``, which prints them beside these counts and the eager GRPO loss's.

The budgets are what the code does today (CONTRIBUTING.md, "What a call costs"): lowering
one is progress, raising one needs a reason written there.
"""

from __future__ import annotations

import os
import sys

import pytest
from helpers import FP32_TOL, assert_rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fused_rl  # noqa: E402
from bench import host  # noqa: E402

# (fused_rl Python functions entered, dispatcher ops) per forward + backward
BUDGET = {
    "policy_loss": (112, 17),
    "policy_loss_cispo": (112, 17),
    "policy_loss_is": (114, 17),
    "token_logprobs": (72, 14),
}


@pytest.mark.no_poison  # NaN-filling every torch.empty would add a fill op per allocation
@pytest.mark.parametrize("name", list(BUDGET))
def test_host_work_within_budget(name, device):
    frames, ops = BUDGET[name]
    inp = host.make_inputs(*host.SHAPE, device=device)
    with host.host_timing(stub=True):
        call = host.BUILDERS[name](inp)
        call()  # first-call work (imports, caches) is not per-call work
        work = host.count_host_work(call)
    assert work["py_frames"] <= frames, (name, work)
    assert work["dispatch_ops"] <= ops, (name, work)


@pytest.mark.no_poison
def test_fewer_dispatcher_ops_than_the_eager_loss(device):
    """The fused loss hands the dispatcher a fifth of what the eager 10-line GRPO loss does
    (84 ops), whose host time the wrapper's Python must stay within."""
    inp = host.make_inputs(*host.SHAPE, device=device)
    with host.host_timing(stub=True):
        work = {}
        for name in ("policy_loss", "eager"):
            call = host.BUILDERS[name](inp)
            call()
            work[name] = host.count_host_work(call)
    assert 4 * work["policy_loss"]["dispatch_ops"] <= work["eager"]["dispatch_ops"], work


def test_eager_yardstick_is_the_same_loss(device):
    """The yardstick computes what the timed policy_loss call computes."""
    inp = host.make_inputs(*host.SHAPE, device=device)
    args = [inp[k] for k in ("targets", "advantages", "old_logprobs", "ref_logprobs", "mask")]
    want = host.eager_grpo_loss(inp["logits"], *args)
    got, _ = fused_rl.policy_loss(
        inp["logits"], inp["targets"], inp["advantages"],
        old_logprobs=inp["old_logprobs"], ref_logprobs=inp["ref_logprobs"], mask=inp["mask"],
        eps_low=host.EPS_LOW, eps_high=host.EPS_HIGH, beta=host.BETA, kl_estimator="k3",
        entropy_coef=host.ENTROPY_COEF, loss_agg="token-mean", backend="reference",
    )  # fmt: skip
    assert_rel(got, want, FP32_TOL, "policy_loss vs eager_grpo_loss")


# the opt-in call options of policy_loss (same call as "policy_loss" above): the budgets of
# the calls without them are unchanged; inplace=True adds its checks, grad_in_forward=True
# the token weights and the normaliser formed before the pass (tests/test_grad_in_forward.py)
OPTION_BUDGET = {
    "inplace": (dict(inplace=True), (115, 17)),
    "grad_in_forward": (dict(grad_in_forward=True), (114, 31)),
    "grad_in_forward_inplace": (dict(grad_in_forward=True, inplace=True), (125, 31)),
}


@pytest.mark.no_poison
@pytest.mark.parametrize("name", list(OPTION_BUDGET))
def test_host_work_of_the_call_options(name, device):
    options, (frames, ops) = OPTION_BUDGET[name]
    inp = host.make_inputs(*host.SHAPE, device=device)
    with host.host_timing(stub=True):
        call = host._policy_loss(inp, **options)
        call()
        work = host.count_host_work(call)
    assert work["py_frames"] <= frames, (name, work)
    assert work["dispatch_ops"] <= ops, (name, work)
