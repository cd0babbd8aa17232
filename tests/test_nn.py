"""fused_rl.nn modules: configuration handling and equality with the functional API."""

import pytest
import torch

import fused_rl
from fused_rl.nn import PolicyLoss


def test_policy_loss_module_matches_function():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 19)
    targets = torch.randint(0, 19, (2, 4))
    adv = torch.randn(2)
    old = torch.randn(2, 4) - 3.0
    config = dict(eps_low=0.1, eps_high=0.3, entropy_coef=0.01, loss_agg="seq-mean-token-sum")
    module = PolicyLoss(**config)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_m, metrics_m = module(a, targets, adv, old_logprobs=old)
    loss_f, metrics_f = fused_rl.policy_loss(b, targets, adv, old_logprobs=old, **config)
    loss_m.backward()
    loss_f.backward()
    assert torch.equal(loss_m, loss_f)
    assert torch.equal(a.grad, b.grad)
    assert metrics_m.keys() == metrics_f.keys()
    assert "eps_high=0.3" in repr(module)


def test_policy_loss_module_rejects_unknown_option():
    with pytest.raises(TypeError, match="clip_eps"):
        PolicyLoss(clip_eps=0.2)
    with pytest.raises(TypeError, match="old_logprobs"):
        PolicyLoss(old_logprobs=torch.zeros(1))


def test_policy_loss_module_checks_the_layout_options():
    """``vocab_start`` / ``vocab_size`` are checked at construction, as every call option."""
    with pytest.raises(ValueError, match="vocab_size"):
        PolicyLoss(vocab_size=0)
    with pytest.raises(TypeError, match="vocab_start"):
        PolicyLoss(vocab_start="a")
    with pytest.raises(ValueError, match="need process_group"):
        PolicyLoss(vocab_size=10)
