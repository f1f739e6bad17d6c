"""The kernel's ``hf.mask`` module: the mask function of ``m3_sparse`` and the padding mask
of the forward pass being run. ``from m3_hf_attention.mask import X`` is the kernel's ``X``,
looked up on the loaded kernel: this package keeps no second copy."""

from ._kernel import forward_to

__getattr__, __dir__ = forward_to("hf.mask")
