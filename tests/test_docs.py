"""The docs stay in step with docs/figures.json, and the README and PERF.md stay short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# PERF.md is a reference (current figures, floors, limits); dated runs go to docs/perf-log/.
PERF_MAX_LINES = 400


def test_figures_blocks_match_figures_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, (
        "the figures tables differ from docs/figures.json; run `python3 scripts/render_docs.py`\n"
        f"{proc.stdout}{proc.stderr}"
    )


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES}"


def test_perf_is_a_reference_not_a_log():
    lines = (ROOT / "docs" / "PERF.md").read_text().splitlines()
    assert len(lines) < PERF_MAX_LINES, f"docs/PERF.md has {len(lines)} lines; move dated runs to docs/perf-log/"
