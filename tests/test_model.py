"""The full model with m3_sparse against the same weights with sdpa, where
transformers builds the dense block mask from its own indexer (an independent oracle).
Prefill logits go through m3_hf_attention.compare, which accepts a difference only where it
comes from block-selection or MoE-routing near-ties (the rule of the example's --compare-sdpa)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention
from m3_hf_attention import M3PagedCache
from m3_hf_attention.compare import assert_prefill_matches_sdpa
from model_utils import BLOCK, CACHE_KEYWORD, TOPK, greedy, left_padded_batch, random_prompt, save_tiny_text_model

LOGIT_ATOL = 2e-4  # fp32 end to end; both paths sum the same keys in a different order
LOGIT_TOL = LOGIT_ATOL  # the prefill check's bound: this x max(1, |logit|)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3")
    save_tiny_text_model(path, seed=0)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    sparse = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    return sparse, dense


def test_registered():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["m3_sparse"] is m3_hf_attention.m3_sparse_attention
    assert ALL_MASK_ATTENTION_FUNCTIONS["m3_sparse"] is m3_hf_attention.m3_sparse_mask


def test_prompt_is_really_sparse():
    # The comparisons below only mean something if queries drop blocks.
    assert 70 > 4 * TOPK * BLOCK // 2


@pytest.mark.parametrize("length", [5, 70, 131])
def test_prefill_logits_match_sdpa(models, length):
    sparse, dense = models
    ids = random_prompt(length, torch.Generator().manual_seed(length))[None]
    assert_prefill_matches_sdpa(sparse, lambda: sparse(ids).logits, dense, [ids[0]], tol=LOGIT_TOL)


def test_generate_batch1_token_identical(models):
    sparse, dense = models
    ids = random_prompt(70, torch.Generator().manual_seed(1))[None]
    out_sparse = greedy(sparse, ids, output_scores=True, return_dict_in_generate=True)
    out_dense = greedy(dense, ids, output_scores=True, return_dict_in_generate=True)
    assert out_sparse.sequences.tolist() == out_dense.sequences.tolist()
    for a, b in zip(out_sparse.scores, out_dense.scores):
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite], b[finite], atol=LOGIT_ATOL, rtol=0)


def test_generate_uses_paged_cache_by_default(models):
    sparse, _ = models
    ids = random_prompt(20, torch.Generator().manual_seed(2))[None]
    out = greedy(sparse, ids, new_tokens=3, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, M3PagedCache)
    assert out.past_key_values.sequence_lengths().tolist() == [22]  # the last token is not fed back


def test_generate_takes_a_paged_cache_under_the_release_keyword(models):
    """A cache passed under this transformers release's own keyword (``cache`` from 5.24,
    ``past_key_values`` before) serves generate() as the default one does, and comes back."""
    assert CACHE_KEYWORD == m3_hf_attention.CACHE_KEYWORD  # the tests' copy, kept free of the package
    sparse, _ = models
    ids = random_prompt(40, torch.Generator().manual_seed(4))[None]
    default = greedy(sparse, ids, new_tokens=6)
    cache = M3PagedCache(sparse.config, 1, 64, page_size=16)
    out = greedy(sparse, ids, new_tokens=6, return_dict_in_generate=True, **{CACHE_KEYWORD: cache})
    assert out.sequences.tolist() == default.tolist()
    assert getattr(out, CACHE_KEYWORD) is cache
    assert cache.sequence_lengths().tolist() == [45]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_prefill_matches_each_sequence(models, side):
    """Each row of a padded batch must equal that sequence run alone."""
    sparse, dense = models
    g = torch.Generator().manual_seed(3)
    lengths = [70, 33, 51, 9]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = []
    for i, n in enumerate(lengths):
        row = random_prompt(n, g)
        rows.append(row)
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols] = row
        mask[i, cols] = 1
    caches = []

    def prefill():
        caches.append(M3PagedCache(sparse.config, len(lengths), width + 4, page_size=16))
        return sparse(input_ids=ids, attention_mask=mask, past_key_values=caches[-1]).logits

    offsets = [width - n if side == "left" else 0 for n in lengths]
    assert_prefill_matches_sdpa(sparse, prefill, dense, rows, offsets=offsets, tol=LOGIT_TOL)
    assert caches[0].sequence_lengths().tolist() == lengths


def test_generate_padded_batch_token_identical(models):
    """A left-padded batch through generate(): every row equals its sequence generated alone
    with sdpa (transformers' own indexer anchors blocks to padded slots, so its batched
    result is not an oracle here)."""
    sparse, dense = models
    lengths = [70, 33, 51]
    width = max(lengths)
    ids, mask, rows = left_padded_batch(lengths, torch.Generator().manual_seed(4))
    out = greedy(sparse, ids, mask, output_scores=True, return_dict_in_generate=True)
    for i, n in enumerate(lengths):
        ref = greedy(dense, rows[i][None], output_scores=True, return_dict_in_generate=True)
        assert out.sequences[i, width:].tolist() == ref.sequences[0, n:].tolist(), f"row {i}"
        for a, b in zip(out.scores, ref.scores):
            finite = torch.isfinite(b[0])
            torch.testing.assert_close(a[i][finite], b[0][finite], atol=LOGIT_ATOL, rtol=0)


def test_generate_prefill_chunk_size_matches_one_pass(models):
    """transformers' chunked prefill (``generate(prefill_chunk_size=...)``, what a batch too
    large for one forward pass needs) on a left-padded batch, with chunks that hold only
    padding for the shortest row: the tokens and scores of a one-pass prefill."""
    sparse, _ = models
    ids, mask, _ = left_padded_batch([70, 33, 51], torch.Generator().manual_seed(6))
    kw = dict(new_tokens=12, output_scores=True, return_dict_in_generate=True)
    one = greedy(sparse, ids, mask, **kw)
    chunked = greedy(sparse, ids, mask, prefill_chunk_size=16, **kw)
    assert chunked.sequences.tolist() == one.sequences.tolist()
    for a, b in zip(chunked.scores, one.scores):
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite], b[finite], atol=LOGIT_ATOL, rtol=0)


def test_chunked_prefill_runs_eagerly_and_decode_keeps_compiling(models, monkeypatch):
    """With an M3PagedCache, generate()'s chunked prefill asks transformers' compile decision
    with compiling off (its chunks run eagerly, as a one-pass prefill does); the decode steps
    keep generate()'s own decision, which it takes before the prefill."""
    sparse, _ = models
    seen = []

    def decision(model_kwargs, generation_config):
        seen.append(generation_config.disable_compile)
        return False  # nothing compiles on the CPU either way

    monkeypatch.setattr(sparse, "_valid_auto_compile_criteria", decision)
    ids = random_prompt(40, torch.Generator().manual_seed(7))[None]
    greedy(sparse, ids, torch.ones_like(ids), new_tokens=3, prefill_chunk_size=16)
    # _sample asks once for the decode steps (before the prefill, compiling not turned off),
    # then the chunked prefill once, with compiling turned off.
    assert len(seen) == 2 and not seen[0] and seen[1] is True, seen
    seen.clear()
    greedy(sparse, ids, torch.ones_like(ids), new_tokens=3)  # one pass: the prefill never asks
    assert len(seen) == 1 and not seen[0], seen


