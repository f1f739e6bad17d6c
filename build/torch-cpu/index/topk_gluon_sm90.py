"""Index branch prefill on Hopper (sm_90): score + block max + top-k in Gluon, with the next
key tile's MMA running under the current tile's epilogue.

Same contract as the tl kernel (``topk_triton.TopkLaunch``) on the calls ``unsupported_reason``
accepts (the ``tl`` kernel serves every other call and is the reference of this one).

Why a second kernel: the ``tl`` kernel waits on each key tile's MMA before its block max
and top-k insert, so a program alternates between the tensor cores and the epilogue and
only the multiprocessor's second program fills the gaps (docs/PERF.md, index branch,
"What limits it"). Here one program of two warpgroups owns a 128-row tile (32 tokens x 4
heads; each warpgroup 64 rows) and:

* streams the key tiles (one block of 128 keys, one or two TMA boxes of the paged cache)
  through an NS-deep shared-memory ring;
* issues tile c + 1's Q K^T asynchronously before tile c's max and insert, and waits on
  it only after them: two accumulators per warpgroup (64 registers each);
* keeps the running top-(topk - local) per row in a layout whose rows sit where the MMA's
  rows sit, so the block max reaches the insert without a trip through shared memory.

fp8 keys with ``fp8_dot`` (the query rows quantized to e4m3 in the kernel, one positive
factor per row that is never applied back) or bf16 / fp16 queries and keys of one dtype;
one split (prefill: enough row tiles to fill the GPU). Per-token fp8 key scales (pages of 128)
ride with their key tile (one more TMA box of 512 bytes) and multiply each score column
before the block max, as in the tl kernel; a per-tensor scale is never read.

On the H200 it beats the tl kernel only with fp8 keys under one scale (4-7%); with bf16 keys
the MMA alone takes as long as the whole tl kernel, and per-token scales lengthen the
epilogue it overlaps (docs/PERF.md, "Gluon index kernel for sm_90"). The launcher's
``engine="auto"`` takes it for that case alone.
"""

from __future__ import annotations

import torch

from ..core.gluon import HAVE_GLUON, TESTED_TRITON, device_reason, triton_version  # noqa: F401

if HAVE_GLUON:
    from ..core.gluon import TensorDescriptor, gl, gluon, mbarrier, tma
    from ..core.gluon import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from ..core.gluon import sync_threads as _sync_threads

from ..core.args import IndexArgs
from ..core.launch import launch_kernel
from .plan import metadata

BM = 128
BK = 128
NUM_WARPS = 8
# Key ring depth: chunk c + NS - 1 is copied while chunk c's epilogue and chunk c + 1's MMA
# run, so NS - 2 tiles of lead hide the copy's latency (3, 4 and 5 stages timed alike on the
# H200 at 128K: docs/PERF.md).
STAGES = 4


def unsupported_reason(index_q, index_k_cache, *, block_size, fp8_dot, token_scales, bm, num_splits, key_major):
    """None when this kernel runs the call, else why not. ``token_scales``: the per-token
    key scales ``[pages, page_size]`` (unit last stride) or None."""
    fp8 = torch.float8_e4m3fn
    k = index_k_cache
    if k.dtype == fp8:
        if not fp8_dot:
            return "fp8 keys need fp8_dot"
        if token_scales is not None:
            if k.shape[1] < BK:
                return f"per-token key scales need pages of at least {BK} keys"
            # They are read as TMA boxes: 16-byte aligned base and rows.
            if token_scales.data_ptr() % 16 or (token_scales.stride(0) * 4) % 16:
                return "per-token key scales with a 16-byte aligned start and rows"
        if index_q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"fp8_dot quantizes float queries, got {index_q.dtype}"
    elif k.dtype not in (torch.bfloat16, torch.float16) or index_q.dtype != k.dtype:
        return f"bf16 or fp16 queries and keys of one dtype, got {index_q.dtype} / {k.dtype}"
    if num_splits != 1 or bm != BM or key_major:
        return "prefill only: 128-row tiles, one split"
    if block_size != BK:
        return f"blocks of {BK} keys, got {block_size}"
    page = k.shape[1]
    if page not in (64, 128):
        return f"pages of 64 or 128 keys, got {page}"
    if index_q.shape[2] not in (64, 128):
        return f"index head dim 64 or 128, got {index_q.shape[2]}"
    if k.shape[0] * page >= 2**31:
        return "more than 2^31 key rows"
    if not k.is_contiguous() or k.data_ptr() % 16:
        return "a contiguous, 16-byte aligned index key cache"
    return device_reason(k)


