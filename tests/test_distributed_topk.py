"""K ids a position over a vocabulary split across ranks: ``fused_rl.distributed.
sharded_logprobs_k`` and verl's Megatron top-k distillation
(``fused_rl.compat.verl.compute_forward_kl_topk_megatron``); gloo on CPU, the Triton
interpreter, world sizes 2 and 3 (tests/dist_harness.py).

Every rank must return the unsharded values (float64 oracles on the concatenated
vocabulary) and its shard of the unsharded gradient under a random upstream gradient.
Where verl and Megatron-Core are installed, the Megatron function is compared with verl's
own on the same nested batch, packed by verl's own preprocessing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fused_rl.compat.verl import compute_forward_kl_topk_megatron
from fused_rl.distributed import group_shard, sharded_kth_largest, sharded_logprobs_k

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_harness import (  # noqa: E402
    check_registry,
    failures,
    needs_gloo,
    needs_interpreter,
    world_cases,
)
from helpers import F64_TOL, FP32_TOL, assert_rel  # noqa: E402
from test_distributed import _CountCollectives  # noqa: E402

from fused_rl.profiling import LaunchCounter  # noqa: E402

WORLD_SIZES = (2, 3)
BACKENDS = ("triton", "reference")
CHECKS, check = check_registry()
HAVE_VERL_MEGATRON = all(
    importlib.util.find_spec(m) is not None for m in ("verl", "megatron")
)  # fmt: skip


def _local(full, start, stop):
    return full[..., start:stop].detach().clone().requires_grad_()


def _oracle_k(full, ids, counted, g, temperature, vocab):
    """float64 log-probs of ``ids`` under the softmax of the first ``vocab`` columns / T,
    zero in rows not counted, and the gradient of ``(logp * g).sum()``."""
    x = full.detach().double().requires_grad_()
    logp = torch.log_softmax(x[..., :vocab] / temperature, -1).gather(-1, ids)
    logp = torch.where(counted[..., None], logp, 0.0)
    (logp * g.double()).sum().backward()
    return logp, x.grad


@check
def logprobs_k_values_and_grads(ctx):
    """Repeated ids (one on every shard, one named thrice), a row not counted, ids on the
    first and last columns, a temperature, fp32 and bf16, both backends; and Megatron's
    padded vocabulary (``vocab_size`` below the shards' total: its columns are not read),
    down to a last rank that holds padding only."""
    g = ctx.gen(1)
    w, k = 6, 5
    for pad in (0, 3, w):
        padded = pad > 0
        vocab = w * ctx.world - pad
        full = torch.randn(2, 4, w * ctx.world, generator=g) * 2
        ids = torch.randint(0, vocab, (2, 4, k), generator=g)
        ids[0, 0] = torch.tensor([0, vocab - 1, 3, 3, 3])
        ids[1, 2, :2] = min(w, vocab - 1)  # the second rank's first column, twice
        counted = torch.ones(2, 4, dtype=torch.bool)
        counted[1, 3] = False
        up = torch.randn(2, 4, k, generator=g)
        start, stop = ctx.rank * w, (ctx.rank + 1) * w
        shard = group_shard(ctx.group, w, None, vocab if padded else None)
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            x = full.to(dtype)
            o_logp, o_grad = _oracle_k(x, ids, counted, up, 0.7, vocab)
            for backend in BACKENDS:
                local = _local(x, start, stop)
                logp, z = sharded_logprobs_k(local, ids, counted, shard, which=backend,
                                             temperature=0.7)  # fmt: skip
                logp = torch.where(counted[..., None], logp, 0.0)
                (logp * up).sum().backward()
                what = f"{backend} {dtype} pad={pad}"
                wide = dtype == torch.float64
                assert logp.dtype == (torch.float64 if wide else torch.float32), what
                assert_rel(logp, o_logp, F64_TOL if wide else FP32_TOL, f"logp {what}")
                tol = {torch.float64: F64_TOL, torch.float32: FP32_TOL}.get(dtype, 4e-3)
                assert_rel(local.grad.double(), o_grad[..., start:stop], tol, f"grad {what}")
                assert (local.grad[1, 3] == 0).all(), f"a row not counted: {what}"
                assert torch.equal(z, x.gather(-1, ids).to(z.dtype)), f"the ids' logits: {what}"
                if padded and ctx.rank == ctx.world - 1:
                    assert (local.grad[..., w - pad :] == 0).all(), f"padding columns: {what}"


@check
def logprobs_k_cost(ctx):
    """Whatever K: forward one layer-1 kernel on the shard and three all-reduces (the row
    max with the layout header, the rescaled sums, the ``(N, K)`` ids' logits in fp32);
    backward one layer-3 kernel and no collective."""
    w = 5
    full = torch.randn(2, 3, w * ctx.world, generator=ctx.gen(5))
    shard = group_shard(ctx.group, w, None, None)
    for k in (1, 4, 9):
        ids = torch.randint(0, w * ctx.world, (2, 3, k), generator=ctx.gen(k))
        local = _local(full, ctx.rank * w, (ctx.rank + 1) * w)
        counted = torch.ones(2, 3, dtype=torch.bool)
        with LaunchCounter() as fwd_kernels, _CountCollectives() as fwd:
            logp, _ = sharded_logprobs_k(local, ids, counted, shard, which="triton")
        with LaunchCounter() as bwd_kernels, _CountCollectives() as bwd:
            logp.backward(torch.randn(logp.shape, generator=ctx.gen(0)))
        assert fwd_kernels.kernels == ["_token_stats_fwd_kernel"], fwd_kernels.kernels
        assert bwd_kernels.kernels == ["_token_stats_bwd_kernel"], bwd_kernels.kernels
        assert [name for name, _ in fwd.calls] == ["all_reduce"] * 3, fwd.calls
        assert fwd.calls[2][1] == 2 * 3 * k * 4, fwd.calls  # the ids' logits, fp32
        assert bwd.calls == [], bwd.calls


@check
def logprobs_k_nan(ctx):
    """A NaN logit on one shard makes its counted row NaN on every rank (values and that
    row's gradient), a NaN in a row not counted changes nothing."""
    w, k = 4, 3
    g = ctx.gen(6)
    full = torch.randn(1, 3, w * ctx.world, generator=g, dtype=torch.float64)
    full[0, 0, w * ctx.world - 1] = math.nan  # the last rank's, a counted row
    full[0, 2, 0] = math.nan  # the first rank's, a row not counted
    ids = torch.randint(0, w * ctx.world, (1, 3, k), generator=g)
    counted = torch.tensor([[True, True, False]])
    shard = group_shard(ctx.group, w, None, None)
    start, stop = ctx.rank * w, (ctx.rank + 1) * w
    for backend in BACKENDS:
        local = _local(full, start, stop)
        logp, _ = sharded_logprobs_k(local, ids, counted, shard, which=backend)
        assert logp[0, 0].isnan().all() and torch.isfinite(logp[0, 1]).all(), backend
        torch.where(counted[..., None], logp, 0.0).sum().backward()
        assert torch.isfinite(local.grad[0, 1]).all() and (local.grad[0, 2] == 0).all(), backend


@check
def logprobs_k_unchecked_bad_id_is_nan(ctx):
    """With value checks off, an id outside [0, V) gives NaN, never a finite value."""
    w = 4
    full = torch.randn(1, 2, w * ctx.world, generator=ctx.gen(2))
    ids = torch.tensor([[[0, w * ctx.world], [1, 2]]])
    shard = group_shard(ctx.group, w, None, None)
    local = _local(full, ctx.rank * w, (ctx.rank + 1) * w)
    logp, _ = sharded_logprobs_k(local, ids, torch.ones(1, 2, dtype=torch.bool), shard,
                                 which="triton")  # fmt: skip
    assert math.isnan(logp[0, 0, 1]) and torch.isfinite(logp[0, 1]).all()


def _kth_oracle(full, k):
    """Per row of the whole vocabulary: NaN if it holds a NaN, else its k-th largest."""
    kth = full.double().topk(k, dim=-1).values[..., -1]
    return torch.where(full.isnan().any(-1), math.nan, kth)


def _ragged_bounds(world, rank, empty_last=False):
    """Ragged shards of widths 4, 8 over a vocabulary of 10 (world 2) or 3, 6, 4 over 12
    (world 3): the last rank holds padding columns past the vocabulary, which rank nowhere.
    ``empty_last``: 10, 4 (world 2) or 6, 6, 3 (world 3), the last rank's columns all
    padding (``shard.valid == 0``)."""
    if empty_last:
        widths = (10, 4) if world == 2 else (6, 6, 3)
    else:
        widths = (4, 8) if world == 2 else (3, 6, 4)
    vocab = 10 if world == 2 else 12
    start = sum(widths[:rank])
    return start, widths[rank], vocab


@check
def kth_largest_over_shards(ctx):
    """``sharded_kth_largest``: the same value on every rank as the float64 oracle on the
    concatenated vocabulary, both backends, every float dtype, K from 1 to V; ties spread
    over the shards, ``+-inf``, ``-0.0``, a NaN on one rank's shard (NaN on every rank);
    ragged shards with padding columns."""
    g = ctx.gen(11)
    w = 5
    vocab = w * ctx.world
    start, stop = ctx.rank * w, (ctx.rank + 1) * w
    shard = group_shard(ctx.group, w, None, None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        full = (torch.randn(2, 4, vocab, generator=g) * 3).to(dtype)
        full[0, 0, ::2] = full[0, 0, 1]  # ties on every shard
        full[0, 1, 0], full[0, 1, vocab - 1] = math.inf, -math.inf
        full[0, 2, : vocab // 2] = -0.0
        full[1, 3, vocab - 2] = math.nan  # the last rank's
        for backend in BACKENDS:
            for k in (1, 2, w, vocab - 1, vocab):
                got = sharded_kth_largest(full[..., start:stop], k, shard, which=backend)
                want = _kth_oracle(full, k)
                assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                same = (got.double() == want) | (got.isnan() & want.isnan())
                assert bool(same.all()), (dtype, backend, k, got, want)
    for empty_last in (False, True):
        start, width, vocab = _ragged_bounds(ctx.world, ctx.rank, empty_last)
        full = torch.randn(3, vocab + 4, generator=g)
        full[:, vocab:] = 100.0  # padding: never ranked
        local = full[:, start : start + width]
        shard = group_shard(ctx.group, width, start, vocab)
        for backend in BACKENDS:
            for k in (1, 3, vocab):
                got = sharded_kth_largest(local, k, shard, which=backend)
                want = _kth_oracle(full[:, :vocab], k)
                assert torch.equal(got.double(), want), (backend, k, empty_last)
            with pytest.raises(ValueError, match=f"k must be in \\[1, {vocab}\\]"):
                sharded_kth_largest(local, vocab + 1, shard, which=backend)


@check
def kth_largest_over_shards_cost(ctx):
    """Triton: one histogram launch and one all-reduce of 257 int32 a row per pass, two
    passes for bf16, four for fp32; nothing else collective."""
    w = 6
    shard = group_shard(ctx.group, w, None, None)
    for dtype, passes in ((torch.bfloat16, 2), (torch.float32, 4)):
        local = torch.randn(2, 3, w, generator=ctx.gen(4)).to(dtype)
        with LaunchCounter() as launches, _CountCollectives() as comms:
            sharded_kth_largest(local, 4, shard, which="triton")
        assert launches.kernels == ["_digit_histogram_kernel"] * passes, launches.kernels
        assert comms.calls == [("all_reduce", 2 * 3 * 257 * 4)] * passes, comms.calls


def _oracle_megatron(full, lt, ids, clamp, up):
    """verl 0.9.1's Megatron top-k forward KL in float64 on the whole vocabulary: the loss,
    the masses of the clamped log-probs, the overlap diagnostics, the gradient."""
    x = full.detach().double().requires_grad_()
    ls = torch.log_softmax(x, -1).gather(-1, ids)
    lt = lt.double()
    if clamp is not None:
        ls, lt = ls.clamp_min(clamp), lt.clamp_min(clamp)
    kl = lt.exp() * (lt - ls)
    (kl.sum(-1) * up.double()).sum().backward()
    top = torch.topk(x.detach(), ids.shape[-1], -1).indices
    overlap = (ids[..., :, None] == top[..., None, :]).any(-1)
    count = overlap.sum(-1)
    adv = (-kl.detach() * overlap).sum(-1) / count.clamp_min(1)
    return dict(distillation_losses=kl.sum(-1).detach(), student_mass=ls.detach().exp().sum(-1),
                teacher_mass=lt.exp().sum(-1), overlap_count=count,
                overlap_token_advantage=torch.where(count > 0, adv, 0.0)), x.grad  # fmt: skip


@check
def megatron_topk_distillation(ctx):
    """``compute_forward_kl_topk_megatron`` on each rank's shard against the float64
    transcription of verl's Megatron math: every output, the gradient; clamps -2 and
    none, fp32 and bf16 logits, K = 1 and 4, ids repeated and on every shard."""
    g = ctx.gen(3)
    w = 7
    vocab = w * ctx.world
    start, stop = ctx.rank * w, (ctx.rank + 1) * w
    for k, clamp, dtype in ((4, -2.0, torch.float32), (1, None, torch.float32),
                            (4, None, torch.bfloat16)):  # fmt: skip
        full = (torch.randn(2, 5, vocab, generator=g) * 2).to(dtype)
        ids = torch.randint(0, vocab, (2, 5, k), generator=g)
        ids[0, 1] = torch.topk(full[0, 1].float(), k).indices  # full overlap
        lt = torch.log_softmax(torch.randn(2, 5, k, generator=g) * 2, -1)
        up = torch.randn(2, 5, generator=g)
        want, o_grad = _oracle_megatron(full, lt, ids, clamp, up)
        config = {"distillation_loss": {"log_prob_min_clamp": clamp}}
        local = _local(full, start, stop)
        got = compute_forward_kl_topk_megatron(local, lt, ids, config, process_group=ctx.group)
        (got["distillation_losses"] * up).sum().backward()
        what = f"K={k} clamp={clamp} {dtype}"
        assert sorted(got) == sorted(want), what
        for name in ("distillation_losses", "student_mass", "teacher_mass",
                     "overlap_token_advantage"):  # fmt: skip
            assert got[name].dtype == torch.float32, (name, what)
            assert_rel(got[name], want[name], FP32_TOL, f"{name} {what}")
        assert torch.equal(got["overlap_count"], want["overlap_count"]), what
        assert got["overlap_count"][0, 1] == k, what
        tol = FP32_TOL if dtype == torch.float32 else 4e-3
        assert_rel(local.grad.double(), o_grad[..., start:stop], tol, f"grad {what}")


@check
def megatron_topk_nan_row(ctx):
    """A NaN in one rank's shard of a student row: that row's loss NaN on every rank, its
    overlap count 0 and the overlap's mean NaN; the other rows finite."""
    g = ctx.gen(9)
    w, k = 5, 3
    vocab = w * ctx.world
    full = torch.randn(1, 3, vocab, generator=g)
    full[0, 1, vocab - 1] = math.nan  # the last rank's
    ids = torch.randint(0, vocab, (1, 3, k), generator=g)
    lt = torch.log_softmax(torch.randn(1, 3, k, generator=g), -1)
    local = _local(full, ctx.rank * w, (ctx.rank + 1) * w)
    config = {"distillation_loss": {"log_prob_min_clamp": -10.0}}
    got = compute_forward_kl_topk_megatron(local, lt, ids, config, process_group=ctx.group)
    assert got["distillation_losses"][0, 1].isnan()
    assert got["overlap_count"][0, 1] == 0 and got["overlap_token_advantage"][0, 1].isnan()
    for name in got:
        assert torch.isfinite(got[name][0, [0, 2]].double()).all(), name


@check
def megatron_topk_bad_arguments(ctx):
    """An id outside [0, V) of the whole vocabulary and K > V raise ValueError naming
    ``teacher_topk_ids`` on every rank (the ids are the same everywhere), before any
    collective; the group stays in step."""
    w = 3
    local = torch.randn(1, 2, w)
    lt = torch.zeros(1, 2, 2)
    cfg = {"distillation_loss": {"log_prob_min_clamp": None}}
    for ids in (torch.full((1, 2, 2), w * ctx.world), torch.zeros(1, 2, w * ctx.world + 1)):
        ids = ids.long()
        with pytest.raises(ValueError, match="teacher_topk_ids"):
            compute_forward_kl_topk_megatron(local, lt[..., :1].expand(*ids.shape), ids, cfg,
                                             process_group=ctx.group)  # fmt: skip
    x = torch.ones(3)
    dist.all_reduce(x, group=ctx.group)
    assert x.tolist() == [float(ctx.world)] * 3


@check
def against_verls_megatron_function(ctx):
    """verl 0.9.1's logits processor (``compute_topk_loss``, Megatron strategy) on one nested
    batch (two sequences, packed and padded by verl's ``preprocess_thd_engine`` to the
    tensor-parallel size) with Megatron's tensor-parallel group, unpatched (verl's own
    Megatron function) and under ``fused_rl.integrations.verl.patched()`` (fused_rl's):
    every output and the gradient. Runs where verl and Megatron-Core import (else nothing
    to compare)."""
    if not HAVE_VERL_MEGATRON:
        return
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.trainer.distillation import losses as dispatcher
    from verl.trainer.distillation.megatron import losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    import fused_rl.integrations.verl as fused_verl

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.world)
    try:
        g = ctx.gen(4)
        w, k = 8, 4
        vocab = w * ctx.world
        ids = [torch.randint(0, vocab, (n, k), generator=g) for n in (5, 3)]
        lts = [torch.log_softmax(torch.randn(n, k, generator=g) * 2, -1) for n in (5, 3)]
        nids = torch.nested.nested_tensor(ids, layout=torch.jagged)
        nlts = torch.nested.nested_tensor(lts, layout=torch.jagged)
        rows = preprocess_thd_engine(nids, pre_process=True)[0].shape[1]
        full = torch.randn(1, rows, vocab, generator=g) * 2
        up = torch.randn(1, rows, generator=g)
        start, stop = ctx.rank * w, (ctx.rank + 1) * w
        config = DistillationConfig(distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=k, log_prob_min_clamp=-10.0))  # fmt: skip
        actor = SimpleNamespace(strategy="megatron")
        data = {"teacher_logprobs": nlts, "teacher_ids": nids}
        outs, grads = [], []
        for patch in (False, True):  # verl's logits processor, which looks the function up
            local = _local(full, start, stop)
            with fused_verl.patched() if patch else contextlib.nullcontext():
                routed = losses.compute_forward_kl_topk is compute_forward_kl_topk_megatron
                assert routed == patch
                out = dispatcher.compute_topk_loss(actor, config, data, local, "thd")
            (out["distillation_losses"] * up).sum().backward()
            outs.append(out)
            grads.append(local.grad)
        theirs, ours = outs
        assert sorted(theirs) == sorted(ours)
        for name in theirs:
            if name == "overlap_count":
                assert torch.equal(theirs[name], ours[name])
            else:
                torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world, name", world_cases(CHECKS, WORLD_SIZES))
@needs_gloo
@needs_interpreter
def test_vocab_parallel_topk(world, name):
    if name == "against_verls_megatron_function" and not HAVE_VERL_MEGATRON:
        pytest.skip("needs verl >= 0.9.1 and Megatron-Core")
    failed = failures(__name__, world, name)
    assert not failed, "\n".join(failed)


def test_megatron_group_needs_megatron(monkeypatch):
    """Without ``process_group=`` the function takes Megatron's tensor-parallel group: an
    ImportError naming it where Megatron-Core is not installed."""
    for name in [m for m in sys.modules if m.split(".")[0] == "megatron"]:  # imported by verl
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(ImportError, match="process_group="):
        compute_forward_kl_topk_megatron(torch.randn(1, 2, 3), torch.zeros(1, 2, 1),
                                         torch.zeros(1, 2, 1, dtype=torch.long), {})  # fmt: skip
