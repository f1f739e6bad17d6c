"""Identical inputs give bitwise identical outputs: every kernel 20 times on fresh
random inputs, and generate() of the tiny M3 model several times (token ids and the
logits of every step).

On a CUDA device (marker ``gpu``) the ops run their GPU paths at moderate M3-shaped
sizes: the Triton index kernels (prefill, split decode + merge, fp8 keys), KV-outer
(index build and schedule in torch, Triton partials and combine), the dense paged
attention (torch and Triton) and the decode kernel. On the CPU the torch paths run
the same checks at small sizes (about ten seconds in all).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention
from model_utils import PAD, greedy, random_prompt, save_tiny_text_model

RUNS = 20


@pytest.fixture(scope="module")
def kernel():
    return m3_hf_attention.load_kernel()


@pytest.fixture(autouse=True)
def _impl(monkeypatch):
    monkeypatch.delenv("M3_SPARSE_IMPL", raising=False)
    monkeypatch.delenv("M3_SPARSE_DEBUG", raising=False)


# ----------------------------------------------------------------------------- inputs


class Problem:
    """A ragged batch over a shuffled page pool with random q/K/V, index queries/keys
    and messy selections (the local block, random earlier blocks, -1 slots, repeats).
    Block-table entries past each sequence's pages are -1."""

    def __init__(self, device, seqs, *, hq, hkv, d, page, block, topk, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.block, self.topk = block, topk
        kv = [s[0] for s in seqs]
        ql = [s[1] for s in seqs]
        need = [-(-n // page) for n in kv]
        pages = sum(need) + 1
        width = max(need) + 1
        order = torch.randperm(pages, generator=g)
        tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
        nxt = 0
        for b, n in enumerate(need):
            tables[b, :n] = order[nxt : nxt + n].to(torch.int32)
            nxt += n
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(ql).cumsum(0)
        tq = int(cu[-1])
        dev = self.device
        self.tables = tables.to(dev)
        self.kw = {"cu_seqlens_q": cu.to(dev), "used_kv_lens": torch.tensor(kv, dtype=torch.int32).to(dev)}
        self.q = torch.randn(tq, hq, d, generator=g).to(dev, dtype)
        self.k = torch.randn(pages, hkv, page, d, generator=g).to(dev, dtype)
        self.v = torch.randn(pages, hkv, page, d, generator=g).to(dev, dtype)
        self.iq = torch.randn(tq, hkv, d, generator=g).to(dev, dtype)
        self.ik = torch.randn(pages, page, d, generator=g).to(dev, dtype)
        pos = torch.cat([torch.arange(n - m, n) for n, m in zip(kv, ql)]).clamp(min=0)
        last = pos // block
        # Random earlier blocks: uniform in [0, last], so a few repeat the local block.
        earlier = (torch.rand(tq, hkv, topk, generator=g) * (last[:, None, None] + 1)).long()
        sel = torch.where(torch.rand(tq, hkv, topk, generator=g) < 0.2, -1, earlier)
        sel[:, :, 0] = last[:, None]
        self.sel = sel.to(torch.int32).to(dev)
        self.max_blocks = -(-width * page // block)


def m3_problem(device, seqs, dtype=torch.bfloat16, seed=0):
    """M3 shapes on the GPU (Hq 64, Hkv 4, D 128, block 128, top-16, page 64), a small
    GQA problem on the CPU."""
    if torch.device(device).type == "cuda":
        return Problem(device, seqs, hq=64, hkv=4, d=128, page=64, block=128, topk=16, dtype=dtype, seed=seed)
    return Problem(device, seqs, hq=8, hkv=2, d=32, page=16, block=16, topk=4, dtype=torch.float32, seed=seed)


def prefill(device):
    if torch.device(device).type == "cuda":
        return [(3000, 3000), (1500, 700), (300, 1), (5, 9)]
    return [(150, 60), (40, 40), (3, 5)]


def decode(device):
    if torch.device(device).type == "cuda":
        return [(8000, 1), (130, 1), (4000, 4), (1, 1), (2500, 2)]
    return [(200, 1), (17, 2), (1, 1)]


# ----------------------------------------------------------------------------- ops


def op_index_prefill(k, device):
    p = m3_problem(device, prefill(device))
    return lambda: (k.index_topk(p.iq, p.ik, p.tables, **p.kw, topk=p.topk, block_size=p.block),)


def op_index_decode(k, device):
    p = m3_problem(device, decode(device))
    return lambda: (k.index_topk(p.iq, p.ik, p.tables, **p.kw, topk=p.topk, block_size=p.block, max_seqlen_q=4),)


def _fp8(k, device, fp8_dot, seqs):
    p = m3_problem(device, seqs)
    keys = p.ik.float()
    scale = (keys.abs().amax(-1) / 448.0).clamp(min=1e-12)
    codes = (keys / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return lambda: (
        k.index_topk(p.iq, codes, p.tables, **p.kw, topk=p.topk, block_size=p.block, index_k_scale=scale,
                     fp8_dot=fp8_dot),
    )


def op_index_fp8_prefill(k, device):
    return _fp8(k, device, False, prefill(device))


def op_index_fp8_decode(k, device):
    return _fp8(k, device, False, decode(device))


def op_index_fp8_dot(k, device):
    return _fp8(k, device, True, prefill(device))


def op_kvouter(k, device):
    p = m3_problem(device, prefill(device))
    return lambda: k.kvouter_attention(p.q, p.k, p.v, p.sel, p.tables, **p.kw, block_size=p.block, return_lse=True)


def op_kvouter_decode_shapes(k, device):
    p = m3_problem(device, decode(device))
    return lambda: k.kvouter_attention(p.q, p.k, p.v, p.sel, p.tables, **p.kw, block_size=p.block, return_lse=True)


def op_kvouter_stages(k, device):
    """The exported stages one by one (the torch partials on every device)."""
    p = m3_problem(device, prefill(device) if torch.device(device).type == "cpu" else [(700, 300), (90, 4)])

    def run():
        index = k.build_kvouter_index(p.sel, cu_seqlens_q=p.kw["cu_seqlens_q"], max_blocks=p.max_blocks)
        plan = k.schedule(index, tile_q=4, num_programs=7)
        po, pm, pl = k.kvouter_partials(p.q, p.k, p.v, index, p.tables, **p.kw, softmax_scale=0.1,
                                         block_size=p.block)
        out, lse = k.combine(po, pm, pl, index.slot_of, out_dtype=p.q.dtype, return_lse=True)
        return (index.seg_offsets, index.entry_token, index.entry_rank, index.slot_of, plan.tile_segment,
                plan.tile_start, plan.tile_end, plan.program_tiles, out, lse)

    return run


def op_dense(k, device):
    p = m3_problem(device, prefill(device))
    return lambda: k.dense_paged_attention(p.q, p.k, p.v, p.tables, **p.kw, return_lse=True)


def op_decode(k, device):
    p = m3_problem(device, decode(device))
    return lambda: k.sparse_decode_attention(p.q, p.k, p.v, p.sel, p.tables, **p.kw, block_size=p.block, return_lse=True)


OPS = {
    "index_prefill": op_index_prefill,
    "index_decode": op_index_decode,
    "index_fp8_prefill": op_index_fp8_prefill,
    "index_fp8_decode": op_index_fp8_decode,
    "index_fp8_dot": op_index_fp8_dot,
    "kvouter": op_kvouter,
    "kvouter_decode_shapes": op_kvouter_decode_shapes,
    "kvouter_stages": op_kvouter_stages,
    "dense": op_dense,
    "dense_triton": op_dense,  # the same call with M3_SPARSE_IMPL=triton
    "decode": op_decode,
}
# Only a GPU runs these differently from another case (on the CPU the torch code
# ignores fp8_dot, and the Triton dense kernel would run in the interpreter).
GPU_ONLY = {"index_fp8_dot", "dense_triton"}


def cases():
    for name in OPS:
        if name not in GPU_ONLY:
            yield pytest.param(name, "cpu", id=f"{name}-cpu")
        yield pytest.param(name, "cuda", id=f"{name}-cuda", marks=pytest.mark.gpu)


def assert_bitwise(first, again, run):
    assert len(first) == len(again)
    for i, (a, b) in enumerate(zip(first, again)):
        if a is None:
            assert b is None
            continue
        # Bitwise, NaNs and -0.0 included: compare the raw bytes.
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(
            a.contiguous().view(torch.uint8) if a.dtype.is_floating_point else a,
            b.contiguous().view(torch.uint8) if b.dtype.is_floating_point else b,
        )
        if not same:
            diff = (a.double() - b.double()).abs() if a.shape == b.shape else None
            where = f", largest difference {float(diff.nan_to_num().max()):.3e}" if diff is not None else ""
            pytest.fail(f"run {run}: output {i} differs from run 0{where}")


@pytest.mark.parametrize("name,device", list(cases()))
def test_op_is_bitwise_deterministic(kernel, name, device, monkeypatch):
    if name == "dense_triton":
        monkeypatch.setenv("M3_SPARSE_IMPL", "triton")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny CPU ops: threads only spin
    try:
        fn = OPS[name](kernel, device)
        first = fn()
        # The inputs really produce work: not every selection empty, not every output zero.
        main = first[0]
        assert main.numel() and (bool((main >= 0).any()) if not main.is_floating_point() else bool((main != 0).any()))
        for run in range(1, RUNS):
            assert_bitwise(first, fn(), run)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- generate()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-determinism")
    # Blocks of 16 keys: the Triton index and KV-outer kernels take them on a GPU.
    save_tiny_text_model(path, seed=5, index_block_size=16, index_topk_blocks=3)
    return path


def load(checkpoint, device, dtype):
    # The stock MoE experts loop accumulates with index_add_, whose CUDA atomics make the
    # sum order vary; batched_mm sums in a fixed order, so what is tested is attention.
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="m3_sparse", dtype=dtype, experts_implementation="batched_mm"
    )
    return model.to(device).eval()


def ragged_prompts(device, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = random_prompt(n, g)
        mask[i, width - n :] = 1
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize(
    "device,dtype,impl,lengths,new_tokens,repeats",
    [
        ("cpu", torch.float32, "auto", [150, 97], 8, 3),
        pytest.param("cuda", torch.bfloat16, "auto", [900, 413, 1], 48, 5, marks=pytest.mark.gpu),
        pytest.param("cuda", torch.bfloat16, "triton", [900, 413, 1], 48, 5, marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cuda-auto", "cuda-triton"],
)
def test_generate_is_bitwise_deterministic(checkpoint, device, dtype, impl, lengths, new_tokens, repeats, monkeypatch):
    monkeypatch.setenv("M3_SPARSE_IMPL", impl)
    model = load(checkpoint, device, dtype)
    ids, mask = ragged_prompts(device, lengths, seed=2)
    runs = []
    for _ in range(repeats):
        out = greedy(model, ids, mask, new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.logits)))
    seq0, logits0 = runs[0]
    assert seq0.shape[1] == ids.shape[1] + new_tokens
    for r, (seq, logits) in enumerate(runs[1:], 1):
        assert seq.tolist() == seq0.tolist(), f"generate run {r}: token ids differ from run 0"
        assert_bitwise((logits0,), (logits,), r)
