"""The kernel package's imports run one way: ``hf`` -> ``api`` -> ``dispatch`` -> op packages
-> ``core``. Read from the sources (every import, also those inside functions), so a
change that breaks a rule fails here before anything runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "m3_sparse"
ROOT = Path(__file__).resolve().parents[1] / "torch-ext" / PACKAGE
OPS = ("index", "kvouter", "decode", "dense")
# What each room may import from the package, besides itself.
ALLOWED = {
    "core": {"core"},
    **{op: {op, "core"} for op in OPS},
    "dispatch": {"core", *OPS},
    "api": {"dispatch", "core", *OPS},
    "custom_ops": {"api", "core", "_ops"},
    # custom_ops: the api's ops as torch.library ops, which a compiled decode step calls.
    "hf": {"hf", "api", "custom_ops", "core"},
    "reference": {"core"},
    "_ops": set(),
    "__init__": {"api", "kvouter", "custom_ops", "reference", "_ops", "hf"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports (``from . import x`` counts as module ``x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(PACKAGE):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT / Path(*sub.split(".")[1:])).with_suffix(".py").exists()
                          or (ROOT / Path(*sub.split(".")[1:]) / "__init__.py").exists() else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
    found.discard(name)
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_stay_in_their_lane(module):
    allowed = ALLOWED[room(module)] | {room(module)}
    bad = sorted(m for m in MODULES[module] if room(m) not in allowed)
    assert not bad, f"{module} imports {bad}; its room ({room(module)}) may import only {sorted(allowed)}"


def test_no_import_cycles():
    graph = {m: {d for d in deps if d in MODULES} for m, deps in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_rules_see_the_imports():
    """The scan itself: known edges are found (a scan that finds nothing passes every rule)."""
    assert f"{PACKAGE}.dispatch" in MODULES[f"{PACKAGE}.api"]
    assert f"{PACKAGE}.core.args" in MODULES[f"{PACKAGE}.core.validate"]
    assert f"{PACKAGE}.api" in MODULES[f"{PACKAGE}.hf.attention"]
    assert f"{PACKAGE}.kvouter.pipeline_triton" in MODULES[f"{PACKAGE}.api"]  # imported inside a function


NO_TRITON = r"""
import sys
sys.modules["triton"] = None  # any import of triton now raises ImportError
sys.path.insert(0, sys.argv[1])
import torch
import m3_sparse
from m3_sparse import hf  # noqa: F401
from m3_sparse.hf import attention, cache, mask, tp  # noqa: F401
q = torch.randn(3, 4, 16)
k = torch.randn(2, 2, 16, 16)
tables = torch.tensor([[0, 1]], dtype=torch.int32)
cu = torch.tensor([0, 3], dtype=torch.int32)
kv = torch.tensor([20], dtype=torch.int32)
sel = m3_sparse.index_topk(q[:, :2], k[:, 0], tables, cu_seqlens_q=cu, used_kv_lens=kv, topk=2, block_size=16)
out, _ = m3_sparse.sparse_attention(q, k, k, sel, tables, cu_seqlens_q=cu, used_kv_lens=kv, block_size=16)
out, _ = m3_sparse.dense_paged_attention(q, k, k, tables, cu_seqlens_q=cu, used_kv_lens=kv)
print("ok")
"""


def test_the_torch_path_needs_no_triton(tmp_path):
    """A CPU install without Triton (the example's) imports the package and runs every op on the
    torch path: only the GPU launchers import Triton, on first use."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["M3_SPARSE_IMPL"] = "torch"
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRITON, str(ROOT.parent)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
