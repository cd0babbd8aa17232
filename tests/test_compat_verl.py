"""fused_rl.compat.verl against an independent transcription of verl 0.9.1's ``core_algos`` /
``torch_functional`` (loops and all, run in float64), plus what the live check against the
real verl 0.9.1 established (scripts/compat_live/verl/check.py): the numeric examples of the
new aggregation, the straight-through KL kinds' values and gradients, the output dtypes.
``legacy_v05`` against verl v0.5's. The last tests run against an installed verl (the live
check's venv) and skip without it."""

import importlib
import warnings
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import clamp_in, rel_err

from fused_rl import compat
from fused_rl.compat import verl
from fused_rl.compat.verl import legacy_v05

# ----------------------------------------------------------------------------- the oracle


def o_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def o_masked_mean(values, mask, axis=None):
    return o_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def o_masked_var(values, mask, unbiased=True):
    mean = o_masked_mean(values, mask)
    var = o_masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * (n / (n - 1))
    return var


def o_masked_whiten(values, mask, shift_mean=True):
    mean, var = o_masked_mean(values, mask), o_masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def o_agg_loss(loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
               loss_scale_factor=None):  # fmt: skip
    """verl 0.9.1: token sums over the global token count, sequence means over the sequences
    that have a valid token (or ``global_batch_size``), times ``dp_size``."""
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return o_masked_sum(loss_mat, mask) / n * dp_size
    if mode == "token-sum":
        return o_masked_sum(loss_mat, mask) * dp_size
    seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (mask.sum(-1) + 1e-8)
    present = (mask.sum(-1) > 0).float()
    n = present.sum() if global_batch_size is None else global_batch_size
    loss = o_masked_sum(seq, present) / n * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def o_agg_loss_v05(loss_mat, loss_mask, mode):
    if mode == "token-mean":
        return o_masked_mean(loss_mat, loss_mask)
    seq = torch.sum(loss_mat * loss_mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / torch.sum(loss_mask, dim=-1)).mean()
    return seq.sum() / loss_mask.shape[-1]


def o_policy_terms(old, new, adv, mask, cliprange, low, high, c):
    low = cliprange if low is None else low
    high = cliprange if high is None else high
    nkl = clamp_in(new - old, -20.0, 20.0)
    ratio = torch.exp(nkl)
    ppo_kl = o_masked_mean(-nkl, mask)
    l1 = -adv * ratio
    l2 = -adv * clamp_in(ratio, 1 - low, 1 + high)
    c1 = torch.maximum(l1, l2)
    clipfrac = o_masked_mean(torch.gt(l2, l1).float(), mask)
    l3 = -adv * c
    c2 = torch.min(l3, c1)
    lower = o_masked_mean(torch.gt(c1, l3) * (adv < 0).float(), mask)
    return torch.where(adv < 0, c2, c1), clipfrac, ppo_kl, lower


def o_policy_loss(old, new, adv, mask, cliprange, low, high, c, mode, agg=o_agg_loss):
    losses, clipfrac, ppo_kl, lower = o_policy_terms(old, new, adv, mask, cliprange, low, high, c)
    return agg(losses, mask, mode), clipfrac, ppo_kl, lower


def o_value_loss(vpreds, returns, values, mask, c, mode, agg=o_agg_loss, **kw):
    clipped = torch.max(torch.min(vpreds, values + c), values - c)
    v1, v2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * agg(torch.max(v1, v2), mask, mode, **kw)
    return loss, o_masked_mean(torch.gt(v2, v1).float(), mask)


def o_kl_forward(lp, ref, kind):
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref).square()
    kl = clamp_in(ref - lp, -20.0, 20.0)
    return clamp_in(torch.exp(kl) - kl - 1, -10.0, 10.0)


def o_kl_penalty(lp, ref, kind):
    """verl 0.9.1: a "+" kind keeps the base value and takes k2's gradient."""
    if not kind.endswith("+"):
        return o_kl_forward(lp, ref, kind)
    k2 = 0.5 * (lp - ref).square()
    return k2 - k2.detach() + o_kl_forward(lp, ref, kind[:-1]).detach()


def o_gae_raw(rewards, values, mask, gamma, lam):
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        new_gaelam = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = new_gaelam * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    return torch.stack(rev[::-1], dim=1)


def o_gae(rewards, values, mask, gamma, lam):
    adv = o_gae_raw(rewards, values, mask, gamma, lam)
    return o_masked_whiten(adv, mask), adv + values


def o_grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    scores = rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for k, group in id2score.items():
        if len(group) == 1:
            id2mean[k], id2std[k] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[k], id2std[k] = torch.stack(group).mean(), torch.stack(group).std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        out[i] = centred / (id2std[index[i]] + epsilon) if norm else centred
    return out.unsqueeze(-1) * mask


