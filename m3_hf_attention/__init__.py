"""m3_hf_attention: MiniMax M3 block-sparse attention for Hugging Face transformers.

``import m3_hf_attention`` registers ``attn_implementation="m3_sparse"``::

    import m3_hf_attention
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse")
    model.generate(**inputs)  # uses an M3PagedCache unless you pass past_key_values

Everything runs from the ``m3-sparse`` hub kernel, loaded with ``kernels`` (see
:func:`load_kernel`): its ops and its transformers integration (the kernel's ``hf``
package), which this package exposes as ``m3_hf_attention.cache``, ``.integration``
(the kernel's ``hf.attention``), ``.mask`` and ``.tp`` without a copy of its own.
"""

from . import cache, integration, mask, tp
from ._kernel import kernel_module, load_kernel

M3PagedCache = cache.M3PagedCache
M3PagedLayer = cache.M3PagedLayer
ATTN_IMPLEMENTATION = integration.ATTN_IMPLEMENTATION
m3_sparse_attention = integration.m3_sparse_attention
m3_sparse_mask = integration.m3_sparse_mask
register = integration.register
# The keyword a model's forward and generate() take a cache under: "cache" from transformers
# 5.24, "past_key_values" before (still accepted, with a warning, until 5.40).
CACHE_KEYWORD = kernel_module("hf.compat").CACHE_KEYWORD

register()

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CACHE_KEYWORD",
    "M3PagedCache",
    "M3PagedLayer",
    "cache",
    "integration",
    "load_kernel",
    "m3_sparse_attention",
    "mask",
    "m3_sparse_mask",
    "register",
    "tp",
]
