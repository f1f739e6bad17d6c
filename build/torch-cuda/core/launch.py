"""Host-side helpers shared by the Triton launchers (no device reads)."""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import threading

import torch

_log = logging.getLogger("m3_sparse")


# Most key splits of one attention row (the decode and dense kernels): the split merge
# (``split_merge``) unrolls its loop over them.
MAX_SPLITS = 64


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def interpreting() -> bool:
    """Triton picks its interpreter from this variable when a kernel is decorated."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


# --------------------------------------------------------------------------- the GPU's capability
# What the kernels need of a GPU, by compute capability (major, minor):
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores and asynchronous copies: every Triton kernel (sm_80 up)
# e4m3 tensor cores (Ada sm_89, Hopper sm_90, Blackwell sm_100 / sm_120). Below it Triton has no
# float8e4nv type at all (3.6 to 3.9 refuse a kernel with an e4m3 pointer for sm_80 / sm_86 /
# sm_87), so fp8 caches, fp8 queries and the fp8 dot need it.
FP8_CAPABILITY = (8, 9)
TMA_CAPABILITY = (9, 0)  # the tensor memory accelerator (dense key tiles as TMA boxes)
GLUON_CAPABILITY = (9, 0)  # the Gluon kernels: Hopper's wgmma and TMA, exactly
# Most shared memory one block may use (the opt-in limit, bytes), by compute capability
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"); a kernel
# above it fails to load. Capabilities not listed get the smallest.
SHARED_MEMORY_PER_BLOCK = {(8, 0): 163 << 10, (8, 6): 99 << 10, (8, 7): 163 << 10, (8, 9): 99 << 10,
                           (9, 0): 227 << 10, (10, 0): 227 << 10, (10, 3): 227 << 10, (12, 0): 99 << 10,
                           (12, 1): 99 << 10}

# Test-only: M3_SPARSE_CAPABILITY=<major>.<minor> (for example 8.0 or 8.9) makes
# ``device_capability`` answer that capability for every CUDA device instead of the GPU's,
# so that the GPU suite runs, on the GPU at hand, the code paths another GPU takes (Gluon,
# TMA, the fp8 kernels, flash-attn-4, the refusals). Only the package's choices change:
# Triton still compiles for the real GPU, so act only as an older GPU than the real one
# (scripts/gpu_check.sh's CAPABILITY knob). Not for production use.
CAPABILITY_ENV = "M3_SPARSE_CAPABILITY"


def device_capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``index``: the one place the package
    reads it (every choice by GPU goes through here), ``M3_SPARSE_CAPABILITY`` when set."""
    forced = os.environ.get(CAPABILITY_ENV)
    if forced:
        return parse_capability(forced)
    return _real_capability(index)


@functools.lru_cache(maxsize=None)
def _real_capability(index: int) -> tuple[int, int]:
    # Asked on every launch (decode steps too): answered once per device.
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def parse_capability(text: str) -> tuple[int, int]:
    """``"8.9"`` -> ``(8, 9)``: a compute capability written as ``major.minor``."""
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(
            f"{CAPABILITY_ENV}: expected a compute capability as major.minor (for example 8.0 or 8.9), got {text!r}"
        )
    return int(major), int(minor)


def sm_name(capability: tuple[int, int]) -> str:
    """``(8, 9)`` -> ``"sm_89 (8.9)"``, as error messages name a GPU."""
    major, minor = capability
    return f"sm_{major}{minor} ({major}.{minor})"


def shared_memory_per_block(capability: tuple[int, int]) -> int:
    """Bytes of shared memory one block may use on a GPU of this capability."""
    return SHARED_MEMORY_PER_BLOCK.get(tuple(capability), min(SHARED_MEMORY_PER_BLOCK.values()))


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on ``device`` (what the plans size their
    tiles against): its capability's limit on CUDA; off the GPU (the interpreter, which has
    no such limit) the H100 / H200's, which the plans were tuned on, so that the CPU runs
    the tiles the H200 does."""
    if device.type != "cuda" or interpreting():
        return SHARED_MEMORY_PER_BLOCK[(9, 0)]
    return shared_memory_per_block(device_capability(device_index(device)))


def contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels index integer metadata (block tables, offsets, lengths, selections)
    with unit inner strides; a strided view is copied (a small device copy, no sync)."""
    return tuple(t.contiguous() for t in tensors)


