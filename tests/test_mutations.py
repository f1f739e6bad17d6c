"""The mutation check (``scripts/mutation_check.py``) on its CI list: each mutation of the short
list, applied to a temporary copy of the sources, makes its quick test fail, and those tests
pass unmutated. Also, for every mutation of the full list (which runs with ``--all``): its text
still occurs in the sources and its named tests still exist, so the list cannot rot unseen."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


mc = _load()
SHORT = [mc.BY_NAME[n] for n in mc.SHORT]


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """One copy of the sources for the module; its quick tests pass unmutated."""
    root = mc.copy_tree(tmp_path_factory.mktemp("mutations"))
    mc.check_baseline(root, SHORT, quick=True)
    return root


@pytest.mark.parametrize("m", SHORT, ids=lambda m: m.name)
def test_the_quick_test_catches_the_mutation(tree, m):
    if m.interpreter_only and _on_gpu():
        pytest.skip("changes only what runs under Triton's interpreter")
    missed, _, tail = mc.check_mutation(tree, m, quick=True)
    assert not missed, f"{m.name} ({m.what}) survived {missed}:\n{tail}"


def test_a_harmless_change_is_reported_as_survived(tree):
    """The check can say "survived": a change of a comment fails no test."""
    m = dataclasses.replace(
        mc.BY_NAME["e4m3_rounding_skipped"], name="comment", old="# Grid step:", new="# The grid step:"
    )
    missed, _, _ = mc.check_mutation(tree, m, quick=True)
    assert missed == list(m.tests[:1])


@pytest.mark.parametrize("m", mc.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_applies_to_the_current_sources(m):
    text = (ROOT / mc.PACKAGE / m.path).read_text()
    assert mc.mutated_text(m, text) != text


def test_a_mutation_whose_text_is_gone_stops_the_check():
    m = dataclasses.replace(mc.MUTATIONS[0], old="a text that is in no source")
    with pytest.raises(mc.MutationError, match="holds 0 occurrence"):
        mc.mutated_text(m, (ROOT / mc.PACKAGE / m.path).read_text())


def test_every_named_test_exists():
    tests = sorted({t for m in mc.MUTATIONS for t in m.tests})
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = set(proc.stdout.splitlines())
    for t in tests:
        assert any(c == t or c.startswith(t + "[") for c in collected), f"{t} is not a test any more"