if HAVE_GLUON:

    @gluon.jit
    def _insert(vals, ids, cand, cid):
        """Offer block ``cid`` (above every kept id) with score ``cand`` [BM] to each row's
        kept list; ties to the lower id (the same rule as the tl kernel)."""
        worst_val = gl.min(vals, axis=1)
        worst_id = gl.max(gl.where(vals == worst_val[:, None], ids, -2147483647), axis=1)
        hit = (ids == worst_id[:, None]) & (cand > worst_val)[:, None]
        vals = gl.where(hit, cand[:, None], vals)
        ids = gl.where(hit, cid, ids)
        return vals, ids

    @gluon.jit
    def _issue_k(k_desc, k_slot, ks_desc, ks_slot, bar, bt_row_ptr, c, kv_len, live,
                 BLOCK: gl.constexpr, PAGE: gl.constexpr, PB: gl.constexpr, D: gl.constexpr, K_SCALE: gl.constexpr):
        """TMA copies of key chunk ``c`` (one block) into a ring slot: one box per page it
        spans, and with per-token scales the chunk's scales (PAGE >= BLOCK: one box). A page
        past the sequence reads page 0; its keys are masked by the caller."""
        nbytes: gl.constexpr = BLOCK * D * k_desc.dtype.primitive_bitwidth // 8 + BLOCK * 4 * K_SCALE
        mbarrier.expect(bar, nbytes, pred=live)
        for p in gl.static_range(BLOCK // PB):
            k_pos = c * BLOCK + p * PB
            page = gl.load(bt_row_ptr + k_pos // PAGE, mask=live & (k_pos < kv_len), other=0).to(gl.int32)
            page = gl.where(page < 0, 0, page)
            tma.async_copy_global_to_shared(k_desc, [page * PAGE + k_pos % PAGE, 0], bar, k_slot.slice(p * PB, PB),
                                            pred=live)
            if K_SCALE:
                tma.async_copy_global_to_shared(ks_desc, [page, k_pos % PAGE], bar, ks_slot, pred=live)

    @gluon.jit
    def _issue_mma(q_smem, k_smem, k_bars, zero, c, n_chunks, NS: gl.constexpr):
        """Chunk c's Q K^T, asynchronous; past the last chunk it runs on a stale slot and its
        result is never used (no copy is in flight there, nothing is waited for)."""
        slot = c % NS
        mbarrier.wait(k_bars.index(slot), (c // NS) & 1, pred=c < n_chunks)
        return warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _refill(k_desc, k_smem, ks_desc, ks_smem, k_bars, bt_row_ptr, fill, kv_len, n_chunks,
                BLOCK: gl.constexpr, PAGE: gl.constexpr, PB: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
                K_SCALE: gl.constexpr):
        """Chunk ``fill``'s copy into the slot of chunk fill - NS, whose MMA and scale reads
        every warp has finished (the barrier makes sure of the other warpgroup)."""
        _sync_threads()
        slot = fill % NS
        _issue_k(k_desc, k_smem.index(slot), ks_desc, ks_smem.index(slot), k_bars.index(slot), bt_row_ptr, fill,
                 kv_len, fill < n_chunks, BLOCK, PAGE, PB, D, K_SCALE)

    @gluon.jit
    def _epilogue(b_s, ks_smem, vals, ids, c, c_full, cand_end, offs_n, krow_layout: gl.constexpr,
                  BLOCK: gl.constexpr, NS: gl.constexpr, K_SCALE: gl.constexpr):
        """Chunk c's block max per row (scores times the keys' scales, keys past a row's
        bound masked in the tail chunks) offered to the kept lists."""
        if K_SCALE:
            # Read as a [1, BLOCK] tile in the scores' own layout: summing its single row gives
            # the scales where the score columns are, with no layout conversion.
            b_ks = gl.sum(ks_smem.index(c % NS).load(b_s.type.layout), axis=0)  # [BLOCK]
            b_s = b_s * b_ks[None, :]
        if c >= c_full:
            k_pos = c * BLOCK + offs_n
            b_s = gl.where(k_pos[None, :] < cand_end[:, None], b_s, float("-inf"))
        b_max = gl.convert_layout(gl.max(b_s, axis=1), krow_layout)  # [BM]
        return _insert(vals, ids, b_max, c)

    @gluon.jit(do_not_specialize=["stride_bt", "batch"])  # a width, a count (core.launch: specializations)
    def _index_topk_tma_kernel(
        q_ptr, k_desc, ks_desc, bt_ptr, cu_ptr, kvlen_ptr, out_ptr,
        stride_bt, batch,
        H: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr, PAGE: gl.constexpr, PB: gl.constexpr,
        TOPK: gl.constexpr, TOPK_P2: gl.constexpr, LOCAL: gl.constexpr, NKEEP: gl.constexpr, KP: gl.constexpr,
        BM: gl.constexpr, FP8_DOT: gl.constexpr, NS: gl.constexpr, K_SCALE: gl.constexpr,
    ):
        # Chunk c + 1's MMA reads its slot while chunk c + NS - 1 is copied: three slots at least.
        gl.static_assert(NS >= 3, "the key ring needs at least three slots")
        pid = gl.program_id(0)
        kt: gl.constexpr = k_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK, 256 // kt.primitive_bitwidth]
        )
        # The kept lists: rows where the scores' rows are (a reduction of the scores over keys
        # lands in this layout's row slice), KP slots spread over the 4 threads of a row quad.
        kp_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, KP, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        krow_layout: gl.constexpr = gl.SliceLayout(1, kp_layout)
        kcol_layout: gl.constexpr = gl.SliceLayout(0, kp_layout)
        q_reg_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

        # Tile -> (sequence, its first token, its token count, tile of the sequence): tiles
        # never straddle sequences; a sequence's tiles run last-rows-first (longest first).
        seq = batch
        q_lo = 0
        nq = 0
        tile = 0
        t_acc = 0
        for b in range(batch):
            lo = gl.load(cu_ptr + b)
            hi = gl.load(cu_ptr + b + 1)
            nt = ((hi - lo) * H + BM - 1) // BM
            here = (pid >= t_acc) & (pid < t_acc + nt)
            seq = gl.where(here, b, seq)
            q_lo = gl.where(here, lo, q_lo)
            nq = gl.where(here, hi - lo, nq)
            tile = gl.where(here, t_acc + nt - 1 - pid, tile)
            t_acc += nt
        if seq >= batch:
            return
        kv_len = gl.load(kvlen_ptr + seq)

        # Query rows, quantized to e4m3 per row for the fp8 MMA (a positive factor per row
        # does not change the row's ranking), staged in shared memory once.
        offs_qm = gl.arange(0, BM, layout=gl.SliceLayout(1, q_reg_layout))
        offs_qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_reg_layout))
        q_rows = tile * BM + offs_qm
        q_ok = q_rows < nq * H
        p_q = q_ptr + (q_lo * H + q_rows).to(gl.int64)[:, None] * D + offs_qd[None, :]
        b_q = gl.load(p_q, mask=q_ok[:, None], other=0.0)  # [BM, D]
        if FP8_DOT:
            b_qf = b_q.to(gl.float32)
            amax = gl.max(gl.abs(b_qf), axis=1)
            b_q = (b_qf * (448.0 / gl.maximum(amax, 1e-30))[:, None]).to(kt)
        q_smem = gl.allocate_shared_memory(kt, [BM, D], k_desc.layout)  # the keys' swizzle: same dtype and D
        q_smem.store(b_q)
        k_smem = gl.allocate_shared_memory(kt, [NS, BLOCK, D], k_desc.layout)
        if K_SCALE:
            ks_smem = gl.allocate_shared_memory(gl.float32, [NS, 1, BLOCK], ks_desc.layout)
        else:
            ks_smem = k_smem  # never read
        k_bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(k_bars.index(s), count=1)
        fence_async_shared()
        _sync_threads()

        offs_m = gl.arange(0, BM, layout=row_layout)
        offs_n = gl.arange(0, BLOCK, layout=col_layout)
        r = tile * BM + offs_m
        row_ok = r < nq * H
        pos = kv_len - nq + r // H
        pos_ok = row_ok & (pos >= 0)
        pos_c = gl.maximum(pos, 0)
        last = pos_c // BLOCK
        cand_blocks = gl.maximum(last - LOCAL + 1, 0)
        cand_end = gl.where(pos_ok, gl.minimum(cand_blocks * BLOCK, pos_c + 1), 0)  # [BM] key bound
        key_hi = gl.max(cand_end, axis=0)
        key_all = gl.min(gl.where(row_ok, cand_end, 2147483647), axis=0)
        n_chunks = (key_hi + BLOCK - 1) // BLOCK
        c_full = gl.minimum(key_all // BLOCK, n_chunks)  # chunks below every row's bound: no mask

        offs_p = gl.arange(0, KP, layout=kcol_layout)
        vals = gl.where(offs_p[None, :] < NKEEP, float("-inf"), float("inf")) + gl.zeros([BM, KP], gl.float32, kp_layout)
        ids = (-1 - offs_p)[None, :] + gl.zeros([BM, KP], gl.int32, kp_layout)

        bt_row_ptr = bt_ptr + seq.to(gl.int64) * stride_bt
        for s in gl.static_range(NS - 1):
            _issue_k(k_desc, k_smem.index(s), ks_desc, ks_smem.index(s), k_bars.index(s), bt_row_ptr, s, kv_len,
                     s < n_chunks, BLOCK, PAGE, PB, D, K_SCALE)
        zero = gl.zeros([BM, BLOCK], gl.float32, s_layout)
        mbarrier.wait(k_bars.index(0), 0, pred=n_chunks > 0)
        b_s0 = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        b_s0 = warpgroup_mma_wait(0, deps=[b_s0])
        # Unrolled by two so that the two accumulators swap roles without register copies:
        # chunk c's scores (b_s0) are in hand at the top; chunk c + 1's MMA runs under their
        # max and insert, then chunk c + 2's under chunk c + 1's.
        for c in range(0, n_chunks, 2):
            s_acc = _issue_mma(q_smem, k_smem, k_bars, zero, c + 1, n_chunks, NS)
            _refill(k_desc, k_smem, ks_desc, ks_smem, k_bars, bt_row_ptr, c + NS - 1, kv_len, n_chunks, BLOCK, PAGE,
                    PB, D, NS, K_SCALE)
            # Always true here; the branch keeps the compiler from hoisting the wait below
            # above the max and insert (it does so within one basic block).
            if c * BLOCK < key_hi:
                vals, ids = _epilogue(b_s0, ks_smem, vals, ids, c, c_full, cand_end, offs_n, krow_layout, BLOCK, NS,
                                      K_SCALE)
            b_s1 = warpgroup_mma_wait(0, deps=[s_acc])
            s_acc = _issue_mma(q_smem, k_smem, k_bars, zero, c + 2, n_chunks, NS)
            _refill(k_desc, k_smem, ks_desc, ks_smem, k_bars, bt_row_ptr, c + NS, kv_len, n_chunks, BLOCK, PAGE, PB,
                    D, NS, K_SCALE)
            if c + 1 < n_chunks:
                vals, ids = _epilogue(b_s1, ks_smem, vals, ids, c + 1, c_full, cand_end, offs_n, krow_layout, BLOCK,
                                      NS, K_SCALE)
            b_s0 = warpgroup_mma_wait(0, deps=[s_acc])
        for s in gl.static_range(NS):
            mbarrier.invalidate(k_bars.index(s))

        # Row layout: forced ids L, L-1, .. (nf of them), the kept ids, then -1.
        offs_km = gl.arange(0, BM, layout=krow_layout)
        rk = tile * BM + offs_km
        rk_ok = rk < nq * H
        pos_k = kv_len - nq + rk // H
        pk_ok = rk_ok & (pos_k >= 0)
        last_k = gl.maximum(pos_k, 0) // BLOCK
        nf = gl.where(pk_ok, gl.minimum(last_k + 1, LOCAL), 0)
        n_kept = gl.sum(((vals > float("-inf")) & (offs_p[None, :] < NKEEP)).to(gl.int32), axis=1)
        p_o = out_ptr + (q_lo * H + rk).to(gl.int64)[:, None] * TOPK  # [BM, 1]
        offs_t = gl.arange(0, TOPK_P2, layout=kcol_layout)
        forced = offs_t[None, :] < nf[:, None]
        gl.store(p_o + offs_t[None, :], last_k[:, None] - offs_t[None, :], mask=rk_ok[:, None] & forced)
        gl.store(p_o + nf[:, None] + offs_p[None, :], ids,
                 mask=rk_ok[:, None] & (offs_p[None, :] < n_kept[:, None]))
        pad = (offs_t[None, :] >= (nf + n_kept)[:, None]) & (offs_t[None, :] < TOPK)
        gl.store(p_o + offs_t[None, :], gl.full([BM, TOPK_P2], -1, gl.int32, kp_layout), mask=rk_ok[:, None] & pad)


def list_widths(topk, local_blocks):
    """(kept blocks per row, padded kept-list width, padded output width). The kept lists and
    the output rows use the MMA-like layout, whose column tile (the wgmma N) is at least 8:
    shorter lists get slots that never take a block."""
    nkeep = topk - local_blocks
    return nkeep, max(8, 1 << max(0, nkeep - 1).bit_length()), max(8, 1 << max(0, topk - 1).bit_length())


def index_topk_tma(args: IndexArgs, num_stages: int | None = None) -> torch.Tensor:
    """``selected [Tq, H, topk]`` of a call ``unsupported_reason`` accepted."""
    index_q, index_k_cache, token_scales, block_tables, cu_seqlens_q, used_kv_lens = metadata(args)
    topk, block_size, local_blocks, fp8_dot = args.topk, args.block_size, args.local_blocks, args.fp8_dot
    out = torch.empty(index_q.shape[0], index_q.shape[1], topk, dtype=torch.int32, device=index_q.device)
    num_tokens, heads, dim = index_q.shape
    pages, page_size, _ = index_k_cache.shape
    batch = used_kv_lens.shape[0]
    kt = index_k_cache.dtype
    bits = torch.finfo(kt).bits
    layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, dim * bits // 8), element_bitwidth=bits, rank=2)
    pb = min(block_size, page_size)
    k2 = index_k_cache.view(pages * page_size, dim)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [pb, dim], layout)
    if token_scales is not None:
        # [pages, page_size] fp32, one box of a chunk's BLOCK scales (pages hold whole blocks).
        s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        ks_desc = TensorDescriptor(token_scales, list(token_scales.shape), list(token_scales.stride()),
                                   [1, block_size], s_layout)
    else:
        ks_desc = k_desc
    nkeep, kp, topk_p2 = list_widths(topk, local_blocks)
    tiles = (num_tokens * heads) // BM + batch
    launch_kernel(
        _index_topk_tma_kernel, (tiles,), index_q, k_desc, ks_desc, block_tables, cu_seqlens_q, used_kv_lens, out,
        block_tables.stride(0), batch,
        H=heads, D=dim, BLOCK=block_size, PAGE=page_size, PB=pb,
        TOPK=topk, TOPK_P2=topk_p2, LOCAL=local_blocks, NKEEP=nkeep, KP=kp,
        BM=BM, FP8_DOT=bool(fp8_dot), NS=num_stages or STAGES, K_SCALE=token_scales is not None,
        num_warps=NUM_WARPS,
    )
    return out
