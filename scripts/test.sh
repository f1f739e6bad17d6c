#!/usr/bin/env bash
# The project's test command (README.md and .ci/run run exactly this):
#
#   bash scripts/test.sh [pytest args...]
#
# Sets up .venv with scripts/setup_venv.sh (a CPU torch, then the project with
# its test extra; installed on every run), checks that build/ is in sync with
# torch-ext/, then runs pytest. `--setup-only` stops after the install.
set -euo pipefail
cd "$(dirname "$0")/.."

setup_only=0
if [[ "${1:-}" == "--setup-only" ]]; then
    setup_only=1
    shift
fi

bash scripts/setup_venv.sh ".[test]"
VPY=.venv/bin/python

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
