"""Tensor parallelism over attention heads for ``m3_sparse``.

transformers 5.17's plan for M3 (``MiniMaxM3VLTextConfig.base_model_tp_plan``) shards the
q/k/v projections column-wise but gathers their outputs (``colwise_gather_output``), and
``o_proj`` re-splits its input: every rank computes the attention of all heads and would
cache all of them. The indexer is not in that plan at all, and the stock indexer reshapes
with the global ``index_n_heads``, so sharding it breaks the eager/sdpa paths.

While ``m3_sparse`` is the model's attention implementation the plan is rewritten to shard
heads instead (Megatron style, one all-reduce per attention block in ``o_proj``):

========================================  ==========  ==========================================
module                                    style       on each of the ``tp`` ranks
========================================  ==========  ==========================================
``layers.*.self_attn.q_proj``             colwise     ``Hq / tp`` query heads
``layers.*.self_attn.k_proj``/``v_proj``  colwise     ``Hkv / tp`` KV heads (the matching groups)
``layers.*.self_attn.indexer.q_proj``     colwise     ``Hi / tp`` index query heads
``layers.*.self_attn.indexer.k_proj``     (none)      the one shared index key head, replicated
``layers.*.self_attn.o_proj``             rowwise     partial output, all-reduced
``layers.*.self_attn``                    m3 check    load-time check of the head counts
========================================  ==========  ==========================================

Column shards are contiguous, so rank ``r`` holds KV heads ``r*Hkv/tp ..`` and exactly the
query heads of those GQA groups and their index heads: the attention function, the index
branch and :class:`~m3_hf_attention.M3PagedCache` (which sizes its pools from the first K/V
it is handed) all work per rank on local tensors, with no communication of their own.
RMSNorm weights act on one head's ``head_dim`` and stay replicated.
"""

from __future__ import annotations

import math
import re

import torch
from transformers.distributed.tensor_parallel import ParallelInterface, TensorParallelLayer
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

from .impl import uses_m3_sparse

HEAD_CHECK_STYLE = "m3_sparse_heads"
_SELF_ATTN = re.compile(r"^(?P<prefix>.*\bself_attn)\.(?P<proj>[qkvo])_proj$")


def supported_tp_sizes(config) -> list[int]:
    """TP sizes that split every head count of ``config`` evenly: the divisors of
    gcd(num_attention_heads, num_key_value_heads[, index_n_heads])."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    counts = [text.num_attention_heads, text.num_key_value_heads]
    if "minimax_m3_sparse" in (getattr(text, "layer_types", None) or []):
        counts.append(text.index_n_heads)
    g = math.gcd(*counts)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_tp_size(config, tp_size: int) -> None:
    """Raise a ValueError naming the supported sizes unless ``tp_size`` splits the heads evenly."""
    sizes = supported_tp_sizes(config)
    if tp_size not in sizes:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        index = ""
        if "minimax_m3_sparse" in (getattr(text, "layer_types", None) or []):
            index = f", index_n_heads={text.index_n_heads}"
        raise ValueError(
            f"m3_sparse tensor parallel: tp_size={tp_size} does not divide the heads of this model "
            f"(num_attention_heads={text.num_attention_heads}, num_key_value_heads={text.num_key_value_heads}{index}); "
            f"each rank must hold whole KV heads with their query and index heads. Supported tp sizes: "
            f"{', '.join(map(str, sizes))}."
        )


def head_parallel_plan(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with its attention entries (``...self_attn.{q,k,v,o}_proj``, any prefix)
    replaced by the head-parallel ones of this module; other entries (MoE experts,
    ``lm_head``) are kept. Usable on a model's full ``tp_plan`` too, e.g. for
    ``DistributedConfig(tp_plan=head_parallel_plan(...))``."""
    out: dict[str, str] = {}
    for key, style in plan.items():
        match = _SELF_ATTN.match(key)
        if match is None:
            out[key] = style
            continue
        prefix = match["prefix"]
        out[key] = "rowwise" if match["proj"] == "o" else "colwise"
        out[f"{prefix}.indexer.q_proj"] = "colwise"
        out[prefix] = HEAD_CHECK_STYLE
    return out


class HeadCountCheck(TensorParallelLayer):
    """The style of each attention module: fails the load with a clear message, before any
    of its weights is sharded, when the TP size would cut a head in two. Forward is untouched."""

    def install_forward(self, module, mesh, **kwargs):
        # 5.25 adds keyword-only config / mesh_manager arguments; neither is needed here.
        check_tp_size(module.config, mesh.size())
        return module


def _init_parallel_plans(original):
    def init_parallel_plans(self):
        original(self)
        if uses_m3_sparse(self.config) and self._tp_plan:
            self._tp_plan = head_parallel_plan(self._tp_plan)

    init_parallel_plans.__wrapped__ = original
    return init_parallel_plans


_REGISTERED = False


def register() -> None:
    """Register the head-count check style and make the M3 text model use the head-parallel
    plan whenever it is built with ``m3_sparse`` (so ``tp_plan="auto"`` picks it). Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    if torch.distributed.is_available():  # transformers registers no TP style otherwise
        ParallelInterface.register(HEAD_CHECK_STYLE, HeadCountCheck())
    cls = m3.MiniMaxM3VLTextModel
    cls.init_parallel_plans = _init_parallel_plans(cls.init_parallel_plans)
    _REGISTERED = True


__all__ = ["HeadCountCheck", "check_tp_size", "head_parallel_plan", "register", "supported_tp_sizes"]
