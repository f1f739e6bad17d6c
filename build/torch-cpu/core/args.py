"""The argument object of one attention call over a paged cache.

The public ops check their arguments once (``core.validate.attention_args``) and hand
this object to the implementation that runs: the torch stages or a kernel's launcher.
Nothing downstream checks the same things again, and no launcher takes the argument
list one by one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .launch import rows_bucket

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class AttnArgs:
    """An attention call, checked.

    q: [Tq, Hq, D] token-major; k_cache / v_cache: [pages, Hkv, page_size, D];
    block_tables: [B, max_pages]; cu_seqlens_q: [B + 1]; used_kv_lens: [B] (tokens
    cached per sequence, the new queries included, right aligned). ``scales``: fp32 [3]
    (q, k, v) dequantization scales on q's device when an input is fp8, else None.
    Sparse calls also carry ``selected`` [Tq, Hkv, topk] (``-1`` = empty slot), the
    ``block_size`` of a selected id, ``max_blocks`` (blocks a block table holds) and the
    ``partial_dtype`` of KV-outer's partials.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    used_kv_lens: torch.Tensor
    batch: int
    softmax_scale: float
    causal: bool
    return_lse: bool
    scales: torch.Tensor | None
    out_dtype: torch.dtype
    selected: torch.Tensor | None = None
    block_size: int = 128
    max_blocks: int = 0
    partial_dtype: torch.dtype | None = None
    max_seqlen_q: int | None = None  # host-known bound of one sequence's query rows (tiling only)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def rows_per_seq(self) -> int:
        """A host-known bound of one sequence's query rows: ``max_seqlen_q``, else ``Tq``."""
        return self.num_tokens if self.max_seqlen_q is None else min(self.max_seqlen_q, self.num_tokens)

    @property
    def hq(self) -> int:
        return self.q.shape[1]

    @property
    def ahead_key(self) -> tuple:
        """What a compile-ahead key (``core.launch.compile_ahead``) keeps of the call: dtypes,
        head counts and dims, page and block sizes, flags, and query rows per sequence
        coarsely (no lengths)."""
        return (
            self.q.dtype, self.k_cache.dtype, tuple(self.q.shape[1:]), tuple(self.k_cache.shape[1:]), self.block_size,
            self.causal, self.return_lse, self.out_dtype, self.partial_dtype, self.selected is not None,
            self.batch > 1, rows_bucket(self.rows_per_seq),
        )

    @property
    def d(self) -> int:
        return self.q.shape[2]

    @property
    def hkv(self) -> int:
        return self.k_cache.shape[1]

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def q_fp8(self) -> bool:
        return self.q.dtype == FP8

    @property
    def kv_fp8(self) -> bool:
        return self.k_cache.dtype == FP8

    @property
    def normalized_partials(self) -> bool:
        """e4m3 partials store O / l in V's units (see ``kvouter.partials``)."""
        return self.partial_dtype is not None and self.partial_dtype != self.out_dtype

    def new_outputs(self, no_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [Tq, Hq, D] in ``out_dtype``, lse [Hq, Tq] fp32 or None), uninitialized, or
        with ``no_keys`` what a query that sees no key gets: zeros, lse = -inf."""
        device = self.q.device
        if no_keys:
            out = torch.zeros(self.num_tokens, self.hq, self.d, dtype=self.out_dtype, device=device)
            lse = torch.full((self.hq, self.num_tokens), float("-inf"), device=device) if self.return_lse else None
            return out, lse
        out = torch.empty(self.num_tokens, self.hq, self.d, dtype=self.out_dtype, device=device)
        lse = torch.empty(self.hq, self.num_tokens, dtype=torch.float32, device=device) if self.return_lse else None
        return out, lse

    def replace(self, **changes) -> "AttnArgs":
        return dataclasses.replace(self, **changes)

    def rows(self, t0: int, t1: int, cu_seqlens_q: torch.Tensor, used_kv_lens: torch.Tensor, selected) -> "AttnArgs":
        """The call restricted to query rows ``t0:t1`` with that slice's varlen description."""
        return self.replace(q=self.q[t0:t1], cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens, selected=selected)


@dataclass(frozen=True)
class IndexArgs:
    """An index top-k call, checked.

    index_q: [Tq, Hi, Di]; index_k_cache: [pages, page_size, Di] (float, or e4m3 codes
    with ``index_k_scale``: fp32 per token ``[pages, page_size]`` or one element);
    block_tables / cu_seqlens_q / used_kv_lens as in :class:`AttnArgs`.
    """

    index_q: torch.Tensor
    index_k_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    used_kv_lens: torch.Tensor
    topk: int
    block_size: int
    local_blocks: int
    max_seqlen_q: int | None
    index_k_scale: torch.Tensor | None
    fp8_dot: bool

    @property
    def fp8(self) -> bool:
        return self.index_k_cache.dtype == FP8

    @property
    def token_scales(self) -> bool:
        """Per-token scales (a per-tensor scale never changes a ranking: no kernel reads it)."""
        return self.fp8 and not is_tensor_scale(self.index_k_scale)

    @property
    def ahead_key(self) -> tuple:
        """What a compile-ahead key keeps of the call (as ``AttnArgs.ahead_key``)."""
        rows = self.index_q.shape[0] if self.max_seqlen_q is None else self.max_seqlen_q
        return (
            self.index_q.dtype, self.index_k_cache.dtype, tuple(self.index_q.shape[1:]),
            tuple(self.index_k_cache.shape[1:]), self.topk, self.block_size, self.local_blocks, self.fp8_dot,
            self.token_scales, rows_bucket(rows),
        )


def is_tensor_scale(index_k_scale) -> bool:
    """True for a per-tensor scale (one element), False for per-token scales."""
    return isinstance(index_k_scale, torch.Tensor) and index_k_scale.dim() <= 1 and index_k_scale.numel() == 1


def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor of ``t``'s shape, dtype and device that holds one element (zero strides):
    what a kept plan remembers of a call's tensor."""
    return None if t is None else t.new_empty(()).expand(t.shape)


def released(args, names: tuple[str, ...]):
    """``args`` (an :class:`AttnArgs` or :class:`IndexArgs`) with the tensors ``names`` as
    stand-ins (:func:`stand_in`)."""
    return dataclasses.replace(args, **{name: stand_in(getattr(args, name)) for name in names})


def tensor_meta(t: torch.Tensor | None) -> tuple | None:
    """What a plan fixes of a tensor (``api.plan_*``): shape, strides, dtype and device
    (None for None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
