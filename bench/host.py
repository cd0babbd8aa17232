"""Host cost of a call: microseconds per call on a tiny shape, where the device is never
the bottleneck, and the launches one call makes (issue 10: a call must cost what its
kernels cost).

On CPU the Triton kernels are stubbed (``fused_rl.profiling.stub_kernels``: a launch records
the kernel's name and does nothing), so what is timed is the Python wrapper, custom-op
dispatch and the aten ops around the kernels. On a GPU the real kernels run and the timed
loop is wrapped in ``torch.cuda.synchronize``. Value checks are off while timing
(``fused_rl.config.check_values = False``, a host sync per call in eager mode).

The yardstick is :func:`eager_grpo_loss`: the GRPO loss with a k3 KL penalty and an entropy
bonus as ten lines of plain PyTorch, real math included. Times are medians over ``repeat``
rounds, each timing ``number`` back-to-back calls of every callable in turn (interleaved,
so that drift in the machine's speed hits all of them alike).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import statistics
import time
from collections.abc import Callable

import torch

SHAPE = (2, 8, 64)  # B, T, V
BETA, ENTROPY_COEF, EPS_LOW, EPS_HIGH = 0.04, 0.01, 0.2, 0.28

CALLS = {
    "policy_loss": "fused_rl.policy_loss fwd+bwd (k3, entropy, every metric)",
    # the token-local variants: the same call with another surrogate / IS weights, which
    # must cost what PPO-clip costs (the same launches; tests/test_bench.py checks it)
    "policy_loss_cispo": "  same, surrogate='cispo'",
    "policy_loss_is": "  same, PPO-clip with is_weights (B, T)",
    "token_logprobs": "fused_rl.token_logprobs(...).sum() fwd+bwd",
    "eager": "eager GRPO loss + entropy bonus fwd+bwd (the yardstick)",
    "liger": "Liger triton_grpo_loss fwd+bwd (no entropy bonus)",
}


def eager_grpo_loss(
    logits,
    targets,
    advantages,
    old_logprobs,
    ref_logprobs,
    mask,
    eps_low=EPS_LOW,
    eps_high=EPS_HIGH,
    beta=BETA,
    entropy_coef=ENTROPY_COEF,
):
    """GRPO with a k3 KL penalty and an entropy bonus, token-mean over ``mask``: plain PyTorch."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(logp - old_logprobs)
    adv = advantages.unsqueeze(-1)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    kl = torch.exp(ref_logprobs - logp) - (ref_logprobs - logp) - 1
    per_token = surrogate + beta * kl - entropy_coef * entropy
    m = mask.float()
    return (per_token * m).sum() / m.sum()