def masks(b, t, gen, kind):
    if kind == "ones":
        return torch.ones(b, t, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    m = (torch.arange(t)[None] < lengths[:, None]).double()
    if kind == "holes":  # multi-turn: observation tokens in the middle
        m[:, 1] = 0.0
        m[:, 0] = 1.0
    return m


def tolerance(dtype, eager_err=0.0):
    if dtype in (torch.float32, torch.float64):
        return 1e-5
    return max(2 * eager_err, 1e-3)


@pytest.fixture(params=["triton", "reference"])
def backend_device(request, monkeypatch, device):
    """The device to run on, with fused_rl's ``auto`` backend picking ``request.param``: the
    reference through CPU tensors while ``TRITON_INTERPRET`` is unset."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "cpu"
    return device


def no_future_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- vocab-sized ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_from_logits(dtype, backend_device):
    device = backend_device
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 6, 37, generator=gen, dtype=torch.float64) * 2
    logits = full.to(device, dtype)[:, :-1].detach().requires_grad_()  # a strided slice
    labels = torch.randint(0, 37, (3, 5), generator=gen).to(device)
    z64 = logits.detach().double().requires_grad_()
    eager_leaf = logits.detach().clone().requires_grad_()
    up1, up2 = (torch.randn(3, 5, generator=gen, dtype=torch.float64).to(device) for _ in "ab")

    def oracle(z):
        lp = F.log_softmax(z, dim=-1).gather(-1, labels[..., None])[..., 0]
        ent = torch.logsumexp(z, -1) - (F.softmax(z, -1) * z).sum(-1)
        return lp, ent

    got = (verl.logprobs_from_logits(logits, labels), verl.entropy_from_logits(logits))
    want, eager = oracle(z64), oracle(eager_leaf)
    for g, w, e in zip(got, want, eager):
        assert g.dtype == dtype and rel_err(g, w) <= tolerance(dtype, rel_err(e, w))
    for outs, cast in ((got, dtype), (want, torch.float64), (eager, dtype)):
        (outs[0] * up1.to(cast) + outs[1] * up2.to(cast)).sum().backward()
    tol = tolerance(dtype, rel_err(eager_leaf.grad, z64.grad))
    assert rel_err(logits.grad, z64.grad) <= tol

    mask = masks(3, 5, gen, "padded").to(device)
    mask[1] = 0.0  # an empty sequence: verl 0.9 leaves it out of the seq-mean
    for mode in verl.LOSS_AGG_MODES:
        ent_loss = verl.compute_entropy_loss(logits, mask, mode)
        want_loss = o_agg_loss(want[1], mask, mode)
        assert ent_loss.dtype == o_agg_loss(eager[1], mask, mode).dtype
        assert rel_err(ent_loss, want_loss) <= tolerance(dtype, 2e-3)
    with pytest.raises(ValueError, match="labels"):
        verl.logprobs_from_logits(logits, torch.full_like(labels, -100))


def test_vocab_ops_original_half_precision_is_verls_torch_path():
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 4, 19, generator=gen) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 19, (2, 4), generator=gen)
    ref_leaf = logits.detach().clone().requires_grad_()
    with compat.half_precision("original"):
        lp, ent = verl.logprobs_from_logits(logits, labels), verl.entropy_from_logits(logits)
    # verl's logprobs_from_logits_v2 for bf16: a log-softmax per leading row, in bf16
    want_lp = torch.stack(
        [F.log_softmax(z, -1).gather(-1, y[:, None])[:, 0] for z, y in zip(ref_leaf, labels)]
    )
    probs = F.softmax(ref_leaf, -1)  # before the logsumexp, as verl: it fixes the backward's
    want_ent = torch.logsumexp(ref_leaf, -1) - (probs * ref_leaf).sum(-1)  # summation order
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    up = torch.randn(2, 4, generator=gen).bfloat16()
    for got, want in ((lp, want_lp), (ent, want_ent)):
        logits.grad = ref_leaf.grad = None
        got.backward(up)
        want.backward(up)
        assert torch.equal(logits.grad, ref_leaf.grad)


# ----------------------------------------------------------------------------- torch_functional


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_masked_sum_and_mean(mask_dtype, axis, device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=gen).to(device)
    m = masks(4, 6, gen, "padded").to(device, mask_dtype)
    x = torch.where(m.bool(), x, torch.full_like(x, float("nan")))  # NaN outside the mask
    for fn, oracle in ((verl.masked_sum, o_masked_sum), (verl.masked_mean, o_masked_mean)):
        got, want = fn(x, m, axis), oracle(x.double(), m.double(), axis)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-6
    empty = torch.zeros_like(m)
    assert verl.masked_mean(x, empty).item() == 0.0  # the + 1e-8: 0, not NaN


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_var_and_whiten(shift_mean, device):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 7, generator=gen) * 3 + 1).to(device)
    m = masks(3, 7, gen, "padded").to(device)
    for unbiased in (True, False):
        assert rel_err(verl.masked_var(x, m, unbiased),
                       o_masked_var(x.double(), m.double(), unbiased)) <= 1e-6  # fmt: skip
    got = verl.masked_whiten(x, m, shift_mean=shift_mean)
    assert rel_err(got, o_masked_whiten(x.double(), m.double(), shift_mean)) <= 1e-5
    if shift_mean:  # verl's default: zero masked mean (the opposite of torchtune's whiten)
        assert abs(o_masked_mean(got.double(), m.double()).item()) < 1e-5
    with pytest.raises(ValueError, match="At least one"):
        verl.masked_var(x, torch.zeros_like(m))
    one = torch.zeros_like(m)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="sum of the mask is one"):
        verl.masked_whiten(x, one)


def test_half_precision_modes_of_the_pytorch_functions():
    """bf16: "accurate" computes in fp32 and rounds each output once to verl's dtype;
    "original" is verl's bf16 op sequence, bit for bit."""
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(4, 9, generator=gen) * 5 + 3).bfloat16()
    m = masks(4, 9, gen, "padded")
    for mask in (m, m.long()):
        for fn, oracle in (
            (verl.masked_mean, o_masked_mean),
            (verl.masked_whiten, o_masked_whiten),
            (lambda a, b: verl.agg_loss(a, b, "seq-mean-token-mean"),
             lambda a, b: o_agg_loss(a, b, "seq-mean-token-mean")),
        ):  # fmt: skip
            eager = oracle(x, mask)  # verl's op sequence in bf16
            exact = oracle(x.double(), mask.double())
            got = fn(x, mask)
            assert got.dtype == eager.dtype  # fp32 with the fp32 mask, bf16 with the int one
            assert rel_err(got, exact) <= max(rel_err(eager, exact), 2.0**-8)
            with compat.half_precision("original"):
                assert torch.equal(fn(x, mask), eager)


