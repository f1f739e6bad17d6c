"""m3_sparse: MiniMax M3 block-sparse attention (MSA) for PyTorch.

Public ops (token-major queries, paged caches; see ``interface.py``):

* ``index_topk``: block selection of the index branch;
* ``kvouter_attention``: sparse attention over the selected blocks, KV-outer;
* ``dense_paged_attention``: dense attention over the same paged cache;
* pipeline stages of ``kvouter_attention``: ``build_kvouter_index``, ``schedule``,
  ``kvouter_partials``, ``combine``;
* ``reference``: naive per-token oracles for tests;
* ``ops``: the five ops above (``index_topk``, ``kvouter_attention``,
  ``sparse_decode_attention``, ``sparse_attention``, ``dense_paged_attention``) as ``torch.library`` custom ops with fake implementations
  (``custom_ops.py``), for ``torch.compile``.

The transformers integration ships in the kernel too (``hf_cache``, ``hf_integration``,
``hf_tp``; they import transformers, so they load on first use). transformers loads a hub
kernel named by ``attn_implementation="<org>/m3-sparse"`` and takes its attention function
from ``flash_attn_forward`` (its contract for kernels that bring their own attention entry
point, next to a ``supports_flash_attn`` marker); reading that attribute, or
``m3_sparse_attention``, registers the integration. ``M3PagedCache`` is the paged cache.
``m3_hf_attention`` is the same integration behind ``import m3_hf_attention``.
"""

import importlib

from . import custom_ops, reference
from ._ops import add_op_namespace_prefix, ops
from .combine import combine
from .decode_attention import sparse_decode_attention
from .index_topk import index_topk
from .interface import dense_paged_attention, kvouter_attention, sparse_attention
from .kvouter_attention import kvouter_partials
from .kvouter_index import KVOuterIndex, build_kvouter_index
from .scheduler import Schedule, schedule

__version__ = "0.1.0"

_LAZY_MODULES = ("hf_cache", "hf_integration", "hf_tp")


def supports_flash_attn() -> bool:
    """Marker transformers looks for (with ``flash_attn_forward``) before it takes a hub
    kernel's own attention function; every device torch runs on is served (CUDA by the
    Triton kernels, others by the torch reference path)."""
    return True


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("m3_sparse_attention", "flash_attn_forward", "register"):
        integration = importlib.import_module(f"{__name__}.hf_integration")
        integration.register()
        return integration.register if name == "register" else integration.m3_sparse_attention
    if name in ("M3PagedCache", "M3PagedLayer"):
        return getattr(importlib.import_module(f"{__name__}.hf_cache"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KVOuterIndex",
    "M3PagedCache",
    "Schedule",
    "add_op_namespace_prefix",
    "build_kvouter_index",
    "combine",
    "dense_paged_attention",
    "index_topk",
    "kvouter_attention",
    "kvouter_partials",
    "m3_sparse_attention",
    "ops",
    "reference",
    "schedule",
    "sparse_attention",
    "sparse_decode_attention",
]
