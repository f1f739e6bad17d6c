"""Where ``M3PagedCache.begin_step`` puts each new token, checked directly.

A row's new tokens are ``[pad]*lead + [real]*n + [pad]*rest``. Leading pads go to the scratch
page (page ``num_pages``, which no block table names); real token ``i`` of row ``b`` goes to
position ``seq_lens[b] + i - lead[b]``, that is page ``block_tables[b, pos // page_size]``,
slot ``pos % page_size``; trailing pads take the positions after the real tokens and are
overwritten by the next step (docs/ARCHITECTURE.md, "The data path of one sparse layer").

Model outputs cannot see a leading pad written to a real slot: on the CPU the real token
written after it in the same scatter wins, and on a GPU the two writes race. So these tests
read what the cache exposes: the step's (page, slot) of every token, its lengths, and the
pools after writing distinct random K/V and index keys, each slot against the token that
should own it, with the scratch page holding nothing but leading pads. The expectations are
computed token by token from the layout drawn here, not from the cache's own arithmetic.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from m3_hf_attention.cache import quantize_index_keys
from model_utils import random_prompt, save_tiny_text_model, text_config

PAGE_SIZES = (16, 32, 64, 128)
FP8 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LOGIT_ATOL = 2e-4  # fp32 end to end, as tests/test_model.py


def _cache(cfg, batch: int, max_len: int, page_size: int, rng: random.Random, device, **kwargs) -> M3PagedCache:
    """A cache whose block table is a shuffled draw from a pool with spare pages, so that a
    token's page comes from the table, not from its row's place in the batch."""
    width = -(-max_len // page_size)
    pool = list(range(batch * width + 3))
    rng.shuffle(pool)
    tables = torch.tensor(pool[: batch * width], dtype=torch.int32).view(batch, width)
    return M3PagedCache(cfg, batch, max_len, page_size=page_size, block_tables=tables, num_pages=len(pool),
                        device=device, **kwargs)  # fmt: skip


def _mask(layout, width: int) -> torch.Tensor:
    """The padding mask [B, width] of rows ``(lead, real)``: lead pads, real tokens, trailing pads."""
    mask = torch.zeros(len(layout), width, dtype=torch.long)
    for b, (lead, real) in enumerate(layout):
        mask[b, lead : lead + real] = 1
    return mask


def _random_values(shape, gen: torch.Generator, device) -> torch.Tensor:
    # In [1, 2): never zero (a fresh pool's value), and distinct from token to token.
    return (torch.rand(shape, generator=gen) + 1.0).to(device)


class Expected:
    """What the cache must hold, kept token by token in plain Python."""

    def __init__(self, cache: M3PagedCache):
        self.cache = cache
        self.tables = cache.block_tables.cpu().tolist()
        self.page_size = cache.page_size
        self.scratch = cache.num_pages
        self.capacity = len(self.tables[0]) * self.page_size
        self.lengths = [0] * cache.max_batch  # real tokens per row, the current step's included
        self.slots = 0
        # Per pool name: the bytes each real token's location (page, head, slot) must hold, and
        # its (row, position); for every pad written, its bytes -> where it may lie ("scratch",
        # or a trailing pad's own location).
        self.real: dict[str, dict[tuple, tuple]] = {}
        self.owner: dict[str, dict[tuple, tuple]] = {}
        self.pads: dict[str, dict[tuple, set]] = {}

    def location(self, b: int, pos: int) -> tuple[int, int]:
        return self.tables[b][pos // self.page_size], pos % self.page_size

    def begin(self, layout, width: int) -> list[list]:
        """The step's expected placement: per row, per token, ``("lead", None)`` or
        ``(kind, position)``; checks the cache's step tensors and lengths against it."""
        seq = list(self.lengths)  # the last step commits now
        step = []
        for b, (lead, real) in enumerate(layout):
            row = []
            for i in range(width):
                if i < lead:
                    row.append(("lead", None))
                else:
                    row.append(("real" if i < lead + real else "trail", seq[b] + i - lead))
            step.append(row)
            self.lengths[b] = seq[b] + real
        self.slots += width
        cache = self.cache
        page, slot = cache.state_on(None, "page").cpu(), cache.state_on(None, "slot").cpu()
        assert page.shape == slot.shape == (cache.max_batch, width)
        for b, row in enumerate(step):
            for i, (kind, pos) in enumerate(row):
                got = (int(page[b, i]), int(slot[b, i]))
                if kind == "lead":
                    where = f"row {b}: leading pad {i} of {layout[b][0]} goes to (page, slot) {got}"
                    assert got[0] == self.scratch, f"{where}, not to the scratch page {self.scratch}"
                    assert 0 <= got[1] < self.page_size, where
                else:
                    want = self.location(b, pos)
                    assert got == want, f"row {b}: {kind} token {i} (position {pos}) goes to {got}, expected {want}"
        layer = cache.layers[0]
        assert layer.seq_lens.tolist() == seq
        assert layer.pending.tolist() == [real for _, real in layout]
        expected_kv = [min(seq[b] + width - lead, self.capacity) for b, (lead, _) in enumerate(layout)]
        assert layer.step_kv_lens.tolist() == expected_kv
        assert layer.seq_lens.dtype == layer.pending.dtype == layer.step_kv_lens.dtype == torch.int32
        assert int(cache.state_on(None, "slots")) == self.slots == cache.get_seq_length()
        return step

    def wrote(self, name: str, step, states: torch.Tensor) -> None:
        """Record a write of ``states`` [B, H, S, X] (K/V; index keys and scales with H = 1)."""
        real, pads, owner = (d.setdefault(name, {}) for d in (self.real, self.pads, self.owner))
        rows = states.detach().cpu().contiguous()
        for b, row in enumerate(step):
            for i, (kind, pos) in enumerate(row):
                for h in range(rows.shape[1]):
                    value = tuple(rows[b, h, i].view(torch.uint8).tolist())
                    if kind == "lead":
                        pads.setdefault(value, set()).add("scratch")
                        continue
                    page, slot = self.location(b, pos)
                    if kind == "real":
                        real[(page, h, slot)] = value
                        owner[(page, h, slot)] = (b, pos)
                    else:
                        pads.setdefault(value, set()).add((page, h, slot))

    def check_pool(self, name: str, pool: torch.Tensor) -> None:
        """Every real token in its own slot; every other slot never written (zero) or holding a
        pad where that pad may lie: a leading pad on the scratch page only, a trailing pad at
        its own position past its row's real tokens."""
        if pool.dim() == 2:  # fp8 index scales [pages, page_size]: one value per slot
            pool = pool[:, None, :, None]
        elif pool.dim() == 3:  # index keys [pages, page_size, Di]: one head
            pool = pool[:, None]
        pages, heads, size = pool.shape[:3]
        assert pages == self.scratch + 1 and size == self.page_size
        rows = pool.detach().cpu().contiguous()
        flat = rows.view(pages * heads * size, -1).view(torch.uint8).tolist()
        real, pads, owner = self.real[name], self.pads.get(name, {}), self.owner[name]
        for (page, h, slot), value in real.items():
            b, pos = owner[(page, h, slot)]
            got = tuple(flat[(page * heads + h) * size + slot])
            assert got == value, f"{name}: page {page}, head {h}, slot {slot} lost row {b}'s token at position {pos}"
        for index, row in enumerate(flat):
            page, rest = divmod(index, heads * size)
            h, slot = divmod(rest, size)
            loc = (page, h, slot)
            if loc in real or not any(row):
                continue
            places = pads.get(tuple(row))
            where = f"{name}: page {page}, head {h}, slot {slot}"
            assert places is not None, f"{where} holds a value that no pad and not its own token wrote"
            if page == self.scratch:
                assert "scratch" in places, f"{where}: the scratch page holds a pad that is not a leading pad"
            else:
                assert loc in places, f"{where} holds a pad of another place (a leading pad on a real page?)"


