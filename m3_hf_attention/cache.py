"""The kernel's ``hf.cache`` module: the paged KV cache (``M3PagedCache``). ``from m3_hf_attention.cache import X`` is
the kernel's ``X``, looked up on the loaded kernel: this package keeps no second copy."""

from ._kernel import forward_to

__getattr__, __dir__ = forward_to("hf.cache")
