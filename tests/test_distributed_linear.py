"""Vocabulary-parallel fused lm_head (issue 16): ``linear_token_logprobs`` /
``linear_policy_loss`` / ``compat.verl.linear_cross_entropy`` with a process group, gloo on
CPU, the Triton interpreter and the reference backend, world sizes 2 and 3.

Each rank holds its ``(V_local, H)`` lm_head shard (and bias shard), ``hidden`` is the same
on every rank, targets are global ids. Every rank must return the unsharded call's values,
the weight / bias shards of the unsharded gradient, and the whole unsharded hidden gradient
(``reduce_hidden_grad=True``, the default) or a partial that sums to it over the ranks
(``False``, verl's contract); with two all-reduces forward whatever the number of chunks
and one (the hidden gradient) backward. One spawn per world size runs every check on every
rank, as ``tests/test_distributed.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_rl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_harness import (  # noqa: E402
    check_registry,
    failures,
    needs_gloo,
    needs_interpreter,
    world_cases,
)
from helpers import FP32_TOL, assert_rel, oracle_token_stats, rel_err  # noqa: E402
from test_distributed import _CountCollectives, _group_ok  # noqa: E402

WORLD_SIZES = (2, 3)
BACKENDS = ("triton", "reference")
CHECKS, check = check_registry()
H = 4


def _bounds(widths, rank):
    start = sum(widths[:rank])
    return start, start + widths[rank]


def _problem(g, V, B=2, S=5, T=3, dtype=torch.float32):
    """Replicated hidden ``(B, S, H)`` (S > T: the causal shift), the full lm_head and bias,
    targets with an ignored token and the extreme ids, upstream gradients."""
    hidden = torch.randn(B, S, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 0], targets[1, -1], targets[1, 0] = V - 1, 0, -100
    gl = torch.randn(B, T, generator=g, dtype=dtype)
    gh = torch.randn(B, T, generator=g, dtype=dtype)
    return hidden, weight, bias, targets, gl, gh


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _run(hidden, weight, bias, targets, gl, gh, **kw):
    """``(logp, entropy, dH, dW, db)`` of ``(logp * gl + entropy * gh).sum()``."""
    h, w, b = _leaf(hidden), _leaf(weight), _leaf(bias)
    lp, ent = fused_rl.linear_token_logprobs(h, w, targets, bias=b, return_entropy=True, **kw)
    (lp * gl + ent * gh).sum().backward()
    return lp, ent, h.grad, w.grad, b.grad


def _oracle(hidden, weight, bias, targets, gl, gh, temperature=1.0):
    """float64 through ``F.linear`` and ``log_softmax`` on the whole vocabulary."""
    h, w, b = (_leaf(t.double()) for t in (hidden, weight, bias))
    T = targets.shape[1]
    z = F.linear(h[:, -T - 1 : -1], w, b)
    lp, ent = oracle_token_stats(z, targets, temperature)
    (lp * gl.double() + ent * gh.double()).sum().backward()
    return lp, ent, h.grad, w.grad, b.grad


def _compare(out, ref, start, stop, tol, what):
    lp, ent, dh, dw, db = out
    assert_rel(lp, ref[0], tol, f"logp {what}")
    assert_rel(ent, ref[1], tol, f"entropy {what}")
    assert_rel(dh, ref[2], tol, f"hidden grad {what}")
    assert_rel(dw, ref[3][start:stop], tol, f"weight grad {what}")
    assert_rel(db, ref[4][start:stop], tol, f"bias grad {what}")


# ----------------------------------------------------------------------------- checks


@check
def values_and_grads(ctx):
    """Equal shards, several chunks, temperature, ignore_index, S > T: values, entropy and
    the three gradients against the float64 oracle and the unsharded call; the hidden
    gradient whole on every rank, or (``reduce_hidden_grad=False``) summing to it."""
    w = 3
    V = w * ctx.world
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    hidden, weight, bias, targets, gl, gh = _problem(ctx.gen(1), V)
    ref = _oracle(hidden, weight, bias, targets, gl, gh, 0.7)
    for backend in BACKENDS:
        kw = dict(temperature=0.7, chunk_tokens=2, backend=backend)
        out = _run(hidden, weight[start:stop], bias[start:stop], targets, gl, gh,
                   process_group=ctx.group, **kw)  # fmt: skip
        _compare(out, ref, start, stop, FP32_TOL, backend)
        assert out[0][1, 0] == 0 and out[1][1, 0] == 0, "ignored token not 0"
        assert (out[2][:, -1] == 0).all() and (out[2][:, 0] == 0).all(), "outside the window"
        unsharded = _run(hidden, weight, bias, targets, gl, gh, **kw)
        _compare(out, unsharded, start, stop, 1e-6, f"vs unsharded {backend}")
        partial = _run(hidden, weight[start:stop], bias[start:stop], targets, gl, gh,
                       process_group=ctx.group, reduce_hidden_grad=False, **kw)  # fmt: skip
        assert_rel(partial[0], out[0], 0.0, "logp, reduce_hidden_grad=False")
        dh = partial[2].clone()
        dist.all_reduce(dh, group=ctx.group)
        assert_rel(dh, ref[2], FP32_TOL, f"summed partial hidden grads {backend}")
        assert_rel(partial[3], out[3], 0.0, "weight grad, reduce_hidden_grad=False")


@check
def logprobs_only_packed(ctx):
    """``return_entropy=False`` with ``(N, H)`` hidden, no bias, every token its own chunk."""
    w, N = 2, 5
    V = w * ctx.world
    g = ctx.gen(2)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    gl = torch.randn(N, generator=g)
    h64, w64 = _leaf(hidden.double()), _leaf(weight.double())
    o_lp = oracle_token_stats(F.linear(h64, w64), targets)[0]
    (o_lp * gl.double()).sum().backward()
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    for backend in BACKENDS:
        h, wt = _leaf(hidden), _leaf(weight[start:stop])
        lp = fused_rl.linear_token_logprobs(
            h, wt, targets, chunk_tokens=1, process_group=ctx.group, backend=backend
        )
        (lp * gl).sum().backward()
        assert_rel(lp, o_lp, FP32_TOL, f"logp {backend}")
        assert_rel(h.grad, h64.grad, FP32_TOL, f"hidden grad {backend}")
        assert_rel(wt.grad, w64.grad[start:stop], FP32_TOL, f"weight grad {backend}")


@check
def ragged_and_padded(ctx):
    """``vocab_start`` / ``vocab_size``: ragged shards (world 3: rank 1 holds no row), and
    equal shards padded at the end (padding rows, even NaN ones, change nothing and get a
    zero gradient)."""
    widths = [4, 2] if ctx.world == 2 else [3, 0, 4]
    V = sum(widths)
    start, stop = _bounds(widths, ctx.rank)
    hidden, weight, bias, targets, gl, gh = _problem(ctx.gen(3), V)
    targets[0, 1] = widths[0]  # the first id of the second shard
    ref = _oracle(hidden, weight, bias, targets, gl, gh)
    for backend in BACKENDS:
        out = _run(hidden, weight[start:stop], bias[start:stop], targets, gl, gh,
                   process_group=ctx.group, vocab_start=start, vocab_size=V, chunk_tokens=4,
                   backend=backend)  # fmt: skip
        _compare(out, ref, start, stop, FP32_TOL, f"ragged {backend}")
    V = 5
    w = -(-V // ctx.world)
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    hidden, weight, bias, targets, gl, gh = _problem(ctx.gen(4), w * ctx.world)
    targets = targets.clamp(max=V - 1)
    weight[V:], bias[V:] = float("nan"), float("nan")
    ref = _oracle(hidden, weight[:V], bias[:V], targets, gl, gh)
    valid = max(0, min(stop, V) - start)
    for backend in BACKENDS:
        lp, ent, dh, dw, db = _run(hidden, weight[start:stop], bias[start:stop], targets, gl,
                                   gh, process_group=ctx.group, vocab_size=V, chunk_tokens=3,
                                   backend=backend)  # fmt: skip
        _compare((lp, ent, dh, dw[:valid], db[:valid]), ref, start, start + valid, FP32_TOL,
                 f"padded {backend}")  # fmt: skip
        assert (dw[valid:] == 0).all() and (db[valid:] == 0).all(), "padding got a gradient"


@check
def collective_count(ctx):
    """Two all-reduces forward however many chunks (the merge: 12 bytes a token, 16 with
    the entropy, plus the header), one backward: the ``(N, H)`` hidden gradient (none with
    ``reduce_hidden_grad=False`` or a hidden that needs no gradient)."""
    w, B, T = 2, 2, 3
    V = w * ctx.world
    N = B * T
    header = (2 * ctx.world + 4) * 4
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    hidden, weight, bias, targets, gl, gh = _problem(ctx.gen(5), V, B=B, T=T)
    for backend in BACKENDS:
        for entropy, reduce, needs_h in ((True, True, True), (False, True, True),
                                         (True, False, True), (False, True, False)):  # fmt: skip
            h = _leaf(hidden) if needs_h else hidden
            wt = _leaf(weight[start:stop])
            with _CountCollectives() as fwd:
                out = fused_rl.linear_token_logprobs(
                    h, wt, targets, return_entropy=entropy, chunk_tokens=1,
                    process_group=ctx.group, reduce_hidden_grad=reduce, backend=backend,
                )  # fmt: skip
            loss = (out[0] * gl + out[1] * gh).sum() if entropy else (out * gl).sum()
            with _CountCollectives() as bwd:
                loss.backward()
            what = f"{backend} entropy={entropy} reduce={reduce} needs_h={needs_h}"
            assert [c[0] for c in fwd.calls] == ["all_reduce"] * 2, f"{what}: {fwd.calls}"
            total = sum(c[1] for c in fwd.calls)
            assert total == (16 if entropy else 12) * N + header, f"{what}: {total} bytes"
            expected = [("all_reduce", N * H * 4)] if reduce and needs_h else []
            assert bwd.calls == expected, f"{what} backward: {bwd.calls}"


def _grpo_variants(B, T, g):
    shifts = torch.tensor([-0.4, -0.1, 0.05, 0.3])
    shift_tok = shifts[torch.randint(0, len(shifts), (B, T), generator=g)]
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g)
    return [
        ("grpo", dict(advantages=adv, old_shift=shift_tok, mask=mask, ref_shift=0.3, beta=0.04,
                      kl_estimator="k3", eps_high=0.28, loss_agg="seq-mean-token-mean",
                      temperature=0.8, entropy_coef=0.01)),
        ("gspo", dict(advantages=adv, old_shift=shifts[:B, None].expand(B, T), mask=mask,
                      importance_sampling="sequence", eps_low=3e-4, eps_high=4e-4,
                      with_entropy=True)),
    ]  # fmt: skip


@check
def policy_loss_vocab_parallel(ctx):
    """``linear_policy_loss(..., process_group=)`` (GRPO with KL, entropy bonus, dual-clip
    free; GSPO): loss, every metric and the gradients equal the unsharded call's."""
    w, B, T = 3, 3, 3
    V = w * ctx.world
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    g = ctx.gen(6)
    hidden, weight, bias, targets, _, _ = _problem(g, V, B=B, S=T + 1, T=T)
    for name, kw in _grpo_variants(B, T, g):
        kw = dict(kw)
        adv, old_shift = kw.pop("advantages"), kw.pop("old_shift")
        ref_shift = kw.pop("ref_shift", None)
        with torch.no_grad():
            logp = fused_rl.linear_token_logprobs(
                hidden, weight, targets, bias=bias, temperature=kw.get("temperature", 1.0),
                backend="reference",
            )  # fmt: skip
        kw["old_logprobs"] = logp + old_shift
        if ref_shift is not None:
            kw["ref_logprobs"] = logp + ref_shift
        h0, w0, b0 = _leaf(hidden), _leaf(weight), _leaf(bias)
        ref_loss, ref_metrics = fused_rl.linear_policy_loss(
            h0, w0, targets, adv, bias=b0, backend="reference", **kw
        )
        ref_loss.backward()
        for backend in BACKENDS:
            what = f"{name} {backend}"
            h, wt, b = _leaf(hidden), _leaf(weight[start:stop]), _leaf(bias[start:stop])
            loss, metrics = fused_rl.linear_policy_loss(
                h, wt, targets, adv, bias=b, chunk_tokens=2, process_group=ctx.group,
                backend=backend, **kw,
            )  # fmt: skip
            loss.backward()
            assert_rel(loss, ref_loss, FP32_TOL, f"loss {what}")
            assert sorted(metrics) == sorted(ref_metrics), (sorted(metrics), what)
            for key, value in metrics.items():
                assert_rel(value, ref_metrics[key], FP32_TOL, f"{key} {what}")
            assert_rel(h.grad, h0.grad, FP32_TOL, f"hidden grad {what}")
            assert_rel(wt.grad, w0.grad[start:stop], FP32_TOL, f"weight grad {what}")
            assert_rel(b.grad, b0.grad[start:stop], FP32_TOL, f"bias grad {what}")


