"""Argument checks that test_kernel_validation.py leaves out: memory layouts (strided
integer tensors and head dims), tensors on a device the forced Triton path cannot run
on, and the M3_SPARSE_DEBUG switch (value checks read device memory only when set).

The Triton paths run on the GPU where there is one, else in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 without CUDA), pinned with M3_SPARSE_IMPL=triton.
"""

from __future__ import annotations

import pytest
import torch

import m3_sparse
from kernel_test_utils import gen, make_batch, randn, random_selection
from m3_sparse.core import validate as _validate
from m3_sparse.core.validate import attention_args, index_args

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
PAGE, BLOCK, TOPK, HQ, HKV, D = 16, 16, 3, 4, 2, 16


def problem(seed: int = 3, pad=-1):
    g = gen(seed)
    batch = make_batch(g, [(70, 5), (40, 3), (23, 23)], PAGE, pad=pad)
    return {
        "q": randn(g, batch.num_tokens, HQ, D).to(DEV),
        "k": batch.kv_cache(g, HKV, D).to(DEV),
        "v": batch.kv_cache(g, HKV, D).to(DEV),
        "sel": random_selection(g, batch, HKV, TOPK, BLOCK).to(DEV),
        "iq": randn(g, batch.num_tokens, HKV, D).to(DEV),
        "ik": batch.index_cache(g, D).to(DEV),
        "block_tables": batch.block_tables.to(DEV),
        "cu_seqlens_q": batch.cu_seqlens_q.to(DEV),
        "used_kv_lens": batch.used_kv_lens.to(DEV),
    }


def run(op: str, p: dict):
    kw = {"cu_seqlens_q": p["cu_seqlens_q"], "used_kv_lens": p["used_kv_lens"]}
    if op == "kvouter_attention":
        return m3_sparse.kvouter_attention(
            p["q"], p["k"], p["v"], p["sel"], p["block_tables"], **kw, block_size=BLOCK, return_lse=True
        )
    if op == "dense_paged_attention":
        return m3_sparse.dense_paged_attention(p["q"], p["k"], p["v"], p["block_tables"], **kw, return_lse=True)
    sel = m3_sparse.index_topk(p["iq"], p["ik"], p["block_tables"], **kw, topk=TOPK, block_size=BLOCK)
    return (torch.sort(sel, -1).values,)  # slot order is not part of the contract


def column_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, stride(1) != 1."""
    return t.t().contiguous().t()


def every_other(t: torch.Tensor) -> torch.Tensor:
    """Same values as a 1-D view with stride 2. The slots in between repeat each
    value, so a kernel that ignores the stride reads wrong but in-range lengths (an
    out-of-range read would crash the interpreter instead of failing the test)."""
    return t.repeat_interleave(2)[::2]


RESTRIDE = {
    "block_tables": column_major,
    "cu_seqlens_q": every_other,
    "used_kv_lens": every_other,
}
OPS = ["kvouter_attention", "dense_paged_attention", "index_topk"]


@pytest.mark.parametrize("arg", sorted(RESTRIDE))
@pytest.mark.parametrize("op", OPS)
def test_triton_paths_take_strided_integer_tensors(op, arg, monkeypatch):
    """A strided block table or length vector holds the same values as a contiguous
    one: the Triton launchers must either honour its strides, copy it, or reject it
    by name, never read the wrong elements."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    # Table entries past each sequence's pages are pool pages here (not -1), so that
    # a misread table stays inside the pool.
    p = problem(pad="pool")
    want = run(op, p)
    p[arg] = RESTRIDE[arg](p[arg])
    assert p[arg].stride() != p[arg].contiguous().stride()
    try:
        got = run(op, p)
    except ValueError as err:  # a clear rejection is acceptable
        assert arg in str(err), f"rejection does not name {arg}: {err}"
        return
    for w, o in zip(want, got):
        if w is not None:
            assert torch.equal(w, o), f"{op}: a strided {arg} changed the result"


