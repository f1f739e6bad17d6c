"""The transformers integration: ``cache`` (``M3PagedCache``, the static paged KV cache with
the index keys beside K/V), ``attention`` (the attention and mask functions of
``attn_implementation="m3_sparse"``, the indexer's paged selection, the ``generate()``
cache hook), ``serving`` (``paged|m3_sparse`` under transformers' continuous batching) and
``tp`` (the tensor-parallel plan). It calls the kernels through ``api``
only, and imports transformers, so the kernel package loads it on first use."""
