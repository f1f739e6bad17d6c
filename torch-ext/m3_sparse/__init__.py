"""m3_sparse: MiniMax M3 block-sparse attention (MSA) for PyTorch.

Public ops (token-major queries, paged caches; see ``interface.py``):

* ``index_topk``: block selection of the index branch;
* ``kvouter_attention``: sparse attention over the selected blocks, KV-outer;
* ``dense_paged_attention``: dense attention over the same paged cache;
* pipeline stages of ``kvouter_attention``: ``build_kvouter_index``, ``schedule``,
  ``kvouter_partials``, ``combine``;
* ``reference``: naive per-token oracles for tests;
* ``ops``: the same three ops as ``torch.library`` custom ops with fake implementations
  (``custom_ops.py``), for ``torch.compile``.
"""

from . import custom_ops, reference
from ._ops import add_op_namespace_prefix, ops
from .combine import combine
from .index_topk import index_topk
from .interface import dense_paged_attention, kvouter_attention
from .kvouter_attention import kvouter_partials
from .kvouter_index import KVOuterIndex, build_kvouter_index
from .scheduler import Schedule, schedule

__version__ = "0.1.0"

__all__ = [
    "KVOuterIndex",
    "Schedule",
    "add_op_namespace_prefix",
    "build_kvouter_index",
    "combine",
    "dense_paged_attention",
    "index_topk",
    "kvouter_attention",
    "kvouter_partials",
    "ops",
    "reference",
    "schedule",
]
