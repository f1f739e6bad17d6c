#!/usr/bin/env bash
# Set up the project's venv, .venv in the repository root:
#
#   bash scripts/setup_venv.sh [--if-changed] [PIP_SPEC [PACKAGE...]]
#
# PIP_SPEC is what `pip install -e` gets: "." (default, the package alone) or
# ".[test]" (with the test extra); PACKAGEs are installed beside it. Creates .venv
# if it is missing, recreates it if its interpreter is broken, installs a CPU
# torch (kept if the venv already has a torch), then the project in editable mode.
#
# After an install it writes a stamp in .venv for these arguments, holding a hash
# of pyproject.toml and the torch spec. With --if-changed nothing is installed
# while that stamp matches and the venv still finds torch, transformers, kernels
# and m3_hf_attention.
#
# Used by scripts/test.sh (every run installs) and scripts/run_example.sh
# (--if-changed).
set -euo pipefail
cd "$(dirname "$0")/.."

if_changed=0
if [[ "${1:-}" == "--if-changed" ]]; then
    if_changed=1
    shift
fi
if [[ $# == 0 ]]; then
    set -- .
fi
spec="$1"
shift

PYTHON="${PYTHON:-python3}"
VENV=.venv
VPY="$VENV/bin/python"
# torch goes in before the project: the project only asks for torch>=2.9, which
# on its own would make pip pick a CUDA build of several GB.
TORCH_SPEC="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

args_id=$(echo "$spec $*" | sha256sum | cut -c1-12)
STAMP="$VENV/.m3-setup-$args_id"
digest=$({ cat pyproject.toml; echo "$TORCH_SPEC $TORCH_CPU_INDEX $spec $*"; } | sha256sum | cut -d' ' -f1)

# A venv whose interpreter went away (moved tree, removed Python) cannot be
# repaired in place.
if [[ -e "$VENV" ]] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    echo "setup_venv.sh: $VENV is broken, recreating it" >&2
    rm -rf "$VENV"
fi

if [[ "$if_changed" == 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$digest" ]] && "$VPY" -c '
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "kernels", "m3_hf_attention")))
' >/dev/null 2>&1; then
    exit 0
fi

if [[ ! -e "$VENV" ]]; then
    echo "setup_venv.sh: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

pip_install() {
    "$VPY" -m pip install --quiet --progress-bar off "$@"
}

rm -f "$STAMP"
# A torch that is already there (a GPU machine's, say) is kept.
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    if ! pip_install "$TORCH_SPEC"; then
        echo "setup_venv.sh: $TORCH_SPEC not installable, trying the PyTorch CPU index" >&2
        pip_install --index-url "$TORCH_CPU_INDEX" torch
    fi
fi
pip_install -e "$spec" "$@"
echo "$digest" > "$STAMP"
