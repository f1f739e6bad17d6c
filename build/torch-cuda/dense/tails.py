"""Page tails: the slots of a sequence's last page past its length.

They hold no token, yet a kernel that loads whole pages (flash-attn-4's TMA path) reads
them, and a NaN there survives its masking (a masked probability of 0 times a NaN value
row is NaN). ``clear_page_tails`` zeroes them before such a kernel runs. This is the torch
oracle; ``tails_triton`` is the kernel (one launch, no host read).
"""

from __future__ import annotations

import torch


def clear_page_tails_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, used_kv_lens: torch.Tensor
) -> None:
    """Zero, in ``k_cache`` and ``v_cache`` ``[pages, Hkv, page_size, D]``, the slots
    ``used % page_size ..`` of each sequence's last page (``block_tables[b, (used - 1) //
    page_size]``). A sequence whose length is a multiple of the page size (or 0) has no tail.
    Reads the lengths on the host: an oracle for tests, not for a captured step."""
    page_size = k_cache.shape[2]
    for b, n in enumerate(used_kv_lens.tolist()):
        tail = n % page_size
        if n <= 0 or tail == 0:
            continue
        page = int(block_tables[b, (n - 1) // page_size])
        k_cache[page, :, tail:] = 0
        v_cache[page, :, tail:] = 0