# Where int32_parts carves one allocation, every part starts on this many elements (128
# bytes): each keeps the pointer alignment Triton specializes on, and coalesced loads.
PART_ALIGN = 32


def int32_parts(device: torch.device, *lengths: int) -> list[torch.Tensor]:
    """Contiguous int32 vectors of ``lengths`` elements (uninitialized), carved from one
    ``torch.empty``: a launcher that needs several small index arrays pays one allocation."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += -(-n // PART_ALIGN) * PART_ALIGN
    buf = torch.empty(max(total, 1), dtype=torch.int32, device=device)
    return [buf[s : s + n] for s, n in zip(starts, lengths)]


def fp8_flags(q: torch.Tensor, k_cache: torch.Tensor, scales, out_dtype, entry: str):
    """(q is fp8, the caches are fp8, output dtype) of a launcher's inputs; fp8 inputs need
    the fp32 [3] scales of ``core.validate.check_quant`` (``entry`` names the public op)."""
    fp8 = torch.float8_e4m3fn
    q_fp8, kv_fp8 = q.dtype == fp8, k_cache.dtype == fp8
    if (q_fp8 or kv_fp8) and scales is None:
        raise ValueError(f"scales: fp8 inputs need their dequantization scales (see {entry})")
    return q_fp8, kv_fp8, out_dtype or q.dtype


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a float torch dtype (a kernel's constexpr compute type)."""
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def num_sms(device: torch.device, cpu_default: int) -> int:
    """Multiprocessors of ``device`` (cached); ``cpu_default`` stands in off the GPU."""
    if device.type != "cuda":
        return cpu_default
    return _sm_count(device_index(device))


# --------------------------------------------------------------------------- buffers
class StreamBuffers:
    """Scratch buffers a launch object reuses from one run to the next (split workspaces,
    arrival counts), one set per CUDA stream: runs on one stream follow each other, so a set
    never serves two runs at once. A plan kept for a decode step runs once per layer; a
    fresh set each time would cost the host an allocation per buffer per run.

    ``make(device)`` builds a set from plain values: a maker that refers to its launch object
    would make a reference cycle, and the launch an op call drops would keep its buffers
    until the garbage collector runs. A buffer a kernel must find zeroed has to be left
    zeroed by that kernel. At most ``MAX_SETS`` streams are remembered (then the sets are
    made again)."""

    MAX_SETS = 8

    def __init__(self, make):
        self._make = make
        self._sets: dict = {}
        self._keep = True

    def stop_keeping(self) -> None:
        """From now on make a fresh set at every ``get``, as a dropped launch would: for a
        kept plan of a call that later calls rarely share (a prefill's), whose buffers would
        otherwise stay allocated."""
        self._keep = False
        self._sets.clear()

    def get(self, device: torch.device):
        if not self._keep:
            return self._make(device)
        key = _stream_handle(device)
        found = self._sets.get(key)
        if found is None:
            if len(self._sets) >= self.MAX_SETS:
                self._sets.clear()
            found = self._sets[key] = self._make(device)
        return found


def _stream_handle(device: torch.device):
    """(device index, raw handle of its current stream: the stream Triton launches on) on
    CUDA; the device alone elsewhere (the interpreter runs in order)."""
    if device.type != "cuda":
        return device
    index = device_index(device)
    return index, _driver_calls()[1](index)


