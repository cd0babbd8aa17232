"""Tests for ``fused_rl.rollout.rollout_is_weights`` (rollout / vLLM importance-sampling
correction, issue 15 item 2b).

Oracles: float64 transcriptions, written here, of the formulas in VARIANTS.md sections
6.1-6.3 for each library's mode (verl ``rollout_is`` token / sequence with its +-20 safety
clamp and upper-only truncation, verl k1 rejection sampling ``token_k1`` / ``seq_sum_k1`` /
``seq_mean_k1`` as a new loss mask, TRL ``token_truncate`` / ``token_mask`` /
``sequence_truncate`` / ``sequence_mask``). Both backends; on CPU the Triton path runs the
real kernel through the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, assert_rel

from fused_rl.profiling import LaunchCounter
from fused_rl.rollout import rollout_is_weights

BACKENDS = ("triton", "reference")
NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------- oracles
# Each returns the library's own (B, T) tensors in float64, padding included as the library
# leaves it; the tests compare on counted tokens and check the padding convention apart.


def _lam(old, roll, mask):
    """verl's masked_sum convention: ``where(m, lam, 0)`` (NaN padding does not leak)."""
    lam = old.double() - roll.double()
    m = mask.bool()
    return torch.where(m, lam, torch.zeros_like(lam)), m.double()


