#!/usr/bin/env bash
# GPU verification in one go: the GPU test suite (`pytest -m gpu tests`), then the benchmarks
# named on the command line, each under its own time limit, logs in $OUT (default ./out/gpu_check) and
# a summary table printed last (with the test suite's passed / failed / skipped counts). The
# exit status is 0 only when every step passed: 1 if a step failed, timed out or is unknown.
#
#   bash scripts/gpu_check.sh                         # tests only
#   bash scripts/gpu_check.sh kvouter dense:"--prefill '' --splits 1,2,4,8,16" long:"--fp8 --sizes 131072"
#
# Steps after the tests: NAME or NAME:"extra args", NAME one of kvouter, index, decode, dense,
# long, generate, host, serve, server, first_call, tp, memory, sanitize, long_run, sdpa_agreement
# (benchmarks/bench_NAME.py; long = bench_long_prefill.py; sanitize, long_run and sdpa_agreement =
# benchmarks/reliability/NAME.py). Each step
# gets --out $OUT/NAME. Wheels in ./.whl (an offline machine's copy of kernels and
# hypothesis) are installed first when present. Environment: TEST_ARGS (pytest's selection,
# default "-m gpu tests"; "tests" runs every test on the GPU, longer than the default limit),
# TEST_TIMEOUT (s, default 480), TESTS=0 (skip the test step: benchmarks only),
# STEP_TIMEOUT (s, default 300), PYTEST_WORKERS (default: the CPU count, as most of a GPU test's
# time is Triton compiling on the host; needs pytest-xdist).
#
# CAPABILITY=<major>.<minor> (for example 8.0 or 8.9) runs everything acting as a GPU of that
# compute capability: it sets M3_SPARSE_CAPABILITY, the test-only override that the package's
# capability helper (torch-ext/m3_sparse/core/launch.py) answers instead of the GPU, so the code
# paths of that GPU (no Gluon, no TMA, no flash-attn-4; below 8.9 no fp8) run on the real one.
# Triton still compiles for the real GPU: act only as an older one. The tests load
# tests/kernels/capability_plugin.py, which reports a test the acted GPU refuses (fp8 below
# sm_89) as skipped with the refusal. Logs go to $OUT/gpu_check/sm_80/ (and so on), so runs
# as different GPUs keep their own; the summary's last line names the capability.
#
#   CAPABILITY=8.0 bash scripts/gpu_check.sh    # the GPU suite as an A100 would run it
#   CAPABILITY=8.9 bash scripts/gpu_check.sh    # ... as an L40S / RTX 40xx would
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}/gpu_check"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
PY="${PYTHON:-python3}"
acting=()
CAPABILITY="${CAPABILITY:-${M3_SPARSE_CAPABILITY:-}}"  # the override set by hand counts too
if [[ -n "$CAPABILITY" ]]; then
    if [[ ! "$CAPABILITY" =~ ^[0-9]+\.[0-9]+$ ]]; then
        echo "gpu_check: CAPABILITY must be a compute capability as major.minor (8.0, 8.9), not '$CAPABILITY'" >&2
        exit 2
    fi
    export M3_SPARSE_CAPABILITY="$CAPABILITY"
    export PYTHONPATH="$PWD/tests/kernels:$PYTHONPATH"
    acting=(-p capability_plugin)
    OUT="$OUT/sm_${CAPABILITY/./}"
fi
mkdir -p "$OUT"

if [[ -d .whl ]]; then
    "$PY" -m pip install -q --no-index --find-links .whl kernels hypothesis >"$OUT/pip.log" 2>&1 \
        || echo "gpu_check: installing from .whl failed (see pip.log)" >&2
fi
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import os, torch, triton, transformers
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
acting = os.environ.get("M3_SPARSE_CAPABILITY")
acting = f" | acting as compute capability {acting}" if acting else ""
print(f"{name} | torch {torch.__version__} | triton {triton.__version__} | transformers {transformers.__version__}{acting}")
EOF

summary=()
status=0
pytest_counts() {  # log file -> "N passed, N failed, N skipped" (+ errors) from pytest's last summary line
    local line
    line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$1" | tail -n 1)
    local passed failed skipped errors
    passed=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+')
    failed=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+')
    skipped=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+')
    errors=$(grep -oE '[0-9]+ errors?' <<<"$line" | grep -oE '[0-9]+')
    local counts="${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
    [[ -n "$errors" ]] && counts+=", $errors errors"
    [[ -z "$line" ]] && counts="no pytest summary"
    echo "$counts"
}
run_step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [[ $rc == 124 ]] && verdict="timed out after ${limit}s"
    [[ $rc != 0 && $rc != 124 ]] && verdict="failed (rc $rc)"
    [[ $rc != 0 ]] && status=1
    [[ $name == tests ]] && verdict+=": $(pytest_counts "$OUT/$name.log")"
    summary+=("| $name | $verdict | $((SECONDS - start)) s | $(tail -n 1 "$OUT/$name.log" | cut -c1-90) |")
}

workers=()
n_workers=${PYTEST_WORKERS:-$(nproc)}
[[ "$n_workers" != 0 ]] && workers=(-n "$n_workers")
read -ra test_args <<<"${TEST_ARGS:--m gpu tests}"
if [[ "${TESTS:-1}" != 0 ]]; then
    run_step tests "${TEST_TIMEOUT:-480}" "$PY" -m pytest -q -p no:cacheprovider ${acting[@]+"${acting[@]}"} \
        "${workers[@]}" -rfE --tb=short "${test_args[@]}"
fi

for spec in "$@"; do
    name=${spec%%:*}
    extra=""
    [[ "$spec" == *:* ]] && extra=${spec#*:}
    case "$name" in
        long) script=benchmarks/bench_long_prefill.py ;;
        sanitize | long_run | sdpa_agreement) script=benchmarks/reliability/$name.py ;;
        kvouter | index | decode | dense | generate | host | serve | server | first_call | tp | memory)
            script=benchmarks/bench_$name.py ;;
        *) summary+=("| $name | unknown step | - | - |"); status=1; continue ;;
    esac
    eval "args=($extra)"
    run_step "$name" "${STEP_TIMEOUT:-300}" "$PY" "$script" --out "$OUT/$name" "${args[@]}"
done

echo
echo "| step | result | time | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
[[ -n "$CAPABILITY" ]] && echo "(acting as compute capability $CAPABILITY: M3_SPARSE_CAPABILITY=$CAPABILITY)"
exit "$status"
