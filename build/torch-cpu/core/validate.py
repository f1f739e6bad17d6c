"""Argument checks shared by the public entry points.

Every check here only reads shapes, dtypes and devices (host metadata), so it
never synchronizes with the GPU. Checks that must read tensor *values* (block
ids, page-table entries, lengths) run when the tensors live on the CPU, where
reading them is free, or everywhere when ``M3_SPARSE_DEBUG=1``.
"""

from __future__ import annotations

import math
import os

import torch

from .args import AttnArgs, IndexArgs, is_tensor_scale
from .quant import E4M3

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (E4M3,)


def debug_enabled() -> bool:
    return os.environ.get("M3_SPARSE_DEBUG", "0") not in ("", "0", "false", "False")


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Value checks cost nothing on the CPU; on an accelerator they need a sync."""
    return t.device.type == "cpu" or debug_enabled()


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected {what} = {expected} (dim {dim}), got shape {tuple(t.shape)}")


def check_positive_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")


def check_varlen(
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_tokens: int,
    page_size: int,
    num_pages: int,
    device: torch.device,
    kv_lens_name: str = "used_kv_lens",
) -> int:
    """Check the varlen batch description; returns the batch size."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor(kv_lens_name, kv_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    batch = kv_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q: expected batch + 1 = {batch + 1} entries ({kv_lens_name} has {batch}), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected {batch} rows (one per sequence), got {block_tables.shape[0]}")
    if not value_checks_enabled(kv_lens):
        return batch
    cu = cu_seqlens_q.to("cpu", torch.int64)
    kv = kv_lens.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens_q: expected to start at 0 and end at the number of query tokens {num_tokens}, "
            f"got {cu.tolist()}"
        )
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        raise ValueError(f"cu_seqlens_q: expected non-decreasing offsets, got {cu.tolist()}")
    if bool((kv < 0).any()):
        bad = int(torch.nonzero(kv < 0)[0])
        raise ValueError(f"{kv_lens_name}[{bad}] = {int(kv[bad])}: expected a non-negative token count")
    capacity = block_tables.shape[1] * page_size
    if bool((kv > capacity).any()):
        bad = int(torch.nonzero(kv > capacity)[0])
        raise ValueError(
            f"{kv_lens_name}[{bad}] = {int(kv[bad])} exceeds the block table capacity "
            f"{block_tables.shape[1]} pages x {page_size} = {capacity} tokens"
        )
    bt = block_tables.to("cpu", torch.int64)
    pages_needed = (kv + page_size - 1) // page_size
    for b in range(batch):
        used = bt[b, : int(pages_needed[b])]
        if used.numel() and (bool((used < 0).any()) or bool((used >= num_pages).any())):
            bad = used[(used < 0) | (used >= num_pages)][0]
            raise ValueError(
                f"block_tables[{b}] holds page id {int(bad)} inside the sequence's {int(kv[b])} tokens; "
                f"expected ids in [0, {num_pages}) (the pool has {num_pages} pages)"
            )
    return batch