# ----------------------------------------------------------------------------- aggregation

MODES = list(verl.LOSS_AGG_MODES)
AGG_KWARGS = [
    {},
    {"dp_size": 2, "batch_num_tokens": 17, "global_batch_size": 6},
    {"batch_num_tokens": torch.tensor(9.0), "global_batch_size": 3, "loss_scale_factor": 64},
    {"loss_scale_factor": 2.5},
]


def test_agg_loss_numbers_from_the_live_check():
    """verl 0.9.1's values on the issue's examples (v0.5 gave 1.5, NaN and 9.0)."""
    x = torch.arange(1.0, 9.0).reshape(2, 4)
    one_row = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert verl.agg_loss(x, one_row, "seq-mean-token-sum").item() == 3.0
    assert verl.agg_loss(x, one_row, "seq-mean-token-mean").item() == 1.5
    assert verl.agg_loss(x, torch.ones(2, 4), "seq-mean-token-sum-norm").item() == 4.5
    assert verl.agg_loss(x, one_row, "token-sum").item() == 3.0
    assert torch.isnan(verl.agg_loss(x, torch.zeros(2, 4), "token-mean"))  # no + 1e-8
    assert torch.isnan(verl.agg_loss(x, torch.zeros(2, 4), "seq-mean-token-sum"))
    assert legacy_v05.agg_loss(x, one_row, "seq-mean-token-sum").item() == 1.5
    assert torch.isnan(legacy_v05.agg_loss(x, one_row, "seq-mean-token-mean"))
    assert legacy_v05.agg_loss(x, torch.ones(2, 4), "seq-mean-token-sum-norm").item() == 9.0
    assert legacy_v05.agg_loss(x, torch.zeros(2, 4), "token-mean").item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", AGG_KWARGS, ids=["default", "dp2", "tensor-count", "scale"])
def test_agg_loss(mode, kw, device):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(device)
    m = masks(4, 5, gen, "padded").to(device)
    m[2] = 0.0  # an empty sequence
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    leaf = loss.float().requires_grad_()
    got = verl.agg_loss(leaf, m.float(), mode, **kw)
    want_leaf = loss.clone().requires_grad_()
    want = o_agg_loss(want_leaf, m, mode, **kw)
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-6
    got.backward()
    want.backward()
    assert rel_err(leaf.grad, want_leaf.grad) <= 1e-6
    assert rel_err(verl.agg_loss(loss, m, mode, **kw), want) <= 1e-12
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        verl.agg_loss(loss, m, "token-mean-sum")


