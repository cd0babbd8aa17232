"""Compile every Triton kernel of fused_rl for a Hopper GPU (sm_90) with no GPU present.

Run as a script in a process WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces kernels
by numpy stand-ins that cannot be compiled): ``python tests/hopper_compile.py``. Prints one
line per kernel and exits non-zero if any variant fails. Used by test_compile_hopper.py.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

MODULES = [
    "vocab_stream_fwd",
    "vocab_stream_bwd",
    "vocab_stream_policy_fwd",
    "token_values",
    "token_reductions",
    "token_kl",
    "token_advantages",
    "token_gaussian",
    "token_policy",
]
# runtime float arguments (everything else that is not a pointer is an integer)
FLOAT_ARGS = {
    "inv_t_hi", "inv_t_lo", "eps_low", "eps_high", "dual_clip", "delta", "beta", "entropy_coef",
    "eps", "correction", "clip_hi", "clip_lo", "lo_hi", "lo_lo", "hi_hi", "hi_lo",
    "vclip_hi", "vclip_lo", "coeff_hi", "coeff_lo", "gamma_hi", "gamma_lo", "decay_hi",
    "decay_lo", "coef_hi", "coef_lo", "num_items", "n_seq", "max_length", "eps_hi", "eps_lo",
    "eps_low_hi", "eps_low_lo", "eps_high_hi", "eps_high_lo", "dual_clip_hi", "dual_clip_lo",
    "delta_hi", "delta_lo", "beta_hi", "beta_lo", "entropy_coef_hi", "entropy_coef_lo",
}  # fmt: skip
INT_NAMES = {"ignore_index", "rows_inner", "group_size", "shift", "positions", "n_outer"}


def _is_int_arg(name: str) -> bool:
    """Lengths (``N``, ``T``...), strides and the named integer arguments."""
    return name.isupper() or "stride" in name or name.startswith("s_") or name in INT_NAMES


INT_POINTERS = {"targets_ptr": "*i64", "index_ptr": "*i64", "code_ptr": "*i8"}
MASK_POINTERS = {"m_ptr", "mask_ptr", "pm_ptr", "vm_ptr"}
# pointers read in the input dtype (the rest are fp32 / fp64 statistics and outputs)
INPUT_POINTERS = {"logits_ptr", "grad_ptr", "x_ptr", "gx_ptr", "v_ptr", "gv_ptr", "lp_ptr"}
# small values so the compile stays fast; the real launchers pick larger ones
BLOCKS = {"BLOCK_V": 256, "BLOCK": 256, "BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_R": 16,
          "BLOCK_B": 16}  # fmt: skip
ENUMS = {"KL_KIND": 5, "KIND": 5, "MODE": 3, "AGG": 4}


def _kernels():
    for module_name in MODULES:
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
        elif _is_int_arg(p.name):
            sig[p.name] = "i32"
        else:  # a new float argument compiled as i32 would hide a real signature error
            raise AssertionError(f"{fn.__name__}: add {p.name!r} to FLOAT_ARGS or INT_NAMES")
    return sig


def compile_all(kernel, low_precision: bool) -> int:
    """Compile every flag set of ``kernel``; return how many variants compiled."""
    acc = tl.float32 if low_precision else tl.float64
    count = 0
    for flags in _flag_sets(kernel):
        constexprs = {p.name: BLOCKS[p.name] for p in kernel.params if p.name in BLOCKS}
        constexprs.update(flags, ACC=acc)
        source = ASTSource(fn=kernel, signature=_signature(kernel, low_precision),
                           constexprs=constexprs)  # fmt: skip
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        if ".entry" not in compiled.asm["ptx"]:
            raise AssertionError(f"no kernel entry in the PTX of {kernel.__name__} {flags}")
        count += 1
    return count


def vocab_stream_vectorised() -> list[str]:
    """The vocab-stream kernels as launched for a real vocabulary (bf16, V = 151936, the
    launchers' BLOCK_V and num_warps, a unit vocab stride and 16-divisible row strides, as
    Triton specialises them at launch): their row loads must compile to 128-bit vector
    loads (``ld.global.v4``), and the backward's gradient stores to vector stores. A change
    that silently turns them into scalar accesses would cost most of the bandwidth.

    Returns the problems found (empty when all is well)."""
    from fused_rl.kernels.vocab_stream_bwd import _token_stats_bwd_kernel
    from fused_rl.kernels.vocab_stream_fwd import _token_stats_fwd_kernel
    from fused_rl.kernels.vocab_stream_policy_fwd import _policy_loss_fwd_kernel

    from fused_rl._launch import vocab_block, vocab_warps

    block = vocab_block(151936)
    cases = [
        (_token_stats_fwd_kernel, dict(HAS_TARGETS=True, WITH_ENTROPY=True), False),
        (_token_stats_bwd_kernel, dict(HAS_TARGETS=True, HAS_G=True, HAS_H=True,
                                       HAS_SCALE=True, HAS_SEQ_SCALE=True), True),
        (_policy_loss_fwd_kernel, dict(HAS_OLD=True, HAS_REF=True, HAS_MASK=True, ADD_KL=True,
                                       KL_KIND=2,
                                       WITH_ENTROPY=True, ENTROPY_BONUS=True, USE_DUAL=True,
                                       USE_DELTA=True), False),
    ]  # fmt: skip
    problems = []
    for kernel, flags, vector_stores in cases:
        names = [p.name for p in kernel.params]
        signature = _signature(kernel, True)
        signature["stride_v"] = "constexpr"
        aligned = [n for n in names if n.endswith("_ptr")] + ["V", "stride_outer", "stride_inner"]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        constexprs = dict(flags, BLOCK_V=block, ACC=tl.float32, stride_v=1)
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": vocab_warps(block)}
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        if "ld.global.v4" not in ptx:
            problems.append(f"{kernel.__name__}: no 128-bit vector load of the logits row")
        if vector_stores and "st.global.v4" not in ptx:
            problems.append(f"{kernel.__name__}: no 128-bit vector store of the gradient row")
    return problems


def main() -> int:
    failures = 0
    for kernel in _kernels():
        for low_precision in (True, False):
            label = f"{kernel.__name__} [{'bf16' if low_precision else 'fp64'}]"
            try:
                print(f"ok   {label}: {compile_all(kernel, low_precision)} variants", flush=True)
            except Exception:
                failures += 1
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
    for problem in vocab_stream_vectorised():
        failures += 1
        print(f"FAIL {problem}", flush=True)
    print(f"{failures} kernel(s) failed to compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