def test_chunked_prefill_and_decode_match_full_forward(models):
    """Prefill in uneven chunks, then decode one token at a time, through one cache with a
    shuffled block table: every step's logits equal the full-sequence sdpa forward."""
    sparse, dense = models
    g = torch.Generator().manual_seed(5)
    ids = random_prompt(90, g)[None]
    page_size, max_len = 16, 96
    pages = -(-max_len // page_size)
    tables = torch.randperm(pages + 3, generator=g)[:pages].view(1, pages).to(torch.int32)
    cache = M3PagedCache(sparse.config, 1, max_len, page_size=page_size, block_tables=tables, num_pages=pages + 3)
    with torch.no_grad():
        ref = dense(ids).logits[0]
        got = []
        for start, stop in [(0, 37), (37, 41), (41, 80)] + [(t, t + 1) for t in range(80, 90)]:
            got.append(sparse(input_ids=ids[:, start:stop], past_key_values=cache, use_cache=True).logits[0])
    torch.testing.assert_close(torch.cat(got), ref, atol=LOGIT_ATOL, rtol=0)


def test_stock_indexer_selection_matches(models):
    """The paged index branch selects the same blocks as transformers' O(N^2) indexer."""
    sparse, dense = models
    ids = random_prompt(100, torch.Generator().manual_seed(6))[None]
    captured = {}

    def grab(name):
        def hook(module, args, output):
            captured[name] = output

        return hook

    hs = [
        sparse.model.layers[0].self_attn.indexer.register_forward_hook(grab("sparse")),
        dense.model.layers[0].self_attn.indexer.register_forward_hook(grab("dense")),
    ]
    try:
        with torch.no_grad():
            sparse(ids)
            dense(ids)
    finally:
        for h in hs:
            h.remove()
    a, b = captured["sparse"], captured["dense"]
    assert a.shape[:3] == b.shape[:3]

    def as_sets(x):
        return [[sorted(v for v in row.tolist() if v >= 0) for row in head] for head in x[0]]

    pad = torch.full((*b.shape[:3], a.shape[-1] - b.shape[-1]), -1, dtype=b.dtype)
    assert as_sets(a) == as_sets(torch.cat([b, pad], -1))


def test_cache_overflow_raises_before_writing(models):
    sparse, _ = models
    ids = random_prompt(40, torch.Generator().manual_seed(7))[None]
    cache = M3PagedCache(sparse.config, 1, 48, page_size=16)
    with torch.no_grad():
        sparse(input_ids=ids, past_key_values=cache, use_cache=True)
    snapshot = [(l.keys.clone(), l.values.clone(), l.seq_lens.clone()) for l in cache.layers]
    with pytest.raises(ValueError, match="max_cache_len=48"):
        with torch.no_grad():
            sparse(input_ids=ids[:, :9], past_key_values=cache, use_cache=True)
    for layer, (k, v, n) in zip(cache.layers, snapshot):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and torch.equal(layer.seq_lens, n)


def test_cache_rejects_bad_arguments(models):
    sparse, _ = models
    cfg = sparse.config
    with pytest.raises(ValueError, match="max_cache_len"):
        M3PagedCache(cfg, 1, 0)
    with pytest.raises(ValueError, match="block_tables: expected shape"):
        M3PagedCache(cfg, 2, 64, page_size=16, block_tables=torch.zeros(2, 3, dtype=torch.int32), num_pages=8)
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, num_pages=8\)"):
        M3PagedCache(cfg, 1, 64, page_size=16, block_tables=torch.tensor([[0, 1, 2, 9]], dtype=torch.int32), num_pages=8)
    with pytest.raises(ValueError, match="shared"):
        M3PagedCache(cfg, 1, 64, page_size=16, block_tables=torch.tensor([[0, 1, 1, 2]], dtype=torch.int32), num_pages=8)
    with pytest.raises(ValueError, match="num_pages: required"):
        M3PagedCache(cfg, 1, 64, page_size=16, block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32))
    cache = M3PagedCache(cfg, 2, 64, page_size=16)
    with pytest.raises(ValueError, match="built for batch 2"):
        with torch.no_grad():
            sparse(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)


def test_pad_inside_new_tokens_is_rejected(models):
    sparse, _ = models
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[1, 0, 1, 1]])
    cache = M3PagedCache(sparse.config, 1, 16, page_size=16)
    with pytest.raises(ValueError, match="padding between real tokens"):
        with torch.no_grad():
            sparse(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
