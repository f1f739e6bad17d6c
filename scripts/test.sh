#!/usr/bin/env bash
# The project's test command (README.md and .ci/run run exactly this):
#
#   bash scripts/test.sh [pytest args...]
#
# Creates .venv if missing, installs a CPU torch and the project with its test
# extra, checks that build/ is in sync with torch-ext/, then runs pytest.
# `--setup-only` stops after the install (scripts/run_example.sh uses it).
set -euo pipefail
cd "$(dirname "$0")/.."

setup_only=0
if [[ "${1:-}" == "--setup-only" ]]; then
    setup_only=1
    shift
fi

PYTHON="${PYTHON:-python3}"
VENV=.venv
VPY="$VENV/bin/python"

# A venv whose interpreter went away (moved tree, removed Python) cannot be
# repaired in place.
if [[ -e "$VENV" ]] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    echo "test.sh: $VENV is broken, recreating it" >&2
    rm -rf "$VENV"
fi
if [[ ! -e "$VENV" ]]; then
    echo "test.sh: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

pip_install() {
    "$VPY" -m pip install --quiet --progress-bar off "$@"
}

# torch goes in before the project: the project only asks for torch>=2.9,
# which on its own would make pip pick a CUDA build of several GB. A torch
# that is already there (a GPU machine's, say) is kept.
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    if ! pip_install "torch==2.13.0"; then
        echo "test.sh: torch==2.13.0 not installable, trying the PyTorch CPU index" >&2
        pip_install --index-url https://download.pytorch.org/whl/cpu torch
    fi
fi
pip_install -e ".[test]"

if [[ "$setup_only" == 1 ]]; then
    exit 0
fi

# Tests must never reach the Hugging Face Hub; offline mode makes an
# accidental download fail at once instead of waiting on the network.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

"$VPY" scripts/build_kernel.py --check

rc=0
"$VPY" -m pytest -q "$@" || rc=$?
if [[ "$rc" == 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$rc"
