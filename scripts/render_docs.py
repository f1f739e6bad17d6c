#!/usr/bin/env python3
"""Write the headline figures of docs/figures.json into the docs.

Each target file holds two marker lines:

    <!-- figures:begin -->
    <!-- figures:end -->

Everything between them is replaced by a markdown table rendered from the JSON
(what, figure, baseline, date, command). Text outside the markers is left alone.

    python3 scripts/render_docs.py            # rewrite README.md and docs/PERF.md
    python3 scripts/render_docs.py --check    # exit 1 if a file's block is stale
    python3 scripts/render_docs.py --check README.md   # only the files named

A file without the two markers (each once, begin before end) is an error in both
modes. Exit status: 0 when every file is (or now is) up to date, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
TARGETS = ("README.md", "docs/PERF.md")
BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
NOTICE = "<!-- generated from docs/figures.json by scripts/render_docs.py: edit the JSON, then run the script -->"
REQUIRED = ("key", "what", "value", "unit", "baseline", "date", "device", "command")
RATIO_MEANS = ("faster", "slower", "of the floor")


class DocsError(Exception):
    pass


# ---------------------------------------------------------------------------------------
# figures.json
# ---------------------------------------------------------------------------------------
def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_range(where: str, r) -> None:
    if r is None:
        return
    if not (isinstance(r, list) and len(r) == 2 and all(_is_number(v) for v in r) and r[0] <= r[1]):
        raise DocsError(f"{where}: 'range' must be [low, high] numbers, got {r!r}")


def _check_command(where: str, command) -> None:
    if not isinstance(command, str) or not command.strip():
        raise DocsError(f"{where}: 'command' must be a non-empty string")
    script = next((w for w in command.split() if w.endswith(".py")), None)
    if script is not None and not (ROOT / script).is_file():
        raise DocsError(f"{where}: the command runs {script}, which does not exist")


def load_figures(path: Path = FIGURES) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DocsError(f"{path.relative_to(ROOT)}: {exc}") from exc
    figures = data.get("figures") if isinstance(data, dict) else None
    if not isinstance(figures, list) or not figures:
        raise DocsError(f"{path.relative_to(ROOT)}: expected an object with a non-empty 'figures' list")
    seen = set()
    for i, fig in enumerate(figures):
        where = f"figures.json entry {i}"
        if not isinstance(fig, dict):
            raise DocsError(f"{where}: expected an object")
        missing = [k for k in REQUIRED if k not in fig]
        if missing:
            raise DocsError(f"{where}: missing {missing}")
        where = f"figures.json entry {fig['key']!r}"
        if not re.fullmatch(r"[a-z0-9_]+", str(fig["key"])) or fig["key"] in seen:
            raise DocsError(f"{where}: keys must be unique snake_case names")
        seen.add(fig["key"])
        if not _is_number(fig["value"]):
            raise DocsError(f"{where}: 'value' must be a number")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(fig["date"])):
            raise DocsError(f"{where}: 'date' must be YYYY-MM-DD")
        _check_range(where, fig.get("range"))
        _check_command(where, fig["command"])
        base = fig["baseline"]
        if base is None:
            continue
        if not isinstance(base, dict) or not {"what", "value", "unit"} <= base.keys():
            raise DocsError(f"{where}: 'baseline' must be null or have what, value and unit")
        if not _is_number(base["value"]):
            raise DocsError(f"{where}: baseline 'value' must be a number")
        _check_range(f"{where} baseline", base.get("range"))
        _check_range(f"{where} baseline ratio", base.get("ratio_range"))
        if base.get("ratio") is not None:
            if not _is_number(base["ratio"]) or base.get("ratio_means") not in RATIO_MEANS:
                raise DocsError(f"{where}: a baseline 'ratio' needs a number and 'ratio_means' in {RATIO_MEANS}")
        if "command" in base:
            _check_command(f"{where} baseline", base["command"])
    return figures


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------
def _num(x) -> str:
    return str(x)  # as written in the JSON: 11.0 stays 11.0


def _amount(value, rng, unit: str) -> str:
    shown = f"{_num(rng[0])}-{_num(rng[1])}" if rng else _num(value)
    return f"{shown} {unit}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_row(fig: dict) -> str:
    figure = f"**{_amount(fig['value'], fig.get('range'), fig['unit'])}**"
    if fig.get("note"):
        figure += f"; {fig['note']}"
    base = fig["baseline"]
    baseline, command = "-", f"`{fig['command']}`"
    if base is not None:
        baseline = f"{base['what']}: {_amount(base['value'], base.get('range'), base['unit'])}"
        if base.get("ratio") is not None:
            rr = base.get("ratio_range")
            ratio = f"{_num(rr[0])}-{_num(rr[1])}" if rr else _num(base["ratio"])
            baseline += f" ({ratio}x {base['ratio_means']})"
        if base.get("command"):
            command += f"; baseline: `{base['command']}`"
    cells = (fig["what"], figure, baseline, fig["date"], command)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render_block(figures: list[dict]) -> str:
    devices = sorted({f["device"] for f in figures})
    lines = [
        NOTICE,
        "",
        f"Measured on one {', '.join(devices)}.",
        "",
        "| what | figure | baseline | date | command |",
        "|---|---|---|---|---|",
        *(render_row(f) for f in figures),
    ]
    return "\n".join(lines) + "\n"


def splice(text: str, block: str, name: str) -> str:
    """``text`` with the lines between the markers replaced by ``block``."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise DocsError(
            f"{name}: expected the marker lines '{BEGIN}' and '{END}' once each, in that order "
            f"(found {len(begins)} and {len(ends)})"
        )
    b, e = begins[0], ends[0]
    return "".join(lines[: b + 1]) + block + "".join(lines[e:])


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Render docs/figures.json into README.md and docs/PERF.md.")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file's figures block is stale")
    ap.add_argument("files", nargs="*", default=list(TARGETS), help=f"files to render (default: {' '.join(TARGETS)})")
    args = ap.parse_args(argv)

    try:
        block = render_block(load_figures())
    except DocsError as exc:
        print(f"render_docs: {exc}", file=sys.stderr)
        return 1

    failed = False
    for name in args.files:
        path = ROOT / name
        try:
            old = path.read_text()
            new = splice(old, block, name)
        except OSError as exc:
            print(f"render_docs: {name}: {exc}", file=sys.stderr)
            failed = True
            continue
        except DocsError as exc:
            print(f"render_docs: {exc}", file=sys.stderr)
            failed = True
            continue
        if new == old:
            continue
        if args.check:
            print(
                f"render_docs: {name}: the figures block differs from docs/figures.json; "
                "run `python3 scripts/render_docs.py`",
                file=sys.stderr,
            )
            failed = True
        else:
            path.write_text(new)
            print(f"render_docs: {name}: figures block rewritten")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
