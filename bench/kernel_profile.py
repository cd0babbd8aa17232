"""Device time per kernel of one benchmark case, per provider (GPU only).

    python bench/kernel_profile.py --case policy_loss:grpo:8x2048x151936 \
        --case linear_policy_loss:grpo:4x1024x151936 --providers fused_rl,liger,trl

Each provider runs the case (forward + backward, as ``bench/run.py`` times it) once to warm
up, then ``--reps`` times under ``torch.profiler``; the table lists every CUDA kernel with its
mean device microseconds per call and calls per run, the total, and the bytes of the logits
each logits-op kernel would move at the measured copy bandwidth for comparison. What the
wall-clock median of ``bench/run.py`` cannot tell: which kernel (the vocab-stream forward,
the backward, a GEMM, a small launch) holds the time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import measure as M  # noqa: E402
from bench import providers as P  # noqa: E402
from bench.cases import HIDDEN, HIDDEN_OPS, Case, make_inputs  # noqa: E402


def parse_case(text: str, dtype: str = "bf16") -> Case:
    """``op:variant:BxTxV[:mode]`` (mode default ``fwd_bwd``; H = 4096 for the linear ops)."""
    op, variant, shape, *rest = text.split(":")
    mode = rest[0] if rest else "fwd_bwd"
    b, t, v = (int(x) for x in shape.split("x"))
    hidden = HIDDEN["full"] if op in HIDDEN_OPS else None
    return Case(op, variant, mode, b, t, v, dtype, compile_ok=False, hidden=hidden)


def kernel_times(run, reps: int) -> dict[str, tuple[float, float]]:
    """``{kernel name: (mean device us per run, launches per run)}`` over ``reps`` runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            # device_time_total (torch >= 2.4), cuda_time_total before
            us = getattr(event, "device_time_total", None)
            total[event.name] += event.cuda_time_total if us is None else us
            count[event.name] += 1
    return {name: (total[name] / reps, count[name] / reps) for name in total}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", required=True, help="op:variant:BxTxV[:mode]")
    p.add_argument("--providers", default="fused_rl,liger")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_profile: no CUDA device")
        return 1
    copy = M.copy_gbps("cuda")
    print(f"{M.device_name('cuda')}; device-to-device copy {copy:.0f} GB/s (read + write)")
    for text in args.case:
        case = parse_case(text)
        inp = make_inputs(case, "cuda")
        logits_bytes = case.batch * case.seqlen * case.vocab * 2
        print(f"\n== {case.label()}  (one pass over the logits at copy speed: "
              f"{logits_bytes / (copy / 2 * 1e9) * 1e6:.0f} us read-only, "
              f"{2 * logits_bytes / (copy * 1e9) * 1e6:.0f} us read + write)")  # fmt: skip
        for provider in args.providers.split(","):
            if not P.applies(provider, case):
                continue
            try:
                run = P.build(provider, case, inp)
                run()
                rows = kernel_times(run, args.reps)
            except Exception as exc:  # a provider that cannot run here: say why, go on
                print(f"  {provider}: not profiled ({type(exc).__name__}: {exc})"[:300])
                continue
            total = sum(us for us, _ in rows.values())
            print(f"  {provider}: {total:.0f} us of kernels per run")
            for name, (us, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:12]:
                print(f"    {us:9.1f} us  x{calls:<5.1f} {name[:110]}")
            M.free_memory("cuda")
        del inp
        M.free_memory("cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
