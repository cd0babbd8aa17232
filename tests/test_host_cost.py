"""Issue 10, "a thin wrapper": with the Triton kernels stubbed, the Python cost of a
``policy_loss`` forward+backward must be at most the total CPU time of an eager 10-line GRPO
loss with an entropy bonus (``bench.host.eager_grpo_loss``, real math included) on the same
tiny input, measured as a ratio in one run (medians of interleaved samples)."""

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


@pytest.mark.no_poison  # NaN-filling every torch.empty would bill fused_rl for the fills
def test_policy_loss_host_cost_at_most_eager_grpo_loss(device):
    result = host.measure(("policy_loss", "eager"), device=device, repeat=9, stub=True)
    fused, eager = result["rows"]["policy_loss"], result["rows"]["eager"]
    ratio = fused["us"] / eager["us"]
    print(f"\nhost cost: policy_loss {fused['us']:.0f} us, eager {eager['us']:.0f} us, "
          f"ratio {ratio:.2f}; launches {fused['launches']} vs {eager['launches']}")  # fmt: skip
    assert ratio <= 1.0, (
        f"policy_loss fwd+bwd costs {fused['us']:.0f} us of host time with its kernels stubbed, "
        f"{ratio:.2f}x the eager GRPO loss's {eager['us']:.0f} us ({fused['launches']} "
        f"launches against {eager['launches']})"
    )


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
