"""fused_rl.compat.verl's policy-loss registry, second part (``dppo_tv``, ``dppo_kl``,
``dro``) against a float64 transcription of verl 0.9.1's ``core_algos`` formulas, written
here from the math (DPPO's total-variation / binary-KL trust-region masks by the sign of the
advantage, its truncated detached ratio, DRO's quadratic log-ratio penalty, the rollout IS
weights, verl's ``agg_loss``, the metrics): values, gradients w.r.t. ``log_prob`` under a
random upstream gradient, metrics, config defaults, errors."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, rel_err

from fused_rl.compat import verl

B, T = 4, 7
MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
         "seq-mean-token-sum-norm"]  # fmt: skip

# ----------------------------------------------------------------------------- the oracle


def o_masked_sum(x, m, axis=None):
    return (torch.where(m.bool(), x, 0.0) * m).sum(axis=axis)


def o_masked_mean(x, m):
    return o_masked_sum(x, m) / (m.sum() + 1e-8)


def o_agg(L, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
          loss_scale_factor=None):  # fmt: skip
    """verl 0.9.1's agg_loss."""
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return o_masked_sum(L, m) / n * dp_size
    if mode == "token-sum":
        return o_masked_sum(L, m) * dp_size
    counts = m.sum(-1)
    per_seq = o_masked_sum(L, m, axis=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (counts + 1e-8)
    present = (counts > 0).double()
    g = present.sum() if global_batch_size is None else global_batch_size
    loss = o_masked_sum(per_seq, present) / g * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def o_dppo(kind, old, lp, adv, m, mode, cfg, w):
    ratio_cfg = cfg.get("clip_ratio", 0.2)
    low, high = cfg.get("clip_ratio_low"), cfg.get("clip_ratio_high")
    low, high = (ratio_cfg if low is None else low), (ratio_cfg if high is None else high)
    d = torch.clamp(lp - old, -20.0, 20.0)
    r = torch.exp(d)
    c = cfg.get("clip_ratio_c", 20.0)
    tr = torch.clamp(r, max=c).detach()
    p, q = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - q) <= high, (p - q) >= -low
    else:
        kl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (kl <= high) | (p <= q), (kl <= low) | (p >= q)
    valid = torch.where(adv > 0, pos, neg).detach().double()
    L = -adv * tr * lp * valid
    if w is not None:
        L = L * w
    loss = o_agg(L, m, mode, **cfg.get("global_batch_info", {}))
    metrics = {
        "actor/pg_clipfrac": o_masked_mean(1.0 - valid, m).item(),
        "actor/ppo_kl": o_masked_mean(-d, m).item(),
        "actor/pg_clipfrac_lower": o_masked_mean((r > c).double() * valid, m).item(),
    }
    return loss, metrics


def o_dro(old, lp, adv, m, mode, cfg, w):
    beta = cfg["policy_loss"]["dro_beta"]
    d = lp - old
    L = -(lp * adv - 0.5 * beta * d.square())
    if w is not None:
        L = L * w
    loss = o_agg(L, m, mode, **cfg.get("global_batch_info", {}))
    return loss, {"actor/ppo_kl": o_masked_mean(-d, m).item()}


def oracle(name, old, lp, adv, m, mode, cfg, w):
    if w is not None and w.dim() == 1:
        w = w[:, None]
    args = (old, lp, adv, m, mode, cfg, w)
    if name == "dro":
        return o_dro(*args)
    return o_dppo(name[-2:], *args)


# ----------------------------------------------------------------------------- cases


def make_case(seed=0, dtype=torch.float64, far=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5 - 0.05
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    if far:
        old[0, 1] = lp[0, 1] - 25.0  # log-ratio +25: past the +-20 clamp, r > c
        old[1, 2] = lp[1, 2] + 30.0  # log-ratio -30
        old[3, 0] = lp[3, 0] - 2.0  # r = e^2 > c = 3
        old[3, 3] = lp[3, 3] - 0.9  # r ~ 2.5 < c
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0] = adv[0].abs() + 0.1
    adv[1] = -adv[1].abs() - 0.1
    adv[2, :3] = 0.0  # zero advantages take the negative branch
    adv[2, 3:] = torch.tensor([0.7, -1.2, 0.4, -0.3], dtype=torch.float64)  # per-token
    adv[3, ::2] = adv[3, ::2].abs()
    adv[3, 1::2] = -adv[3, 1::2].abs()
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 5:] = 0.0  # padding
    mask[2, 1] = 0.0  # a hole
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 1.5 + 0.25
    w[1, 5:] = 1e3  # padded weights weigh nothing
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(old), cast(lp), cast(adv), cast(mask), cast(w)


CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 3.0,
          "policy_loss": {"dro_beta": 0.7}, "global_batch_info": {}}  # fmt: skip
NAMES = ["dppo_tv", "dppo_kl", "dro"]


