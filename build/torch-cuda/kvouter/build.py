"""KV-outer index builder: invert per-token selections into per-(kv head, block) lists.

Input ``selected[t, g, r]`` (block id chosen by token ``t`` for KV head ``g`` in
slot ``r``). Blocks of different sequences are different work, so a block is
named globally as ``seq * max_blocks + block`` and a segment as
``g * num_global_blocks + global_block``.

Output, all with sizes fixed by the input shapes (no device-to-host copy):

* ``seg_offsets`` [Hkv * NBg + 1] int32: CSR row pointers over segments;
* ``entry_token``, ``entry_rank``, ``entry_segment`` [E] int32 with
  ``E = Tq * Hkv * topk``: the (token, slot, segment) of each entry, sorted by
  segment then token; entries past ``seg_offsets[-1]`` are unused (``-1``);
* ``slot_of`` [Tq, Hkv, topk] int32: reverse map from a selection slot to the
  entry (and so the partial) computed for it, ``-1`` for empty slots and for
  a repeated id (a block counted once per token and head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.validate import INDEX_DTYPES, check_positive_int, check_selected_values, check_tensor
from ..core.layout import repeated_slots, token_seq_ids


@dataclass
class KVOuterIndex:
    seg_offsets: torch.Tensor
    entry_token: torch.Tensor
    entry_rank: torch.Tensor
    entry_segment: torch.Tensor
    slot_of: torch.Tensor
    num_kv_heads: int
    max_blocks: int  # blocks per sequence (block table capacity / block_size)
    num_global_blocks: int

    @property
    def num_segments(self) -> int:
        return self.seg_offsets.shape[0] - 1

    @property
    def capacity(self) -> int:
        return self.entry_token.shape[0]


def validate_build(selected, cu_seqlens_q, max_blocks, batch_size) -> int:
    """Checks shared by the torch and Triton builders; returns the batch size."""
    check_tensor("selected", selected, ndim=3, dtypes=INDEX_DTYPES)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=selected.device)
    check_positive_int("max_blocks", max_blocks)
    check_selected_values(selected, max_blocks)
    return cu_seqlens_q.shape[0] - 1 if batch_size is None else batch_size


def build_kvouter_index(
    selected: torch.Tensor, *, cu_seqlens_q: torch.Tensor, max_blocks: int, batch_size: int | None = None
) -> KVOuterIndex:
    """Build the CSR inverse map and the reverse map of ``selected`` [Tq, Hkv, topk].

    ``max_blocks``: blocks per sequence (block table width x page_size / block_size).
    """
    batch = validate_build(selected, cu_seqlens_q, max_blocks, batch_size)
    num_tokens, hkv, topk = selected.shape
    nbg = batch * max_blocks
    num_segments = hkv * nbg
    device = selected.device
    cap = num_tokens * hkv * topk

    sel = selected.to(torch.int64)
    seq = token_seq_ids(cu_seqlens_q, num_tokens)  # [Tq]
    valid = sel >= 0
    valid &= ~repeated_slots(sel)  # a repeated id within one (token, head) row keeps its first slot

    heads = torch.arange(hkv, device=device)[None, :, None]
    seg = heads * nbg + seq[:, None, None] * max_blocks + sel.clamp(min=0)  # [Tq, Hkv, topk]
    tokens = torch.arange(num_tokens, device=device)[:, None, None].expand_as(sel)
    ranks = torch.arange(topk, device=device)[None, None, :].expand_as(sel)
    # Invalid slots sort past every real segment.
    key = torch.where(valid, seg, num_segments) * num_tokens + tokens
    order = torch.argsort(key.reshape(-1), stable=True)

    flat_valid = valid.reshape(-1)[order]
    entry_token = torch.where(flat_valid, tokens.reshape(-1)[order], -1).to(torch.int32)
    entry_rank = torch.where(flat_valid, ranks.reshape(-1)[order], -1).to(torch.int32)
    entry_segment = torch.where(flat_valid, seg.reshape(-1)[order], -1).to(torch.int32)

    # Not bincount: on CUDA it reads the largest id back to size its output (a host sync).
    counts = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, torch.where(valid, seg, num_segments).reshape(-1), torch.ones_like(seg).reshape(-1))
    seg_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    seg_offsets[1:] = torch.cumsum(counts[:num_segments], 0)

    slot_of = torch.full((cap,), -1, dtype=torch.int64, device=device)
    slot_of[order] = torch.arange(cap, device=device)
    slot_of = torch.where(valid.reshape(-1), slot_of, -1).view(num_tokens, hkv, topk).to(torch.int32)
    return KVOuterIndex(
        seg_offsets=seg_offsets.to(torch.int32),
        entry_token=entry_token,
        entry_rank=entry_rank,
        entry_segment=entry_segment,
        slot_of=slot_of,
        num_kv_heads=hkv,
        max_blocks=max_blocks,
        num_global_blocks=nbg,
    )
