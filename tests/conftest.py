"""Test configuration: run the real Triton kernels on CPU through the interpreter when
there is no GPU, and poison fresh allocations with NaN so unwritten outputs fail."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before Triton / fused_rl kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _unpoisoned_trace_rules() -> None:
    """Dynamo maps torch functions to trace rules once, lazily, by their identity; built while
    the poison fixture below had replaced torch.empty, the map would lack the real one and a
    later torch.compile test would refuse to trace torch.empty. Build it unpoisoned, and
    again whenever something cleared it (``dist.init_process_group`` does)."""
    rules = torch._dynamo.trace_rules
    if torch.empty not in rules.get_torch_obj_rule_map():
        rules.clear_lru_cache()
        rules.get_torch_obj_rule_map()


# not on a vocab-parallel rank (tests/dist_harness.py), which imports this module already
# poisoned: there the map is built at its first compile either way, and the ranks that never
# compile skip Dynamo's import (~2 s each)
if not os.environ.get("FUSED_RL_DIST_RANK"):
    _unpoisoned_trace_rules()


def pytest_configure(config):
    config.addinivalue_line("markers", "no_poison: do not NaN-fill torch.empty in this test")
    config.addinivalue_line(
        "markers",
        "integration: runs a subprocess, the bench CLI, the example or the sm_90 compile "
        "(part of the suite and of CI; `-m 'not integration'` leaves them out)",
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    """``FUSED_RL_FAILURE_LOG=<file>`` (``bench/gpu_session.sh`` sets it): each failure's
    traceback appended to the file when it happens, by the controlling process, so a run
    stopped by a time limit keeps them (pytest prints them only at its end)."""
    path = os.environ.get("FUSED_RL_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _poison_empty(request, monkeypatch):
    """NaN-fill every floating ``torch.empty`` / ``torch.empty_like`` during the test."""
    _unpoisoned_trace_rules()  # before the patch: a map built during it would lack torch.empty
    if "no_poison" in request.keywords:
        yield
        return
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _fill(t):
        if t.is_floating_point() and t.numel() > 0:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: _fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _fill(real_empty_like(*a, **k)))
    yield


@pytest.fixture(autouse=True, scope="session")
def _interpreter_fast_paths():
    """Interpreted kernels skip the interpreter's redundant re-patch of ``triton.language`` at
    each helper call (``helpers.helper_calls_patch_once``) and look its NumPy dtypes up in a
    memo (``helpers.np_dtype_memo``): the suite's time, not its results."""
    from helpers import helper_calls_patch_once, np_dtype_memo

    with helper_calls_patch_once(), np_dtype_memo():
        yield


@pytest.fixture(autouse=True, scope="session")
def _pinned_compile_options():
    """Every fused_rl launch the suite makes passes its compile options (FMA contraction on),
    so none depends on Triton's default (``helpers.pinned_compile_options``)."""
    from helpers import pinned_compile_options

    with pinned_compile_options():
        yield


@pytest.fixture(autouse=True)
def _compiled_scalar_abi():
    """Python floats reach interpreted kernels as fp32, as a compiled launch passes them, so a
    hyper-parameter that needs ``f32_pair`` to be fp64-exact fails here, not first on a GPU."""
    from helpers import compiled_scalar_abi

    with compiled_scalar_abi():
        yield