def test_agg_loss_global_batch_arguments():
    gen = torch.Generator().manual_seed(13)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    m = masks(8, 6, gen, "padded")
    tokens, seqs = int(m.sum()), 8
    for mode in MODES:  # micro-batches summed = the whole batch, given the global counts
        whole = verl.agg_loss(loss, m, mode, batch_num_tokens=tokens, global_batch_size=seqs)
        parts = sum(
            verl.agg_loss(loss[i : i + 2], m[i : i + 2], mode, batch_num_tokens=tokens,
                          global_batch_size=seqs)
            for i in range(0, 8, 2)
        )  # fmt: skip
        assert rel_err(parts, whole) <= 1e-12
        ranks = [  # dp_size ranks; FSDP averages their gradients
            verl.agg_loss(loss[i : i + 4], m[i : i + 4], mode, dp_size=2,
                          batch_num_tokens=tokens, global_batch_size=seqs)
            for i in (0, 4)
        ]  # fmt: skip
        assert rel_err(torch.stack(ranks).mean(), whole) <= 1e-12
    norm = verl.agg_loss(loss, m, "seq-mean-token-sum-norm", loss_scale_factor=3)
    assert rel_err(norm * 3 / 6, verl.agg_loss(loss, m, "seq-mean-token-sum-norm")) <= 1e-12
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        verl.agg_loss(loss, m, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size is required"):
        verl.agg_loss(loss, m, "seq-mean-token-mean", dp_size=2)
    assert verl.agg_loss(loss, m, "token-sum", dp_size=4).item() == pytest.approx(
        4 * o_masked_sum(loss, m).item(), rel=1e-12
    )


@pytest.mark.parametrize("mode", list(legacy_v05.LOSS_AGG_MODES))
def test_legacy_v05_agg_loss(mode):
    gen = torch.Generator().manual_seed(14)
    loss = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    m = masks(4, 5, gen, "padded")
    assert rel_err(legacy_v05.agg_loss(loss, m, mode), o_agg_loss_v05(loss, m, mode)) <= 1e-12
    m[2] = 0.0
    got = legacy_v05.agg_loss(loss, m, mode)
    if mode == "seq-mean-token-mean":
        assert torch.isnan(got)  # an empty sequence: 0 / 0, as in v0.5
    else:
        assert rel_err(got, o_agg_loss_v05(loss, m, mode)) <= 1e-12
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        legacy_v05.agg_loss(loss, m, "token-sum")


def test_legacy_v05_is_importable_as_a_module():
    module = importlib.import_module("fused_rl.compat.verl.legacy_v05")
    assert module is legacy_v05 and module.masked_whiten is verl.masked_whiten
    from fused_rl.compat.verl.legacy_v05 import compute_value_loss  # noqa: F401

    with pytest.raises(NotImplementedError, match="k3\\+"):
        legacy_v05.kl_penalty(torch.zeros(2), torch.zeros(2), "k3+")


# ----------------------------------------------------------------------------- policy / value

CLIPS = [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 1.5), (None, 0.2, 0.3, 3.0)]


def _policy_inputs(gen):
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64) - 2
    new = old + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.8
    new[0, 0], new[0, 1] = old[0, 0] + 30.0, old[0, 1] - 30.0  # the +-20 log-ratio clamp
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    m = masks(4, 6, gen, "padded")
    m[:, 0] = 1.0
    return old, new, adv, m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", CLIPS)
def test_compute_policy_loss(mode, clip, device):
    cliprange, low, high, c = clip
    old, new, adv, m = _policy_inputs(torch.Generator().manual_seed(4))
    lp = new.float().to(device).requires_grad_()
    with pytest.warns(FutureWarning, match="compute_policy_loss_vanilla"):
        got = verl.compute_policy_loss(old.float().to(device), lp, adv.float().to(device),
                                       m.to(device), cliprange, low, high, c, mode)  # fmt: skip
    lp64 = lp.detach().double().requires_grad_()
    want = o_policy_loss(old.to(device), lp64, adv.to(device), m.to(device), cliprange, low,
                         high, c, mode)  # fmt: skip
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5
    assert want[3].item() > 0 and want[1].item() > 0  # both clips are exercised
    got[0].backward()
    want[0].backward()
    assert rel_err(lp.grad, lp64.grad) <= 1e-5
    with pytest.raises(AssertionError):
        no_future_warning(verl.compute_policy_loss, old, new, adv, m, 0.2, clip_ratio_c=1.0)
    if mode in legacy_v05.LOSS_AGG_MODES:
        legacy = legacy_v05.compute_policy_loss(old, new, adv, m, cliprange, low, high, c, mode)
        want = o_policy_loss(old, new, adv, m, cliprange, low, high, c, mode, agg=o_agg_loss_v05)
        assert all(rel_err(g, w) <= 1e-12 for g, w in zip(legacy, want))


@pytest.mark.parametrize("config_kind", ["object", "dict"])
def test_compute_policy_loss_vanilla(config_kind):
    old, new, adv, m = _policy_inputs(torch.Generator().manual_seed(15))
    weights = torch.rand(4, 6, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    info = {"dp_size": 2, "batch_num_tokens": 30, "global_batch_size": 5}
    fields = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28,
              "clip_ratio_c": 2.0, "global_batch_info": info}  # fmt: skip
    config = SimpleNamespace(**fields) if config_kind == "object" else fields
    for mode in MODES:
        lp = new.clone().requires_grad_()
        loss, metrics = verl.compute_policy_loss_vanilla(old, lp, adv, m, mode, config, weights)
        lp64 = new.clone().requires_grad_()
        losses, clipfrac, ppo_kl, lower = o_policy_terms(old, lp64, adv, m, 0.2, None, 0.28, 2.0)
        want = o_agg_loss(losses * weights, m, mode, **fields["global_batch_info"])
        assert rel_err(loss, want) <= 1e-12
        assert metrics == pytest.approx({"actor/pg_clipfrac": clipfrac.item(),
                                         "actor/ppo_kl": ppo_kl.item(),
                                         "actor/pg_clipfrac_lower": lower.item()})  # fmt: skip
        loss.backward()
        want.backward()
        assert rel_err(lp.grad, lp64.grad) <= 1e-12
    with pytest.raises(AssertionError, match="config"):
        verl.compute_policy_loss_vanilla(old, new, adv, m)
    with pytest.raises(TypeError, match="global_batch_info"):
        verl.compute_policy_loss_vanilla(
            old, new, adv, m, config={**fields, "global_batch_info": {"dp": 2}}
        )


