"""Vocabulary-parallel log-probs on torch.distributed (issue 16): gloo on CPU, the Triton
interpreter, world sizes 2 and 3.

Every rank must return the unsharded call's values (checked against the float64 oracle on
the concatenated vocabulary, and against the unsharded fused call), and its shard of the
unsharded gradient under a random upstream gradient; with two all-reduces forward and none
backward. One ``torch.multiprocessing.spawn`` per world size runs every check in order on
every rank (the process group's timeout turns a hang into a failure); each rank writes its
verdicts to a file, and one test per (world size, check) reads them.
"""

from __future__ import annotations

import contextlib
import math
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fused_rl
from fused_rl import config
from fused_rl.nn import PolicyLoss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_harness import (  # noqa: E402
    check_registry,
    failures,
    needs_gloo,
    needs_interpreter,
    unpoisoned,
    world_cases,
)
from helpers import (  # noqa: E402
    F64_TOL,
    FP32_TOL,
    assert_rel,
    fp32_neighbours_sharing_z,
    oracle_token_stats,
)

WORLD_SIZES = (2, 3)
BACKENDS = ("triton", "reference")
CHECKS, check = check_registry()
# distillation between models of their own logit scale / soft cap (tests/test_distill.py
# SPLIT_CASES: all four differing, the teacher's cap only, the student's scale only)
OWN_TRANSFORMS = (
    dict(logit_scale=1.5, softcap=4.0, teacher_logit_scale=0.6, teacher_softcap=2.5),
    dict(teacher_softcap=2.0),
    dict(logit_scale=2.5),
)


# ----------------------------------------------------------------------------- helpers


def _shard_bounds(widths, rank):
    start = sum(widths[:rank])
    return start, start + widths[rank]


def _oracle(full, targets, g, h, temperature=1.0, ignore_index=-100):
    """float64 ``(logp, entropy, grad of (logp * g + entropy * h).sum())`` on the whole
    vocabulary; ``full`` may be the ``(B, S, V)`` buffer with ``S > T`` targets."""
    x = full.detach().double().requires_grad_()
    window = x
    if targets is not None and targets.dim() >= 1 and x.dim() == targets.dim() + 1:
        if x.shape[-2] > targets.shape[-1]:
            shift = x.shape[-2] - targets.shape[-1] - 1
            window = x.narrow(-2, shift, targets.shape[-1])
    lp, ent = oracle_token_stats(window, targets, temperature, ignore_index)
    loss = ent * h.double() if lp is None else lp * g.double() + ent * h.double()
    loss.sum().backward()
    return lp, ent, x.grad


def _local(full, start, stop):
    return full[..., start:stop].detach().clone().requires_grad_()


def _sharded_logp(local, targets, g, h, backend, **kw):
    lp, ent = fused_rl.token_logprobs(
        local, targets, return_entropy=True, process_group=dist.group.WORLD, backend=backend,
        **kw,
    )  # fmt: skip
    (lp * g + ent * h).sum().backward()
    return lp, ent, local.grad


def _group_ok(ctx):
    """The group is still in step after an error (no rank left inside a collective)."""
    x = torch.ones(3)
    dist.all_reduce(x, group=ctx.group)
    assert x.tolist() == [float(ctx.world)] * 3


# ----------------------------------------------------------------------------- checks


@check
def values_and_grads(ctx):
    """Equal shards, the model's (B, S, V) buffer with S > T targets, temperature,
    ignore_index, a target on the last rank's last column and on the first column; logits
    offset by 1e3 too, at T = 1 (the statistics stay relative to the row max; ``x / 0.7``
    in fp32 would round the offset logits by ~1e-4, unsharded alike)."""
    w = 5
    V = w * ctx.world
    g = ctx.gen(1)
    for offset, temperature in ((0.0, 0.7), (1e3, 1.0)):
        full = torch.randn(2, 5, V, generator=g) * 2 + offset
        targets = torch.randint(0, V, (2, 3), generator=g)
        targets[0, 0], targets[1, 2], targets[1, 0] = V - 1, 0, -100
        gl, gh = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
        o_lp, o_ent, o_grad = _oracle(full, targets, gl, gh, temperature)
        start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
        for backend in BACKENDS:
            local = _local(full, start, stop)
            lp, ent, grad = _sharded_logp(local, targets, gl, gh, backend, temperature=temperature)
            what = f"{backend}, offset {offset}"
            assert_rel(lp, o_lp, FP32_TOL, f"logp {what}")
            assert_rel(ent, o_ent, FP32_TOL, f"entropy {what}")
            assert_rel(grad, o_grad[..., start:stop], FP32_TOL, f"grad {what}")
            assert lp[1, 0] == 0 and ent[1, 0] == 0, "ignored token not 0"
            assert (grad[:, 0] == 0).all() and (grad[:, -1] == 0).all(), "outside the window"
            # the unsharded fused call on the concatenated vocabulary
            u_lp, u_ent = fused_rl.token_logprobs(
                full, targets, temperature=temperature, return_entropy=True, backend=backend
            )
            assert_rel(lp, u_lp, 1e-6, f"logp vs unsharded {what}")
            assert_rel(ent, u_ent, 1e-6, f"entropy vs unsharded {what}")


@check
def logprobs_only_packed(ctx):
    """``return_entropy=False`` on packed ``(N, V_local)`` logits, non-contiguous."""
    w = 4
    V = w * ctx.world
    g = ctx.gen(2)
    full = torch.randn(V, 6, generator=g).t()  # (6, V), column-major
    targets = torch.randint(0, V, (6,), generator=g)
    targets[2] = V - 1
    gl = torch.randn(6, generator=g)
    o_lp, _, o_grad = _oracle(full, targets, gl, torch.zeros(6))
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    for backend in BACKENDS:
        local = full[:, start:stop].detach().requires_grad_()  # a strided view
        lp = fused_rl.token_logprobs(local, targets, process_group=ctx.group, backend=backend)
        (lp * gl).sum().backward()
        assert_rel(lp, o_lp, FP32_TOL, f"logp {backend}")
        assert_rel(local.grad, o_grad[:, start:stop], FP32_TOL, f"grad {backend}")


@check
def entropy_only(ctx):
    w = 3
    V = w * ctx.world
    g = ctx.gen(3)
    full = torch.randn(2, 4, V, generator=g)
    gh = torch.randn(2, 4, generator=g)
    _, o_ent, o_grad = _oracle(full, None, None, gh, 1.3)
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    for backend in BACKENDS:
        local = _local(full, start, stop)
        ent = fused_rl.token_entropy(
            local, temperature=1.3, process_group=ctx.group, backend=backend
        )
        (ent * gh).sum().backward()
        assert_rel(ent, o_ent, FP32_TOL, f"entropy {backend}")
        assert_rel(local.grad, o_grad[..., start:stop], FP32_TOL, f"grad {backend}")


def _ragged_widths(world):
    return [6, 3] if world == 2 else [4, 0, 5]  # world 3: rank 1 holds no column


