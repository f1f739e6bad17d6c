"""The kernel's ``hf.attention`` module: the attention function, the mask function and the ``generate()`` cache hook. ``from m3_hf_attention.integration import X`` is
the kernel's ``X``, looked up on the loaded kernel: this package keeps no second copy."""

from ._kernel import forward_to

__getattr__, __dir__ = forward_to("hf.attention")
