"""The mask side of ``attn_implementation="m3_sparse"``.

Causality and block selection live in the kernels, so the mask function hands on the 2-D
padding mask unchanged (never a 4-D mask). The paged cache and the indexer run before the
attention function and get no mask argument: the model's ``create_causal_mask``, wrapped
here, hands the padding mask of each forward pass to an ``M3PagedCache``
(``begin_step``). With any other cache, or none, it records the mask per thread
(``set_step_mask``) for the eager path that pages a contiguous history.
"""

from __future__ import annotations

import threading

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

from . import compat, serving
from .cache import M3PagedCache, new_token_layout
from .impl import ATTN_IMPLEMENTATION, uses_m3_sparse

# A second copy of this module (another kernel build loaded side by side) must not wrap the
# patched function again: the original is kept on the patch.
_ORIGINAL_CREATE_CAUSAL_MASK = getattr(m3.create_causal_mask, "m3_sparse_original", m3.create_causal_mask)

# The padding mask of the forward pass being run without a paged cache, per thread.
_STEP = threading.local()


def set_step_mask(mask: torch.Tensor | None) -> None:
    """Record the 2-D padding mask of the forward pass being run without an
    ``M3PagedCache`` (set by the wrapped ``create_causal_mask`` before the layers)."""
    _STEP.mask = mask


def step_mask() -> torch.Tensor | None:
    return getattr(_STEP, "mask", None)


def create_causal_mask(*args, **kwargs):
    """``create_causal_mask`` of the M3 model while this package is loaded.

    Loading the attention function from the hub pairs it with one of transformers' own
    mask functions (sdpa's for ``"org/m3-sparse"``, flash-attention's for
    ``"org/m3-sparse:m3_sparse_attention"``): a 4-D mask, or a host read of the mask,
    and no record of padding for the paged cache. The first mask built for such a model
    registers :func:`m3_sparse_mask` under its hub string instead. Under continuous batching
    (``paged|`` + the hub string) it hands the name to ``serving.claim``: the serving
    attention function and no mask.
    """
    config = kwargs.get("config", args[0] if args else None)
    impl = getattr(config, "_attn_implementation", None)
    if serving.uses_paged_m3_sparse(config):
        serving.claim(impl)  # a hub string switched to continuous batching
    elif uses_m3_sparse(config):
        if impl != ATTN_IMPLEMENTATION and ALL_MASK_ATTENTION_FUNCTIONS.get(impl) is not m3_sparse_mask:
            AttentionMaskInterface.register(impl, m3_sparse_mask)
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        cache = compat.mask_cache(args, kwargs)
        if isinstance(cache, M3PagedCache):
            embeds = kwargs.get("inputs_embeds", args[1] if len(args) > 1 else None)
            cache.begin_step(mask, embeds.shape[1], device=embeds.device, config=config)
        else:
            set_step_mask(None if mask is None else mask.to(torch.bool))
    return _ORIGINAL_CREATE_CAUSAL_MASK(*args, **kwargs)


create_causal_mask.m3_sparse_original = _ORIGINAL_CREATE_CAUSAL_MASK


def m3_sparse_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of ``m3_sparse``: causality and block selection live in the kernels,
    so only the 2-D padding mask travels on (``None`` when there is none)."""
    if mask_function is not None and mask_function is not causal_mask_function:
        # transformers composes extra rules (packed sequences, overlays) into mask_function;
        # the kernels implement plain causal attention only.
        raise ValueError(
            "m3_sparse supports plain causal masks with padding; packed sequences (position_ids restarting "
            "without an attention mask) and custom mask overlays are not supported. Pad the batch instead."
        )
    return None if attention_mask is None else attention_mask.to(torch.bool)
