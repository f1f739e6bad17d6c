"""m3_hf_attention: MiniMax M3 block-sparse attention for Hugging Face transformers.

``import m3_hf_attention`` registers ``attn_implementation="m3_sparse"``::

    import m3_hf_attention
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse")
    model.generate(**inputs)  # uses an M3PagedCache unless you pass past_key_values

The kernels come from the ``m3-sparse`` hub kernel, loaded with ``kernels``
(see :func:`load_kernel`).
"""

from ._kernel import load_kernel
from .cache import M3PagedCache, M3PagedLayer
from .integration import ATTN_IMPLEMENTATION, m3_sparse_attention, m3_sparse_mask, register

register()

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "M3PagedCache",
    "M3PagedLayer",
    "load_kernel",
    "m3_sparse_attention",
    "m3_sparse_mask",
    "register",
]