# --------------------------------------------------------------------------- specializations
# Triton compiles a kernel once per specialization: besides its constants, each int argument
# is keyed by whether it is 1 and whether it is a multiple of 16. Where an int is a length (a
# token or row count, a bound on tiles) that split is worth nothing to the generated code, yet
# it would make a kernel compile again, seconds each, for the first prompt whose length falls
# on the other side of it, or for the first decode step after a prefill. Such parameters are
# declared ``do_not_specialize`` on their kernel, and a launcher passes no length-derived
# constant (a block size chosen from the length): the lengths of a model's calls share one
# compile per kernel (tests/kernels/test_gpu_compile.py checks it for every target). So do
# the widths of block tables (their row stride): a serving step's tables are as wide as its
# longest request's history, so every step may bring another. Kernels that find a token's
# sequence count over whole vectors of ``cu_seqlens_q`` (one load for a decode batch, or a
# step's prefill rows in KV-outer's index build) take at least SEQ_VECTOR_MIN sequences a
# vector, so that the batch sizes a server steps through, up to that many requests, share one
# compile too.
SEQ_VECTOR_MIN, SEQ_VECTOR_MAX = 64, 1024


def seq_vector(batch: int) -> tuple[int, int]:
    """(sequences a vector, vectors) of such a count over ``batch`` sequences."""
    chunk = min(SEQ_VECTOR_MAX, max(SEQ_VECTOR_MIN, next_pow2(batch)))
    return chunk, -(-batch // chunk)


def seq_block(count: int) -> int:
    """The width of one vector over ``count`` entries per sequence (all of them at once, for
    kernels that take no loop over vectors): a power of two, at least SEQ_VECTOR_MIN."""
    return max(SEQ_VECTOR_MIN, next_pow2(count))


# --------------------------------------------------------------------------- launches
# Triton binds and specializes every argument of every call in Python before it launches
# (tens of microseconds of host time a call, docs/perf-log/2026-12-04.md), and an eager
# decode step makes dozens of calls. ``launch_kernel`` keeps the compiled kernel of each call
# under a key at least as fine as Triton's own specialization and launches it directly.
LAUNCH_CACHE_SIZE = 64  # specializations kept per kernel; a decode step reuses a handful
# The Triton releases whose compiled-kernel launcher ``launch_kernel`` calls directly (checked
# on the H200 by tests/kernels/test_launch.py); other releases launch through Triton every time.
DIRECT_LAUNCH_TRITON = ("3.6.",)
# The same for the Gluon kernels (their descriptors are keyed, ``_args_key``), checked by the
# same test's Gluon comparison; on other releases they launch through Triton (which costs their
# call the binder's host time).
DIRECT_LAUNCH_GLUON_TRITON = ("3.6.",)
_launch_cache: dict = {}
_UNSEEN = object()


_descriptor_class = None  # Triton's host-side TensorDescriptor, once Triton is imported (_cache_for)
_gluon_descriptor_class = None  # Gluon's (Hopper) host-side TensorDescriptor, where Gluon is installed


def _args_key(args: tuple) -> tuple:
    """What Triton's specialization can depend on, or finer, for every argument: a tensor's
    dtype and its address modulo 16 (Triton asks whether it is 16-byte aligned); a host-side
    tensor descriptor's dtype, block shape and padding (Triton 3.6 types it by dtype and
    block shape; its base, shape and strides are launch arguments), and a Gluon descriptor's
    shared-memory layout besides (Gluon types it by layout too; its layouts hash by value,
    as Triton keys constexprs by them); an int, bool, string or
    None with its type and value (``True == 1``, yet Triton types them apart); a float's
    type only (it is passed as a 32-bit float whatever its value). One comprehension, no
    call per plain argument: a decode launch has about forty arguments."""
    tensor, descriptor, gluon = torch.Tensor, _descriptor_class, _gluon_descriptor_class
    return tuple([
        (a.dtype, a.data_ptr() & 15) if isinstance(a, tensor)
        else float if a.__class__ is float
        else (descriptor, a.base.dtype, tuple(a.block_shape), a.padding) if a.__class__ is descriptor
        else (gluon, a.base.dtype, tuple(a.block_shape), a.padding, a.layout) if a.__class__ is gluon
        else (a.__class__, a)
        for a in args
    ])


def _cache_for(fn):
    """The launch cache of ``fn``: a dict, or None where calls go through Triton itself (the
    interpreter, a Triton without the launch interface this relies on)."""
    cache = _launch_cache.get(fn, _UNSEEN)
    if cache is not _UNSEEN:
        return cache
    import triton

    global _descriptor_class, _gluon_descriptor_class
    if _descriptor_class is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor as _descriptor_class
        except ImportError:  # pragma: no cover - a Triton without host-side descriptors
            pass
    if _gluon_descriptor_class is None:
        try:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _gluon_descriptor_class
        except ImportError:  # a Triton without Gluon
            pass
    cache = None
    params = getattr(fn, "params", None)
    gluon = type(fn).__module__.startswith("triton.experimental.gluon")
    if (
        not interpreting()
        and triton.__version__.startswith(DIRECT_LAUNCH_GLUON_TRITON if gluon else DIRECT_LAUNCH_TRITON)
        and params is not None
        and all(hasattr(p, "name") and hasattr(p, "default") for p in params)
    ):
        cache = {}
    _launch_cache[fn] = cache
    return cache


def _hooks_set() -> bool:
    """Whether a launch hook is registered: a hook function, or a chain of them (Triton's
    ``HookChain``, present even when empty) that holds one."""
    runtime = _runtime_settings()
    for h in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if h is not None and bool(getattr(h, "calls", True)):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _runtime_settings():
    """Triton's runtime settings (``knobs.runtime``, where the launch hooks are), looked up once."""
    from triton import knobs

    return knobs.runtime


@functools.lru_cache(maxsize=None)
def _driver_calls():
    """Triton's active driver's (current device, current stream) calls, bound once: the
    driver is a lazy proxy whose lookups cost host time on every launch."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream


def launch_kernel(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)`` for a Triton kernel whose non-constexpr arguments come
    positionally and everything else as keywords.

    The first call of a specialization goes through Triton, which compiles (or loads) the
    kernel; later calls with the same key (:func:`_args_key` of the arguments, the keywords,
    the current device) launch that kernel on the current stream directly, with the
    arguments Triton would pass. Calls go through Triton every time under the interpreter
    and while launch hooks (a profiler's) are set. Inside a compile-ahead pass
    (:func:`compile_ahead`) nothing launches: the kernel is compiled in the background."""
    ahead = _ahead.get()
    if ahead is not None:
        ahead.compile(fn, grid, args, kwargs)
        return
    cache = _cache_for(fn)
    if cache is None or _hooks_set():
        fn[grid](*args, **kwargs)
        return
    current_device, current_stream = _driver_calls()
    device = current_device()
    key = (device, _args_key(args), tuple(kwargs.items()))
    hit = cache.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)
        if len(cache) >= LAUNCH_CACHE_SIZE:
            cache.clear()
        # The bound arguments after the positional ones, in the kernel's parameter order:
        # constexprs given as keywords, defaults for the rest (Triton passes them all).
        tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in fn.params[len(args):])
        cache[key] = (kernel, tail)
        return
    kernel, tail = hit
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    stream = current_stream(device)
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)


