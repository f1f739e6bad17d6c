"""The name ``m3_sparse`` and how to tell that a model config runs it."""

from __future__ import annotations

ATTN_IMPLEMENTATION = "m3_sparse"


def uses_m3_sparse(config) -> bool:
    """Whether ``config`` runs m3_sparse: under its registered name, or under a hub string
    (``"org/m3-sparse:m3_sparse_attention"``) that transformers mapped to this package's
    attention function."""
    return names_m3_sparse(getattr(config, "_attn_implementation", None))


def names_m3_sparse(impl) -> bool:
    """Whether the attention implementation ``impl`` is m3_sparse: its registered name, or a
    hub string registered with this package's attention function."""
    if impl == ATTN_IMPLEMENTATION:
        return True
    if not isinstance(impl, str) or "/" not in impl:
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return bool(getattr(ALL_ATTENTION_FUNCTIONS.get(impl), "is_m3_sparse_attention", False))
