"""m3_sparse: MiniMax M3 block-sparse attention (MSA) for PyTorch.

Public ops (``api``; token-major queries, paged caches):

* ``index_prep``: the index branch's query/key norm and rotary embedding (one launch on CUDA);
* ``index_topk``: block selection of the index branch;
* ``sparse_attention``: sparse attention over the selected blocks, the decode kernel or
  KV-outer chosen from the query rows per sequence (``sparse_decode_attention``,
  ``kvouter_attention``; ``qouter_attention``, query-outer over tiles of neighbouring
  tokens, where ``M3_SPARSE_PREFILL`` asks for it);
* ``dense_paged_attention``: dense attention over the same paged cache (flash-attn-4, Triton
  or torch; ``dense_paged_attention_kernel`` says which runs a call);
* ``plan_index_topk``, ``plan_sparse_attention``, ``plan_dense_paged_attention``: those ops
  checked and set up once, then run per layer on tensors of the same shapes (an eager
  decode step's layers);
* the stages of ``kvouter_attention`` (torch references): ``build_kvouter_index``,
  ``schedule``, ``kvouter_partials``, ``combine``;
* ``reference``: naive per-token oracles for tests;
* ``ops``: the six ops as ``torch.library`` custom ops with fake implementations
  (``custom_ops``), for ``torch.compile``;
* launch configs (``IndexConfig``, ``KVOuterConfig``, ``DecodeConfig``, ``DenseConfig``):
  immutable, passed per call.

The transformers integration ships in the kernel too (``hf``: the paged cache, the
attention and mask functions, the tensor-parallel plan; it imports transformers, so it
loads on first use). transformers loads a hub kernel named by
``attn_implementation="<org>/m3-sparse"`` and takes its attention function from
``flash_attn_forward`` (its contract for kernels that bring their own attention entry
point, next to a ``supports_flash_attn`` marker); reading that attribute, or
``m3_sparse_attention``, registers the integration. docs/ARCHITECTURE.md maps the package.
"""

import importlib

from . import custom_ops, reference
from ._ops import add_op_namespace_prefix, ops
from .api import (
    DecodeConfig,
    DenseConfig,
    IndexConfig,
    KVOuterConfig,
    UnsupportedGPUError,
    dense_paged_attention,
    dense_paged_attention_kernel,
    index_prep,
    index_topk,
    kvouter_attention,
    plan_dense_paged_attention,
    plan_index_topk,
    plan_sparse_attention,
    qouter_attention,
    sparse_attention,
    sparse_decode_attention,
)
from .kvouter import KVOuterIndex, Schedule, build_kvouter_index, combine, kvouter_partials, schedule

__version__ = "0.1.0"


def supports_flash_attn() -> bool:
    """Marker transformers looks for (with ``flash_attn_forward``) before it takes a hub
    kernel's own attention function; every device torch runs on is served (CUDA by the
    Triton kernels, others by the torch reference path)."""
    return True


def __getattr__(name: str):
    if name == "hf":
        return importlib.import_module(f"{__name__}.hf")
    if name in ("m3_sparse_attention", "flash_attn_forward", "register"):
        attention = importlib.import_module(f"{__name__}.hf.attention")
        attention.register()
        return attention.register if name == "register" else attention.m3_sparse_attention
    if name in ("M3PagedCache", "M3PagedLayer"):
        return getattr(importlib.import_module(f"{__name__}.hf.cache"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A literal list of strings: kernel-builder reads it from the source without importing
# (the function list of its card), as do the public-API checks that version a kernel by it.
# It holds transformers' entry points for a hub kernel (flash_attn_forward,
# supports_flash_attn, m3_sparse_attention) and M3PagedCache; all but
# supports_flash_attn are served by __getattr__ above and import transformers on use.
__all__ = [
    "UnsupportedGPUError",
    "DecodeConfig",
    "DenseConfig",
    "IndexConfig",
    "KVOuterConfig",
    "KVOuterIndex",
    "M3PagedCache",
    "Schedule",
    "add_op_namespace_prefix",
    "build_kvouter_index",
    "combine",
    "dense_paged_attention",
    "dense_paged_attention_kernel",
    "flash_attn_forward",
    "index_prep",
    "index_topk",
    "kvouter_attention",
    "kvouter_partials",
    "m3_sparse_attention",
    "ops",
    "plan_dense_paged_attention",
    "plan_index_topk",
    "plan_sparse_attention",
    "qouter_attention",
    "reference",
    "schedule",
    "sparse_attention",
    "sparse_decode_attention",
    "supports_flash_attn",
]
