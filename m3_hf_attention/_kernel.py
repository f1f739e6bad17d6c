"""Loading the ``m3-sparse`` hub kernel.

The package keeps no copy of the kernel code: it asks the ``kernels`` loader
for the variant built for this torch (``build/torch-cuda`` or ``build/torch-cpu``
of this repository), or for a hub repository named by ``M3_SPARSE_KERNEL``.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_VAR = "M3_SPARSE_KERNEL"


@functools.cache
def load_kernel() -> ModuleType:
    """Return the loaded ``m3_sparse`` kernel module.

    ``M3_SPARSE_KERNEL`` may name a local kernel repository (a directory holding
    ``build/``) or a hub repository id such as ``org/m3-sparse``; by default the
    ``build/`` directory of this source tree is used, offline.
    """
    import kernels

    source = os.environ.get(ENV_VAR)
    if source:
        path = Path(source).expanduser()
        if path.exists():
            return kernels.get_local_kernel(path.resolve())
        if "/" not in source:
            raise RuntimeError(f"{ENV_VAR}={source!r}: expected an existing directory or a hub repo id 'org/name'")
        return kernels.get_kernel(source)
    if not (REPO_ROOT / "build").is_dir():
        raise RuntimeError(
            f"m3_hf_attention: no built kernel found at {REPO_ROOT / 'build'}. Install the package from its "
            f"source tree (pip install -e .), run `python scripts/build_kernel.py`, or set {ENV_VAR} to a kernel "
            "repository path or hub id."
        )
    return kernels.get_local_kernel(REPO_ROOT)


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