def check_key_rows(k_out, k_rows, tokens: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
    """``k_out [N, d]`` (``dtype``, unit last stride) and ``k_rows [tokens]``: the row of
    ``k_out`` each token's key is written to, in ``[0, N)`` (values checked where reading
    them is free). Tokens that share a row leave one of their keys there: a paged cache
    sends its padding to one scratch page."""
    check_tensor("k_out", k_out, ndim=2, dtypes=(dtype,), device=device)
    check_tensor("k_rows", k_rows, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if k_out.shape[1] != d or k_out.stride(1) != 1:
        raise ValueError(f"k_out: expected [rows, {d}] with a unit last stride, got shape {tuple(k_out.shape)}")
    if k_rows.shape[0] != tokens:
        raise ValueError(f"k_rows: expected one row per token ({tokens}), got {k_rows.shape[0]}")
    if tokens and value_checks_enabled(k_rows):
        rows = k_rows.to("cpu", torch.int64)
        if int(rows.min()) < 0 or int(rows.max()) >= k_out.shape[0]:
            raise ValueError(f"k_rows: expected rows in [0, {k_out.shape[0]}), got {rows.tolist()}")


def check_pages(q, k_cache, block_tables, cu_seqlens_q, used_kv_lens) -> int:
    """:func:`check_varlen` of queries ``q [Tq, ...]`` over a K/V page pool
    ``[pages, Hkv, page_size, D]``; returns the batch size."""
    return check_varlen(cu_seqlens_q, used_kv_lens, block_tables, num_tokens=q.shape[0], page_size=k_cache.shape[2],
                        num_pages=k_cache.shape[0], device=q.device)


def check_selected_values(selected: torch.Tensor, max_blocks: int) -> None:
    if not value_checks_enabled(selected) or selected.numel() == 0:
        return
    lo = int(selected.min())
    hi = int(selected.max())
    if lo < -1 or hi >= max_blocks:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"selected: block id {bad} out of range; expected -1 (empty slot) or an id in "
            f"[0, {max_blocks}) (block table capacity in blocks)"
        )


SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_kv(q, k_cache, v_cache, page_size, *, allow_fp8: bool = False):
    """Shapes and dtypes of q [Tq, Hq, D] and the paged caches [pages, Hkv, page_size, D].

    ``allow_fp8`` (the public attention ops): the caches may be float8_e4m3fn (both), and then
    q is float8_e4m3fn or any float dtype; otherwise all three share one float dtype.
    """
    if not allow_fp8:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:
                raise ValueError(
                    f"{name}: float8_e4m3fn inputs are taken by the public ops (kvouter_attention, "
                    "sparse_decode_attention, sparse_attention, dense_paged_attention) with their scales; this "
                    "entry point takes bfloat16, float16 or float32"
                )
    dtypes = FLOAT_DTYPES + FP8_DTYPES if allow_fp8 else FLOAT_DTYPES
    check_tensor("q", q, ndim=3, dtypes=dtypes)
    device = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes, device=device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)} "
            f"([pages, kv_heads, page_size, head_dim]), got {tuple(v_cache.shape)}"
        )
    fp8_kv = k_cache.dtype in FP8_DTYPES, v_cache.dtype in FP8_DTYPES
    if q.dtype in FP8_DTYPES and not all(fp8_kv):
        raise ValueError(
            f"q is float8_e4m3fn: k_cache and v_cache must be float8_e4m3fn too, got {_name(k_cache.dtype)} "
            f"and {_name(v_cache.dtype)}"
        )
    if any(fp8_kv):
        if not all(fp8_kv):
            raise ValueError(
                f"k_cache and v_cache must both be float8_e4m3fn or neither, got {_name(k_cache.dtype)} and "
                f"{_name(v_cache.dtype)}"
            )
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"k_cache/v_cache: expected the dtype of q ({q.dtype}), got {k_cache.dtype} and {v_cache.dtype}"
        )
    check_dim("k_cache", k_cache, 3, q.shape[2], "head dim (q.shape[2])")
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q/k_cache: the number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})"
        )
    if page_size is not None and k_cache.shape[2] != page_size:
        raise ValueError(f"page_size: expected k_cache.shape[2] = {page_size}, got shape {tuple(k_cache.shape)}")
    if k_cache.shape[2] not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"k_cache: page size {k_cache.shape[2]} is not supported; expected one of {SUPPORTED_PAGE_SIZES}")


def check_quant(q, k_cache, q_scale, k_scale, v_scale, out_dtype):
    """Dequantization scales and output dtype of inputs checked by ``check_kv(allow_fp8=True)``.

    A scale (``real = stored * scale``) belongs to a float8_e4m3fn tensor and defaults to 1;
    it is a positive float or a one-element floating tensor on q's device (read by the
    kernels, never by the host). Returns (scales, out_dtype): ``scales`` an fp32 tensor
    [3] (q, k, v) on q's device, or None when no input is fp8; ``out_dtype`` the dtype of
    the partials and the output (default: q's, bfloat16 for an fp8 q).
    """
    fp8_q, fp8_kv = q.dtype in FP8_DTYPES, k_cache.dtype in FP8_DTYPES
    owners = (("q_scale", q_scale, fp8_q, "q"), ("k_scale", k_scale, fp8_kv, "k_cache"), ("v_scale", v_scale, fp8_kv, "v_cache"))
    for name, s, fp8, owner in owners:
        if s is None:
            continue
        if not fp8:
            raise ValueError(f"{name}: a dequantization scale of float8_e4m3fn {owner}, which is {_name(q.dtype if owner == 'q' else k_cache.dtype)} here")
        if isinstance(s, torch.Tensor):
            if s.numel() != 1:
                raise ValueError(f"{name}: expected one value (a float or a one-element tensor), got shape {tuple(s.shape)}")
            if not s.is_floating_point() or s.dtype in FP8_DTYPES:
                raise ValueError(f"{name}: expected a floating tensor (float32, bfloat16, float16), got {_name(s.dtype)}")
            if s.device != q.device:
                raise ValueError(f"{name}: expected a tensor on {q.device}, got one on {s.device}")
            if value_checks_enabled(s):
                v = float(s.reshape(()))
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(f"{name}: expected a positive finite float, got {v}")
        elif isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{name}: expected a positive finite float, got {s!r}")
    if not fp8_q and not fp8_kv:
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype: only fp8 inputs take another output dtype; the output is q's {_name(q.dtype)}")
        return None, q.dtype
    if out_dtype is None:
        out_dtype = default_out_dtype(q.dtype)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of (bfloat16, float16, float32), got {out_dtype}")
    scales = torch.empty(3, dtype=torch.float32, device=q.device)
    for i, (_, s, _, _) in enumerate(owners):
        # A fill / device copy per value: no host-to-device transfer, nothing to sync on.
        if isinstance(s, torch.Tensor):
            scales[i].copy_(s.reshape(()))
        else:
            scales[i].fill_(1.0 if s is None else float(s))
    return scales, out_dtype


