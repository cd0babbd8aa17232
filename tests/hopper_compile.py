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
]
# runtime float arguments (everything else that is not a pointer is an integer)
FLOAT_ARGS = {
    "inv_temperature", "eps_low", "eps_high", "dual_clip", "delta", "beta", "entropy_coef",
    "eps", "correction", "clip_hi", "clip_lo", "lo_hi", "lo_lo", "hi_hi", "hi_lo",
    "vclip_hi", "vclip_lo", "coeff_hi", "coeff_lo", "gamma_hi", "gamma_lo", "decay_hi",
    "decay_lo", "coef_hi", "coef_lo",
}  # fmt: skip
INT_POINTERS = {"targets_ptr": "*i64", "index_ptr": "*i64", "code_ptr": "*i8"}
MASK_POINTERS = {"m_ptr", "mask_ptr", "pm_ptr", "vm_ptr"}
# pointers read in the input dtype (the rest are fp32 / fp64 statistics and outputs)
INPUT_POINTERS = {"logits_ptr", "grad_ptr", "x_ptr", "gx_ptr", "v_ptr", "gv_ptr", "lp_ptr"}
# small values so the compile stays fast; the real launchers pick larger ones
BLOCKS = {"BLOCK_V": 256, "BLOCK": 256, "BLOCK_P": 128, "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_R": 16}
ENUMS = {"KL_KIND": 5, "KIND": 5, "MODE": 3}


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
        else:
            sig[p.name] = "i32"
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
    print(f"{failures} kernel(s) failed to compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
