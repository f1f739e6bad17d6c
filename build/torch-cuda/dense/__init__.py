"""Dense attention over the paged cache (``attention``: torch path and oracle;
``attention_triton``: the Triton kernel, key tiles as TMA boxes on sm_90)."""
