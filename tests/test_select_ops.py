"""``fused_rl._select_ops.kth_largest``: the k-th largest of each row by a streamed radix
select (``kernels/vocab/select.py``), against a float64 oracle written here (a Python sort of
each row) on both backends: every float dtype, ties at the k-th value, ``+-inf``, ``-0.0``,
neighbouring floats that differ only in the last digit a pass looks at, NaN rows, strided
and batched layouts, rows longer than a block, ``torch.compile(fullgraph=True)``, bad
arguments, and the cost (one launch, 8-bit digits: ``bits / 8`` passes, nothing allocated but
the output), and the sm_90 compile as launched (no spill, 128-bit loads)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import sm90_compile_output

import fused_rl._select_ops as S
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def oracle(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: NaN if it holds a NaN, else the k-th entry of its values sorted descending
    (Python floats: exact for every dtype here)."""
    rows = logits.detach().double().reshape(-1, logits.shape[-1]).cpu()
    out = []
    for row in rows.tolist():
        if any(math.isnan(v) for v in row):
            out.append(math.nan)
        else:
            out.append(sorted(row, reverse=True)[k - 1])
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def check(logits: torch.Tensor, k: int, backend: str) -> None:
    got = S.kth_largest(logits, k, backend=backend)
    want_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert got.shape == logits.shape[:-1] and got.dtype == want_dtype
    assert got.device == logits.device
    want = oracle(logits, k).to(got.device)
    same = (got.double() == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), (k, got[~same], want[~same])


def awkward_rows(dtype, device, vocab=53, seed=0):
    """``(3, 4, vocab)`` logits: Gaussian rows and, in row ``(0, *)``, the special cases:
    a run of ties, ``+-inf``, an all ``-inf`` row but for three values, ``-0.0`` beside
    ``+0.0``, and (row ``(2, 1)``, ``(2, 2)``) a NaN and a negative NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 4, vocab, generator=gen) * 3).to(dtype)
    x[0, 1, : vocab // 2] = x[0, 1, vocab - 1]  # ties across the k-th value
    x[0, 2, 7], x[0, 2, 8] = float("inf"), float("-inf")
    x[0, 3] = float("-inf")
    x[0, 3, :3] = torch.tensor([1.0, -2.0, 1.0], dtype=dtype)
    x[1, 0, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0], dtype=dtype)
    x[2, 1, 5] = float("nan")
    x[2, 2, 9] = -float("nan")
    return x.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_oracle(dtype, backend, device):
    x = awkward_rows(dtype, device)
    for k in (1, 2, 3, 5, 26, 27, 52, 53):
        check(x, k, backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_digit_decides(dtype, device):
    """Neighbouring floats (one unit in the last place apart, around several magnitudes and
    signs) and subnormals: the k-th is told apart only by the last digit the radix select
    looks at; both routes (one launch, one launch a pass)."""
    base = torch.tensor([0.75, -0.75, 3.0e-3, -40.0], dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    values = [base, torch.nextafter(base, base + 1), torch.nextafter(base, base - 1)]
    values.append(torch.tensor([tiny, -tiny, 0.0, -0.0], dtype=dtype))
    # subnormals (the interpreter's bf16 -> fp32 cast flushes them: the value is built from
    # its bits)
    values.append(torch.tensor([tiny, -tiny], dtype=torch.float64).to(dtype) / 4)
    row = torch.cat(values)
    perm = torch.randperm(row.numel(), generator=torch.Generator().manual_seed(1))
    x = torch.stack([row, row[perm], -row]).to(device)
    for k in range(1, row.numel() + 1):
        check(x, k, "triton")
        want = oracle(x, k).reshape(-1).to(device)
        assert torch.equal(pass_by_pass(x.reshape(-1, 1, x.shape[-1]), k).double(), want), k


def pass_by_pass(x3d: torch.Tensor, k: int) -> torch.Tensor:
    """The vocabulary-parallel route on one rank (``kth_largest_by_passes``), each pass's
    histogram checked for its shape and dtype."""

    def check(hist):
        assert hist.shape == (x3d.shape[0] * x3d.shape[1], S.BINS + 1)
        assert hist.dtype == torch.int32

    return S.kth_largest_by_passes(x3d, k, check)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_pass_a_launch_route(dtype, device):
    x = awkward_rows(dtype, device)
    for k in (1, 2, 26, 53):
        got = pass_by_pass(x.reshape(-1, 1, x.shape[-1]), k)
        want = oracle(x, k).reshape(-1).to(device)
        same = (got.double() == want) | (got.isnan() & want.isnan())
        assert bool(same.all()), (k, got[~same], want[~same])


@pytest.mark.no_poison  # Dynamo cannot trace the NaN-filling torch.empty of the fixture
def test_one_pass_a_launch_route_compiles(device):
    """``digit_histogram_op`` and the digit choice trace with ``torch.compile(fullgraph=True)``."""
    x = awkward_rows(torch.bfloat16, device).reshape(-1, 1, 53)
    compiled = torch.compile(pass_by_pass, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, 5), pass_by_pass(x, 5), rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_rows_longer_than_a_block(dtype, device):
    """Several loop steps a pass (the launch streams 2048 columns a step), with the k-th
    value's ties spread across them."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4500, generator=gen).to(dtype)
    x[1, ::7] = x[1, 11]
    x = x.to(device)
    for k in (1, 64, 128, 700, 4500):
        check(x, k, "triton")
        want = oracle(x, k).to(device)
        assert torch.equal(pass_by_pass(x[:, None], k).double(), want), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts(backend, device):
    """Strided and transposed views are read in place; 1-D, 2-D, 4-D and zero rows."""
    x = awkward_rows(torch.float32, device, vocab=40)
    check(x[:, 1:, ::2], 4, backend)  # a strided vocabulary and a row offset
    check(x.transpose(0, 1), 6, backend)
    check(x[1, 2], 3, backend)
    check(x.reshape(2, 6, 40)[None].expand(2, 2, 6, 40), 9, backend)
    empty = S.kth_largest(x[:, :0], 1, backend=backend)
    assert empty.shape == (3, 0)


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
def test_one_launch_nothing_allocated_but_the_output(device):
    x = torch.randn(4, 16, 300, generator=torch.Generator().manual_seed(3)).to(device)
    x = x.to(torch.bfloat16)
    with LaunchCounter() as c:
        S.kth_largest(x, 10, backend="triton")
    assert (c.total, c.kernels) == (1, ["_kth_largest_kernel"])
    with AllocationTracker() as a:
        S.kth_largest(x, 10, backend="triton")
    assert a.count_at_least(64 * 4 + 1) == 0  # only the (4, 16) fp32 output