def run_pair(name, case, mode, cfg, with_w=True, seed=1):
    old, lp, adv, mask, w = case
    weights = w if with_w else None
    upstream = torch.randn((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    fn = verl.get_policy_loss_fn(name)
    x = lp.clone().requires_grad_()
    kwargs = {} if mode is None else {"loss_agg_mode": mode}
    loss, metrics = fn(old, x, adv, mask, config=cfg, rollout_is_weights=weights, **kwargs)
    loss.backward(upstream.to(loss.dtype))
    y = lp.double().clone().requires_grad_()
    plain = cfg if isinstance(cfg, dict) else vars(cfg)
    if not isinstance(plain.get("policy_loss", {}), dict):
        plain = {**plain, "policy_loss": vars(plain["policy_loss"])}
    ref_loss, ref_metrics = oracle(
        name, old.double(), y, adv.double(), mask.double(), mode or "token-mean", plain,
        None if weights is None else weights.double(),
    )  # fmt: skip
    ref_loss.backward(upstream)
    return (loss, x.grad, metrics), (ref_loss, y.grad, ref_metrics)


def check(ours, ref, tol):
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = ours, ref
    assert torch.isfinite(loss)
    assert abs(loss.item() - ref_loss.item()) <= tol * max(abs(ref_loss.item()), 1.0), (
        loss.item(),
        ref_loss.item(),
    )
    assert rel_err(grad, ref_grad) <= tol, (grad, ref_grad)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in metrics.items():
        assert isinstance(value, float), key
        assert abs(value - ref_metrics[key]) <= 10 * tol, (key, value, ref_metrics[key])


# ----------------------------------------------------------------------------- values


def test_cases_exercise_both_branches():
    old, lp, adv, mask, _ = make_case(seed=3)
    for kind in ("tv", "kl"):
        _, m = o_dppo(kind, old, lp, adv, mask, "token-mean", CONFIG, None)
        assert 0.0 < m["actor/pg_clipfrac"] < 1.0
        assert m["actor/pg_clipfrac_lower"] > 0.0
    assert (adv > 0).any() and (adv < 0).any() and (adv == 0).any()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("with_w", [True, False])
def test_against_the_oracle(name, mode, with_w):
    case = make_case(seed=3)
    check(*run_pair(name, case, mode, CONFIG, with_w=with_w), F64_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_other_seeds_and_bands(name):
    for seed, band in ((5, (0.05, 0.3)), (8, (0.4, 0.02)), (11, (None, None))):
        cfg = {**CONFIG, "clip_ratio_low": band[0], "clip_ratio_high": band[1]}
        check(*run_pair(name, make_case(seed=seed), "token-mean", cfg, seed=seed), F64_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_global_batch_info(name):
    case = make_case(seed=4)
    for mode, info in (
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 40}),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 6}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 5, "loss_scale_factor": 3.0}),
    ):
        cfg = {**CONFIG, "global_batch_info": info}
        check(*run_pair(name, case, mode, cfg), F64_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_fp32_config_objects_and_weight_shapes(name):
    old, lp, adv, mask, w = make_case(seed=6, dtype=torch.float32, far=False)
    cfg = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.25, clip_ratio_c=3.0,
        policy_loss=SimpleNamespace(dro_beta=0.3), global_batch_info={},
    )  # fmt: skip
    ours, ref = run_pair(name, (old, lp, adv, mask, w), "seq-mean-token-mean", cfg)
    assert ours[0].dtype == torch.float32
    check(ours, ref, FP32_TOL)
    case = make_case(seed=7)
    for shape in ((B, 1), (B,)):
        w2 = case[4][:, :1].reshape(shape)
        ours = run_pair(name, (*case[:4], w2), "token-mean", CONFIG)[0]
        ref = run_pair(name, (*case[:4], case[4][:, :1].expand(B, T)), "token-mean", CONFIG)[1]
        check(ours, ref, F64_TOL)


def test_clip_ratio_c_default_is_verls_get():
    """verl's DPPO reads config.get("clip_ratio_c", 20.0): 20 where the key is absent."""
    case = make_case(seed=9)
    cfg = {k: v for k, v in CONFIG.items() if k != "clip_ratio_c"}
    for name in ("dppo_tv", "dppo_kl"):
        ours, ref = run_pair(name, case, "token-mean", cfg)
        check(ours, ref, F64_TOL)
        with_3 = run_pair(name, case, "token-mean", CONFIG)[0]
        assert ours[2]["actor/pg_clipfrac_lower"] < with_3[2]["actor/pg_clipfrac_lower"]


