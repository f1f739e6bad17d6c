"""The mask side of ``attn_implementation="m3_sparse"``.

Causality and block selection live in the kernels, so the mask function hands on the 2-D
padding mask unchanged (never a 4-D mask). The paged cache and the indexer run before the
attention function and see no mask argument: the mask function records the forward pass's
padding mask (``set_step_mask``), and they read it (``step_mask``) to learn how many of each
sequence's new tokens are real.
"""

from __future__ import annotations

import threading

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

from ..core.validate import debug_enabled

ATTN_IMPLEMENTATION = "m3_sparse"

# A second copy of this module (another kernel build loaded side by side) must not wrap the
# patched function again: the original is kept on the patch.
_ORIGINAL_CREATE_CAUSAL_MASK = getattr(m3.create_causal_mask, "m3_sparse_original", m3.create_causal_mask)


def uses_m3_sparse(config) -> bool:
    """Whether ``config`` runs m3_sparse: under its registered name, or under a hub string
    (``"org/m3-sparse:m3_sparse_attention"``) that transformers mapped to this package's
    attention function."""
    impl = getattr(config, "_attn_implementation", None)
    if impl == ATTN_IMPLEMENTATION:
        return True
    if not isinstance(impl, str) or "/" not in impl:
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return bool(getattr(ALL_ATTENTION_FUNCTIONS.get(impl), "is_m3_sparse_attention", False))


# The padding mask of the forward pass being run, per thread. (A side channel: the cache and
# the indexer get no mask argument from transformers.)
_STEP = threading.local()


def set_step_mask(mask: torch.Tensor | None) -> None:
    """Record the 2-D padding mask of the forward pass being run (set by the m3_sparse
    mask function, which transformers calls once per forward before the layers)."""
    _STEP.mask = mask


def step_mask() -> torch.Tensor | None:
    return getattr(_STEP, "mask", None)


def new_token_layout(mask: torch.Tensor | None, batch: int, total: int, q_len: int, device):
    """(leading pads, real tokens) among each sequence's ``q_len`` new tokens, both [B] int64.

    The new tokens of a row must be ``[pad]*lead + [real]*n + [pad]*rest``: left and
    right padding both work; a pad between real tokens is rejected (checked where
    reading the mask is free: on the CPU or with ``M3_SPARSE_DEBUG=1``).
    """
    if mask is None or tuple(mask.shape) != (batch, total):
        full = torch.full((batch,), q_len, dtype=torch.int64, device=device)
        return torch.zeros_like(full), full
    new = mask[:, -q_len:].to(device=device, dtype=torch.bool)
    n = new.sum(-1)
    lead = torch.where(n > 0, new.to(torch.int8).argmax(-1), q_len).to(torch.int64)
    if new.device.type == "cpu" or debug_enabled():
        idx = torch.arange(q_len, device=new.device)
        expected = (idx[None, :] >= lead[:, None]) & (idx[None, :] < (lead + n)[:, None])
        if not bool((expected == new).all()):
            raise ValueError(
                "M3PagedCache: the new tokens of a row have padding between real tokens; expected left or right "
                "padding only"
            )
    return lead, n


def create_causal_mask(*args, **kwargs):
    """``create_causal_mask`` of the M3 model while this package is loaded.

    Loading the attention function from the hub pairs it with one of transformers' own
    mask functions (sdpa's for ``"org/m3-sparse"``, flash-attention's for
    ``"org/m3-sparse:m3_sparse_attention"``): a 4-D mask, or a host read of the mask,
    and no record of padding for the paged cache. The first mask built for such a model
    registers :func:`m3_sparse_mask` under its hub string instead.
    """
    config = kwargs.get("config", args[0] if args else None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION and uses_m3_sparse(config):
        if ALL_MASK_ATTENTION_FUNCTIONS.get(impl) is not m3_sparse_mask:
            AttentionMaskInterface.register(impl, m3_sparse_mask)
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
    mask = None if attention_mask is None else attention_mask.to(torch.bool)
    set_step_mask(mask)
    return mask
