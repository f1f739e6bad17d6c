"""No O(N^2) memory on the m3_sparse path: a long prompt through the whole model keeps
every single allocation far below one [N, N] fp32 score matrix of one head."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from m3_hf_attention import M3PagedCache
from model_utils import random_prompt, save_tiny_text_model

N = 8192
# One head's [N, N] fp32 scores would be 256 MiB. The chunked stages allocate at most
# ~(64 queries x 2048 keys x index dim) for the index scores, (512 entries x block x D)
# for the partials and (32 queries x 1024 keys x kv heads x D) for dense layers, plus
# O(N x topk) buffers (partials: N x Hkv x topk x G x D fp32 = 12 MiB here).
BOUND = 32 * 2**20


def largest_allocation(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def test_long_prompt_has_no_quadratic_intermediate(tmp_path):
    save_tiny_text_model(tmp_path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="m3_sparse").eval()
    ids = random_prompt(N, torch.Generator().manual_seed(0))[None]
    cache = M3PagedCache(model.config, 1, N + 8, page_size=64)

    def run():
        with torch.no_grad():
            model.model(input_ids=ids, past_key_values=cache, use_cache=True)

    start = time.perf_counter()
    peak = largest_allocation(run)
    elapsed = time.perf_counter() - start
    assert cache.sequence_lengths().tolist() == [N]
    assert 0 < peak < BOUND, f"largest single allocation {peak / 2**20:.1f} MiB (bound {BOUND / 2**20:.0f} MiB)"
    assert N * N * 4 >= 8 * BOUND  # the bound really excludes a quadratic buffer
    print(f"N={N}: largest allocation {peak / 2**20:.1f} MiB in {elapsed:.1f} s")
