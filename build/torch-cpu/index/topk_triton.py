"""Index branch on the GPU: streaming score + block max + top-k in Triton.

Same contract as ``topk.index_topk_torch`` (see that module): for every
(query token, index head) row, the ``local_blocks`` blocks ending at
``L = p // block_size`` are forced and the remaining ``topk - local_blocks``
slots go to the best earlier blocks by max-pooled raw score, ties to the lower
block id, ``-1`` in unused slots. Slot order: forced ids (``L, L-1, ..``), then
the kept ids, then ``-1``.

Work decomposition. The index queries ``[Tq, Hi, Di]`` are read as flat rows
``token * Hi + head``: all index heads share the single index-key head, so the
rows of a sequence are tiled together and every key tile is scored against all
heads (and, in decode, all speculative tokens) of the sequence at once. A
program owns one row tile of one sequence (tiles never straddle sequences; the
tile -> sequence map is computed on the device from ``cu_seqlens_q``) and one
split of that tile's candidate key range. It streams key tiles through the
block table, scores them with ``tl.dot`` (fp32 accumulate), max-pools them to
blocks and keeps a running top-(topk - local) per row in registers. Blocks
arrive in increasing id order, so a block whose score only equals the worst kept
one never displaces it: that is exactly "ties to the lower id".

With one split (long prefill: enough row tiles to fill the GPU) the program
writes the final selection. With several (decode, or a short chunk after a long
cache) each split writes its local top list to a small workspace
``[Tq * Hi, splits, KP]`` and ``_merge_kernel`` picks the global best; the
global top set is a subset of the union of the local ones.

Nothing reads device data on the host: the grid is sized from shapes
(``Tq * Hi // BM + batch`` row tiles, an upper bound; programs without a tile
exit) and the split count from the block-table capacity.

fp8 index keys (``float8_e4m3fn`` cache plus a per-token fp32 scale
``[pages, page_size]``): each score column is multiplied by its key's scale. With a
per-tensor scale (one element) the kernel reads no scale at all: it would multiply
every score of a row by the same positive factor, which never changes the ranking, and
the per-score multiply is 128 of the 530 instructions a warp issues per key tile in
the fp8 prefill loop (sm_90).
By default the keys are widened to the query dtype before the dot (half the
key bytes, the query exact). With ``fp8_dot`` the query rows are quantized to
e4m3 in the kernel too (a positive per-row factor does not change a row's
ranking, so it is never applied back) and the dot runs on the fp8 tensor cores.
In decode (row tiles of at most 32 rows) that dot is taken key-major, ``K @ Q^T``:
the 128-key tile becomes the MMA's M, so Hopper's warpgroup MMA reads the fp8 keys
from shared memory as they arrived, where a 16-row M would not qualify for it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core.args import IndexArgs
from ..core.interpreter import dot, to_e4m3
from ..core.launch import StreamBuffers, interpreting, launch_kernel, next_pow2, seq_block
from .plan import DEFAULT_CONFIG, KEY_MAJOR_STAGES, IndexConfig, IndexPlan, metadata

@triton.jit
def _seq_of_tile(cu_ptr, pid, batch, H: tl.constexpr, BM: tl.constexpr, BATCH_P2: tl.constexpr):
    """(sequence, its first query token, its query count, tile index) of row tile
    ``pid``; the sequence is ``batch`` for programs past the last tile."""
    offs_b = tl.arange(0, BATCH_P2)
    b_ok = offs_b < batch
    cu_lo = tl.load(cu_ptr + offs_b, mask=b_ok, other=0)
    cu_hi = tl.load(cu_ptr + offs_b + 1, mask=b_ok, other=0)
    n_q = cu_hi - cu_lo
    n_tiles = (n_q * H + BM - 1) // BM
    tile_end = tl.cumsum(n_tiles, 0)
    seq = tl.sum((tile_end <= pid).to(tl.int32), 0)
    here = offs_b == seq
    t_end = tl.sum(tl.where(here, tile_end, 0), 0)
    q_lo = tl.sum(tl.where(here, cu_lo, 0), 0)
    nq = tl.sum(tl.where(here, n_q, 0), 0)
    # Tiles of one sequence are handed out last-rows-first: later rows see more
    # keys, so the longest programs start earliest and the tail wave is short.
    tile = t_end - 1 - pid
    return seq, q_lo, nq, tile


@triton.jit
def _insert(vals, ids, cand, cid):
    """Offer block ``cid`` (higher than every kept id) with score ``cand`` [BM] to
    each row's kept list. vals/ids: [BM, KP]."""
    worst_val = tl.min(vals, axis=1)
    # Among equal worst scores the highest id is the one that loses the tie.
    worst_id = tl.max(tl.where(vals == worst_val[:, None], ids, -2147483647), axis=1)
    hit = (ids == worst_id[:, None]) & (cand > worst_val)[:, None]
    vals = tl.where(hit, cand[:, None], vals)
    ids = tl.where(hit, cid, ids)
    return vals, ids


