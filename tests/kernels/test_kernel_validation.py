"""Bad arguments to the public entry points raise ValueError/TypeError naming the
argument, before touching anything: the inputs are left as they were.

On the CPU the value checks (ids, lengths, page tables) always run; on an
accelerator they need M3_SPARSE_DEBUG=1, so these tests use CPU tensors.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import m3_sparse
from kernel_test_utils import gen, make_batch, randn, random_selection

PAGE, BLOCK, TOPK, HQ, HKV, D = 16, 16, 3, 4, 2, 8
SEQS = [(40, 3), (20, 2)]  # 3 + 2 pages; block tables 4 pages wide (64 tokens, 4 blocks)


def base_args() -> dict:
    g = gen(0)
    batch = make_batch(g, SEQS, PAGE)
    assert batch.block_tables.shape[1] == 4
    return {
        "q": randn(g, batch.num_tokens, HQ, D),
        "k_cache": batch.kv_cache(g, HKV, D),
        "v_cache": batch.kv_cache(g, HKV, D),
        "selected": random_selection(g, batch, HKV, TOPK, BLOCK),
        "block_tables": batch.block_tables,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "used_kv_lens": batch.used_kv_lens,
        "index_q": randn(g, batch.num_tokens, HKV, D),
        "index_k_cache": batch.index_cache(g, D),
        "num_pages": batch.num_pages,
        "kw": {},
    }


def call_kvouter(a):
    return m3_sparse.kvouter_attention(
        a["q"], a["k_cache"], a["v_cache"], a["selected"], a["block_tables"],
        cu_seqlens_q=a["cu_seqlens_q"], used_kv_lens=a["used_kv_lens"], **{"block_size": BLOCK, **a["kw"]},
    )


def call_dense(a):
    return m3_sparse.dense_paged_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_tables"],
        cu_seqlens_q=a["cu_seqlens_q"], used_kv_lens=a["used_kv_lens"], **a["kw"],
    )


def call_index(a):
    kw = {"topk": TOPK, "block_size": BLOCK, "local_blocks": 1, **a["kw"]}
    return m3_sparse.index_topk(
        a["index_q"], a["index_k_cache"], a["block_tables"],
        cu_seqlens_q=a["cu_seqlens_q"], used_kv_lens=a["used_kv_lens"], **kw,
    )


def call_build(a):
    kw = {"max_blocks": 4, **a["kw"]}
    return m3_sparse.build_kvouter_index(a["selected"], cu_seqlens_q=a["cu_seqlens_q"], **kw)


def default_index(a):
    return m3_sparse.build_kvouter_index(a["selected"], cu_seqlens_q=a["cu_seqlens_q"], max_blocks=4)


def call_schedule(a):
    index = a["index"] if "index" in a else default_index(a)
    kw = {"tile_q": 8, "num_programs": 4, **a["kw"]}
    return m3_sparse.schedule(index, **kw)


def call_partials(a):
    index = a["index"] if "index" in a else default_index(a)
    kw = {"softmax_scale": 0.3, "block_size": BLOCK, **a["kw"]}
    return m3_sparse.kvouter_partials(
        a["q"], a["k_cache"], a["v_cache"], index, a["block_tables"],
        cu_seqlens_q=a["cu_seqlens_q"], used_kv_lens=a["used_kv_lens"], **kw,
    )


def combine_args(a):
    index = default_index(a)
    po, pm, pl = m3_sparse.kvouter_partials(
        a["q"], a["k_cache"], a["v_cache"], index, a["block_tables"],
        cu_seqlens_q=a["cu_seqlens_q"], used_kv_lens=a["used_kv_lens"], softmax_scale=0.3, block_size=BLOCK,
    )
    a.update(partial_o=po, partial_m=pm, partial_l=pl, slot_of=index.slot_of)


def call_combine(a):
    return m3_sparse.combine(a["partial_o"], a["partial_m"], a["partial_l"], a["slot_of"], **a["kw"])


ENTRY_POINTS = {
    "kvouter_attention": call_kvouter,
    "dense_paged_attention": call_dense,
    "index_topk": call_index,
    "build_kvouter_index": call_build,
    "schedule": call_schedule,
    "kvouter_partials": call_partials,
    "combine": call_combine,
}


def setitem(key, fn):
    def mutate(a):
        a[key] = fn(a)

    return mutate


def set_kw(**kw):
    def mutate(a):
        a["kw"].update(kw)

    return mutate


def poke(key, index, value):
    def mutate(a):
        a[key] = a[key].clone()
        a[key][index] = value

    return mutate


def wide_heads(a):
    shape = (a["num_pages"], HKV, PAGE, 2 * D)
    a.update(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape))


def other_tokens_index(a):
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    return m3_sparse.build_kvouter_index(a["selected"][:4], cu_seqlens_q=cu, max_blocks=4)


def page_size_24(a):
    a.update(k_cache=torch.zeros(9, HKV, 24, D), v_cache=torch.zeros(9, HKV, 24, D))


def small_pages(page):
    """Caches (and index keys) cut into pages of ``page`` tokens: only the page
    size is wrong, the pool is as large as before."""

    def mutate(a):
        n = a["k_cache"].shape[0] * PAGE // page if page < PAGE else a["k_cache"].shape[0]
        a["k_cache"] = torch.zeros(n, HKV, page, D)
        a["v_cache"] = torch.zeros(n, HKV, page, D)

    return mutate


# Cases shared by the three ops that read a paged batch; "kv" = the K/V ops only.
BATCH_CASES = [
    ("block_tables float", setitem("block_tables", lambda a: a["block_tables"].float()), ValueError, "block_tables"),
    ("block_tables 1-D", setitem("block_tables", lambda a: a["block_tables"][0]), ValueError, "block_tables"),
    ("block_tables rows", setitem("block_tables", lambda a: a["block_tables"][:1]), ValueError, "block_tables"),
    ("page id -1 in length", poke("block_tables", (0, 1), -1), ValueError, "block_tables"),
    ("page id num_pages in length", lambda a: poke("block_tables", (1, 1), a["num_pages"])(a), ValueError,
     "block_tables"),
    ("page id huge in length", poke("block_tables", (0, 2), 2**31 - 1), ValueError, "block_tables"),
    ("used_kv_lens > capacity", poke("used_kv_lens", 0, 65), ValueError, "used_kv_lens"),
    ("used_kv_lens negative", poke("used_kv_lens", 1, -1), ValueError, "used_kv_lens"),
    ("used_kv_lens float", setitem("used_kv_lens", lambda a: a["used_kv_lens"].float()), ValueError, "used_kv_lens"),
    ("used_kv_lens 2-D", setitem("used_kv_lens", lambda a: a["used_kv_lens"][None]), ValueError, "used_kv_lens"),
    ("cu_seqlens_q short", setitem("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q end", poke("cu_seqlens_q", -1, 4), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q start", poke("cu_seqlens_q", 0, 1), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q decreasing", setitem("cu_seqlens_q", lambda a: torch.tensor([0, 6, 5], dtype=torch.int32)),
     ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q float", setitem("cu_seqlens_q", lambda a: a["cu_seqlens_q"].float()), ValueError, "cu_seqlens_q"),
]

KV_CASES = [
    ("q 2-D", setitem("q", lambda a: a["q"][0]), ValueError, "q"),
    ("q int", setitem("q", lambda a: a["q"].to(torch.int32)), ValueError, "q"),
    ("q list", setitem("q", lambda a: a["q"].tolist()), TypeError, "q"),
    ("k_cache 3-D", setitem("k_cache", lambda a: a["k_cache"][:, 0]), ValueError, "k_cache"),
    ("v_cache 3-D", setitem("v_cache", lambda a: a["v_cache"][:, 0]), ValueError, "v_cache"),
    ("k_cache int", setitem("k_cache", lambda a: a["k_cache"].to(torch.int16)), ValueError, "k_cache"),
    ("k_cache bf16 vs q fp32", setitem("k_cache", lambda a: a["k_cache"].bfloat16()), ValueError, "k_cache"),
    ("head dim", wide_heads, ValueError, "k_cache"),
    ("Hq % Hkv", setitem("q", lambda a: a["q"][:, :3]), ValueError, "q"),
    ("k/v shape", setitem("v_cache", lambda a: a["v_cache"][:, :1]), ValueError, "v_cache"),
    ("page size 8", small_pages(8), ValueError, "k_cache"),
    ("page size 24", page_size_24, ValueError, "k_cache"),
    ("page size 256", small_pages(256), ValueError, "k_cache"),
    ("softmax_scale negative", set_kw(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("softmax_scale nan", set_kw(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("softmax_scale str", set_kw(softmax_scale="0.1"), ValueError, "softmax_scale"),
]

SPARSE_CASES = [
    ("selected float", setitem("selected", lambda a: a["selected"].float()), ValueError, "selected"),
    ("selected 2-D", setitem("selected", lambda a: a["selected"][:, 0]), ValueError, "selected"),
    ("selected tokens", setitem("selected", lambda a: a["selected"][:4]), ValueError, "selected"),
    ("selected heads", setitem("selected", lambda a: a["selected"][:, :1]), ValueError, "selected"),
    ("block id -2", poke("selected", (0, 0, 0), -2), ValueError, "selected"),
    ("block id = capacity", poke("selected", (1, 1, 2), 4), ValueError, "selected"),
    ("page_size kwarg", set_kw(page_size=32), ValueError, "page_size"),
    ("block_size 0", set_kw(block_size=0), ValueError, "block_size"),
    ("block_size float", set_kw(block_size=16.0), ValueError, "block_size"),
]

INDEX_CASES = [
    ("index_q 2-D", setitem("index_q", lambda a: a["index_q"][:, 0]), ValueError, "index_q"),
    ("index_q int", setitem("index_q", lambda a: a["index_q"].to(torch.int32)), ValueError, "index_q"),
    ("index_q list", setitem("index_q", lambda a: a["index_q"].tolist()), TypeError, "index_q"),
    ("index_k_cache 4-D", setitem("index_k_cache", lambda a: a["index_k_cache"][:, None]), ValueError, "index_k_cache"),
    ("index_k_cache int", setitem("index_k_cache", lambda a: a["index_k_cache"].long()), ValueError, "index_k_cache"),
    ("index head dim", setitem("index_k_cache", lambda a: a["index_k_cache"][..., :4]), ValueError, "index_k_cache"),
    ("topk 0", set_kw(topk=0), ValueError, "topk"),
    ("topk -1", set_kw(topk=-1), ValueError, "topk"),
    ("topk float", set_kw(topk=2.0), ValueError, "topk"),
    ("topk bool", set_kw(topk=True), ValueError, "topk"),
    ("local_blocks > topk", set_kw(local_blocks=TOPK + 1), ValueError, "local_blocks"),
    ("local_blocks -1", set_kw(local_blocks=-1), ValueError, "local_blocks"),
    ("local_blocks float", set_kw(local_blocks=1.0), ValueError, "local_blocks"),
    ("block_size 0", set_kw(block_size=0), ValueError, "block_size"),
]

BUILD_CASES = [
    ("selected float", setitem("selected", lambda a: a["selected"].float()), ValueError, "selected"),
    ("selected 2-D", setitem("selected", lambda a: a["selected"][:, 0]), ValueError, "selected"),
    ("selected list", setitem("selected", lambda a: a["selected"].tolist()), TypeError, "selected"),
    ("block id -2", poke("selected", (2, 1, 0), -2), ValueError, "selected"),
    ("block id = max_blocks", poke("selected", (0, 0, 1), 4), ValueError, "selected"),
    ("cu_seqlens_q float", setitem("cu_seqlens_q", lambda a: a["cu_seqlens_q"].float()), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q 2-D", setitem("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None]), ValueError, "cu_seqlens_q"),
    ("max_blocks 0", set_kw(max_blocks=0), ValueError, "max_blocks"),
    ("max_blocks float", set_kw(max_blocks=4.0), ValueError, "max_blocks"),
]

SCHEDULE_CASES = [
    ("tile_q 0", set_kw(tile_q=0), ValueError, "tile_q"),
    ("tile_q float", set_kw(tile_q=1.5), ValueError, "tile_q"),
    ("num_programs 0", set_kw(num_programs=0), ValueError, "num_programs"),
    ("num_programs -3", set_kw(num_programs=-3), ValueError, "num_programs"),
    ("index not an index", setitem("index", lambda a: a["selected"]), TypeError, "index"),
]

# The two pipeline stages are exported (``__all__``) and documented as public.
PARTIALS_CASES = [
    ("q int", setitem("q", lambda a: a["q"].to(torch.int32)), ValueError, "q"),
    ("head dim", wide_heads, ValueError, "k_cache"),
    ("index of other tokens", setitem("index", other_tokens_index), ValueError, "index"),
    ("softmax_scale negative", set_kw(softmax_scale=-1.0), ValueError, "softmax_scale"),
]

COMBINE_CASES = [
    ("slot_of float", setitem("slot_of", lambda a: a["slot_of"].float()), ValueError, "slot_of"),
    ("slot_of 2-D", setitem("slot_of", lambda a: a["slot_of"][:, 0]), ValueError, "slot_of"),
    ("slot_of out of range", lambda a: poke("slot_of", (0, 0, 0), a["partial_m"].shape[0])(a), ValueError, "slot_of"),
    ("partial_o 2-D", setitem("partial_o", lambda a: a["partial_o"][:, 0]), ValueError, "partial_o"),
    ("partial_m shape", setitem("partial_m", lambda a: a["partial_m"][:, :1]), ValueError, "partial_m"),
    ("partial_l rows", setitem("partial_l", lambda a: a["partial_l"][:-1]), ValueError, "partial_l"),
]


def cases():
    for ep in ("kvouter_attention", "dense_paged_attention", "index_topk"):
        for c in BATCH_CASES:
            yield ep, *c
    for ep in ("kvouter_attention", "dense_paged_attention"):
        for c in KV_CASES:
            yield ep, *c
    for c in SPARSE_CASES:
        yield "kvouter_attention", *c
    for ep, table in (
        ("index_topk", INDEX_CASES),
        ("build_kvouter_index", BUILD_CASES),
        ("schedule", SCHEDULE_CASES),
        ("kvouter_partials", PARTIALS_CASES),
        ("combine", COMBINE_CASES),
    ):
        for c in table:
            yield ep, *c


CASES = list(cases())


def snapshot(a):
    return {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_valid_arguments_are_accepted(entry):
    """The base arguments every rejection case starts from are themselves valid."""
    a = base_args()
    if entry == "combine":
        combine_args(a)
    ENTRY_POINTS[entry](a)


@pytest.mark.parametrize("entry,case,mutate,exc,name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_rejected_with_named_argument(entry, case, mutate, exc, name):
    a = base_args()
    if entry == "combine":
        combine_args(a)
    mutate(a)
    before = snapshot(a)
    with pytest.raises((ValueError, TypeError)) as info:
        ENTRY_POINTS[entry](a)
    msg = str(info.value)
    assert isinstance(info.value, exc), f"expected {exc.__name__}, got {type(info.value).__name__}: {msg}"
    assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", msg), f"message does not name {name!r}: {msg}"
    for k, v in before.items():
        assert torch.equal(a[k], v), f"rejected call modified {k}"


def test_block_table_padding_past_the_length_is_accepted():
    """Only pages inside a sequence's length must be in the pool."""
    a = base_args()
    bt = a["block_tables"].clone()
    bt[0, 3] = -1  # sequence 0 uses 3 pages
    bt[1, 2:] = 2**31 - 1  # sequence 1 uses 2
    a["block_tables"] = bt
    # Whether the computation then stays off those entries is test_kvouter's business
    # (test_*_block_table_padding_is_never_read); here block_size == page_size.
    call_index(a)
    call_kvouter(a)


