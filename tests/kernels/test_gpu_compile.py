"""Every Triton kernel the package launches compiles for every GPU it serves, without one.

``gpu_targets.py`` runs the public ops, for one GPU at a time, with the capability override
set to that GPU's and tensors that only say they live on a GPU, and catches each
kernel launch on its way there: dispatch and the launchers decide which kernels and
variants (dtypes, tiles, constants) a GPU gets, so a new kernel or variant is covered as soon
as an op launches it. Then Triton compiles each distinct launch for the target through its
own launch path (the JIT's specialization of the launcher's arguments, its front end, its
GPU passes and ptxas, which the interpreter never runs), stopped before the launch. This
catches what only the GPU compiler rejects (types, layouts, MMA shapes such as an fp8 dot's
depth) and a kernel that would need more shared memory than the GPU lets one block have (it
would fail to load there).

Targets: sm_80 (which also compiles what the ops launch acting as sm_86 / sm_87: Triton
generates the same code for them, but sm_86 has 99 KB of shared memory to sm_80's 163 KB, so
the plans may choose smaller tiles there), sm_89, sm_90 (sm_90a: the Gluon kernels, with the
Triton release they are written for), sm_100 (and sm_103) and sm_120 (and sm_121).
fp8 calls run from sm_89 on and are refused below it; the Gluon kernels run on sm_90 only.
The decode kernel's variants are also compiled in test_triton_decode.py (sm_90, with a check
that its K/V loads are software-pipelined).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_targets
from kernel_test_utils import aot_compile
from m3_sparse.core import launch
from m3_sparse.dense import attention_fa4

SCRIPT = f"import runpy; runpy.run_path({str(Path(gpu_targets.__file__).resolve())!r}, run_name='__main__')"
ARCHS = sorted(gpu_targets.TARGETS)
# The compiles of one target run in a few shards, each in its own interpreter, so that
# pytest-xdist can spread them over its workers.
SHARDS = 2


@pytest.fixture(scope="module")
def recorded() -> dict:
    """What the ops launch on every target (no compiling): one interpreter for all."""
    return aot_compile(SCRIPT, "record", *map(str, ARCHS))


def _calls(recorded: dict, arch: int) -> dict:
    return recorded["targets"][str(arch)]["calls"]


def test_dispatch_launches_every_kernel_of_the_package(recorded):
    """Each Triton kernel the package defines (those no other Triton function names) is
    launched by some op on some target: the compile test below cannot miss one. The Gluon
    kernels run only with the Triton release they are written for."""
    defined = {f"{module}.{name}" for module, names in recorded["kernels"].items() for name in names}
    assert len(defined) >= 15, sorted(defined)
    launched = set().union(*(set(t["launched"]) for t in recorded["targets"].values()))
    missing = defined - launched
    if recorded["targets"]["90"]["gluon_reason"] is not None:
        gluon = {k for k in missing if "_gluon_" in k}
        assert gluon == {k for k in defined if "_gluon_" in k}, sorted(gluon)
        missing -= gluon
    assert not missing, f"kernels no op launches on any target (add a call to gpu_targets.calls()): {sorted(missing)}"
    assert not launched - defined, sorted(launched - defined)


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm{a}" for a in ARCHS])
def test_each_gpu_gets_the_kernels_it_has(recorded, arch):
    """Per target: fp8 calls are refused below sm_89 (an UnsupportedGPUError that names the
    GPU), pinned Gluon calls off sm_90 or with another Triton (the pin's ValueError), the tl
    KV-outer kernel pinned on a block too big for a GPU's shared memory there only, and
    everything else runs; dense key tiles are TMA boxes from sm_90 on; flash-attn-4 (its
    page-tail kernel) runs on sm_90 / sm_100 only."""
    target = gpu_targets.TARGETS[arch]
    fp8 = target.capability >= launch.FP8_CAPABILITY
    gluon_reason = recorded["targets"][str(arch)]["gluon_reason"]
    calls = _calls(recorded, arch)
    assert len(calls) >= 45
    for name, call in calls.items():
        if call["fp8"] and not fp8:
            assert call.get("error_type") == "UnsupportedGPUError", (name, call)
            assert "compute capability 8.9 or newer" in call["refused"] and f"sm_{arch} " in call["refused"], name
        elif call["gluon"] and gluon_reason is not None:
            assert call.get("error_type") == "ValueError" and "engine='tma'" in call["refused"], (name, call)
            assert gluon_reason in call["refused"], (name, call["refused"])
        elif call["smem"] and "refused" in call:  # the tl KV-outer kernel pinned on a block too big for the GPU
            assert call["error_type"] == "ValueError" and "resident in shared memory" in call["refused"], (name, call)
            assert launch.shared_memory_per_block(target.capability) < launch.shared_memory_per_block((9, 0)), name
        else:
            assert "refused" not in call, (name, call["refused"])
            if call["gluon"]:
                assert any("_tma_kernel(" in k for k in call["kernels"]), (name, call["kernels"])
            launched_fp8 = any("float8_e4m3fn" in k for k in call["kernels"])
            assert launched_fp8 <= fp8, (name, call["kernels"])
    assert calls["dense long prefill"]["tma"] == (target.capability >= launch.TMA_CAPABILITY)
    assert not calls["dense prefill, gathered K/V"]["tma"]
    fa4 = calls["dense prefill, flash-attn-4 installed (its page tails)"]["kernels"]
    if target.capability[0] in attention_fa4.ARCHS:
        assert [k.split("(")[0] for k in fa4] == ["_clear_page_tails_kernel"]
    else:
        assert all(k.startswith(("_dense_paged_attn_kernel(", "_merge_splits_kernel(")) for k in fa4), fa4
    if gluon_reason is None:  # sm_90 with the Gluon release: M3's prefill partials run the Gluon kernel
        assert any(k.startswith("_kvouter_partials_tma_kernel(") for k in calls["sparse prefill (KV-outer)"]["kernels"])


# Calls that must share every compile: a model's prefill and its decode steps (index prep),
# prompts of two lengths (one a multiple of 16, one not) over block tables of two widths (the
# same), KV-outer over two and three prompts, decode steps of two batch sizes (and widths), and
# a decode step's key splits, which grow with the history (their merge takes the count at run time).
SAME_COMPILES = [
    ("index prep, bf16, keys into the pool", "index prep, bf16, a decode step's keys into the pool"),
    ("index top-k prefill (key splits and their merge)", "index top-k prefill, a prompt of another length"),
    ("sparse prefill (KV-outer)", "sparse prefill (KV-outer), prompts of another length and count"),
    ("KV-outer, tl partials", "KV-outer, tl partials, prompts of another length and count"),
    ("KV-outer, Gluon partials pinned", "KV-outer, Gluon partials pinned, prompts of another length and count"),
    ("dense prefill", "dense prefill, a prompt of another length"),
    # a server's steps take many batch sizes
    ("sparse decode (key splits, merged in place)", "sparse decode, another batch"),
    ("index top-k decode (key splits and their merge)", "index top-k decode, another batch"),
    ("dense decode (key splits and their merge)", "dense decode, another batch"),
    ("dense decode, one sequence over 4K", "dense decode, one sequence over 32K"),
]


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm{a}" for a in ARCHS])
def test_lengths_share_their_compiles(recorded, arch):
    """A kernel compiles once for every length a model's calls take (core.launch:
    specializations): the decode step's index prep reuses the prefill's compile, a prompt of
    another length every kernel of the first, and a decode step of another batch size every
    kernel of the first (no int argument specialized on a length, no constant chosen from
    one). Triton specializes an int argument on being 1 and on being a multiple of 16 unless
    its kernel says otherwise."""
    calls = _calls(recorded, arch)
    for first, second in SAME_COMPILES:
        if "refused" in calls[first]:  # the Gluon kernel off its GPU or its Triton release
            assert "refused" in calls[second], second
            continue
        assert calls[first]["keys"], first
        assert sorted(set(calls[first]["keys"])) == sorted(set(calls[second]["keys"])), (first, second)


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm{a}" for a in ARCHS])
def test_kernels_compile_for_the_gpu(arch, shard):
    out = aot_compile(SCRIPT, "compile", str(arch), str(shard), str(SHARDS))
    compiled, total = out["compiled"], out["distinct"]
    assert total >= 30, total
    assert len(compiled) == len(range(shard, total, SHARDS)), [c["launch"] for c in compiled]
    bad = {c["launch"]: c["error"] for c in compiled if not c["ok"]}
    assert not bad, f"kernels that do not compile for sm_{arch}: {json.dumps(bad, indent=1)}"
    # Each launch within the shared memory a block may use on every GPU that launches it.
    over = {}
    for c in compiled:
        for cap in c["capabilities"]:
            limit = launch.shared_memory_per_block(launch.parse_capability(cap))
            if c["shared"] > limit:
                over[f"{c['launch']} on {cap}"] = f"{c['shared']} bytes of {limit}"
    assert not over, f"kernels over the shared memory a block may use: {json.dumps(over, indent=1)}"
