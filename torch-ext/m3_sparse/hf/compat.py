"""Every difference between the transformers and kernels releases this package supports.

Supported: transformers 5.17 through 5.25, kernels 0.16.2 through 0.19.x. One function (or
constant) per difference, each naming the release that changed it; the rest of ``hf/``
calls these instead of testing versions itself.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

TRANSFORMERS = Version(transformers.__version__).release


def transformers_at_least(*release: int) -> bool:
    """Whether the installed transformers is ``release`` (e.g. ``(5, 25)``) or newer."""
    return TRANSFORMERS >= release


# ---------------------------------------------------------------------------------------
# the model path (attention, indexer, masks, generate())
# ---------------------------------------------------------------------------------------
# 5.24 renamed the models' and generate()'s ``past_key_values`` keyword to ``cache`` (the old
# name is deprecated until 5.40): the decoder layers call the attention module with
# ``cache=``, generate() keeps the cache in ``model_kwargs["cache"]`` and hands
# ``create_masks_for_generate`` / ``create_causal_mask`` a ``cache`` argument.
CACHE_KEYWORD = "cache" if transformers_at_least(5, 24) else "past_key_values"


def pop_cache(args: tuple, kwargs: dict):
    """The cache of an attention module's call, taken out of what the caller passed after the
    attention mask: positionally (``args[0]``) or by keyword. From 5.24 the module's cache is
    ``cache`` (``past_key_values`` still accepted); up to 5.23 it is ``past_key_values``, and a
    ``cache`` keyword is the continuous-batching manager's, which transformers' paged attention
    functions read from the keywords: it stays there. ``kwargs`` loses the module's keyword; the
    caller passes the cache on positionally, which every release reads the same way."""
    if len(args) > 1:
        raise TypeError(f"attention forward: expected at most one positional argument after the mask, got {len(args)}")
    cache = args[0] if args else None
    for name in ("cache", "past_key_values"):
        if name == "cache" and CACHE_KEYWORD != "cache":
            continue
        value = kwargs.pop(name, None)
        if value is not None:
            if cache is not None:
                raise TypeError(f"attention forward: got the cache twice (positionally and as {name!r})")
            cache = value
    return cache


def mask_cache(args: tuple, kwargs: dict):
    """The cache argument of ``create_causal_mask`` / ``create_masks_for_generate`` (the
    fourth parameter of both on every release: ``past_key_values`` up to 5.23, ``cache``
    from 5.24), positional or by keyword."""
    if len(args) > 3:
        return args[3]
    return kwargs.get(CACHE_KEYWORD, kwargs.get("past_key_values"))


def generation_cache(model_kwargs: dict):
    """The cache generate() carries in its ``model_kwargs`` (the key is the 5.24 rename's)."""
    return model_kwargs.get(CACHE_KEYWORD)


def set_generation_cache(model_kwargs: dict, cache) -> None:
    model_kwargs[CACHE_KEYWORD] = cache



# ---------------------------------------------------------------------------------------
# continuous batching (hf/serving.py)
# ---------------------------------------------------------------------------------------
# 5.18 rebuilt the continuous-batching cache (``generation/continuous_batching/cache.py``):
# one allocator per layer type (``cache_allocators/``, looked up in
# ``cache.ATTN_TYPE_TO_ALLOCATOR``) carves blocks out of sectors of one byte tensor. Up to 5.17
# the cache grouped the layers itself into ``key_cache`` / ``value_cache`` tensors and took full
# and sliding attention only. ``hf/serving_allocator.py`` serves the first design,
# ``hf/serving_groups.py`` the second.
CB_ALLOCATORS = transformers_at_least(5, 18)

# The attention implementation continuous batching runs a model under. Up to 5.18 the manager
# switches a model loaded with ``X`` to ``paged|X`` (``switch_to_cb_friendly_attn``, undone by
# ``stop()``), a registered implementation. 5.19 dropped that: ``from_pretrained`` and
# ``AttentionInterface`` drop a ``paged|`` prefix (but on ``paged|eager``) and the switch refuses
# all but ``paged|eager``, ``sdpa`` and flash attention. Until 5.24 the model's
# ``create_causal_mask`` sees no cache in a step (the manager's travels as a keyword beside it),
# takes the step's restarting ``position_ids`` for packed sequences and composes a mask that
# m3_sparse's mask function refuses; so 5.19-5.23 serve under a name of this package's with no
# mask function, for which ``masking_utils`` builds no mask. 5.24 hands ``create_causal_mask``
# the manager's cache (the ``cache`` rename) and builds no mask for it: the model keeps its name.
CB_PAGED_NAMES = not transformers_at_least(5, 19)
CB_KEEPS_NAME = transformers_at_least(5, 24)
CB_SERVING_NAME = "m3_sparse_serving"


def cb_attn_implementation(impl: str) -> str:
    """The attention implementation a model loaded with ``impl`` (``m3_sparse`` or a hub string
    of this package) runs under continuous batching."""
    if CB_PAGED_NAMES:
        return f"paged|{impl}"
    return impl if CB_KEEPS_NAME else CB_SERVING_NAME


# 5.19: ``group_layers_by_attn_type`` accepts the layer types of ``ATTN_TYPE_TO_ALLOCATOR``; 5.18
# checked a fixed set (full and sliding attention), so a registered allocator alone did not let
# its layer type through.
CB_GROUPS_FROM_REGISTRY = transformers_at_least(5, 19)


def cb_manager_cache(cache, kwargs: dict):
    """The continuous-batching manager's cache in an attention module's call (None outside a
    step): the manager passes it as the model's ``cache`` keyword, which 5.24 made the models'
    cache argument (the module's ``cache``); up to 5.23 it travels in the keywords beside the
    module's ``past_key_values=None`` (for the paged attention functions that read it)."""
    return cache if transformers_at_least(5, 24) else kwargs.get("cache")


def cb_step_max_lengths(kwargs: dict):
    """A continuous-batching step's longest new-token run and key history, as the manager passes
    them to the model: 5.19 renamed the keywords ``max_seqlen_q`` / ``max_seqlen_k`` to
    ``max_length_q`` / ``max_length_k``. The key length is an int, or a dict by layer type."""
    if "max_length_q" in kwargs:
        return kwargs["max_length_q"], kwargs["max_length_k"]
    return kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]


