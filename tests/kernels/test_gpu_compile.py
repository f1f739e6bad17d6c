"""Every Triton kernel of the package compiles for the GPU, without one: Triton's
ahead-of-time compiler lowers each kernel for Hopper (sm_90) and Blackwell (sm_100) from a
signature, down to PTX, on the CPU. The interpreter runs the kernels' semantics in CI; this
catches what only the GPU compiler rejects (types, layouts, MMA shapes such as an fp8 dot's
depth). The decode kernel's variants are also compiled in test_triton_decode.py (sm_90, with
a check that its K/V loads are software-pipelined).

Each configuration is the one the launcher picks for M3 (or a named edge), with pointer
types as the launcher passes them.
"""

from __future__ import annotations

import json

import pytest

from kernel_test_utils import aot_compile

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
arch, shard, shards = (int(x) for x in sys.argv[2:5])
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from m3_sparse.core import split_merge
from m3_sparse.kvouter import combine_triton as tcomb
from m3_sparse.decode import attention_triton as tdec
from m3_sparse.dense import attention_triton as tda
from m3_sparse.dense import plan as dplan
from m3_sparse.index import topk_triton as tix
from m3_sparse.index import plan as iplan
from m3_sparse.kvouter import partials_triton as tkv
from m3_sparse.kvouter import build_triton as tidx
from m3_sparse.kvouter import schedule_triton as tsched

FLOATS = {"qk_scale"}

def build(kernel, constexprs, pointers, num_warps=4, num_stages=2):
    names = list(kernel.arg_names)
    missing = [n for n in names if n.isupper() and n not in constexprs]
    if missing:
        raise ValueError(f"constexprs not given: {missing}")
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if pointers.get(n, "").startswith("*")}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})

I32 = "*i32"