def test_kv_lens_smaller_than_query_count_is_accepted():
    """Left-padded rows (more queries than cached tokens) are allowed: they sit at
    negative positions and see nothing (test_kvouter, test_index_topk check the values)."""
    a = base_args()
    a["used_kv_lens"] = torch.tensor([2, 20], dtype=torch.int32)
    call_index(a)
    call_kvouter(a)
    call_dense(a)


@pytest.mark.gpu  # a second device: CUDA beside the CPU
@pytest.mark.parametrize("entry,key", [
    ("kvouter_attention", "k_cache"),
    ("kvouter_attention", "selected"),
    ("kvouter_attention", "block_tables"),
    ("dense_paged_attention", "v_cache"),
    ("index_topk", "index_k_cache"),
    ("index_topk", "cu_seqlens_q"),
])
def test_mismatched_devices(entry, key):
    a = base_args()
    for k in ("q", "index_q"):
        a[k] = a[k].cuda()
    for k in ("k_cache", "v_cache", "selected", "block_tables", "cu_seqlens_q", "used_kv_lens", "index_k_cache"):
        if k != key:
            a[k] = a[k].cuda()
    with pytest.raises(ValueError, match=re.escape(key)):
        ENTRY_POINTS[entry](a)


# The attention ops' parameters as users pass them: the tensors by position, the rest by
# keyword. The ops write their shared part once (``api.attention_op``).
_PAGED = ["cu_seqlens_q", "used_kv_lens"]
_QUANT = ["q_scale", "k_scale", "v_scale", "out_dtype"]
SIGNATURES = {
    "kvouter_attention": (
        ["q", "k_cache", "v_cache", "selected", "block_tables"],
        _PAGED + ["softmax_scale", "causal", "page_size", "block_size", "return_lse", *_QUANT, "partial_dtype",
                  "max_workspace_bytes", "config"],
    ),
    "sparse_decode_attention": (
        ["q", "k_cache", "v_cache", "selected", "block_tables"],
        _PAGED + ["softmax_scale", "causal", "page_size", "block_size", "return_lse", *_QUANT, "config"],
    ),
    "sparse_attention": (
        ["q", "k_cache", "v_cache", "selected", "block_tables"],
        _PAGED + ["max_seqlen_q", "softmax_scale", "causal", "page_size", "block_size", "return_lse", *_QUANT,
                  "partial_dtype"],
    ),
    "dense_paged_attention": (
        ["q", "k_cache", "v_cache", "block_tables"],
        _PAGED + ["max_seqlen_q", "softmax_scale", "causal", "return_lse", *_QUANT, "config"],
    ),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_attention_op_signatures(name):
    """Each op's parameters: the positional tensors in order, then keyword-only ones; only the
    paged lengths have no default."""
    positional, keywords = SIGNATURES[name]
    params = inspect.signature(getattr(m3_sparse, name)).parameters.values()
    assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == keywords
    assert [p.name for p in params if p.default is p.empty] == positional + _PAGED


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_attention_op_binding_errors(name):
    """A call the signature does not take raises TypeError before any check runs."""
    fn, a = getattr(m3_sparse, name), base_args()
    tensors = [a[n] for n in SIGNATURES[name][0]]
    paged = {n: a[n] for n in _PAGED}
    with pytest.raises(TypeError, match="positional"):
        fn(*tensors, a["q"], **paged)
    with pytest.raises(TypeError, match="used_kv_lens"):
        fn(*tensors, cu_seqlens_q=a["cu_seqlens_q"])
    with pytest.raises(TypeError, match="bogus"):
        fn(*tensors, **paged, bogus=1)
    with pytest.raises(TypeError, match="'q'"):
        fn(*tensors, **paged, q=a["q"])
    # The same call, bound right, runs: keywords in any order, q by keyword.
    sized = {"block_size": BLOCK} if "block_size" in SIGNATURES[name][1] else {}
    out, _ = fn(**sized, **dict(reversed(paged.items())), **dict(zip(SIGNATURES[name][0], tensors)))
    assert out.shape == a["q"].shape