@pytest.mark.parametrize("mode", MODES)
def test_compute_value_loss(mode, device):
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    vpreds = values + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.5
    returns = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    m = masks(3, 5, gen, "padded")
    m[1] = 0.0
    for kw in AGG_KWARGS:
        v = vpreds.float().to(device).requires_grad_()
        got = verl.compute_value_loss(v, returns.float().to(device), values.float().to(device),
                                      m.to(device), 0.2, mode, **kw)  # fmt: skip
        v64 = v.detach().double().cpu().requires_grad_()  # the oracle's inputs are on the CPU
        want = o_value_loss(v64, returns, values, m, 0.2, mode, **kw)
        assert all(rel_err(g, w) <= 1e-5 for g, w in zip(got, want))
        got[0].backward()
        want[0].backward()
        assert rel_err(v.grad, v64.grad) <= 1e-5
    if mode in legacy_v05.LOSS_AGG_MODES:
        legacy = legacy_v05.compute_value_loss(vpreds, returns, values, m, 0.2, mode)
        want = o_value_loss(vpreds, returns, values, m, 0.2, mode, agg=o_agg_loss_v05)
        for g, w in zip(legacy, want):  # v0.5's seq-mean-token-mean: NaN for the empty row
            assert (g.isnan() and w.isnan()) or rel_err(g, w) <= 1e-12


# ----------------------------------------------------------------------------- KL

KL_KINDS = list(verl.KL_PENALTIES)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_penalty(kind, backend_device):
    device = backend_device
    gen = torch.Generator().manual_seed(6)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64) - 2
    ref = lp + torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ref[0, 0] = lp[0, 0] + 25.0  # beyond low_var_kl's clamps
    up = torch.randn(3, 4, generator=gen, dtype=torch.float64).to(device)
    for dtype in (torch.float32, torch.float64):
        a = lp.to(device, dtype).requires_grad_()
        b = ref.to(device, dtype).requires_grad_()
        got = verl.kl_penalty(a, b, kind)
        a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
        want = o_kl_penalty(a64, b64, kind)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert got.dtype == dtype and rel_err(got, want) <= tol
        got.backward(up.to(dtype))
        want.backward(up)
        assert rel_err(a.grad, a64.grad) <= tol and rel_err(b.grad, b64.grad) <= tol
        if kind.endswith("+"):  # straight through: the base value, k2's gradient d / -d
            base = verl.kl_penalty(a.detach(), b.detach(), kind[:-1])
            assert torch.equal(got.detach(), base)
            d = (a - b).detach().double()
            assert rel_err(a.grad, up * d) <= tol and rel_err(b.grad, -up * d) <= tol
    for bad in ("full", "full+", "k4", "k4+"):
        with pytest.raises(NotImplementedError, match="kl_penalty"):
            verl.kl_penalty(a, b, bad)


