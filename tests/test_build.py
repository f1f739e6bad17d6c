"""The hub layout: build/ is generated from torch-ext/, and the kernels loader
finds and imports the right variant offline."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import kernels  # a dependency of the project: its absence is an error, not a skip
import kernels_data
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build_kernel.py"
SOURCE_PKG = ROOT / "torch-ext" / "m3_sparse"
PUBLIC_NAMES = (
    "index_topk",
    "kvouter_attention",
    "dense_paged_attention",
    "build_kvouter_index",
    "schedule",
    "kvouter_partials",
    "combine",
    "reference",
)
EXPECTED_ARCHS = ["9.0", "10.0"]



def _run_build_script(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "build_kernel.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_project(dst: Path) -> Path:
    """The parts of the tree the build script reads and writes."""
    (dst / "scripts").mkdir(parents=True)
    shutil.copy2(BUILD_SCRIPT, dst / "scripts" / "build_kernel.py")
    shutil.copy2(ROOT / "build.toml", dst / "build.toml")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "torch-ext", dst / "torch-ext", ignore=ignore)
    return dst


def _source_package():
    """torch-ext/m3_sparse imported as a plain package.

    Reuses a copy another test already imported: a second copy of the same
    sources would register its ops under the same (unrewritten) namespace.
    """
    init = (SOURCE_PKG / "__init__.py").resolve()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve() == init:
            return mod
    if "m3_sparse" not in sys.modules:
        sys.path.insert(0, str(SOURCE_PKG.parent))
        try:
            return importlib.import_module("m3_sparse")
        finally:
            sys.path.remove(str(SOURCE_PKG.parent))
    name = "_m3_sparse_source_for_test_build"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(SOURCE_PKG)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _variant_of(module) -> str:
    return Path(module.__file__).resolve().parent.name


def _small_kvouter_case(device="cpu"):
    """Two sequences over a shared page pool, with empty slots and a repeated block id."""
    g = torch.Generator().manual_seed(0)
    page_size, block_size, d, hq, hkv, topk = 16, 16, 16, 4, 2, 3
    kv_lens = [40, 25]
    q_lens = [3, 2]
    num_pages = 7
    k_cache = torch.randn(num_pages, hkv, page_size, d, generator=g)
    v_cache = torch.randn(num_pages, hkv, page_size, d, generator=g)
    block_tables = torch.tensor([[4, 0, 6], [2, 5, -1]], dtype=torch.int32)
    tq = sum(q_lens)
    q = torch.randn(tq, hq, d, generator=g)
    selected = torch.tensor(
        [
            [[0, 2, -1], [1, 2, 2]],
            [[2, -1, -1], [0, 1, 2]],
            [[1, 2, 0], [2, -1, 0]],
            [[0, 1, -1], [1, -1, -1]],
            [[1, 0, 1], [-1, 1, 0]],
        ],
        dtype=torch.int32,
    )
    assert selected.shape == (tq, hkv, topk)
    args = (q, k_cache, v_cache, selected, block_tables)
    kwargs = dict(
        cu_seqlens_q=torch.tensor([0, q_lens[0], tq], dtype=torch.int32),
        used_kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_size=block_size,
        return_lse=True,
    )
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


# (a) build/ in sync ---------------------------------------------------------


def test_build_dir_in_sync_with_sources():
    res = _run_build_script(ROOT, "--check")
    assert res.returncode == 0, f"build/ is stale:\n{res.stdout}{res.stderr}"


def test_check_flags_a_stale_build_and_generation_is_deterministic(tmp_path):
    # Independent of whether the real build/ is current: that is the test above.
    root = _copy_project(tmp_path / "proj")
    assert _run_build_script(root, "--check").returncode == 1  # no build/ yet
    assert _run_build_script(root).returncode == 0
    assert _run_build_script(root, "--check").returncode == 0

    src = root / "torch-ext" / "m3_sparse" / "kvouter" / "combine.py"
    src.write_text(src.read_text() + "\n# changed\n")
    res = _run_build_script(root, "--check")
    assert res.returncode == 1
    assert "differs: build/torch-cpu/kvouter/combine.py" in res.stderr
    assert "differs: build/torch-cuda/_ops.py" in res.stderr  # the id follows the sources
    assert "python scripts/build_kernel.py" in res.stderr

    (root / "build" / "torch-rocm").mkdir()
    (root / "build" / "torch-rocm" / "__init__.py").write_text("")
    assert "unexpected: build/torch-rocm/__init__.py" in _run_build_script(root, "--check").stderr

    assert _run_build_script(root).returncode == 0
    first = {p.relative_to(root): p.read_bytes() for p in sorted((root / "build").rglob("*")) if p.is_file()}
    assert _run_build_script(root).returncode == 0
    second = {p.relative_to(root): p.read_bytes() for p in sorted((root / "build").rglob("*")) if p.is_file()}
    assert first == second
    assert not (root / "build" / "torch-rocm").exists()
    assert _run_build_script(root, "--check").returncode == 0


def test_variants_have_distinct_ids_matching_their_op_namespace():
    ids = {}
    for variant in ("torch-cpu", "torch-cuda"):
        meta = kernels_data.Metadata.read_from_file(ROOT / "build" / variant / "metadata.json")
        raw = json.loads((ROOT / "build" / variant / "metadata.json").read_text())
        assert str(meta.name) == "m3-sparse" and meta.name.python_name == "m3_sparse"
        assert meta.version == 1 and meta.license == "Apache-2.0" and meta.python_depends == []
        assert raw["id"] == meta.id
        ops_src = (ROOT / "build" / variant / "_ops.py").read_text()
        assert f'NAMESPACE = "{meta.id}"' in ops_src
        ids[variant] = meta.id
    assert len(set(ids.values())) == 2, ids


# (b) offline load through the kernels loader ----------------------------------


def test_get_local_kernel_loads_and_matches_torch_ext():
    module = kernels.get_local_kernel(ROOT)
    expected_variant = "torch-cuda" if torch.version.cuda is not None else "torch-cpu"
    assert _variant_of(module) == expected_variant
    for name in PUBLIC_NAMES:
        assert hasattr(module, name), f"loaded kernel lacks {name}"
    meta = kernels_data.Metadata.read_from_file(ROOT / "build" / expected_variant / "metadata.json")
    assert module._ops.NAMESPACE == meta.id

    source = _source_package()
    assert source is not module
    args, kwargs = _small_kvouter_case()
    out, lse = module.kvouter_attention(*args, **kwargs)
    ref_out, ref_lse = source.kvouter_attention(*args, **kwargs)
    assert out.shape == args[0].shape and lse.shape == (args[0].shape[1], args[0].shape[0])
    assert torch.isfinite(out).all()
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


# (c) arch declarations -------------------------------------------------------


def test_cuda_variant_declares_hopper_and_blackwell():
    meta = kernels_data.Metadata.read_from_file(ROOT / "build" / "torch-cuda" / "metadata.json")
    assert meta.backend.backend_type == kernels_data.Backend.CUDA
    assert meta.backend.archs == EXPECTED_ARCHS
    cpu = kernels_data.Metadata.read_from_file(ROOT / "build" / "torch-cpu" / "metadata.json")
    assert cpu.backend.backend_type == kernels_data.Backend.CPU
    assert cpu.backend.archs is None

    # What the loader's arch check makes of them (kernels 0.16 internals).
    from kernels.archs import _supports_cuda_capability

    assert _supports_cuda_capability(meta.backend.archs, (9, 0))
    assert _supports_cuda_capability(meta.backend.archs, (10, 0))
    assert not _supports_cuda_capability(meta.backend.archs, (8, 0))


# (d) variant resolution -------------------------------------------------------


def test_get_local_kernel_backend_cpu_picks_torch_cpu():
    module = kernels.get_local_kernel(ROOT, backend="cpu")
    assert _variant_of(module) == "torch-cpu"
    assert module.__name__ == kernels_data.Metadata.read_from_file(ROOT / "build" / "torch-cpu" / "metadata.json").id


def test_resolution_picks_the_noarch_variant_per_backend():
    # Resolve for simulated systems (kernels 0.16 internals), so that the CUDA
    # choice is checked on a CPU-only torch too.
    from packaging.version import Version

    from kernels.backends import CPU, CUDA
    from kernels.variants import _resolve_variant_for_system, get_variants_local

    variants = get_variants_local(ROOT / "build")
    assert sorted(v.variant_str for v in variants) == ["torch-cpu", "torch-cuda"]
    for backend, expected in ((CPU(), "torch-cpu"), (CUDA(version=Version("12.8")), "torch-cuda")):
        accepted, _ = _resolve_variant_for_system(
            variants=variants,
            selected_backend=backend,
            cpu="x86_64",
            os="linux",
            torch_version=Version("2.13"),
            torch_cxx11_abi=True,
            tvm_ffi_version=None,
        )
        assert [v.variant_str for v in accepted] == [expected]


@pytest.mark.gpu
def test_cuda_variant_runs_on_the_device():
    module = kernels.get_local_kernel(ROOT)
    assert _variant_of(module) == "torch-cuda"
    args, kwargs = _small_kvouter_case("cuda")
    out, lse = module.kvouter_attention(*args, **kwargs)
    cpu_args, cpu_kwargs = _small_kvouter_case()
    ref_out, ref_lse = kernels.get_local_kernel(ROOT, backend="cpu").kvouter_attention(*cpu_args, **cpu_kwargs)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-4, atol=1e-4)
