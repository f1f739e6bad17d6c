#!/usr/bin/env bash
# Set up one of the project's venvs in the repository root:
#
#   bash scripts/setup_venv.sh [--if-changed] [--newest | --oldest] [PIP_SPEC [PACKAGE...]]
#
# PIP_SPEC is what `pip install -e` gets: "." (default, the package alone) or
# ".[test]" (with the test extra); PACKAGEs are installed beside it.
#
# .venv (no option, or --newest): created if missing, recreated if its interpreter is
# broken; a CPU torch goes in first (kept if the venv already has a torch), then the
# project in editable mode. --newest also installs NEWEST below, the newest supported
# transformers, kernels and huggingface_hub: a .venv made under an older pyproject.toml
# still satisfies the range with what it has, and pip keeps what satisfies.
#
# .venv-oldest (--oldest): OLDEST below, the oldest supported releases, layered over
# .venv, which must be set up first. A .pth file puts .venv's site-packages on its path
# after its own, so torch, triton, numpy and the test tools are .venv's, installed once;
# its own site-packages holds only what OLDEST needs in other versions than .venv has
# (transformers, kernels, huggingface_hub, kernels-data, ...). pip installs into the
# venv it runs in and leaves .venv's copies alone ("outside environment").
#
# Before it installs a torch it checks the free space where the venv goes
# (M3_SETUP_MIN_FREE_MB, default MIN_FREE_MB below) and stops with what it found: a full disk
# otherwise fails inside pip, halfway, and then the CPU-index retry fails too.
#
# After an install it writes a stamp in the venv for these arguments, holding a hash of
# pyproject.toml, the torch spec and the pins. With --if-changed nothing is installed
# while that stamp matches and the venv still finds torch, transformers, kernels and
# m3_hf_attention.
#
# Used by scripts/test.sh (--if-changed --newest, then --if-changed --oldest) and
# scripts/run_example.sh (--if-changed).
set -euo pipefail
cd "$(dirname "$0")/.."

# The two ends of pyproject.toml's supported range that scripts/test.sh runs the suite
# on (tests/test_ci_scripts.py checks them against pyproject.toml). Raise NEWEST with the
# range's upper bounds.
NEWEST=("transformers==5.25.0" "kernels==0.19.1" "huggingface_hub>=2.4,<3")
OLDEST=("transformers==5.17.0" "kernels==0.16.2" "huggingface_hub>=1.10,<2")

if_changed=0
end=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --if-changed) if_changed=1 ;;
        --newest | --oldest)
            if [[ -n "$end" && "$end" != "${1#--}" ]]; then
                echo "setup_venv.sh: --newest and --oldest exclude each other" >&2
                exit 2
            fi
            end="${1#--}"
            ;;
        *) break ;;
    esac
    shift
done
if [[ $# == 0 ]]; then
    set -- .
fi
spec="$1"
shift

PYTHON="${PYTHON:-python3}"
BASE=.venv
pins=()
if [[ "$end" == newest ]]; then
    pins=("${NEWEST[@]}")
elif [[ "$end" == oldest ]]; then
    pins=("${OLDEST[@]}")
fi
if [[ "$end" == oldest ]]; then
    VENV=.venv-oldest
else
    VENV=$BASE
fi
VPY="$VENV/bin/python"
# torch goes in before the project: the project only asks for torch>=2.9, which
# on its own would make pip pick a CUDA build of several GB.
TORCH_SPEC="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
# What a new .venv takes (torch's CPU build 0.75 GB, Triton 1 GB, the rest 0.3 GB), with room
# for pip to unpack the torch wheel first.
MIN_FREE_MB="${M3_SETUP_MIN_FREE_MB:-3072}"

args_id=$(echo "$end $spec $*" | sha256sum | cut -c1-12)
STAMP="$VENV/.m3-setup-$args_id"
digest=$({ cat pyproject.toml; echo "$TORCH_SPEC $TORCH_CPU_INDEX $end $spec ${pins[*]-} $*"; } | sha256sum | cut -d' ' -f1)

purelib() {
    "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'
}

if [[ "$end" == oldest ]]; then
    if ! "$BASE/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "setup_venv.sh: --oldest layers over $BASE, which has no torch: run 'bash scripts/setup_venv.sh --newest \".[test]\"' first" >&2
        exit 1
    fi
    base_site=$(purelib "$BASE/bin/python")
    # The layer is only valid over the interpreter and site-packages it was made for.
    if [[ -e "$VENV" ]] && ! [[ "$("$VPY" -c 'import sys; print(sys.version)' 2>/dev/null)" == "$("$BASE/bin/python" -c 'import sys; print(sys.version)')" ]]; then
        echo "setup_venv.sh: $VENV is broken or made by another Python than $BASE, recreating it" >&2
        rm -rf "$VENV"
    fi
    digest=$(echo "$digest $base_site" | sha256sum | cut -d' ' -f1)
elif [[ -e "$VENV" ]] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    # A venv whose interpreter went away (moved tree, removed Python) cannot be
    # repaired in place.
    echo "setup_venv.sh: $VENV is broken, recreating it" >&2
    rm -rf "$VENV"
fi

if [[ "$if_changed" == 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$digest" ]] && "$VPY" -c '
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "kernels", "m3_hf_attention")))
' >/dev/null 2>&1; then
    exit 0
fi

pip_install() {
    "$VPY" -m pip install --quiet --progress-bar off "$@"
}

if [[ "$end" == oldest ]]; then
    if [[ ! -e "$VENV" ]]; then
        # Without pip: .venv's pip, on the path through the .pth file, installs into this venv.
        "$BASE/bin/python" -m venv --without-pip "$VENV"
        # Never committed, whatever the repository's .gitignore says.
        echo "*" > "$VENV/.gitignore"
    fi
    echo "$base_site" > "$(purelib "$VPY")/m3-shared-layer.pth"
    rm -f "$STAMP"
    pip_install -e "$spec" ${pins[@]+"${pins[@]}"} "$@"
    # The pins must win over .venv's copies: this venv's site-packages comes first.
    "$VPY" - ${pins[@]+"${pins[@]}"} <<'EOF'
import sys
from importlib import metadata

for pin in sys.argv[1:]:
    if "==" in pin:
        name, want = pin.split("==")
        got = metadata.version(name)
        if got != want:
            sys.exit(f"setup_venv.sh: .venv-oldest resolves {name} {got}, expected {want} (its own site-packages must come before .venv's on sys.path)")
EOF
    echo "$digest" > "$STAMP"
    exit 0
fi

if [[ ! -e "$VENV" ]]; then
    echo "setup_venv.sh: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

check_free_space() {
    local free
    free=$(df -Pm . | awk 'NR == 2 {print $4}')
    if [[ -n "$free" && "$free" -lt "$MIN_FREE_MB" ]]; then
        echo "setup_venv.sh: $free MiB free on $PWD; a new $VENV with torch needs about $MIN_FREE_MB MiB there:" \
            "free some space and run again" >&2
        exit 1
    fi
}

rm -f "$STAMP"
# A torch that is already there (a GPU machine's, say) is kept.
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    check_free_space
    if ! pip_install "$TORCH_SPEC"; then
        echo "setup_venv.sh: $TORCH_SPEC not installable, trying the PyTorch CPU index" >&2
        pip_install --index-url "$TORCH_CPU_INDEX" torch
    fi
fi
pip_install -e "$spec" ${pins[@]+"${pins[@]}"} "$@"
echo "$digest" > "$STAMP"