def test_never_differentiable(device):
    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(4)).to(device)
    x.requires_grad_()
    for backend in BACKENDS:
        out = S.kth_largest(x, 3, backend=backend)
        assert not out.requires_grad


def test_torch_compile_fullgraph(device):
    x = awkward_rows(torch.bfloat16, device)

    def f(logits):
        return S.kth_largest(logits, 5) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("k", "error", "match"),
    [
        (0, ValueError, "k must be"),
        (54, ValueError, "k must be at most the vocabulary size 53, got 54"),
        (True, TypeError, "k must be an int"),
        (2.0, TypeError, "k must be an int"),
    ],
)
def test_bad_k_names_it(k, error, match, device):
    x = torch.zeros(2, 53, device=device)
    with pytest.raises(error, match=match):
        S.kth_largest(x, k)


def test_bad_logits_name_them(device):
    with pytest.raises(TypeError, match="logits"):
        S.kth_largest(torch.ones(2, 5, dtype=torch.int64, device=device), 1)


# Triton's own cubin for sm_90a, as launched at V = 151936: no register spilled; bf16 rows
# with 16-aligned lengths load 128 bits at a time; every offset product 64-bit. The same for
# the one-pass histogram kernel of the vocabulary-parallel select.
_COMPILE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import triton, triton.language as tl
from triton.compiler import ASTSource
from hopper_compile import (SM90, kernel_signature, narrow_offset_products, sm90_options,
                            stack_bytes)
from fused_rl._launch import vocab_launch
import fused_rl.kernels.vocab.select as select

fn = select._kth_largest_kernel

launch = vocab_launch(151936, writes=False)
names = [p.name for p in fn.params if not p.is_constexpr]
aligned = ("logits_ptr", "out_ptr", "V", "stride_outer", "stride_inner")
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
count = 0
for logits, out, acc in (("*bf16", "*fp32", tl.float32), ("*fp16", "*fp32", tl.float32),
                         ("*fp32", "*fp32", tl.float32), ("*fp64", "*fp64", tl.float64)):
    sig = dict(kernel_signature(fn, set(), {"logits_ptr": logits}, out), stride_v="constexpr")
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs=dict(BLOCK_V=launch["BLOCK_V"], ACC=acc, stride_v=1))
    c = triton.compile(src, target=SM90,
                       options=sm90_options(launch["num_warps"]))
    assert stack_bytes(c.asm["cubin"]) == 0, (logits, "registers spilled")
    assert not narrow_offset_products(c.asm["ttir"]), (logits, "narrow offsets")
    if logits != "*fp64":
        ptx = c.asm["ptx"]
        assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, (logits, "no vector load")
    count += 1
# the vocabulary-parallel pass (fused_rl.distributed.sharded_kth_largest): one a launch
hist = select._digit_histogram_kernel
names = [p.name for p in hist.params if not p.is_constexpr]
for logits, first in (("*bf16", True), ("*bf16", False), ("*fp64", False)):
    sig = dict(kernel_signature(hist, set(), {"logits_ptr": logits, "prefix_ptr": "*i64",
                                              "hist_ptr": "*i32"}, "*i32"), stride_v="constexpr")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    src = ASTSource(fn=hist, signature=sig, attrs=attrs, constexprs=dict(
        FIRST=first, BLOCK_V=launch["BLOCK_V"], stride_v=1))
    c = triton.compile(src, target=SM90,
                       options=sm90_options(launch["num_warps"]))
    assert stack_bytes(c.asm["cubin"]) == 0, (logits, first, "registers spilled")
    assert not narrow_offset_products(c.asm["ttir"]), (logits, first, "narrow offsets")
    count += 1
print("compiled", count)
"""


@pytest.mark.integration
@pytest.mark.no_poison
def test_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.compiler")
    assert sm90_compile_output(_COMPILE_SCRIPT).endswith("compiled 7")
