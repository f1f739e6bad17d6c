"""Which kernel each op picks on each GPU, on the CPU: the capability comes from the test-only
override (``M3_SPARSE_CAPABILITY``, read by ``core.launch.device_capability``) and the calls'
tensors say they live on ``cuda:0`` without memory (``gpu_targets.fake_cuda``).

The rule (``dispatch``'s docstring): any GPU from sm_80 runs the Triton ``tl`` kernels; the
Gluon kernels run on sm_90 only (with the Triton release they are written for), TMA key tiles
from sm_90, fp8 inputs from sm_89, flash-attn-4 on sm_90 / sm_100. A GPU below 8.0, and fp8
inputs on sm_80 / sm_86, are refused with an error that names the GPU and what is needed,
unless the torch code is pinned. ``test_gpu_compile.py`` checks the same choices end to end
(every op run for each compile target) and compiles what they launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import m3_sparse
from gpu_targets import fake_cuda
from m3_sparse import DenseConfig, IndexConfig, KVOuterConfig, dispatch
from m3_sparse.core import gluon, launch
from m3_sparse.core.validate import attention_args, index_args
from m3_sparse.dense import attention_fa4
from m3_sparse.index import plan as index_plan

# Imported here, while the conftest's TRITON_INTERPRET=1 is set: a kernel module first
# imported inside a test below (which clears it) would keep GPU kernels for the whole run.
from kernel_test_utils import kernel_module

dense_triton = kernel_module("m3_sparse.dense.attention_triton")

FP8 = torch.float8_e4m3fn
SERVED = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
NO_FP8 = {(8, 0), (8, 6)}
TMA = {(9, 0), (10, 0), (12, 0)}
FA4 = {(9, 0), (10, 0)}
IDS = [f"sm{a}{b}" for a, b in SERVED]


@pytest.fixture
def act_as(monkeypatch):
    """``act_as((major, minor))``: dispatch sees a GPU of that capability with 132 SMs, the
    Triton release the Gluon kernels are written for (so that only the GPU decides whether
    they run), no flash-attn-4, no pinned implementation and no interpreter."""

    def set_capability(capability, gluon_release: bool = True):
        monkeypatch.setenv(launch.CAPABILITY_ENV, "{}.{}".format(*capability))
        for var in ("TRITON_INTERPRET", "M3_SPARSE_IMPL", "M3_SPARSE_DENSE_IMPL"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
        monkeypatch.setattr(attention_fa4, "varlen_function", lambda: None)  # not installed unless a test says so
        if gluon_release:
            monkeypatch.setattr(gluon, "HAVE_GLUON", True)
            monkeypatch.setattr(gluon, "triton_version", lambda: gluon.TESTED_TRITON[0] + "0")
        gluon.capability_reason.cache_clear()

    yield set_capability
    gluon.capability_reason.cache_clear()


def cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda:0")


def attn(b=2, s=512, hq=64, hkv=4, d=128, page=64, q=torch.bfloat16, kv=None, sparse=True, **kw):
    """Checked arguments of an attention call (M3's shapes), on CUDA-looking tensors."""
    kv = kv or q
    pool = cuda(b * 64 + 1, hkv, page, d, dtype=kv)
    if q == FP8:
        kw["q_scale"] = 0.5
    if kv == FP8:
        kw.update(k_scale=0.25, v_scale=0.125)
    if sparse:
        kw["selected"] = cuda(b * s, hkv, 16, dtype=torch.int32)
    return attention_args(
        cuda(b * s, hq, d, dtype=q), pool, pool, cuda(b, 64, dtype=torch.int32),
        cu_seqlens_q=cuda(b + 1, dtype=torch.int32), used_kv_lens=cuda(b, dtype=torch.int32), softmax_scale=0.1,
        causal=True, return_lse=False, sparse=sparse, max_seqlen_q=s, **kw,
    )


def index_call(b=16, s=4096, k=torch.bfloat16, per_token=False, fp8_dot=False):
    """Checked arguments of an index top-k prefill (M3's index branch)."""
    keys = cuda(b * 64 + 1, 64, 128, dtype=k)
    scale = None
    if k == FP8:
        scale = cuda(b * 64 + 1, 64, dtype=torch.float32) if per_token else cuda(1, dtype=torch.float32)
    return index_args(
        cuda(b * s, 4, 128), keys, cuda(b, 64, dtype=torch.int32), cu_seqlens_q=cuda(b + 1, dtype=torch.int32),
        used_kv_lens=cuda(b, dtype=torch.int32), topk=16, max_seqlen_q=s, index_k_scale=scale, fp8_dot=fp8_dot,
    )


def index_engine(args, cfg=index_plan.DEFAULT_CONFIG) -> str:
    return dispatch.index_engine(args, cfg, index_plan.plan(args, cfg))


# --------------------------------------------------------------------------- the GPUs served
@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_every_gpu_from_sm80_runs_the_tl_kernels(act_as, capability):
    act_as(capability)
    with fake_cuda():
        bf16 = attn()
        assert dispatch.use_triton(bf16.q, dispatch.kvouter_unsupported(bf16))
        assert dispatch.use_triton(bf16.q, dispatch.decode_unsupported(bf16))
        assert dispatch.dense_kernel(attn(sparse=False), DenseConfig()) == "triton"  # flash-attn-4 not installed
        idx = index_call()
        assert dispatch.use_triton(idx.index_q, dispatch.index_unsupported(idx))
        assert index_engine(idx) == "triton"  # auto keeps the tl kernel for bf16 keys, sm_90 too
        q = cuda(2, 8, 4, 128)
        assert dispatch.use_triton(q, dispatch.prep_unsupported(q, cuda(2, 8, 128), cuda(1, 8, 64), cuda(1, 8, 64)))


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_gluon_kernels_run_on_sm90_only(act_as, capability):
    act_as(capability)
    hopper = capability == (9, 0)
    with fake_cuda():
        m3 = attn()
        tma = KVOuterConfig(engine="tma")
        assert dispatch.partials_engine(m3, KVOuterConfig(), 4, 1 << 20) == ("tma" if hopper else "triton")
        # The decode / KV-outer crossover follows the partials kernel that would run.
        assert dispatch.decode_max_queries(m3.q, m3.k_cache, m3.v_cache, 128) == (
            dispatch.DECODE_MAX_QUERIES if hopper else dispatch.DECODE_MAX_QUERIES_TL
        )
        if hopper:
            assert dispatch.partials_engine(m3, tma, 4, 1 << 20) == "tma"
        else:
            with pytest.raises(ValueError, match=rf"engine='tma': needs sm_90 .*this GPU is sm_{capability[0]}{capability[1]}"):
                dispatch.partials_engine(m3, tma, 4, 1 << 20)
        if capability in NO_FP8:
            return
        # Index keys in e4m3 under one scale with the fp8 dot: where the Gluon kernel measured faster.
        idx = index_call(k=FP8, fp8_dot=True)
        assert index_engine(idx) == ("tma" if hopper else "triton")
        assert index_engine(idx, IndexConfig(engine="triton")) == "triton"


def test_a_models_transposed_q_runs_the_tma_partials(act_as):
    """A model's batch-1 q is a transposed view ([T, Hq, D], heads T*D apart): the TMA partials
    kernel takes it (its wrapper copies it), so the model's prefill runs the kernel KV-outer is
    measured with; a head dim of another stride keeps the tl kernel."""
    act_as((9, 0))
    with fake_cuda():
        m3 = attn(b=1)
        tokens, hq, d = m3.q.shape
        transposed = m3.replace(q=cuda(hq, tokens, d).transpose(0, 1))
        assert not transposed.q.is_contiguous()
        assert dispatch.partials_engine(transposed, KVOuterConfig(), 4, 1 << 20) == "tma"
        assert dispatch.decode_max_queries(transposed.q, m3.k_cache, m3.v_cache, 128) == dispatch.DECODE_MAX_QUERIES
        strided = cuda(tokens, hq, 2 * d)[..., ::2]
        why = dispatch.tma_partials_reason(strided, m3.k_cache, m3.v_cache, 128, None, None, 4, 0)
        assert why == "q with a contiguous head dim (stride 1), got stride 2"
        caches = cuda(*m3.k_cache.shape[:3], 2 * d)[..., :d]
        assert dispatch.tma_partials_reason(m3.q, caches, caches, 128, None, None, 4, 0) == "contiguous caches"


def test_gluon_waits_for_its_triton_release(act_as):
    act_as((9, 0), gluon_release=False)
    with fake_cuda():
        m3 = attn()
        why = dispatch.tma_partials_reason(m3.q, m3.k_cache, m3.v_cache, 128, None, None, 4, 0)
    import triton

    if not gluon.HAVE_GLUON:
        assert why == "this Triton has no Gluon Hopper API"
    elif triton.__version__.startswith(gluon.TESTED_TRITON):
        assert why is None
    else:
        assert why == f"written for Triton {gluon.TESTED_TRITON[0]}x, found {triton.__version__}"


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_tma_key_tiles_from_sm90(act_as, capability):
    act_as(capability)
    with fake_cuda():
        k = cuda(129, 4, 64, 128)
        why = dense_triton.tma_unusable(k, k, 64, 128)
    if capability in TMA:
        assert why is None
    else:
        assert why == f"TMA needs compute capability 9.0 or newer, this device has {capability[0]}.x"


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_flash_attn_4_on_sm90_and_sm100(act_as, capability, monkeypatch):
    act_as(capability)
    monkeypatch.setattr(attention_fa4, "varlen_function", lambda: object())  # as if installed
    with fake_cuda():
        prefill = attn(sparse=False)
        assert dispatch.dense_kernel(prefill, DenseConfig()) == ("fa4" if capability in FA4 else "triton")
        if capability not in FA4:
            with pytest.raises(ValueError, match=r"impl='fa4': flash-attn-4 runs here on sm_90 and sm_100"):
                dispatch.dense_kernel(prefill, DenseConfig(impl="fa4"))
        if capability not in NO_FP8:  # fp8 caches take flash-attn-4 only when pinned
            assert dispatch.dense_kernel(attn(kv=FP8, sparse=False), DenseConfig()) == "triton"


# --------------------------------------------------------------------------- fp8
FP8_CALLS = {
    "fp8 K/V under a bf16 q": dict(kv=FP8),
    "fp8 q, K, V": dict(q=FP8),
    "fp8 K/V with e4m3 partials": dict(kv=FP8, partial_dtype=FP8),
}


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
@pytest.mark.parametrize("call", FP8_CALLS)
def test_fp8_attention_needs_sm89(act_as, capability, call):
    act_as(capability)
    with fake_cuda():
        sparse, dense = attn(**FP8_CALLS[call]), attn(sparse=False, **{k: v for k, v in FP8_CALLS[call].items()
                                                                         if k != "partial_dtype"})
        checks = [
            lambda: dispatch.use_triton(sparse.q, dispatch.kvouter_unsupported(sparse)),
            lambda: dispatch.use_triton(sparse.q, dispatch.decode_unsupported(sparse)),
            lambda: dispatch.dense_kernel(dense, DenseConfig()) == "triton",
        ]
        for check in checks:
            if capability in NO_FP8:
                name = f"sm_{capability[0]}{capability[1]} \\({capability[0]}.{capability[1]}\\)"
                with pytest.raises(dispatch.UnsupportedGPUError, match=rf"compute capability 8.9 or newer .*{name}"):
                    check()
            else:
                assert check()


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
@pytest.mark.parametrize("per_token,fp8_dot", [(True, True), (False, True), (True, False)],
                         ids=["per-token-dot", "one-scale-dot", "widened"])
def test_fp8_index_keys_need_sm89(act_as, capability, per_token, fp8_dot):
    """The fp8 dot (e4m3 MMA) is an option of fp8 keys: below sm_89 the keys themselves are
    refused, with or without it (Triton has no e4m3 type there), never run another way."""
    act_as(capability)
    with fake_cuda():
        idx = index_call(k=FP8, per_token=per_token, fp8_dot=fp8_dot)
        if capability in NO_FP8:
            with pytest.raises(dispatch.UnsupportedGPUError, match=r"float8_e4m3fn inputs .* need a GPU with fp8 tensor cores"):
                dispatch.use_triton(idx.index_q, dispatch.index_unsupported(idx))
        else:
            assert dispatch.use_triton(idx.index_q, dispatch.index_unsupported(idx))
            assert index_plan.plan(idx).k_cast == (not fp8_dot)  # the fp8 dot only where it was asked for


def test_pinned_choices_are_kept_or_refused_on_a_gpu_without_fp8(act_as, monkeypatch):
    act_as((8, 0))
    with fake_cuda():
        fp8 = attn(kv=FP8)
        refusal = dispatch.kvouter_unsupported(fp8)
        # Pinned Triton: refused, not swapped for the torch code.
        with pytest.raises(dispatch.UnsupportedGPUError, match="sm_80"):
            dispatch.use_triton(fp8.q, refusal, impl="triton")
        # Pinned torch (per call or for the process): the torch code, which takes fp8 anywhere.
        assert not dispatch.use_triton(fp8.q, refusal, impl="torch")
        assert dispatch.dense_kernel(attn(kv=FP8, sparse=False), DenseConfig(impl="torch")) == "torch"
        monkeypatch.setenv("M3_SPARSE_IMPL", "torch")
        assert not dispatch.use_triton(fp8.q, refusal)
        # A bf16 call on the same GPU is not affected.
        monkeypatch.delenv("M3_SPARSE_IMPL")
        bf16 = attn()
        assert dispatch.use_triton(bf16.q, dispatch.kvouter_unsupported(bf16), impl="triton")


# --------------------------------------------------------------------------- below sm_80
@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)], ids=["sm75", "sm70", "sm61"])
def test_gpus_below_sm80_are_refused(act_as, capability):
    act_as(capability)
    name = rf"cuda:0 is sm_{capability[0]}{capability[1]} \({capability[0]}.{capability[1]}\)"
    with fake_cuda():
        bf16 = attn()
        for run in (
            lambda: dispatch.use_triton(bf16.q, dispatch.kvouter_unsupported(bf16)),
            lambda: dispatch.use_triton(bf16.q, dispatch.decode_unsupported(bf16)),
            lambda: dispatch.dense_kernel(attn(sparse=False), DenseConfig()),
            lambda: dispatch.use_triton(cuda(2, 8, 4, 128)),  # index_prep: no reason of its own
            lambda: dispatch.use_triton(bf16.q, None, impl="triton"),
        ):
            with pytest.raises(dispatch.UnsupportedGPUError, match=rf"compute capability 8.0 or newer .*{name}"):
                run()
        assert not dispatch.use_triton(bf16.q, dispatch.kvouter_unsupported(bf16), impl="torch")
        assert dispatch.dense_kernel(attn(sparse=False), DenseConfig(impl="torch")) == "torch"