def index_builder(k, topk, chunk=None, key64=False):
    cx = dict(C=chunk or 512 // topk, TK=topk, BB=2, UNROLL=topk <= tidx.UNROLL_TOPK)
    if k is tidx._chunk_rank_kernel:
        cx["KEY64"] = key64
    ptrs = {"sel_ptr": I32, "cu_ptr": I32, "slot_ptr": I32, "cnt_ptr": I32, "tot_ptr": I32,
            "seg_off_ptr": I32, "e_tok_ptr": I32, "e_rank_ptr": I32, "e_seg_ptr": I32}
    if k is tidx._chunk_scan_kernel:
        cx = dict(C=512 // topk, BB=2, BLK=tidx.SCAN_BLOCKS, U=tidx.SCAN_CHUNKS)
    return build(k, cx, ptrs)

def partials(dtype="bf16", kv="bf16", po="bf16", pv=None, **kw):
    # pv: the dtype P @ V runs in (the partials' unless they are e4m3).
    dts = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    cx = dict(G=16, GP=16, TQ=4, D=128, BD=128, BS=128, PS=64, CAUSAL=True, PREC=None,
              FILL=64, Q_FP8=False, KV_FP8=False, WIDEN_K=False, PV_DT=dts[pv or po], NORM=False)
    cx.update(kw)
    ptrs = {n: I32 for n in ("bt_ptr", "cu_ptr", "kvlen_ptr", "entry_token_ptr", "seg_offsets_ptr", "tile_seg_ptr",
                             "tile_start_ptr", "tile_end_ptr", "prog_tiles_ptr")}
    ptrs.update(q_ptr="*" + dtype, k_ptr="*" + kv, v_ptr="*" + kv, po_ptr="*" + po, pm_ptr="*fp32", pl_ptr="*fp32",
                scale_ptr="*fp32")
    return build(tkv._kvouter_partials_kernel, cx, ptrs, num_warps=4, num_stages=2)

def dense(dtype="bf16", kv="bf16", out="bf16", final=True, **kw):
    dts = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    # The launcher's prefill tile for q's dtype.
    block_m = dplan.default_block_m(tda.torch.float32 if dtype == "fp32" else tda.torch.bfloat16)
    cx = dict(G=16, GP=16, TM=block_m // 16, D=128, BD=128, BN=dplan.BLOCK_N, PS=64, CAUSAL=True, RETURN_LSE=True,
              SEARCH_STEPS=5, PREC=None, FINAL=final, Q_FP8=False, KV_FP8=False, WIDEN_K=False, PV_DT=dts[out],
              HKV=4, TMA=True)
    cx.update(kw)
    ptrs = {n: I32 for n in ("bt_ptr", "cu_ptr", "kvlen_ptr")}
    ptrs.update(q_ptr="*" + dtype, k_ptr="*" + kv, v_ptr="*" + kv, scale_ptr="*fp32")
    # K/V tiles as TMA boxes of the caches seen as [rows, D]; without, the launcher passes the caches.
    box = f"tensordesc<{kv}[{cx['BN']}, {cx['BD']}]>" if cx["TMA"] else "*" + kv
    ptrs.update(k_desc=box, v_desc=box)
    ptrs.update(o_ptr="*" + out if final else "*fp32", lse_ptr="*fp32", l_ptr="*" + out if final else "*fp32")
    return build(tda._dense_paged_attn_kernel, cx, ptrs, num_warps=dplan.default_num_warps(cx["TM"] * cx["GP"], cx["BD"]))

def index_topk(q="bf16", k="bf16", final=True, **kw):
    cx = dict(H=4, D=128, BLOCK=128, PAGE=128, TOPK=16, TOPK_P2=16, LOCAL=1, NKEEP=15, KP=16, BM=iplan.PREFILL_BM,
              BK=128, CH=128, TPB=1, NBT=1, SAME_PAGE=True, BATCH_P2=2, DOT_FP32=False, K_SCALE=False, FP8_DOT=False,
              K_CAST=False, KEY_MAJOR=False, FINAL=final)
    cx.update(kw)
    ptrs = {n: I32 for n in ("bt_ptr", "cu_ptr", "kvlen_ptr", "out_ptr", "ws_id_ptr")}
    ptrs.update(q_ptr="*" + q, k_ptr="*" + k, ks_ptr="*fp32" if cx["K_SCALE"] else "*" + k,
                ws_val_ptr=I32 if final else "*fp32")
    return build(tix._index_topk_kernel, cx, ptrs, num_warps=4, num_stages=2 if cx["BM"] >= 128 else 3)

def decode(q="bf16", kv="bf16", final=False, **kw):
    dts = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    cx = dict(G=16, RP=16, D=128, BD=128, BS=128, BN=64, PS=128, TOPK_P2=16, CAUSAL=True, FINAL=final,
              RETURN_LSE=True, SEQ_CHUNK=32, SEQ_STEPS=1, PREC=None, Q_FP8=False, KV_FP8=False,
              WIDEN_K=False, PV_DT=tl.bfloat16, MERGE=not final)
    cx.update(kw)
    ptrs = {n: I32 for n in ("sel_ptr", "bt_ptr", "cu_ptr", "kvlen_ptr", "cnt_ptr")}
    ptrs.update(q_ptr="*" + q, k_ptr="*" + kv, v_ptr="*" + kv, scale_ptr="*fp32",
                o_ptr="*bf16" if final else "*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32")
    return build(tdec._decode_split_kernel, cx, ptrs, num_warps=4, num_stages=3)

F8 = "fp8e4nv"
cases = {
    "index top-k prefill": lambda: index_topk(),
    "index top-k decode split": lambda: index_topk(BM=16, final=False, BATCH_P2=64),
    "index top-k fp8 keys, fp8 dot": lambda: index_topk(k=F8, K_SCALE=True, FP8_DOT=True),
    "index top-k fp8 keys, per-tensor scale, fp8 dot": lambda: index_topk(k=F8, FP8_DOT=True),
    "index top-k fp8 keys, per-tensor scale, widened": lambda: index_topk(k=F8, BM=16, K_CAST=True, final=False),
    "index top-k fp8 keys, per-tensor scale, widened, key-major": lambda: index_topk(
        k=F8, BM=16, K_CAST=True, final=False, KEY_MAJOR=True),
    "index top-k fp8 keys, per-tensor scale, fp8 dot, key-major": lambda: index_topk(
        k=F8, BM=16, FP8_DOT=True, final=False, KEY_MAJOR=True),
    "index top-k fp8 keys, widened": lambda: index_topk(k=F8, BM=16, K_SCALE=True, K_CAST=True, final=False),
    "index top-k decode, key-major": lambda: index_topk(BM=16, final=False, BATCH_P2=64, KEY_MAJOR=True),
    "index top-k fp8 keys, widened, key-major": lambda: index_topk(k=F8, BM=16, K_SCALE=True, K_CAST=True, final=False,
                                                                   KEY_MAJOR=True),
    "index top-k fp8 keys, fp8 dot, key-major": lambda: index_topk(k=F8, BM=16, K_SCALE=True, FP8_DOT=True, final=False,
                                                                   KEY_MAJOR=True),
    "index merge": lambda: build(tix._merge_kernel, dict(H=4, BLOCK=128, TOPK=16, TOPK_P2=16, LOCAL=1, NKEEP=15,
                                                          KP=16, NC=128, RB=8, BATCH_P2=64),
                                 {"ws_val_ptr": "*fp32", "ws_id_ptr": I32, "out_ptr": I32, "cu_ptr": I32,
                                  "kvlen_ptr": I32}),
    "decode M3": lambda: decode(),
    "decode M3, merge in a second kernel": lambda: decode(MERGE=False),
    "decode fp8 q/K/V final": lambda: decode(F8, F8, final=True, Q_FP8=True, KV_FP8=True),
    "split merge": lambda: build(split_merge._merge_splits_kernel, dict(S=8, G=16, RB=8, D=128, BD=128, RETURN_LSE=True),
                                    {"o_ws_ptr": "*fp32", "m_ws_ptr": "*fp32", "l_ws_ptr": "*fp32",
                                     "out_ptr": "*bf16", "lse_ptr": "*fp32"}),
    "index rank topk16": lambda: index_builder(tidx._chunk_rank_kernel, 16),
    "index rank topk32": lambda: index_builder(tidx._chunk_rank_kernel, 32),
    "index rank, largest chunk": lambda: index_builder(tidx._chunk_rank_kernel, 16, tidx.MAX_CHUNK_ENTRIES // 16),
    "index rank, slots looped at run time": lambda: index_builder(tidx._chunk_rank_kernel, 128),
    "index rank, int64 sort keys": lambda: index_builder(tidx._chunk_rank_kernel, 16, key64=True),
    "index scan": lambda: index_builder(tidx._chunk_scan_kernel, 16),
    "index scatter": lambda: index_builder(tidx._scatter_kernel, 16),
    "index scatter, slots looped at run time": lambda: index_builder(tidx._scatter_kernel, 128),
    "scheduler": lambda: build(tsched._emit_tiles_kernel, dict(BT=128, BP=1024),
                               {n: I32 for n in ("seg_off_ptr", "tile_base_ptr", "tile_seg_ptr", "tile_start_ptr",
                                                 "tile_end_ptr", "num_tiles_ptr", "prog_ptr")}),
    "partials M3 bf16": lambda: partials(),
    "partials fp16 G3": lambda: partials("fp16", "fp16", "fp16", G=3, GP=4, TQ=16, D=64, BD=64, BS=64,
                                         PS=16, CAUSAL=False),
    "partials fp8 q/K/V": lambda: partials(F8, F8, "bf16", Q_FP8=True, KV_FP8=True),
    "partials fp8 K/V, bf16 q": lambda: partials("bf16", F8, "bf16", KV_FP8=True, WIDEN_K=True),
    "partials fp8 q/K/V D16 (padded tile)": lambda: partials(F8, F8, "fp16", D=16, BD=32, Q_FP8=True, KV_FP8=True),
    "partials fp8 K/V, fp32 q": lambda: partials("fp32", F8, "fp32", PREC="ieee", KV_FP8=True, WIDEN_K=True),
    "partials fp8 q/K/V, e4m3 partials": lambda: partials(F8, F8, F8, pv="bf16", Q_FP8=True, KV_FP8=True, NORM=True),
    "combine": lambda: build(tcomb._combine_kernel, dict(G=16, GP=16, TOPK=16, D=128, BD=128, BT=1, RETURN_LSE=True,
                                                         NORM=False, SCALE=False),
                             {"po_ptr": "*bf16", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "slot_ptr": I32,
                              "out_ptr": "*bf16", "lse_ptr": "*fp32", "scale_ptr": "*fp32"}),
    "combine, e4m3 partials": lambda: build(tcomb._combine_kernel, dict(G=16, GP=16, TOPK=16, D=128, BD=128, BT=1,
                                                                        RETURN_LSE=False, NORM=True, SCALE=True),
                                            {"po_ptr": "*" + F8, "pm_ptr": "*fp32", "pl_ptr": "*fp32", "slot_ptr": I32,
                                             "out_ptr": "*bf16", "lse_ptr": "*fp32", "scale_ptr": "*fp32"}),
    "dense prefill": lambda: dense(),
    "dense prefill, gathered K/V": lambda: dense(TMA=False),
    "dense decode split": lambda: dense(TM=1, final=False),
    "dense fp8 K/V split": lambda: dense("bf16", F8, TM=1, final=False, KV_FP8=True, WIDEN_K=True),
    "dense fp8 q/K/V": lambda: dense(F8, F8, Q_FP8=True, KV_FP8=True),
    "dense fp8 K/V, fp32 q": lambda: dense("fp32", F8, "fp32", PREC="ieee", KV_FP8=True, WIDEN_K=True),
}
def gluon_index(kdt, page, k_scale=False, topk=16, local=1):
    # Hopper only (wgmma): compiled for sm_90 alone.
    from triton.experimental.gluon._runtime import GluonASTSource
    from m3_sparse.index import topk_gluon_sm90 as gi
    fn = gi._index_topk_tma_kernel
    names = fn.arg_names
    bits = 8 if kdt == F8 else 16
    lay = f"NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={bits}, rank=2)"
    pb = min(128, page)
    k_box = f"tensordesc<{kdt}[{pb}, 128],{lay}>"
    s_box = "tensordesc<fp32[1, 128],NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)>"
    sig = {"q_ptr": "*bf16", "k_desc": k_box, "ks_desc": s_box if k_scale else k_box, "bt_ptr": I32, "cu_ptr": I32,
           "kvlen_ptr": I32, "out_ptr": I32, "stride_bt": "i32", "batch": "i32"}
    nkeep, kp, topk_p2 = gi.list_widths(topk, local)
    cx = dict(H=4, D=128, BLOCK=128, PAGE=page, PB=pb, TOPK=topk, TOPK_P2=topk_p2, LOCAL=local, NKEEP=nkeep, KP=kp,
              BM=gi.BM, FP8_DOT=kdt == F8, NS=gi.STAGES, K_SCALE=k_scale)
    full = {n: "constexpr" if n in cx else sig[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = GluonASTSource(fn, full, {(names.index(k),): v for k, v in cx.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": gi.NUM_WARPS})


from m3_sparse.index import topk_gluon_sm90 as _gi
# Gluon's API moves between Triton releases: the kernel is compiled by the release it names.
if arch == 90 and _gi.HAVE_GLUON and triton.__version__.startswith(_gi.TESTED_TRITON):
    cases["gluon index prefill, fp8 keys, page 128"] = lambda: gluon_index(F8, 128)
    cases["gluon index prefill, bf16 keys, page 64"] = lambda: gluon_index("bf16", 64)
    cases["gluon index prefill, fp8 keys with per-token scales"] = lambda: gluon_index(F8, 128, k_scale=True)
    # Kept lists shorter than the MMA's 8-column tile (top-4, two local blocks).
    cases["gluon index prefill, top-4 with two local blocks"] = lambda: gluon_index("bf16", 128, topk=4, local=2)
res = {}
for i, (name, make) in enumerate(cases.items()):
    if i % shards != shard:
        continue
    try:
        make()
        res[name] = {"ok": True}
    except Exception as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
print("RESULT " + json.dumps({"cases": len(cases), "results": res}))
"""


# The cases compile in a few shards, each in its own interpreter, so that pytest-xdist can
# spread one architecture's compiles over several workers (in one interpreter, sm_90 took
# three minutes on the H200 machine's host).
SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_kernels_compile_for_the_gpu(arch, shard):
    out = aot_compile(SCRIPT, str(arch), str(shard), str(SHARDS))
    res, total = out["results"], out["cases"]
    bad = {k: v["error"] for k, v in res.items() if not v["ok"]}
    assert not bad, f"kernels that do not compile for sm_{arch}: {json.dumps(bad, indent=1)}"
    assert total >= 40, total
    assert len(res) == len(range(shard, total, SHARDS)), sorted(res)
