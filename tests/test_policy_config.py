"""``fused_rl.PolicyConfig``: one options object, checked once, the kernels' one table.

The public functions keep their keywords (built into a config on the way in); a whole config
passes as ``policy_config=``; the kernels' hyper-parameters and mode lists come from
``kernels/modes.py``, which both sides import."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from fused_rl.kernels import modes

import fused_rl
from fused_rl.nn import LinearPolicyLoss, PolicyLoss
from fused_rl.policy_config import OPTION_NAMES, PolicyConfig

PUBLIC = (fused_rl.policy_loss, fused_rl.policy_loss_from_logprobs, fused_rl.linear_policy_loss)


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_every_option_is_a_keyword_of_every_policy_function(fn):
    params = inspect.signature(fn).parameters
    for name in (*OPTION_NAMES, "policy_config"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    for field in dataclasses.fields(PolicyConfig):
        assert params[field.name].default == field.default, field.name
    assert list(params)[-1] == "backend"


def test_every_option_is_documented_once_on_the_config():
    doc = PolicyConfig.__doc__
    for name in OPTION_NAMES:
        assert name in doc, f"PolicyConfig's docstring does not describe {name}"


def test_modules_take_every_option():
    for name in OPTION_NAMES:
        assert name in PolicyLoss.OPTIONS and name in LinearPolicyLoss.OPTIONS, name


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        (dict(eps_low=-0.1), ValueError, "eps_low"),
        (dict(eps_high=float("nan")), ValueError, "eps_high"),
        (dict(dual_clip=1.0), ValueError, "dual_clip"),
        (dict(delta=1.1, eps_high=0.2), ValueError, "delta"),
        (dict(kl_estimator="k4"), ValueError, "kl_estimator"),
        (dict(surrogate="grpo"), ValueError, "surrogate"),
        (dict(surrogate="gmpo"), ValueError, "gmpo"),
        (dict(loss_agg="mean"), ValueError, "loss_agg"),
        (dict(max_length=0), ValueError, "max_length"),
        (dict(log_ratio_clamp=0.0), ValueError, "log_ratio_clamp"),
        (dict(log_ratio_clamp="20"), TypeError, "log_ratio_clamp"),
        (dict(kl_bias_correction=1), TypeError, "kl_bias_correction"),
        (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile"),
        (dict(entropy_agg="seq-mean-token-mean"), ValueError, "entropy_agg"),
    ],
)
def test_bad_option_names_itself_at_construction(options, error, name):
    with pytest.raises(error, match=name):
        PolicyConfig(**options)
    with pytest.raises(error, match=name):  # the keyword path raises the same, before any work
        fused_rl.policy_loss_from_logprobs(torch.zeros(1, 2), torch.zeros(1), **options)


def test_frozen_and_replace_checks_again():
    cfg = PolicyConfig(eps_high=0.28)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eps_low = 0.1
    assert cfg.replace(beta=0.1).beta == 0.1 and cfg.beta == 0.0
    with pytest.raises(ValueError, match="beta"):
        cfg.replace(beta=float("inf"))


def test_kernel_table_follows_the_shared_order():
    cfg = PolicyConfig(eps_low=0.1, eps_high=0.3, dual_clip=3.0, beta=0.2, entropy_coef=0.01,
                       log_ratio_clamp=20.0)  # fmt: skip
    table = dict(zip(modes.POLICY_PARAMS, cfg.kernel_params, strict=True))
    assert table["eps_low"] == 0.1 and table["eps_high"] == 0.3 and table["dual_clip"] == 3.0
    assert table["delta"] == 0.0 and table["beta"] == 0.2 and table["log_ratio_clamp"] == 20.0
    assert PolicyConfig().kernel_params[modes.POLICY_PARAMS.index("log_ratio_clamp")] == float(
        "inf"
    )
    sapo = PolicyConfig(surrogate="sapo", sapo_tau_pos=0.7, importance_sampling="sequence")
    surrogate, kl_kind, bias_kl, sequence, agg = sapo.kernel_modes
    assert modes.SURROGATES[surrogate] == "sapo" and modes.KL_KINDS[kl_kind] == "k3"
    assert (bias_kl, sequence, modes.LOSS_AGG_MODES[agg]) == (0, 1, "token-mean")
    assert sapo.kernel_params[modes.POLICY_PARAMS.index("sp0")] == 0.7


def test_kernels_name_every_table_entry():
    """Each ``POLICY_PARAMS`` entry has its ``P_*`` position in the token layer, each mode
    list its constants (what keeps the kernels and the Python side in one order)."""
    pytest.importorskip("triton")
    from fused_rl.kernels.policy import finalize, layer2

    for i, name in enumerate(modes.POLICY_PARAMS):
        assert getattr(layer2, f"P_{name.upper()}").value == i, name
    for i, name in enumerate(modes.SURROGATES):
        assert getattr(layer2, f"SURROGATE_{name.upper()}").value == i, name
    for i, name in enumerate(modes.LOSS_AGG_MODES):
        const = "AGG_" + name.upper().replace("-", "_")
        assert getattr(finalize, const).value == i, name


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_policy_config_equals_the_keywords(backend, device):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 23, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, 23, (2, 4), generator=gen).to(device)
    adv, old = torch.randn(2, generator=gen), torch.randn(2, 4, generator=gen) - 3.0
    adv, old = adv.to(device), old.to(device)
    options = dict(eps_high=0.28, loss_agg="seq-mean-token-mean", log_ratio_clamp=0.5)
    a, ma = fused_rl.policy_loss(logits, targets, adv, old_logprobs=old, backend=backend,
                                 **options)  # fmt: skip
    cfg = PolicyConfig(**options)
    b, mb = fused_rl.policy_loss(logits, targets, adv, old_logprobs=old, backend=backend,
                                 policy_config=cfg)  # fmt: skip
    module = PolicyLoss(policy_config=cfg, backend=backend)
    c, _ = module(logits, targets, adv, old_logprobs=old)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert "log_ratio_clamp=0.5" in repr(PolicyLoss(**options))


def test_policy_config_and_options_together_is_an_error():
    cfg = PolicyConfig()
    logp = torch.zeros(1, 2)
    with pytest.raises(TypeError, match="policy_config= and the options"):
        fused_rl.policy_loss_from_logprobs(logp, torch.zeros(1), policy_config=cfg, beta=0.1)
    with pytest.raises(TypeError, match="policy_config must be a fused_rl.PolicyConfig"):
        fused_rl.policy_loss_from_logprobs(logp, torch.zeros(1), policy_config={"beta": 0.1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        fused_rl.policy_loss_from_logprobs(logp, torch.zeros(1), eps=0.2)
    with pytest.raises(TypeError, match="policy_config"):
        PolicyLoss(policy_config=cfg, eps_high=0.3)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_log_ratio_clamp_from_hidden_states(backend, device):
    """The fused-linear loss (one pass per chunk, its own kernel call) honours the clamp as
    the materialised path does."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, 8, generator=gen).to(device).requires_grad_()
    weight = torch.randn(29, 8, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, 29, (2, 5), generator=gen).to(device)
    adv = torch.randn(2, generator=gen).to(device)
    old = (torch.randn(2, 5, generator=gen) * 4.0 - 3.0).to(device)  # log-ratios beyond the clamp
    kw = dict(old_logprobs=old, log_ratio_clamp=1.5, backend=backend)
    loss, metrics = fused_rl.linear_policy_loss(hidden, weight, targets, adv, chunk_tokens=4, **kw)
    grads = torch.autograd.grad(loss, [hidden, weight])
    logits = torch.nn.functional.linear(hidden, weight)
    want, want_metrics = fused_rl.policy_loss(logits, targets, adv, **kw)
    want_grads = torch.autograd.grad(want, [hidden, weight])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["ratio_max"], want_metrics["ratio_max"])
    assert metrics["ratio_max"] <= torch.exp(torch.tensor(1.5)) * (1 + 1e-6)
