"""scripts/test.sh and scripts/setup_venv.sh, run for real on a copy of the scripts whose venvs
are real but whose pip, pytest and build check are fakes that record how they were called: which
venv gets which installs and when, which passes run with which pytest arguments, and what the
exit code is. Nothing is downloaded or installed. Also: the versions the two passes pin are the
ends of pyproject.toml's ranges."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: kernels brings tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Each fake appends one JSON line to $FAKE_LOG: the tool, the venv it ran in, its arguments.
RECORD = """
import json, os, sys
def record(tool, **extra):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"tool": tool, "venv": os.path.basename(sys.prefix), "args": sys.argv[1:], **extra}) + "\\n")
"""

# pip: `install` of NAME==VERSION leaves an importable NAME with that version in the venv it
# runs in, as a real install would.
FAKE_PIP = RECORD + """
import sysconfig
from pathlib import Path
record("pip")
site = Path(sysconfig.get_path("purelib"))
for arg in sys.argv[2:]:
    if "==" in arg:
        name, version = arg.split("==")
        (site / name).mkdir(exist_ok=True)
        (site / name / "__init__.py").write_text(f"__version__ = {version!r}\\n")
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n")
"""

# pytest: exits with $FAKE_RC_NEWEST in .venv and $FAKE_RC_OLDEST in .venv-oldest.
FAKE_PYTEST = RECORD + """
record("pytest", omp=os.environ.get("OMP_NUM_THREADS"), offline=os.environ.get("HF_HUB_OFFLINE"))
import time
start = time.process_time()
while time.process_time() - start < float(os.environ.get("FAKE_CPU_S", "0")):
    pass
