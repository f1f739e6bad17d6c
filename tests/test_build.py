"""The hub layout: build/ is generated from torch-ext/, carries what the kernels loader checks
(its metadata format, the digest, the compute capabilities), and the loader finds and imports
the right variant offline, on kernels 0.16.2 and 0.19.x alike."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import kernels  # a dependency of the project: its absence is an error, not a skip
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build_kernel.py"
KERNEL_LOADER = ROOT / "m3_hf_attention" / "_kernel.py"
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
# What transformers takes from a hub kernel that brings its own attention function.
TRANSFORMERS_ENTRY_POINTS = ("flash_attn_forward", "supports_flash_attn", "m3_sparse_attention")
EXPECTED_ARCHS = ["8.0+PTX"]
# A100, A10 / RTX 30, Orin, L40S / RTX 40, H100 / H200, B200, B300, Thor, RTX 50, GB10,
# and a generation that does not exist yet: Triton compiles for the device it runs on.
SERVED_CAPABILITIES = [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), (13, 0)]
REFUSED_CAPABILITIES = [(6, 1), (7, 0), (7, 5)]  # Pascal, Volta, Turing: no bf16 MMA for the kernels
FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _module_from_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The build script's helper is the one place that knows where each kernels release keeps
# its modules and types (kernels_data 0.16 / kernels._rust 0.19, kernels.* / kernels._internals.*).
build_kernel = _module_from_file("_build_kernel_under_test", BUILD_SCRIPT)
kernel_types = build_kernel.kernels_module("types")


def _metadata(variant: str, root: Path = ROOT):
    return kernel_types.Metadata.read_from_file(root / "build" / variant / "metadata.json")


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


def _copy_variants(dst: Path) -> Path:
    """build/'s variants as a hub snapshot or a second local repository would hold them."""
    shutil.copytree(ROOT / "build", dst / "build", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
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


def _build_toml() -> dict:
    return build_kernel.tomllib.loads((ROOT / "build.toml").read_text())


def _subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "KERNELS_CACHE", "M3_SPARSE_KERNEL")}
    env.update(extra)
    return env


# (a) build/ in sync, and checked with the loader's own parser and hashing -----------------


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


def test_check_catches_a_stale_digest_with_the_loaders_hashing(tmp_path):
    # In process (build_kernel.check is what --check prints): one import of kernels for all cases.
    root = _copy_project(tmp_path / "proj")
    build_kernel.write(root)
    variant = root / "build" / "torch-cpu"
    assert build_kernel.check(root) == []

    # A built file edited by hand: its hash no longer matches the digest.
    built = variant / "kvouter" / "combine.py"
    original = built.read_bytes()
    built.write_bytes(original + b"# edited\n")
    problems = build_kernel.check(root)
    # kernels' own violation text (Digest.validate), not a message of the script.
    assert "digest: build/torch-cpu: File hash mismatch for kvouter/combine.py" in " ".join(problems), problems
    built.write_bytes(original)

    # A digest that went stale while the files stayed: one recorded hash is wrong.
    meta_path = variant / "metadata.json"
    meta_bytes = meta_path.read_bytes()
    meta = json.loads(meta_bytes)
    meta["digest"]["files"]["api.py"] = meta["digest"]["files"]["custom_ops.py"]
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    problems = build_kernel.check(root)
    assert "differs: build/torch-cpu/metadata.json" in problems
    assert "digest: build/torch-cpu: File hash mismatch for api.py" in " ".join(problems), problems

    # No digest at all: what kernels 0.19 warns about on every load.
    del meta["digest"]
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    problems = build_kernel.check(root)
    assert "no digest: build/torch-cpu/metadata.json records none, so kernels cannot verify the variant" in problems
    meta_path.write_bytes(meta_bytes)

    # A file the digest does not list; bytecode caches aside, which kernels skips too.
    (variant / "kvouter" / "stray.pyo").write_bytes(b"x")
    (variant / "kvouter" / "__pycache__").mkdir(exist_ok=True)
    (variant / "kvouter" / "__pycache__" / "combine.cpython-311.pyc").write_bytes(b"x")
    problems = build_kernel.check(root)
    assert problems == [
        "unexpected: build/torch-cpu/kvouter/stray.pyo",
        "digest: build/torch-cpu: Unknown file: kvouter/stray.pyo",
    ]
    (variant / "kvouter" / "stray.pyo").unlink()
    assert build_kernel.check(root) == []

    # The command line reports them and fails.
    built.write_bytes(original + b"# edited\n")
    res = _run_build_script(root, "--check")
    assert res.returncode == 1
    assert "digest: build/torch-cpu: File hash mismatch for kvouter/combine.py" in res.stderr