def test_ops_on_the_cpu_are_not_asked_about_a_gpu(act_as):
    """The override changes GPU choices only: CPU tensors run the torch code at any capability."""
    act_as((7, 0))
    assert not dispatch.use_triton(torch.zeros(1))
    assert dispatch.gpu_unsupported(torch.zeros(1), fp8=True) is None


# --------------------------------------------------------------------------- the override
def test_override_is_parsed_and_checked(monkeypatch):
    monkeypatch.setenv(launch.CAPABILITY_ENV, " 12.1 ")
    assert launch.device_capability(0) == (12, 1)
    assert launch.device_capability(3) == (12, 1)  # every device
    for bad in ("8", "sm_80", "8.x", "eight"):
        monkeypatch.setenv(launch.CAPABILITY_ENV, bad)
        with pytest.raises(ValueError, match=rf"M3_SPARSE_CAPABILITY: expected a compute capability as major.minor .*{bad!r}"):
            launch.device_capability(0)


def test_shared_memory_limits():
    assert launch.shared_memory_per_block((9, 0)) == 227 << 10
    assert launch.shared_memory_per_block((8, 0)) == 163 << 10
    assert launch.shared_memory_per_block((8, 9)) == launch.shared_memory_per_block((12, 0)) == 99 << 10
    assert launch.shared_memory_per_block((11, 0)) == 99 << 10  # not listed: the smallest