def verl_rollout_is(old, roll, mask, level, threshold):
    """verl ``compute_rollout_correction_weights`` (6.1): exp of the +-20-clamped token or
    summed log-ratio, times the mask, then ``min(w, threshold)``."""
    lam, m = _lam(old, roll, mask)
    if level == "token":
        w = torch.exp(lam.clamp(-20.0, 20.0))
    else:
        w = torch.exp((lam * m).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(lam)
    return (w * m).clamp(max=threshold)


def verl_rollout_rs_k1(old, roll, mask, option, lower, upper):
    """verl ``compute_rollout_rejection_mask`` k1 options (6.1): ``k1 = -clamp(lam, +-20)``,
    keep ``ln(lower) <= stat <= ln(upper)``; returns the new response mask ``m * keep``."""
    lam, m = _lam(old, roll, mask)
    k1 = -lam.clamp(-20.0, 20.0)
    if option == "token_k1":
        stat = k1
    elif option == "seq_sum_k1":
        stat = (k1 * m).sum(-1, keepdim=True).expand_as(k1)
    else:  # seq_mean_k1: verl masked_mean, ``sum / (n + 1e-8)``
        stat = ((k1 * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)).expand_as(k1)
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    return m * keep.double()


def trl_vllm_is(old, roll, mask, mode, clip_min, clip_max):
    """TRL ``_generate_and_score_completions`` (6.3): ``lam = (old - vllm) * m``, token or
    summed ratio, ``clamp`` (truncate) or ``masked_fill(outside, 0)`` with None bounds as
    -inf / +inf (mask)."""
    m = mask.double()
    lam = (old.double() - roll.double()) * m
    if mode.startswith("sequence"):
        rho = torch.exp(lam.sum(-1, keepdim=True)).expand_as(lam)
    else:
        rho = torch.exp(lam)
    if mode.endswith("truncate"):
        return torch.clamp(rho, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return rho.masked_fill((rho < lo) | (rho > hi), 0.0)


# ----------------------------------------------------------------------------- inputs


def _mask(n_rows, length, device, seed=0):
    """Right padding of random lengths, one hole, one empty row (when B >= 3)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n_rows,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if n_rows >= 3:
        mask[1] = False
    if length >= 4:
        mask[0, length // 2] = False
    return mask.to(device)


# log-ratio spreads per level: a mix of rejected / truncated and kept tokens or sequences
# under the bounds used here, (0.5, 2) and (0.8, 1.6)
SPREAD = {"token": 0.35, "sequence": 0.12, "geometric": 0.8}


def _rollout(device, n_rows=5, length=23, dtype=torch.float32, seed=0, spread=0.35):
    """Log-probs with ``old - roll ~ N(0, spread^2)`` per token, right-padded rows."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n_rows, length, generator=gen, dtype=torch.float64) * 3.0
    roll = old + spread * torch.randn(n_rows, length, generator=gen, dtype=torch.float64)
    return old.to(device, dtype), roll.to(device, dtype), _mask(n_rows, length, device, seed)


def _poison(x, mask):
    """NaN, +inf and -inf at the positions that do not count."""
    fill = torch.tensor([NAN, INF, -INF], dtype=x.dtype, device=x.device)
    pattern = fill[torch.arange(x.numel(), device=x.device) % 3].reshape(x.shape)
    return torch.where(mask.bool(), x, pattern)


def _check_padding(weights, keep, mask):
    off = ~mask.bool()
    assert (weights[off] == 1).all(), "weights of uncounted tokens must be exactly 1"
    if keep is not None:
        assert not keep[off].any(), "keep must be False at uncounted tokens"


def _on_counted(x, mask):
    return x[mask.bool()]


# ----------------------------------------------------------------------------- library modes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_truncated_is(device, backend, level):
    """verl TIS: upper-only truncation at ``rollout_is_threshold``; the +-20 safety clamp is
    reproduced by ``clip_min=exp(-20)`` and costs < e^-20 absolute without it."""
    old, roll, mask = _rollout(device, spread=2.0)
    roll[0, 0] = old[0, 0] + 30.0  # lam = -30 < -20: the safety clamp acts (token and row 0)
    roll = _poison(roll, mask)
    want = verl_rollout_is(old, roll, mask, level, threshold=2.0)
    assert (_on_counted(want, mask) < math.exp(-19.0)).any(), "the lower clamp must matter"
    plain = rollout_is_weights(old, roll, mask, level=level, clip_max=2.0, backend=backend)
    exact = rollout_is_weights(
        old, roll, mask, level=level, clip_min=math.exp(-20.0), clip_max=2.0, backend=backend
    )
    for got in (plain, exact):
        assert got.dtype == torch.float32 and got.shape == old.shape
        _check_padding(got, None, mask)
    assert_rel(_on_counted(exact, mask), _on_counted(want, mask), FP32_TOL, "verl exact")
    # without the clamp: off by less than e^-20 where it acted, fp32 rounding elsewhere (a
    # few ulps: a GPU's exp, ex2.approx of a rounded x * log2(e), is not correctly rounded)
    want_c = _on_counted(want, mask)
    diff = (_on_counted(plain, mask).double() - want_c).abs()
    assert (diff <= math.exp(-20.0) + 2.0**-21 * want_c).all(), diff.max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "option,level", [("token_k1", "token"), ("seq_sum_k1", "sequence"),
                     ("seq_mean_k1", "geometric")]
)  # fmt: skip
@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.8, 1.6)])
def test_verl_rejection_sampling(device, backend, option, level, bounds):
    """verl k1 RS "lower_upper" (bounds on pi_rollout / pi_old) is ``mode="mask"`` with
    ``clip_min = 1/upper, clip_max = 1/lower``; ``mask & keep`` is verl's new response mask."""
    lower, upper = bounds
    old, roll, mask = _rollout(device, n_rows=16, spread=SPREAD[level])
    roll = _poison(roll, mask)
    want_mask = verl_rollout_rs_k1(old, roll, mask, option, lower, upper)
    weights, keep = rollout_is_weights(
        old, roll, mask, level=level, mode="mask", clip_min=1 / upper, clip_max=1 / lower,
        backend=backend,
    )  # fmt: skip
    assert keep.dtype == torch.bool and keep.shape == old.shape
    kept = want_mask.bool()
    assert kept.any() and (mask.bool() & ~kept).any(), "the case must keep and reject some"
    assert torch.equal((mask & keep).cpu(), kept.cpu())
    assert torch.equal(keep.cpu(), kept.cpu())  # keep is already False at padding
    _check_padding(weights, keep, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "trl_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
@pytest.mark.parametrize("bounds", [(None, 1.5), (0.5, 2.0), (0.7, None)])
def test_trl_vllm_is(device, backend, trl_mode, bounds):
    """TRL's four modes: ``level`` from the prefix, ``mode`` from the suffix, the bounds
    passed as they are; ``*_mask`` survivors keep their raw ratio, rejected ones get 0."""
    clip_min, clip_max = bounds
    level, mode = trl_mode.split("_")
    old, roll, mask = _rollout(device, n_rows=16, spread=SPREAD[level])
    want = trl_vllm_is(old, roll, mask, trl_mode, clip_min, clip_max)
    out = rollout_is_weights(
        old, _poison(roll, mask), mask, level=level, mode=mode, clip_min=clip_min,
        clip_max=clip_max, backend=backend,
    )  # fmt: skip
    weights, keep = out if mode == "mask" else (out, None)
    assert_rel(_on_counted(weights, mask), _on_counted(want, mask), FP32_TOL, trl_mode)
    _check_padding(weights, keep, mask)
    if mode == "mask":
        raw = _on_counted(want, mask)
        assert (raw == 0).any() and (raw > 0).any(), "the case must keep and reject some"
        assert torch.equal(_on_counted(keep, mask).cpu(), (raw != 0).cpu())
        # the multiply-by-keep form is the same tensor on counted tokens
        assert torch.equal(_on_counted(weights * keep, mask), _on_counted(weights, mask))


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncate_two_sided_and_raw(device, backend):
    """``[clip_min, clip_max]`` truncation; no bounds at all is the raw ratio."""
    old, roll, mask = _rollout(device)
    lam = torch.where(mask, old.double() - roll.double(), 0.0)
    got = rollout_is_weights(old, roll, mask, clip_min=0.8, clip_max=1.25, backend=backend)
    assert_rel(got, lam.exp().clamp(0.8, 1.25), FP32_TOL, "two-sided")
    raw = rollout_is_weights(old, roll, mask, clip_max=None, backend=backend)
    assert_rel(raw, lam.exp(), FP32_TOL, "raw")
    seq = rollout_is_weights(old, roll, mask, level="geometric", clip_max=None, backend=backend)
    n = mask.sum(-1, keepdim=True).double()
    want = torch.where(n > 0, lam.sum(-1, keepdim=True) / n.clamp(min=1), 0.0).exp()
    assert_rel(seq, torch.where(mask, want, 1.0), FP32_TOL, "geometric")


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_padding_never_matters(device, backend, level, mode):
    """NaN / +-inf log-probs at uncounted tokens give the same bits as clean padding; fully
    masked rows are all weight 1, keep False; a float / int mask is an indicator."""
    old, roll, mask = _rollout(device, n_rows=4, length=37)
    mask[2] = False
    kw = dict(level=level, mode=mode, clip_min=0.5, clip_max=2.0, backend=backend)

    def call(o, r, m):
        out = rollout_is_weights(o, r, m, **kw)
        return out if mode == "mask" else (out, None)

    clean = call(old, roll, mask)
    weights, keep = dirty = call(_poison(old, mask), _poison(roll, mask), mask)
    for other in (dirty, call(old, roll, mask.float() * 0.5), call(old, roll, mask.int())):
        assert torch.equal(clean[0], other[0]) and (keep is None or torch.equal(clean[1], other[1]))
    assert torch.isfinite(weights).all()
    assert (weights[2] == 1).all() and (keep is None or not keep[2].any())
    _check_padding(weights, keep, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_no_mask_and_t1(device, backend, level):
    """``mask=None`` counts every token; T = 1 (sequence = token there)."""
    old, roll, _ = _rollout(device, n_rows=3, length=1)
    lam = old.double() - roll.double()
    got = rollout_is_weights(old, roll, level=level, clip_min=0.9, clip_max=1.1, backend=backend)
    assert got.shape == (3, 1)
    assert_rel(got, lam.exp().clamp(0.9, 1.1), FP32_TOL, "T=1")
    old, roll, _ = _rollout(device, n_rows=3, length=19)
    lam = old.double() - roll.double()
    w, keep = rollout_is_weights(old, roll, level=level, mode="mask", clip_max=None,
                                 backend=backend)  # fmt: skip
    if level == "token":
        want = lam
    elif level == "sequence":
        want = lam.sum(-1, keepdim=True).expand_as(lam)
    else:
        want = lam.mean(-1, keepdim=True).expand_as(lam)
    assert keep.all()
    assert_rel(w, want.exp(), FP32_TOL, "no mask")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_nan_and_inf_in_counted_tokens(device, backend, level):
    """NaN in a counted token: NaN weight (the whole sequence at sequence level), never
    rejected. ``rollout = -inf``: ratio inf, truncated to clip_max / rejected. ``old =
    -inf``: ratio 0, truncated to clip_min / rejected. A huge sequence sum overflows to inf,
    which truncates to clip_max."""
    old = torch.full((4, 6), -1.0, device=device)
    roll = torch.full((4, 6), -1.0, device=device)
    roll[0, 2] = NAN
    roll[1, 3] = -INF
    old[2, 1] = -INF
    roll[3] = -40.0  # lam = 39 per token: the sum, 234, overflows exp in fp32
    w = rollout_is_weights(old, roll, level=level, clip_min=0.5, clip_max=2.0, backend=backend)
    wm, keep = rollout_is_weights(old, roll, level=level, mode="mask", clip_min=0.5,
                                  clip_max=2.0, backend=backend)  # fmt: skip
    nan_row = torch.isnan(w[0]) if level == "sequence" else torch.arange(6, device=device) == 2
    assert torch.equal(torch.isnan(w[0]), nan_row) and torch.equal(torch.isnan(wm[0]), nan_row)
    assert keep[0].all()
    hit = torch.ones(6, dtype=torch.bool, device=device)
    if level == "token":
        hit = torch.arange(6, device=device) == 3
    assert (w[1][hit] == 2.0).all() and (wm[1][hit] == 0).all() and not keep[1][hit].any()
    assert (w[1][~hit] == 1.0).all() and keep[1][~hit].all()
    hit2 = hit if level == "sequence" else torch.arange(6, device=device) == 1
    assert (w[2][hit2] == 0.5).all() and (wm[2][hit2] == 0).all() and not keep[2][hit2].any()
    assert (w[3] == 2.0).all() and (wm[3] == 0).all() and not keep[3].any()
    raw = rollout_is_weights(old[3:], roll[3:], level=level, clip_max=None, backend=backend)
    assert (raw == INF).all() if level == "sequence" else torch.isfinite(raw).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_bf16_fp64_and_mixed_dtypes(device, backend, level):
    """bf16 inputs compute in fp32 (fp32 out); fp64 stays fp64 at F64_TOL (the bounds go
    through f32_pair: 1/3 is not an fp32 number); mixed fp32 / bf16 give fp32."""
    old, roll, mask = _rollout(device, n_rows=8, dtype=torch.float64, spread=0.6)
    lam = torch.where(mask, old - roll, 0.0)
    if level == "token":
        log_w = lam
    else:
        log_w = lam.sum(-1, keepdim=True)
        if level == "geometric":
            n = mask.sum(-1, keepdim=True).double()
            log_w = torch.where(n > 0, log_w / n.clamp(min=1), 0.0)
        log_w = log_w.expand_as(lam)
    kw = dict(level=level, clip_min=1 / 3, clip_max=4 / 3, backend=backend)
    got = rollout_is_weights(old, roll, mask, **kw)
    assert got.dtype == torch.float64
    want = torch.where(mask, log_w.exp().clamp(1 / 3, 4 / 3), 1.0)
    assert_rel(got, want, F64_TOL, "fp64")
    # hit to ~2^-48 (f32_pair), not to the bit: a bare fp32 bound would be 1e-8 off
    at_bound = ((got - 1 / 3).abs() < 1e-14) | ((got - 4 / 3).abs() < 1e-14)
    assert at_bound.any(), "the bounds must be hit"
    for o, r in ((old.bfloat16(), roll.bfloat16()), (old.float(), roll.bfloat16())):
        got = rollout_is_weights(o, r, mask, **kw)
        assert got.dtype == torch.float32
        ref = rollout_is_weights(o.double(), r.double(), mask, **kw)
        assert_rel(got, ref, FP32_TOL, f"{o.dtype}/{r.dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_non_contiguous_inputs(device, backend, level):
    """Strided slices and transposed (time-major) views give the contiguous results."""
    old, roll, mask = _rollout(device, n_rows=4, length=21)
    big = torch.zeros(4, 43, device=device)
    big[:, 1::2] = old
    old_s = big[:, 1::2]
    roll_t = roll.t().contiguous().t()
    mask_t = mask.t().contiguous().t()
    assert not (old_s.is_contiguous() or roll_t.is_contiguous() or mask_t.is_contiguous())
    kw = dict(level=level, mode="mask", clip_min=0.5, clip_max=2.0, backend=backend)
    (w_s, keep_s), (w, keep) = (rollout_is_weights(old_s, roll_t, mask_t, **kw),
                                rollout_is_weights(old, roll, mask, **kw))  # fmt: skip
    assert w_s.is_contiguous() and keep_s.is_contiguous() and torch.equal(keep_s, keep)
    if backend == "triton":  # the reference's torch ops may round a strided input apart
        assert torch.equal(w_s, w)
    assert_rel(w_s, w, FP32_TOL, "strided")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty(device, backend, shape):
    x = torch.zeros(shape, device=device)
    w, keep = rollout_is_weights(x, x, mode="mask", backend=backend)
    assert w.shape == keep.shape == shape and keep.dtype == torch.bool


def test_backends_agree_and_detached(device):
    """Both backends agree to rounding, long rows span several blocks, repeat calls are
    bit-identical, and no gradient flows (the weights are constants)."""
    old, roll, mask = _rollout(device, n_rows=3, length=2100, spread=0.03)
    old.requires_grad_(True)
    for level in ("token", "sequence", "geometric"):
        kw = dict(level=level, mode="mask", clip_min=0.5, clip_max=2.0)
        a = rollout_is_weights(old, roll, mask, backend="triton", **kw)
        b = rollout_is_weights(old, roll, mask, backend="reference", **kw)
        assert torch.equal(a[1], b[1]), level
        assert_rel(a[0], b[0], FP32_TOL, level)
        assert torch.equal(a[0], rollout_is_weights(old, roll, mask, backend="triton", **kw)[0])
        assert not (a[0].requires_grad or b[0].requires_grad or a[0].grad_fn or b[0].grad_fn)


@pytest.mark.no_poison  # the fixture's NaN fill of torch.empty would count as a launch
def test_one_launch(device):
    """One Triton launch for every level and mode, no aten op around it; the torch version
    of the same math (the reference) launches at least 5 times."""
    old, roll, mask = _rollout(device)
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            kw = dict(level=level, mode=mode, clip_min=0.5)
            with LaunchCounter() as c:
                rollout_is_weights(old, roll, mask, backend="triton", **kw)
            assert c.total == 1 and not c.ops, (c.ops, c.kernels)
            with LaunchCounter() as c:
                rollout_is_weights(old, roll, mask, backend="reference", **kw)
            assert c.total >= 5, c.ops


@pytest.mark.no_poison
def test_torch_compile(device):
    old, roll, mask = _rollout(device, n_rows=3, length=17)

    def fn(o, r, m):
        w = rollout_is_weights(o, r, m, level="sequence", clip_max=2.0)
        wm, keep = rollout_is_weights(o, r, m, mode="mask", clip_min=0.5, clip_max=2.0)
        return w * 2.0, wm, keep

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(old, roll, mask), fn(old, roll, mask)):
        torch.testing.assert_close(got, want)


@pytest.mark.no_poison
def test_docstring_example():
    import doctest

    import fused_rl.rollout as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- errors


def test_errors(device):
    x = torch.zeros(2, 3, device=device)
    call = rollout_is_weights
    with pytest.raises(TypeError, match="old_logprobs"):
        call([[0.0]], x)
    with pytest.raises(TypeError, match="rollout_logprobs"):
        call(x, x.long())
    with pytest.raises(ValueError, match=r"old_logprobs must be a \(B, T\)"):
        call(x[0], x[0])
    with pytest.raises(ValueError, match=r"rollout_logprobs must be a \(B, T\)"):
        call(x, x[None])
    with pytest.raises(ValueError, match="rollout_logprobs must have shape"):
        call(x, torch.zeros(2, 4, device=device))
    with pytest.raises(ValueError, match="mask must have shape"):
        call(x, x, torch.ones(2, 4, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="mask"):
        call(x, x, torch.ones(2, 3, dtype=torch.complex64, device=device))
    with pytest.raises(ValueError, match="level must be one of"):
        call(x, x, level="geo")
    with pytest.raises(ValueError, match="mode must be one of"):
        call(x, x, mode="token_mask")
    for bad in (0.0, -1.0, math.inf, NAN):
        with pytest.raises(ValueError, match="clip_min"):
            call(x, x, clip_min=bad)
        with pytest.raises(ValueError, match="clip_max"):
            call(x, x, clip_max=bad)
    for bad in (True, torch.tensor(2.0), "2"):
        with pytest.raises(TypeError, match="clip_max"):
            call(x, x, clip_max=bad)
    for lo, hi in ((2.0, 2.0), (3.0, 2.0)):
        with pytest.raises(ValueError, match=r"clip_min .* must be < clip_max"):
            call(x, x, clip_min=lo, clip_max=hi)
    with pytest.raises(ValueError, match="rollout_logprobs is on meta"):
        call(x, x.to("meta"))
    with pytest.raises(ValueError, match="mask is on meta"):
        call(x, x, torch.ones(2, 3, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="backend"):
        call(x, x, backend="cuda")
    with pytest.raises(TypeError):
        call(x, x, None, "token")  # everything after mask is keyword-only