def make_inputs(batch: int, seqlen: int, vocab: int, device, dtype=torch.float32, seed=0):
    """A tiny GRPO batch: logits leaf ``(B, T, V)``, the ``(B, T+1, V)`` buffer Liger takes,
    rollout log-probs near the policy's, one padded tail."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(batch, seqlen + 1, vocab, generator=gen).to(device, dtype)
    targets = torch.randint(0, vocab, (batch, seqlen), generator=gen).to(device)
    with torch.no_grad():
        logp = torch.log_softmax(buf[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(batch, seqlen, generator=gen).to(device)  # noqa: E731
    mask = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    mask[0, seqlen // 2 :] = False
    return {
        "logits": buf[:, :-1].detach().clone().requires_grad_(True),
        "buf": buf.detach().clone().requires_grad_(True),
        "targets": targets,
        "advantages": torch.randn(batch, generator=gen).to(device),
        "old_logprobs": logp + noise(0.1),
        "ref_logprobs": logp + noise(0.2),
        "mask": mask,
        "is_weights": 0.5 + torch.rand(batch, seqlen, generator=gen).to(device),
    }


def _policy_loss(inp, **variant):
    import fused_rl

    logits = inp["logits"]

    def call():
        logits.grad = None
        loss, metrics = fused_rl.policy_loss(
            logits,
            inp["targets"],
            inp["advantages"],
            old_logprobs=inp["old_logprobs"],
            ref_logprobs=inp["ref_logprobs"],
            mask=inp["mask"],
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            beta=BETA,
            kl_estimator="k3",
            entropy_coef=ENTROPY_COEF,
            loss_agg="token-mean",
            backend="triton",
            **variant,
        )
        loss.backward()
        return loss, metrics

    return call


def _token_logprobs(inp):
    import fused_rl

    logits = inp["logits"]

    def call():
        logits.grad = None
        logp = fused_rl.token_logprobs(logits, inp["targets"], backend="triton")
        logp.sum().backward()
        return logp

    return call


def _eager(inp):
    logits = inp["logits"]
    args = [inp[k] for k in ("targets", "advantages", "old_logprobs", "ref_logprobs", "mask")]

    def call():
        logits.grad = None
        loss = eager_grpo_loss(logits, *args)
        loss.backward()
        return loss

    return call


class Unavailable(Exception):
    """A call that cannot run here (Liger not importable)."""


def _liger(inp):
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:
        raise Unavailable(f"liger_kernel not importable ({type(exc).__name__})") from exc
    params = inspect.signature(triton_grpo_loss).parameters
    kwargs = dict(temperature=1.0, beta=BETA, eps_low=EPS_LOW, eps_high=EPS_HIGH, inplace=False)
    if "reduce" in params:
        kwargs["reduce"] = True  # token-mean inside, as a trainer calls it
    if "loss_type" in params:
        kwargs["loss_type"] = "dapo"  # normalised by the batch's token count: token-mean
    buf, mask = inp["buf"], inp["mask"].to(torch.int32)
    args = [inp[k] for k in ("old_logprobs", "ref_logprobs", "targets", "advantages")]

    def call():
        buf.grad = None
        out = triton_grpo_loss(buf, *args, mask, **kwargs)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if loss.dim():  # an older Liger without reduce=: per-token losses
            loss = (loss * mask).sum() / mask.sum()
        loss.backward()
        return loss

    return call


BUILDERS: dict[str, Callable] = {
    "policy_loss": _policy_loss,
    "policy_loss_cispo": lambda inp: _policy_loss(inp, surrogate="cispo"),
    "policy_loss_is": lambda inp: _policy_loss(inp, is_weights=inp["is_weights"]),
    "token_logprobs": _token_logprobs,
    "eager": _eager,
    "liger": _liger,
}


@contextlib.contextmanager
def host_timing(stub: bool):
    """Value checks off, one intra-op thread, and with ``stub`` every Triton launch a no-op.

    One thread: no op of a tiny shape is worth a parallel region, and on a loaded machine
    waking the pool's threads costs more than the math (eager 2.4 ms with 2 threads, 0.67 ms
    with one, on a 2-core machine at load 3)."""
    import fused_rl
    from fused_rl.profiling import stub_kernels

    saved, threads = fused_rl.config.check_values, torch.get_num_threads()
    fused_rl.config.check_values = False
    torch.set_num_threads(1)
    try:
        with stub_kernels() if stub else contextlib.nullcontext():
            yield
    finally:
        fused_rl.config.check_values = saved
        torch.set_num_threads(threads)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fns: dict[str, Callable[[], object]],
    device="cpu",
    repeat: int = 7,
    number: int | None = None,
    target_s: float = 0.02,
) -> dict[str, list[float]]:
    """Microseconds per call of each ``fns[name]()``: ``repeat`` samples each, every sample
    the mean of ``number`` back-to-back calls (default: enough calls to take ``target_s``,
    like ``timeit``'s autorange), the callables interleaved sample by sample. Each callable
    runs twice first (warm-up: compilation, caches). The caller takes the median."""
    counts = {}
    for name, fn in fns.items():
        fn(), fn()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - start, 1e-7)
        counts[name] = number or max(1, min(100_000, int(target_s / once)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for name, fn in fns.items():
                n = counts[name]
                _sync(device)
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                _sync(device)
                samples[name].append((time.perf_counter() - start) / n * 1e6)
    finally:
        if was_enabled:
            gc.enable()
    return samples


def count_launches(fn: Callable[[], object]) -> int:
    """Device-kernel-equivalent ops of one call (``fused_rl.profiling.LaunchCounter``)."""
    from fused_rl.profiling import LaunchCounter

    with LaunchCounter() as counter:
        fn()
    return counter.total


def count_host_work(fn: Callable[[], object]) -> dict[str, int]:
    """What one call makes the host do, counted (deterministic, unlike a timing): the Python
    functions of fused_rl it enters (``py_frames``: the wrapper, validation, launchers) and
    the ops that reach PyTorch's dispatcher (``dispatch_ops``: every aten op, whether it
    launches or not). Run with the kernels stubbed and the value checks off, as timed."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    frames = 0
    package = f"{os.sep}fused_rl{os.sep}"

    def profile(frame, event, _arg):
        nonlocal frames
        if event == "call" and package in frame.f_code.co_filename:
            frames += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    with _Ops() as ops:
        fn()
    return {"py_frames": frames, "dispatch_ops": ops.count}


