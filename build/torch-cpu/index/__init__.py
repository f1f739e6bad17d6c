"""The index branch: block selection (``topk``: torch path and oracle; ``topk_triton``: the
``tl`` kernel, its plan and launch; ``topk_gluon_sm90``: the Hopper prefill kernel)."""
