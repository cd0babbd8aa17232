"""Tests for ``fused_rl.values``: ``value_loss`` and torchtune's ``ppo_loss``.

Both backends are compared with float64 oracles written here (torchtune's ``PPOLoss.forward``
transcribed from seed 000, and the clipped value loss with each ``loss_agg`` spelled out),
on values and on gradients under random upstream gradients. On CPU the Triton path runs the
real kernels through the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import FP32_TOL, assert_rel, bf16_tol, clamp_in, gradcheck

from fused_rl.values import ppo_loss, value_loss

BACKENDS = ("triton", "reference")
F64_TOL = 1e-12
AGG_F64_TOL = 1e-7  # fused_rl._agg.token_weights is fp32 (1/10 has a 1.5e-8 relative error)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- oracles


def o_value_loss(v, v_old, ret, mask, clip, loss_agg, max_length=None, num_items=None):
    """float64 ``(loss, clip_frac, value_mean)``; aggregation written per mode."""
    v, v_old, ret = v.double(), v_old.double(), ret.double()
    sq = (v - ret) ** 2
    clipped = torch.zeros_like(sq, dtype=torch.bool)
    if clip is not None:
        sq_c = (clamp_in(v, v_old - clip, v_old + clip) - ret) ** 2
        clipped = sq_c > sq
        sq = torch.maximum(sq, sq_c)
    m = torch.ones_like(v) if mask is None else mask.double()
    per_token = torch.where(m != 0, 0.5 * sq * m, torch.zeros_like(sq))
    n_seq, length = m.shape
    if loss_agg == "token-mean":
        den = m.sum() if num_items is None else torch.tensor(float(num_items))
        loss = per_token.sum() / den if den > 0 else per_token.sum() * 0
    elif loss_agg == "seq-mean-token-mean":
        rows = [per_token[b].sum() / m[b].sum() for b in range(n_seq) if m[b].sum() > 0]
        loss = sum(rows, per_token.sum() * 0) / n_seq
    elif loss_agg == "seq-mean-token-sum":
        loss = per_token.sum() / n_seq
    else:
        loss = per_token.sum() / (n_seq * (max_length or length))
    count = m.sum()
    frac = (clipped.double() * m).sum() / count if count > 0 else count * 0
    mean = (torch.where(m != 0, v * m, 0 * v)).sum() / count if count > 0 else count * 0
    return loss, frac, mean


def o_ppo(lp_old, lp, adv, v_old, v, ret, pmask, vmask, eps, vclip, vcoef):
    """torchtune ``PPOLoss.forward`` (seed 000) in float64, masks as ``x * m``."""
    lp_old, lp, adv, v_old, v, ret = (t.double() for t in (lp_old, lp, adv, v_old, v, ret))

    def tt_mean(x, m):
        return x.mean() if m is None else (x * m).sum() / (m.double().sum() + 1e-8)

    ratios = torch.exp(lp - lp_old)
    pl_c = -adv * torch.clamp(ratios, 1.0 - eps, 1.0 + eps)
    pl_u = -adv * ratios
    clipfrac = tt_mean((pl_c > pl_u).double(), pmask)
    policy = tt_mean(torch.maximum(pl_c, pl_u), pmask)
    v_c = torch.clamp(v, v_old - vclip, v_old + vclip)
    value = 0.5 * tt_mean(torch.maximum((v - ret) ** 2, (v_c - ret) ** 2), vmask)
    return policy + value * vcoef, policy, value, ratios.mean(), clipfrac


# ----------------------------------------------------------------------------- inputs


def _inputs(device, dtype=torch.float32, shape=(4, 9), strided=True, seed=0):
    """Six (B, T) tensors: strided views, ratios on both sides of the clip band and exactly 1,
    values on both sides of the value-clip band and exactly at the centre."""
    g = torch.Generator().manual_seed(seed)
    b, t = shape

    def rnd(scale=1.0):
        big = torch.randn(b + 1, 2 * t + 1, generator=g) * scale
        x = big[1:, 1::2] if strided else big[1:, :t].contiguous()
        return x.to(device=device, dtype=dtype)

    lp_old = rnd(0.5) - 1.0
    lp = lp_old + rnd(0.3)
    v_old = rnd()
    v = v_old + rnd(0.4)
    lp[:, 0], v[:, 0] = lp_old[:, 0], v_old[:, 0]  # ratio == 1 and v == v_old exactly (ties)
    return lp_old, lp, rnd(), v_old, v, rnd()


def _masks(device, shape=(4, 9), seed=1):
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(shape, generator=g) > 0.3
    pm[1] = False  # an empty row
    vm = pm.clone()
    vm[:, 0] = True  # differs from the policy mask
    fm = torch.rand(shape, generator=g) * (torch.rand(shape, generator=g) > 0.2)
    return pm.to(device), vm.to(device), fm.to(device)


def _grads(out, inputs, up):
    return torch.autograd.grad(out, inputs, up, allow_unused=True)


# ----------------------------------------------------------------------------- value_loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", AGGS)
def test_value_loss_parity(backend, loss_agg, device):
    _, _, _, v_old, v, ret = _inputs(device)
    pm, _, fm = _masks(device)
    for mask in (pm, fm, None):
        for clip in (0.2, None):
            vg = v.clone().requires_grad_(True)
            loss, metrics = value_loss(
                vg, v_old, ret, mask=mask, clip=clip, loss_agg=loss_agg, backend=backend
            )
            v64 = v.double().requires_grad_(True)
            o_loss, o_frac, o_mean = o_value_loss(v64, v_old, ret, mask, clip, loss_agg)
            what = f"{loss_agg} clip={clip} mask={None if mask is None else mask.dtype}"
            assert loss.shape == () and loss.dtype == torch.float32
            assert_rel(loss, o_loss, FP32_TOL, what)
            for name, ref in (("clip_frac", o_frac), ("value_mean", o_mean)):
                got = metrics[name]
                assert got.dtype == torch.float32 and not got.requires_grad and got.shape == ()
                assert_rel(got, ref, FP32_TOL, f"{what} {name}")
            up = torch.randn(())
            (g,) = _grads(loss, vg, up)
            (o_g,) = _grads(o_loss, v64, up.double())
            assert g.dtype == v.dtype
            assert_rel(g, o_g, FP32_TOL, f"{what} grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_float64_ties_and_keywords(backend, device):
    """Exact PyTorch subgradients in float64: v on the clip bounds (clamp passes the gradient)
    and the two branches tied with the clipped one flat (maximum halves the gradient)."""
    d = torch.float64
    v_old = torch.tensor([[0.5, 0.5, -1.5, 0.0]], dtype=d, device=device)
    v = torch.tensor([[0.75, 0.25, 1.0, 3.0]], dtype=d, device=device, requires_grad=True)
    ret = torch.tensor([[2.0, -1.0, 0.0, 1.0]], dtype=d, device=device)
    loss, metrics = value_loss(v, v_old, ret, clip=0.25, backend=backend)
    v64 = v.detach().clone().requires_grad_(True)
    o_loss, o_frac, _ = o_value_loss(v64, v_old, ret, None, 0.25, "token-mean")
    assert_rel(loss, o_loss, F64_TOL, "loss")
    assert metrics["clip_frac"].item() == pytest.approx(o_frac.item())
    assert_rel(_grads(loss, v, None)[0], _grads(o_loss, v64, None)[0], F64_TOL, "grad")
    # num_items (token-mean over a global count) and max_length (Dr. GRPO norm)
    for kw, agg in ((dict(num_items=10), "token-mean"), (dict(max_length=7), AGGS[3])):
        loss, _ = value_loss(v, v_old, ret, clip=0.25, loss_agg=agg, backend=backend, **kw)
        o_loss, _, _ = o_value_loss(v64, v_old, ret, None, 0.25, agg, **kw)
        assert_rel(loss, o_loss, AGG_F64_TOL, str(kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_mask_any_strides(backend, device):
    """A transposed (column-major) float mask gives the same loss, gradient and metrics as
    its contiguous copy, for every loss_agg (the weights derived from it keep its strides)."""
    g = torch.Generator().manual_seed(4)
    v, v_old, ret = (torch.randn(3, 5, generator=g).to(device) for _ in range(3))
    mask_t = (torch.rand(5, 3, generator=g) > 0.3).float().to(device).t()
    assert not mask_t.is_contiguous()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        outs = []
        for mask in (mask_t, mask_t.contiguous()):
            leaf = v.clone().requires_grad_(True)
            loss, metrics = value_loss(leaf, v_old, ret, mask=mask, clip=0.2, loss_agg=agg,
                                       backend=backend)  # fmt: skip
            outs.append((loss, torch.autograd.grad(loss, leaf)[0], *metrics.values()))
        for got, want in zip(*outs):  # the reference may sum in another order
            assert_rel(got, want, 1e-6, agg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_clip_frac_counts_by_mask(backend, device):
    """num_items = 0 as a tensor (unchecked: no sync) zeroes the weights, not the metric:
    the clip fraction stays a masked mean over the mask."""
    v = torch.tensor([[0.0, 1.0, 2.0]], device=device)
    v_old, ret = torch.zeros(1, 3, device=device), torch.ones(1, 3, device=device)
    zero = torch.tensor(0.0, device=device)
    _, metrics = value_loss(v, v_old, ret, clip=0.5, num_items=zero, backend=backend)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_targets_are_constants(backend, device):
    """old_values / returns / a float mask with requires_grad get no gradient on either
    backend (nor do ppo_loss's masks)."""
    v, v_old, ret, mask = (torch.rand(3, 5, device=device, requires_grad=True) for _ in range(4))
    loss, _ = value_loss(v, v_old, ret, mask=mask, clip=0.1, backend=backend)
    grads = torch.autograd.grad(loss, [v, v_old, ret, mask], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])
    out = ppo_loss(v_old, v, ret, v_old, v, ret, mask, mask, backend=backend)
    grads = torch.autograd.grad(out[0], [v, mask], allow_unused=True)
    assert grads[0] is not None and grads[1] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_empty_mask_and_padding(backend, device):
    _, _, _, v_old, v, ret = _inputs(device)
    v = v.clone()
    empty = torch.zeros(v.shape, dtype=torch.bool, device=device)
    vg = v.clone().requires_grad_(True)
    loss, metrics = value_loss(vg, v_old, ret, mask=empty, backend=backend)
    assert loss.item() == 0.0 and metrics["clip_frac"].item() == 0.0
    assert metrics["value_mean"].item() == 0.0
    assert torch.equal(_grads(loss, vg, None)[0], torch.zeros_like(v))
    # NaN / inf under the mask never leak into the loss, the metrics or the gradient
    pm, _, _ = _masks(device)
    v[~pm] = float("inf")
    vg = v.clone().requires_grad_(True)
    loss, metrics = value_loss(vg, v_old, ret, mask=pm, backend=backend)
    (g,) = _grads(loss, vg, None)
    assert torch.isfinite(loss) and torch.isfinite(metrics["value_mean"])
    assert torch.isfinite(g).all() and torch.equal(g[~pm], torch.zeros_like(g[~pm]))