def measure(
    calls=tuple(CALLS),
    device=None,
    shape=SHAPE,
    dtype=torch.float32,
    repeat=7,
    number=None,
    target_s=0.02,
    stub=None,
) -> dict:
    """``{"device", "stubbed", "shape", "rows": {name: {"us", "samples", "launches",
    "vs_eager"} or {"skipped": reason}}}`` for the ``calls`` (keys of ``CALLS``).

    ``stub`` (default: on CPU): Triton launches are no-ops while timing."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stub = device.type != "cuda" if stub is None else stub
    inp = make_inputs(*shape, device=device, dtype=dtype)
    rows: dict[str, dict] = {}
    fns = {}
    with host_timing(stub):
        for name in calls:
            try:
                fns[name] = BUILDERS[name](inp)
            except Unavailable as exc:
                rows[name] = {"skipped": str(exc)}
        samples = time_calls(fns, device, repeat=repeat, number=number, target_s=target_s)
        for name, fn in fns.items():
            rows[name] = {
                "us": statistics.median(samples[name]),
                "samples": samples[name],
                "launches": count_launches(fn),
                **count_host_work(fn),
            }
    eager = rows.get("eager", {}).get("us")
    for row in rows.values():
        if "us" in row:
            row["vs_eager"] = row["us"] / eager if eager else None
    return {
        "device": str(device),
        "stubbed": stub,
        "shape": shape,
        "dtype": str(dtype),
        "rows": {name: rows[name] for name in calls},
    }


def format_table(result: dict) -> str:
    b, t, v = result["shape"]
    how = (
        "Triton kernels stubbed (fused_rl.profiling.stub_kernels): the wrapper's cost"
        if result["stubbed"]
        else "real kernels, torch.cuda.synchronize around each timed loop"
    )
    lines = [
        f"Host cost per call, B={b} T={t} V={v} {result['dtype'].replace('torch.', '')} on "
        f"{result['device']}: {how}; value checks off; median of {_repeats(result)} samples",
        "",
        f"{'call':<58} {'us/call':>9} {'x eager':>8} {'launches':>9} {'py frames':>9} "
        f"{'aten ops':>8}",
    ]
    for name, row in result["rows"].items():
        label = CALLS[name]
        if "skipped" in row:
            lines.append(f"{label:<58} {'-':>9} {'-':>8} {'-':>9}  ({row['skipped']})")
            continue
        ratio = f"{row['vs_eager']:.2f}" if row.get("vs_eager") is not None else "-"
        lines.append(f"{label:<58} {row['us']:>9.1f} {ratio:>8} {row['launches']:>9} "
                     f"{row['py_frames']:>9} {row['dispatch_ops']:>8}")  # fmt: skip
    return "\n".join(lines)


def _repeats(result: dict) -> int:
    return max((len(r["samples"]) for r in result["rows"].values() if "samples" in r), default=0)
