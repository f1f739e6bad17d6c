#!/usr/bin/env python3
"""Generate the noarch kernel variants in ``build/`` from ``torch-ext/``.

This stands in for kernel-builder on a pure-Python (``[torch-noarch]``) kernel:
``build.toml`` names the kernel and its backends, and for every backend ``B``
this writes ``build/torch-B/`` holding

* every ``.py`` file of ``torch-ext/<python name>/``, at the variant's top level
  (the layout ``kernels.get_local_kernel`` imports: ``build/torch-B/__init__.py``);
* ``_ops.py`` with ``NAMESPACE`` rewritten to the build id, so that two builds
  loaded into one process never share a ``torch.ops`` namespace;
* ``metadata.json`` (name, id, version, license, python-depends, backend, and
  the ``digest`` of the variant's files that kernels 0.19 verifies on load).

``build/`` is owned by this script: generating replaces it as a whole, and
``--check`` fails on anything in it that generating would not produce (the
loader would otherwise be free to pick a stale variant). Python bytecode caches
are ignored, since importing a variant writes them. Both modes also hand every
``metadata.json`` to the kernels loader's own parser and check the recorded
digest with its own hashing, so they need ``kernels`` (0.16.2 to 0.19.x)
installed and fail when it is not.

Usage::

    python scripts/build_kernel.py           # (re)generate build/
    python scripts/build_kernel.py --check   # exit 1 when build/ is stale
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR_NAME = "build"
SOURCE_SUFFIXES = (".py",)
HASH_HEX_CHARS = 10
# The builder emits ids such as `_relu_cuda_<hash>`; the backend is part of it
# because a CUDA process may load both the cuda variant and (backend="cpu") the
# cpu variant, and each must get its own module name and op namespace.
ID_TEMPLATE = "_{python_name}_{backend}_{source_hash}"
# What `metadata.json`'s digest records per file (kernels' `DigestAlgorithm`
# spells it this way in JSON; it also takes "sha512").
DIGEST_ALGORITHM = "sha256"
# A hub repository id as the Hub takes it: `namespace/name`, no placeholders.
REPO_ID_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"

# Where the installed kernels keeps what this script (and tests/test_build.py)
# uses. kernels 0.19 moved its modules under `kernels._internals` and its Rust
# types (Metadata, Digest) from the separate `kernels_data` package into
# `kernels._rust`; 0.16 has the modules at the top level beside `kernels_data`.
KERNELS_MODULES = {
    "types": ("kernels._rust", "kernels_data"),
    "archs": ("kernels._internals.archs", "kernels.archs"),
    "backends": ("kernels._internals.backends", "kernels.backends"),
    "python_deps": ("kernels._internals.python_deps", "kernels.deps"),
    "variants": ("kernels._internals.variants", "kernels.variants"),
}


class BuildError(RuntimeError):
    pass


def kernels_module(role: str) -> ModuleType:
    """The installed kernels' module for ``role`` (a key of :data:`KERNELS_MODULES`)."""
    candidates = KERNELS_MODULES[role]
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only this candidate (or a package above it) being absent means "try
            # the next layout"; a module that fails on an import of its own is a
            # broken install and must surface as such.
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise
    raise BuildError(
        f"the kernels loader is not installed (none of {', '.join(candidates)} imports): build/ is checked "
        "with its own metadata parser and digest; install kernels 0.16.2 to 0.19.x (`pip install -e .` brings it)"
    )


def _read_config(root: Path) -> dict:
    path = root / "build.toml"
    if tomllib is None:
        raise BuildError("reading build.toml needs Python >= 3.11 (tomllib) or the `tomli` package")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BuildError(f"{path} not found") from None
    general = data.get("general")
    if not isinstance(general, dict):
        raise BuildError(f"{path}: missing [general]")
    if general.get("edition") != 5:
        raise BuildError(f"{path}: this script implements build.toml edition 5, got {general.get('edition')!r}")
    if "torch-noarch" not in data:
        raise BuildError(f"{path}: only pure-Python kernels ([torch-noarch]) can be built by this script")
    name = general.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", name):
        raise BuildError(f"{path}: [general] name must match ^[a-z][-a-z0-9]*[a-z0-9]$, got {name!r}")
    backends = general.get("backends")
    if not backends or not all(isinstance(b, str) for b in backends) or len(set(backends)) != len(backends):
        raise BuildError(f"{path}: [general] backends must be a non-empty list of distinct names, got {backends!r}")
    version = general.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BuildError(f"{path}: [general] version must be an int, got {version!r}")
    license_ = general.get("license")
    if not isinstance(license_, str):
        raise BuildError(f"{path}: [general] license must be a string, got {license_!r}")
    noarch = data["torch-noarch"]
    cuda_general = general.get("cuda", {})
    hub = general.get("hub", {})
    repo_id = hub.get("repo-id")
    if not isinstance(repo_id, str) or not re.fullmatch(REPO_ID_PATTERN, repo_id):
        raise BuildError(
            f"{path}: [general.hub] repo-id must be the hub repository 'namespace/name' the kernel is published "
            f"to, got {repo_id!r}"
        )
    # kernel-builder uploads to `hub.branch` when it is set, and to `v<version>` otherwise;
    # `get_kernel(..., version=N)` reads branch `vN`, so any other branch would never be loaded.
    if hub.get("branch", f"v{version}") != f"v{version}":
        raise BuildError(
            f"{path}: [general.hub] branch {hub['branch']!r} is not v{version}: kernels loads version {version} "
            f"from branch v{version}; leave branch out"
        )
    return {
        "name": name,
        "python_name": name.replace("-", "_"),
        "version": version,
        "license": license_,
        "backends": sorted(backends),
        "python_depends": list(general.get("python-depends", [])),
        "cuda_python_depends": list(cuda_general.get("python-depends", [])),
        "archs": {
            "cuda": noarch.get("cuda_capabilities"),
            "rocm": noarch.get("rocm_archs"),
        },
    }