def test_kl_penalty_numbers_from_the_live_check():
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, 30.0], requires_grad=True)
    kl = verl.kl_penalty(lp, ref, "k3+")
    kl.backward(torch.tensor([1.0, 2.0, 3.0]))
    d = torch.tensor([0.5, -1.0, -33.0])
    want = torch.clamp(torch.exp(-d) + d - 1, max=10.0)  # the clamps hold the value ...
    assert torch.allclose(kl, want) and kl[2].item() == 10.0
    assert torch.equal(lp.grad, d * torch.tensor([1.0, 2.0, 3.0]))  # ... not the gradient
    assert torch.equal(ref.grad, -lp.grad)
    k2p = verl.kl_penalty(lp, ref.detach(), "k2+")
    assert torch.equal(k2p, verl.kl_penalty(lp, ref.detach(), "mse"))
    assert torch.isnan(verl.kl_penalty(torch.tensor([-float("inf")]), torch.zeros(1), "k1+"))
    assert verl.kl_penalty_forward(lp, ref, "k3").dtype == torch.float32
    with pytest.raises(NotImplementedError):
        verl.kl_penalty_forward(lp, ref, "k3+")  # the forward takes the base names only


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl", "mse"])
def test_kl_penalty_dtypes_and_broadcasting(kind):
    gen = torch.Generator().manual_seed(17)
    lp = (torch.randn(2, 5, generator=gen) - 1).bfloat16().requires_grad_()
    ref32 = torch.randn(2, 1, generator=gen) - 1
    got = verl.kl_penalty(lp, ref32, kind)  # (2, 1) broadcasts; bf16 with fp32 gives fp32
    want = o_kl_penalty(lp.detach().double(), ref32.double(), kind)
    assert got.dtype == torch.float32 and got.shape == (2, 5)
    assert rel_err(got, want) <= 1e-5
    half = verl.kl_penalty(lp, lp.detach().roll(1, -1), kind)
    assert half.dtype == torch.bfloat16
    with compat.half_precision("original"):  # verl's bf16 arithmetic, bit for bit
        a = lp.detach().clone().requires_grad_()
        b = lp.detach().roll(1, -1)
        ours = verl.kl_penalty(a, b, kind)
        a2 = lp.detach().clone().requires_grad_()
        theirs = o_kl_penalty(a2, b, kind)
        assert torch.equal(ours, theirs)
        up = torch.randn(2, 5, generator=gen).bfloat16()
        ours.backward(up)
        theirs.backward(up)
        assert torch.equal(a.grad, a2.grad)


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("mask_kind", ["ones", "padded", "holes"])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (1.1, 0.9)])
def test_compute_gae_advantage_return(mask_kind, gamma, lam, backend_device):
    device = backend_device
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    m = masks(4, 9, gen, mask_kind).float()
    m[0] = 1.0
    m[1, 3:] = 0.0
    adv, ret = verl.compute_gae_advantage_return(rewards.float().to(device),
                                                 values.float().to(device),
                                                 m.to(device), gamma, lam)  # fmt: skip
    want_adv, want_ret = o_gae(rewards, values, m, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32
    assert rel_err(ret, want_ret) <= 1e-5 and rel_err(adv, want_adv) <= 1e-5
    adv64, ret64 = verl.compute_gae_advantage_return(rewards.to(device), values.to(device),
                                                     m.to(device), gamma, lam)  # fmt: skip
    assert rel_err(adv64, want_adv) <= 1e-12 and rel_err(ret64, want_ret) <= 1e-12


def test_gae_dtypes_from_the_live_check():
    """verl's dtype: the promotion of rewards, values and a floating mask (its x * mask)."""
    gen = torch.Generator().manual_seed(18)
    r, v = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    m = masks(3, 7, gen, "holes").float()
    bf = r.bfloat16(), v.bfloat16()
    cases = [
        (bf, m, torch.float32),  # bf16 rewards / values, fp32 mask: fp32 (fused_rl gave bf16)
        (bf, m.long(), torch.bfloat16),
        (bf, m.bool(), torch.bfloat16),  # verl raises on bool; the adapter accepts it
        ((r, v), m.double(), torch.float64),
        ((r.bfloat16(), v), m.long(), torch.float32),
    ]
    for (rr, vv), mask, dtype in cases:
        adv, ret = verl.compute_gae_advantage_return(rr, vv, mask, 0.9, 0.95)
        assert adv.dtype == ret.dtype == dtype, (rr.dtype, vv.dtype, mask.dtype)
        want_adv, want_ret = o_gae(rr.double(), vv.double(), mask.double(), 0.9, 0.95)
        tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
        assert rel_err(adv, want_adv) <= tol and rel_err(ret, want_ret) <= tol
    # a bool mask gives what the same 0/1 float mask gives
    as_bool = verl.compute_gae_advantage_return(r, v, m.bool(), 0.9, 0.95)
    as_float = verl.compute_gae_advantage_return(r, v, m, 0.9, 0.95)
    assert all(torch.equal(a, b) for a, b in zip(as_bool, as_float))
    # 0-dim tensor gamma / lam, as verl annotates them: their (fp32) values
    gamma, lam = torch.tensor(0.9), torch.tensor(0.95)
    tensors = verl.compute_gae_advantage_return(r, v, m, gamma, lam)
    floats = verl.compute_gae_advantage_return(r, v, m, gamma.item(), lam.item())
    assert all(torch.equal(a, b) for a, b in zip(tensors, floats))
    # original mode: verl's bf16 loop, bit for bit
    with compat.half_precision("original"):
        got = verl.compute_gae_advantage_return(*bf, m.long(), 0.9, 0.95)
    raw = o_gae_raw(*bf, m.long(), 0.9, 0.95)
    assert torch.equal(got[0], o_masked_whiten(raw, m.long())) and torch.equal(got[1], raw + bf[1])


def test_gae_masked_positions_never_matter():
    gen = torch.Generator().manual_seed(19)
    r, v = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    m = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0]]).float()
    adv, ret = verl.compute_gae_advantage_return(r, v, m, 0.99, 0.9)
    poisoned = torch.where(m.bool(), v, float("nan"))
    adv2, ret2 = verl.compute_gae_advantage_return(torch.where(m.bool(), r, 1e30), poisoned, m,
                                                   0.99, 0.9)  # fmt: skip
    assert torch.equal(adv, adv2)  # verl's x * 0 would spread the NaN to every earlier step
    assert torch.equal(ret[m.bool()], ret2[m.bool()])


@pytest.mark.parametrize("norm", [True, False])
def test_compute_grpo_outcome_advantage(norm, device):
    gen = torch.Generator().manual_seed(8)
    rewards = torch.zeros(7, 4, dtype=torch.float64)
    rewards[:, -1] = torch.randint(0, 3, (7,), generator=gen).double()
    rewards[5, -1] = rewards[6, -1] = 1.0  # a constant group
    index = np.array(["b", "a", "b", "c", "a", "d", "d"], dtype=object)  # "c": a group of one
    m = masks(7, 4, gen, "padded")
    adv, ret = verl.compute_grpo_outcome_advantage(
        rewards.float().to(device), m.to(device), index, norm_adv_by_std_in_grpo=norm
    )
    want = o_grpo(rewards, m, index, norm=norm)
    assert adv is ret and rel_err(adv, want) <= 1e-5
    ids = [1, 0, 1, 2, 0, 3, 3]  # a tensor index works too (grouped by value)
    as_tensor = verl.compute_grpo_outcome_advantage(rewards, m, torch.tensor(ids))[0]
    assert rel_err(as_tensor, o_grpo(rewards, m, ids)) <= 1e-12
    # a group of one divides by 1 + eps rounded to fp32, as verl's torch.tensor(1.0) + eps
    assert as_tensor[3, 0].item() == rewards[3].sum().item() / (torch.tensor(1.0) + 1e-6).item()


