"""Loading the ``m3-sparse`` hub kernel.

The package keeps no copy of the kernel code: it asks the ``kernels`` loader
for the variant built for this torch (``build/torch-cuda`` or ``build/torch-cpu``
of this repository), or for the kernel that ``M3_SPARSE_KERNEL`` names: a local
kernel repository, or a hub repository (docs/HUB.md).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_VAR = "M3_SPARSE_KERNEL"
# The kernel's major version, build.toml's `[general] version` (tests/test_build.py
# checks that they agree). A constant rather than read from build.toml, which an
# install outside the source tree does not have. kernels requires a version or a
# revision for a hub kernel: version N is the repository's branch `vN`.
KERNEL_VERSION = 1
# build.toml's `[general.hub] repo-id`: the hub string `attn_implementation` takes (m3-serve
# passes it to transformers' server; tests/test_build.py checks the two agree).
HUB_REPO_ID = "m3-hf-attention/m3-sparse"
# `namespace/name`, optionally `@<revision>` (a branch, tag or commit).
_HUB_SOURCE = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?")


def _hub_request(source: str) -> tuple[str, dict]:
    """``kernels.get_kernel``'s repository id and version/revision keywords for ``source``."""
    match = _HUB_SOURCE.fullmatch(source)
    if match is None:
        raise RuntimeError(
            f"{ENV_VAR}={source!r}: expected an existing directory (a kernel repository holding build/), a hub "
            f"repository id 'namespace/name' (loads version {KERNEL_VERSION}), or 'namespace/name@<revision>' "
            "with a branch, tag or commit"
        )
    revision = match["revision"]
    pin = {"revision": revision} if revision else {"version": KERNEL_VERSION}
    # Naming a repository in M3_SPARSE_KERNEL is the choice to run its code: without
    # trust_remote_code, kernels refuses any publisher the Hub does not mark as trusted.
    return match["repo_id"], {**pin, "trust_remote_code": True}


def _load_from_hub(source: str) -> ModuleType:
    import kernels
    from huggingface_hub import constants

    repo_id, kwargs = _hub_request(source)
    try:
        return kernels.get_kernel(repo_id, **kwargs)
    except Exception as e:
        which = f"revision {kwargs['revision']!r}" if "revision" in kwargs else f"version {kwargs['version']}"
        hint = (
            " Offline (HF_HUB_OFFLINE) it must already be in the hub cache, a version with its ref "
            f"(refs/v{KERNEL_VERSION}): docs/HUB.md says how to fill the cache."
            if constants.HF_HUB_OFFLINE
            else ""
        )
        raise RuntimeError(
            f"{ENV_VAR}={source!r}: kernels could not load {which} of the hub kernel {repo_id!r}: {e}{hint}"
        ) from e


def kernel_location() -> tuple[Path | None, str | None]:
    """Where :func:`load_kernel` takes the kernel from: ``(a local kernel repository, None)``
    (``M3_SPARSE_KERNEL`` naming an existing directory, else this source tree), or
    ``(None, the hub source M3_SPARSE_KERNEL names)``."""
    source = os.environ.get(ENV_VAR)
    if not source:
        return REPO_ROOT, None
    path = Path(source).expanduser()
    return (path.resolve(), None) if path.exists() else (None, source)


@functools.cache
def load_kernel() -> ModuleType:
    """Return the loaded ``m3_sparse`` kernel module.

    ``M3_SPARSE_KERNEL`` may name a local kernel repository (a directory holding
    ``build/``), a hub repository id such as ``org/m3-sparse`` (version
    :data:`KERNEL_VERSION`, the branch ``v1``) or ``org/m3-sparse@<revision>``
    (a branch, tag or commit, for a pinned load); by default the ``build/``
    directory of this source tree is used, offline.
    """
    import kernels

    local, hub = kernel_location()
    if hub is not None:
        return _load_from_hub(hub)
    if local == REPO_ROOT and not (REPO_ROOT / "build").is_dir():
        raise RuntimeError(
            f"m3_hf_attention: no built kernel found at {REPO_ROOT / 'build'}. Install the package from its "
            f"source tree (pip install -e .), run `python scripts/build_kernel.py`, or set {ENV_VAR} to a kernel "
            "repository path or hub id."
        )
    return kernels.get_local_kernel(local)


def kernel_module(name: str) -> ModuleType:
    """The submodule ``name`` (e.g. ``"hf.cache"``) of the loaded kernel."""
    return importlib.import_module(f"{load_kernel().__name__}.{name}")


def forward_to(name: str):
    """``(__getattr__, __dir__)`` for a module of this package that stands for the kernel's
    submodule ``name``: its attributes are the kernel's, looked up on use (PEP 562)."""
    source = kernel_module(name)

    def __getattr__(attr: str):
        return getattr(source, attr)

    def __dir__() -> list[str]:
        return sorted(dir(source))

    return __getattr__, __dir__