def _read_sources(src_dir: Path) -> dict[str, bytes]:
    if not (src_dir / "__init__.py").is_file():
        raise BuildError(f"{src_dir}/__init__.py not found")
    files: dict[str, bytes] = {}
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        if not path.is_file() or "__pycache__" in rel.parts or path.suffix not in SOURCE_SUFFIXES:
            continue
        files[rel.as_posix()] = path.read_bytes()
    return files


def _source_hash(sources: dict[str, bytes]) -> str:
    """The short hash in the build id (and so in the op namespace)."""
    h = hashlib.sha256()
    for rel in sorted(sources):
        data = sources[rel]
        # Length-prefixed so that moving bytes between a name and a body, or
        # between two files, changes the digest.
        h.update(f"{len(rel)}:{rel}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()[:HASH_HEX_CHARS]


def _rewrite_ops(ops_src: bytes, python_name: str, build_id: str) -> bytes:
    text = ops_src.decode("utf-8")
    pattern = re.compile(rf'^NAMESPACE = "_{re.escape(python_name)}"$', re.MULTILINE)
    text, count = pattern.subn(f'NAMESPACE = "{build_id}"', text)
    if count != 1:
        raise BuildError(
            f'_ops.py: expected exactly one line `NAMESPACE = "_{python_name}"` to rewrite, found {count}'
        )
    return text.encode("utf-8")


def _variant_digest(files: dict[str, bytes]) -> dict:
    """``metadata.json``'s ``digest`` for a variant holding ``files`` (metadata.json aside).

    This is what kernels' ``Digest.hash_variant`` computes (kernels_data 0.16.2 and
    kernels 0.19.1 alike): every regular file under the variant directory, symlinks
    followed, keyed by its path relative to the variant with ``/`` separators, valued
    by the base64 of its SHA-256. It leaves out the top-level ``metadata.json`` (which
    holds the digest) and ``metadata.json.sigstore``, every ``__pycache__`` directory
    and every ``*.pyc`` file; nothing else, so a ``metadata.json`` in a subdirectory
    or a stray ``.pyo`` counts. A variant written here holds only the sources, the
    rewritten ``_ops.py`` and ``metadata.json``, so the digest covers all of them but
    the last. :func:`_loader_problems` recomputes it with kernels' own code.
    """
    return {
        "algorithm": DIGEST_ALGORITHM,
        "files": {
            rel: base64.b64encode(hashlib.new(DIGEST_ALGORITHM, data).digest()).decode("ascii")
            for rel, data in sorted(files.items())
        },
    }


def _metadata(config: dict, backend: str, build_id: str, digest: dict) -> bytes:
    backend_info: dict = {"type": backend}
    archs = config["archs"].get(backend)
    if archs:
        backend_info["archs"] = list(archs)
    depends = config["python_depends"] + (config["cuda_python_depends"] if backend == "cuda" else [])
    meta = {
        "backend": backend_info,
        "digest": digest,
        "id": build_id,
        "license": config["license"],
        "name": config["name"],
        "python-depends": depends,
        "version": config["version"],
    }
    data = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8")
    _validate_metadata(data)
    return data


def _validate_metadata(data: bytes) -> None:
    # The loader's own parser is the authority on the format.
    try:
        kernels_module("types").Metadata.from_bytes(data)
    except ValueError as e:
        raise BuildError(f"generated metadata.json is rejected by the kernels loader's parser: {e}") from None


def _loader_problems(variant_dir: Path, shown: str) -> list[str]:
    """What the kernels loader would refuse in the variant at ``variant_dir`` (``shown``
    names it in messages): a ``metadata.json`` its parser rejects, no digest, or files
    that do not match the digest, each hashed by kernels' own ``Digest.hash_variant``
    (the check kernels 0.19 runs on every load)."""
    types = kernels_module("types")
    try:
        meta = types.Metadata.read_from_file(variant_dir / "metadata.json")
    except ValueError as e:
        return [f"rejected by the kernels loader's parser: {shown}/metadata.json: {e}"]
    if meta.digest is None:
        return [f"no digest: {shown}/metadata.json records none, so kernels cannot verify the variant"]
    try:
        meta.digest.validate(types.Digest.hash_variant(meta.digest.algorithm, variant_dir))
    except types.DigestValidationError as e:
        return [f"digest: {shown}: {violation}" for violation in e.violations]
    return []


def generate(root: Path = ROOT) -> dict[str, dict[str, bytes]]:
    """Return ``{variant dir name: {relative path: bytes}}`` for ``build/``."""
    config = _read_config(root)
    sources = _read_sources(root / "torch-ext" / config["python_name"])
    if "_ops.py" not in sources:
        raise BuildError(f"torch-ext/{config['python_name']}/_ops.py not found")
    source_hash = _source_hash(sources)
    variants: dict[str, dict[str, bytes]] = {}
    for backend in config["backends"]:
        build_id = ID_TEMPLATE.format(python_name=config["python_name"], backend=backend, source_hash=source_hash)
        files = dict(sources)
        files["_ops.py"] = _rewrite_ops(sources["_ops.py"], config["python_name"], build_id)
        if "metadata.json" in files:
            raise BuildError("torch-ext must not contain metadata.json; it is generated")
        files["metadata.json"] = _metadata(config, backend, build_id, _variant_digest(files))
        variants[f"torch-{backend}"] = files
    return variants


def _is_cache(rel: Path) -> bool:
    # Exactly what kernels' digest leaves out (see _variant_digest): anything else
    # in build/ is either generated here or a problem.
    return "__pycache__" in rel.parts or rel.suffix == ".pyc"


def _actual_files(build_dir: Path) -> tuple[dict[str, Path], list[str]]:
    files: dict[str, Path] = {}
    odd: list[str] = []
    for path in sorted(build_dir.rglob("*")):
        rel = path.relative_to(build_dir)
        if _is_cache(rel):
            continue
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            odd.append(rel.as_posix())
        elif path.is_file():
            files[rel.as_posix()] = path
    return files, odd


def check(root: Path = ROOT) -> list[str]:
    """Differences between ``build/`` and what :func:`generate` produces (empty: in sync)."""
    expected = {
        f"{variant}/{rel}": data for variant, files in generate(root).items() for rel, data in files.items()
    }
    build_dir = root / BUILD_DIR_NAME
    if not build_dir.is_dir():
        return [f"{BUILD_DIR_NAME}/ does not exist"]
    actual, odd = _actual_files(build_dir)
    problems = [f"not a regular file: {BUILD_DIR_NAME}/{rel}" for rel in odd]
    for rel in sorted(expected.keys() - actual.keys()):
        problems.append(f"missing: {BUILD_DIR_NAME}/{rel}")
    for rel in sorted(actual.keys() - expected.keys()):
        problems.append(f"unexpected: {BUILD_DIR_NAME}/{rel}")
    for rel in sorted(expected.keys() & actual.keys()):
        if actual[rel].read_bytes() != expected[rel]:
            problems.append(f"differs: {BUILD_DIR_NAME}/{rel}")
    for variant in sorted(p.name for p in build_dir.iterdir() if (p / "metadata.json").is_file()):
        problems += _loader_problems(build_dir / variant, f"{BUILD_DIR_NAME}/{variant}")
    return problems


def write(root: Path = ROOT) -> dict[str, dict[str, bytes]]:
    variants = generate(root)
    build_dir = root / BUILD_DIR_NAME
    # Assemble next to build/ and swap it in, so that a failure halfway never
    # leaves a half-written variant for the loader to pick up.
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        for variant, files in variants.items():
            for rel, data in files.items():
                out = tmp / variant / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
            # The digest was computed here; the loader's own hashing of the written
            # files must agree before the variant replaces the current one.
            problems = _loader_problems(tmp / variant, f"{BUILD_DIR_NAME}/{variant}")
            if problems:
                raise BuildError("the written variant fails the kernels loader's checks:\n  " + "\n  ".join(problems))
        os.chmod(tmp, 0o755)
        if build_dir.exists():
            shutil.rmtree(build_dir)
        tmp.rename(build_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if build/ differs from what the sources generate",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check(ROOT)
            if problems:
                shown = problems[:20]
                more = len(problems) - len(shown)
                print(
                    f"build_kernel.py --check: {BUILD_DIR_NAME}/ is out of sync with torch-ext/ and build.toml:",
                    file=sys.stderr,
                )
                for p in shown:
                    print(f"  {p}", file=sys.stderr)
                if more:
                    print(f"  ... and {more} more", file=sys.stderr)
                print("Regenerate it with: python scripts/build_kernel.py", file=sys.stderr)
                return 1
            print(f"build_kernel.py --check: {BUILD_DIR_NAME}/ is in sync")
            return 0
        variants = write(ROOT)
    except BuildError as e:
        print(f"build_kernel.py: error: {e}", file=sys.stderr)
        return 2
    for variant, files in variants.items():
        build_id = json.loads(files["metadata.json"])["id"]
        print(f"wrote {BUILD_DIR_NAME}/{variant}/ ({len(files)} files, id {build_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