# --------------------------------------------------------------------------- compiling ahead
# A first call compiles each of its kernels when it reaches its launch, one after another:
# seconds per kernel, tens of seconds for a model's first generate(). Which kernels a call
# launches, with which specializations, is decided from host facts only (nothing reads the
# device), so the call can first be run once with every launch turned into Triton's warm-up
# compile, handed to a thread pool (Triton's asynchronous compile mode); the compiles then run
# side by side, and the real call finds every kernel built. The pass's torch work (allocations,
# small index ops) runs on the device and is dropped with its outputs; its kernels write
# nothing, so a pass leaves every input and cache as it was.
# "1" turns passes on. Off by default: a pass overlaps one op's compiles, not those of
# different ops, so a model's first generate() gains little (benchmarks/bench_first_call.py
# times it with and without passes).
COMPILE_AHEAD_ENV = "M3_SPARSE_COMPILE_AHEAD"
# Passes a call key gets while they still find kernels to compile; then, or after a pass that
# found none, calls of that key run directly. A key is coarse (no lengths): a later call whose
# lengths select other specializations compiles them at their launches.
MAX_PASSES = 8
_ahead: contextvars.ContextVar = contextvars.ContextVar("m3_sparse_compile_ahead", default=None)
_passes: dict = {}  # call key -> passes made, MAX_PASSES once warm
_pool = None
_pool_lock = threading.Lock()


