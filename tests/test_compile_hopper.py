"""Every Triton kernel compiles for a Hopper GPU (sm_90), with no GPU present.

The interpreter runs kernels in numpy and tolerates type errors that the real compiler
rejects (a scalar re-bound to a tensor of another type, an int flag stored to a float
pointer, ...). ``tests/hopper_compile.py`` compiles every kernel ahead of time for
``cuda:90`` through Triton's own front end, LLVM and ptxas, so CPU-only CI catches those.
It also checks that the vocab-stream kernels, compiled as launched for a 151936 vocabulary,
read the logits with 128-bit vector loads and spill no registers (a stack frame in the
cubin; a canary kernel proves the check can see one), and that three of them stay within an
instruction budget a logit (``STREAM_BUDGETS``). It runs in a subprocess because this process
has the interpreter switched on.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# an integration test (subprocess / CLI / compile): `pytest -m 'not integration'` skips it
pytestmark = pytest.mark.integration

pytest.importorskip("triton.backends.compiler")


# minutes of compiling in its subprocess, which has its own limit: past the per-test limit
# of a GPU machine's run (bench/gpu_session.sh's --timeout=150, with pytest-timeout there)
@pytest.mark.timeout(900)
@pytest.mark.no_poison
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " 0 kernel(s) failed" in " " + result.stdout.splitlines()[-1]


@pytest.mark.timeout(600)
@pytest.mark.no_poison
def test_token_reductions_offsets_are_64bit():
    """Lengths and strides reach a kernel as i32 when they fit, so ``stats + 3 * R`` wraps past
    ~715M rows unless the product is 64-bit. ``hopper_compile.py --offsets`` compiles every
    ``token_ops/reductions`` kernel for sm_90 and walks back from each pointer offset
    (``tt.addptr``) in its TTIR, failing on any i32 product on the way; it first checks that
    the walk flags a known i32 offset and passes its int64 twin (``offset_check_works``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    result = subprocess.run(
        [sys.executable, str(script), "--offsets"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


# a block loop closed by ``@P0 EXIT`` and a branch back, with a shuffle whose divergent-warp
# fallback (after the body) jumps back into it, then the kernel's closing spin
_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FADD R2, R2, R3 ;
        /*0020*/                   BRA.DIV UR4, `(.L_x_2) ;
        /*0030*/                   SHFL.BFLY PT, R5, R2, 0x1, 0x1f ;
.L_x_3:
        /*0040*/                   FADD R2, R2, R5 ;
        /*0050*/               @P0 EXIT ;
        /*0060*/                   BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/                   WARPSYNC.COLLECTIVE R17, `(.L_x_4) ;
        /*0080*/                   SHFL.BFLY P6, R5, R2, R13, R12 ;
        /*0090*/                   ENDCOLLECTIVE ;
.L_x_4:
        /*00a0*/                   BRA `(.L_x_3) ;
.L_x_1:
        /*00b0*/                   BRA `(.L_x_1) ;
"""


def test_innermost_loops_of_a_listing():
    """The SASS loop finder behind the instruction budgets counts the block loop (six
    instructions, closed by an EXIT and a branch back) and neither the shuffle's fallback,
    which branches back into the body, nor the closing spin."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hopper_compile import listing_innermost_loops

    assert listing_innermost_loops(_LISTING) == [6]
    without_exit = _LISTING.replace("@P0 EXIT", "FADD R2, R2, R2")
    assert listing_innermost_loops(without_exit) == [6]
    assert listing_innermost_loops(_LISTING, common_path=True) == [6]


# a block loop with a uniform branch over two instructions of rarely-run work (the exact
# KL's rescale to a new maximum), then the closing spin
_BRANCHED = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FMNMX R2, R2, R3, !PT ;
        /*0020*/               @!P1 BRA P2, `(.L_x_1) ;
        /*0030*/                   FMUL R4, R4, R5 ;
        /*0040*/                   FMUL R6, R6, R5 ;
.L_x_1:
        /*0050*/                   FADD R4, R4, R2 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2) ;
"""


def test_common_path_of_a_listing():
    """``common_path``: the loop's instructions on the path that takes its forward branch
    (four: the max, the branch, the add, the branch back), against all six."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hopper_compile import listing_innermost_loops

    assert listing_innermost_loops(_BRANCHED) == [6]
    assert listing_innermost_loops(_BRANCHED, common_path=True) == [4]
