"""What the package launches on each GPU, found by running its ops, with no GPU.

``tests/kernels/test_gpu_compile.py`` runs this file in fresh interpreters (no
``TRITON_INTERPRET``). For a GPU of a given compute capability it sets the capability override
(``M3_SPARSE_CAPABILITY``, ``core/launch.py``) to it, gives Triton a stand-in driver whose
current target is that GPU, and runs the public ops (``calls()``: every op, in each dtype and
launch mode its launchers distinguish) on tensors that say they live on ``cuda:0`` but hold no
memory (meta tensors, ``fake_cuda``). So dispatch and the launchers choose exactly what they
would on that GPU, and every Triton launch is caught on its way there: its kernel, with the
launcher's own arguments and constants, makes the list of (kernel, variant) of the GPU. A new
kernel or variant is on it as soon as an op launches it. Nothing here chooses a kernel.

Modes (argv after the torch-ext folder):
  ``record ARCH...``: for each target's capability, which kernels each call launches (no
  compiling) or why the ops refused the call, and every Triton kernel the package defines;
  ``compile ARCH SHARD SHARDS``: compile the distinct launches of the capabilities the target
  stands for (this shard's share) with Triton's own launch path, stopped before the launch,
  and report each kernel's shared memory and the capabilities that launch it.

The result is one line, ``RESULT <json>``, on stdout.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import time
import warnings
from dataclasses import dataclass

# Compile targets: the capability Triton compiles for, the capabilities it stands for (Triton
# generates the same code for each; the package's choices may differ where they follow the
# shared memory a GPU has: sm_86 has 99 KB, sm_80 163 KB) and an SM count of such a GPU (split
# counts depend on it).
@dataclass(frozen=True)
class Target:
    arch: int
    stands_for: tuple[tuple[int, int], ...]
    sms: int

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.arch, 10)


TARGETS = {
    80: Target(80, ((8, 0), (8, 6), (8, 7)), 108),  # A100, RTX 30xx / A6000, Orin
    89: Target(89, ((8, 9),), 142),  # L40S, RTX 40xx
    90: Target(90, ((9, 0),), 132),  # H100, H200 (sm_90a)
    100: Target(100, ((10, 0), (10, 3)), 148),  # B200, B300
    120: Target(120, ((12, 0), (12, 1)), 170),  # RTX 50xx, GB10
}

BF16 = FP16 = FP32 = FP8 = INT32 = None  # torch dtypes, set by main()


# --------------------------------------------------------------------------- tensors on "cuda:0"
def fake_cuda():
    """A torch function mode in which tensors made for (or from) a CUDA device are meta tensors
    that report ``cuda:0``: shapes, strides and dtypes without memory or a GPU."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    cuda0, meta = torch.device("cuda", 0), torch.device("meta")

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return cuda0

        @property
        def is_cuda(self):
            return True

        def data_ptr(self):
            return 0  # every tensor 16-byte aligned, as the caching allocator gives them

    def is_cuda(v):
        return (isinstance(v, torch.device) and v.type == "cuda") or (isinstance(v, str) and v.startswith("cuda"))

    def unwrap(x):
        if isinstance(x, OnCuda):
            with torch._C.DisableTorchFunctionSubclass():
                return x.as_subclass(torch.Tensor)
        return meta if is_cuda(x) else x

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, OnCuda) and x.is_meta:
            return x.as_subclass(OnCuda)
        return x

    class FakeCuda(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            args, kwargs = tree_map(unwrap, (args, kwargs or {}))
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return tree_map(wrap, out)

    return FakeCuda()


class StandInDriver:
    """Triton's driver for a GPU that is not there: device 0, stream 0, the compile target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


# --------------------------------------------------------------------------- the calls
def cuda(*shape, dtype=None):
    import torch

    return torch.empty(shape, dtype=dtype or BF16, device="cuda:0")


@dataclass(frozen=True)
class Batch:
    """``b`` sequences of ``s`` new tokens each over block tables of ``w`` pages of ``p`` slots."""

    b: int
    s: int
    p: int = 64
    w: int = 64

    @property
    def meta(self) -> dict:
        return dict(cu_seqlens_q=cuda(self.b + 1, dtype=INT32), used_kv_lens=cuda(self.b, dtype=INT32))

    @property
    def tables(self):
        return cuda(self.b, self.w, dtype=INT32)

    def pool(self, hkv: int, d: int, dtype=None):
        return cuda(self.b * self.w + 1, hkv, self.p, d, dtype=dtype)


def scales(q_dtype, kv_dtype) -> dict:
    out = {}
    if q_dtype == FP8:
        out["q_scale"] = 0.5
    if kv_dtype == FP8:
        out.update(k_scale=0.25, v_scale=0.125)
    return out


def attention(op, batch: Batch, *, hq=64, hkv=4, d=128, topk=16, block=128, q=None, kv=None, sparse=True, **kw):
    """One attention op call (M3's shapes by default)."""
    q, kv = q or BF16, kv or q or BF16
    args = [cuda(batch.b * batch.s, hq, d, dtype=q), batch.pool(hkv, d, kv), batch.pool(hkv, d, kv)]
    if sparse:
        args.append(cuda(batch.b * batch.s, hkv, topk, dtype=INT32))
        kw["block_size"] = block
    args.append(batch.tables)
    if "max_seqlen_q" in inspect.signature(op).parameters:
        kw["max_seqlen_q"] = batch.s
    return op(*args, **batch.meta, **scales(q, kv), **kw)


def index(batch: Batch, *, heads=4, d=128, topk=16, block=128, q=None, k=None, per_token=True, **kw):
    """One ``index_topk`` call (M3's index branch by default); fp8 keys with their scales."""
    import m3_sparse

    k = k or q or BF16
    if k == FP8:
        kw["index_k_scale"] = cuda(batch.b * batch.w + 1, batch.p, dtype=FP32) if per_token else cuda(1, dtype=FP32)
    return m3_sparse.index_topk(
        cuda(batch.b * batch.s, heads, d, dtype=q or BF16), cuda(batch.b * batch.w + 1, batch.p, d, dtype=k),
        batch.tables, **batch.meta, topk=topk, block_size=block, max_seqlen_q=batch.s, **kw,
    )


def build_index(batch: Batch, *, hkv=1, topk=16, block=128):
    """KV-outer's first stage alone (``kvouter_attention`` runs it on CUDA tensors)."""
    from m3_sparse.kvouter.build_triton import build_kvouter_index_triton

    return build_kvouter_index_triton(
        cuda(batch.b * batch.s, hkv, topk, dtype=INT32), cu_seqlens_q=batch.meta["cu_seqlens_q"],
        max_blocks=batch.w * batch.p // block, batch_size=batch.b,
    )


def prep(batch: Batch, dtype, *, heads=4, d=128, rotary=64, into_pool=False):
    import m3_sparse

    kw = {}
    if into_pool:
        kw = dict(k_out=cuda(batch.b * batch.w * batch.p, d, dtype=dtype), k_rows=cuda(batch.b * batch.s, dtype=INT32))
    return m3_sparse.index_prep(
        cuda(batch.b, batch.s, heads, d, dtype=dtype), cuda(batch.b, batch.s, d, dtype=dtype), cuda(d, dtype=dtype),
        cuda(d, dtype=dtype), cuda(1, batch.s, rotary, dtype=dtype), cuda(1, batch.s, rotary, dtype=dtype), eps=1e-6,
        **kw,
    )


@contextlib.contextmanager
def fa4_installed():
    """flash-attn-4 (not Triton: nothing of it is compiled here) as if installed, so that dense
    calls go where dispatch sends them on a GPU that has it."""
    from m3_sparse.dense import attention_fa4

    saved = attention_fa4.varlen_function, attention_fa4.forward
    attention_fa4.varlen_function = lambda: object()
    attention_fa4.forward = lambda args, *rest: (args.new_outputs()[0], cuda(args.hq, args.num_tokens, dtype=FP32))
    try:
        yield
    finally:
        attention_fa4.varlen_function, attention_fa4.forward = saved


@dataclass(frozen=True)
class Call:
    """One op call: ``fp8`` calls have e4m3 inputs; ``gluon`` calls pin the Gluon kernel;
    ``smem`` calls pin the tl KV-outer kernel on a block that needs more shared memory than
    a 99 KB GPU has."""

    run: object
    fp8: bool = False
    gluon: bool = False
    smem: bool = False


def calls() -> dict[str, Call]:
    """Every op, in each dtype and launch mode its launchers distinguish (M3's shapes unless
    named). The ops choose the kernel and its variant; a call only sets shapes and options."""
    import m3_sparse
    from m3_sparse import DecodeConfig, DenseConfig, IndexConfig, KVOuterConfig

    sparse, decode_op = m3_sparse.sparse_attention, m3_sparse.sparse_decode_attention
    kvouter, dense = m3_sparse.kvouter_attention, m3_sparse.dense_paged_attention
    qouter = m3_sparse.qouter_attention
    decode, step_chunk, prefill = Batch(4, 1), Batch(2, 64), Batch(2, 512)
    long = Batch(16, 4096, w=128)  # enough row tiles to fill the GPU: no key splits
    long128 = Batch(16, 4096, p=128, w=64)
    many = Batch(256, 1)  # enough (token, KV head) pairs to fill the GPU: one split
    # Prompts of another length (509 tokens each, not a multiple of 16) over block tables of
    # another width (42 pages, not a multiple of 16; a serving step's tables are as wide as its
    # longest history); for KV-outer, whose index build sees every prefill row of a step, one
    # prompt more (252 segments of 4 heads x 3 prompts x 21 blocks, not a multiple of 16
    # either); decode steps of another batch size over tables of another width.
    other, other_rows, other_decode = Batch(2, 509, w=42), Batch(3, 509, w=42), Batch(20, 1, w=42)
    return {
        # index branch: prep
        "index prep, bf16, keys into the pool": Call(lambda: prep(prefill, BF16, into_pool=True)),
        "index prep, bf16, a decode step's keys into the pool": Call(lambda: prep(decode, BF16, into_pool=True)),
        "index prep, fp16": Call(lambda: prep(prefill, FP16)),
        "index prep, fp32": Call(lambda: prep(prefill, FP32, heads=2, d=64, rotary=32)),
        # index branch: top-k
        "index top-k prefill (key splits and their merge)": Call(lambda: index(prefill)),
        "index top-k long prefill": Call(lambda: index(long)),
        "index top-k prefill, a prompt of another length": Call(lambda: index(other)),
        "index top-k decode (key splits and their merge)": Call(lambda: index(decode)),
        "index top-k decode, another batch": Call(lambda: index(other_decode)),
        "index top-k decode, key-major": Call(lambda: index(decode, config=IndexConfig(key_major=True))),
        "index top-k fp16, pages of 128, top-32": Call(lambda: index(Batch(2, 512, p=128), q=FP16, topk=32)),
        "index top-k fp32": Call(lambda: index(prefill, q=FP32, d=64)),
        "index top-k fp8 keys, per-token scales, fp8 dot": Call(lambda: index(long, k=FP8, fp8_dot=True), fp8=True),
        "index top-k fp8 keys, one scale, fp8 dot": Call(
            lambda: index(long, k=FP8, per_token=False, fp8_dot=True), fp8=True),
        "index top-k fp8 keys, one scale, fp8 dot, tl kernel": Call(
            lambda: index(long, k=FP8, per_token=False, fp8_dot=True, config=IndexConfig(engine="triton")), fp8=True),
        "index top-k fp8 keys, widened": Call(lambda: index(long, k=FP8, per_token=False), fp8=True),
        "index top-k decode, fp8 keys, per-token scales, fp8 dot": Call(
            lambda: index(decode, k=FP8, fp8_dot=True), fp8=True),
        "index top-k decode, fp8 keys, one scale, fp8 dot": Call(
            lambda: index(decode, k=FP8, per_token=False, fp8_dot=True), fp8=True),
        "index top-k decode, fp8 keys, widened": Call(lambda: index(decode, k=FP8), fp8=True),
        "index top-k decode, fp8 keys, widened, key-major": Call(
            lambda: index(decode, k=FP8, config=IndexConfig(key_major=True)), fp8=True),
        "index top-k, Gluon, bf16 keys": Call(lambda: index(long, config=IndexConfig(engine="tma")), gluon=True),
        "index top-k, Gluon, fp8 keys with per-token scales": Call(
            lambda: index(long128, k=FP8, fp8_dot=True, config=IndexConfig(engine="tma")), fp8=True, gluon=True),
        "index top-k, Gluon, top-4 with two local blocks": Call(
            lambda: index(long128, topk=4, local_blocks=2, config=IndexConfig(engine="tma")), gluon=True),
        # sparse attention: the decode kernel
        "sparse decode (key splits, merged in place)": Call(lambda: attention(sparse, decode)),
        "sparse decode, another batch": Call(lambda: attention(sparse, other_decode)),
        "sparse decode, merge kernel": Call(lambda: attention(decode_op, decode, config=DecodeConfig(fused_merge=False))),
        "sparse decode, one split": Call(lambda: attention(sparse, many)),
        "sparse decode, 64-row chunks": Call(lambda: attention(sparse, step_chunk)),
        "sparse decode, fp16, G = 64, pages of 16, blocks of 64": Call(
            lambda: attention(sparse, Batch(4, 1, p=16, w=256), hq=64, hkv=1, block=64, topk=32, q=FP16)),
        "sparse decode, fp32, D = 96": Call(lambda: attention(sparse, decode, hq=4, hkv=4, d=96, q=FP32)),
        "sparse decode, fp8 q/K/V": Call(lambda: attention(sparse, decode, q=FP8), fp8=True),
        "sparse decode, fp8 K/V, bf16 q": Call(lambda: attention(sparse, decode, kv=FP8), fp8=True),
        "sparse decode, fp8 q/K/V, one split": Call(lambda: attention(sparse, many, q=FP8), fp8=True),
        # sparse attention: KV-outer (index build, schedule, partials, combine)
        # (Two sequences: the decode kernel's short-row variant launches beside KV-outer.)
        "sparse prefill (KV-outer)": Call(lambda: attention(sparse, prefill)),
        "sparse prefill (KV-outer), prompts of another length and count": Call(lambda: attention(sparse, other_rows)),
        "sparse prefill, fp8 q/K/V": Call(lambda: attention(sparse, prefill, q=FP8), fp8=True),
        "KV-outer, tl partials": Call(lambda: attention(kvouter, prefill, config=KVOuterConfig(engine="triton"))),
        "KV-outer, fp16, G = 3, D = 64, bidirectional": Call(
            lambda: attention(kvouter, Batch(2, 512, p=16, w=256), hq=12, hkv=4, d=64, block=64, q=FP16, causal=False)),
        # The index build over 128 slots per row (its loops run at run time past 64). Only the
        # build: the combine kernel unrolls its loop over the slots, and at 128 ptxas takes
        # minutes on it, for a top-k M3 never uses.
        "KV-outer index build, 128 slots per row": Call(lambda: build_index(Batch(2, 256), topk=128, block=16)),
        "KV-outer, int64 sort keys (a very wide block table)": Call(
            lambda: attention(kvouter, Batch(1, 64, w=1 << 23), hq=16, hkv=1)),
        "KV-outer, fp8 q/K/V": Call(lambda: attention(kvouter, prefill, q=FP8), fp8=True),
        "KV-outer, fp8 K/V, bf16 q": Call(lambda: attention(kvouter, prefill, kv=FP8), fp8=True),
        "KV-outer, fp8 q/K/V, e4m3 partials": Call(
            lambda: attention(kvouter, prefill, q=FP8, partial_dtype=FP8), fp8=True),
        "KV-outer, fp8 K/V, bf16 q, e4m3 partials": Call(
            lambda: attention(kvouter, prefill, kv=FP8, partial_dtype=FP8), fp8=True),
        "KV-outer, fp8 K/V, fp32 q": Call(
            lambda: attention(kvouter, prefill, q=FP32, kv=FP8, hq=16, config=KVOuterConfig(impl="triton")),
            fp8=True, smem=True),
        "KV-outer, fp32": Call(
            lambda: attention(kvouter, prefill, q=FP32, hq=16, config=KVOuterConfig(impl="triton")), smem=True),
        "sparse prefill, fp32 (KV-outer where its block fits)": Call(lambda: attention(sparse, prefill, q=FP32, hq=16)),
        "sparse prefill, D = 256": Call(lambda: attention(sparse, prefill, d=256)),
        "KV-outer, fp8 q/K/V, D = 16, fp16 out": Call(
            lambda: attention(kvouter, prefill, hq=16, hkv=1, d=16, q=FP8, out_dtype=FP16), fp8=True),
        "KV-outer, fp8, tl partials": Call(
            lambda: attention(kvouter, prefill, q=FP8, config=KVOuterConfig(engine="triton")), fp8=True),
        "KV-outer, Gluon partials pinned": Call(
            lambda: attention(kvouter, prefill, config=KVOuterConfig(engine="tma")), gluon=True),
        "KV-outer, Gluon partials pinned, prompts of another length and count": Call(
            lambda: attention(kvouter, other_rows, config=KVOuterConfig(engine="tma")), gluon=True),
        "KV-outer, tl partials, prompts of another length and count": Call(
            lambda: attention(kvouter, other_rows, config=KVOuterConfig(engine="triton"))),
        # sparse attention: query-outer tiles (the dense kernel's sparse mode)
        "query-outer prefill": Call(lambda: attention(qouter, long)),
        "query-outer prefill, gathered K/V, key splits": Call(
            lambda: attention(qouter, prefill, config=DenseConfig(use_tma=False, num_splits=2))),
        "query-outer, fp16, G = 4, pages of 16, blocks of 32, bidirectional": Call(
            lambda: attention(qouter, Batch(2, 256, p=16, w=64), hq=16, hkv=4, d=64, block=32, q=FP16,
                              causal=False)),
        "query-outer prefill, fp32": Call(lambda: attention(qouter, prefill, q=FP32, hq=16)),
        "query-outer prefill, fp8 q/K/V": Call(lambda: attention(qouter, prefill, q=FP8), fp8=True),
        "query-outer prefill, fp8 K/V, bf16 q": Call(lambda: attention(qouter, prefill, kv=FP8), fp8=True),
        # dense attention
        "dense prefill": Call(lambda: attention(dense, prefill, sparse=False)),
        "dense prefill, a prompt of another length": Call(lambda: attention(dense, other, sparse=False)),
        "dense long prefill": Call(lambda: attention(dense, long, sparse=False)),
        "dense prefill, gathered K/V": Call(
            lambda: attention(dense, prefill, sparse=False, config=DenseConfig(use_tma=False))),
        "dense decode (key splits and their merge)": Call(lambda: attention(dense, decode, sparse=False)),
        # (The same width: a narrower table bounds the history, and the dense decode plan takes
        # fewer key splits for it.)
        "dense decode, another batch": Call(lambda: attention(dense, Batch(20, 1), sparse=False)),
        # one sequence over 4K and 32K of history: 8 and 64 key splits
        "dense decode, one sequence over 4K": Call(lambda: attention(dense, Batch(1, 1, w=64), sparse=False)),
        "dense decode, one sequence over 32K": Call(lambda: attention(dense, Batch(1, 1, w=512), sparse=False)),
        "dense decode, pages of 128": Call(lambda: attention(dense, Batch(4, 1, p=128, w=32), sparse=False)),
        "dense prefill, D = 256": Call(lambda: attention(dense, prefill, d=256, sparse=False)),
        "dense, fp16, bidirectional, pages of 16": Call(
            lambda: attention(dense, Batch(2, 256, p=16, w=64), hq=16, hkv=16, d=64, q=FP16, sparse=False,
                              causal=False)),
        "dense prefill, fp32": Call(lambda: attention(dense, prefill, q=FP32, hq=16, sparse=False)),
        "dense decode, fp8 K/V": Call(lambda: attention(dense, decode, kv=FP8, sparse=False), fp8=True),
        "dense prefill, fp8 q/K/V": Call(lambda: attention(dense, prefill, q=FP8, sparse=False), fp8=True),
        "dense prefill, fp8 K/V, fp32 q": Call(
            lambda: attention(dense, prefill, q=FP32, kv=FP8, hq=16, sparse=False), fp8=True),
        "dense prefill, flash-attn-4 installed (its page tails)": Call(lambda: _with_fa4(dense, prefill)),
    }


def _with_fa4(op, batch):
    with fa4_installed():
        return attention(op, batch, sparse=False)


# --------------------------------------------------------------------------- catching launches
@dataclass
class Launch:
    """A kernel launch the ops made: everything Triton's launch path gets."""

    fn: object
    args: tuple
    kwargs: dict
    grid: object

    @property
    def name(self) -> str:
        return self.fn.__name__

    def key(self) -> tuple:
        """What Triton specializes a compile on (or finer): tensor dtypes, descriptor block
        shapes, int arguments up to Triton's own rules (== 1, divisible by 16; nothing for a
        parameter the kernel leaves unspecialized), the constants and launch options
        (keywords) by value."""
        params = getattr(self.fn, "params", ())
        plain = {i for i, p in enumerate(params) if getattr(p, "do_not_specialize", False)}

        def one(a):
            if hasattr(a, "data_ptr") and hasattr(a, "dtype"):
                return ("tensor", str(a.dtype))
            if hasattr(a, "block_shape"):
                base = getattr(a, "base", None)
                return ("desc", str(getattr(base, "dtype", None)), tuple(a.block_shape), str(getattr(a, "layout", "")))
            if isinstance(a, bool) or a is None or isinstance(a, str):
                return a
            if isinstance(a, int):
                return ("int", a == 1, a % 16 == 0, a >= 2**31)
            if isinstance(a, float):
                return "float"
            return repr(a)

        return (self.name, self.fn.__module__,
                tuple("int" if i in plain and type(a) is int else one(a) for i, a in enumerate(self.args)),
                tuple(sorted((k, repr(v)) for k, v in self.kwargs.items())))

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        types = ", ".join(str(a.dtype).replace("torch.", "") for a in self.args if hasattr(a, "dtype"))
        return f"{self.name}({types}; {consts})"


def catch_launches(log: list):
    """Replace Triton's launch of every JIT function (Gluon's too) by a record in ``log``."""
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        log.append(Launch(self, args, kwargs, grid))
        return None

    original = JITFunction.run
    JITFunction.run = run
    return original


def package_kernels(torch_ext: str) -> dict[str, list[str]]:
    """Module -> the Triton kernels it defines that no other Triton function names (the ones
    launched from the host; the others are called, or passed to ``tl.reduce``, by kernels), for every module of the package but ``hf`` (no kernels there)."""
    from triton.runtime.jit import JITFunction

    import m3_sparse

    funcs = {}
    for info in pkgutil.walk_packages(m3_sparse.__path__, "m3_sparse."):
        if info.name.startswith("m3_sparse.hf"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__:
                funcs[(mod.__name__, name)] = obj
    sources = {key: fn.src for key, fn in funcs.items()}
    entries: dict[str, list[str]] = {}
    for (module, name), fn in funcs.items():
        called = any(re.search(rf"\b{re.escape(name)}\b", src) for key, src in sources.items() if key != (module, name))
        if not called:
            entries.setdefault(module, []).append(name)
    return entries


def run_calls(capability: tuple[int, int], log: list) -> tuple[dict, list[Launch]]:
    """Every call of ``calls()`` acting as a GPU of ``capability``: per call, the kernels it
    launched or why the ops refused it; and the launches, in order."""
    from m3_sparse.core import gluon

    os.environ["M3_SPARSE_CAPABILITY"] = "{}.{}".format(*capability)
    outcome, launches = {}, []
    with fake_cuda():
        for name, call in calls().items():
            del log[:]
            try:
                call.run()
            except Exception as e:  # a refusal is reported, the test decides whether it is right
                outcome[name] = {"refused": f"{type(e).__name__}: {e}"[:600], "error_type": type(e).__name__,
                                 "fp8": call.fp8, "gluon": call.gluon, "smem": call.smem}
                continue
            outcome[name] = {"kernels": [x.describe() for x in log], "keys": [repr(x.key()) for x in log],
                             "fp8": call.fp8, "gluon": call.gluon,
                             "smem": call.smem,
                             "tma": any("tensordesc" in repr(type(a)).lower() or hasattr(a, "block_shape")
                                        for x in log for a in x.args)}
            launches.extend(log)
    return {"calls": outcome, "gluon_reason": gluon.capability_reason(capability)}, launches


def distinct(launches: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for x in launches:
        k = x.key()
        if k not in seen:
            seen.add(k)
            out.append(x)
    return out


def target_launches(target: Target, log: list) -> list[tuple[Launch, list[str]]]:
    """The distinct launches of every capability the target stands for, each with the
    capabilities ("8.6") that launch it, in first-seen order."""
    found: dict = {}
    for capability in target.stands_for:
        _, launches = run_calls(capability, log)
        for x in launches:
            found.setdefault(x.key(), (x, []))[1].append("{}.{}".format(*capability))
    return [(x, sorted(set(caps))) for x, caps in found.values()]


def main() -> None:
    torch_ext, mode, *rest = sys.argv[1:]
    sys.path.insert(0, torch_ext)
    for var in ("TRITON_INTERPRET", "M3_SPARSE_IMPL", "M3_SPARSE_DENSE_IMPL", "M3_SPARSE_DEBUG"):
        os.environ.pop(var, None)
    warnings.filterwarnings("ignore")
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    global BF16, FP16, FP32, FP8, INT32
    BF16, FP16, FP32, FP8, INT32 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32
    first = int(rest[0])
    driver.set_active(StandInDriver(GPUTarget("cuda", first, 32)))
    from m3_sparse.core import launch

    launch.DIRECT_LAUNCH_TRITON = ()  # every launch through Triton's own path (caught below)
    log: list[Launch] = []
    original_run = catch_launches(log)
    if mode == "record":
        result = {"kernels": package_kernels(torch_ext), "targets": {}}
        for arch in map(int, rest):
            launch._sm_count = lambda index, sms=TARGETS[arch].sms: sms
            report, launches = run_calls(TARGETS[arch].capability, log)
            report["distinct"] = len(distinct(launches))
            report["launched"] = sorted({f"{x.fn.__module__}.{x.name}" for x in launches})
            result["targets"][arch] = report
    else:
        arch, shard, shards = first, int(rest[1]), int(rest[2])
        launch._sm_count = lambda index: TARGETS[arch].sms
        todo = target_launches(TARGETS[arch], log)
        result = {"distinct": len(todo), "compiled": []}
        for x, capabilities in todo[shard::shards]:
            entry = {"launch": x.describe(), "capabilities": capabilities}
            start = time.perf_counter()
            try:
                kernel = original_run(x.fn, *x.args, grid=x.grid, warmup=True, **x.kwargs)
                entry.update(ok=True, shared=kernel.metadata.shared, seconds=round(time.perf_counter() - start, 2))
            except Exception as e:
                entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
            result["compiled"].append(entry)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
