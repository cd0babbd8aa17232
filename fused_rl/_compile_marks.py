"""Marks ``torch.compile`` reads on fused_rl's host functions, set without importing
``torch._dynamo`` (about 2 s, most of ``import fused_rl``'s time; a program that compiles
imports it anyway). Plain Python: the reference twin and the leaf tables use it too."""


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result``: Dynamo calls ``fn`` while tracing and
    keeps its result as a constant (for host-side tables and probes, not tensor code). The
    mark set as that function sets it (tests/test_backend.py compares the two, so a torch
    that marks otherwise fails the suite). Not for a ``functools.lru_cache`` wrapper: Dynamo
    traces through those with a warning; cache inside ``fn`` instead."""
    fn._dynamo_marked_constant = True
    return fn