def _write_step(cache: M3PagedCache, cfg, expected: Expected, step, width: int, gen: torch.Generator, device) -> None:
    """Every layer writes distinct random K/V of this step through ``update``, and each
    sparse layer its index keys: plain pools alternately through ``index_key_rows`` (the rows
    the eager index kernel writes) and ``update_index``; fp8 pools through ``update_index``
    (codes and per-token scales)."""
    batch = cache.max_batch
    for layer in cache.layers:
        k = _random_values((batch, cfg.num_key_value_heads, width, cfg.head_dim), gen, device)
        v = _random_values(k.shape, gen, device)
        layer.update(k, v)
        expected.wrote(f"keys{layer.layer_idx}", step, k)
        expected.wrote(f"values{layer.layer_idx}", step, v)
        if not layer.is_sparse:
            continue
        idx = _random_values((batch, 1, width, cfg.index_head_dim), gen, device)
        name = f"index{layer.layer_idx}"
        if layer.index_scales is not None:
            layer.update_index(idx)
            codes, scales = quantize_index_keys(idx)
            expected.wrote(name, step, codes)
            expected.wrote(f"scales{layer.layer_idx}", step, scales[..., None])
        elif layer.layer_idx % 2 == 0:
            flat, rows = layer.index_key_rows(batch, width, cfg.index_head_dim, idx.device)
            flat.index_copy_(0, rows, idx[:, 0].reshape(-1, cfg.index_head_dim))
            expected.wrote(name, step, idx)
        else:
            layer.update_index(idx)
            expected.wrote(name, step, idx)