def test_dppo_truncation_detaches_the_ratio():
    """The gradient is -A sg(min(r, c)) valid / n: no d r / d logp term."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -4.0, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    cfg = {"clip_ratio": 1.0, "clip_ratio_c": 3.0}  # every token valid
    loss, m = verl.compute_policy_loss_dppo_tv(old, lp, adv, torch.ones(1, 3), config=cfg)
    loss.backward()
    r = torch.exp(lp.detach() - old).clamp(max=3.0)
    assert torch.allclose(lp.grad, -adv * r / 3)
    assert m["actor/pg_clipfrac"] == 0.0
    assert abs(m["actor/pg_clipfrac_lower"] - 1 / 3) < 1e-7


def test_dro_penalty_weighted_by_rollout_weights():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    adv = torch.zeros(1, 2, dtype=torch.float64)  # the penalty alone
    w = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    cfg = {"policy_loss": {"dro_beta": 2.0}}
    loss, _ = verl.compute_policy_loss_dro(old, lp, adv, torch.ones(1, 2), config=cfg,
                                           rollout_is_weights=w)  # fmt: skip
    assert abs(loss.item() - (2.0 * 0.25 + 0.5 * 1.0) / 2) < 1e-12
    loss.backward()
    assert torch.allclose(
        lp.grad, torch.tensor([[2.0 * 2.0 * 0.5, 0.5 * 2.0 * -1.0]], dtype=torch.float64) / 2
    )


@pytest.mark.parametrize("name", NAMES)
def test_bool_mask_and_empty_batch(name):
    old, lp, adv, mask, w = make_case(seed=12)
    ours = run_pair(name, (old, lp, adv, mask.bool(), w), "token-mean", CONFIG)[0]
    ref = run_pair(name, (old, lp, adv, mask, w), "token-mean", CONFIG)[1]
    # a bool mask's count is exact in fp32 (verl's masked_mean adds 1e-8 in fp32 there)
    check((*ours[:2], {}), (*ref[:2], {}), F64_TOL)
    for key, value in ours[2].items():
        assert abs(value - ref[2][key]) <= 1e-8, key
    fn = verl.get_policy_loss_fn(name)
    loss, _ = fn(old, lp, adv, torch.zeros(B, T), config=CONFIG)
    assert torch.isnan(loss)  # verl's 0 / 0
    # NaN rollout weights on padding: the loss ignores them (verl's masked_sum), the gradient
    # there is 0 (verl's autograd would give 0 * NaN)
    poisoned = w.clone()
    poisoned[mask == 0] = float("nan")
    ours = run_pair(name, (old, lp, adv, mask, poisoned), "token-mean", CONFIG)[0]
    ref = run_pair(name, (old, lp, adv, mask, w), "token-mean", CONFIG)[1]
    check(ours, ref, F64_TOL)


# ----------------------------------------------------------------------------- registry


def test_registry_and_signatures():
    params = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
              "config", "rollout_is_weights"]  # fmt: skip
    for name in NAMES:
        fn = verl.get_policy_loss_fn(name)
        assert fn is getattr(verl, f"compute_policy_loss_{name}")
        assert fn.__name__ in verl.__all__
        sig = inspect.signature(fn)
        assert list(sig.parameters) == params, name
        assert sig.parameters["loss_agg_mode"].default == "token-mean"
        assert sig.parameters["config"].default is None
        assert sig.parameters["rollout_is_weights"].default is None
        assert "Mirrors" in fn.__doc__
    with pytest.raises(NotImplementedError, match=r"'bypass_mode'.*not built in fused_rl yet"):
        verl.get_policy_loss_fn("bypass_mode")
    assert set(verl.POLICY_LOSS_REGISTRY) == set(verl.VERL_POLICY_LOSSES) - {"bypass_mode"}


def test_errors():
    old, lp, adv, mask, w = make_case(seed=15)
    for name in NAMES:
        fn = verl.get_policy_loss_fn(name)
        with pytest.raises(AssertionError, match="config"):
            fn(old, lp, adv, mask)
        with pytest.raises(TypeError, match="global_batch_info"):
            fn(old, lp, adv, mask, config={**CONFIG, "global_batch_info": {"dp": 2}})
        with pytest.raises(ValueError, match="rollout_is_weights"):
            fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=w[:, :2])
        with pytest.raises(ValueError, match="advantages"):
            fn(old, lp, adv[:, :3], mask, config=CONFIG)
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(old, lp, adv, mask, "mean", CONFIG)
        with pytest.raises(ValueError, match="batch_num_tokens is required"):
            fn(old, lp, adv, mask, config={**CONFIG, "global_batch_info": {"dp_size": 2}})
    bad_configs = [{}, {"policy_loss": {}}]
    bad_configs += [{"policy_loss": {"dro_beta": b}} for b in (None, 0.0, -1.0)]
    for bad in bad_configs:
        with pytest.raises(ValueError, match="dro_beta must be a positive value"):
            verl.compute_policy_loss_dro(old, lp, adv, mask, config=bad)
    with pytest.raises(AssertionError, match="policy_loss"):
        verl.compute_policy_loss_dro(old, lp, adv, mask, config={"policy_loss": None})
    with pytest.raises(ValueError, match="rollout_is_weights"):
        verl.compute_policy_loss_dro(old, lp, adv, mask, config=CONFIG, rollout_is_weights=-w)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        verl.compute_policy_loss_dppo_tv(old, lp, adv, mask, config={"clip_ratio_c": 0.0})
    with pytest.raises(ValueError, match="clip_ratio_low"):
        verl.compute_policy_loss_dppo_kl(old, lp, adv, mask, config={"clip_ratio_low": -0.1})