@pytest.mark.parametrize("op", ["kvouter_attention", "dense_paged_attention"])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_forced_triton_rejects_strided_head_dim_by_name(op, arg, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    p = problem()
    x = p[arg]
    p[arg] = torch.stack([x, x], -1).flatten(-2)[..., ::2]  # same values, head-dim stride 2
    assert p[arg].stride(-1) == 2
    name = {"q": "q", "k": "k_cache", "v": "v_cache"}[arg]
    with pytest.raises(ValueError) as info:
        run(op, p)
    assert name in str(info.value), f"rejection does not name {name}: {info.value}"


@pytest.mark.gpu  # the automatic choice runs Triton only on CUDA tensors
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_auto_takes_a_strided_head_dim(arg, monkeypatch):
    """In the automatic mode a layout the kernel does not take runs the torch code
    (``_dispatch`` promises this) instead of raising."""
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    p = problem()
    want = run("kvouter_attention", p)
    x = p[arg]
    p[arg] = torch.stack([x, x], -1).flatten(-2)[..., ::2]
    assert torch.equal(p[arg], x) and p[arg].stride(-1) == 2
    got = run("kvouter_attention", p)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", OPS)
def test_forced_triton_refuses_cpu_tensors_without_interpreter(op, monkeypatch):
    """A CPU tensor reaching a GPU-only kernel is refused with the device named,
    not handed to Triton."""
    monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = {k: v.cpu() for k, v in problem().items()}
    with pytest.raises(RuntimeError, match="CUDA tensors.*cpu"):
        run(op, p)


# ------------------------------------------------------------------ M3_SPARSE_DEBUG


def meta_args():
    """Arguments on the meta device: shapes and dtypes but no data, so any value read
    raises. That stands in for an accelerator where a read would be a host sync."""
    m = torch.device("meta")
    return dict(
        q=torch.empty(5, HQ, D, device=m),
        k=torch.empty(10, HKV, PAGE, D, device=m),
        sel=torch.empty(5, HKV, TOPK, dtype=torch.int32, device=m),
        bt=torch.empty(2, 4, dtype=torch.int32, device=m),
        cu=torch.empty(3, dtype=torch.int32, device=m),
        kv=torch.empty(2, dtype=torch.int32, device=m),
    )


def sparse_args(a):
    return attention_args(
        a["q"], a["k"], a["k"], a["bt"], cu_seqlens_q=a["cu"], used_kv_lens=a["kv"], softmax_scale=None,
        causal=True, return_lse=False, selected=a["sel"], block_size=BLOCK,
    )


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_without_debug_validation_reads_no_device_values(value, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_DEBUG", value)
    a = meta_args()
    assert sparse_args(a).batch == 2
    index_args(a["q"][:, :HKV], a["k"][:, 0], a["bt"], cu_seqlens_q=a["cu"], used_kv_lens=a["kv"], topk=TOPK, block_size=BLOCK)
    _validate.check_selected_values(a["sel"], 4)  # build_kvouter_index's value check


@pytest.mark.parametrize("value", ["1", "true"])
def test_debug_reads_device_values(value, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_DEBUG", value)
    assert _validate.debug_enabled()
    a = meta_args()
    with pytest.raises(NotImplementedError):  # it tried to copy the values to the host
        sparse_args(a)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,arg",
    [
        ("block id past the table", "selected"),
        ("block id -2", "selected"),
        ("page outside the pool", "block_tables"),
        ("kv length past the table", "used_kv_lens"),
    ],
)
def test_debug_mode_checks_values_on_cuda(case, arg, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_DEBUG", "1")
    p = problem()
    if case == "block id past the table":
        p["sel"][0, 0, 0] = p["block_tables"].shape[1] * PAGE // BLOCK
    elif case == "block id -2":
        p["sel"][1, 1, 1] = -2
    elif case == "page outside the pool":
        p["block_tables"][0, 0] = p["k"].shape[0]
    else:
        p["used_kv_lens"][1] = p["block_tables"].shape[1] * PAGE + 1
    with pytest.raises(ValueError, match=arg):
        run("kvouter_attention", p)