@check
def ragged_shards(ctx):
    """``vocab_start`` / ``vocab_size``: shards of different widths, one of them empty."""
    widths = _ragged_widths(ctx.world)
    V = sum(widths)
    g = ctx.gen(4)
    full = torch.randn(3, 2, V, generator=g)
    targets = torch.tensor([[0, V - 1], [widths[0], widths[0] - 1], [-100, V // 2]])
    gl, gh = torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)
    o_lp, o_ent, o_grad = _oracle(full, targets, gl, gh)
    start, stop = _shard_bounds(widths, ctx.rank)
    for backend in BACKENDS:
        local = _local(full, start, stop)
        lp, ent, grad = _sharded_logp(
            local, targets, gl, gh, backend, vocab_start=start, vocab_size=V
        )
        assert_rel(lp, o_lp, FP32_TOL, f"logp {backend}")
        assert_rel(ent, o_ent, FP32_TOL, f"entropy {backend}")
        assert grad.shape == local.shape
        assert_rel(grad, o_grad[..., start:stop], FP32_TOL, f"grad {backend}")


@check
def token_stats_diagnostics(ctx):
    """``token_stats`` / ``linear_token_stats`` with ``process_group=``: the five outputs of
    the unsharded call on ragged shards (world 3: one empty), with ties at the row maximum
    across a shard boundary (the earlier id is the top-1, wherever the later one lives),
    an ignored token and a NaN row; gradients of ``logp`` and ``entropy``."""
    widths = _ragged_widths(ctx.world)
    V = sum(widths)
    g = ctx.gen(41)
    full = torch.randn(2, 4, V, generator=g)
    cut = widths[0]  # the first id of the next non-empty shard
    full[0, 0, cut - 1] = full[0, 0, cut] = 9.0  # a tie across the boundary
    full[0, 1, cut - 1] = full[0, 1, cut] = 9.0
    full[1, 2, 0] = full[1, 2, V - 1] = 9.0  # a tie between the first and the last id
    full[1, 3, 2] = float("nan")
    targets = torch.tensor([[cut, cut - 1, 0, -100], [V - 1, 3, V - 1, 1]])
    targets[1, 0] = full[1, 0].argmax()
    start, stop = _shard_bounds(widths, ctx.rank)
    gl, gh = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    hidden = torch.randn(2, 5, 6, generator=g)
    weight = torch.randn(V, 6, generator=g)
    layout = dict(process_group=ctx.group, vocab_start=start, vocab_size=V)
    for backend in BACKENDS:
        local = _local(full, start, stop)
        got = fused_rl.token_stats(local, targets, backend=backend, **layout)
        want = fused_rl.token_stats(full, targets, backend=backend)
        top1 = got.is_top1.tolist()
        assert [top1[0][0], top1[0][1], top1[0][3]] == [False, True, False], backend
        assert [top1[1][0], top1[1][2], top1[1][3]] == [True, False, False], backend
        for name, a, b in zip(got._fields, got, want):
            if name == "is_top1":
                assert torch.equal(a, b), f"{backend} is_top1"
                continue
            assert torch.equal(a.isnan(), b.isnan()), f"{backend} {name} NaN"
            ok = ~b.isnan()
            assert_rel(a[ok], b[ok], 1e-6, f"{backend} {name} vs unsharded")
        # gradients on the rows without NaN
        keep = torch.ones(2, 4, dtype=torch.bool)
        keep[1, 3] = False
        (torch.where(keep, got.logp * gl + got.entropy * gh, 0.0)).sum().backward()
        whole = full.clone().requires_grad_()
        w = fused_rl.token_stats(whole, targets, backend=backend)
        (torch.where(keep, w.logp * gl + w.entropy * gh, 0.0)).sum().backward()
        assert_rel(local.grad[keep], whole.grad[..., start:stop][keep], FP32_TOL, "grad")
        # from hidden states: this rank's rows of the head
        w_local = weight[start:stop].clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        lin = fused_rl.linear_token_stats(h, w_local, targets, chunk_tokens=3, backend=backend,
                                          **layout)  # fmt: skip
        un = fused_rl.linear_token_stats(hidden, weight, targets, chunk_tokens=3, backend=backend)
        assert torch.equal(lin.is_top1, un.is_top1), f"{backend} linear is_top1"
        for name in ("logp", "entropy", "mean_logit", "log_sum_sq_probs"):
            assert_rel(getattr(lin, name), getattr(un, name), 1e-6, f"{backend} linear {name}")
        (lin.logp.sum() + lin.entropy.sum()).backward()
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        u = fused_rl.linear_token_stats(hh, ww, targets, chunk_tokens=3, backend=backend)
        (u.logp.sum() + u.entropy.sum()).backward()
        assert_rel(h.grad, hh.grad, 1e-6, f"{backend} linear hidden grad")
        assert_rel(w_local.grad, ww.grad[start:stop], 1e-6, f"{backend} linear weight grad")


@check
def megatron_padded(ctx):
    """Equal shards, the vocabulary padded at the end (``vocab_size`` alone): padding
    columns, even NaN / inf ones, change nothing and get exactly zero gradient."""
    for V in (7, 5):
        w = -(-V // ctx.world)
        g = ctx.gen(5 + V)
        full = torch.randn(2, 3, w * ctx.world, generator=g)
        full[..., V:] = float("nan")
        full[0, 0, V:] = float("inf")
        targets = torch.randint(0, V, (2, 3), generator=g)
        targets[0, 0] = V - 1
        gl, gh = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
        o_lp, o_ent, o_grad = _oracle(full[..., :V], targets, gl, gh)
        start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
        for backend in BACKENDS:
            local = _local(full, start, stop)
            lp, ent, grad = _sharded_logp(local, targets, gl, gh, backend, vocab_size=V)
            assert_rel(lp, o_lp, FP32_TOL, f"logp {backend} V={V}")
            assert_rel(ent, o_ent, FP32_TOL, f"entropy {backend} V={V}")
            valid = max(0, min(stop, V) - start)
            assert_rel(grad[..., :valid], o_grad[..., start : start + valid], FP32_TOL, "grad")
            assert (grad[..., valid:] == 0).all(), "padding columns got a gradient"


@check
def fp64(ctx):
    w = 4
    V = w * ctx.world
    g = ctx.gen(6)
    full = torch.randn(2, 3, V, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (2, 3), generator=g)
    gl = torch.randn(2, 3, generator=g, dtype=torch.float64)
    gh = torch.randn(2, 3, generator=g, dtype=torch.float64)
    o_lp, o_ent, o_grad = _oracle(full, targets, gl, gh, 0.9)
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    for backend in BACKENDS:
        local = _local(full, start, stop)
        lp, ent, grad = _sharded_logp(local, targets, gl, gh, backend, temperature=0.9)
        assert lp.dtype == torch.float64 and grad.dtype == torch.float64
        assert_rel(lp, o_lp, F64_TOL, f"logp {backend}")
        assert_rel(ent, o_ent, F64_TOL, f"entropy {backend}")
        assert_rel(grad, o_grad[..., start:stop], F64_TOL, f"grad {backend}")


class _CountCollectives:
    """Wraps every torch.distributed collective: (name, bytes) per call."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single",
             "gather", "scatter", "barrier", "send", "recv")  # fmt: skip

    # the out-of-place (functional) collectives, counted under the same names
    FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")

    def __enter__(self):
        from torch.distributed import _functional_collectives as funcol

        self.calls, self.saved = [], {}
        for module, names in ((dist, self.NAMES), (funcol, self.FUNCTIONAL)):
            for name in names:
                real = getattr(module, name)
                self.saved[module, name] = real

                def wrapped(*args, _real=real, _name=name, **kwargs):
                    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                    self.calls.append((_name, 0 if t is None else t.numel() * t.element_size()))
                    return _real(*args, **kwargs)

                setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc):
        for (module, name), real in self.saved.items():
            setattr(module, name, real)


@check
def collective_count(ctx):
    """Two all-reduces forward: the MAX of the row max (4 bytes per token) with a header of
    ``2 P + 4`` floats, and one packed SUM (4 bytes per token per statistic); none backward."""
    w, N = 3, 5
    V = w * ctx.world
    g = ctx.gen(7)
    full = torch.randn(N, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    header = (2 * ctx.world + 4) * 4
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    cases = (("logp+entropy", 16), ("logp", 12), ("entropy", 12))
    for backend in BACKENDS:
        for case, per_token in cases:
            local = _local(full, start, stop)
            with _CountCollectives() as fwd:
                if case == "entropy":
                    out = fused_rl.token_entropy(local, process_group=ctx.group, backend=backend)
                    loss = out.sum()
                else:
                    out = fused_rl.token_logprobs(
                        local, targets, return_entropy=case != "logp", process_group=ctx.group,
                        backend=backend,
                    )  # fmt: skip
                    loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
            with _CountCollectives() as bwd:
                loss.backward()
            names = [c[0] for c in fwd.calls]
            assert names == ["all_reduce", "all_reduce"], f"{case} forward: {fwd.calls}"
            total = sum(c[1] for c in fwd.calls)
            assert total == per_token * N + header, f"{case}: {total} bytes for {N} tokens"
            assert bwd.calls == [], f"{case} backward communicates: {bwd.calls}"


def _mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ctx.world,))


@check
def fsdp_gather_param(ctx):
    """``gather_param``: an FSDP2-sharded head (a DTensor placed ``Shard(0)``, uneven at 3
    ranks; and HSDP's ``(Replicate, Shard(0))`` on a 2-D mesh) gathered whole for the
    fused-linear ops on each rank's own tokens (data parallel): each rank's log-probs are
    the plain call's, and the head's gradient is the mean over the ranks of each rank's
    gradient (float64, every rank's data rebuilt on every rank), left sharded on the
    DTensor; under no_grad a plain copy; a plain tensor and None pass through; a DTensor
    handed to the op itself raises ``TypeError`` naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fused_rl.distributed import gather_param

    V, H, B, T = 7, 4, 2, 3
    weight = torch.randn(V, H, generator=ctx.gen(5))

    def data(rank):
        g = ctx.gen(100 + rank)
        return (torch.randn(B, T, H, generator=g), torch.randint(0, V, (B, T), generator=g),
                torch.randn(B, T, generator=g))  # fmt: skip

    want = torch.zeros(V, H, dtype=torch.float64)
    for rank in range(ctx.world):
        hidden, targets, up = data(rank)
        w64 = weight.double().requires_grad_()
        logits = (hidden.double() @ w64.T).log_softmax(-1)
        (logits.gather(-1, targets[..., None])[..., 0] * up.double()).sum().backward()
        want += w64.grad / ctx.world
    hidden, targets, up = data(ctx.rank)
    hsdp = init_device_mesh("cpu", (ctx.world, 1))  # replicated over all the ranks here
    layouts = [(_mesh(ctx), [Shard(0)], "triton"), (_mesh(ctx), [Shard(0)], "reference"),
               (hsdp, [Replicate(), Shard(0)], "triton")]  # fmt: skip
    for mesh, placements, backend in layouts:
        sharded = distribute_tensor(weight, mesh, placements).requires_grad_()
        whole = gather_param(sharded)
        assert type(whole) is torch.Tensor and torch.equal(whole.detach(), weight)
        logp = fused_rl.linear_token_logprobs(hidden, whole, targets, backend=backend)
        assert_rel(logp, fused_rl.linear_token_logprobs(hidden, weight, targets), FP32_TOL,
                   f"logp {backend}")  # fmt: skip
        (logp * up).sum().backward()
        assert type(sharded.grad).__name__ == "DTensor"
        assert_rel(sharded.grad.full_tensor(), want, FP32_TOL, f"mean grad {backend}")
        with pytest.raises(TypeError, match="weight is a DTensor"):
            fused_rl.linear_token_logprobs(hidden, sharded, targets, backend=backend)
    with torch.no_grad():
        copy = gather_param(sharded)
    assert copy.grad_fn is None and torch.equal(copy, weight)
    assert gather_param(weight) is weight and gather_param(None) is None


@check
def dtensor(ctx):
    """A DTensor placed Shard(-1) (torch.chunk layout: uneven, world 3 with V = 4 leaves
    rank 2 empty): plain replicated-valued outputs, a DTensor gradient of the same layout."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(ctx)
    for V in (7, 4):
        g = ctx.gen(8 + V)
        full = torch.randn(2, 3, V, generator=g)
        targets = torch.randint(0, V, (2, 3), generator=g)
        targets[0, 0] = V - 1
        gl, gh = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
        o_lp, o_ent, o_grad = _oracle(full, targets, gl, gh)
        chunks = torch.arange(V).chunk(ctx.world)
        ids = chunks[ctx.rank] if ctx.rank < len(chunks) else torch.arange(0)
        for backend in BACKENDS:
            dt = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
            t_in = distribute_tensor(targets, mesh, [Replicate()]) if V == 7 else targets
            lp, ent = fused_rl.token_logprobs(dt, t_in, return_entropy=True, backend=backend)
            assert type(lp) is torch.Tensor and type(ent) is torch.Tensor
            (lp * gl + ent * gh).sum().backward()
            assert_rel(lp, o_lp, FP32_TOL, f"logp {backend} V={V}")
            assert_rel(ent, o_ent, FP32_TOL, f"entropy {backend} V={V}")
            local_grad = dt.grad.to_local()
            assert local_grad.shape[-1] == len(ids)
            if len(ids):
                assert_rel(local_grad, o_grad[..., ids], FP32_TOL, f"grad {backend} V={V}")
            if backend == "triton":
                ent2 = fused_rl.token_entropy(distribute_tensor(full, mesh, [Shard(-1)]))
                assert_rel(ent2, oracle_token_stats(full, None)[1], FP32_TOL, "token_entropy")
    # replicated over the vocabulary: an ordinary call on the local tensor
    full = torch.randn(2, 5, generator=ctx.gen(9))
    rep = distribute_tensor(full, mesh, [Replicate()])
    t = torch.tensor([0, 4])
    assert_rel(fused_rl.token_logprobs(rep, t), oracle_token_stats(full, t)[0], FP32_TOL, "rep")
    with pytest.raises(ValueError, match="process_group"):
        fused_rl.token_logprobs(
            distribute_tensor(full, mesh, [Shard(1)]), t, process_group=ctx.group
        )


@check
def errors(ctx):
    """Bad layouts and targets raise ValueError naming the argument on every rank, and
    leave the group usable (no rank stuck in a collective)."""
    g = ctx.gen(10)
    targets = torch.randint(0, 6, (2, 3), generator=g)
    wide = 3 + (ctx.rank == ctx.world - 1)  # the last shard one column wider
    logp = fused_rl.token_logprobs
    for backend in BACKENDS:
        grp = dict(process_group=ctx.group, backend=backend)
        x = torch.randn(2, 3, wide, generator=g)
        with pytest.raises(ValueError, match=r"^logits: .* differ in width"):
            logp(x, targets, **grp)
        _group_ok(ctx)
        with pytest.raises(ValueError, match=r"^logits: .*V_local per rank"):
            fused_rl.token_entropy(x, **grp)
        _group_ok(ctx)
        x = torch.randn(2, 3, 3, generator=g)
        V = 3 * ctx.world
        for bad in (V, V + 7, -3):
            t = targets.clone()
            t[1, 1] = bad
            with pytest.raises(
                ValueError, match=rf"^targets holds {bad}, outside \[0, V\) = \[0, {V}\)"
            ):
                logp(x, t, **grp)
            _group_ok(ctx)
        with pytest.raises(ValueError, match=rf"^vocab_size = {V + 1}, but the shards cover"):
            logp(x, targets, vocab_size=V + 1, **grp)
        _group_ok(ctx)
        with pytest.raises(ValueError, match="^vocab_size differs across the process group"):
            logp(x, targets, vocab_size=V - ctx.rank, **grp)  # a different size per rank
        _group_ok(ctx)
        start = 3 * ctx.rank + (1 if ctx.rank == 1 else 0)  # a gap after rank 0
        with pytest.raises(ValueError, match="^vocab_start: the shards must be contiguous"):
            logp(x, targets, vocab_start=start, vocab_size=V, **grp)
        _group_ok(ctx)
        # checked locally, before any collective
        with pytest.raises(ValueError, match="vocab_start needs vocab_size"):
            logp(x, targets, vocab_start=0, **grp)
        with pytest.raises(ValueError, match="need process_group"):
            logp(x, targets, vocab_size=V)
        with pytest.raises(ValueError, match="temperature"):
            logp(x, targets, temperature=0.0, **grp)
        with pytest.raises(ValueError, match="targets"):
            logp(x, targets[:1], **grp)
        with pytest.raises(TypeError, match="vocab_start"):
            logp(x, targets, vocab_start=1.5, vocab_size=V, **grp)
        _group_ok(ctx)


@check
def unchecked_gives_nan(ctx):
    """With ``config.check_values = False`` nothing is read on the host: a target outside
    [0, V) gives NaN at its token (the other tokens unchanged), a bad layout NaN everywhere."""
    g = ctx.gen(11)
    V = 3 * ctx.world
    full = torch.randn(2, 3, V, generator=g)
    targets = torch.randint(0, V, (2, 3), generator=g)
    start, stop = _shard_bounds([3] * ctx.world, ctx.rank)
    o_lp = oracle_token_stats(full, targets)[0]
    config.check_values = False
    try:
        for backend in BACKENDS:
            for bad in (V, V + 5, -1, -2, -3):
                t = targets.clone()
                t[0, 1] = bad
                lp = fused_rl.token_logprobs(
                    full[..., start:stop], t, process_group=ctx.group, backend=backend
                )
                assert torch.isnan(lp[0, 1]), f"target {bad}: {lp[0, 1]}"
                keep = torch.ones_like(t, dtype=torch.bool)
                keep[0, 1] = False
                assert_rel(lp[keep], o_lp[keep], FP32_TOL, f"others, target {bad}")
            x = torch.randn(2, 3, 3 + (ctx.rank == 0), generator=g)
            lp, ent = fused_rl.token_logprobs(
                x, targets, return_entropy=True, process_group=ctx.group, backend=backend
            )
            assert torch.isnan(lp).all() and torch.isnan(ent).all(), "bad layout not NaN"
    finally:
        config.check_values = True


@check
def nan_and_masked_shards(ctx):
    """A NaN logit on one rank makes its row NaN on every rank; a row whose whole shard is
    -inf on one rank (vocabulary masked there) is finite and exact."""
    g = ctx.gen(12)
    V = 3 * ctx.world
    full = torch.randn(3, V, generator=g)
    full[0, V - 2] = float("nan")
    full[1:, :3] = float("-inf")  # rank 0's whole shard in rows 1 and 2
    targets = torch.tensor([1, V - 1, 0])
    start, stop = _shard_bounds([3] * ctx.world, ctx.rank)
    o_lp, o_ent = oracle_token_stats(full, targets)
    for backend in BACKENDS:
        lp, ent = fused_rl.token_logprobs(
            full[:, start:stop], targets, return_entropy=True, process_group=ctx.group,
            backend=backend,
        )  # fmt: skip
        assert torch.isnan(lp[0]) and torch.isnan(ent[0]), "NaN in, not NaN out"
        assert_rel(lp[1:2], o_lp[1:2], FP32_TOL, f"masked shard logp {backend}")
        assert_rel(ent[1:], o_ent[1:], FP32_TOL, f"masked shard entropy {backend}")
        assert lp[2] == float("-inf") or torch.isnan(lp[2]), lp[2]  # its target was masked


@check
def double_backward_raises(ctx):
    V = 3 * ctx.world
    start, stop = _shard_bounds([3] * ctx.world, ctx.rank)
    local = _local(torch.randn(2, V, generator=ctx.gen(13)), start, stop)
    lp = fused_rl.token_logprobs(local, torch.tensor([0, V - 1]), process_group=ctx.group)
    (grad,) = torch.autograd.grad(lp.sum(), local, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        grad.sum().backward()


@check
def token_count_dp_invariance(ctx):
    """``global_token_count``: ``policy_loss(token-mean, num_items=...)`` summed over
    data-parallel ranks equals the loss of the concatenated batch; the gradients match."""
    from fused_rl.distributed import global_token_count

    g = ctx.gen(14)
    sizes = [r + 1 for r in range(ctx.world)]  # unequal shares of the batch
    B, T, V = sum(sizes), 4, 9
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 2.2
    mask = torch.rand(B, T, generator=g) > 0.3
    weights = torch.rand(B, T, generator=g) * mask
    lo = sum(sizes[: ctx.rank])
    hi = lo + sizes[ctx.rank]
    # a bool count through the Triton kernel's num_items tensor, float weights through the
    # reference; the unsharded loss on the reference backend (its parity with the kernels is
    # tests/test_policy*.py's job)
    for m, backend in ((mask, "triton"), (weights, "reference")):
        count = global_token_count(m[lo:hi])
        assert count.dtype == (torch.float32 if m.is_floating_point() else torch.int64)
        assert_rel(count, m.double().sum(), 1e-7, "count")
        kw = dict(loss_agg="token-mean", eps_high=0.28)
        full = logits.clone().requires_grad_()
        ref_loss, _ = fused_rl.policy_loss(
            full, targets, adv, mask=m, old_logprobs=old, backend="reference", **kw
        )
        ref_loss.backward()
        mine = logits[lo:hi].clone().requires_grad_()
        loss, _ = fused_rl.policy_loss(
            mine, targets[lo:hi], adv[lo:hi], mask=m[lo:hi], old_logprobs=old[lo:hi],
            num_items=count, backend=backend, **kw,
        )  # fmt: skip
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_rel(total, ref_loss, FP32_TOL, f"summed loss {backend}")
        assert_rel(mine.grad, full.grad[lo:hi], FP32_TOL, f"grad {backend}")
    with pytest.raises(ValueError, match="mask"):
        global_token_count(torch.tensor([1.0, -1.0]))


def _policy_variants(B, T, g):
    """(name, keyword arguments of policy_loss) covering token and sequence importance
    sampling, KL, the entropy bonus and metric, masks, ignore_index, num_items, another
    surrogate with rollout IS weights. The old log-probs sit ``old_shift`` away from the
    current ones, far from the clip boundaries (a token crossing one between two runs would
    flip its whole gradient row); ``ref_shift`` likewise for the reference policy."""
    shifts = torch.tensor([-0.5, -0.1, 0.05, 0.3, 0.6, -0.3])
    shift_tok = shifts[torch.randint(0, len(shifts), (B, T), generator=g)]
    shift_seq = shifts[:B, None].expand(B, T)
    mask = torch.rand(B, T, generator=g) > 0.25
    weights = torch.rand(B, T, generator=g) * mask
    adv = torch.randn(B, generator=g)
    return [
        ("ppo_kl_entropy", dict(
            advantages=torch.randn(B, T, generator=g), old_shift=shift_tok, mask=mask,
            ref_shift=0.3, beta=0.04, kl_estimator="k3", entropy_coef=0.01, temperature=0.8,
            eps_high=0.28, dual_clip=3.0, loss_agg="seq-mean-token-mean")),
        ("gspo", dict(
            advantages=adv, old_shift=shift_seq, mask=weights, importance_sampling="sequence",
            eps_low=3e-4, eps_high=4e-4, with_entropy=True)),
        ("on_policy_num_items", dict(
            advantages=adv, old_shift=None, mask=None, with_entropy=True, num_items=7.0,
            loss_agg="token-mean")),
        ("cispo_is_weights", dict(
            advantages=adv, old_shift=shift_tok, mask=mask, surrogate="cispo",
            is_weights=torch.rand(B, T, generator=g) + 0.5, ref_shift=0.3, beta=0.04,
            kl_bias_correction=True)),
    ]  # fmt: skip


@check
def policy_loss_vocab_parallel(ctx):
    """Step 4: ``policy_loss(..., process_group=...)``, ``nn.PolicyLoss(process_group=...)``
    and a DTensor: loss, every metric and the gradient shard equal the unsharded call's."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from fused_rl.nn import PolicyLoss

    w, B, T = 4, 3, 3
    V = w * ctx.world
    g = ctx.gen(15)
    full = torch.randn(B, T + 1, V, generator=g)  # the model's buffer: S = T + 1
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 0], targets[1, 1] = V - 1, -100
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    mesh = _mesh(ctx)
    for i, (name, kw) in enumerate(_policy_variants(B, T, g)):
        kw = dict(kw)
        adv, old_shift = kw.pop("advantages"), kw.pop("old_shift")
        ref_shift = kw.pop("ref_shift", None)
        # the unsharded call (the reference backend: its parity with the fused kernels is
        # tests/test_policy*.py's job; this keeps the interpreter's work small)
        with torch.no_grad():
            logp = fused_rl.token_logprobs(
                full, targets, temperature=kw.get("temperature", 1.0), backend="reference"
            )
        if old_shift is not None:
            kw["old_logprobs"] = logp + old_shift
        if ref_shift is not None:
            kw["ref_logprobs"] = logp + ref_shift
        whole = full.clone().requires_grad_()
        ref_loss, ref_metrics = fused_rl.policy_loss(whole, targets, adv, backend="reference", **kw)
        ref_loss.backward()
        for backend in BACKENDS:
            what = f"{name} {backend}"
            runs = {"process_group": partial(fused_rl.policy_loss, process_group=ctx.group)}
            if i == 0:
                module_kw = {k: v for k, v in kw.items() if k in PolicyLoss.OPTIONS}
                call_kw = {k: v for k, v in kw.items() if k not in PolicyLoss.OPTIONS}
                module = PolicyLoss(process_group=ctx.group, backend=backend, **module_kw)
                runs["nn.PolicyLoss"] = lambda x, t, a, m=module, c=call_kw: m(x, t, a, **c)
            if i == 1:
                runs["DTensor"] = fused_rl.policy_loss
            for how, run in runs.items():
                if how == "DTensor":
                    local = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
                    ids = torch.arange(V).chunk(ctx.world)[ctx.rank]
                else:
                    local, ids = _local(full, start, stop), torch.arange(start, stop)
                if how == "nn.PolicyLoss":
                    loss, metrics = run(local, targets, adv)
                else:
                    loss, metrics = run(local, targets, adv, backend=backend, **kw)
                loss.backward()
                grad = local.grad.to_local() if how == "DTensor" else local.grad
                assert_rel(loss, ref_loss, FP32_TOL, f"loss {what} {how}")
                assert sorted(metrics) == sorted(ref_metrics), (sorted(metrics), what)
                for key, value in metrics.items():
                    assert_rel(value, ref_metrics[key], FP32_TOL, f"{key} {what} {how}")
                assert_rel(grad, whole.grad[..., ids], FP32_TOL, f"grad {what} {how}")


@check
def exact_kl_vocab_parallel(ctx):
    """``token_kl(process_group=)`` and ``policy_loss(ref_logits=, kl_estimator="full",
    process_group=)``: every rank the unsharded values (the float64 oracle on the whole
    vocabulary; the unsharded fused call), and its shard of the gradient, under a random
    upstream gradient; a reference near the policy and one far from it."""
    w, B, T = 5, 2, 3
    V = w * ctx.world
    g = ctx.gen(31)
    full = torch.randn(B, T + 1, V, generator=g) * 2  # the model's buffer: S = T + 1
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[1, 2] = -100
    mask = torch.rand(B, T, generator=g) > 0.2
    up = torch.randn(B, T, generator=g)
    spreads = (1.0, 1e-2)
    ref_fulls = [full + spread * torch.randn(full.shape, generator=g) for spread in spreads]
    kw = dict(kl_estimator="full", beta=0.3, mask=mask, importance_sampling="sequence",
              entropy_coef=0.01)  # fmt: skip

    def unsharded(ref_full):
        whole = full.clone().requires_grad_()
        loss, metrics = fused_rl.policy_loss(
            whole, targets, torch.randn(B, generator=ctx.gen(7)), ref_logits=ref_full,
            backend="triton", **kw,
        )  # fmt: skip
        loss.backward()
        return loss.detach(), metrics, whole.grad

    wants = ctx.once(*(partial(unsharded, ref_full) for ref_full in ref_fulls))
    for spread, ref_full, (ref_loss, ref_metrics, ref_grad) in zip(
        spreads, ref_fulls, wants, strict=True
    ):
        # the oracle: float64 on the whole vocabulary, positions 0 .. T-1 predict the targets
        x = full.double().requires_grad_()
        lp = torch.log_softmax(x[:, :T], -1)
        lq = torch.log_softmax(ref_full[:, :T].double(), -1)
        kl_o = (lp.exp() * (lp - lq)).sum(-1)
        (grad_o,) = torch.autograd.grad((kl_o * up).sum(), x)
        for backend in BACKENDS:
            what = f"spread {spread} {backend}"
            local = _local(full[:, :T], start, stop)
            kl = fused_rl.token_kl(local, ref_full[:, :T, start:stop], process_group=ctx.group,
                                   backend=backend)  # fmt: skip
            assert_rel(kl, kl_o, FP32_TOL if spread == 1.0 else 1e-4, f"token_kl {what}")
            (kl * up).sum().backward()
            assert_rel(local.grad, grad_o[:, :T, start:stop], FP32_TOL, f"token_kl grad {what}")
            mine = _local(full, start, stop)
            loss, metrics = fused_rl.policy_loss(
                mine, targets, torch.randn(B, generator=ctx.gen(7)),
                ref_logits=ref_full[..., start:stop], process_group=ctx.group, backend=backend,
                **kw,
            )  # fmt: skip
            loss.backward()
            assert_rel(loss, ref_loss, FP32_TOL, f"policy_loss {what}")
            assert sorted(metrics) == sorted(ref_metrics)
            for key, value in metrics.items():
                assert_rel(value, ref_metrics[key], 1e-4 if key == "kl" else FP32_TOL,
                           f"{key} {what}")  # fmt: skip
            assert_rel(mine.grad, ref_grad[..., start:stop], FP32_TOL, f"grad {what}")
    # a shard where the policy holds no mass (all -inf there) or underflows (200 below the
    # other shards' logits) while the reference has mass: its share of S_u still counts
    last = _shard_bounds([w] * ctx.world, ctx.world - 1)
    for fill in (-math.inf, -200.0):
        x = full[:, :T].clone()
        x[..., last[0] : last[1]] = fill + (0.0 if fill == -math.inf else x[..., last[0] : last[1]])
        ref_full = full[:, :T] + torch.randn(full[:, :T].shape, generator=g)
        xo = x.double().requires_grad_()
        lp = torch.log_softmax(xo, -1)
        lq = torch.log_softmax(ref_full.double(), -1)
        safe = torch.where(lp == -math.inf, 0.0, lp)  # no 0 * inf in the oracle's backward
        kl_o = torch.where(lp.exp() > 0, lp.exp() * (safe - lq), 0.0).sum(-1)
        (grad_o,) = torch.autograd.grad((kl_o * up).sum(), xo)
        for backend in BACKENDS:
            local = _local(x, start, stop)
            kl = fused_rl.token_kl(local, ref_full[..., start:stop], process_group=ctx.group,
                                   backend=backend)  # fmt: skip
            assert_rel(kl, kl_o, FP32_TOL, f"token_kl with a shard at {fill} {backend}")
            (kl * up).sum().backward()
            assert_rel(local.grad, grad_o[..., start:stop], FP32_TOL, f"grad at {fill} {backend}")


@check(worlds=(2,))
def distill_vocab_parallel(ctx):
    """``distill_loss(process_group=)`` at ``beta`` 0, 1 and two generalized JSDs: every rank
    the unsharded call's loss and every metric (the unsharded fused call, itself checked
    against the float64 oracle in tests/test_distill.py) and its shard of the gradient.
    At 2 ranks only: the divergences merge over 3 ranks in :func:`divergence_layouts`."""
    w, B, T = 4, 2, 5
    V = w * ctx.world
    g = ctx.gen(41)
    full = torch.randn(B, T, V, generator=g) * 2
    teacher = full + torch.randn(full.shape, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :2] = -100
    mask = torch.rand(B, T, generator=g) > 0.2
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    # one model without mass on the last rank's columns (a token): that KL is +inf, as
    # unsharded; the other divergences finite
    last = _shard_bounds([w] * ctx.world, ctx.world - 1)
    models = {}
    for which in ("student", "teacher"):
        x, t = full.clone(), teacher.clone()
        (x if which == "student" else t)[0, 4, last[0] : last[1]] = -math.inf
        models[which] = x, t
    runs = [(which, beta) for which in models for beta in (0.0, 1.0, 0.5)]
    wants = ctx.once(*(partial(fused_rl.distill_loss, *models[which], beta=beta,
                               backend="triton") for which, beta in runs))  # fmt: skip
    for (which, beta), (ref_loss, ref_metrics) in zip(runs, wants, strict=True):
        x, t = models[which]
        for backend in BACKENDS:
            loss, metrics = fused_rl.distill_loss(
                x[..., start:stop], t[..., start:stop], beta=beta, process_group=ctx.group,
                backend=backend,
            )  # fmt: skip
            what = f"{which} -inf, beta {beta} {backend}"
            assert loss.isinf() == ref_loss.isinf(), (what, loss, ref_loss)
            if not ref_loss.isinf():
                assert_rel(loss, ref_loss, FP32_TOL, what)
            for key, value in metrics.items():
                assert value.isinf() == ref_metrics[key].isinf(), (what, key, value)
                assert not value.isnan(), (what, key)
    cases = [
        dict(beta=beta, softcap=softcap)
        for beta, softcap in (
            (0.0, None),
            (1.0, None),
            (0.5, None),
            (0.1, None),
            (1.0, 3.0),
            (0.5, 3.0),
        )
    ]
    cases += [dict(beta=beta, **own) for beta, own in zip((0.0, 1.0, 0.3), OWN_TRANSFORMS)]
    # the aggregations take the merged per-token divergences (no collective of their own):
    # the cases take them in turn
    aggs = ("token-mean", "seq-mean-token-mean")
    runs = [dict(targets=targets, mask=mask, loss_agg=aggs[i % 2], temperature=0.8, **case)
            for i, case in enumerate(cases)]  # fmt: skip

    def unsharded(kw):
        whole = full.clone().requires_grad_()
        loss, metrics = fused_rl.distill_loss(whole, teacher, backend="triton", **kw)
        (loss * 1.7).backward()
        return loss.detach(), metrics, whole.grad

    wants = ctx.once(*(partial(unsharded, kw) for kw in runs))
    for kw, (ref_loss, ref_metrics, ref_grad) in zip(runs, wants, strict=True):
        for backend in BACKENDS:
            what = f"{ {k: v for k, v in kw.items() if k not in ('targets', 'mask')} } {backend}"
            mine = _local(full, start, stop)
            loss, metrics = fused_rl.distill_loss(
                mine, teacher[..., start:stop], process_group=ctx.group, backend=backend, **kw
            )
            (loss * 1.7).backward()
            assert_rel(loss, ref_loss, FP32_TOL, f"loss {what}")
            assert sorted(metrics) == sorted(ref_metrics)
            for key, value in metrics.items():
                assert_rel(value, ref_metrics[key], FP32_TOL, f"{key} {what}")
            assert_rel(mine.grad, ref_grad[..., start:stop], FP32_TOL, f"grad {what}")
    _group_ok(ctx)


@check
def linear_distill_vocab_parallel(ctx):
    """``linear_distill_loss(process_group=)``: lm_head shards of both models, the hidden
    states on every rank: the unsharded call's loss and metrics, the heads' gradient shards
    and the whole hidden gradient, chunk by chunk (3 rows a chunk: several merges)."""
    w, N, H, Ht = 3, 7, 5, 4
    V = w * ctx.world
    g = ctx.gen(51)
    hidden = torch.randn(1, N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = 0.1 * torch.randn(V, generator=g)
    t_hidden = torch.randn(1, N, Ht, generator=g)
    t_weight = torch.randn(V, Ht, generator=g)
    mask = torch.rand(1, N, generator=g) > 0.2
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    targets = torch.randint(0, V, (1, N), generator=g)
    targets[0, 1] = -100
    cases = [
        dict(beta=beta, loss_agg=agg)
        for beta, agg in ((0.0, "token-mean"), (1.0, "seq-mean-token-mean"), (0.5, "token-mean"))
    ]
    cases += [dict(beta=beta, **own) for beta, own in zip((0.3, 0.0, 1.0), OWN_TRANSFORMS)]
    common = dict(mask=mask, chunk_tokens=3, temperature=0.9, targets=targets)

    def unsharded(case):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, metrics = fused_rl.linear_distill_loss(
            leaves[0], leaves[1], t_hidden, t_weight, bias=leaves[2], backend="triton",
            **common, **case,
        )  # fmt: skip
        (loss * 1.3).backward()
        return loss.detach(), metrics, [leaf.grad for leaf in leaves]

    wants = ctx.once(*(partial(unsharded, case) for case in cases))
    for case, (ref_loss, ref_metrics, ref_grads) in zip(cases, wants, strict=True):
        kw = dict(common, **case)
        for backend in BACKENDS:
            what = f"{case} {backend}"
            mine = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
            my_bias = bias[start:stop].clone().requires_grad_()
            loss, metrics = fused_rl.linear_distill_loss(
                mine[0], mine[1], t_hidden, t_weight[start:stop], bias=my_bias,
                process_group=ctx.group, backend=backend, **kw,
            )  # fmt: skip
            (loss * 1.3).backward()
            assert_rel(loss, ref_loss, FP32_TOL, f"loss {what}")
            for key, value in metrics.items():
                assert_rel(value, ref_metrics[key], FP32_TOL, f"{key} {what}")
            assert_rel(mine[0].grad, ref_grads[0], FP32_TOL, f"hidden grad {what}")
            assert_rel(mine[1].grad, ref_grads[1][start:stop], FP32_TOL, f"weight {what}")
            assert_rel(my_bias.grad, ref_grads[2][start:stop], FP32_TOL, f"bias {what}")
    _group_ok(ctx)


def _value_grad(fn, x, up):
    """``fn(leaf)`` and the gradient of ``sum(out * up)`` over its finite entries."""
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    torch.where(torch.isfinite(out), out * up.to(out.dtype), 0.0).sum().backward()
    return out.detach(), leaf.grad


def _same_cut(got, want, what):
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"kept sets differ {what}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"NaN differ {what}"


@check
def truncated_vocab_parallel(ctx):
    """``truncated_logprobs(process_group=)``: every rank the unsharded call's values (and
    the float64 oracle's) and its columns of the gradient, both backends: top-k read off the
    gathered slots (k <= 64) and searched (k > 64), top-p decided by the slots (peaked rows)
    and searched (flat rows, 200 columns a shard), with top-k, temperature, the soft cap, 90
    values tied at the row top spread over the shards (more per shard than k), ignored and
    cut targets; the collectives: a header all-reduce and one all-gather forward for k <=
    64, one all-reduce more per search pass, none backward. At 3 ranks: one case per route
    (the slots, top-p and top-k searched, both) on the Triton backend, not compiled, no bf16
    or infinite logits (2 ranks run those; the reference backend's gathered rows at 3 ranks:
    :func:`truncated_vocab_parallel_layouts`)."""
    from test_truncated import oracle as truncated_oracle

    w = 200
    V = w * ctx.world
    g = ctx.gen(30)
    full = torch.randn(6, V, generator=g) * torch.tensor([8.0, 0.5, 2.0, 1.0, 4.0, 0.3])[:, None]
    full[5, torch.randperm(V, generator=g)[:90]] = 1.5  # 90 tied at the top of a flat row
    full = full.view(2, 3, V)
    targets = torch.randint(0, V, (2, 3), generator=g)
    targets[0, 0] = -100
    targets[0, 1] = int(full[0, 1].argmax())
    targets[1, 2] = int((full[1, 2] == 1.5).nonzero()[-1])
    up = torch.randn(2, 3, generator=g)
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    cases = [dict(top_k=1), dict(top_k=7, temperature=0.7), dict(top_k=64, top_p=0.9),
             dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.99, temperature=0.7),
             dict(top_k=100), dict(top_k=80, top_p=0.7), dict(top_k=9, top_p=0.9, softcap=2.0),
             dict(top_p=0.9, softcap=3.0), dict(top_k=500), dict(top_k=3 * V)]  # fmt: skip
    if ctx.world > 2:  # the merges of more than two shards: each route once
        cases = [dict(top_k=7, temperature=0.7), dict(top_p=0.9), dict(top_k=100),
                 dict(top_k=80, top_p=0.7)]  # fmt: skip
    wants = ctx.once(*(partial(_value_grad, partial(fused_rl.truncated_logprobs,
                                                    targets=targets, **kw), full, up)
                       for kw in cases))  # fmt: skip
    for kw, (want, w_grad) in zip(cases, wants, strict=True):
        unsharded = partial(fused_rl.truncated_logprobs, targets=targets, **kw)
        o_lp = truncated_oracle(full, targets, **kw)
        # the reference gathers whole rows: at 3 ranks truncated_vocab_parallel_layouts
        # gathers them (ragged, one shard empty)
        for backend in BACKENDS if ctx.world == 2 else ("triton",):
            what = f"{kw} {backend}"
            sharded = partial(unsharded, process_group=ctx.group, backend=backend)
            with _CountCollectives() as fwd:
                got, grad = _value_grad(sharded, full[..., start:stop], up)
            _same_cut(got, want, what)
            fin = torch.isfinite(want)
            assert_rel(got[fin], want[fin], 1e-5, f"logp vs unsharded {what}")
            assert_rel(got[fin], o_lp[fin], FP32_TOL, f"logp vs oracle {what}")
            assert_rel(grad, w_grad[..., start:stop], 1e-5, f"grad {what}")
            assert got[0, 0] == 0 and (grad[0, 0] == 0).all(), f"ignored token {what}"
            assert torch.isfinite(got[1, 2]), f"a tied target cut {what}"
            names = [c[0] for c in fwd.calls]
            if backend == "triton" and kw.get("top_k", 65) <= 64:
                assert names == ["all_reduce", "all_gather"], f"{what}: {names}"
            if backend == "triton" and kw == dict(top_p=0.9):  # a flat row: searched
                assert names.count("all_reduce") > 1 and names.count("all_gather") == 2, names
    # bf16 shards; a soft cap with infinite logits (capped to +-c: finite rows)
    more = ((full.bfloat16(), dict(top_k=9, top_p=0.9)),
            (full.index_fill(-1, torch.tensor([0, V - 1]), float("-inf")),
             dict(top_p=0.9, softcap=2.0)))  # fmt: skip
    more = more if ctx.world == 2 else ()  # dtypes and transforms: no merge of their own
    wants = ctx.once(*(partial(_value_grad, partial(fused_rl.truncated_logprobs,
                                                    targets=targets, **kw), x, up)
                       for x, kw in more))  # fmt: skip
    for (x, kw), (want, w_grad) in zip(more, wants, strict=True):
        unsharded = partial(fused_rl.truncated_logprobs, targets=targets, **kw)
        got, grad = _value_grad(partial(unsharded, process_group=ctx.group), x[..., start:stop],
                                up)  # fmt: skip
        _same_cut(got, want, f"{kw} {x.dtype}")
        fin = torch.isfinite(want)
        assert_rel(got[fin], want[fin], 1e-5, f"logp {kw} {x.dtype}")
        assert_rel(grad.float(), w_grad[..., start:stop].float(), 1e-2, f"grad {kw}")
    # torch.compile(fullgraph=True): the route is one opaque op each way; both backends,
    # values and this rank's gradient
    for backend in BACKENDS if ctx.world == 2 else ():
        fn = partial(fused_rl.truncated_logprobs, targets=targets, top_k=80, top_p=0.9,
                     process_group=ctx.group, backend=backend)  # fmt: skip
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        got, grad = _value_grad(compiled, full[..., start:stop], up)
        want, w_grad = _value_grad(fn, full[..., start:stop], up)
        assert torch.equal(got, want), f"compiled {backend}"
        assert torch.equal(grad, w_grad), f"compiled grad {backend}"
    # the backward communicates nothing; token_logprobs takes the same route
    local = full[..., start:stop].detach().requires_grad_()
    lp = fused_rl.token_logprobs(local, targets, top_p=0.9, process_group=ctx.group)
    with _CountCollectives() as bwd:
        torch.where(torch.isfinite(lp), lp, 0.0).sum().backward()
    assert bwd.calls == [], bwd.calls
    assert torch.equal(lp, fused_rl.truncated_logprobs(local, targets, top_p=0.9,
                                                       process_group=ctx.group))  # fmt: skip
    # flat bf16 rows whose cut the search closes by its estimate from the bracket's masses
    # (a pass sooner: 2 search passes, 3 reads unsharded): the ranks search alike, one
    # all-reduce a pass after the header's
    import fused_rl._truncated_ops as T

    wf = 4096
    lo, hi = _shard_bounds([wf] * ctx.world, ctx.rank)
    flat = (torch.randn(1, 2, wf * ctx.world, generator=ctx.gen(34)) * 2).bfloat16()
    ft = flat.float().argmax(-1)
    want, _, passes = T.truncated_logprobs_fwd_op.launcher(flat, ft, 0, 0.9, 1.0, None, -100)
    assert passes.tolist() == [3, 3], passes
    with _CountCollectives() as fwd:
        got = fused_rl.truncated_logprobs(flat[..., lo:hi], ft, top_p=0.9, process_group=ctx.group)
    assert_rel(got, want, 1e-5, "flat bf16 rows")
    assert [c[0] for c in fwd.calls].count("all_reduce") == 1 + 2, fwd.calls


@check
def truncated_vocab_parallel_radix(ctx):
    """Top-k > 64 across the ranks by the radix select on the logits' bits: every rank the
    unsharded call's values (and the float64 oracle's) and its columns of the gradient, fp32
    / bf16 / fp64, temperature, the soft cap, top-p on top; logits below the k-th that share
    its ``z`` kept with it wherever they sit (``-0.0`` beside a k-th of ``+0.0``, a one-ulp
    neighbour at ``T = 0.7``). Collectives: the header, the gather, then ``B / 8``
    all-reduces of the digit histograms (one more with the soft cap), none when the gathered
    slots decide every row. And a bf16 top-p cut inside a group of tied values below every
    shard's 64 largest, searched on the logits' own 16-bit keys. At 3 ranks the merges of
    more than two shards: fp32, top-p on top, the signed zeros at one k and the neighbour
    (the key widths, the transforms, the 16-bit search, the row of ties decided by the
    gathered slots and the unchecked ``k >= V`` run at 2 ranks only)."""
    from test_truncated import oracle as truncated_oracle

    every = ctx.world == 2
    g = ctx.gen(32)
    w = 150
    V = w * ctx.world
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)

    def case(x, targets, n_reduces, oracle=True, **kw):
        return x, targets, n_reduces, oracle, kw

    def run(*cases):
        """Each case ``(x, targets, n_reduces, oracle, kw)`` against the unsharded call (the
        calls spread over the ranks): ``[(got, the collectives' names)]``."""
        ups = [torch.randn(c[1].shape, generator=torch.Generator().manual_seed(33))
               for c in cases]  # fmt: skip
        wants = ctx.once(*(partial(_value_grad, partial(fused_rl.truncated_logprobs,
                                                        targets=targets, **kw), x, up)
                           for (x, targets, *_, kw), up in zip(cases, ups)))  # fmt: skip
        out = []
        for (x, targets, n_reduces, oracle, kw), up, (want, w_grad) in zip(
            cases, ups, wants, strict=True
        ):
            unsharded = partial(fused_rl.truncated_logprobs, targets=targets, **kw)
            with _CountCollectives() as fwd:
                got, grad = _value_grad(partial(unsharded, process_group=ctx.group),
                                        x[..., start:stop], up)  # fmt: skip
            what = f"{kw} {x.dtype}"
            _same_cut(got, want, what)
            fin = torch.isfinite(want)
            wide = x.dtype == torch.float64
            assert_rel(got[fin], want[fin], F64_TOL if wide else 1e-5,
                       f"logp vs unsharded {what}")  # fmt: skip
            if oracle:  # (float64 z keeps apart what the kernels' fp32 z merges)
                o_lp = truncated_oracle(x, targets, **kw).to(got.dtype)
                assert_rel(got[fin], o_lp[fin], F64_TOL if wide else FP32_TOL, f"oracle {what}")
            tol = 1e-2 if x.dtype == torch.bfloat16 else (F64_TOL if wide else 1e-5)
            assert_rel(grad.double(), w_grad[..., start:stop].double(), tol, f"grad {what}")
            names = [c[0] for c in fwd.calls]
            assert names[:2] == ["all_reduce", "all_gather"], f"{what}: {names}"
            if n_reduces is not None:
                assert names[2:] == ["all_reduce"] * n_reduces, f"{what}: {names}"
            out.append((got, names))
        return out

    # k above every shard's 64 slots together: the slots cannot decide it
    k = 64 * ctx.world + 8
    x = torch.randn(2, 3, V, generator=g) * torch.tensor([2.0, 0.5, 4.0])[:, None]
    t = torch.randint(0, V, (2, 3), generator=g)
    t[1, 1] = -100
    dtypes = (torch.float32, torch.bfloat16, torch.float64) if every else (torch.float32,)
    cases = [case(x.to(dtype), t, torch.finfo(dtype).bits // 8, top_k=k) for dtype in dtypes]
    cases.append(case(x, t, None, top_k=k, top_p=0.8))
    if every:
        cases += [case(x, t, 4, top_k=k, temperature=0.7), case(x, t, 5, top_k=k, softcap=2.0),
                  # a row of ties: the gathered slots (and the ties they count) decide it
                  case(torch.ones(1, V), torch.tensor([3]), 0, top_k=k)]  # fmt: skip
    run(*cases)
    if every:
        # unchecked (no header read, as under torch.compile) top_k >= V is not turned off:
        # the radix select keeps every value, the unsharded call's values
        config.check_values = False
        try:
            run(case(x, t, 4, False, top_k=V + 7))
        finally:
            config.check_values = True
    # no token at all: an empty result on every rank
    for kw in (dict(top_k=k), dict(top_p=0.9)):
        empty = fused_rl.truncated_logprobs(x[0, :0, start:stop], t[0, :0], **kw,
                                            process_group=ctx.group)  # fmt: skip
        assert empty.shape == (0,), empty.shape

    def shards(top, rest):
        """A row whose every shard holds 70 of ``top`` (its 64th value is one of them),
        then its share of ``rest``."""
        parts = rest.chunk(ctx.world)
        return torch.cat([torch.cat([top[70 * r : 70 * (r + 1)], parts[r]])
                          for r in range(ctx.world)])  # fmt: skip

    # signed zeros below every shard's 64th: the k-th is +0.0 or -0.0, every zero kept
    n_rest = V - 70 * ctx.world
    rest = torch.cat([torch.zeros(10), torch.full((50,), -0.0),
                      -torch.rand(n_rest - 60, generator=g) - 0.5])  # fmt: skip
    row = shards(torch.rand(70 * ctx.world, generator=g) + 0.5,
                 rest[torch.randperm(n_rest, generator=g)])  # fmt: skip
    neg_zero = int(((row == 0) & torch.signbit(row)).nonzero()[0])
    ks = (70 * ctx.world + 5, 70 * ctx.world + 30)[: 2 if every else 1]
    for k, (got, _) in zip(ks, run(*(case(row[None], torch.tensor([neg_zero]), 4, top_k=k)
                                     for k in ks)), strict=True):  # fmt: skip
        assert torch.isfinite(got).all(), f"-0.0 cut at k = {k}"
    # T = 0.7: the k-th logit's lower neighbour, on another shard, shares its z: kept
    x_k, below = fp32_neighbours_sharing_z(0.7)
    top = torch.rand(70 * ctx.world, generator=g) + 2.0
    top[69], top[70] = x_k, below  # shard 0's last held value, shard 1's first
    row = shards(top, -torch.rand(n_rest, generator=g))
    ((got, _),) = run(case(row[None], torch.tensor([w]), 4, False, top_k=70 * ctx.world - 1,
                           temperature=0.7))  # fmt: skip
    assert torch.isfinite(got).all(), "the neighbour sharing the k-th's z was cut"
    # bf16 top-p inside a tie group below every shard's 64 largest: searched on 16-bit keys
    if not every:
        return
    big = 400
    row = torch.cat(
        [
            torch.full((100 * ctx.world,), 3.0),
            torch.full((100 * ctx.world,), 2.0),
            torch.rand(big * ctx.world - 200 * ctx.world, generator=g) * 6 - 5,
        ]
    )
    row = row[torch.randperm(row.numel(), generator=g)].bfloat16()
    start, stop = _shard_bounds([big] * ctx.world, ctx.rank)
    tie = int((row == 2.0).nonzero()[0])
    ties = (case(row[None], torch.tensor([tie]), None, top_p=0.8, temperature=temperature)
            for temperature in (1.0, 0.7))  # fmt: skip
    for _, names in run(*ties):
        searched = names.count("all_reduce") - 1
        assert 1 <= searched <= 4 and names.count("all_gather") == 2, names  # 7 on fp32 keys


@check
def truncated_vocab_parallel_layouts(ctx):
    """Truncated log-probs on ragged shards with an empty one, a Megatron-padded vocabulary
    (NaN padding changes nothing and gets no gradient), fp64 through the search passes, a
    NaN logit on one rank (a NaN row and NaN gradient row everywhere), a shard whose row is
    all ``-inf``; a target outside ``[0, V)`` raises on every rank (NaN unchecked)."""
    g = ctx.gen(31)
    widths = [60, 30] if ctx.world == 2 else [40, 0, 50]
    V = sum(widths)
    full = torch.randn(2, 4, V, generator=g) * 0.7
    full[0, 1, 3] = float("nan")
    full[1, 0, : widths[0]] = float("-inf")  # rank 0's whole shard
    targets = torch.randint(widths[0], V, (2, 4), generator=g)
    up = torch.randn(2, 4, generator=g)
    start, stop = _shard_bounds(widths, ctx.rank)
    cases = (dict(top_k=5), dict(top_p=0.9), dict(top_k=70, top_p=0.8))
    wants = ctx.once(*(partial(_value_grad, partial(fused_rl.truncated_logprobs,
                                                    targets=targets, **kw), full, up)
                       for kw in cases))  # fmt: skip
    for kw, (want, w_grad) in zip(cases, wants, strict=True):
        unsharded = partial(fused_rl.truncated_logprobs, targets=targets, **kw)
        assert torch.isnan(want[0, 1]) and not torch.isnan(want[1, 0])
        for backend in BACKENDS:
            sharded = partial(unsharded, process_group=ctx.group, vocab_start=start,
                              vocab_size=V, backend=backend)  # fmt: skip
            got, grad = _value_grad(sharded, full[..., start:stop], up)
            _same_cut(got, want, f"ragged {kw} {backend}")
            fin = torch.isfinite(want)
            assert_rel(got[fin], want[fin], 1e-5, f"ragged logp {kw} {backend}")
            assert grad[0, 1].isnan().all() or grad.shape[-1] == 0, "NaN row: NaN gradient"
            keep = torch.ones(2, 4, dtype=torch.bool)
            keep[0, 1] = False
            assert_rel(grad[keep], w_grad[..., start:stop][keep], 1e-5, f"ragged grad {kw}")
    # padded: equal shards of ceil(V / P) columns, the padding NaN
    w = -(-37 // ctx.world)
    padded = torch.full((3, w * ctx.world), float("nan"))
    padded[:, :37] = torch.randn(3, 37, generator=g, dtype=torch.float64).float()
    t = torch.tensor([0, 36, 5])
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    unsharded = partial(fused_rl.truncated_logprobs, targets=t, top_p=0.8)
    ((want, w_grad),) = ctx.once(partial(_value_grad, unsharded, padded[:, :37], torch.ones(3)))
    for backend in BACKENDS:
        sharded = partial(unsharded, process_group=ctx.group, vocab_size=37, backend=backend)
        got, grad = _value_grad(sharded, padded[:, start:stop], torch.ones(3))
        _same_cut(got, want, f"padded {backend}")
        assert_rel(got[torch.isfinite(want)], want[torch.isfinite(want)], 1e-5, "padded logp")
        valid = max(0, min(stop, 37) - start)
        assert_rel(grad[:, :valid], w_grad[:, start : start + valid], 1e-5, "padded grad")
        assert (grad[:, valid:] == 0).all(), "padding columns got a gradient"
    # fp64 (int64 keys) through the search
    x64 = torch.randn(2, 40 * ctx.world, generator=g, dtype=torch.float64)
    t64 = torch.tensor([1, 2])
    start, stop = _shard_bounds([40] * ctx.world, ctx.rank)
    unsharded = partial(fused_rl.truncated_logprobs, targets=t64, top_p=0.95)
    ((want, w_grad),) = ctx.once(partial(_value_grad, unsharded, x64, torch.ones(2)))
    for backend in BACKENDS:
        sharded = partial(unsharded, process_group=ctx.group, backend=backend)
        got, grad = _value_grad(sharded, x64[:, start:stop], torch.ones(2, dtype=torch.float64))
        assert got.dtype == torch.float64
        _same_cut(got, want, f"fp64 {backend}")
        assert_rel(got[torch.isfinite(want)], want[torch.isfinite(want)], F64_TOL, "fp64")
        assert_rel(grad, w_grad[:, start:stop], F64_TOL, "fp64 grad")
    # DTensor logits placed Shard(-1) (torch.chunk layout)
    from torch.distributed.tensor import Shard, distribute_tensor

    x = torch.randn(2, 3, 41, generator=g)
    t = torch.randint(0, 41, (2, 3), generator=g)
    want = fused_rl.truncated_logprobs(x, t, top_k=4, top_p=0.8)
    dt = distribute_tensor(x, _mesh(ctx), [Shard(2)])
    got = fused_rl.truncated_logprobs(dt, t, top_k=4, top_p=0.8)
    assert type(got) is torch.Tensor
    _same_cut(got, want, "DTensor")
    assert_rel(got[torch.isfinite(want)], want[torch.isfinite(want)], 1e-6, "DTensor")
    # unchecked, a layout the ranks disagree on (ragged widths, no vocab_start): NaN on
    # every rank and the same collectives, never a hang (k > 64: the search on some rows)
    config.check_values = False
    try:
        x = torch.randn(2, 3, 100 if ctx.rank == 0 else 50, generator=g)
        lp = fused_rl.truncated_logprobs(x, torch.zeros(2, 3, dtype=torch.long), top_k=120,
                                         top_p=0.9, process_group=ctx.group)  # fmt: skip
        assert torch.isnan(lp).all(), lp
    finally:
        config.check_values = True
    _group_ok(ctx)
    # a target outside [0, V): every rank raises; unchecked, NaN at its token
    x = torch.randn(2, 3, 5, generator=g)
    bad = torch.zeros(2, 3, dtype=torch.long)
    bad[1, 1] = 5 * ctx.world
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=rf"^targets holds {5 * ctx.world}, outside"):
            fused_rl.truncated_logprobs(x, bad, top_k=3, process_group=ctx.group,
                                        backend=backend)  # fmt: skip
        _group_ok(ctx)
    config.check_values = False
    try:
        lp = fused_rl.truncated_logprobs(x, bad, top_k=3, process_group=ctx.group)
        assert torch.isnan(lp[1, 1]) and torch.isnan(lp).sum() == 1, lp
    finally:
        config.check_values = True


@check
def linear_truncated_vocab_parallel(ctx):
    """``linear_token_logprobs(top_k=, top_p=, process_group=)``: lm_head shards (ragged,
    one empty at world 3), replicated hidden, three chunks: every rank the unsharded call's
    log-probs, the hidden gradient summed over the ranks (and this rank's part without
    ``reduce_hidden_grad``), its rows of the weight and bias gradients; both backends, cuts
    in registers and searched, the soft cap."""
    g = ctx.gen(32)
    widths = [150, 90] if ctx.world == 2 else [100, 0, 140]
    V, H = sum(widths), 8
    hidden = torch.randn(7, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.4
    bias = torch.randn(V, generator=g) * 0.3
    targets = torch.randint(0, V, (7,), generator=g)
    targets[2] = -100
    targets[0] = int((hidden[0] @ weight.t() + bias).argmax())
    up = torch.randn(7, generator=g)
    start, stop = _shard_bounds(widths, ctx.rank)

    def run(fn, h, w, b):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
        out = fn(leaves[0], leaves[1], bias=leaves[2])
        torch.where(torch.isfinite(out), out * up, 0.0).sum().backward()
        return out.detach(), [leaf.grad for leaf in leaves]

    cases = [
        dict(dict(chunk_tokens=3), **kw)  # None: the default chunks, ragged shards
        for kw in (
            dict(top_k=5),
            dict(top_p=0.9),
            dict(top_k=70, top_p=0.8),
            dict(top_k=9, top_p=0.9, softcap=2.0),
            dict(top_p=0.9, chunk_tokens=None),
        )
    ]
    calls = [partial(fused_rl.linear_token_logprobs, targets=targets, **kw) for kw in cases]
    wants = ctx.once(*(partial(run, call, hidden, weight, bias) for call in calls))
    # with and without the hidden gradient's all-reduce in turn: each on both backends, the
    # cuts' routes with either
    for i, (kw, unsharded, (want, (w_h, w_w, w_b))) in enumerate(
        zip(cases, calls, wants, strict=True)
    ):
        for j, backend in enumerate(BACKENDS):
            what = f"{kw} {backend}"
            reduce = (i + j) % 2 == 0
            sharded = partial(
                unsharded,
                process_group=ctx.group,
                vocab_start=start,
                vocab_size=V,
                backend=backend,
                reduce_hidden_grad=reduce,
            )
            got, (d_h, d_w, d_b) = run(sharded, hidden, weight[start:stop], bias[start:stop])
            _same_cut(got, want, what)
            fin = torch.isfinite(want)
            assert_rel(got[fin], want[fin], 1e-5, f"logp {what}")
            assert_rel(d_w, w_w[start:stop], 1e-5, f"weight grad {what}")
            assert_rel(d_b, w_b[start:stop], 1e-5, f"bias grad {what}")
            if not reduce:  # this rank's part of dH: summed here to check it
                dist.all_reduce(d_h, group=ctx.group)
            assert_rel(d_h, w_h, 1e-5, f"hidden grad {what} reduce={reduce}")
    _group_ok(ctx)


@check
def linear_exact_kl_vocab_parallel(ctx):
    """``linear_policy_loss(ref_hidden=, ref_weight=, kl_estimator="full", process_group=)``:
    both models' lm_head shards (equal widths; other layouts: ``divergence_layouts``), the
    composed route (the sharded log-probs,
    each chunk's exact KL merged over the ranks): every rank the unsharded call's loss and
    metrics, the hidden gradient summed over the ranks, its rows of the weight and bias
    gradients; token-level and GSPO, both backends, three chunks."""
    g = ctx.gen(33)
    w, H, H_ref = 13, 6, 5
    V = w * ctx.world
    hidden = torch.randn(2, 5, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    bias = torch.randn(V, generator=g) * 0.1
    ref = dict(ref_hidden=torch.randn(2, 5, H_ref, generator=g),
               ref_weight=torch.randn(V, H_ref, generator=g) * 0.5,
               ref_bias=torch.randn(V, generator=g) * 0.1)  # fmt: skip
    targets = torch.randint(0, V, (2, 4), generator=g)
    targets[1, 0] = -100
    adv = torch.randn(2, generator=g)
    old = torch.randn(2, 4, generator=g) * 0.3 - 3.0
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)

    def run(h, wt, b, ref_w, ref_b, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in (h, wt, b)]
        loss, metrics = fused_rl.linear_policy_loss(
            leaves[0], leaves[1], targets, adv, bias=leaves[2], old_logprobs=old,
            ref_hidden=ref["ref_hidden"], ref_weight=ref_w, ref_bias=ref_b, chunk_tokens=3,
            kl_estimator="full", beta=0.3, entropy_coef=0.01, **kw,
        )  # fmt: skip
        (loss * 1.7).backward()
        return loss.detach(), metrics, [leaf.grad for leaf in leaves]

    variants = (dict(), dict(importance_sampling="sequence"))
    wants = ctx.once(*(partial(run, hidden, weight, bias, ref["ref_weight"], ref["ref_bias"],
                               **options) for options in variants))  # fmt: skip
    for options, (want, w_metrics, (w_h, w_w, w_b)) in zip(variants, wants, strict=True):
        for backend in BACKENDS:
            what = f"{options} {backend}"
            got, metrics, (d_h, d_w, d_b) = run(
                hidden, weight[start:stop], bias[start:stop], ref["ref_weight"][start:stop],
                ref["ref_bias"][start:stop], process_group=ctx.group, backend=backend, **options,
            )  # fmt: skip
            assert_rel(got, want, 1e-5, f"loss {what}")
            for name, value in w_metrics.items():
                assert_rel(metrics[name], value, 1e-5, f"{name} {what}")
            assert_rel(d_h, w_h, 1e-5, f"hidden grad {what}")
            assert_rel(d_w, w_w[start:stop], 1e-5, f"weight grad {what}")
            assert_rel(d_b, w_b[start:stop], 1e-5, f"bias grad {what}")
    _group_ok(ctx)


def _layouts(ctx, V):
    """``(name, (start, stop), columns, layout keywords)`` of this rank in a Megatron-padded
    vocabulary (equal shards past ``V``: ``vocab_size`` alone) and in ragged shards (one
    empty at world 3: ``vocab_start`` and ``vocab_size``); ``columns`` the padded width."""
    w = -(-V // ctx.world)
    padded = _shard_bounds([w] * ctx.world, ctx.rank)
    widths = _ragged_widths(ctx.world)
    assert sum(widths) == V
    return [("padded", padded, w * ctx.world, dict(vocab_size=V)),
            ("ragged", _shard_bounds(widths, ctx.rank), V,
             dict(vocab_start=_shard_bounds(widths, ctx.rank)[0], vocab_size=V))]  # fmt: skip


def _padded(full, columns, fill):
    """``full`` ``(..., V)`` padded to ``columns`` with ``fill`` (Megatron's padding)."""
    pad = full.new_full((*full.shape[:-1], columns - full.shape[-1]), fill)
    return torch.cat((full, pad), -1)


@check
def divergence_layouts(ctx):
    """``token_kl``, ``distill_loss`` (forward KL, reverse KL, a JSD), ``linear_distill_loss``,
    ``policy_loss`` / ``nn.PolicyLoss`` with the exact KL and ``linear_policy_loss``'s exact
    KL on a Megatron-padded vocabulary (NaN / inf padding
    columns or lm_head rows, never read, zero gradient) and on ragged shards with an empty
    one: every rank the unsharded call's values, its shard of the gradient."""
    V = sum(_ragged_widths(ctx.world))
    g = ctx.gen(61)
    B, T, H, Ht = 2, 3, 5, 4
    full = torch.randn(B, T, V, generator=g) * 2
    other = full + torch.randn(B, T, V, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    up = torch.randn(B, T, generator=g)
    hidden, t_hidden = torch.randn(B, T + 1, H, generator=g), torch.randn(B, T + 1, Ht, generator=g)
    weight, t_weight = torch.randn(V, H, generator=g), torch.randn(V, Ht, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    pkw = dict(kl_estimator="full", beta=0.2, importance_sampling="sequence",
               entropy_coef=0.01, mask=mask)  # fmt: skip
    lkw = dict(ref_hidden=t_hidden, kl_estimator="full", beta=0.2, chunk_tokens=2,
               importance_sampling="sequence")  # fmt: skip

    # the unsharded calls, each (value, its gradients), spread over the ranks
    def kl_ref():
        x = full.clone().requires_grad_()
        kl = fused_rl.token_kl(x, other, mask=mask, backend="triton")
        return kl.detach(), torch.autograd.grad((kl * up).sum(), x)[0]

    def distill_ref(beta, own):
        x = full.clone().requires_grad_()
        loss, metrics = fused_rl.distill_loss(x, other, beta=beta, mask=mask, temperature=0.9,
                                              backend="triton", **own)  # fmt: skip
        return loss.detach(), metrics, torch.autograd.grad(loss * 1.3, x)[0]

    def linear_distill_ref():
        wl = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        loss, _ = fused_rl.linear_distill_loss(wl[0][:, :T], wl[1], t_hidden[:, :T], t_weight,
                                               beta=0.5, mask=mask, chunk_tokens=2,
                                               backend="triton")  # fmt: skip
        return loss.detach(), torch.autograd.grad(loss, wl)

    def policy_ref():
        x = full.clone().requires_grad_()
        loss, metrics = fused_rl.policy_loss(x, targets, up[:, 0], ref_logits=other,
                                             backend="triton", **pkw)  # fmt: skip
        return loss.detach(), metrics, torch.autograd.grad(loss, x)[0]

    def linear_policy_ref():
        wl = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        loss, metrics = fused_rl.linear_policy_loss(
            wl[0], wl[1], targets, up[:, 0], ref_weight=t_weight, backend="triton", **lkw
        )
        return loss.detach(), metrics, torch.autograd.grad(loss, wl)

    transforms = {0.0: {}, 1.0: {}, 0.5: {}, 0.3: OWN_TRANSFORMS[0]}  # each model's own at 0.3
    (want_kl, want_grad), want_ld, want_p, want_lp, *wants = ctx.once(
        kl_ref, linear_distill_ref, policy_ref, linear_policy_ref,
        *(partial(distill_ref, beta, own) for beta, own in transforms.items()),
    )  # fmt: skip
    distill = {
        beta: (transforms[beta], *want) for beta, want in zip(transforms, wants, strict=True)
    }
    for name, (start, stop), columns, layout in _layouts(ctx, V):
        for backend in BACKENDS:
            what = f"{name} {backend}"
            xp = _padded(full, columns, math.nan)
            xp[0, 0, V:] = math.inf
            local = _local(xp, start, stop) if name == "padded" else _local(full, start, stop)
            ref_local = _padded(other, columns, -math.inf) if name == "padded" else other
            kl = fused_rl.token_kl(local, ref_local[..., start:stop], mask=mask,
                                   process_group=ctx.group, backend=backend, **layout)  # fmt: skip
            assert_rel(kl, want_kl, FP32_TOL, f"token_kl {what}")
            (kl * up).sum().backward()
            valid = max(0, min(stop, V) - start)
            assert_rel(local.grad[..., :valid], want_grad[..., start : start + valid], FP32_TOL,
                       f"token_kl grad {what}")  # fmt: skip
            assert (local.grad[..., valid:] == 0).all(), f"padding got a gradient {what}"
            for beta, (own, want_loss, want_metrics, want_g) in distill.items():
                local.grad = None
                loss, metrics = fused_rl.distill_loss(
                    local, ref_local[..., start:stop], beta=beta, mask=mask, temperature=0.9,
                    process_group=ctx.group, backend=backend, **layout, **own,
                )  # fmt: skip
                assert_rel(loss, want_loss, FP32_TOL, f"distill beta {beta} {what}")
                for key, value in metrics.items():
                    assert_rel(value, want_metrics[key], FP32_TOL, f"{key} beta {beta} {what}")
                (g_x,) = torch.autograd.grad(loss * 1.3, local)
                assert_rel(g_x[..., :valid], want_g[..., start : start + valid], FP32_TOL,
                           f"distill grad beta {beta} {what}")  # fmt: skip
                assert (g_x[..., valid:] == 0).all()
            # from hidden states: padding rows of the lm_heads hold NaN
            wp = _padded(weight.t(), columns, math.nan).t() if name == "padded" else weight
            twp = _padded(t_weight.t(), columns, math.nan).t() if name == "padded" else t_weight
            leaves = [hidden.clone().requires_grad_(), wp[start:stop].clone().requires_grad_()]
            loss, _ = fused_rl.linear_distill_loss(
                leaves[0][:, :T], leaves[1], t_hidden[:, :T], twp[start:stop], beta=0.5,
                mask=mask, chunk_tokens=2, process_group=ctx.group, backend=backend, **layout,
            )  # fmt: skip
            want, (want_dh, want_dw) = want_ld
            assert_rel(loss, want, FP32_TOL, f"linear_distill {what}")
            loss.backward()
            assert_rel(leaves[0].grad, want_dh, FP32_TOL, f"linear_distill dH {what}")
            assert_rel(leaves[1].grad[:valid], want_dw[start : start + valid], FP32_TOL,
                       f"linear_distill dW {what}")  # fmt: skip
            assert (leaves[1].grad[valid:] == 0).all()
            # policy_loss on the logits (and its module): the log-probs and the exact KL
            want, want_metrics, want_g = want_p
            module = PolicyLoss(kl_estimator="full", beta=0.2,
                                            importance_sampling="sequence", entropy_coef=0.01,
                                            process_group=ctx.group, backend=backend,
                                            **layout)  # fmt: skip
            for call in ("function", "module"):
                local.grad = None
                if call == "function":
                    loss, metrics = fused_rl.policy_loss(
                        local, targets, up[:, 0], ref_logits=ref_local[..., start:stop],
                        process_group=ctx.group, backend=backend, **layout, **pkw,
                    )  # fmt: skip
                else:
                    loss, metrics = module(local, targets, up[:, 0], mask=mask,
                                           ref_logits=ref_local[..., start:stop])  # fmt: skip
                assert_rel(loss, want, FP32_TOL, f"policy_loss {call} {what}")
                for key, value in want_metrics.items():
                    assert_rel(metrics[key], value, 1e-4 if key == "kl" else FP32_TOL,
                               f"policy_loss {key} {what}")  # fmt: skip
                (g_x,) = torch.autograd.grad(loss, local)
                assert_rel(g_x[..., :valid], want_g[..., start : start + valid], FP32_TOL,
                           f"policy_loss grad {what}")  # fmt: skip
                assert (g_x[..., valid:] == 0).all()
            leaves = [hidden.clone().requires_grad_(), wp[start:stop].clone().requires_grad_()]
            loss, metrics = fused_rl.linear_policy_loss(
                leaves[0], leaves[1], targets, up[:, 0], ref_weight=twp[start:stop],
                process_group=ctx.group, backend=backend, **layout, **lkw,
            )  # fmt: skip
            want, want_metrics, (want_dh, want_dw) = want_lp
            assert_rel(loss, want, FP32_TOL, f"linear_policy_loss {what}")
            assert_rel(metrics["kl"], want_metrics["kl"], FP32_TOL, f"kl {what}")
            loss.backward()
            assert_rel(leaves[0].grad, want_dh, FP32_TOL, f"linear_policy_loss dH {what}")
            assert_rel(leaves[1].grad[:valid], want_dw[start : start + valid], FP32_TOL,
                       f"linear_policy_loss dW {what}")  # fmt: skip
    # a layout the ranks disagree on: ValueError on every rank, checked; NaN unchecked
    start, stop = _shard_bounds([2] * ctx.world, ctx.rank)
    x, r = full[..., start:stop], other[..., start:stop]
    bad = dict(vocab_size=2 * ctx.world - (ctx.rank == 0))
    with pytest.raises(ValueError, match="vocab_size differs"):
        fused_rl.token_kl(x, r, process_group=ctx.group, **bad)
    with pytest.raises(ValueError, match="vocab_size differs"):
        fused_rl.distill_loss(x, r, process_group=ctx.group, **bad)
    # shards of different widths without vocab_start (one of them empty): the layout error
    # on every rank, never a rank alone raising or a collective of mismatched sizes
    for width in (3, 0):
        xw = torch.randn(B, T, 2 if ctx.rank else width, generator=g)
        with pytest.raises(ValueError, match="differ in width"):
            fused_rl.token_kl(xw, xw, process_group=ctx.group)
        hw = torch.randn(40, H, generator=g)
        ww = torch.randn(2 if ctx.rank else width, H, generator=g)
        with pytest.raises(ValueError, match="differ in width"):
            fused_rl.linear_distill_loss(hw, ww, hw, ww, process_group=ctx.group)
    config.check_values = False
    try:
        assert fused_rl.token_kl(x, r, process_group=ctx.group, **bad).isnan().all()
        loss, metrics = fused_rl.distill_loss(x, r, beta=0.5, process_group=ctx.group, **bad)
        assert loss.isnan() and all(v.isnan() for v in metrics.values())
    finally:
        config.check_values = True
    _group_ok(ctx)


def _stacked(stats):
    """A ``TokenStats`` as one tensor (the top-1 flag as 0 / 1)."""
    return torch.stack([*stats[:4], stats.is_top1.to(stats.logp.dtype)])


@check(worlds=(2,))
def compiled_fullgraph(ctx):
    """Every vocabulary-parallel op under ``torch.compile(fullgraph=True)`` (no graph break:
    collectives traced, or the routes with host reads opaque custom ops): the eager call's
    values and this rank's gradients. The logits ops on the Triton backend, and on the
    reference backend one op per route its shards take (their merges are the Triton
    backend's, traced with it; what differs is the local plain-PyTorch partial): the row
    statistics with the extras (``token_stats``), the pair statistics with the mixture pass
    (``distill_jsd``; ``token_kl`` and the exact KL take the same partials), the gathered
    rows (``truncated``). The ops from hidden states under Inductor (two of them: the
    generated code, not only the graph), as :func:`compiled_token_counts` compiles every one
    of them under ``aot_eager`` in one graph. At 2 ranks only (what compiles does not depend
    on the world size; the compiles are the check's cost)."""
    w, B, T, H = 5, 2, 3, 4
    V = w * ctx.world
    g = ctx.gen(71)
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    full, other = torch.randn(B, T, V, generator=g) * 2, torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 0] = -100
    adv, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) - 2
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    grp = dict(process_group=ctx.group)
    logits_ops = {
        "token_logprobs": lambda x, **k: fused_rl.token_logprobs(x, targets, **grp, **k),
        "token_entropy": lambda x, **k: fused_rl.token_entropy(x, **grp, **k),
        "token_kl": lambda x, **k: fused_rl.token_kl(x, other[..., start:stop], **grp, **k),
        "distill_jsd": lambda x, **k: fused_rl.distill_loss(
            x, other[..., start:stop], beta=0.4, **grp, **k)[0],
        "truncated": lambda x, **k: fused_rl.truncated_logprobs(
            x, targets, top_k=3, top_p=0.8, **grp, **k),
        "policy_full_kl": lambda x, **k: fused_rl.policy_loss(
            x, targets, adv, old_logprobs=old, ref_logits=other[..., start:stop],
            kl_estimator="full", beta=0.1, **grp, **k)[0],
        "token_stats": lambda x, **k: _stacked(fused_rl.token_stats(x, targets, **grp, **k)),
    }  # fmt: skip
    # ops from hidden states compiled by Inductor (their merge of the chunks' partials, which
    # Inductor once miscompiled when it was traced, now runs inside their custom ops)
    head_ops = {
        "linear_logprobs": lambda h, wt, **k: fused_rl.linear_token_logprobs(
            h, wt, targets[:, 1:], **grp, **k),
        "linear_policy": lambda h, wt, **k: fused_rl.linear_policy_loss(
            h, wt, targets[:, 1:], adv, **grp, **k)[0],
    }  # fmt: skip

    def value_grads(fn, leaves):
        leaves = [x.detach().clone().requires_grad_() for x in leaves]
        out = fn(*leaves)
        up = torch.linspace(0.5, 1.5, out.numel()).view(out.shape)
        torch.where(torch.isfinite(out), out * up, 0.0).sum().backward()
        return out.detach(), [x.grad for x in leaves]

    reference_routes = ("token_stats", "distill_jsd", "truncated")
    cases = [(name, fn, [full[..., start:stop]], BACKENDS if name in reference_routes
              else ("triton",)) for name, fn in logits_ops.items()]  # fmt: skip
    # Inductor: the generated code, not only the traced graph, is the eager call. A logits
    # op's merge is traced (it reads this rank's own maxima after the MAX all-reduce, which
    # Inductor once wrote straight into the reduced buffer); the heads' several chunks run
    # inside their custom ops
    cases += [("token_logprobs inductor", logits_ops["token_logprobs"], [full[..., start:stop]],
               ("triton",))]  # fmt: skip
    cases += [(f"{name} inductor", partial(fn, chunk_tokens=2), [hidden, weight[start:stop]],
               ("triton",)) for name, fn in head_ops.items()]  # fmt: skip
    for name, fn, leaves, backends in cases:
        for backend in backends:
            what = f"{name} {backend}"
            eager = partial(fn, backend=backend)
            torch._dynamo.reset()
            inductor = name.endswith("inductor")
            compiled = torch.compile(eager, fullgraph=True,
                                     backend="inductor" if inductor else "aot_eager")  # fmt: skip
            with unpoisoned() if inductor else contextlib.nullcontext():
                got, got_g = value_grads(compiled, leaves)
            want, want_g = value_grads(eager, leaves)
            fin = torch.isfinite(want)  # truncated: cut targets are -inf in both
            assert torch.equal(fin, torch.isfinite(got)), what
            assert_rel(got[fin], want[fin], 1e-6, what)
            for a, e in zip(got_g, want_g, strict=True):
                assert_rel(a, e, 1e-6, f"grad {what}")
    _group_ok(ctx)


SHARDED_HEADS = ("entropy", "stats", "top_p", "grpo", "exact_kl", "distill")


def _sharded_heads(d, be, grp):
    """The vocabulary-parallel ops from hidden states of :func:`compiled_token_counts`, each
    one output tensor (``d``: the step's tensors, the shards' ``w`` / ``b`` / ``rw``)."""
    head = dict(bias=d["b"], chunk_tokens=4, backend=be, **grp)
    policy = lambda **kw: fused_rl.linear_policy_loss(  # noqa: E731
        d["h"], d["w"], d["targets"], d["adv"], old_logprobs=d["old"], mask=d["mask"],
        num_items=d["n"], **head, **kw)[0]  # fmt: skip
    stats = lambda s: torch.stack([s.logp, s.entropy, s.mean_logit, s.log_sum_sq_probs])  # noqa: E731
    return {
        "entropy": lambda: torch.stack(fused_rl.linear_token_logprobs(
            d["h"], d["w"], d["targets"], return_entropy=True, temperature=0.9, **head)),
        "stats": lambda: stats(fused_rl.linear_token_stats(d["h"], d["w"], d["targets"],
                                                           **head)),
        "top_p": lambda: fused_rl.linear_token_logprobs(
            d["h"], d["w"], d["targets"], top_p=0.9, **head).clamp(min=-1e4),
        "grpo": lambda: policy(entropy_coef=0.01, beta=0.05, ref_logprobs=d["old"] + 0.1),
        "exact_kl": lambda: policy(ref_hidden=d["rh"], ref_weight=d["rw"],
                                   kl_estimator="full", beta=0.1),
        "distill": lambda: fused_rl.linear_distill_loss(
            d["h"], d["w"], d["rh"], d["rw"], beta=0.5, mask=d["mask"], num_items=d["n"],
            **head)[0],
    }  # fmt: skip


@check(worlds=(2,))
def compiled_token_counts(ctx):
    """The vocabulary-parallel ops from hidden states run each chunk loop inside one custom
    op while compiling (the group travels by name), as on one device: a new token count each
    step (chunks of 4 rows: 2, 3 and 5 chunks) compiles at most twice (all the ops in one
    compiled function, each with its own leaves), with the eager call's
    values and this rank's gradients of the hidden states, the lm_head shard and its bias.
    A padded vocabulary (the last rank's last row padding); at 2 ranks only. The reference
    backend for ``exact_kl`` only: while compiling, both backends trace the same sharded
    custom ops (the backend is an argument of theirs; what runs inside is the eager code,
    checked on both backends by the eager checks here and in test_distributed_linear.py);
    the token-level tails that differ are compiled on one device (test_compile_shapes.py;
    the sequence-level exact KL takes ``exact_kl``'s custom ops, its tail compiled there),
    except ``loss_with_exact_kl``'s on the reference backend (one device's reference
    materialises both logits and calls ``policy_loss``), compiled here."""
    w, H = 4, 5
    vocab = w * ctx.world - 1
    start, stop = _shard_bounds([w] * ctx.world, ctx.rank)
    grp = dict(process_group=ctx.group, vocab_size=vocab)
    # every (op, backend) in one compiled function (each its own leaves): one graph, and one
    # recompile for the symbolic count, for all of them (a compile per op was the check's cost)
    pairs = [(name, be) for name in SHARDED_HEADS
             for be in (BACKENDS if name == "exact_kl" else ("triton",))]  # fmt: skip

    def heads(ds):
        return [_sharded_heads(d, be, grp)[name]() for (name, be), d in zip(pairs, ds, strict=True)]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(heads, fullgraph=True, backend="aot_eager")
    for i, T in enumerate((5, 9, 3)):
        g = ctx.gen(100 + i)
        d = dict(h=torch.randn(2, T, H, generator=g),
                 w=torch.randn(w * ctx.world, H, generator=g)[start:stop],
                 b=torch.randn(w * ctx.world, generator=g)[start:stop],
                 targets=torch.randint(0, vocab, (2, T), generator=g),
                 up=torch.rand(2, T, generator=g) + 0.5, adv=torch.randn(2, generator=g),
                 old=torch.randn(2, T, generator=g) - 3.0,
                 mask=torch.rand(2, T, generator=g) > 0.2,
                 rh=torch.randn(2, T, H, generator=g),
                 rw=torch.randn(w * ctx.world, H, generator=g)[start:stop])  # fmt: skip
        d["targets"][0, 0] = -100
        d["n"] = 7 + 3 * i  # the trainer's count: an int, new each step
        results = []
        for f in (compiled, heads):
            leaves = [{k: d[k].clone().requires_grad_() for k in ("h", "w", "b")} for _ in pairs]
            outs = f([dict(d, **lv) for lv in leaves])
            sum(
                (out * d["up"].expand_as(out) if out.dim() else out).sum() for out in outs
            ).backward()
            results.append([(out.detach(), *(lv[k].grad for k in ("h", "w", "b")))
                            for out, lv in zip(outs, leaves, strict=True)])  # fmt: skip
        for (name, backend), got, want in zip(pairs, *results, strict=True):
            for a, e, what in zip(got, want, ("value", "grad h", "grad w", "grad b"), strict=True):
                assert_rel(a, e, 1e-6, f"{name} {backend} {what} T={T}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"{graphs} graphs for 3 token counts"
    _group_ok(ctx)


@pytest.mark.parametrize("world, name", world_cases(CHECKS, WORLD_SIZES))
@needs_gloo
@needs_interpreter
def test_vocab_parallel(world, name):
    failed = failures(__name__, world, name)
    assert not failed, "\n".join(failed)


def test_signatures():
    """The vocabulary-parallel keywords are the documented ones, in order, and ``backend``
    comes last."""
    import inspect

    for fn in (fused_rl.token_logprobs, fused_rl.token_entropy, fused_rl.token_kl,
               fused_rl.distill_loss, fused_rl.linear_distill_loss, fused_rl.token_stats,
               fused_rl.linear_token_stats, fused_rl.linear_token_logprobs,
               fused_rl.linear_policy_loss):  # fmt: skip
        names = list(inspect.signature(fn).parameters)
        at = names.index("process_group")
        assert names[at : at + 3] == ["process_group", "vocab_start", "vocab_size"]
        assert names[-1] == "backend"
    assert math.isfinite(fused_rl.distributed.MAX_VOCAB)


@pytest.mark.no_poison
def test_module_docstring_example():
    """fused_rl.distributed's example (a one-process gloo group) runs."""
    import doctest

    import fused_rl.distributed as module

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
