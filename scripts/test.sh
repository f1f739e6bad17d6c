#!/usr/bin/env bash
# The project's test command (README.md and .ci/run run exactly this):
#
#   bash scripts/test.sh [--setup-only] [pytest args...]
#
# Without pytest args it runs the two passes CI runs, each in parallel with pytest-xdist
# (-n M3_TEST_JOBS --dist load --durations=40):
#   newest: the whole suite in .venv, on the newest supported transformers, kernels and
#           huggingface_hub (NEWEST in scripts/setup_venv.sh);
#   oldest: the tests marked both_ends (the model, integration and hub tests; the rule is
#           in tests/conftest.py) in .venv-oldest, on the oldest supported (OLDEST:
#           transformers 5.17.0, kernels 0.16.2, huggingface_hub 1.x). It shares .venv's
#           torch, Triton and test tools.
# With pytest args, pytest gets exactly those args and nothing of ours, in the newest pass
# only: `bash scripts/test.sh tests/test_model.py -x`. For workers there, pass `-n 2` and
# set OMP_NUM_THREADS=1 (as the default passes do: torch threads beyond the cores spin).
#
# Environment:
#   M3_TEST_RANGE=newest|oldest|both  which passes run (default: both without pytest args,
#                                     newest with them); with args, each pass gets them
#   M3_TEST_JOBS=N                    xdist workers of the default passes (default: the
#                                     CPU cores this process may use)
#
# Each venv is installed only when its inputs changed (scripts/setup_venv.sh --if-changed);
# --setup-only stops after that. build/ must match torch-ext/ (scripts/build_kernel.py
# --check). Every pass counts: the exit code is the first failing pass's, and pytest's
# exit 5 (no tests collected) is a failure. Each pass's wall and CPU time is printed.
set -euo pipefail
cd "$(dirname "$0")/.."

setup_only=0
if [[ "${1:-}" == "--setup-only" ]]; then
    setup_only=1
    shift
fi

range="${M3_TEST_RANGE:-}"
if [[ -z "$range" ]]; then
    if [[ $# == 0 ]]; then range=both; else range=newest; fi
fi
case "$range" in
    newest | oldest | both) ;;
    *)
        echo "test.sh: M3_TEST_RANGE must be newest, oldest or both, not '$range'" >&2
        exit 2
        ;;
esac

clock() {
    local s=$(($(date +%s) - $1))
    printf '%dm%02ds' $((s / 60)) $((s % 60))
}

t0=$(date +%s)
# .venv is set up in every range: .venv-oldest is layered over it.
bash scripts/setup_venv.sh --if-changed --newest ".[test]"
if [[ "$range" != newest ]]; then
    bash scripts/setup_venv.sh --if-changed --oldest .
fi
echo "test.sh: venvs ready in $(clock "$t0")"

if [[ "$setup_only" == 1 ]]; then
    exit 0
fi

# Tests must never reach the Hugging Face Hub; offline mode makes an
# accidental download fail at once instead of waiting on the network.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

.venv/bin/python scripts/build_kernel.py --check

if [[ $# == 0 ]]; then
    jobs="${M3_TEST_JOBS:-$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())')}"
    # load: tests go out a few at a time to whichever worker is free, so the long ones (GPU
    # compiles, whole-model runs) spread over the workers. worksteal, which first splits the
    # list in halves, ended later on 2 cores; loadfile would put every GPU-compile case of
    # tests/kernels/test_gpu_compile.py on one worker.
    parallel=(-n "$jobs" --dist load --durations=40)
    # torch sizes its thread pool to every core; with a worker per core, more threads
    # than cores only contend.
    if [[ -z "${OMP_NUM_THREADS:-}" && "$jobs" =~ ^[0-9]+$ && "$jobs" -gt 1 ]]; then
        export OMP_NUM_THREADS=1
    fi
    newest_args=("${parallel[@]}")
    oldest_args=(-m both_ends "${parallel[@]}")
else
    newest_args=("$@")
    oldest_args=("$@")
fi

versions() {
    "$1" -c 'from importlib.metadata import version as v
print(", ".join(f"{n} {v(n)}" for n in ("transformers", "kernels", "huggingface_hub", "torch")))'
}

# Sets CPU to the CPU seconds (user + sys) of this shell's finished children: the pytest
# runs with their workers and subprocesses. Beside a pass's wall time it shows how much
# other load held the workers back. A plain call: in $(...) `times` counts the subshell's.
children_cpu() {
    local file
    file=$(mktemp)
    times > "$file"
    CPU=$(awk 'NR == 2 { split($0, t, /[ms ]+/); print t[1] * 60 + t[2] + t[3] * 60 + t[4] }' "$file")
    rm -f "$file"
}

summary=()
status=0
run_pass() {
    local name="$1" venv="$2"
    shift 2
    echo "test.sh: $name pass in $venv ($(versions "$venv/bin/python")): pytest $*"
    local start cpu0 rc=0
    start=$(date +%s)
    children_cpu
    cpu0=$CPU
    "$venv/bin/python" -m pytest "$@" || rc=$?
    children_cpu
    local line="$name pass: exit $rc in $(clock "$start"), CPU $(awk -v a="$cpu0" -v b="$CPU" 'BEGIN { s = b - a; printf "%dm%02ds", s / 60, s % 60 }')"
    if [[ "$rc" == 5 ]]; then
        line+=" (pytest collected no tests; that is a failure)"
    fi
    echo "test.sh: $line"
    summary+=("$line")
    if [[ "$status" == 0 ]]; then
        status=$rc
    fi
}

if [[ "$range" != oldest ]]; then
    run_pass newest .venv ${newest_args[@]+"${newest_args[@]}"}
fi
if [[ "$range" != newest ]]; then
    run_pass oldest .venv-oldest ${oldest_args[@]+"${oldest_args[@]}"}
fi
printf 'test.sh: %s\n' "${summary[@]}"
echo "test.sh: all in $(clock "$t0"), exit $status"
exit "$status"
