"""An eager step's index keys are written by the kernel that makes them
(``M3PagedLayer.index_key_rows`` hands ``api.index_prep`` the pool's rows): the same pages
as ``update_index``, with its checks, and only where no quantization is needed."""

from __future__ import annotations

import pytest
import torch

from m3_hf_attention import M3PagedCache
from model_utils import text_config

BATCH, Q_LEN, PAGE = 2, 5, 16


def _step(cache, cfg, mask, g):
    """Begin a step of ``Q_LEN`` tokens and write every layer's K/V; returns the sparse layers."""
    cache.begin_step(mask, Q_LEN)
    for layer in cache.layers:
        k = torch.randn(BATCH, cfg.num_key_value_heads, Q_LEN, cfg.head_dim, generator=g)
        layer.update(k, torch.randn(k.shape, generator=g))
    return [layer for layer in cache.layers if layer.is_sparse]


@pytest.mark.parametrize("lead", [0, 2], ids=["no_padding", "left_padded"])
def test_rows_are_the_slots_update_index_writes(lead):
    cfg = text_config()
    mask = torch.ones(BATCH, Q_LEN, dtype=torch.long)
    mask[1, :lead] = 0  # leading pads go to the scratch page in both writes
    caches = [M3PagedCache(cfg, BATCH, 40, page_size=PAGE) for _ in range(2)]
    for step in range(3):
        keys = torch.randn(BATCH, 1, Q_LEN, cfg.index_head_dim, generator=torch.Generator().manual_seed(step))
        by_update, by_rows = (_step(c, cfg, mask if step == 0 else None, torch.Generator().manual_seed(10 + step))
                              for c in caches)
        for a, b in zip(by_update, by_rows):
            a.update_index(keys)
            flat, rows = b.index_key_rows(BATCH, Q_LEN, cfg.index_head_dim, keys.device)
            assert flat.data_ptr() == b.index_keys.data_ptr() and rows.shape == (BATCH * Q_LEN,)
            flat.index_copy_(0, rows, keys[:, 0].reshape(-1, cfg.index_head_dim))
            assert torch.equal(a.index_keys, b.index_keys)
    assert torch.equal(caches[0].sequence_lengths(), caches[1].sequence_lengths())


def test_index_key_rows_keeps_update_index_checks():
    cfg = text_config()
    cache = M3PagedCache(cfg, BATCH, 40, page_size=PAGE)
    sparse = _step(cache, cfg, None, torch.Generator().manual_seed(0))
    layer = sparse[0]
    with pytest.raises(ValueError, match=f"built for batch {BATCH}, got batch 1"):
        layer.index_key_rows(1, Q_LEN, cfg.index_head_dim, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"expected {Q_LEN} new tokens"):
        layer.index_key_rows(BATCH, Q_LEN + 1, cfg.index_head_dim, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected head_dim"):
        layer.index_key_rows(BATCH, Q_LEN, cfg.index_head_dim + 1, torch.device("cpu"))
    layer.index_key_rows(BATCH, Q_LEN, cfg.index_head_dim, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="already written for this step"):
        layer.update_index(torch.randn(BATCH, 1, Q_LEN, cfg.index_head_dim))
    full = next(layer for layer in cache.layers if not layer.is_sparse)
    with pytest.raises(ValueError, match="not a sparse layer"):
        full.index_key_rows(BATCH, Q_LEN, cfg.index_head_dim, torch.device("cpu"))


def test_fp8_index_pools_are_left_to_update_index():
    cfg = text_config()
    cache = M3PagedCache(cfg, BATCH, 40, page_size=PAGE, index_key_dtype=torch.float8_e4m3fn)
    layer = _step(cache, cfg, None, torch.Generator().manual_seed(0))[0]
    assert layer.index_key_rows(BATCH, Q_LEN, cfg.index_head_dim, torch.device("cpu")) == (None, None)