def _check_pools(cache: M3PagedCache, expected: Expected) -> None:
    for layer in cache.layers:
        expected.check_pool(f"keys{layer.layer_idx}", layer.keys)
        expected.check_pool(f"values{layer.layer_idx}", layer.values)
        if layer.is_sparse:
            expected.check_pool(f"index{layer.layer_idx}", layer.index_keys)
            if layer.index_scales is not None:
                expected.check_pool(f"scales{layer.layer_idx}", layer.index_scales)


def _left_padded(rng: random.Random, batch: int, width: int) -> list[tuple[int, int]]:
    """Rows ``(lead, real)``: one unpadded, one all padding, the rest random lead counts."""
    leads = [rng.randint(1, width - 1) for _ in range(batch - 2)]
    layout = [(0, width), (width, 0)] + [(lead, width - lead) for lead in leads]
    rng.shuffle(layout)
    return layout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_left_padded_prompt_sends_every_pad_to_the_scratch_page(page_size, device):
    """The first step of a left-padded batch: ragged random lead counts (pads running over
    more than one page), a row with no padding and a row of padding only."""
    rng, gen = random.Random(page_size), torch.Generator().manual_seed(page_size)
    batch, width, cfg = 6, page_size + 7, text_config()
    cache = _cache(cfg, batch, width + 2, page_size, rng, device)
    expected = Expected(cache)
    layout = _left_padded(rng, batch, width)
    cache.begin_step(_mask(layout, width).to(device), width)
    step = expected.begin(layout, width)
    _write_step(cache, cfg, expected, step, width, gen, device)
    _check_pools(cache, expected)
    assert cache.sequence_lengths().tolist() == [real for _, real in layout]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "page_size, index_key_dtype", [(16, None), (32, FP8), (64, None), (128, FP8)], ids=lambda v: str(v).split(".")[-1]
)
def test_a_left_padded_step_after_a_history(page_size, index_key_dtype, device):
    """Steps with leading pads on a cache that already holds tokens (a second prompt chunk,
    as a chunked prefill of a padded batch sends; or any later step of a direct forward):
    pads still go to the scratch page, and the real tokens continue each row's history
    without a gap. Between them a decode step, and a step with trailing pads that the next
    step overwrites. The full mask is passed, as the model passes it (new tokens last)."""
    rng, gen = random.Random(100 + page_size), torch.Generator().manual_seed(100 + page_size)
    batch = 5
    widths = [rng.randint(page_size // 2, page_size + 9), rng.randint(page_size // 2, page_size + 9), 1, 11, 1,
              rng.randint(page_size // 2, page_size + 9)]  # fmt: skip
    cfg = text_config()
    cache = _cache(cfg, batch, sum(widths), page_size, rng, device, index_key_dtype=index_key_dtype)
    expected = Expected(cache)
    full = torch.zeros(batch, 0, dtype=torch.long)
    for n, width in enumerate(widths):
        if width == 1:
            layout = [(0, 1)] * batch  # a decode step
        elif n == 3:
            # Right padding in one row, left in another: the trailing pads are overwritten by
            # the next step's real tokens, the leading ones never leave the scratch page.
            layout = [(0, width), (0, 4), (6, width - 6), (3, 5), (width, 0)]
        else:
            layout = _left_padded(rng, batch, width)
        full = torch.cat([full, _mask(layout, width)], dim=1)
        mask = None if width == 1 and n == 2 else full.to(device)  # a decode step may pass no mask
        cache.begin_step(mask, width)
        step = expected.begin(layout, width)
        _write_step(cache, cfg, expected, step, width, gen, device)
        _check_pools(cache, expected)
    assert cache.sequence_lengths().tolist() == expected.lengths
    assert any(length > 0 for length in expected.lengths)


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3")
    save_tiny_text_model(path, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


def test_a_left_padded_chunk_after_a_history_matches_the_unpadded_rows(sparse_model):
    """The model through a left-padded first chunk and a left-padded second chunk (with
    position_ids that continue each row's real tokens, as generate() derives them from the
    mask): each row's second-chunk logits are those of the row run alone, unpadded, in one
    pass. The histories are long enough for the sparse layers to drop blocks."""
    gen = torch.Generator().manual_seed(11)
    history, chunk = [37, 50, 20], [9, 30, 5]
    batch, w1, w2 = len(history), max(history), max(chunk) + 3
    firsts = [random_prompt(n, gen) for n in history]
    seconds = [random_prompt(n, gen) for n in chunk]
    ids1, ids2 = torch.zeros(batch, w1, dtype=torch.long), torch.zeros(batch, w2, dtype=torch.long)
    mask1, mask2 = torch.zeros_like(ids1), torch.zeros_like(ids2)
    for b in range(batch):
        ids1[b, w1 - history[b]:], mask1[b, w1 - history[b]:] = firsts[b], 1
        ids2[b, w2 - chunk[b]:], mask2[b, w2 - chunk[b]:] = seconds[b], 1
    pos1 = (mask1.cumsum(-1) - 1).clamp(min=0)
    pos2 = (torch.tensor(history)[:, None] + mask2.cumsum(-1) - 1).clamp(min=0)
    cache = M3PagedCache(sparse_model.config, batch, w1 + w2, page_size=16)
    with torch.no_grad():
        sparse_model(input_ids=ids1, attention_mask=mask1, position_ids=pos1, past_key_values=cache, use_cache=True)
        logits = sparse_model(input_ids=ids2, attention_mask=torch.cat([mask1, mask2], 1), position_ids=pos2,
                              past_key_values=cache, use_cache=True).logits  # fmt: skip
        assert cache.sequence_lengths().tolist() == [h + c for h, c in zip(history, chunk)]
        for b in range(batch):
            alone = sparse_model(input_ids=torch.cat([firsts[b], seconds[b]])[None]).logits[0, history[b]:]
            torch.testing.assert_close(logits[b, w2 - chunk[b]:], alone, atol=LOGIT_ATOL, rtol=0)
