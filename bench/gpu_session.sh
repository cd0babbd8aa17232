#!/usr/bin/env bash
# One call on a lent GPU machine: the CUDA test-suite, then the full benchmark suite.
#
#   bash bench/gpu_session.sh [all|tests|bench|linear|peers|host|inplace|distill|fullkl|
#       truncated|e2e|ldiag|chunks]
#       [extra bench/run.py arguments]
#   bash bench/gpu_session.sh tests,fullkl,distill   # several parts, TOTAL (520) s shared
#
#   all (default)  tests (at most TEST_TIMEOUT s), then `bench/run.py --suite full` until
#                  the time budget is spent
#   tests          the CUDA test-suite only
#   bench          the full suite only (with policy_loss[grpo+fullkl], the exact KL, at
#                  16x1024x151936)
#   linear         issue 14's fused-linear measurements: peak memory against tokens
#                  (`bench/run.py memory`, measured), then the full suite's linear cases,
#                  16384 tokens x 151936 first (the targets' shape); results.md's
#                  "Targets (issue 14, fused linear)" gives the verdicts
#   peers          the side-by-side with the peers' own paths (`bench/run.py --suite peers`:
#                  TRL's and verl's fused heads, Liger with inplace=True and False, eager,
#                  torch.compile; policy_loss[grpo+fullkl], the exact KL, at 8x2048x151936
#                  with every provider that runs it), then the host cost with real launches
#                  at 1 x 16 x 1024
#   host           the host cost alone ($OUT/host.log)
#   inplace        fused_rl inplace=True and grad_in_forward=True (two passes) beside Liger's
#                  inplace=True and the defaults (`bench/run.py --suite inplace`: 8x2048x151936
#                  and 4x4096x262144, bf16)
#   distill        the on-policy distillation losses (`bench/run.py --suite distill`:
#                  distill_loss at 8x2048x151936 first, then 4x1024x32000 and 4x4096x262144;
#                  linear_distill_loss at H = 4096, 8x2048 and 4x1024 tokens x 151936; bf16,
#                  beta 0 / 0.5 / 1; verl's top-k forward KL, K = 128, at 8x2048x151936)
#                  for fused_rl, the materialised path, eager (TRL's GKD computation; verl's
#                  default top-k path), torch.compile of it, Liger's LigerJSD /
#                  LigerFusedLinearJSD (needs the liger-kernel wheel in .whl/), TRL's own
#                  chunked divergence from hidden states (DistillationTrainer's, needs the
#                  trl wheel) and verl's own top-k function where verl imports; time,
#                  measured peak memory and the
#                  float64 check of every row
#   fullkl         policy_loss with the exact KL to the reference (`bench/run.py --suite
#                  fullkl`: GRPO + beta KL(pi || pi_ref) from the reference's logits, bf16,
#                  8x2048x151936 then 4x1024x32000) for fused_rl, the same call with k3 on the
#                  same inputs (fused_rl_k3: what the exact KL costs), eager (both fp32
#                  log-softmaxes) and torch.compile of it; time, measured peak memory and the
#                  float64 check of every row (resumable, as bench)
#   truncated      token_logprobs under a sampler's top-k / top-p (`bench/run.py --suite
#                  truncated`: top-k 50 without grad and forward + backward, top-k 1000 and
#                  top-p 0.9 forward + backward, bf16, 8x2048x151936, each mode beside the
#                  plain token_logprobs[logp]) for fused_rl, eager (torch.topk, a sort of the
#                  fp32 logits for top-p) and torch.compile of it; time, measured peak
#                  memory and the float64 check of every row (resumable, as bench)
#   ldiag          linear_distill_loss's worst row against float64 (it failed the bench's
#                  check on an H200 for fused_rl, the materialised path and eager alike):
#                  the distill suite's linear_distill_loss cases for fused_rl and the
#                  materialised path twice, with cuBLAS's default bf16 GEMM reductions and
#                  with --exact-bf16-gemm (none in bf16), each its own results:
#                  $OUT/ldiag-default/ and $OUT/ldiag-exact/ (results.json: err_row_at),
#                  the logs $OUT/ldiag-default.log and $OUT/ldiag-exact.log
#   chunks         the rows per chunk of the ops from hidden states: the peers suite's
#                  linear_token_logprobs / linear_policy_loss cases at 16384 x 151936, H =
#                  4096, for fused_rl at its default chunk (2048 rows, beside the
#                  materialised path) and at 883 (the default before 2026-11-27), 1024 and
#                  4096 rows (--chunk-tokens): whether each chunk's dW += dz^T h_c (a read
#                  and a write of the fp32 (V, H) dW a chunk) costs what the roofline says. $OUT/chunks-<rows>/results.json (results.md
#                  dropped: 8 files come back; `bench/run.py report` rewrites it) and
#                  $OUT/chunks.log; five files, so a call of its own or beside tests
#   e2e            one GRPO step of TRL's GRPOTrainer, TRL's head against fused_rl's
#                  integration (bench/e2e_trl.py: a random Qwen2.5-1.5B-shaped model,
#                  vocabulary 151936, 2 x (256 + 4096) tokens): $OUT/e2e.log and
#                  $OUT/results/e2e_trl.json (needs the trl and datasets wheels in .whl/);
#                  then one on-policy distillation step of TRL's DistillationTrainer, TRL's
#                  chunked divergence against fused_rl's (bench/e2e_trl_distill.py: random
#                  Qwen2.5-0.5B / 1.5B-shaped student / teacher, 2 x (256 + 2048) tokens):
#                  $OUT/e2e_distill.log and $OUT/results/e2e_trl_distill.json; then one
#                  SFT and one DPO step of TRL's SFTTrainer / DPOTrainer, TRL's head (with
#                  its token accuracy and mean logits) against fused_rl's
#                  (bench/e2e_trl_pref.py: Qwen2.5-1.5B-shaped, 4 x (256 + 1792) words):
#                  $OUT/e2e_pref.log and $OUT/results/e2e_trl_pref.json
#
# The bench part RESUMES: cases already in bench/results/<gpu>/results.json of this working
# tree are skipped, so repeated calls (each under the 10-minute command limit) complete the
# suite. Everything comes back under $OUT (at most 8 files, none deeper than 2 folders):
#   $OUT/env.txt               nvidia-smi, versions
#   $OUT/pytest.log            the CUDA test-suite's output
#   $OUT/failures.log          each failed test's traceback, written as it fails
#   $OUT/bench.log             the benchmark's output (its table at the end)
#   $OUT/results/results.json  all results so far (this call's merged into the tree's)
#   $OUT/results/results.md    the tables
#   peers, host: $OUT/host.log (microseconds and launches per call, real kernels)
#   linear: $OUT/memory.log, $OUT/results/memory_vs_tokens.json (and its plot where the
#           GPU machine has matplotlib)
# To commit them (on the machine that called):
#   mkdir -p bench/results/<gpu> && cp <files_at>/results/* bench/results/<gpu>/
#   python bench/run.py report --out bench/results/<gpu>     # the PNG plots (matplotlib)
# then call again with `bench` to continue an unfinished suite.
#
# Environment: OUT (default bench/results/_session), BENCH_BUDGET (seconds for the bench
# part; default 500 minus the time already spent), TEST_TIMEOUT (default 240; the whole
# suite took ~400 s with -n auto on an H200 on 2026-11-28: half of it in 200 s), TESTS (the
# test paths, default tests).
# liger-kernel, trl and verl are not on the GPU image: carry their wheels in .whl/ (the
# device README's notes), all pure Python except multiprocess (per Python version):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5 \
#     trl==1.16.0 verl==0.9.1 datasets==4.8.0 dill==0.4.0 multiprocess==0.70.18
# TRL's fused head imports transformers (on the image) and, in its backward,
# trl.trainer.utils, which needs datasets (+ dill, multiprocess); verl's file needs torch.
# The run of 2026-11-26 (H200): `peers` then `tests` took 357 s of command time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# big cases allocate and free tens of GB per provider: avoid fragmentation OOMs (the
# measured peaks, max_memory_allocated, do not depend on it)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
PY=${PYTHON:-python3}
PART=${1:-all}
[ $# -gt 0 ] && shift
OUT=${OUT:-bench/results/_session}
mkdir -p "$OUT/results"

if [[ "$PART" == *,* ]]; then
    # several parts in one call (e.g. tests,fullkl,distill): each part in turn gets an equal
    # share of what is left of TOTAL seconds (default 520) as its TEST_TIMEOUT / BENCH_BUDGET;
    # each part's console output goes to $OUT/<part>.out and a bench part's log to
    # $OUT/<part>.log; the results of every bench part accumulate in $OUT/results/
    IFS=, read -ra PARTS <<<"$PART"
    status=0
    left=${#PARTS[@]}
    for part in "${PARTS[@]}"; do
        share=$(((${TOTAL:-520} - SECONDS) / left))
        left=$((left - 1))
        echo "== $part (${share}s)"
        OUT="$OUT" TEST_TIMEOUT=$share BENCH_BUDGET=$share bash "$0" "$part" "$@" \
            >"$OUT/$part.out" 2>&1 || status=1
        [ -f "$OUT/bench.log" ] && mv "$OUT/bench.log" "$OUT/$part.log"
        tail -25 "$OUT/$part.out"
    done
    exit "$status"
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# fused_rl.kernels maps to kernels/ only through an install (pyproject package-dir)
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation . >>"$OUT/install.log" 2>&1 \
        || { echo "fused_rl install failed:"; tail -20 "$OUT/install.log"; exit 1; }
fi
rm -f "$OUT/install.log"

{
    nvidia-smi 2>&1
    "$PY" -c "import torch, triton, fused_rl; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'fused_rl', fused_rl.__version__); \
print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))"
    "$PY" -c "import liger_kernel; print('liger_kernel importable')" 2>&1 | tail -1
    "$PY" -c "import trl.kernels.chunked_logprob as m; import importlib.metadata as im; \
print('trl', im.version('trl'), 'ChunkedLogProbFunction importable')" 2>&1 | tail -1
    "$PY" -c "import importlib.util as u; print('verl found at', u.find_spec('verl').origin)" 2>&1 | tail -1
} >"$OUT/env.txt" 2>&1

status=0
if [ "$PART" = all ] || [ "$PART" = tests ]; then
    echo "== CUDA test-suite"
    # one worker per core (pytest-xdist, the test extra): each worker compiles its own
    # kernel variants: ~1 minute on the H100 machine, against over 4 minutes serially
    XDIST=""
    "$PY" -c "import xdist" 2>/dev/null && XDIST="-n auto"
    # every failure is recorded: no -x (it hides the failures after the first)
    # -v names each test as it ends (a run stopped by TEST_TIMEOUT still says which failed);
    # --timeout (pytest-timeout, on the GPU image) fails one hung test instead of the run
    TIMEOUT=""
    "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout=150"
    # each failure's traceback lands in $OUT/failures.log as it happens (tests/conftest.py):
    # a run stopped by TEST_TIMEOUT keeps them (pytest's -rfE summary comes only at the end)
    # TESTS: the test paths (default tests; e.g. "tests/test_[p-z]*.py" for the second half)
    # shellcheck disable=SC2086
    rm -f "$OUT/failures.log"  # this run's failures only
    FUSED_RL_FAILURE_LOG="$OUT/failures.log" timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest \
        -v -rfE $XDIST $TIMEOUT ${TESTS:-tests} \
        --benchmark-disable -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" \
        | grep -E "FAILED|ERROR| passed| failed" | tail -40
    status=${PIPESTATUS[0]}
    echo "pytest exit status $status (124 = stopped by TEST_TIMEOUT)"
    # Triton 3.9 warns when a launch leaves FMA contraction unset (fused_rl pins it:
    # fused_rl._launch.COMPILE_OPTIONS); pytest's warnings summary would name the test
    echo "Triton's unset-fp-fusion warnings: $(grep -c "TRITON_DEFAULT_FP_FUSION is unset" \
"$OUT/pytest.log")"
fi

if [ "$PART" = all ] || [ "$PART" = bench ] || [ "$PART" = linear ] || [ "$PART" = peers ] \
    || [ "$PART" = inplace ] || [ "$PART" = distill ] || [ "$PART" = fullkl ] \
    || [ "$PART" = truncated ]; then
    SLUG=$("$PY" -c "import sys, torch; sys.path.insert(0, '.'); from bench.measure import \
slug, device_name; print(slug(device_name('cuda' if torch.cuda.is_available() else 'cpu')))")
    # resume from what this working tree already holds for this GPU
    [ -f "bench/results/$SLUG/results.json" ] && cp "bench/results/$SLUG/results.json" "$OUT/results/"
fi

if [ "$PART" = linear ]; then
    LINEAR=linear_policy_loss,linear_token_logprobs
    echo "== fused-linear peak memory against tokens (measured)"
    "$PY" bench/run.py memory --op "$LINEAR" --vocab 151936 --dtype bf16 \
        --providers fused_rl,fused_rl_mat,eager,liger --out "$OUT/results" 2>&1 \
        | tee "$OUT/memory.log" | tail -30
    status=${PIPESTATUS[0]}
    BUDGET=${BENCH_BUDGET:-$((500 - SECONDS))}
    echo "== linear cases of the full suite on $SLUG, budget ${BUDGET}s (16384 x 151936 first)"
    DEADLINE=$((SECONDS + BUDGET))
    {
        "$PY" bench/run.py --suite full --op "$LINEAR" --tokens 16384 --vocab 151936 --resume \
            --no-plots --time-budget "$BUDGET" --out "$OUT/results" "$@"
        first=$?
        rest=0
        if [ $((DEADLINE - SECONDS)) -gt 30 ]; then
            "$PY" bench/run.py --suite full --op "$LINEAR" --resume --no-plots \
                --time-budget "$((DEADLINE - SECONDS))" --out "$OUT/results" "$@"
            rest=$?
        fi
        [ "$first" -ne 0 ] && exit "$first"
        exit "$rest"
    } 2>&1 | tee "$OUT/bench.log" | tail -60
    bench_status=${PIPESTATUS[0]}
    echo "bench exit status $bench_status; results for bench/results/$SLUG/ in $OUT/results/"
    [ "$status" -eq 0 ] && status=$bench_status
fi

SUITE=""
[ "$PART" = peers ] && SUITE=peers
SUITE_ARGS=()
if [ "$PART" = inplace ]; then
    SUITE=inplace
    SUITE_ARGS=(--providers "$("$PY" -c "import sys; sys.path.insert(0, '.'); \
from bench.cases import INPLACE_PROVIDERS; print(','.join(INPLACE_PROVIDERS))")")
fi
if [ "$PART" = distill ]; then
    SUITE=distill
    SUITE_ARGS=(--providers "$("$PY" -c "import sys; sys.path.insert(0, '.'); \
from bench.cases import DISTILL_PROVIDERS; print(','.join(DISTILL_PROVIDERS))")")
fi
if [ "$PART" = fullkl ]; then
    SUITE=fullkl
    SUITE_ARGS=(--providers "$("$PY" -c "import sys; sys.path.insert(0, '.'); \
from bench.cases import FULL_KL_PROVIDERS; print(','.join(FULL_KL_PROVIDERS))")")
fi
if [ "$PART" = truncated ]; then
    SUITE=truncated
    SUITE_ARGS=(--providers "$("$PY" -c "import sys; sys.path.insert(0, '.'); \
from bench.cases import TRUNCATED_PROVIDERS; print(','.join(TRUNCATED_PROVIDERS))")")
fi
{ [ "$PART" = all ] || [ "$PART" = bench ]; } && SUITE=full
if [ -n "$SUITE" ]; then
    BUDGET=${BENCH_BUDGET:-$((500 - SECONDS))}
    echo "== $SUITE benchmark suite on $SLUG, budget ${BUDGET}s"
    "$PY" bench/run.py --suite "$SUITE" --resume --no-plots --time-budget "$BUDGET" \
        --out "$OUT/results" "${SUITE_ARGS[@]}" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
    bench_status=${PIPESTATUS[0]}
    echo "bench exit status $bench_status; results for bench/results/$SLUG/ in $OUT/results/"
    [ "$status" -eq 0 ] && status=$bench_status
fi

if [ "$PART" = ldiag ]; then
    BUDGET=${BENCH_BUDGET:-$((500 - SECONDS))}
    for mode in default exact; do
        FLAG=()
        [ "$mode" = exact ] && FLAG=(--exact-bf16-gemm)
        echo "== linear_distill_loss, bf16 GEMM reductions: $mode, budget $((BUDGET / 2))s"
        "$PY" bench/run.py --suite distill --op linear_distill_loss --no-plots \
            --providers fused_rl,fused_rl_mat --time-budget $((BUDGET / 2)) \
            --out "$OUT/ldiag-$mode" ${FLAG[@]+"${FLAG[@]}"} "$@" 2>&1 \
            | tee "$OUT/ldiag-$mode.log" | tail -30
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
fi

if [ "$PART" = chunks ]; then
    BUDGET=${BENCH_BUDGET:-$((500 - SECONDS))}
    {
        failed=0
        for rows in default 883 1024 4096; do
            FLAG=() PROVIDERS=fused_rl
            [ "$rows" = default ] && PROVIDERS=fused_rl,fused_rl_mat
            [ "$rows" = default ] || FLAG=(--chunk-tokens "$rows")
            echo "== linear ops at 16384 x 151936, chunk: $rows rows, budget $((BUDGET / 4))s"
            "$PY" bench/run.py --suite peers --op linear_token_logprobs,linear_policy_loss \
                --tokens 16384 --vocab 151936 --providers "$PROVIDERS" --no-plots \
                --time-budget $((BUDGET / 4)) --out "$OUT/chunks-$rows" \
                ${FLAG[@]+"${FLAG[@]}"} "$@" || failed=1
            rm -f "$OUT/chunks-$rows/results.md"
        done
        exit "$failed"
    } 2>&1 | tee "$OUT/chunks.log" | tail -60
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [ "$PART" = peers ] || [ "$PART" = host ]; then
    echo "== host cost with real launches, 1 x 16 x 1024 bf16"
    "$PY" bench/run.py host --device cuda --tokens 16 --seqlen 16 --vocab 1024 --dtype bf16 \
        2>&1 | tee "$OUT/host.log"
fi

if [ "$PART" = e2e ]; then
    echo "== one GRPO step of TRL's GRPOTrainer: TRL's head against fused_rl's"
    "$PY" -m bench.e2e_trl --device cuda --out "$OUT/results/e2e_trl.json" "$@" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/e2e.log" | tail -20
    status=${PIPESTATUS[0]}
    echo "== one distillation step of TRL's DistillationTrainer: TRL's loss against fused_rl's"
    "$PY" -m bench.e2e_trl_distill --device cuda --out "$OUT/results/e2e_trl_distill.json" \
        2>&1 | grep -v "Loading weights" | tee "$OUT/e2e_distill.log" | tail -20
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    echo "== one SFT and one DPO step of TRL's trainers: TRL's head against fused_rl's"
    "$PY" -m bench.e2e_trl_pref --device cuda --out "$OUT/results/e2e_trl_pref.json" \
        2>&1 | grep -v "Loading weights" | tee "$OUT/e2e_pref.log" | tail -20
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

exit "$status"