class _AheadPass:
    """A compile-ahead pass: Triton's asynchronous compile mode over the pool, and how many
    kernels it handed to the pool."""

    def __init__(self, mode):
        self.mode = mode

    def compile(self, fn, grid, args, kwargs) -> None:
        fn.run(*args, grid=grid, warmup=True, **kwargs)

    @property
    def submitted(self) -> int:
        return len(self.mode.raw_futures)


def _compile_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="m3-compile")
        return _pool


def _async_compile_mode():
    """Triton's asynchronous compile mode class, or None for a Triton without one."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - a Triton before 3.5
        return None
    return AsyncCompileMode


def compile_ahead(key, device: torch.device, call, *args, **kwargs):
    """``call(*args, **kwargs)``; with ``M3_SPARSE_COMPILE_AHEAD=1``, on the first calls of
    ``key`` on a CUDA device, after a compile-ahead pass of the same call (see above). Never
    while a CUDA graph is captured or under the interpreter. ``key``: the call key, or a
    function making it, called only while passes are on (every op call comes through here)."""
    if _ahead.get() is not None or not compile_ahead_on(device):
        return call(*args, **kwargs)
    key = key() if callable(key) else key
    done = _passes.get(key, 0)
    if done >= MAX_PASSES:
        return call(*args, **kwargs)
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return call(*args, **kwargs)
    mode_class = _async_compile_mode()
    if mode_class is None:
        _passes[key] = MAX_PASSES
        return call(*args, **kwargs)
    try:
        with mode_class(_compile_pool()) as mode:  # its exit waits for the compiles
            ahead = _AheadPass(mode)
            token = _ahead.set(ahead)
            try:
                call(*args, **kwargs)
            finally:
                _ahead.reset(token)
        _passes[key] = MAX_PASSES if ahead.submitted == 0 else done + 1
    except Exception as exc:  # noqa: BLE001 - the real call below raises what the call itself raises
        # A pass only prepares: whatever stopped it (bad input, a compile error), the real call
        # runs as it would without passes and raises that error itself.
        _passes[key] = MAX_PASSES
        _log.debug("compile-ahead pass of %s stopped (%s: %s); its kernels compile at their launches",
                   key[0], type(exc).__name__, exc)
    return call(*args, **kwargs)


def compile_ahead_on(device: torch.device) -> bool:
    """Whether calls on ``device`` get compile-ahead passes (a CUDA device, the variable set,
    no interpreter)."""
    return device.type == "cuda" and _ahead_wanted()


def compiling_ahead() -> bool:
    """Whether a compile-ahead pass is running: work that is not a Triton launch (another
    library's kernel) skips itself in one, since the pass's results are dropped."""
    return _ahead.get() is not None


def _ahead_wanted() -> bool:
    return os.environ.get(COMPILE_AHEAD_ENV, "0") == "1" and not interpreting()


def rows_bucket(rows: int) -> int:
    """Query rows per sequence, coarsely, for a compile-ahead key: one (decode), a few (a
    decode or mixed step's short rows), many (prefill). The kernels and their tiles differ
    between these."""
    return 0 if rows <= 1 else 1 if rows <= 16 else 2
