"""fused_rl.compat.verl.policy_loss_composed: the registered policy losses that add
token-space terms to fused_rl's op (``clip_cov``, ``kl_cov``, ``geo_mean``, ``dppo_tv``,
``dppo_kl``, ``dro``) against a float64 transcription of verl 0.9.1's ``core_algos`` formulas,
written here from the math (Clip-Cov's random and KL-Cov's top-k covariance selections,
GMPO's log-space clip, DPPO's total-variation / binary-KL trust-region masks by the sign of
the advantage and its truncated detached ratio, DRO's quadratic log-ratio penalty, the
rollout IS weights, verl's ``agg_loss``, the metrics): values, gradients w.r.t. ``log_prob``
under a random upstream gradient, metrics, config defaults, errors."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, rel_err

from fused_rl.compat import verl

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
    per_seq = (L * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (counts + 1e-8)
    present = (counts > 0).float()  # verl: .float()
    g = present.sum() if global_batch_size is None else global_batch_size
    loss = o_masked_sum(per_seq, present) / g * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


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


CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
          "tau_pos": 1.0, "tau_neg": 1.05, "global_batch_info": {}}  # fmt: skip


# ------------------------------------------------------------------- clip_cov, kl_cov, geo_mean
# float64 transcriptions of verl 0.9.1's compute_policy_loss_{clip_cov,kl_cov,geo_mean}


def o_clip_cov(old, lp, adv, m, mode, cfg, w):
    """verl's Clip-Cov; consumes the global CPU RNG (randperm) as verl does."""
    low = cfg.get("clip_ratio_low", 0.2)
    high = cfg.get("clip_ratio_high", 0.2)
    pl = cfg.get("policy_loss", {})
    ratio_c, lb, ub = (pl.get("clip_cov_ratio", 2e-4), pl.get("clip_cov_lb", 1.0),
                       pl.get("clip_cov_ub", 5.0))  # fmt: skip
    d = lp - old
    r = torch.exp(d)
    ppo_kl = o_masked_mean(-d, m).detach()
    L1 = -adv * r
    L2 = -adv * torch.clamp(r, 1 - low, 1 + high)
    corr = torch.ones_like(adv)
    by_origin = (L2 > L1) & (m > 0)
    cov = (adv - o_masked_mean(adv, m)) * (lp - o_masked_mean(lp.detach(), m))
    cov = cov.detach().clone()
    cov[m == 0] = -torch.inf
    cov[by_origin] = -torch.inf
    num = max(int(ratio_c * m.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (m > 0))
    if len(idx) > 0:
        perm = torch.randperm(len(idx))
        idx = idx[perm[: min(num, len(idx))]]
    corr[idx[:, 0], idx[:, 1]] = 0
    L = torch.maximum(L1, L2) * corr
    if w is not None:
        L = L * w
    loss = o_agg(L, m, mode, **cfg.get("global_batch_info", {}))
    return loss, {"actor/pg_clipfrac": float(o_masked_mean((corr == 0).double(), m)),
                  "actor/ppo_kl": float(ppo_kl)}, corr  # fmt: skip


def o_kl_cov(old, lp, adv, m, mode, cfg, w):
    pl = cfg.get("policy_loss", {})
    ratio_k = pl.get("kl_cov_ratio", 2e-4)
    coef = pl.get("ppo_kl_coef", 0.1)
    coef = 1.0 if coef is None else coef
    d = lp - old
    r = torch.exp(d)
    L = -adv * r
    L_kl = -adv * r + coef * d.abs()
    valid = m > 0
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, p = adv[valid].detach().reshape(-1), lp[valid].detach().reshape(-1)
    chosen = torch.zeros(m.numel(), dtype=torch.bool)
    if len(a) > 0:
        cov = (a - a.mean()) * (p - p.mean())
        k = max(1, int(len(cov) * ratio_k))
        chosen[flat[torch.topk(cov, k, largest=True).indices]] = True
    chosen = chosen.reshape(m.shape)
    L = torch.where(chosen, L_kl, L)
    if w is not None:
        L = L * w
    loss = o_agg(L, m, mode, **cfg.get("global_batch_info", {}))
    return loss, {"actor/ppo_kl": float(o_masked_mean(d.abs(), m).detach())}, chosen


def o_geo_mean(old, lp, adv, m, cfg, w):
    low = cfg.get("clip_ratio_low", 0.2)
    high = cfg.get("clip_ratio_high", 0.2)
    d = lp - old
    sgn = torch.sign(adv)
    dc = torch.clamp(d, -low, high)
    dmin = sgn * torch.min(sgn * d, sgn * dc)
    n = m.sum(-1)
    ratio = torch.exp((dmin * m).sum(-1) / (n + 1e-8))
    a = (adv * m).sum(-1) / (n + 1e-8)
    L = -a * ratio
    if w is not None:
        L = L * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    clipped = torch.ne(d, dc)
    return torch.mean(L), {
        "actor/pg_clipfrac": float(o_masked_mean((clipped * (adv > 0)).double(), m)),
        "actor/ppo_kl": float(o_masked_mean(-d, m).detach()),
        "actor/pg_clipfrac_lower": float(o_masked_mean((clipped * (adv < 0)).double(), m)),
    }


GEO_TOL = 1e-8  # the exponent's n_i vs verl's n_i + 1e-8 (relative 1e-8 / n_i)


def make_cov_case(seed, dtype=torch.float64, rows=4, cols=40):
    """Many tokens, per-token advantages of both signs and zeros, padding, an empty row."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4 - 0.05
    old = lp + torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 1.5
    adv[0, :5] = 0.0
    mask = torch.ones(rows, cols, dtype=torch.float64)
    mask[1, 30:] = 0.0
    mask[2, ::7] = 0.0
    mask[3] = 0.0  # an all-masked sequence
    w = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 1.5 + 0.25
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(old), cast(lp), cast(adv), cast(mask), cast(w)


COV_CONFIG = {**CONFIG, "policy_loss": {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.2,
                                        "clip_cov_ub": 3.0, "kl_cov_ratio": 0.05,
                                        "ppo_kl_coef": 0.7}}  # fmt: skip


def run_cov_pair(name, case, mode, cfg, with_w=True, seed=1):
    old, lp, adv, mask, w = case
    weights = w if with_w else None
    upstream = torch.randn((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = lp.clone().requires_grad_()
    kwargs = {} if mode is None else {"loss_agg_mode": mode}
    torch.manual_seed(123)
    loss, metrics = verl.get_policy_loss_fn(name)(old, x, adv, mask, config=cfg,
                                                  rollout_is_weights=weights, **kwargs)  # fmt: skip
    loss.backward(upstream.to(loss.dtype))
    y = lp.double().clone().requires_grad_()
    args = (old.double(), y, adv.double(), mask.double())
    wd = None if weights is None else weights.double()
    torch.manual_seed(123)
    if name == "geo_mean":
        ref_loss, ref_metrics = o_geo_mean(*args, cfg, wd)
    else:
        oracle = o_clip_cov if name == "clip_cov" else o_kl_cov
        ref_loss, ref_metrics, _ = oracle(*args, mode or "token-mean", cfg, wd)
    ref_loss.backward(upstream)
    return (loss, x.grad, metrics), (ref_loss, y.grad, ref_metrics)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("mode", [None, "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_cov_against_the_oracle(name, mode):
    case = make_cov_case(seed=20)
    check(*run_cov_pair(name, case, mode, COV_CONFIG), F64_TOL)
    check(*run_cov_pair(name, case, mode, COV_CONFIG, with_w=False), F64_TOL)


def test_cov_global_batch_info_fp32_and_defaults():
    case = make_cov_case(seed=21)
    cfg = {**COV_CONFIG, "global_batch_info": {"dp_size": 2, "batch_num_tokens": 77}}
    for name in ("clip_cov", "kl_cov"):
        check(*run_cov_pair(name, case, "token-mean", cfg), F64_TOL)
        ours, ref = run_cov_pair(name, make_cov_case(seed=22, dtype=torch.float32), None,
                                 COV_CONFIG)  # fmt: skip
        assert ours[0].dtype == torch.float32
        check(ours, ref, FP32_TOL)
        check(*run_cov_pair(name, case, None, {}), F64_TOL)  # PolicyLossConfig's defaults


def test_clip_cov_selection_is_verls():
    """The same seed picks the same tokens as verl's randperm; they get loss and gradient 0;
    the global RNG is left where verl leaves it."""
    old, lp, adv, mask, _ = make_cov_case(seed=23)
    cfg = {**COV_CONFIG, "clip_ratio": 0.2}
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        _, _, corr = o_clip_cov(old, lp, adv, mask, "token-mean", cfg, None)
        after_ref = torch.rand(())
        assert 1 < int((corr == 0).sum()) <= max(int(0.05 * mask.sum()), 1)
        torch.manual_seed(seed)
        x = lp.clone().requires_grad_()
        loss, metrics = verl.compute_policy_loss_clip_cov(old, x, adv, mask, config=cfg)
        assert torch.rand(()) == after_ref  # one randperm of the same length consumed
        loss.backward()
        assert (x.grad[corr == 0] == 0).all()
        assert metrics["actor/pg_clipfrac"] == pytest.approx(
            float((corr == 0).sum() / (mask.sum() + 1e-8)), rel=1e-12
        )
    torch.manual_seed(0)
    a, _ = verl.compute_policy_loss_clip_cov(old, lp, adv, mask, config=cfg)
    torch.manual_seed(5)
    b, _ = verl.compute_policy_loss_clip_cov(old, lp, adv, mask, config=cfg)
    assert a != b  # a different draw


def test_clip_cov_no_candidate_and_clip_num():
    """No covariance inside (lb, ub): nothing dropped and the RNG is untouched (verl draws
    only with a candidate); clip_num is at least 1."""
    old, lp, adv, mask, _ = make_cov_case(seed=24)
    cfg = {**CONFIG, "policy_loss": {"clip_cov_lb": 1e6, "clip_cov_ub": 1e7}}
    torch.manual_seed(3)
    loss, metrics = verl.compute_policy_loss_clip_cov(old, lp, adv, mask, config=cfg)
    after = torch.rand(())
    torch.manual_seed(3)
    assert torch.rand(()) == after and metrics["actor/pg_clipfrac"] == 0.0
    cfg = {**CONFIG, "policy_loss": {"clip_cov_ratio": 1e-9, "clip_cov_lb": -1e9}}
    torch.manual_seed(3)
    _, metrics = verl.compute_policy_loss_clip_cov(old, lp, adv, mask, config=cfg)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / float(mask.sum()), rel=1e-6)


def test_kl_cov_penalty_and_defaults():
    """The chosen tokens' gradient is -A r + coef sign(d) (sign(0) = 0), the others' -A r;
    ppo_kl_coef None is verl's fallback 1.0, absent the dataclass's 0.1."""
    old, lp, adv, mask, w = make_cov_case(seed=25)
    lp[0, 7] = old[0, 7] = 0.0  # d = 0 at a token made the largest covariance
    adv[0, 7] = 50.0
    for coef in (None, 0.3):
        cfg = {**CONFIG, "policy_loss": {"ppo_kl_coef": coef, "kl_cov_ratio": 0.02}}
        x = lp.clone().requires_grad_()
        loss, metrics = verl.compute_policy_loss_kl_cov(old, x, adv, mask, config=cfg,
                                                        rollout_is_weights=w)  # fmt: skip
        loss.backward()
        y = lp.clone().requires_grad_()
        ref, ref_metrics, chosen = o_kl_cov(old, y, adv, mask, "token-mean",
                                            {**cfg}, w)  # fmt: skip
        ref.backward()
        assert chosen[0, 7] and int(chosen.sum()) == max(1, int(mask.sum() * 0.02))
        assert rel_err(loss, ref) <= F64_TOL and rel_err(x.grad, y.grad) <= F64_TOL
        n = mask.sum()
        expected = -adv[0, 7] * w[0, 7] / n  # sign(0) = 0: no penalty gradient
        assert x.grad[0, 7].item() == pytest.approx(expected.item(), rel=1e-12)
    loss_none, _ = verl.compute_policy_loss_kl_cov(
        old, lp, adv, mask, config={"policy_loss": {"ppo_kl_coef": None}}
    )
    loss_default, _ = verl.compute_policy_loss_kl_cov(old, lp, adv, mask, config={})
    ref_none, _, _ = o_kl_cov(old, lp, adv, mask, "token-mean",
                              {"policy_loss": {"ppo_kl_coef": None}}, None)  # fmt: skip
    ref_default, _, _ = o_kl_cov(old, lp, adv, mask, "token-mean", {}, None)
    assert rel_err(loss_none, ref_none) <= F64_TOL
    assert rel_err(loss_default, ref_default) <= F64_TOL


def test_kl_cov_no_clipping_far_ratios():
    """kl_cov has no clip: ratios far outside any band keep -A r and its gradient."""
    old, lp, adv, mask, _ = make_cov_case(seed=26)
    old[0, 10] = lp[0, 10] - 8.0  # r = e^8
    old[1, 3] = lp[1, 3] + 9.0  # r = e^-9
    adv[0, 10], adv[1, 3] = 1.0, -1.0
    check(*run_cov_pair("kl_cov", (old, lp, adv, mask, None), None, COV_CONFIG, with_w=False),
          F64_TOL)  # fmt: skip


@pytest.mark.parametrize("with_w", [True, False])
def test_geo_mean_against_the_oracle(with_w):
    """Token-level advantages (zeros, both signs), padding, an all-masked sequence counted in
    the mean, the geometric-mean IS weight, loss_agg_mode ignored."""
    case = make_cov_case(seed=30)
    cfg = {**CONFIG, "clip_ratio_low": 0.15, "clip_ratio_high": 0.25}
    for mode in (None, "token-mean", "anything"):
        check(*run_cov_pair("geo_mean", case, mode, cfg, with_w=with_w), GEO_TOL)
    ours, ref = run_cov_pair("geo_mean", make_cov_case(seed=31, dtype=torch.float32), None, cfg)
    assert ours[0].dtype == torch.float32
    check(ours, ref, FP32_TOL)


def test_geo_mean_sequence_advantages_and_frozen_tokens():
    """Sequence-constant advantages (GMPO's case): -mean_i A_i rho_i; a token past its side's
    bound gets no gradient; A > 0 tokens below -low count in pg_clipfrac (verl's metric) but
    keep their gradient."""
    old, lp, adv, mask, w = make_cov_case(seed=32)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=torch.float64)[:, None].expand_as(lp).clone()
    old[0, 3] = lp[0, 3] - 1.0  # A > 0, d = 1 > high: frozen
    old[0, 4] = lp[0, 4] + 1.0  # A > 0, d = -1 < -low: counted by pg_clipfrac, not frozen
    old[1, 2] = lp[1, 2] + 1.0  # A < 0, d < -low: frozen
    x = lp.clone().requires_grad_()
    loss, metrics = verl.compute_policy_loss_geo_mean(old, x, adv, mask, config=CONFIG,
                                                      rollout_is_weights=w[:, :1])  # fmt: skip
    loss.backward()
    assert x.grad[0, 3] == 0 and x.grad[1, 2] == 0 and x.grad[0, 4] != 0
    y = lp.clone().requires_grad_()
    ref, ref_metrics = o_geo_mean(old, y, adv, mask, CONFIG, w[:, :1])
    ref.backward()
    assert rel_err(loss, ref) <= GEO_TOL and rel_err(x.grad, y.grad) <= GEO_TOL
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"])
    assert ref_metrics["actor/pg_clipfrac"] > 0


def test_geo_mean_bool_mask_nan_and_empty_batch():
    old, lp, adv, mask, w = make_cov_case(seed=33)
    poisoned = lp.clone()
    poisoned[mask == 0] = float("nan")
    x = poisoned.clone().requires_grad_()
    loss, _ = verl.compute_policy_loss_geo_mean(old, x, adv, mask.bool(), config=CONFIG,
                                                rollout_is_weights=w)  # fmt: skip
    loss.backward()
    ref, _ = o_geo_mean(old, lp, adv, mask, CONFIG, w)
    assert rel_err(loss, ref) <= GEO_TOL
    assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all()
    zero = torch.zeros_like(mask)  # verl: every L_i = 0, mean 0 (not NaN)
    loss, metrics = verl.compute_policy_loss_geo_mean(old, lp, adv, zero, config=CONFIG)
    assert loss.item() == 0.0 and metrics["actor/ppo_kl"] == 0.0


def test_new_entries_errors_and_signatures():
    import inspect

    old, lp, adv, mask, w = make_cov_case(seed=34)
    for name in ("clip_cov", "kl_cov", "geo_mean"):
        fn = verl.get_policy_loss_fn(name)
        assert fn is getattr(verl, f"compute_policy_loss_{name}")
        sig = inspect.signature(fn)
        assert list(sig.parameters) == ["old_log_prob", "log_prob", "advantages",
                                        "response_mask", "loss_agg_mode", "config",
                                        "rollout_is_weights"]  # fmt: skip
        assert sig.parameters["loss_agg_mode"].default == "token-mean"
        with pytest.raises(AssertionError, match="config"):
            fn(old, lp, adv, mask)
        with pytest.raises(ValueError, match="rollout_is_weights"):
            fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=w[:, :2])
        with pytest.raises(ValueError, match="config.clip_ratio_low"):
            fn(old, lp, adv, mask, config={"clip_ratio_low": -0.1})
    with pytest.raises(AssertionError, match="clip_ratio should be larger than 0"):
        verl.compute_policy_loss_clip_cov(
            old, lp, adv, mask, config={"policy_loss": {"clip_cov_ratio": 0.0}}
        )
    with pytest.raises(AssertionError, match="kl_cov_ratio should be larger than 0"):
        verl.compute_policy_loss_kl_cov(
            old, lp, adv, mask, config={"policy_loss": {"kl_cov_ratio": -1.0}}
        )
    with pytest.raises(AssertionError, match="policy_loss"):
        verl.compute_policy_loss_kl_cov(old, lp, adv, mask, config={"policy_loss": None})
    with pytest.raises(ValueError, match=">= 0 for kl_cov"):
        verl.compute_policy_loss_kl_cov(old, lp, adv, mask, config={}, rollout_is_weights=-w)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        verl.compute_policy_loss_clip_cov(old, lp, adv, mask, "mean", CONFIG)


# ---------------------------------------------------------------------- dppo_tv, dppo_kl, dro
# float64 transcriptions of verl 0.9.1's compute_policy_loss_{dppo_tv,dppo_kl,dro}

B, T = 4, 7
MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
         "seq-mean-token-sum-norm"]  # fmt: skip


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


def o_dppo_dro(name, old, lp, adv, m, mode, cfg, w):
    if w is not None and w.dim() == 1:
        w = w[:, None]
    args = (old, lp, adv, m, mode, cfg, w)
    if name == "dro":
        return o_dro(*args)
    return o_dppo(name[-2:], *args)


def make_dppo_case(seed=0, dtype=torch.float64, far=True):
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


DPPO_CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.15,
               "clip_ratio_c": 3.0, "policy_loss": {"dro_beta": 0.7},
               "global_batch_info": {}}  # fmt: skip
DPPO_NAMES = ["dppo_tv", "dppo_kl", "dro"]


def run_dppo_pair(name, case, mode, cfg, with_w=True, seed=1):
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
    ref_loss, ref_metrics = o_dppo_dro(
        name, old.double(), y, adv.double(), mask.double(), mode or "token-mean", plain,
        None if weights is None else weights.double(),
    )  # fmt: skip
    ref_loss.backward(upstream)
    return (loss, x.grad, metrics), (ref_loss, y.grad, ref_metrics)


# ----------------------------------------------------------------------------- values


def test_dppo_cases_exercise_both_branches():
    old, lp, adv, mask, _ = make_dppo_case(seed=3)
    for kind in ("tv", "kl"):
        _, m = o_dppo(kind, old, lp, adv, mask, "token-mean", DPPO_CONFIG, None)
        assert 0.0 < m["actor/pg_clipfrac"] < 1.0
        assert m["actor/pg_clipfrac_lower"] > 0.0
    assert (adv > 0).any() and (adv < 0).any() and (adv == 0).any()


@pytest.mark.parametrize("name", DPPO_NAMES)
@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("with_w", [True, False])
def test_dppo_dro_against_the_oracle(name, mode, with_w):
    case = make_dppo_case(seed=3)
    check(*run_dppo_pair(name, case, mode, DPPO_CONFIG, with_w=with_w), F64_TOL)


@pytest.mark.parametrize("name", DPPO_NAMES)
def test_dppo_dro_other_seeds_and_bands(name):
    for seed, band in ((5, (0.05, 0.3)), (8, (0.4, 0.02)), (11, (None, None))):
        cfg = {**DPPO_CONFIG, "clip_ratio_low": band[0], "clip_ratio_high": band[1]}
        check(
            *run_dppo_pair(name, make_dppo_case(seed=seed), "token-mean", cfg, seed=seed), F64_TOL
        )


@pytest.mark.parametrize("name", DPPO_NAMES)
def test_dppo_dro_global_batch_info(name):
    case = make_dppo_case(seed=4)
    for mode, info in (
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 40}),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 6}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 5, "loss_scale_factor": 3.0}),
    ):
        cfg = {**DPPO_CONFIG, "global_batch_info": info}
        check(*run_dppo_pair(name, case, mode, cfg), F64_TOL)


@pytest.mark.parametrize("name", DPPO_NAMES)
def test_dppo_dro_fp32_config_objects_and_weight_shapes(name):
    old, lp, adv, mask, w = make_dppo_case(seed=6, dtype=torch.float32, far=False)
    cfg = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.25, clip_ratio_c=3.0,
        policy_loss=SimpleNamespace(dro_beta=0.3), global_batch_info={},
    )  # fmt: skip
    ours, ref = run_dppo_pair(name, (old, lp, adv, mask, w), "seq-mean-token-mean", cfg)
    assert ours[0].dtype == torch.float32
    check(ours, ref, FP32_TOL)
    case = make_dppo_case(seed=7)
    for shape in ((B, 1), (B,)):
        w2 = case[4][:, :1].reshape(shape)
        ours = run_dppo_pair(name, (*case[:4], w2), "token-mean", DPPO_CONFIG)[0]
        ref = run_dppo_pair(
            name, (*case[:4], case[4][:, :1].expand(B, T)), "token-mean", DPPO_CONFIG
        )[1]
        check(ours, ref, F64_TOL)


def test_clip_ratio_c_default_is_verls_get():
    """verl's DPPO reads config.get("clip_ratio_c", 20.0): 20 where the key is absent."""
    case = make_dppo_case(seed=9)
    cfg = {k: v for k, v in DPPO_CONFIG.items() if k != "clip_ratio_c"}
    for name in ("dppo_tv", "dppo_kl"):
        ours, ref = run_dppo_pair(name, case, "token-mean", cfg)
        check(ours, ref, F64_TOL)
        with_3 = run_dppo_pair(name, case, "token-mean", DPPO_CONFIG)[0]
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


@pytest.mark.parametrize("name", DPPO_NAMES)
def test_dppo_dro_bool_mask_and_empty_batch(name):
    old, lp, adv, mask, w = make_dppo_case(seed=12)
    ours = run_dppo_pair(name, (old, lp, adv, mask.bool(), w), "token-mean", DPPO_CONFIG)[0]
    ref = run_dppo_pair(name, (old, lp, adv, mask, w), "token-mean", DPPO_CONFIG)[1]
    # a bool mask's count is exact in fp32 (verl's masked_mean adds 1e-8 in fp32 there)
    check((*ours[:2], {}), (*ref[:2], {}), F64_TOL)
    for key, value in ours[2].items():
        assert abs(value - ref[2][key]) <= 1e-8, key
    fn = verl.get_policy_loss_fn(name)
    loss, _ = fn(old, lp, adv, torch.zeros(B, T), config=DPPO_CONFIG)
    assert torch.isnan(loss)  # verl's 0 / 0
    # NaN rollout weights on padding: the loss ignores them (verl's masked_sum), the gradient
    # there is 0 (verl's autograd would give 0 * NaN)
    poisoned = w.clone()
    poisoned[mask == 0] = float("nan")
    ours = run_dppo_pair(name, (old, lp, adv, mask, poisoned), "token-mean", DPPO_CONFIG)[0]
    ref = run_dppo_pair(name, (old, lp, adv, mask, w), "token-mean", DPPO_CONFIG)[1]
    check(ours, ref, F64_TOL)


# ----------------------------------------------------------------------------- registry


def test_dppo_dro_registry_and_signatures():
    params = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
              "config", "rollout_is_weights"]  # fmt: skip
    for name in DPPO_NAMES:
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


def test_dppo_dro_errors():
    old, lp, adv, mask, w = make_dppo_case(seed=15)
    for name in DPPO_NAMES:
        fn = verl.get_policy_loss_fn(name)
        with pytest.raises(AssertionError, match="config"):
            fn(old, lp, adv, mask)
        with pytest.raises(TypeError, match="global_batch_info"):
            fn(old, lp, adv, mask, config={**DPPO_CONFIG, "global_batch_info": {"dp": 2}})
        with pytest.raises(ValueError, match="rollout_is_weights"):
            fn(old, lp, adv, mask, config=DPPO_CONFIG, rollout_is_weights=w[:, :2])
        with pytest.raises(ValueError, match="advantages"):
            fn(old, lp, adv[:, :3], mask, config=DPPO_CONFIG)
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(old, lp, adv, mask, "mean", DPPO_CONFIG)
        with pytest.raises(ValueError, match="batch_num_tokens is required"):
            fn(old, lp, adv, mask, config={**DPPO_CONFIG, "global_batch_info": {"dp_size": 2}})
    bad_configs = [{}, {"policy_loss": {}}]
    bad_configs += [{"policy_loss": {"dro_beta": b}} for b in (None, 0.0, -1.0)]
    for bad in bad_configs:
        with pytest.raises(ValueError, match="dro_beta must be a positive value"):
            verl.compute_policy_loss_dro(old, lp, adv, mask, config=bad)
    with pytest.raises(AssertionError, match="policy_loss"):
        verl.compute_policy_loss_dro(old, lp, adv, mask, config={"policy_loss": None})
    with pytest.raises(ValueError, match="rollout_is_weights"):
        verl.compute_policy_loss_dro(old, lp, adv, mask, config=DPPO_CONFIG, rollout_is_weights=-w)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        verl.compute_policy_loss_dppo_tv(old, lp, adv, mask, config={"clip_ratio_c": 0.0})
    with pytest.raises(ValueError, match="clip_ratio_low"):
        verl.compute_policy_loss_dppo_kl(old, lp, adv, mask, config={"clip_ratio_low": -0.1})
