"""Varlen batch and paged-cache bookkeeping shared by the torch implementations.

Conventions used everywhere in the package:

* queries are token-major: ``[Tq, H, D]``, sequence ``b`` owning rows
  ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``;
* a sequence's new query tokens are the LAST tokens of its cache ("right
  aligned"): query ``i`` of a sequence with ``n`` queries and ``kv_len`` cached
  tokens sits at absolute position ``kv_len - n + i``;
* caches are paged: token ``j`` of sequence ``b`` lives in page
  ``block_tables[b, j // page_size]`` at slot ``j % page_size``.
"""

from __future__ import annotations

import torch


def token_seq_ids(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence id of every query token, computed on the device (no sync). [Tq] int64"""
    tokens = torch.arange(num_tokens, device=cu_seqlens_q.device, dtype=torch.int64)
    return torch.searchsorted(cu_seqlens_q.to(torch.int64)[1:], tokens, right=True)


def token_positions(
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq id, absolute position) of every query token. Both [Tq] int64."""
    seq = token_seq_ids(cu_seqlens_q, num_tokens)
    cu = cu_seqlens_q.to(torch.int64)
    kv = kv_lens.to(torch.int64)
    q_len = cu[1:] - cu[:-1]
    tokens = torch.arange(num_tokens, device=cu.device, dtype=torch.int64)
    pos = kv[seq] - q_len[seq] + (tokens - cu[seq])
    return seq, pos


def repeated_slots(selected: torch.Tensor) -> torch.Tensor:
    """``[..., topk]`` bool: slots whose block id already stands in an earlier slot of the
    same row. A repeated id counts once everywhere: only its first slot is live."""
    topk = selected.shape[-1]
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=selected.device).tril(-1)
    return ((selected[..., :, None] == selected[..., None, :]) & earlier).any(-1)


def gather_tokens(
    cache: torch.Tensor, block_tables: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Read cache rows of (sequence, absolute position) pairs.

    ``cache`` is ``[pages, page_size, ...]`` (index keys) or ``[pages, H, page_size, D]``
    (K/V: pass it with the head axis moved behind the slot axis). ``seq``/``pos``
    must be in range; callers clamp positions they will mask anyway.
    """
    pos = pos.clamp(min=0)
    page = block_tables.to(torch.int64)[seq, pos // page_size]
    return cache[page, pos % page_size]


def key_extent(kv_lens: torch.Tensor, capacity: int) -> int:
    """How many key positions a streaming loop must cover.

    On the CPU reading the longest sequence is free and saves looping over an
    empty cache tail; on an accelerator that read would be a host sync, so the
    loop covers the block-table capacity and masks.
    """
    if kv_lens.device.type == "cpu" and kv_lens.numel() > 0:
        return max(1, min(capacity, int(kv_lens.max())))
    return capacity


def chunk_varlen(
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, t0: int, t1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q, kv_lens) of the query rows ``t0:t1`` of a varlen batch, on the device,
    for causal attention.

    Every sequence keeps its batch slot (possibly with no rows). A position depends only
    on a row's distance to its sequence's last row, so a sequence's kv length drops by
    its rows cut off after ``t1``: each kept row stays at its absolute position, and
    under causality it never saw the keys of those later rows. A length that would turn
    negative (left-padding rows, all before the first key) becomes 0: those rows see
    nothing either way.
    """
    cu = cu_seqlens_q.to(torch.int64)
    cut = (cu[1:] - t1).clamp(min=0)
    kv = (kv_lens.to(torch.int64) - cut).clamp(min=0)
    return (cu.clamp(t0, t1) - t0).to(cu_seqlens_q.dtype), kv.to(kv_lens.dtype)