@triton.jit
def _score_chunk(
    vals,
    ids,
    b_q,
    k_ptr,
    ks_ptr,
    bt_row_ptr,
    c,
    key_hi,
    cand_end,
    stride_kp,
    stride_ks,
    stride_sp,
    offs_d,
    BM: tl.constexpr,
    BK: tl.constexpr,
    CH: tl.constexpr,
    TPB: tl.constexpr,
    NBT: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    SAME_PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_SCALE: tl.constexpr,
    K_CAST: tl.constexpr,
    KEY_MAJOR: tl.constexpr,
):
    """Score key chunk ``c`` (CH keys = NBT blocks, or one block in TPB tiles)
    and offer its blocks to the kept lists. KEY_MAJOR (NBT == 1 only): scores as
    ``[BK, BM]`` = K @ Q^T, so that a short row tile (decode) sits in the MMA's N and
    the key tile fills its M: Hopper's warpgroup MMA then takes the fp8 keys straight
    from shared memory, where an M of 16 rows would fall back to the register path."""
    tl.static_assert(NBT == 1 or not KEY_MAJOR, "key-major scores need key tiles inside one block")
    if NBT == 1:
        b_max1 = tl.full([BM], float("-inf"), tl.float32)
    else:
        b_maxn = tl.full([BM, NBT], float("-inf"), tl.float32)
    for sub in tl.static_range(TPB):
        k0 = c * CH + sub * BK
        offs_k = k0 + tl.arange(0, BK)
        if SAME_PAGE:
            # The whole tile lies in one page: one table read, contiguous rows.
            if MASKED:
                page = tl.load(bt_row_ptr + k0 // PAGE, mask=k0 < key_hi, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row_ptr + k0 // PAGE).to(tl.int64)
            slot = (k0 % PAGE) + tl.arange(0, BK)
            if K_SCALE:
                p_s = ks_ptr + page * stride_sp + slot
        else:
            if MASKED:
                page = tl.load(bt_row_ptr + offs_k // PAGE, mask=offs_k < key_hi, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row_ptr + offs_k // PAGE).to(tl.int64)
            slot = offs_k % PAGE
            if K_SCALE:
                p_s = ks_ptr + page * stride_sp + slot
        if KEY_MAJOR:
            p_k = k_ptr + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :]  # [BK, D]
            k_mask = (offs_k < key_hi)[:, None]
        else:
            p_k = k_ptr + (page * stride_kp + slot * stride_ks)[None, :] + offs_d[:, None]  # [D, BK]
            k_mask = (offs_k < key_hi)[None, :]
        if MASKED:
            b_k = tl.load(p_k, mask=k_mask, other=0.0)
            if K_SCALE:
                b_ks = tl.load(p_s, mask=offs_k < key_hi, other=0.0)
        else:
            b_k = tl.load(p_k)
            if K_SCALE:
                b_ks = tl.load(p_s)
        if KEY_MAJOR:
            if DOT_FP32:
                b_s = tl.dot(b_k.to(tl.float32), tl.trans(b_q), input_precision="ieee")  # [BK, BM]
            elif K_CAST:
                b_s = dot(b_k.to(b_q.dtype), tl.trans(b_q), None)  # [BK, BM]
            else:
                b_s = dot(b_k, tl.trans(b_q), None)  # [BK, BM]
            if K_SCALE:
                b_s = b_s * b_ks[:, None]
            if MASKED:
                b_s = tl.where(offs_k[:, None] < cand_end[None, :], b_s, float("-inf"))
            b_max1 = tl.maximum(b_max1, tl.max(b_s, axis=0))
        else:
            if DOT_FP32:
                b_s = tl.dot(b_q, b_k.to(tl.float32), input_precision="ieee")  # [BM, BK]
            elif K_CAST:
                b_s = dot(b_q, b_k.to(b_q.dtype), None)  # [BM, BK]
            else:
                b_s = dot(b_q, b_k, None)  # [BM, BK]
            if K_SCALE:
                b_s = b_s * b_ks[None, :]
            if MASKED:
                b_s = tl.where(offs_k[None, :] < cand_end[:, None], b_s, float("-inf"))
            if NBT == 1:
                b_max1 = tl.maximum(b_max1, tl.max(b_s, axis=1))
            else:
                b_maxn = tl.maximum(b_maxn, tl.max(tl.reshape(b_s, [BM, NBT, BLOCK]), axis=2))
    if NBT == 1:
        vals, ids = _insert(vals, ids, b_max1, c)
    else:
        offs_n = tl.arange(0, NBT)
        for i in tl.static_range(NBT):
            cand = tl.max(tl.where(offs_n[None, :] == i, b_maxn, float("-inf")), axis=1)
            vals, ids = _insert(vals, ids, cand, c * NBT + i)
    return vals, ids


@triton.jit
def _write_selection(
    out_ptr, grow, row_ok, nf, last, kept_ids, n_kept, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, KP: tl.constexpr
):
    """Row layout: forced ids L, L-1, .. (nf of them), the n_kept kept ids, -1."""
    offs_t = tl.arange(0, TOPK_P2)
    offs_p = tl.arange(0, KP)
    p_o = out_ptr + grow.to(tl.int64)[:, None] * TOPK  # [BM, 1]
    forced = offs_t[None, :] < nf[:, None]
    tl.store(p_o + offs_t[None, :], last[:, None] - offs_t[None, :], mask=row_ok[:, None] & forced)
    tl.store(p_o + nf[:, None] + offs_p[None, :], kept_ids, mask=row_ok[:, None] & (offs_p[None, :] < n_kept[:, None]))
    pad = (offs_t[None, :] >= (nf + n_kept)[:, None]) & (offs_t[None, :] < TOPK)
    tl.store(p_o + offs_t[None, :], tl.full([1, TOPK_P2], -1, tl.int32), mask=row_ok[:, None] & pad)


@triton.jit(do_not_specialize=["stride_bt", "batch", "num_splits"])  # a width, counts (core.launch: specializations)
def _index_topk_kernel(
    q_ptr,
    k_ptr,
    ks_ptr,
    bt_ptr,
    cu_ptr,
    kvlen_ptr,
    out_ptr,
    ws_val_ptr,
    ws_id_ptr,
    stride_kp,
    stride_ks,
    stride_sp,
    stride_bt,
    batch,
    num_splits,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    LOCAL: tl.constexpr,
    NKEEP: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    CH: tl.constexpr,
    TPB: tl.constexpr,
    NBT: tl.constexpr,
    SAME_PAGE: tl.constexpr,
    BATCH_P2: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_SCALE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    K_CAST: tl.constexpr,
    KEY_MAJOR: tl.constexpr,
    FINAL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    seq, q_lo, nq, tile = _seq_of_tile(cu_ptr, pid, batch, H, BM, BATCH_P2)
    if seq >= batch:
        return
    kv_len = tl.load(kvlen_ptr + seq)

    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    r = tile * BM + offs_m  # row of this sequence: token * H + head
    row_ok = r < nq * H
    grow = q_lo * H + r
    pos = kv_len - nq + r // H
    pos_ok = row_ok & (pos >= 0)
    pos_c = tl.maximum(pos, 0)
    last = pos_c // BLOCK
    # Candidates are the blocks before the forced window; with LOCAL == 0 the
    # query's own block competes, cut at the query.
    cand_blocks = tl.maximum(last - LOCAL + 1, 0)
    cand_end = tl.where(pos_ok, tl.minimum(cand_blocks * BLOCK, pos_c + 1), 0)
    key_hi = tl.max(cand_end, 0)
    key_all = tl.min(tl.where(row_ok, cand_end, 2147483647), 0)

    n_chunks = (key_hi + CH - 1) // CH
    per_split = (n_chunks + num_splits - 1) // num_splits
    c0 = split * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    # Chunks below every row's candidate end need neither masks nor bounds.
    c_full = tl.maximum(tl.minimum(key_all // CH, c1), c0)

    p_q = q_ptr + grow.to(tl.int64)[:, None] * D + offs_d[None, :]
    b_q = tl.load(p_q, mask=row_ok[:, None], other=0.0)  # [BM, D]
    if FP8_DOT:
        # Per-row scale to the e4m3 range; it multiplies a whole row of scores,
        # so it never changes the row's ranking and is not applied back.
        b_qf = b_q.to(tl.float32)
        amax = tl.max(tl.abs(b_qf), axis=1)
        b_q = to_e4m3(b_qf * (448.0 / tl.maximum(amax, 1e-30))[:, None])
    if DOT_FP32:
        b_q = b_q.to(tl.float32)

    offs_p = tl.arange(0, KP)
    # Unused slots: -inf with distinct negative ids (so they fill in slot order
    # and the valid kept ids stay a prefix); slots past NKEEP: +inf, never evicted.
    vals = tl.where(offs_p[None, :] < NKEEP, float("-inf"), float("inf")) + tl.zeros([BM, KP], tl.float32)
    ids = (-1 - offs_p)[None, :] + tl.zeros([BM, KP], tl.int32)

    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    for c in range(c0, c_full):
        vals, ids = _score_chunk(
            vals, ids, b_q, k_ptr, ks_ptr, bt_row_ptr, c, key_hi, cand_end, stride_kp, stride_ks, stride_sp, offs_d,
            BM, BK, CH, TPB, NBT, BLOCK, PAGE, SAME_PAGE, False, DOT_FP32, K_SCALE, K_CAST, KEY_MAJOR,
        )
    for c in range(c_full, c1):
        vals, ids = _score_chunk(
            vals, ids, b_q, k_ptr, ks_ptr, bt_row_ptr, c, key_hi, cand_end, stride_kp, stride_ks, stride_sp, offs_d,
            BM, BK, CH, TPB, NBT, BLOCK, PAGE, SAME_PAGE, True, DOT_FP32, K_SCALE, K_CAST, KEY_MAJOR,
        )

    if FINAL:
        nf = tl.where(pos_ok, tl.minimum(last + 1, LOCAL), 0)
        n_kept = tl.sum(((vals > float("-inf")) & (offs_p[None, :] < NKEEP)).to(tl.int32), axis=1)
        _write_selection(out_ptr, grow, row_ok, nf, last, ids, n_kept, TOPK, TOPK_P2, KP)
    else:
        p_w = (grow.to(tl.int64) * num_splits + split)[:, None] * KP + offs_p[None, :]
        w_ok = row_ok[:, None] & (offs_p[None, :] < NKEEP)
        tl.store(ws_val_ptr + p_w, vals, mask=w_ok)
        tl.store(ws_id_ptr + p_w, ids, mask=w_ok)


@triton.jit(do_not_specialize=["total_rows", "batch", "num_splits"])  # counts (core.launch: specializations)
def _merge_kernel(
    ws_val_ptr,
    ws_id_ptr,
    out_ptr,
    cu_ptr,
    kvlen_ptr,
    total_rows,
    batch,
    num_splits,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    LOCAL: tl.constexpr,
    NKEEP: tl.constexpr,
    KP: tl.constexpr,
    NC: tl.constexpr,
    RB: tl.constexpr,
    BATCH_P2: tl.constexpr,
):
    """Per row: best NKEEP of the splits' kept lists (score desc, id asc), then the
    final row layout."""
    pid = tl.program_id(0)
    grow = pid * RB + tl.arange(0, RB)
    row_ok = grow < total_rows
    tok = grow // H
    offs_b = tl.arange(0, BATCH_P2)
    cu_hi = tl.load(cu_ptr + offs_b + 1, mask=offs_b < batch, other=2147483647)
    seq = tl.minimum(tl.sum((cu_hi[None, :] <= tok[:, None]).to(tl.int32), axis=1), batch - 1)  # [RB]
    q_lo = tl.load(cu_ptr + seq)
    q_hi = tl.load(cu_ptr + seq + 1)
    kv_len = tl.load(kvlen_ptr + seq)
    pos = kv_len - (q_hi - q_lo) + (tok - q_lo)
    pos_ok = row_ok & (pos >= 0)
    last = tl.maximum(pos, 0) // BLOCK
    nf = tl.where(pos_ok, tl.minimum(last + 1, LOCAL), 0)

    offs_c = tl.arange(0, NC)  # split * KP + slot
    c_ok = row_ok[:, None] & ((offs_c // KP) < num_splits)[None, :] & ((offs_c % KP) < NKEEP)[None, :]
    p_w = grow.to(tl.int64)[:, None] * num_splits * KP + offs_c[None, :]
    vals = tl.load(ws_val_ptr + p_w, mask=c_ok, other=float("-inf"))  # [RB, NC]
    ids = tl.load(ws_id_ptr + p_w, mask=c_ok, other=0)
    # Empty slots of a split hold -inf; they must never be chosen.
    vals = tl.where(vals > float("-inf"), vals, float("-inf"))

    offs_p = tl.arange(0, KP)
    kept = tl.full([RB, KP], -1, tl.int32)
    n_kept = tl.zeros([RB], tl.int32)
    for i in tl.static_range(NKEEP):
        best = tl.max(vals, axis=1)
        best_id = tl.min(tl.where(vals == best[:, None], ids, 2147483647), axis=1)
        ok = best > float("-inf")
        kept = tl.where((offs_p[None, :] == i) & ok[:, None], best_id[:, None], kept)
        n_kept += ok.to(tl.int32)
        vals = tl.where(ids == best_id[:, None], float("-inf"), vals)
    _write_selection(out_ptr, grow, row_ok, nf, last, kept, n_kept, TOPK, TOPK_P2, KP)


def _split_lists(size: int, device) -> tuple:
    """The splits' top lists, (scores, ids) of ``size`` entries: made from plain values, so
    a launch dropped after an op call frees them at once (no reference cycle)."""
    return (torch.empty(size, dtype=torch.float32, device=device), torch.empty(size, dtype=torch.int32, device=device))


class TopkLaunch:
    """The tl kernel's launch (and the split merge's) for one planned call, set up once: the
    metadata as the kernels read it and their constants. :meth:`run` launches it for index
    queries and a key pool of the call's shapes and dtypes (each sparse layer of a decode
    step has its own pool and makes the same call)."""

    def __init__(self, args: IndexArgs, p: IndexPlan, cfg: IndexConfig = DEFAULT_CONFIG):
        self.args, self.plan = args, p
        num_tokens, heads, dim = args.index_q.shape
        batch = args.used_kv_lens.shape[0]
        self.empty = num_tokens == 0 or batch == 0
        _, _, _, self.block_tables, self.cu_seqlens_q, self.used_kv_lens = metadata(args)
        topk, local_blocks = args.topk, args.local_blocks
        nkeep = topk - local_blocks
        kp = next_pow2(max(nkeep, 1))
        self.ws_size = num_tokens * heads * p.num_splits * kp
        # Measured on the H200 (docs/PERF.md, index branch): one warpgroup per 128-row tile
        # with a 2-deep key pipeline beat 8 warps / 3 stages in prefill.
        num_warps = cfg.num_warps or 4
        num_stages = cfg.num_stages or (2 if p.bm >= 128 else KEY_MAJOR_STAGES if p.key_major and args.fp8_dot else 3)
        batch_p2 = seq_block(batch + 1)  # core.launch: specializations
        # The interpreter takes no register cap.
        extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}
        page = args.index_k_cache.shape[1]
        self.ints = (batch, p.num_splits)
        self.constants = dict(
            H=heads, D=dim, BLOCK=args.block_size, PAGE=page,
            TOPK=topk, TOPK_P2=next_pow2(topk), LOCAL=local_blocks, NKEEP=nkeep, KP=kp,
            BM=p.bm, BK=p.bk, CH=p.ch, TPB=p.ch // p.bk, NBT=p.ch // args.block_size, SAME_PAGE=page % p.bk == 0,
            BATCH_P2=batch_p2, DOT_FP32=p.dot_fp32, K_SCALE=args.token_scales,
            FP8_DOT=bool(args.fp8 and args.fp8_dot), K_CAST=p.k_cast, KEY_MAJOR=p.key_major, FINAL=p.final,
            num_warps=num_warps, num_stages=num_stages, **extra,
        )
        if not p.final:
            # The splits' top lists (scores, ids), reused from run to run.
            self.scratch = StreamBuffers(functools.partial(_split_lists, self.ws_size))
            total_rows = num_tokens * heads
            nc = next_pow2(p.num_splits) * kp
            # Few rows per program: the merge is a chain of dependent reductions, so
            # its time is latency, and more programs hide more of it.
            rb = max(1, min(16, 1024 // nc))
            self.merge_grid = (triton.cdiv(total_rows, rb),)
            self.merge_ints = (total_rows, batch, p.num_splits)
            self.merge_constants = dict(
                H=heads, BLOCK=args.block_size, TOPK=topk, TOPK_P2=next_pow2(topk), LOCAL=local_blocks, NKEEP=nkeep,
                KP=kp, NC=nc, RB=rb, BATCH_P2=batch_p2, num_warps=4,
            )

    def run(self, index_q: torch.Tensor, index_k_cache: torch.Tensor, index_k_scale=None) -> torch.Tensor:
        """``selected`` of the planned call with these tensors (the caller's shapes and dtypes
        are the planned call's: ``api.PlannedIndexTopk`` checks them)."""
        args, p = self.args, self.plan
        num_tokens, heads, _ = index_q.shape
        device = index_q.device
        out = torch.empty(num_tokens, heads, args.topk, dtype=torch.int32, device=device)
        if self.empty:
            return out
        q = index_q.contiguous()
        k = index_k_cache if index_k_cache.stride(2) == 1 else index_k_cache.contiguous()
        scale = index_k_scale if self.constants["K_SCALE"] else None
        if scale is not None and scale.stride(1) != 1:
            scale = scale.contiguous()
        if p.final:
            ws_val = ws_id = out
        else:
            ws_val, ws_id = self.scratch.get(device)
        bt, cu, kv = self.block_tables, self.cu_seqlens_q, self.used_kv_lens
        scale_t = scale if scale is not None else k  # a placeholder pointer when unused
        launch_kernel(
            _index_topk_kernel, (p.tiles, p.num_splits),
            q, k, scale_t, bt, cu, kv, out, ws_val, ws_id,
            k.stride(0), k.stride(1), scale_t.stride(0), bt.stride(0),
            *self.ints,
            **self.constants,
        )
        if not p.final:
            launch_kernel(_merge_kernel, self.merge_grid, ws_val, ws_id, out, cu, kv, *self.merge_ints,
                          **self.merge_constants)
        return out