# ----------------------------------------------------------------------------- ppo_loss


@pytest.mark.parametrize("backend", BACKENDS)
def test_ppo_torchtune_fixtures(backend, device):
    """torchtune's PPOLoss tests: epsilon 0.2, ratio e -> policy loss -1.2 (adv 1), ratio 1/e
    -> 0.8 (adv -1), ratio e^0.1 unclipped; ratios_mean is the plain mean of the ratios."""
    ones = torch.ones(3, device=device)
    old = torch.tensor([0.5, 0.8, 1.2], device=device)
    cases = ((1.0, 1.0, -1.2, math.e), (-1.0, -1.0, 0.8, 1 / math.e))
    cases += ((0.1, 1.0, -math.exp(0.1), math.exp(0.1)),)
    for shift, adv, expected, ratio in cases:
        out = ppo_loss(old, old + shift, adv * ones, ones, ones, ones, epsilon=0.2, backend=backend)
        assert out[1].item() == pytest.approx(expected, abs=1e-5)
        assert out[3].item() == pytest.approx(ratio, abs=1e-5)
        assert out[2].item() == 0.0  # values == returns
        assert out[4].item() == (0.0 if shift == 0.1 else 1.0)
    # value clipping: v = old + 1 is clipped to old + 0.2 -> max((1-0)^2, (0.2-0)^2) = 1
    out = ppo_loss(old, old, ones, 0 * ones, ones, 0 * ones, epsilon=0.2, backend=backend)
    assert out[2].item() == pytest.approx(0.5)
    assert out[0].item() == pytest.approx(out[1].item() + 0.1 * 0.5)
    # adv = 0: the two branches tie, never counted as clipped
    out = ppo_loss(old, old + 1.0, 0 * ones, ones, ones, ones, backend=backend)
    assert out[4].item() == 0.0 and out[1].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ppo_parity(backend, dtype, device):
    tensors = _inputs(device, dtype)
    pm, vm, fm = _masks(device)
    empty = torch.zeros_like(pm)
    tol = FP32_TOL if dtype == torch.float32 else F64_TOL
    mask_cases = ((None, None), (pm, None), (None, vm), (pm, vm), (fm, pm), (empty, empty))
    for pmask, vmask in mask_cases:
        lp = tensors[1].clone().requires_grad_(True)
        v = tensors[4].clone().requires_grad_(True)
        args = (tensors[0], lp, tensors[2], tensors[3], v, tensors[5], pmask, vmask)
        out = ppo_loss(*args, epsilon=0.2, value_clip_range=0.3, value_coeff=0.5, backend=backend)
        lp64 = lp.detach().double().requires_grad_(True)
        v64 = v.detach().double().requires_grad_(True)
        o_args = (tensors[0], lp64, tensors[2], tensors[3], v64, tensors[5], pmask, vmask)
        o_out = o_ppo(*o_args, 0.2, 0.3, 0.5)
        what = f"pmask={pmask is not None} vmask={vmask is not None}"
        names = ("loss", "policy_loss", "value_loss", "ratios_mean", "clipfrac")
        for name, got, ref in zip(names, out, o_out):
            assert got.shape == () and got.dtype == dtype
            assert torch.isfinite(got)
            assert_rel(got, ref, tol, f"{what} {name}")
            assert got.requires_grad == (name == "loss")
        up = torch.randn((), dtype=torch.float64)
        grads = _grads(out[0], (lp, v), up.to(dtype))
        o_grads = _grads(o_out[0], (lp64, v64), up)
        for name, got, ref in zip(("d pi_logprobs", "d phi_values"), grads, o_grads):
            assert got.dtype == dtype
            assert_rel(got, ref, tol, f"{what} {name}")
        if pmask is empty:
            assert all(t.item() == 0.0 for t in (out[0], out[1], out[2], out[4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ppo_recipe_padding_and_other_shapes(backend, device):
    """torchtune's recipe writes logprobs = 1.0 and values = 0 at padding; an inf there (or a
    3-D input) must not change anything under the masks."""
    lp_old, lp, adv, v_old, v, ret = _inputs(device, strided=False)
    pm, vm, _ = _masks(device)
    lp_old, lp = lp_old.masked_fill(~pm, 1.0), lp.masked_fill(~pm, 1.0)
    v_old, v = v_old.masked_fill(~vm, 0.0), v.masked_fill(~vm, 0.0)
    ref = ppo_loss(lp_old, lp, adv, v_old, v, ret, pm, vm, backend=backend)
    o_ref = o_ppo(lp_old, lp, adv, v_old, v, ret, pm, vm, 0.1, 0.2, 0.1)
    for got, want in zip(ref, o_ref):
        assert_rel(got, want, FP32_TOL, "recipe padding")
    ret_bad = ret.masked_fill(~vm, float("inf"))
    adv_bad = adv.masked_fill(~pm, float("nan"))
    bad = ppo_loss(lp_old, lp, adv_bad, v_old, v, ret_bad, pm, vm, backend=backend)
    for got, want in zip(bad[:3], ref[:3]):
        assert_rel(got, want, FP32_TOL, "NaN / inf at padding")
    lp_g, v_g = lp.clone().requires_grad_(True), v.clone().requires_grad_(True)
    bad = ppo_loss(lp_old, lp_g, adv_bad, v_old, v_g, ret_bad, pm, vm, backend=backend)
    for g in _grads(bad[0], (lp_g, v_g), None):
        assert torch.isfinite(g).all()
    three_d = [t.reshape(2, 2, 9) for t in (lp_old, lp, adv, v_old, v, ret, pm, vm)]
    for got, want in zip(ppo_loss(*three_d, backend=backend), ref):
        assert_rel(got, want, FP32_TOL, "3-D")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs(backend, device):
    tensors = _inputs(device, torch.bfloat16, seed=3)
    pm, vm, _ = _masks(device)
    oracle = o_ppo(*tensors, pm, vm, 0.2, 0.2, 0.1)
    # eager same-dtype torchtune (bf16 all the way) as the tolerance reference
    lp_old, lp, adv, v_old, v, ret = tensors
    ratios = torch.exp(lp - lp_old)
    pol = torch.maximum(-adv * torch.clamp(ratios, 0.8, 1.2), -adv * ratios)
    eager = (pol * pm).sum() / (pm.sum() + 1e-8)
    out = ppo_loss(*tensors, pm, vm, epsilon=0.2, backend=backend)
    assert out[1].dtype == torch.float32
    assert_rel(out[1], oracle[1], bf16_tol(eager, oracle[1]), "bf16 policy loss")
    v = tensors[4].clone().requires_grad_(True)
    loss, _ = value_loss(v, tensors[3], tensors[5], mask=vm, backend=backend)
    loss.backward()
    assert v.grad.dtype == torch.bfloat16


def test_gradcheck_float64_triton(device):
    tensors = [t.double() for t in _inputs(device, shape=(2, 5), seed=4)]
    pm, vm, fm = (m[:2, :5] for m in _masks(device))
    lp, v = tensors[1].requires_grad_(True), tensors[4].requires_grad_(True)

    def fn(lp, v):
        out = ppo_loss(
            tensors[0], lp, tensors[2], tensors[3], v, tensors[5], pm, vm,
            epsilon=0.2, backend="triton",
        )  # fmt: skip
        loss, _ = value_loss(
            v, tensors[3], tensors[5], mask=fm, loss_agg="seq-mean-token-mean", backend="triton"
        )
        return out[0], loss

    assert gradcheck(fn, (lp, v))


def test_deterministic(device):
    """Several blocks (B*T > BLOCK): two runs are bit-identical, values and gradients."""
    tensors = _inputs(device, shape=(5, 450), seed=5)
    pm, vm, _ = _masks(device, shape=(5, 450))

    def run():
        lp = tensors[1].clone().requires_grad_(True)
        v = tensors[4].clone().requires_grad_(True)
        out = ppo_loss(tensors[0], lp, tensors[2], tensors[3], v, tensors[5], pm, vm)
        vl, metrics = value_loss(v, tensors[3], tensors[5], mask=vm, backend="triton")
        return (*out, vl, *metrics.values(), *torch.autograd.grad(out[0] + vl, (lp, v)))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    tensors = _inputs(device, seed=6)
    pm, vm, _ = _masks(device)

    def f(lp, v):
        out = ppo_loss(tensors[0], lp, tensors[2], tensors[3], v, tensors[5], pm, vm)
        vl, metrics = value_loss(v, tensors[3], tensors[5], mask=vm, loss_agg=AGGS[1])
        return out[0] + vl, out[1], metrics["clip_frac"]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        lp = tensors[1].clone().requires_grad_(True)
        v = tensors[4].clone().requires_grad_(True)
        outs = fn(lp, v)
        results.append((*outs, *torch.autograd.grad(outs[0], (lp, v))))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_errors(device):
    lp_old, lp, adv, v_old, v, ret = _inputs(device)
    with pytest.raises(ValueError, match="returns"):
        ppo_loss(lp_old, lp, adv, v_old, v, ret[:, :3])
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(lp_old, lp, adv.to("meta"), v_old, v, ret)
    with pytest.raises(ValueError, match="value_padding_masks"):
        ppo_loss(lp_old, lp, adv, v_old, v, ret, None, torch.ones(3, device=device))
    with pytest.raises(TypeError, match="advantages"):
        ppo_loss(lp_old, lp, adv.long(), v_old, v, ret)
    with pytest.raises(ValueError, match="epsilon"):
        ppo_loss(lp_old, lp, adv, v_old, v, ret, epsilon=-0.1)
    with pytest.raises(ValueError, match="value_clip_range"):
        ppo_loss(lp_old, lp, adv, v_old, v, ret, value_clip_range=float("nan"))
    with pytest.raises(ValueError, match="values"):
        value_loss(v[0], v_old[0], ret[0])
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, v_old.t(), ret)
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, v_old, ret, clip=-1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        value_loss(v, v_old, ret, loss_agg="sum")
    with pytest.raises(ValueError, match="mask"):
        value_loss(v, v_old, ret, mask=torch.ones(2, 2, dtype=torch.bool, device=device))


@pytest.mark.gpu
def test_no_host_sync_cuda():
    tensors = _inputs("cuda", seed=7)
    pm, vm, _ = _masks("cuda")
    lp = tensors[1].clone().requires_grad_(True)
    v = tensors[4].clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ppo_loss(tensors[0], lp, tensors[2], tensors[3], v, tensors[5], pm, vm)
        vl, _ = value_loss(v, tensors[3], tensors[5], mask=vm, loss_agg=AGGS[1])
        (out[0] + vl).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_items", [0, -3, float("nan"), float("inf")])
def test_value_loss_rejects_bad_num_items(num_items):
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="num_items"):
        value_loss(v, v, v, num_items=num_items)