@check
def verl_linear_cross_entropy(ctx):
    """``compat.verl.linear_cross_entropy(..., dist_process_group=)``: verl's vocab-parallel
    contract, global log-probs / entropy on every rank, the weight shard's gradient, and
    each rank's PARTIAL hidden gradient (verl's backward does not reduce it; its callers
    do, e.g. through Megatron's sequence-parallel gather)."""
    from fused_rl.compat import verl

    w, N = 3, 5
    V = w * ctx.world
    start, stop = _bounds([w] * ctx.world, ctx.rank)
    g = ctx.gen(7)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    gl, gh = torch.randn(N, generator=g), torch.randn(N, generator=g)
    h64, w64 = _leaf(hidden.double()), _leaf(weight.double())
    o_lp, o_ent = oracle_token_stats(F.linear(h64, w64) / 1.3, labels)
    (o_lp * gl.double() + o_ent * gh.double()).sum().backward()
    h, wt = _leaf(hidden), _leaf(weight[start:stop])
    lp, ent = verl.linear_cross_entropy(h, wt, labels, 1.3, "none", ctx.group)
    (lp * gl + ent * gh).sum().backward()
    assert_rel(lp, o_lp, FP32_TOL, "logp")
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    assert_rel(wt.grad, w64.grad[start:stop], FP32_TOL, "weight grad")
    dh = h.grad.clone()
    assert rel_err(dh, h64.grad) > 1e-3, "the hidden gradient was reduced (verl: partial)"
    dist.all_reduce(dh, group=ctx.group)
    assert_rel(dh, h64.grad, FP32_TOL, "summed hidden grad")
    total, _ = verl.linear_cross_entropy(hidden, weight[start:stop], labels, 1.3, "sum",
                                         dist_process_group=ctx.group)  # fmt: skip
    assert_rel(total, o_lp.sum(), FP32_TOL, "reduction sum")
    bad = labels.clone()
    bad[2] = V
    with pytest.raises(ValueError, match=rf"^labels holds {V}, outside \[0, V\) = \[0, {V}\)"):
        verl.linear_cross_entropy(hidden, weight[start:stop], bad, dist_process_group=ctx.group)
    _group_ok(ctx)


