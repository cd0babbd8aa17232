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
