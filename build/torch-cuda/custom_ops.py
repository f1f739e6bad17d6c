"""The public ops as ``torch.library`` custom ops with fake (meta) implementations.

Registered under this build's namespace (``_ops.NAMESPACE``), so ``torch.compile``
traces a call as one opaque node whose output shapes come from the fake
implementation: the ops' host-side validation and Python loops never reach the
graph, and ``fullgraph=True`` compiles code that calls them.

Each op is one schema (positional arguments, in the order given) over one ``api``
function; the attention ops return ``(out, lse)``. An op's ``max_seqlen_q`` of 0 or less
means "not given".
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import api
from ._ops import NAMESPACE
from .core.validate import default_out_dtype

_PAGED = "Tensor cu_seqlens_q, Tensor used_kv_lens"
_QUANT = "Tensor? q_scale=None, Tensor? k_scale=None, Tensor? v_scale=None, ScalarType? out_dtype=None"
_SPARSE = "Tensor q, Tensor k_cache, Tensor v_cache, Tensor selected, Tensor block_tables, " + _PAGED
SCHEMAS = {
    "index_topk": (
        "Tensor index_q, Tensor index_k_cache, Tensor block_tables, " + _PAGED + ", Tensor? index_k_scale, "
        "int topk, int block_size, int local_blocks, int max_seqlen_q, bool fp8_dot",
        "Tensor",
    ),
    "kvouter_attention": (
        _SPARSE + ", float softmax_scale, bool causal, int block_size, " + _QUANT + ", ScalarType? partial_dtype=None",
        "(Tensor, Tensor)",
    ),
    "sparse_decode_attention": (
        _SPARSE + ", float softmax_scale, bool causal, int block_size, " + _QUANT,
        "(Tensor, Tensor)",
    ),
    "sparse_attention": (
        _SPARSE + ", int max_seqlen_q, float softmax_scale, bool causal, int block_size, " + _QUANT
        + ", ScalarType? partial_dtype=None",
        "(Tensor, Tensor)",
    ),
    "qouter_attention": (
        _SPARSE + ", int max_seqlen_q, float softmax_scale, bool causal, int block_size, " + _QUANT,
        "(Tensor, Tensor)",
    ),
    "dense_paged_attention": (
        "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, " + _PAGED
        + ", float softmax_scale, bool causal, " + _QUANT,
        "(Tensor, Tensor)",
    ),
}


def _names(schema: str) -> list[str]:
    return [arg.split("=")[0].split()[-1] for arg in schema.split(", ")]


def _call(fn, names):
    """The op's implementation: its positional arguments passed to ``fn`` by name."""

    def impl(*args):
        kw = dict(zip(names, args))
        if kw.get("max_seqlen_q", 1) <= 0:
            kw["max_seqlen_q"] = None
        if fn is api.index_topk:
            if kw["index_k_scale"] is None:
                kw.pop("fp8_dot")  # only an fp8 cache takes the flag (and its scale)
            return fn(**kw)
        return fn(**kw, return_lse=True)

    return impl


def _fake(name, names):
    def fake(*args):
        kw = dict(zip(names, args))
        if name == "index_topk":
            q = kw["index_q"]
            return q.new_empty((q.shape[0], q.shape[1], kw["topk"]), dtype=torch.int32)
        q, out_dtype = kw["q"], kw.get("out_dtype")
        out_dtype = default_out_dtype(q.dtype) if out_dtype is None else out_dtype
        return q.new_empty(q.shape, dtype=out_dtype), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    return fake


def _register(name: str):
    args, returns = SCHEMAS[name]
    names = _names(args)
    op = custom_op(
        f"{NAMESPACE}::{name}", _call(getattr(api, name), names), mutates_args=(), schema=f"({args}) -> {returns}"
    )
    op.register_fake(_fake(name, names))
    return op


# What a caller of ``call`` may leave out: the op's "not given" values.
_CALL_DEFAULTS = {"max_seqlen_q": 0, "fp8_dot": False}
_SCALES = ("q_scale", "k_scale", "v_scale")


def call(name: str, **kwargs):
    """``api.<name>(**kwargs)`` through the op's custom op, for code that ``torch.compile``
    traces: the api's keywords; optional ones left out take the op's defaults, and float
    dequantization scales become fp32 tensors (the schema takes tensors). Returns what the
    op returns (the attention ops: ``(out, lse)``)."""
    op = _OPS[name]
    names = _names(SCHEMAS[name][0])
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"{name}: unexpected arguments {sorted(unknown)}")
    args = []
    for n in names:
        value = kwargs.get(n, _CALL_DEFAULTS.get(n))
        if n in _SCALES and value is not None and not isinstance(value, torch.Tensor):
            first = kwargs[names[0]]
            value = torch.full((1,), float(value), dtype=torch.float32, device=first.device)
        args.append(value)
    return op(*args)


index_topk_op = _register("index_topk")
kvouter_attention_op = _register("kvouter_attention")
sparse_decode_attention_op = _register("sparse_decode_attention")
sparse_attention_op = _register("sparse_attention")
qouter_attention_op = _register("qouter_attention")
dense_paged_attention_op = _register("dense_paged_attention")

_OPS = {
    "index_topk": index_topk_op,
    "kvouter_attention": kvouter_attention_op,
    "sparse_decode_attention": sparse_decode_attention_op,
    "sparse_attention": sparse_attention_op,
    "qouter_attention": qouter_attention_op,
    "dense_paged_attention": dense_paged_attention_op,
}