def default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The output of an op on ``dtype`` inputs (q, or partials) when none is asked for:
    bfloat16 for float8_e4m3fn, else the same dtype."""
    return torch.bfloat16 if dtype in FP8_DTYPES else dtype


def check_partial_dtype(partial_dtype, v_cache, out_dtype):
    """The dtype of the KV-outer partials: ``out_dtype`` (raw O rows, the default) or
    float8_e4m3fn, which only fp8 caches take: the rows are then stored normalized (O / l,
    in V's stored units, so within +-448) and the combine applies V's scale."""
    if partial_dtype is None or partial_dtype == out_dtype:
        return out_dtype
    if partial_dtype not in FP8_DTYPES:
        raise ValueError(
            f"partial_dtype: expected None, the output dtype ({_name(out_dtype)}) or float8_e4m3fn, got {partial_dtype}"
        )
    if v_cache.dtype not in FP8_DTYPES:
        raise ValueError(
            "partial_dtype=float8_e4m3fn: needs float8_e4m3fn caches (the partials are stored in V's fp8 units), "
            f"got v_cache {_name(v_cache.dtype)}"
        )
    return partial_dtype


def check_scale(softmax_scale, d):
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def attention_args(
    q, k_cache, v_cache, block_tables, *, cu_seqlens_q, used_kv_lens, softmax_scale, causal, return_lse,
    q_scale=None, k_scale=None, v_scale=None, out_dtype=None, page_size=None, selected=None, block_size=128,
    partial_dtype=None, sparse=True, allow_fp8=True, max_seqlen_q=None,
) -> AttnArgs:
    """Every check of an attention op, once, and its :class:`AttnArgs`.

    ``sparse``: the call attends ``selected`` blocks of ``block_size`` keys (checked);
    ``allow_fp8``: fp8 inputs with their scales (the public ops), else float inputs only.
    """
    check_kv(q, k_cache, v_cache, page_size if sparse else None, allow_fp8=allow_fp8)
    max_blocks = 0
    if sparse:
        check_positive_int("block_size", block_size)
        check_tensor("selected", selected, ndim=3, dtypes=INDEX_DTYPES, device=q.device)
        check_dim("selected", selected, 0, q.shape[0], "query tokens (q.shape[0])")
        check_dim("selected", selected, 1, k_cache.shape[1], "KV heads (k_cache.shape[1])")
    batch = check_pages(q, k_cache, block_tables, cu_seqlens_q, used_kv_lens)
    if sparse:
        max_blocks = -(-block_tables.shape[1] * k_cache.shape[2] // block_size)
        check_selected_values(selected, max_blocks)
    scale = check_scale(softmax_scale, q.shape[2])
    scales, out_dtype = check_quant(q, k_cache, q_scale, k_scale, v_scale, out_dtype)
    if sparse:
        partial_dtype = check_partial_dtype(partial_dtype, v_cache, out_dtype)
    return AttnArgs(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens, batch=batch, softmax_scale=scale, causal=bool(causal),
        return_lse=bool(return_lse), scales=scales, out_dtype=out_dtype, selected=selected,
        block_size=block_size, max_blocks=max_blocks, partial_dtype=partial_dtype if sparse else None,
        max_seqlen_q=None if max_seqlen_q is None else int(max_seqlen_q),
    )


# e4m3fn only: it is what Hopper's fp8 tensor cores take (e4m3fnuz is AMD's encoding),
# and its 3 mantissa bits are enough for ranking while e5m2's 2 are not.
FP8_INDEX_DTYPES = FP8_DTYPES
# Hopper's fp8 MMA reduces over at least 32 elements.
FP8_DOT_MIN_DIM = 32


def check_index_k_scale(index_k_cache: torch.Tensor, index_k_scale) -> None:
    """An fp8 cache needs its fp32 scale, per token ``[pages, page_size]`` or per
    tensor (one element); any other cache must come without one (a stray scale would
    otherwise be silently ignored)."""
    if index_k_cache.dtype in FP8_INDEX_DTYPES:
        want = f"per-token {tuple(index_k_cache.shape[:2])} ([pages, page_size]) or per-tensor (1,) or ()"
        if index_k_scale is None:
            raise ValueError(
                "index_k_scale: required with an fp8 (float8_e4m3fn) index_k_cache: pass its fp32 "
                f"dequantization scale, {want}"
            )
        check_tensor("index_k_scale", index_k_scale, dtypes=(torch.float32,), device=index_k_cache.device)
        if not is_tensor_scale(index_k_scale) and tuple(index_k_scale.shape) != tuple(index_k_cache.shape[:2]):
            raise ValueError(f"index_k_scale: expected shape {want}, got {tuple(index_k_scale.shape)}")
        if is_tensor_scale(index_k_scale) and value_checks_enabled(index_k_scale):
            # The GPU kernel never reads a per-tensor scale: only a positive finite one
            # leaves the ranking (and so the torch path's result) unchanged.
            v = float(index_k_scale.reshape(()))
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"index_k_scale: a per-tensor scale must be positive and finite, got {v}")
    elif index_k_scale is not None:
        raise ValueError(
            "index_k_scale: only an fp8 (float8_e4m3fn) index_k_cache takes a scale; index_k_cache is "
            f"{_name(index_k_cache.dtype)}"
        )


def index_args(
    index_q, index_k_cache, block_tables, *, cu_seqlens_q, used_kv_lens, topk, block_size=128, local_blocks=1,
    max_seqlen_q=None, index_k_scale=None, fp8_dot=False,
) -> IndexArgs:
    """Every check of ``index_topk``, once, and its :class:`IndexArgs`."""
    if not isinstance(fp8_dot, bool):
        raise ValueError(f"fp8_dot: expected a bool, got {fp8_dot!r}")
    if isinstance(index_k_cache, torch.Tensor):
        check_index_k_scale(index_k_cache, index_k_scale)
        if fp8_dot and index_k_cache.dtype not in FP8_INDEX_DTYPES:
            raise ValueError(
                "fp8_dot: only applies to an fp8 (float8_e4m3fn) index_k_cache; index_k_cache is "
                f"{_name(index_k_cache.dtype)}"
            )
        if fp8_dot and isinstance(index_q, torch.Tensor) and index_q.dim() == 3 and index_q.shape[2] < FP8_DOT_MIN_DIM:
            raise ValueError(
                f"fp8_dot: the fp8 tensor-core dot needs an index head dim of at least {FP8_DOT_MIN_DIM}, got "
                f"{index_q.shape[2]}; use fp8_dot=False (fp32 scores of the fp8 keys)"
            )
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    device = index_q.device
    check_tensor("index_k_cache", index_k_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_INDEX_DTYPES, device=device)
    check_dim("index_k_cache", index_k_cache, 2, index_q.shape[2], "index head dim (index_q.shape[2])")
    if index_k_cache.shape[1] not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"index_k_cache: page size {index_k_cache.shape[1]} is not supported; expected one of {SUPPORTED_PAGE_SIZES}"
        )
    check_positive_int("topk", topk)
    check_positive_int("block_size", block_size)
    if not isinstance(local_blocks, int) or isinstance(local_blocks, bool) or not 0 <= local_blocks <= topk:
        raise ValueError(f"local_blocks: expected an int in [0, topk={topk}], got {local_blocks!r}")
    pages, page_size = index_k_cache.shape[:2]
    check_varlen(cu_seqlens_q, used_kv_lens, block_tables, num_tokens=index_q.shape[0], page_size=page_size,
                 num_pages=pages, device=device)
    if max_seqlen_q is not None:
        max_seqlen_q = int(max_seqlen_q)
    return IndexArgs(
        index_q=index_q, index_k_cache=index_k_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
        used_kv_lens=used_kv_lens, topk=topk, block_size=block_size, local_blocks=local_blocks,
        max_seqlen_q=max_seqlen_q, index_k_scale=index_k_scale, fp8_dot=fp8_dot,
    )
