#!/usr/bin/env bash
# Run the end-to-end example in the project's venv (same setup as the tests):
#
#   bash scripts/run_example.sh [examples/generate.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test.sh --setup-only
exec .venv/bin/python examples/generate.py "$@"