PACKAGE = Path(m3_sparse.__file__).resolve().parent


def test_capability_is_read_in_one_place():
    """Every capability question goes through ``core.launch.device_capability`` (which the
    override answers): nothing else in the package asks torch, Triton or the driver."""
    asks = re.compile(r"get_device_capability|get_device_properties\([^)]*\)\.(major|minor)|\bcapability\s*=\s*torch")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line) and path != PACKAGE / "core" / "launch.py"
    ]
    assert not found, f"capability read outside core/launch.py: {found}"


# --------------------------------------------------------------------------- shared memory
SMALL_SMEM = {(8, 6), (8, 9), (12, 0)}  # 99 KB a block, against 163 KB (sm_80) and 227 KB


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_tiles_fit_the_gpus_shared_memory(act_as, capability):
    """Where a GPU has 99 KB of shared memory a block, the plans halve the key tiles of fp32
    calls (and wide heads), which would not load there; M3's bf16 tiles are the same on
    every GPU. test_gpu_compile.py checks the compiled kernels against each limit."""
    from m3_sparse.decode import plan as decode_plan
    from m3_sparse.dense import plan as dense_plan

    act_as(capability)
    small = capability in SMALL_SMEM
    with fake_cuda():
        assert decode_plan.plan(attn(b=4, s=1)).bn == 64
        assert decode_plan.plan(attn(b=4, s=1, hq=4, d=96, q=torch.float32)).bn == (32 if small else 64)
        assert dense_plan.plan(attn(sparse=False)).bn == 64
        assert dense_plan.plan(attn(b=4, s=1, page=128, sparse=False)).bn == (64 if small else 128)
        assert dense_plan.plan(attn(hq=16, q=torch.float32, sparse=False)).bn == (32 if small else 64)
        assert dense_plan.plan(attn(sparse=False), DenseConfig(block_n=64, use_tma=False)).bn == 64  # pinned: kept