def test_grpo_dtypes_from_the_live_check():
    gen = torch.Generator().manual_seed(20)
    r = torch.randn(6, 3, generator=gen)
    index = np.array([0, 0, 1, 1, 1, 2])
    m = masks(6, 3, gen, "padded").float()
    for rewards, mask, dtype in [
        (r.bfloat16(), m, torch.float32),  # bf16 scores times an fp32 mask
        (r.bfloat16(), m.bool(), torch.bfloat16),
        (r, m.long(), torch.float32),
        (r.double(), m, torch.float64),
    ]:
        adv, _ = verl.compute_grpo_outcome_advantage(rewards, mask, index)
        assert adv.dtype == dtype
        exact = o_grpo(rewards.double(), mask.double(), index)
        eager = o_grpo(rewards, mask, index)  # verl's op sequence in the inputs' dtypes
        assert rel_err(adv, exact) <= max(rel_err(eager, exact), 1e-6)
        with compat.half_precision("original"):
            assert torch.equal(verl.compute_grpo_outcome_advantage(rewards, mask, index)[0],
                               eager) or rewards.dtype != torch.bfloat16  # fmt: skip


# ----------------------------------------------------------------------------- the package

# Every public name fused_rl.compat.verl had as one module (its __all__, and the v0.5 modes);
# the names it only imported (torch, F, Tensor, V, sys, ...) were never its API.
PUBLIC_NAMES = [
    "FusedLinearForPPO", "KL_PENALTIES", "LINEAR_CE_REDUCTIONS", "LOSS_AGG_MODES",
    "LOSS_AGG_MODES_V05", "POLICY_LOSS_REGISTRY", "VERL_POLICY_LOSSES", "agg_loss",
    "clip_by_value", "compute_entropy_loss", "compute_forward_kl_topk",
    "compute_forward_kl_topk_megatron",
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov", "compute_policy_loss_dppo_kl", "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro", "compute_policy_loss_geo_mean", "compute_policy_loss_gpg",
    "compute_policy_loss_gspo", "compute_policy_loss_kl_cov", "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla", "compute_value_loss", "entropy_from_logits",
    "get_policy_loss_fn", "kl_penalty", "kl_penalty_forward", "legacy_v05", "linear_cross_entropy",
    "logprobs_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "register_policy_loss",
]  # fmt: skip
LEGACY_V05_NAMES = [
    "LOSS_AGG_MODES", "agg_loss", "clip_by_value", "compute_entropy_loss",
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_policy_loss",
    "compute_value_loss", "entropy_from_logits", "kl_penalty", "logprobs_from_logits",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten",
]  # fmt: skip
# the fused_rl.compat.verl import paths README.md, docs/, tests/, scripts/ and bench/ use
IMPORT_PATHS = [
    "fused_rl.compat.verl",
    "fused_rl.compat.verl.FusedLinearForPPO",
    "fused_rl.compat.verl.get_policy_loss_fn",
    "fused_rl.compat.verl.legacy_v05",
    "fused_rl.compat.verl.legacy_v05.compute_value_loss",
    "fused_rl.compat.verl.linear_cross_entropy",
]
# verl's modules (``verl.utils.<path>`` flattened where a function has the module's name)
SUBMODULES = [
    "core_algos",
    "distillation",
    "experimental_torch_functional",
    "kernel_linear_cross_entropy",
    "legacy_v05",
    "policy_loss",
    "policy_loss_composed",
    "torch_functional",
]
PRIVATE_SUBMODULES = ["_accurate", "_policy_loss_common", "_precision_twins"]


