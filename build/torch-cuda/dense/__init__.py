"""Dense attention over the paged cache (``attention``: torch path and oracle;
``attention_triton``: the Triton kernel, key tiles as TMA boxes on sm_90;
``attention_fa4``: flash-attn-4 where it is installed), and a prefill with no history on
torch's fused sdpa kernels (``attention_sdpa``)."""
