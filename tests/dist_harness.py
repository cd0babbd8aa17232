"""The process-group harness of the vocab-parallel tests (``test_distributed*.py``).

Each test module keeps a ``CHECKS`` dict (name -> ``check(ctx)``, :func:`check_registry`),
each check given a :class:`Ctx`; :func:`failures` runs every check of a module on ``world``
gloo ranks in ONE spawn (cached per module and world size) and returns each rank's
traceback for a check, so a parametrised test per (world, check) reads its verdict without
spawning again. Fresh
``torch.empty`` buffers are NaN-filled on the ranks, as tests/conftest.py does in process.
:meth:`Ctx.once` runs a check's unsharded reference calls once over the group, the ranks
taking turns, instead of once on every rank (the ranks share the machine's cores).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    compiled_scalar_abi,
    helper_calls_patch_once,
    np_dtype_memo,
    pinned_compile_options,
)

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run Triton through the interpreter"
)


class Ctx:
    """What a check gets: its rank, the world size, the group (WORLD), seeded generators."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.group = dist.group.WORLD
        self._turn = 0  # the rank that runs the next :meth:`once` call

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)  # the same stream on every rank

    def once(self, *calls):
        """``[call() for call in calls]``, each call run on ONE rank (the ranks take turns,
        across calls of ``once`` too) and its result sent to every rank: for the unsharded
        reference calls, whose inputs are the same everywhere (the generators are seeded
        alike), so that the ranks do not each repeat them. A call must not draw from a
        shared generator (only one rank would), nor use the process group (only one rank
        runs it). Results are pickled: detached tensors, tuples, dicts. A call that raises
        (or returns what cannot be pickled) fails the check on every rank, its traceback in
        the message, never a rank alone, which would leave the others in a collective."""
        owner = [(self._turn + i) % self.world for i in range(len(calls))]
        self._turn += len(calls)
        mine = {}
        for i, call in enumerate(calls):
            if owner[i] == self.rank:
                try:
                    mine[i] = (None, pickle.dumps(call()))
                except BaseException:  # noqa: B036 - pytest.fail too: raised on every rank
                    mine[i] = (traceback.format_exc(), None)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.group)
        results = []
        for i in range(len(calls)):
            error, value = gathered[owner[i]][i]
            if error is not None:
                raise AssertionError(f"reference call {i} failed on rank {owner[i]}:\n{error}")
            results.append(pickle.loads(value))
        return results


def check_registry():
    """``(CHECKS, check)``: a test module's dict of checks and the decorator that fills it:
    ``@check``, or ``@check(worlds=(2,))`` for a check run at those world sizes only."""
    checks: dict = {}

    def check(fn=None, *, worlds=None):
        def register(fn):
            fn.worlds = worlds
            checks[fn.__name__] = fn
            return fn

        return register if fn is None else register(fn)

    return checks, check


def world_cases(checks: dict, world_sizes) -> list:
    """``(world, name)`` for each check at each of ``world_sizes`` it runs at."""
    return [
        pytest.param(world, name, id=f"{world}-{name}")
        for world in world_sizes
        for name, fn in checks.items()
        if fn.worlds is None or world in fn.worlds
    ]


_REAL_EMPTY = (torch.empty, torch.empty_like)


@contextlib.contextmanager
def unpoisoned():
    """``torch.empty`` / ``torch.empty_like`` as torch has them, for a check that Inductor
    compiles (the NaN fill traces as a copy into a fresh buffer, which Inductor's
    functional-graph check rejects; tests/conftest.py's ``no_poison`` marker in process)."""
    poisoned = (torch.empty, torch.empty_like)
    torch.empty, torch.empty_like = _REAL_EMPTY
    try:
        yield
    finally:
        torch.empty, torch.empty_like = poisoned


def poison_empty() -> None:
    """NaN-fill fresh floating ``torch.empty`` allocations (tests/conftest.py does this for
    in-process tests): an output the code never writes fails."""
    real_empty, real_empty_like = _REAL_EMPTY

    def fill(t):
        if t.is_floating_point() and t.numel() > 0:
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))


def _worker(rank: int, world: int, init_file: str, out_dir: str, module: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    poison_empty()
    os.environ["FUSED_RL_DIST_RANK"] = str(rank)  # read by tests/conftest.py
    tests = importlib.import_module(module)
    ctx = Ctx(rank, world)
    verdicts = {}
    with (
        compiled_scalar_abi(),
        helper_calls_patch_once(),
        np_dtype_memo(),
        pinned_compile_options(),
    ):
        for name, fn in tests.CHECKS.items():
            if fn.worlds is not None and world not in fn.worlds:
                continue
            try:
                t0 = time.perf_counter()
                ctx._turn = 0  # a check left early (on one rank) leaves the next in step
                fn(ctx)
                if os.environ.get("FUSED_RL_TIME_CHECKS"):
                    print(f"rank {rank} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
                verdicts[name] = None
            except BaseException:  # noqa: B036 - a verdict per check, whatever it raised
                verdicts[name] = traceback.format_exc()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(verdicts))
    dist.destroy_process_group()
    # the verdicts are written: leave without the interpreter's teardown, which now and then
    # aborts a rank after a short run ("terminate called without an active exception",
    # SIGABRT, after destroy_process_group returned) and fails spawn for nothing
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_RESULTS: dict = {}


def failures(module: str, world: int, name: str) -> list[str]:
    """Each rank's traceback of check ``name`` of test module ``module`` at ``world`` ranks."""
    if (module, world) not in _RESULTS:
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "init")
            torch.multiprocessing.spawn(
                _worker, args=(world, init_file, tmp, module), nprocs=world, join=True
            )
            _RESULTS[module, world] = [
                json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)
            ]
    return [f"rank {r}:\n{v[name]}" for r, v in enumerate(_RESULTS[module, world]) if v[name]]