@pytest.mark.parametrize("capability", SERVED, ids=IDS)
def test_kvouter_blocks_that_do_not_fit_run_the_decode_kernel(act_as, capability):
    """The tl KV-outer kernel keeps a whole block resident: in fp32 (160 KB at M3's head) it
    fits sm_80 and sm_90+, not a 99 KB GPU, where ``sparse_attention`` runs the decode
    kernel instead; pinned to the tl kernel, the call is refused with the sizes."""
    act_as(capability)
    small = capability in SMALL_SMEM
    with fake_cuda():
        fp32 = attn(hq=16, q=torch.float32)
        why = dispatch.kvouter_unsupported(fp32)
        assert dispatch.runs_decode(fp32) == small
        assert dispatch.runs_decode(attn()) is False  # M3's bf16 prefill: KV-outer everywhere
        if small:
            assert "resident in shared memory, about 165888 bytes; this GPU allows 101376 per block" in why
            assert not dispatch.use_triton(fp32.q, why)  # kvouter_attention on auto: the torch stages
            with pytest.raises(ValueError, match="impl='triton': the Triton KV-outer kernel keeps a block"):
                dispatch.use_triton(fp32.q, why, impl="triton")
        else:
            assert why is None


def test_plans_off_the_gpu_are_the_h200s():
    """The interpreter has no shared-memory limit: the CPU runs the tiles the H200 runs."""
    assert launch.shared_memory(torch.device("cpu")) == launch.shared_memory_per_block((9, 0))