def test_check_fails_loudly_without_the_kernels_parser(tmp_path):
    """Without kernels the metadata cannot be checked: an error (exit 2), never a silent pass."""
    root = _copy_project(tmp_path / "proj")
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.modules["kernels"] = None  # as if kernels (and kernels_data) were not installed
        sys.modules["kernels_data"] = None
        sys.argv = ["build_kernel.py", *sys.argv[1:]]
        runpy.run_path({str(root / "scripts" / "build_kernel.py")!r}, run_name="__main__")
        """
    )
    for args in (["--check"], []):
        res = subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        assert "the kernels loader is not installed" in res.stderr
        assert "kernels._rust, kernels_data" in res.stderr
    assert not (root / "build").exists()


def test_metadata_digest_is_what_the_loader_computes():
    for variant in ("torch-cpu", "torch-cuda"):
        variant_dir = ROOT / "build" / variant
        meta = _metadata(variant)
        assert meta.digest is not None, f"{variant}/metadata.json records no digest"
        assert str(meta.digest.algorithm) == str(kernel_types.DigestAlgorithm.SHA256)
        actual = kernel_types.Digest.hash_variant(meta.digest.algorithm, variant_dir)
        meta.digest.validate(actual)  # raises DigestValidationError listing each violation
        on_disk = {
            p.relative_to(variant_dir).as_posix()
            for p in variant_dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        }
        assert set(meta.digest.files) == on_disk - {"metadata.json"}


# (b) metadata and build.toml -----------------------------------------------------------


def test_variants_have_distinct_ids_matching_their_op_namespace():
    ids = {}
    for variant in ("torch-cpu", "torch-cuda"):
        meta = _metadata(variant)
        raw = json.loads((ROOT / "build" / variant / "metadata.json").read_text())
        assert str(meta.name) == "m3-sparse" and meta.name.python_name == "m3_sparse"
        assert meta.version == 1 and meta.license == "Apache-2.0"
        assert raw["id"] == meta.id
        ops_src = (ROOT / "build" / variant / "_ops.py").read_text()
        assert f'NAMESPACE = "{meta.id}"' in ops_src
        ids[variant] = meta.id
    assert len(set(ids.values())) == 2, ids


def test_build_toml_is_accepted_by_the_kernels_build_parser(tmp_path):
    build = getattr(kernel_types, "Build", None)
    if build is None:
        pytest.skip("this kernels release (0.16) has no build.toml parser")
    parsed = build.open(ROOT)
    assert [str(b) for b in parsed.general.backends] == [str(kernel_types.Backend.CPU), str(kernel_types.Backend.CUDA)]
    # The parser rejects what kernel-builder would: a snake_case key in [general.hub].
    (tmp_path / "build.toml").write_text(
        (ROOT / "build.toml").read_text().replace("repo-id =", "repo_id =", 1)
    )
    with pytest.raises(ValueError, match="repo_id"):
        build.open(tmp_path)


def test_hub_repo_id_is_real_and_named_by_the_card(tmp_path):
    repo_id = _build_toml()["general"]["hub"]["repo-id"]
    assert "<" not in repo_id and "org/" not in repo_id, repo_id
    card = (ROOT / "CARD.md").read_text()
    assert f'get_kernel("{repo_id}", version=1' in card
    assert f'attn_implementation="{repo_id}"' in card
    # kernel-builder renders CARD.md as a template: plain text must pass through unchanged.
    assert not any(token in card for token in ("{{", "{%", "{#"))

    # The script refuses a placeholder instead of writing a card-less, unpublishable id.
    root = _copy_project(tmp_path / "proj")
    toml = root / "build.toml"
    toml.write_text(toml.read_text().replace(f'repo-id = "{repo_id}"', 'repo-id = "<org>/m3-sparse"'))
    res = _run_build_script(root)
    assert res.returncode == 2
    assert "[general.hub] repo-id must be the hub repository 'namespace/name'" in res.stderr


def test_loader_version_is_the_kernel_major_version():
    loader = _module_from_file("_m3_kernel_loader_version", KERNEL_LOADER)
    version = _build_toml()["general"]["version"]
    assert loader.KERNEL_VERSION == version == _metadata("torch-cuda").version


def test_loader_hub_repo_id_is_build_toml_s():
    loader = _module_from_file("_m3_kernel_loader_repo", KERNEL_LOADER)
    assert loader.HUB_REPO_ID == _build_toml()["general"]["hub"]["repo-id"]


def test_no_python_depends_and_why():
    """build.toml declares no python-depends: the loader would refuse the cuda variant on a
    machine without the declared package (see build.toml). This is what both kernels releases
    do with nvidia-cutlass-dsl, the one dependency flash-attn-4 would have it declare."""
    for variant in ("torch-cpu", "torch-cuda"):
        assert _metadata(variant).python_depends == []
    if importlib.util.find_spec("cutlass") is not None:
        pytest.skip("nvidia-cutlass-dsl is installed here, so the loader would accept it")
    validate = build_kernel.kernels_module("python_deps").validate_dependencies
    backends = build_kernel.kernels_module("backends")
    from packaging.version import Version

    with pytest.raises(ImportError, match="pip install nvidia-cutlass-dsl"):
        validate("m3_sparse", ["nvidia-cutlass-dsl"], backends.CUDA(version=Version("12.8")))
    # Only the cuda backend lists it: declared for every backend, the cpu variant would fail too.
    with pytest.raises(ValueError, match="unsupported kernel dependency: nvidia-cutlass-dsl"):
        validate("m3_sparse", ["nvidia-cutlass-dsl"], backends.CPU())


# (c) offline load through the kernels loader -------------------------------------------------


def test_get_local_kernel_loads_and_matches_torch_ext():
    module = kernels.get_local_kernel(ROOT)
    expected_variant = "torch-cuda" if torch.version.cuda is not None else "torch-cpu"
    assert _variant_of(module) == expected_variant
    for name in PUBLIC_NAMES:
        assert hasattr(module, name), f"loaded kernel lacks {name}"
    assert module._ops.NAMESPACE == _metadata(expected_variant).id

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


def test_loading_verifies_the_digest_without_a_warning(caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="kernels"):
        warnings.simplefilter("always")
        kernels.get_local_kernel(ROOT)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    assert not [m for m in said if "digest" in m], said
    try:
        digest = importlib.import_module("kernels._internals.digest")
    except ModuleNotFoundError:
        return  # kernels 0.16 neither verifies nor warns: the metadata must only parse, as above
    # kernels 0.19 hashed the variant on this load; the same verification, looked at directly:
    variant = "torch-cuda" if torch.version.cuda is not None else "torch-cpu"
    result = digest.verify_digest(ROOT / "build" / variant, metadata=_metadata(variant), location=None)
    assert isinstance(result, digest.DigestVerificationResult.Success), str(result)
    assert any("match the digest" in r.getMessage() for r in caplog.records), "no digest check was logged"


def test_a_tampered_variant_is_refused_on_load(tmp_path):
    try:
        importlib.import_module("kernels._internals.digest")
    except ModuleNotFoundError:
        pytest.skip("this kernels release (0.16) does not verify digests on load; --check does (test above)")
    repo = _copy_variants(tmp_path / "repo")
    target = repo / "build" / "torch-cpu" / "kvouter" / "combine.py"
    target.write_text(target.read_text() + "\n# tampered\n")
    # Refused before the tampered code is imported.
    with pytest.raises(RuntimeError, match=r"do not match the digest(.|\n)*File hash mismatch for kvouter/combine.py"):
        kernels.get_local_kernel(repo, backend="cpu")


# (d) compute capabilities ------------------------------------------------------------------


def test_cuda_variant_serves_every_capability_from_sm80(monkeypatch):
    meta = _metadata("torch-cuda")
    assert meta.backend.backend_type == kernel_types.Backend.CUDA
    assert meta.backend.archs == EXPECTED_ARCHS
    cpu = _metadata("torch-cpu")
    assert cpu.backend.backend_type == kernel_types.Backend.CPU
    assert cpu.backend.archs is None

    # The loader's own check (inside get_kernel / get_local_kernel), on a simulated CUDA device.
    archs = build_kernel.kernels_module("archs")
    capability = {}
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    for cap in SERVED_CAPABILITIES:
        capability["now"] = cap
        assert archs._supports_cuda_capability(meta.backend.archs, cap), cap
        archs._check_arch_incompatibility(meta, "torch-cuda")
    for cap in REFUSED_CAPABILITIES:
        capability["now"] = cap
        assert not archs._supports_cuda_capability(meta.backend.archs, cap), cap
        with pytest.raises(RuntimeError, match=f"CUDA capability {cap[0]}.{cap[1]} of the current device"):
            archs._check_arch_incompatibility(meta, "torch-cuda")


# (e) variant resolution -----------------------------------------------------------------------


def test_get_local_kernel_backend_cpu_picks_torch_cpu():
    module = kernels.get_local_kernel(ROOT, backend="cpu")
    assert _variant_of(module) == "torch-cpu"
    assert module.__name__ == _metadata("torch-cpu").id


def test_resolution_picks_the_noarch_variant_per_backend():
    # Resolve for simulated systems (kernels internals), so that the CUDA choice is
    # checked on a CPU-only torch too.
    from packaging.version import Version

    backends = build_kernel.kernels_module("backends")
    variants_mod = build_kernel.kernels_module("variants")
    variants = variants_mod.get_variants_local(ROOT / "build")
    assert sorted(v.variant_str for v in variants) == ["torch-cpu", "torch-cuda"]
    for backend, expected in ((backends.CPU(), "torch-cpu"), (backends.CUDA(version=Version("12.8")), "torch-cuda")):
        accepted, _ = variants_mod._resolve_variant_for_system(
            variants=variants,
            selected_backend=backend,
            cpu="x86_64",
            os="linux",
            torch_version=Version("2.13"),
            torch_cxx11_abi=True,
            tvm_ffi_version=None,
        )
        assert [v.variant_str for v in accepted] == [expected]


# (f) the names transformers takes from the kernel ---------------------------------------------


def test_all_lists_the_transformers_entry_points():
    tree = ast.parse((SOURCE_PKG / "__init__.py").read_text())
    (assign,) = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    exported = ast.literal_eval(assign.value)  # a literal list, as kernel-builder reads it
    assert isinstance(exported, list) and all(isinstance(n, str) for n in exported)
    assert set(TRANSFORMERS_ENTRY_POINTS) <= set(exported)
    assert len(exported) == len(set(exported))
    # That they resolve, lazily, on the kernel as the loader imports it:
    # test_offline_hub_cache_loads_version_1_only_with_its_ref.


# (g) M3_SPARSE_KERNEL naming a hub repository -------------------------------------------------


@pytest.fixture
def kernel_loader(monkeypatch):
    """m3_hf_attention/_kernel.py on its own (importing the package would load and register
    the kernel), with ``kernels.get_kernel`` recording its calls instead of reaching the Hub."""
    loader = _module_from_file("_m3_kernel_loader_under_test", KERNEL_LOADER)
    calls = []
    real = kernels.get_kernel

    def fake_get_kernel(repo_id, **kwargs):
        inspect.signature(real).bind(repo_id, **kwargs)  # what the installed kernels accepts
        calls.append((repo_id, kwargs))
        return "kernel module"

    monkeypatch.setattr(kernels, "get_kernel", fake_get_kernel)
    loader.calls = calls
    return loader


@pytest.mark.parametrize(
    "source, repo_id, pin",
    [
        ("m3-hf-attention/m3-sparse", "m3-hf-attention/m3-sparse", {"version": 1}),
        (f"my.org/m3_sparse@{FAKE_COMMIT}", "my.org/m3_sparse", {"revision": FAKE_COMMIT}),
        ("someone/m3-sparse@v1", "someone/m3-sparse", {"revision": "v1"}),
    ],
)
def test_env_hub_source_passes_a_version_or_a_revision(kernel_loader, monkeypatch, tmp_path, source, repo_id, pin):
    monkeypatch.chdir(tmp_path)  # a relative path of that name must not exist
    monkeypatch.setenv("M3_SPARSE_KERNEL", source)
    assert kernel_loader.load_kernel.__wrapped__() == "kernel module"
    assert kernel_loader.calls == [(repo_id, {**pin, "trust_remote_code": True})]


@pytest.mark.parametrize("source", ["m3-sparse", "a/b/c", "org/m3-sparse@", "org/m3 sparse", "/org/m3-sparse"])
def test_env_hub_source_that_is_neither_path_nor_id_is_refused(kernel_loader, monkeypatch, tmp_path, source):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("M3_SPARSE_KERNEL", source)
    with pytest.raises(RuntimeError, match=r"expected an existing directory .*'namespace/name@<revision>'"):
        kernel_loader.load_kernel.__wrapped__()
    assert kernel_loader.calls == []


def test_env_hub_source_failure_names_the_kernel_and_the_offline_cache(kernel_loader, monkeypatch):
    from huggingface_hub import constants

    cause = ValueError("Version 1 of 'org/m3-sparse' is not available in the local cache")

    def failing(repo_id, **kwargs):
        raise cause

    monkeypatch.setattr(kernels, "get_kernel", failing)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("M3_SPARSE_KERNEL", "org/m3-sparse")
    with pytest.raises(RuntimeError) as info:
        kernel_loader.load_kernel.__wrapped__()
    message = str(info.value)
    assert "could not load version 1 of the hub kernel 'org/m3-sparse'" in message
    assert str(cause) in message and "docs/HUB.md" in message
    assert info.value.__cause__ is cause


def test_env_local_path_loads_that_repository(kernel_loader, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kernels, "get_local_kernel", lambda path: calls.append(path) or "local module")
    monkeypatch.setenv("M3_SPARSE_KERNEL", str(tmp_path))
    assert kernel_loader.load_kernel.__wrapped__() == "local module"
    assert calls == [tmp_path.resolve()] and kernel_loader.calls == []


# (h) offline from the hub cache, as docs/HUB.md fills it ----------------------------------


def test_offline_hub_cache_loads_version_1_only_with_its_ref(tmp_path):
    """The cache as ``hf download <repo> --repo-type kernel --revision v1`` leaves it (a
    snapshot and ``refs/v1``), read by the real loader offline through M3_SPARSE_KERNEL:
    version 1 needs the ref, a pinned commit does not, the digest is verified, and the
    loaded kernel serves transformers' entry points lazily (no transformers until used)."""
    repo_id = _build_toml()["general"]["hub"]["repo-id"]
    hub = tmp_path / "hub"
    storage = hub / ("kernels--" + repo_id.replace("/", "--"))
    _copy_variants(storage / "snapshots" / FAKE_COMMIT)
    code = textwrap.dedent(
        f"""
        import importlib.util, json, os, sys
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("loader", {str(KERNEL_LOADER)!r})
        loader = importlib.util.module_from_spec(spec); spec.loader.exec_module(loader)
        out = {{}}
        def load(source):
            os.environ["M3_SPARSE_KERNEL"] = source
            try:
                module = loader.load_kernel.__wrapped__()
            except RuntimeError as e:
                return None, "error: " + str(e)
            return module, str(Path(module.__file__).parent.relative_to({str(storage)!r}))
        out["version_without_ref"] = load({repo_id!r})[1]
        out["pinned_commit"] = load({repo_id + "@" + FAKE_COMMIT!r})[1]
        refs = Path({str(storage)!r}) / "refs"
        refs.mkdir()
        (refs / "v1").write_text({FAKE_COMMIT!r})
        k, out["version_with_ref"] = load({repo_id!r})
        out["transformers_after_load"] = "transformers" in sys.modules
        out["missing"] = [n for n in k.__all__ if not hasattr(k, n)]  # M3PagedCache etc. import transformers
        # transformers' test for a kernel that brings its own attention function:
        out["own_attention"] = hasattr(k, "flash_attn_forward") and hasattr(k, "supports_flash_attn")
        out["same_function"] = k.flash_attn_forward is k.m3_sparse_attention and k.supports_flash_attn()
        out["transformers_after_use"] = "transformers" in sys.modules
        print(json.dumps(out))
        """
    )
    env = _subprocess_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), HF_HOME=str(tmp_path / "home"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    variant = "torch-cuda" if torch.version.cuda is not None else "torch-cpu"
    without_ref = got.pop("version_without_ref")
    assert without_ref.startswith("error: ") and "docs/HUB.md" in without_ref
    assert "Version 1 of" in without_ref and "not available in the local cache" in without_ref
    assert got == {
        "pinned_commit": f"snapshots/{FAKE_COMMIT}/build/{variant}",
        "version_with_ref": f"snapshots/{FAKE_COMMIT}/build/{variant}",
        "transformers_after_load": False,
        "missing": [],
        "own_attention": True,
        "same_function": True,
        "transformers_after_use": True,
    }
    assert "digest" not in res.stderr, res.stderr[-4000:]


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