def cb_allocator_states(states: torch.Tensor) -> torch.Tensor:
    """New key or value states ``[T, Hkv, D]`` (one packed row) in the layout a cache allocator's
    ``update`` takes: 5.19 moved the transpose into ``PagedAttentionCache.update`` (the allocators
    take ``[T, Hkv, D]``); in 5.18 they took the model's ``[1, Hkv, T, D]``."""
    return states if transformers_at_least(5, 19) else states.transpose(0, 1)[None]


# 5.18 renamed ``ContinuousBatchingConfig.block_size`` (tokens per block of a request's table) to
# ``page_size`` (tokens per page: a block holds one page per layer); ``block_size`` stays as a
# deprecated alias that logs a warning.
CB_PAGE_SIZE_FIELD = "page_size" if CB_ALLOCATORS else "block_size"


def cb_tokens_per_page(cb_config) -> int:
    """A ``ContinuousBatchingConfig``'s tokens per page (``CB_PAGE_SIZE_FIELD``)."""
    return getattr(cb_config, CB_PAGE_SIZE_FIELD)


def cb_max_requests(cb_config) -> int:
    """The request rows of the manager's step inputs: ``max_requests_per_batch``, or
    transformers' fallback where it is not resolved yet (the memory handler sees it before)."""
    from transformers.generation.continuous_batching import initialization

    return cb_config.max_requests_per_batch or initialization.FALLBACK_DEFAULTS["max_requests_per_batch"]


def cb_pool_tokens(cache, cb_config) -> int:
    """The tokens one request can hold in an empty continuous-batching cache, in pages of
    ``cb_tokens_per_page`` tokens. Up to 5.17: its whole-model blocks (``num_blocks``). From
    5.18 (``CB_ALLOCATORS``) the cache is sectors that each allocator cuts into blocks of its
    own (``blocks_per_sector``), and a request takes whole sectors for each allocator: the
    most pages ``b`` with the sum over allocators of ``ceil(b / blocks_per_sector)`` within
    ``num_sectors``. (``num_blocks`` counts whole-model blocks of bytes, which 5.18-5.24 take as
    K/V alone, without M3's index keys; and it ignores the rounding to sectors.)"""
    pages = cache.num_blocks
    if CB_ALLOCATORS:
        per_sector = [a.blocks_per_sector for a in cache.cache_allocators.values()]

        def fits(b: int) -> bool:
            return sum(-(-b // n) for n in per_sector) <= cache.num_sectors

        lo, hi = 0, cache.num_sectors * max(per_sector)  # fits(lo); the answer is at most hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        pages = lo
    return pages * cb_tokens_per_page(cb_config)


def cb_resolve_memory_percent(cb_config, has_logit_processors: bool, device) -> None:
    """``initialization.resolve_max_memory_percent``: 5.21 gave it the device (0.6 of the free
    memory on the CPU and MPS, whose memory the host shares); before, it took none."""
    from transformers.generation.continuous_batching import initialization

    if transformers_at_least(5, 21):
        initialization.resolve_max_memory_percent(cb_config, has_logit_processors, device=device)
    else:
        initialization.resolve_max_memory_percent(cb_config, has_logit_processors)


def cb_check_bounds(cb_config) -> None:
    """``initialization.check_cb_values_bounds``, added in 5.18 (a page holds at least 4 tokens)."""
    from transformers.generation.continuous_batching import initialization

    if CB_ALLOCATORS:
        initialization.check_cb_values_bounds(cb_config)
