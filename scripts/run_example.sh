#!/usr/bin/env bash
# Run the end-to-end example in the project's venv:
#
#   bash scripts/run_example.sh [examples/generate.py args...]
#
# Sets up .venv with what the example needs: a CPU torch, then `pip install -e .`
# (no test extra: no Triton, which the CPU path does not import). The install is
# skipped while pyproject.toml and the torch spec are unchanged
# (scripts/setup_venv.sh --if-changed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh --if-changed .
exec .venv/bin/python examples/generate.py "$@"