def _resolve(path: str):
    """``path``'s object: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def test_every_public_name_resolves():
    """``from fused_rl.compat.verl import X`` for every name the single module had, each the
    object its submodule defines (re-exported, not copied)."""
    for name in PUBLIC_NAMES:
        obj = getattr(importlib.import_module("fused_rl.compat.verl"), name)
        home = getattr(obj, "__module__", None)
        if home is not None and name != "legacy_v05":
            assert home.startswith("fused_rl.compat.verl."), name
            assert getattr(importlib.import_module(home), name) is obj, name
    assert sorted(verl.__all__) == sorted(set(PUBLIC_NAMES) - {"LOSS_AGG_MODES_V05"})
    for name in LEGACY_V05_NAMES:
        assert hasattr(legacy_v05, name), name
    assert sorted(legacy_v05.__all__) == sorted(LEGACY_V05_NAMES)
    assert legacy_v05.LOSS_AGG_MODES is verl.LOSS_AGG_MODES_V05
    submodule_names = {
        n
        for m in SUBMODULES
        if m != "legacy_v05"
        for n in importlib.import_module(f"fused_rl.compat.verl.{m}").__all__
    }
    assert submodule_names == set(verl.__all__) - {"legacy_v05"}  # fmt: skip


@pytest.mark.parametrize("path", IMPORT_PATHS)
def test_documented_import_paths_resolve(path):
    obj = _resolve(path)
    if path.endswith(".linear_cross_entropy"):  # the function, as before the split (its
        assert obj is verl.linear_cross_entropy and callable(obj)  # module: kernel_...)


def test_legacy_v05_is_a_real_module():
    """A file, not a module built at import time: nothing in the package writes sys.modules
    or calls types.ModuleType."""
    import ast
    import pathlib

    assert legacy_v05.__spec__.origin.endswith("legacy_v05.py")
    assert legacy_v05.__name__ == "fused_rl.compat.verl.legacy_v05"
    package = pathlib.Path(verl.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) not in (
                    ("types", "ModuleType"),
                    ("sys", "modules"),
                ), path.name


def test_submodules_are_verls_and_small():
    import pkgutil

    found = sorted(m.name for m in pkgutil.iter_modules(verl.__path__))
    assert found == sorted(SUBMODULES + PRIVATE_SUBMODULES)
    for name in found:
        module = importlib.import_module(f"fused_rl.compat.verl.{name}")
        with open(module.__file__) as f:
            assert len(f.readlines()) <= 800, name


@pytest.mark.no_poison
@pytest.mark.parametrize("name", SUBMODULES)
def test_docstring_examples_of_every_submodule(name):
    """tests/test_docstrings.py runs the package's own examples; these are its modules'."""
    import doctest

    module = importlib.import_module(f"fused_rl.compat.verl.{name}")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0


# ----------------------------------------------------------------------------- backends / originals


def test_reference_backend_path_agrees(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 5, 23, generator=gen)
    labels = torch.randint(0, 23, (2, 5), generator=gen)
    rewards, values = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    m = masks(2, 5, gen, "holes")
    run = lambda: (verl.logprobs_from_logits(logits, labels), verl.entropy_from_logits(logits),
                   verl.kl_penalty(rewards, values, "k3+"),
                   *verl.compute_gae_advantage_return(rewards, values, m, 1.0, 0.95))  # fmt: skip
    fused = run()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for a, b in zip(fused, run()):
        assert rel_err(a, b) <= 1e-5


def test_against_installed_verl(device):
    """The live check's venv: a few of its comparisons, with the real verl (skips without)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    verl_F = pytest.importorskip("verl.utils.torch_functional")
    gen = torch.Generator().manual_seed(10)
    old = torch.randn(3, 5, generator=gen).to(device)
    new = old + 0.5 * torch.randn(3, 5, generator=gen).to(device)
    adv = torch.randn(3, 5, generator=gen).to(device)
    m = torch.ones(3, 5, device=device)
    m[1, 2:] = 0.0
    m[2] = 0.0
    for mode in MODES:
        got = no_future_warning(verl.compute_policy_loss, old, new, adv, m, 0.2,
                                loss_agg_mode=mode)  # fmt: skip
        want = no_future_warning(core_algos.compute_policy_loss, old, new, adv, m, 0.2,
                                 loss_agg_mode=mode)  # fmt: skip
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for kw in AGG_KWARGS:
            kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            assert torch.equal(verl.agg_loss(adv, m, mode, **kw),
                               core_algos.agg_loss(adv, m, mode, **kw))  # fmt: skip
            got = verl.compute_value_loss(new, adv, old, m, 0.3, mode, **kw)
            want = core_algos.compute_value_loss(new, adv, old, m, 0.3, mode, **kw)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    for kind in KL_KINDS:
        a, b = new.clone().requires_grad_(), old.clone().requires_grad_()
        a2, b2 = new.clone().requires_grad_(), old.clone().requires_grad_()
        got, want = verl.kl_penalty(a, b, kind), core_algos.kl_penalty(a2, b2, kind)
        assert got.dtype == want.dtype and rel_err(got, want) <= 1e-6
        up = torch.randn(3, 5, generator=gen).to(device)
        got.backward(up)
        want.backward(up)
        assert rel_err(a.grad, a2.grad) <= 1e-6 and rel_err(b.grad, b2.grad) <= 1e-6
    r, v = torch.randn(3, 5, generator=gen).bfloat16(), torch.randn(3, 5, generator=gen).bfloat16()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]]).float()
    got = verl.compute_gae_advantage_return(r, v, mask, 0.9, 0.95)
    want = core_algos.compute_gae_advantage_return(r, v, mask, 0.9, 0.95)
    exact = core_algos.compute_gae_advantage_return(r.double(), v.double(), mask, 0.9, 0.95)
    for g, w, e in zip(got, want, exact):  # verl rounds its first step to bf16, then fp32
        assert g.dtype == w.dtype == torch.float32
        assert rel_err(g, e) <= max(rel_err(w, e), 1e-5)
    x = torch.randn(3, 5, generator=gen)
    assert torch.equal(verl.masked_whiten(x, mask), verl_F.masked_whiten(x, mask))
