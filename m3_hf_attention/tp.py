"""The kernel's ``hf.tp`` module: the tensor-parallel plan. ``from m3_hf_attention.tp import X`` is
the kernel's ``X``, looked up on the loaded kernel: this package keeps no second copy."""

from ._kernel import forward_to

__getattr__, __dir__ = forward_to("hf.tp")