end = "OLDEST" if sys.prefix.endswith("-oldest") else "NEWEST"
sys.exit(int(os.environ.get("FAKE_RC_" + end, "0")))
"""

FAKE_BUILD_CHECK = RECORD + 'record("build_kernel")\n'

# What .venv holds before the scripts run: a torch (so setup_venv.sh keeps it) and the rest of
# what test.sh's version line and the stamp check look up.
BASE_PACKAGES = {"torch": "2.13.0", "huggingface_hub": "2.4.0", "m3_hf_attention": "0.1.0"}


def _package(site: Path, name: str, version: str, main: str | None = None) -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if main is not None:
        (site / name / "__main__.py").write_text(main)
    (site / f"{name}-{version}.dist-info").mkdir()
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )


@pytest.fixture()
def repo(tmp_path) -> Path:
    """The scripts and pyproject.toml in a new tree whose .venv has the fakes."""
    (tmp_path / "scripts").mkdir()
    for name in ("test.sh", "setup_venv.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "scripts" / "build_kernel.py").write_text(FAKE_BUILD_CHECK)
    venv.create(tmp_path / ".venv", with_pip=False)
    site = Path(
        subprocess.check_output(
            [tmp_path / ".venv" / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            text=True,
        ).strip()
    )
    _package(site, "pip", "99.0", FAKE_PIP)
    _package(site, "pytest", "99.0", FAKE_PYTEST)
    for name, version in BASE_PACKAGES.items():
        _package(site, name, version)
    return tmp_path


def run(repo: Path, *args: str, script: str = "scripts/test.sh", **env: str):
    """(exit code, stdout + stderr, the fakes' calls) of one run of the script."""
    log = repo / "calls.jsonl"
    log.unlink(missing_ok=True)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("M3_TEST_", "FAKE_", "OMP_NUM"))}
    full_env.update({"FAKE_LOG": str(log), "M3_TEST_JOBS": "2", **env})
    proc = subprocess.run(
        ["bash", script, *args], cwd=repo, env=full_env, capture_output=True, text=True, timeout=120
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, calls


def of(calls, tool, venv_name=None):
    return [c["args"] for c in calls if c["tool"] == tool and venv_name in (None, c["venv"])]


def pins(end: str) -> list[str]:
    """The NEWEST or OLDEST array of scripts/setup_venv.sh."""
    match = re.search(rf"^{end}=\((.*)\)$", (ROOT / "scripts" / "setup_venv.sh").read_text(), re.MULTILINE)
    assert match, f"no {end}=(...) line in scripts/setup_venv.sh"
    return re.findall(r'"([^"]+)"', match.group(1))


PARALLEL = ["-n", "2", "--dist", "load", "--durations=40"]


def test_the_default_run_installs_both_venvs_then_runs_both_passes(repo):
    rc, out, calls = run(repo)
    assert rc == 0, out
    assert of(calls, "pip", ".venv") == [["install", "--quiet", "--progress-bar", "off", "-e", ".[test]", *pins("NEWEST")]]
    assert of(calls, "pip", ".venv-oldest") == [["install", "--quiet", "--progress-bar", "off", "-e", ".", *pins("OLDEST")]]
    assert of(calls, "build_kernel") == [["--check"]]
    assert of(calls, "pytest", ".venv") == [PARALLEL]
    assert of(calls, "pytest", ".venv-oldest") == [["-m", "both_ends", *PARALLEL]]
    # One worker per core: torch's thread pool is kept to one thread each; no hub access.
    assert {(c["omp"], c["offline"]) for c in calls if c["tool"] == "pytest"} == {("1", "1")}
    assert re.search(r"newest pass in \.venv \(transformers 5\.25\.0, kernels 0\.19\.1, huggingface_hub 2\.4\.0, torch 2\.13\.0\)", out), out
    assert re.search(r"oldest pass in \.venv-oldest \(transformers 5\.17\.0, kernels 0\.16\.2, ", out), out
    assert re.search(r"newest pass: exit 0 in \d+m\d\ds, CPU \d+m\d\ds", out), out
    assert re.search(r"oldest pass: exit 0 in \d+m\d\ds, CPU \d+m\d\ds", out), out


def test_each_pass_reports_the_cpu_time_of_its_processes(repo):
    rc, out, calls = run(repo, FAKE_CPU_S="2.2")
    assert rc == 0, out
    cpu = [int(m) * 60 + int(s) for m, s in re.findall(r"pass: exit 0 in \d+m\d\ds, CPU (\d+)m(\d\d)s", out)]
    assert len(cpu) == 4 and all(2 <= c <= 4 for c in cpu), out  # each pass line, printed again at the end


def test_the_oldest_venv_has_its_pins_first_and_shares_the_rest(repo):
    assert run(repo, "--setup-only")[0] == 0
    code = "import torch, transformers, kernels; print(transformers.__version__, kernels.__version__, transformers.__file__, torch.__file__)"
    out = subprocess.check_output([repo / ".venv-oldest" / "bin" / "python", "-c", code], text=True).split()
    assert out[:2] == ["5.17.0", "0.16.2"]
    assert "/.venv-oldest/" in out[2] and "/.venv/" in out[3], out
    assert (repo / ".venv-oldest" / ".gitignore").read_text().strip() == "*"


def test_a_second_run_installs_nothing_until_pyproject_changes(repo):
    assert run(repo)[0] == 0
    rc, out, calls = run(repo)
    assert rc == 0, out
    assert of(calls, "pip") == []
    assert len(of(calls, "pytest")) == 2
    with (repo / "pyproject.toml").open("a") as f:
        f.write("# changed\n")
    rc, out, calls = run(repo)
    assert rc == 0, out
    assert [c["venv"] for c in calls if c["tool"] == "pip"] == [".venv", ".venv-oldest"]


def test_pytest_args_go_through_unchanged_to_the_newest_pass_only(repo):
    rc, out, calls = run(repo, "tests/test_model.py", "-x", "-q", "-k", "a b")
    assert rc == 0, out
    assert of(calls, "pytest") == [["tests/test_model.py", "-x", "-q", "-k", "a b"]]
    assert of(calls, "pip", ".venv-oldest") == [] and not (repo / ".venv-oldest").exists()
    # With the user's args torch keeps its own thread count.
    assert [c["omp"] for c in calls if c["tool"] == "pytest"] == [None]


def test_the_range_variable_picks_the_passes(repo):
    rc, out, calls = run(repo, "tests/test_model.py", M3_TEST_RANGE="oldest")
    assert rc == 0, out
    assert [(c["venv"], c["args"]) for c in calls if c["tool"] == "pytest"] == [(".venv-oldest", ["tests/test_model.py"])]
    rc, out, calls = run(repo, "-x", M3_TEST_RANGE="both")
    assert [(c["venv"], c["args"]) for c in calls if c["tool"] == "pytest"] == [(".venv", ["-x"]), (".venv-oldest", ["-x"])]
    rc, out, calls = run(repo, M3_TEST_RANGE="newest")
    assert rc == 0 and of(calls, "pytest") == [PARALLEL], out
    rc, out, calls = run(repo, M3_TEST_RANGE="old")
    assert rc == 2 and "M3_TEST_RANGE must be newest, oldest or both, not 'old'" in out
    assert of(calls, "pytest") == [] and of(calls, "pip") == []


def test_jobs_default_to_the_usable_cores(repo):
    rc, out, calls = run(repo, M3_TEST_RANGE="newest", M3_TEST_JOBS="")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert rc == 0 and of(calls, "pytest") == [["-n", str(cores), *PARALLEL[2:]]], out


@pytest.mark.parametrize(
    ("newest", "oldest", "expected"),
    [("0", "0", 0), ("1", "0", 1), ("0", "1", 1), ("2", "1", 2), ("0", "5", 5), ("5", "0", 5)],
)
def test_every_pass_counts_and_no_tests_is_a_failure(repo, newest, oldest, expected):
    rc, out, calls = run(repo, FAKE_RC_NEWEST=newest, FAKE_RC_OLDEST=oldest)
    assert rc == expected, out
    assert [c["venv"] for c in calls if c["tool"] == "pytest"] == [".venv", ".venv-oldest"]
    assert f"newest pass: exit {newest} in" in out and f"oldest pass: exit {oldest} in" in out
    assert ("collected no tests; that is a failure" in out) == ("5" in (newest, oldest)), out


def test_ci_runs_the_test_command_without_arguments(repo):
    rc, out, calls = run(repo, script=".ci/run")
    assert rc == 0, out
    assert of(calls, "pytest") == [PARALLEL, ["-m", "both_ends", *PARALLEL]]


def test_a_torch_install_without_the_space_for_it_stops_before_pip(repo):
    """Where a new torch must go in and the disk lacks room, the script says how much is free
    and stops: no pip call that would fail halfway, no retry on the network index."""
    site = Path(subprocess.check_output(
        [repo / ".venv" / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True,
    ).strip())
    shutil.rmtree(site / "torch")
    rc, out, calls = run(repo, "--newest", ".[test]", script="scripts/setup_venv.sh", M3_SETUP_MIN_FREE_MB=str(1 << 40))
    assert rc == 1, out
    assert re.search(r"setup_venv\.sh: \d+ MiB free on .*; a new \.venv with torch needs about \d+ MiB", out), out
    assert of(calls, "pip") == []
    # With the room it asks for, the same run installs torch, then the project.
    rc, out, calls = run(repo, "--newest", ".[test]", script="scripts/setup_venv.sh", M3_SETUP_MIN_FREE_MB="1")
    assert rc == 0, out
    assert [args[-1] for args in of(calls, "pip")][:1] == ["torch==2.13.0"]


def test_the_pinned_ends_are_the_ends_of_pyprojects_ranges():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {Requirement(d).name.replace("-", "_"): Requirement(d).specifier for d in deps}
    for end in ("NEWEST", "OLDEST"):
        for pin in map(Requirement, pins(end)):
            name = pin.name.replace("-", "_")
            assert name in ranges, f"{end} pins {name}, which pyproject.toml does not depend on"
            exact = [s.version for s in pin.specifier if s.operator == "=="]
            if exact:
                assert Version(exact[0]) in ranges[name], f"{end} {pin} is outside pyproject.toml's {name}{ranges[name]}"
    # The oldest pass runs each range's lower bound.
    for pin in map(Requirement, pins("OLDEST")):
        floors = [s.version for s in ranges[pin.name.replace("-", "_")] if s.operator == ">="]
        exact = [s.version for s in pin.specifier if s.operator == "=="]
        if exact:
            assert Version(exact[0]).release[: len(Version(floors[0]).release)] == Version(floors[0]).release, (
                f"OLDEST pins {pin}, but pyproject.toml's lower bound is {floors[0]}"
            )
