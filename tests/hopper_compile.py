"""Compile every Triton kernel of fused_rl for a Hopper GPU (sm_90) with no GPU present.

Run as a script in a process WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces kernels
by numpy stand-ins that cannot be compiled): ``python tests/hopper_compile.py``. Prints one
line per kernel and exits non-zero if any variant fails. ``--offsets`` compiles only the
modules of ``WIDE_OFFSET_MODULES`` and checks their offsets are 64-bit
(``narrow_offset_products``). Used by test_compile_hopper.py.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import triton
import triton.language as tl
from fused_rl.kernels.modes import KL_KINDS, N_MIX, POLICY_PARAMS
from fused_rl.kernels.vocab.truncated import _bracket_sums
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fused_rl._launch import COMPILE_OPTIONS

SM90 = GPUTarget("cuda", 90, 32)


def sm90_options(num_warps: int | None = None) -> dict:
    """A launch's compile options (``fused_rl._launch.COMPILE_OPTIONS``: contracted
    multiply-adds) with its ``num_warps`` (Triton's default when None): the sm_90 compiles
    here and in the tests' compile scripts are the kernels as launched."""
    options = dict(COMPILE_OPTIONS)
    if num_warps is not None:
        options["num_warps"] = num_warps
    return options


MODULES = [
    "vocab.layer1",
    "vocab.layer3",
    "vocab.policy_fused",
    "token_ops.values",
    "token_ops.reductions",
    "token_ops.kl",
    "token_ops.advantages",
    "token_ops.gaussian",
    "policy.token_pass",
    "policy.finalize",
    "token_ops.rollout",
]
# runtime float arguments (everything else that is not a pointer is an integer)
FLOAT_ARGS = {
    "inv_t_hi", "inv_t_lo", "inv_cap_hi", "inv_cap_lo", "eps_low", "eps_high", "dual_clip",
    "delta", "beta", "entropy_coef",
    "eps", "correction", "clip_hi", "clip_lo", "lo_hi", "lo_lo", "hi_hi", "hi_lo",
    "vclip_hi", "vclip_lo", "coeff_hi", "coeff_lo", "gamma_hi", "gamma_lo", "decay_hi",
    "decay_lo", "coef_hi", "coef_lo", "num_items_hi", "num_items_lo", "n_seq", "max_length",
    "eps_hi", "eps_lo", "grad_scale_hi", "grad_scale_lo",
}  # fmt: skip
# tuple arguments: the policy kernels' hyper-parameters, one fp32 (hi, lo) pair per entry of
# kernels/modes.py POLICY_PARAMS; the distillation kernels' JSD constants (kernels/modes.py
# N_MIX: fused_rl.distill.mixture_constants)
TUPLE_ARGS = {"hyper": ("fp32",) * (2 * len(POLICY_PARAMS)), "mix": ("fp32",) * N_MIX}
# modules whose every pointer offset must be computed in 64 bits (narrow_offset_products)
WIDE_OFFSET_MODULES = [
    "token_ops.reductions",
    "token_ops.values",
    "token_ops.gaussian",
    "token_ops.rollout",
]
INT_NAMES = {"ignore_index", "rows_inner", "group_size", "shift", "positions", "n_outer",
             "n_rows", "r_shift"}  # fmt: skip


def _is_int_arg(name: str) -> bool:
    """Lengths (``N``, ``T``...), strides and the named integer arguments."""
    return name.isupper() or "stride" in name or name.startswith("s_") or name in INT_NAMES


INT_POINTERS = {"targets_ptr": "*i64", "index_ptr": "*i64", "code_ptr": "*i8"}
MASK_POINTERS = {"m_ptr", "mask_ptr", "pm_ptr", "vm_ptr", "keep_ptr"}
# pointers read in the input dtype (the rest are fp32 / fp64 statistics and outputs)
INPUT_POINTERS = {"logits_ptr", "grad_ptr", "x_ptr", "gx_ptr", "v_ptr", "gv_ptr", "lp_ptr",
                  "rl_ptr"}  # fmt: skip
# small values so the compile stays fast; the real launchers pick larger ones
BLOCKS = {"BLOCK_V": 256, "BLOCK": 256, "BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_R": 16,
          "BLOCK_B": 16}  # fmt: skip
KL_FULL = KL_KINDS.index("full")  # the exact KL's KL_KIND
# KIND: the two-log-prob estimators only (kl_and_grad asserts it never sees "full")
ENUMS = {"KL_KIND": 6, "KIND": 5, "MODE": 3, "AGG": 4, "SURROGATE": 6}


def _kernels(modules=MODULES):
    for module_name in modules:
        module = importlib.import_module(f"fused_rl.kernels.{module_name}")
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") and name.endswith("_kernel"):
                yield fn


def _flag_sets(fn):
    flags = [p.name for p in fn.params if p.is_constexpr and p.name.isupper()]
    flags = [f for f in flags if f not in BLOCKS and f != "ACC"]
    bools = [f for f in flags if f not in ENUMS]
    sets = [dict.fromkeys(bools, False), dict.fromkeys(bools, True)]
    sets += [{**dict.fromkeys(bools, False), b: True} for b in bools]
    out = []
    for i, s in enumerate(sets):
        for enum in (f for f in flags if f in ENUMS):
            s = {**s, enum: i % ENUMS[enum]}
        if s not in out:
            out.append(s)
    for enum in (f for f in flags if f in ENUMS):  # every enum value at least once
        for value in range(ENUMS[enum]):
            s = {**sets[1], **{e: 0 for e in flags if e in ENUMS}, enum: value}
            if s not in out:
                out.append(s)
    return out


def _signature(fn, low_precision: bool):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in INT_POINTERS:
            sig[p.name] = INT_POINTERS[p.name]
        elif p.name in MASK_POINTERS:
            sig[p.name] = "*i1"
        elif p.name.endswith("_ptr"):
            wide = "*fp32" if low_precision else "*fp64"
            sig[p.name] = "*bf16" if low_precision and p.name in INPUT_POINTERS else wide
        elif p.name in FLOAT_ARGS:
            sig[p.name] = "fp32"
        elif p.name in TUPLE_ARGS:
            sig[p.name] = TUPLE_ARGS[p.name]
        elif _is_int_arg(p.name):
            sig[p.name] = "i32"
        else:  # a new float argument compiled as i32 would hide a real signature error
            raise AssertionError(f"{fn.__name__}: add {p.name!r} to FLOAT_ARGS or INT_NAMES")
    return sig


def compile_all(kernel, low_precision: bool, check_offsets: bool = False) -> int:
    """Compile every flag set of ``kernel``; return how many variants compiled. With
    ``check_offsets``, fail on any i32 product that reaches a pointer offset."""
    acc = tl.float32 if low_precision else tl.float64
    count = 0
    for flags in _flag_sets(kernel):
        constexprs = {p.name: BLOCKS[p.name] for p in kernel.params if p.name in BLOCKS}
        constexprs.update(flags, ACC=acc)
        source = ASTSource(fn=kernel, signature=_signature(kernel, low_precision),
                           constexprs=constexprs)  # fmt: skip
        compiled = triton.compile(source, target=SM90, options=sm90_options())
        if ".entry" not in compiled.asm["ptx"]:
            raise AssertionError(f"no kernel entry in the PTX of {kernel.__name__} {flags}")
        narrow = narrow_offset_products(compiled.asm["ttir"]) if check_offsets else []
        if narrow:
            raise AssertionError(
                f"32-bit offset arithmetic in {kernel.__name__} {flags}:\n" + "\n".join(narrow)
            )
        count += 1
    return count


# one SSA definition of a TTIR line: ``%name = op operands : types loc(...)``
_TTIR_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+)(.*?)(?: loc\(.*)?$")
_I32 = re.compile(r":\s*(?:i32|tensor<[\dx]*xi32>)\s*$")


def kernel_signature(fn, floats, pointers: dict, other_ptr: str, unit=()) -> dict:
    """A Triton signature for ``ASTSource``: constexprs (and ``unit``, compiled as the
    constant 1), the pointer types in ``pointers`` (name -> type), ``other_ptr`` for every
    other ``*_ptr``, ``fp32`` for the names in ``floats``, :data:`TUPLE_ARGS`' types for
    its tuples, ``i32`` for the rest. For the
    per-module compile scripts of tests/test_distill.py and tests/test_truncated.py."""
    out = {}
    for p in fn.params:
        n = p.name
        if p.is_constexpr or n in unit:
            out[n] = "constexpr"
        elif n in pointers:
            out[n] = pointers[n]
        elif n.endswith("_ptr"):
            out[n] = other_ptr
        elif n in TUPLE_ARGS:
            out[n] = TUPLE_ARGS[n]
        else:
            out[n] = "fp32" if n in floats else "i32"
    return out


def narrow_offset_products(ttir: str) -> list[str]:
    """The i32 integer products (``arith.muli`` / ``arith.shli`` of ``i32``) whose value reaches
    the offset operand of a ``tt.addptr``, one TTIR line each (empty when all is well).

    Why: a launch passes lengths and strides as i32 whenever they fit, so ``ptr + 3 * R``
    computes ``3 * R`` in i32 and wraps once ``R`` passes 2^31 / 3 (~715M rows), while ``ptr
    + R`` alone cannot wrap. Offsets that are 64-bit show up in the TTIR as ``arith.extsi ... to
    i64`` before the product (``row.to(tl.int64) * stride``, ``wide(R) * 3``), so the check is:
    walk back from every pointer offset through the ops defining it and report each i32
    product met (a sum of two in-range i32 values, such as a loop counter plus
    ``tl.arange``, is not flagged). The TTIR is the front end's output after inlining, so
    helper functions are checked where they are called."""
    defs = {}
    for line in ttir.splitlines():
        match = _TTIR_DEF.match(line)
        if match:
            name, op, rest = match.groups()
            defs[name] = (op, re.findall(r"%[\w#]+", rest), bool(_I32.search(rest)), line.strip())
    found, seen = [], set()
    for op, operands, _, _ in list(defs.values()):
        if op != "tt.addptr":
            continue
        stack = operands[1:]  # the offset; the base pointer is an addptr of its own
        while stack:
            name = stack.pop()
            if name in seen or name not in defs:  # function / loop arguments end the walk
                continue
            seen.add(name)
            d_op, d_operands, is_i32, d_line = defs[name]
            if d_op in ("arith.muli", "arith.shli") and is_i32:
                found.append(d_line)
            stack.extend(d_operands)
    return found


@triton.jit
def _narrow_offset_canary(out_ptr, R):
    tl.store(out_ptr + 3 * R, 1.0)  # i32 product: must be flagged


@triton.jit
def _wide_offset_canary(out_ptr, R):
    tl.store(out_ptr + 3 * R.to(tl.int64), 1.0)  # 64-bit: must pass


def offset_check_works() -> list[str]:
    """The check flags a known i32 offset product and passes its 64-bit twin (so that a
    change in Triton's TTIR cannot make it vacuous)."""
    problems = []
    for kernel, expect_narrow in ((_narrow_offset_canary, True), (_wide_offset_canary, False)):
        source = ASTSource(fn=kernel, signature={"out_ptr": "*fp32", "R": "i32"}, constexprs={})
        ttir = triton.compile(source, target=SM90, options=sm90_options()).asm["ttir"]
        if bool(narrow_offset_products(ttir)) != expect_narrow:
            problems.append(f"narrow_offset_products is wrong on {kernel.__name__}:\n{ttir}")
    return problems


def _nvidia_tool(name: str) -> str:
    """The ``cuobjdump`` / ``nvdisasm`` Triton ships (``triton.knobs`` on recent Triton, its
    ``bin`` folder on older), else one on the PATH."""
    try:
        from triton import knobs

        return getattr(knobs.nvidia, name).path
    except (ImportError, AttributeError):
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        found = str(bundled) if bundled.exists() else shutil.which(name)
        if found is None:
            raise AssertionError(f"no {name}: the check cannot read a cubin") from None
        return found


@triton.jit
def _search_pass_probe(row_ptr, out_ptr, n_read, stride_v, inv_t, m, lo, hi,
                       N_CAND: tl.constexpr, SEARCH_BLOCK: tl.constexpr):  # fmt: skip
    """One top-p search pass (``kernels/vocab/truncated.py`` ``_bracket_sums``) alone in a
    kernel: its loop is the kernel's one loop."""
    j = tl.arange(0, N_CAND)
    cand = lo + (hi - lo) * j.to(tl.float32) / N_CAND
    cnt, mass = _bracket_sums(row_ptr, n_read, stride_v, inv_t, inv_t, m, cand, N_CAND,
                              SEARCH_BLOCK, False, tl.float32)  # fmt: skip
    tl.store(out_ptr + j, mass + cnt.to(tl.float32))


def search_pass_instructions(search_block: int, n_cand: int, num_warps: int) -> float:
    """sm_90 SASS instructions (per warp) a logit of a top-p search pass costs, bf16 logits
    at ``search_block`` columns of 8 logits a step, as launched (unit stride, 16-divisible row
    pointer and length): the pass is compute-bound, so this is its time."""
    signature = {"row_ptr": "*bf16", "out_ptr": "*fp32", "n_read": "i32",
                 "stride_v": "constexpr", "inv_t": "fp32", "m": "fp32", "lo": "fp32",
                 "hi": "fp32", "N_CAND": "constexpr", "SEARCH_BLOCK": "constexpr"}  # fmt: skip
    source = ASTSource(fn=_search_pass_probe, signature=signature,
                       constexprs={"N_CAND": n_cand, "SEARCH_BLOCK": search_block, "stride_v": 1},
                       attrs={(i,): [["tt.divisibility", 16]] for i in (0, 2)})  # fmt: skip
    cubin = triton.compile(source, target=SM90, options=sm90_options(num_warps)).asm["cubin"]
    loops = innermost_loops(cubin)
    if len(loops) != 1:
        raise AssertionError(f"the search-pass probe has {len(loops)} innermost loops, not 1")
    return loops[0] * num_warps / (search_block * 8)


def innermost_loops(cubin: bytes, common_path: bool = False) -> list[int]:
    """The instruction counts of the innermost loops of the kernel in ``cubin`` (its sm_90
    SASS, ``nvdisasm``: a branch back to an earlier label, with no such loop inside),
    largest first. A static measure of a compute-bound loop's work per step. A warp
    shuffle's divergent-warp fallback (the block a ``BRA.DIV`` jumps to, placed after the
    body, up to its unconditional ``BRA`` back into it) is not a loop; a loop closed by
    ``@P0 EXIT`` and a ``BRA`` back is. ``common_path``: each loop's instructions on the
    path that takes every forward branch inside it, past the work such a branch guards (a
    step that moves the exact KL's running sums to a new maximum, taken by few of a row's
    steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([_nvidia_tool("nvdisasm"), "-c", str(path)], capture_output=True,
                             text=True)  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"nvdisasm failed:\n{out.stderr[-2000:]}")
    return listing_innermost_loops(out.stdout, common_path)


def listing_innermost_loops(sass: str, common_path: bool = False) -> list[int]:
    """:func:`innermost_loops` of an ``nvdisasm -c`` listing."""
    labels, pending, listing = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            at = int(ins.group(1), 16)
            labels.update(dict.fromkeys(pending, at))
            pending = []
            listing.append((at, ins.group(2)))
    target = re.compile(r"BRA(\.DIV)?\s+(?:\S+,\s*)?`\((\.L_x_\d+)\)")
    fallbacks = {labels[m.group(2)] for _, text in listing
                 if (m := target.search(text)) and m.group(1)}  # fmt: skip
    loops, in_fallback = [], False
    for at, text in listing:
        in_fallback = in_fallback or at in fallbacks
        branch = target.search(text)
        if not branch or branch.group(1):
            continue
        if not in_fallback and labels.get(branch.group(2), at) < at:  # not the end's spin
            loops.append((labels[branch.group(2)], at))
        if in_fallback and not text.startswith("@"):  # its jump back into the body
            in_fallback = False
    inner = [(lo, hi) for lo, hi in loops
             if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]  # fmt: skip
    if not common_path:
        return sorted((sum(lo <= a <= hi for a, _ in listing) for lo, hi in inner), reverse=True)
    counts = []
    for lo, hi in inner:
        count, at, order = 0, lo, [a for a, _ in listing]
        while at <= hi:
            i = order.index(at)
            count += 1
            branch = target.search(listing[i][1])
            ahead = branch and not branch.group(1) and at < labels[branch.group(2)] <= hi
            at = (
                labels[branch.group(2)]
                if ahead
                else (order[i + 1] if i + 1 < len(order) else hi + 1)
            )
        counts.append(count)
    return sorted(counts, reverse=True)


def stack_bytes(cubin: bytes) -> int:
    """The per-thread stack frame of the kernel in ``cubin`` (Triton's own, as it would be
    launched), where ptxas puts the registers it spills (``cuobjdump -res-usage``: ``STACK``,
    plus ``LOCAL``); fails loudly if the report has neither."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    report = out.stdout + out.stderr
    stack, local = re.findall(r"STACK:(\d+)", report), re.findall(r"LOCAL:(\d+)", report)
    if out.returncode != 0 or not stack or not local:
        raise AssertionError(f"no resource report from cuobjdump -res-usage:\n{report[-2000:]}")
    return sum(map(int, stack)) + sum(map(int, local))


@triton.jit
def _spill_canary(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """A row of ``BLOCK`` values held across its own sum: on one warp, more values a thread
    than registers, so it must spill."""
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols)
    tl.store(out_ptr + cols, x / tl.sum(x * x, 0))


def spill_check_works() -> list[str]:
    """The spill check finds a spill: ``_spill_canary`` (8192 fp32 values on one warp, 256 a
    thread) reports a stack."""
    source = ASTSource(fn=_spill_canary, signature={"x_ptr": "*fp32", "out_ptr": "*fp32",
                                                    "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 8192})  # fmt: skip
    compiled = triton.compile(source, target=SM90, options=sm90_options(1))
    if stack_bytes(compiled.asm["cubin"]) == 0:
        return ["the spill check saw no stack in _spill_canary, which must spill"]
    return []


# the policy forward as GRPO / PPO with k3, entropy bonus and dual clip run it, and the
# statistics backward with targets (the flags each check varies are set where it runs)
POLICY_FLAGS = dict(HAS_OLD=True, HAS_REF=True, HAS_MASK=True, ADD_KL=True, KL_KIND=2,
                    SURROGATE=0, HAS_IS=True, BIAS_KL=False, WITH_ENTROPY=True,
                    ENTROPY_BONUS=True, USE_DUAL=True, USE_DELTA=True, HAS_ENT_SCALE=False,
                    HAS_SOFTCAP=False)  # fmt: skip
BWD_FLAGS = dict(HAS_TARGETS=True, HAS_G=True, HAS_H=False, HAS_SCALE=True, HAS_SEQ_SCALE=True,
                 HAS_KL=False, HAS_SOFTCAP=False)  # fmt: skip


def _compile_launched(kernel, flags: dict, one_warp: bool):
    """``(compiled, launch)``: a vocab-stream kernel compiled for sm_90 as launched on a bf16
    vocabulary of 151936 (``vocab_launch``'s block and warps, one warp a row for a read-only
    stream or the read layout, a unit vocab stride and 16-divisible row strides, as Triton
    specialises them at launch)."""
    from fused_rl._launch import vocab_launch

    names = [p.name for p in kernel.params]
    signature = _signature(kernel, True)
    signature["stride_v"] = "constexpr"
    if "r_stride_v" in names:
        signature["r_stride_v"] = "constexpr"
    # the row strides of the logits and of the gradient (a fresh buffer or, inplace=True,
    # the logits themselves): multiples of 16 at a real vocabulary, as Triton sees them
    rows = ["stride_outer", "stride_inner", "grad_stride_outer", "grad_stride_inner",
            "r_stride_outer", "r_stride_inner"]  # fmt: skip
    aligned = [n for n in names if n.endswith("_ptr")] + ["V"] + [n for n in rows if n in names]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    launch = vocab_launch(151936, writes=not one_warp, heavy=flags.get("KL_KIND") == KL_FULL)
    constexprs = dict(flags, BLOCK_V=launch["BLOCK_V"], ACC=tl.float32, stride_v=1)
    if "r_stride_v" in names:
        constexprs["r_stride_v"] = 1
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options=sm90_options(launch["num_warps"])), launch


def vocab_stream_vectorised() -> list[str]:
    """The vocab-stream kernels as launched for a real vocabulary (bf16, V = 151936, the
    launchers' ``vocab_launch`` options, a unit vocab stride and 16-divisible row strides, as
    Triton specialises them at launch): their row loads must compile to 128-bit vector
    loads (``ld.global.v4``), and the gradient stores to vector stores. A change that
    silently turns them into scalar accesses would cost most of the bandwidth. The read-only
    forward kernels (one warp per row) must also reduce without a barrier (``bar.sync``): a
    cross-warp reduction per block step is what made the 8-warp forward slower than a copy.
    And none may spill registers (:func:`stack_bytes` of Triton's own cubin): the exact KL's
    two-row forward did at 2048 columns a warp (255 registers, a 752-byte stack with Triton
    3.9's ptxas), and ran 4.4x the k3 call on an H200 (Triton 3.6).

    Returns the problems found (empty when all is well)."""
    from fused_rl.kernels.vocab.layer1 import _token_stats_fwd_kernel
    from fused_rl.kernels.vocab.layer3 import _token_stats_bwd_kernel
    from fused_rl.kernels.vocab.policy_fused import _policy_loss_fwd_kernel

    policy = POLICY_FLAGS
    bwd = dict(BWD_FLAGS, HAS_H=True)
    cases = [  # (kernel, flags, writes a gradient row[, launched at the read layout])
        (_token_stats_fwd_kernel, dict(HAS_TARGETS=True, WITH_ENTROPY=True, WITH_EXTRAS=False,
                                       HAS_SOFTCAP=False), False),
        # the diagnostics (token_stats: mean logit, log sum p^2, top-1) from the same read
        (_token_stats_fwd_kernel, dict(HAS_TARGETS=True, WITH_ENTROPY=True, WITH_EXTRAS=True,
                                       HAS_SOFTCAP=False), False),
        (_token_stats_bwd_kernel, dict(bwd, HAS_SOFTCAP=False), True),
        (_policy_loss_fwd_kernel, dict(policy, WRITE_GRAD=False), False),
        # WRITE_GRAD: the fused-linear loss also writes each row's gradient (vector stores)
        (_policy_loss_fwd_kernel, dict(policy, WRITE_GRAD=True), True),
        # the logit soft cap (a tanh per element) keeps the vector loads and stores
        (_token_stats_fwd_kernel, dict(HAS_TARGETS=True, WITH_ENTROPY=True, WITH_EXTRAS=False,
                                       HAS_SOFTCAP=True), False),
        (_token_stats_bwd_kernel, dict(bwd, HAS_SOFTCAP=True), True),
        (_policy_loss_fwd_kernel, dict(policy, WRITE_GRAD=True, HAS_SOFTCAP=True), True),
        # the exact KL (kl_estimator="full", KL_KINDS[5]): the reference's row streamed too
        (_policy_loss_fwd_kernel, dict(policy, KL_KIND=KL_FULL, WRITE_GRAD=False), False),
        (_policy_loss_fwd_kernel, dict(policy, KL_KIND=KL_FULL, WRITE_GRAD=True), True),
        (_token_stats_bwd_kernel, dict(bwd, HAS_SOFTCAP=False, HAS_KL=True), True),
        (_policy_loss_fwd_kernel, dict(policy, KL_KIND=KL_FULL, WRITE_GRAD=True, HAS_SOFTCAP=True),
         True),
        (_token_stats_bwd_kernel, dict(bwd, HAS_SOFTCAP=True, HAS_KL=True), True),
        # grad_in_forward=True: the gradient row written at the forward's read layout
        (_policy_loss_fwd_kernel, dict(policy, WRITE_GRAD=True), True, True),
        (_policy_loss_fwd_kernel, dict(policy, KL_KIND=KL_FULL, WRITE_GRAD=True), True, True),
    ]  # fmt: skip
    problems = []
    for kernel, flags, writes, *read_layout in cases:
        one_warp = not writes or bool(read_layout)
        compiled, launch = _compile_launched(kernel, flags, one_warp)
        ptx = compiled.asm["ptx"]
        label = f"{kernel.__name__} ({'writes' if writes else 'reads'}, {launch}, {flags})"
        stack = stack_bytes(compiled.asm["cubin"])
        if stack:
            problems.append(f"{label}: a {stack}-byte stack a thread (registers spilled)")
        if "ld.global.v4" not in ptx:
            problems.append(f"{label}: no 128-bit vector load of the logits row")
        if writes and "st.global.v4" not in ptx:
            problems.append(f"{label}: no 128-bit vector store of the gradient row")
        if one_warp and re.search(r"\bbar(rier)?\.sync", ptx):
            problems.append(f"{label}: a barrier in the one-warp forward (cross-warp reduction)")
    return problems


# sm_90 warp instructions a logit (innermost loop, as launched) each stream may cost: an H200
# issues ~1.05e12 a second (132 SMs x 4 schedulers x 1.98 GHz) and reads ~2.4e12 bf16 logits
# a second, so a one-row read-only stream is memory-bound below ~0.44. Measured 2026-11-29
# (Triton 3.9): 0.28, 0.44 and 1.47 (1.57 before the exact KL's seven running sums were kept
# a lane each, ``kernels.common.lane_sums``: a shuffle tree a sum a block saved); before
# ``kernels.common.exp`` (a multiply and one ex2.approx.ftz against tl.exp's five
# instructions) and the int32 one-hot column, 0.38, 0.57 and 1.95
STREAM_BUDGETS = [  # (label, kernel name, flags, one warp a row, ceiling)
    ("token_logprobs forward", "_token_stats_fwd_kernel",
     dict(HAS_TARGETS=True, WITH_ENTROPY=False, WITH_EXTRAS=False, HAS_SOFTCAP=False), True,
     0.32),
    ("token_logprobs backward", "_token_stats_bwd_kernel", BWD_FLAGS, False, 0.5),
    # measured 1.11 (the common path: a step that raises no maximum) and 0.85 with Triton
    # 3.9; 1.18 and 0.86 with two shuffle trees a step and bf16 widened by .to
    # (kernels.common.widen), 1.47 and 0.96 with a rescale every step, a degree-8 expm1 and
    # two tests in gap_from
    ("policy_loss exact-KL forward", "_policy_loss_fwd_kernel",
     dict(POLICY_FLAGS, KL_KIND=KL_FULL, WRITE_GRAD=False), True, 1.15),
    ("policy_loss exact-KL backward", "_token_stats_bwd_kernel", dict(BWD_FLAGS, HAS_KL=True),
     False, 0.92),
]  # fmt: skip


def stream_instructions() -> list[str]:
    """Each stream of :data:`STREAM_BUDGETS`, compiled as launched: its block loop's sm_90
    instructions (:func:`innermost_loops`) per logit within its ceiling. A streamed kernel
    that is compute-bound runs slower than its bytes; an ``exp`` without ``ftz`` or a 64-bit
    compare a column puts it back there. Returns the problems found."""
    from fused_rl.kernels.vocab import layer1, layer3, policy_fused

    problems = []
    for label, name, flags, one_warp, ceiling in STREAM_BUDGETS:
        kernel = next(getattr(m, name) for m in (layer1, layer3, policy_fused) if hasattr(m, name))
        compiled, launch = _compile_launched(kernel, flags, one_warp)
        loops = innermost_loops(compiled.asm["cubin"], common_path=True)
        if len(loops) != 1:
            problems.append(f"{label}: {len(loops)} innermost loops, not the one block loop")
            continue
        # the common path skips rarely-run work (a rescale), never most of the step
        (whole,) = innermost_loops(compiled.asm["cubin"])
        if loops[0] < 0.8 * whole:
            problems.append(f"{label}: its common path skips {whole - loops[0]} of {whole}")
        per_logit = loops[0] * launch["num_warps"] / launch["BLOCK_V"]
        print(f"{label}: {per_logit:.3f} sm_90 instructions a logit (ceiling {ceiling})")
        if per_logit > ceiling:
            problems.append(f"{label}: {per_logit:.3f} sm_90 instructions a logit > {ceiling}")
    return problems


def main(offsets_only: bool = False) -> int:
    failures = 0
    for kernel in _kernels(WIDE_OFFSET_MODULES if offsets_only else MODULES):
        wide = kernel.__module__.rsplit(".", 1)[-1] in WIDE_OFFSET_MODULES
        for low_precision in (True, False):
            label = f"{kernel.__name__} [{'bf16' if low_precision else 'fp64'}]"
            try:
                count = compile_all(kernel, low_precision, check_offsets=wide)
                print(f"ok   {label}: {count} variants", flush=True)
            except Exception:
                failures += 1
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
    problems = offset_check_works()
    if not offsets_only:
        problems += spill_check_works() + vocab_stream_vectorised() + stream_instructions()
    for problem in problems:
        failures += 1
        print(f"FAIL {problem}", flush=True)
    print(f"{failures} kernel(s) failed to compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(offsets_only="--offsets" in sys.argv[1:]))