@check
def errors(ctx):
    """Bad layouts and targets raise ValueError naming the argument on every rank, and
    leave the group usable; local argument errors raise before any collective."""
    g = ctx.gen(8)
    V = 2 * ctx.world
    hidden = torch.randn(2, 4, H, generator=g)
    targets = torch.randint(0, V, (2, 3), generator=g)
    op = fused_rl.linear_token_logprobs
    for backend in BACKENDS:
        grp = dict(process_group=ctx.group, backend=backend, chunk_tokens=2)
        wide = torch.randn(2 + (ctx.rank == ctx.world - 1), H, generator=g)
        with pytest.raises(ValueError, match=r"^weight: .* differ in width"):
            op(hidden, wide, targets, **grp)
        _group_ok(ctx)
        with pytest.raises(ValueError, match=r"^weight: .* differ in width"):
            fused_rl.linear_policy_loss(hidden, wide, targets, torch.ones(2), **grp)
        _group_ok(ctx)
        weight = torch.randn(2, H, generator=g)
        for bad in (V, -3):
            t = targets.clone()
            t[1, 1] = bad
            with pytest.raises(ValueError, match=rf"^targets holds {bad}, outside \[0, V\)"):
                op(hidden, weight, t, **grp)
            _group_ok(ctx)
        with pytest.raises(ValueError, match=rf"^vocab_size = {V + 1}, but the shards cover"):
            op(hidden, weight, targets, vocab_size=V + 1, **grp)
        _group_ok(ctx)
        with pytest.raises(ValueError, match="^vocab_start: the shards must be contiguous"):
            op(hidden, weight, targets, vocab_start=2 * ctx.rank + (ctx.rank == 1),
               vocab_size=V, **grp)  # fmt: skip
        _group_ok(ctx)
        # local, before any collective
        with pytest.raises(ValueError, match="need process_group"):
            op(hidden, weight, targets, vocab_size=V)
        with pytest.raises(ValueError, match="vocab_start needs vocab_size"):
            op(hidden, weight, targets, vocab_start=0, **grp)
        with pytest.raises(TypeError, match="reduce_hidden_grad"):
            op(hidden, weight, targets, reduce_hidden_grad=1, **grp)
        with pytest.raises(ValueError, match="weight must have at least one row"):
            op(hidden, weight[:0], targets)  # unsharded: an empty lm_head
        _group_ok(ctx)


@check
def double_backward_raises(ctx):
    V = 2 * ctx.world
    start, stop = _bounds([2] * ctx.world, ctx.rank)
    g = ctx.gen(9)
    h = torch.randn(3, H, generator=g, requires_grad=True)
    wt = _leaf(torch.randn(V, H, generator=g)[start:stop])
    lp = fused_rl.linear_token_logprobs(h, wt, torch.tensor([0, V - 1, 1]),
                                        process_group=ctx.group)  # fmt: skip
    (grad,) = torch.autograd.grad(lp.sum(), wt, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        grad.sum().backward()


@pytest.mark.parametrize("world, name", world_cases(CHECKS, WORLD_SIZES))
@needs_gloo
@needs_interpreter
def test_vocab_parallel_linear(world, name):
    failed = failures(__name__, world, name)
    assert not failed, "\n".join(failed)


def test_signatures():
    """The vocab-parallel keywords, before ``backend``, on both linear ops."""
    import inspect

    for fn in (fused_rl.linear_token_logprobs, fused_rl.linear_policy_loss):
        names = list(inspect.signature(fn).parameters)
        assert names[-5:] == [
            "process_group", "vocab_start", "vocab_size", "reduce_hidden_grad", "backend"
        ]  # fmt: skip
