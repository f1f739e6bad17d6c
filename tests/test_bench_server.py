"""benchmarks/bench_server.py on the CPU: guidellm drives m3-serve (the toy M3-shaped model) and
its dense twin; each run's figures come back from guidellm's own report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("guidellm")
ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_reports_each_server_under_guidellm(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick", "--out", str(tmp_path),
           "--seconds", "3", "--sweep-size", "2", "--concurrency", "2", "--new-tokens", "4", "--warmup-seconds", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_server.json").read_text())["rows"]
    assert {(r["config"], r["strategy"]) for r in rows} >= {
        (c, s) for c in ("m3_sparse", "dense") for s in ("synchronous", "concurrent")
    }
    # The warm-up runs (one request at a time, then the closed loop) are written beside the
    # others, and none of their figures is a row.
    for config in ("m3_sparse", "dense"):
        for warmup, strategy in (("warmup-sync", "synchronous"), ("warmup", "concurrent")):
            report = json.loads((tmp_path / f"guidellm-{config}-sf-{warmup}.json").read_text())
            assert [b["config"]["strategy"]["type_"] for b in report["benchmarks"]] == [strategy], warmup
    assert sorted(r["config"] for r in rows if r["strategy"] == "concurrent") == ["dense", "m3_sparse"]
    for r in rows:
        assert r["errored"] == 0, r
        if r["strategy"] in ("synchronous", "concurrent"):
            assert r["requests"] > 0 and r["output_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"], r
            assert 0 <= r["goodput_share"] <= 1 and r["goodput_requests_s"] <= r["requests_s"] * 1.5, r
    # Every request generated all its tokens: the checkpoints have no end-of-sequence token.
    report = json.loads((tmp_path / "guidellm-m3_sparse-sf-concurrent.json").read_text())
    done = report["benchmarks"][0]["requests"]["successful"]
    assert done and all(r["output_tokens"] == 4 for r in done)
    assert "| sf | m3_sparse | concurrent |" in (tmp_path / "bench_server.md").read_text()


def test_targets_from_guidellm_rows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    def row(config, strategy, rate, req_s, tok_s, good, share, itl=(2.0, 9.0)):
        return {"layers": "sfs", "config": config, "strategy": strategy, "rate": rate, "requests": 10,
                "requests_s": req_s, "output_tok_s": tok_s, "goodput_requests_s": good, "goodput_share": share,
                "itl_p50_ms": itl[0], "itl_p99_ms": itl[1]}

    rows = [
        row("dense", "synchronous", None, 0.1, 5.0, 0.1, 1.0),
        row("dense", "constant", 0.2, 0.2, 9.0, 0.12, 0.6),  # the highest rate with half its requests good
        row("dense", "constant", 0.3, 0.25, 11.0, 0.05, 0.2),
        row("dense", "throughput", None, 0.3, 12.0, 0.0, 0.0),
        row("m3_sparse", "constant", 1.0, 1.0, 60.0, 0.9, 0.9, itl=(2.0, 6.0)),  # nearest half of 2.2 req/s
        row("m3_sparse", "constant", 2.0, 1.9, 110.0, 0.3, 0.15, itl=(2.0, 50.0)),
        row("m3_sparse", "throughput", None, 2.2, 120.0, 0.2, 0.1),
        row("m3_sparse", "concurrent", 64, 2.0, 115.0, 0.0, 0.0),
    ]
    # Another step size's runs, which would win every figure if they were counted with these.
    other = [dict(r, max_batch_tokens=1024, requests_s=r["requests_s"] * 10, output_tok_s=r["output_tok_s"] * 10,
                  goodput_requests_s=r["goodput_requests_s"] * 10) for r in rows]
    t = bench_server.targets(rows + other, "sfs")
    assert t["max_batch_tokens"] is None
    assert t["dense_rate_req_s"] == 0.2 and t["dense_goodput_req_s"] == 0.12
    assert t["m3_goodput_req_s"] == 0.9 and abs(t["goodput_ratio"] - 7.5) < 1e-9
    assert t["dense_best_goodput_req_s"] == 0.12 and abs(t["goodput_over_best"] - 7.5) < 1e-9
    assert abs(t["tok_s_ratio"] - 10.0) < 1e-9
    assert t["m3_half_of_best_req_s"] == 1.1 and t["m3_half_rate"] == 1.0 and t["m3_itl_p99_over_p50"] == 3.0
    assert bench_server.targets([r for r in rows if r["config"] == "dense"], "sfs") is None
    t = bench_server.targets(rows + other, "sfs", 1024)
    assert t["max_batch_tokens"] == 1024 and t["dense_rate_req_s"] == 2.0 and t["m3_saturation_tok_s"] == 1200.0
    assert bench_server.targets(rows + other, "sfs", 512) is None
    # A twin that got half its requests within the bounds at no rate: no reference rate, and the
    # comparison with its best goodput of any run instead.
    few = [dict(r, goodput_share=0.3) if r["config"] == "dense" else r for r in rows]
    t = bench_server.targets(few, "sfs")
    assert t["dense_rate_req_s"] is None and t["goodput_ratio"] is None
    assert t["dense_best_goodput_req_s"] == 0.12 and abs(t["goodput_over_best"] - 7.5) < 1e-9


def _byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer without merges at ``path`` (a ``tokenizer.json``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def _serve_with(monkeypatch, bench_server, server_class) -> None:
    """bench_server's servers made by ``server_class`` over empty checkpoint folders."""

    def models(args, pattern, where):
        for name in ("m3", "dense"):
            (where / f"{name}-{pattern}").mkdir(parents=True, exist_ok=True)
        _byte_tokenizer(where / f"m3-{pattern}" / "tokenizer.json")  # the probe's prompts need one
        return where

    monkeypatch.setattr(bench_server, "ServerProcess", server_class)
    monkeypatch.setattr(bench_server, "save_models", models)


def _fake_guidellm(tmp_path: Path) -> Path:
    """A guidellm that answers every run with an empty report."""
    fake = tmp_path / "guidellm"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys
out = next(a.split("path=")[1] for a in sys.argv if a.startswith("kind=json,path="))
pathlib.Path(out).write_text(json.dumps({{"benchmarks": []}}))
""")
    fake.chmod(0o755)
    return fake


def test_each_max_batch_tokens_value_gets_its_own_servers(tmp_path, monkeypatch):
    """``--max-batch-tokens 2k,512``: both configurations are served at each step size, each
    server started with its ``--cb-max-batch-tokens``, and each value's files named apart."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    started = []

    class Server:
        def __init__(self, checkpoint, extra, args, log):
            started.append((checkpoint.name, extra))
            log.write_text("INFO: started\n")
            self.port, self.proc = 1, argparse.Namespace(poll=lambda: None, returncode=None, wait=lambda s: None)

        def stop(self):
            pass

    _serve_with(monkeypatch, bench_server, Server)
    code = bench_server.main(["--quick", "--out", str(tmp_path), "--guidellm", str(_fake_guidellm(tmp_path)),
                              "--seconds", "1", "--warmup-seconds", "0", "--max-batch-tokens", "2k,512"])
    assert code == 0
    sdpa = ["--attn-implementation", "sdpa"]
    assert started == [
        ("m3-sf", ["--cb-max-batch-tokens", "2048"]), ("dense-sf", [*sdpa, "--cb-max-batch-tokens", "2048"]),
        ("m3-sf", ["--cb-max-batch-tokens", "512"]), ("dense-sf", [*sdpa, "--cb-max-batch-tokens", "512"]),
    ]
    for steps in (2048, 512):
        for config in ("m3_sparse", "dense"):
            assert (tmp_path / f"guidellm-{config}-sf-mbt{steps}-sweep.json").is_file()
            assert (tmp_path / f"server-{config}-sf-mbt{steps}.log").is_file()
    assert json.loads((tmp_path / "bench_server.json").read_text())["args"]["max_batch_tokens"] == [2048, 512]


@pytest.mark.parametrize("given", ["0", "2k,-512", "many"])
def test_max_batch_tokens_must_be_positive_counts(given, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    with pytest.raises(SystemExit) as e:
        bench_server.parse_args(["--quick", "--guidellm", sys.executable, "--max-batch-tokens", given])
    assert e.value.code == 2
    assert f"--max-batch-tokens: expected positive token counts (k = 1024), got {given!r}" in capsys.readouterr().err


def test_a_guidellm_run_that_never_ends_is_made_again(tmp_path, monkeypatch):
    """guidellm sometimes never finishes a run: past its length and a grace period it is killed
    (with its worker processes) and run once more; a second hang is an error."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    fake = tmp_path / "guidellm"
    marker = tmp_path / "hung-once"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys, time
out = next(a.split("path=")[1] for a in sys.argv if a.startswith("kind=json,path="))
marker = pathlib.Path({str(marker)!r})
if not marker.exists() or "always" in marker.read_text():
    marker.write_text(marker.read_text() if marker.exists() else "once")
    time.sleep(600)
pathlib.Path(out).write_text(json.dumps({{"benchmarks": []}}))
""")
    fake.chmod(0o755)
    monkeypatch.setattr(bench_server, "GUIDELLM_GRACE_S", 2.0)
    args = argparse.Namespace(guidellm=str(fake), prompt_min=20, prompt_max=40, new_tokens=4, sweep_size=2)
    report = bench_server.run_guidellm(args, 1, "m", "kind=concurrent,streams=2", tmp_path / "r.json",
                                       tmp_path / "r.log", 0.5)
    assert report == {"benchmarks": []} and marker.read_text() == "once"
    marker.write_text("always")
    with pytest.raises(RuntimeError, match="no result in two tries"):
        bench_server.run_guidellm(args, 1, "m", "kind=concurrent,streams=2", tmp_path / "s.json",
                                  tmp_path / "s.log", 0.5)


def test_a_server_that_dies_is_reported_and_the_other_configuration_still_runs(tmp_path, monkeypatch):
    """A server that stops under load fails its configuration with the reason from its log
    (transformers' "... died: ..." line); the next configuration still runs, the failure is in
    the JSON and the report, and the exit status is 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    fake = tmp_path / "guidellm"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys
if "model=dies" in " ".join(sys.argv):
    sys.exit(1)
out = next(a.split("path=")[1] for a in sys.argv if a.startswith("kind=json,path="))
pathlib.Path(out).write_text(json.dumps({{"benchmarks": []}}))
""")
    fake.chmod(0o755)
    started = []

    class Server:  # m3_sparse's dies at its first run; the dense twin's serves
        def __init__(self, checkpoint, extra, args, log):
            started.append(checkpoint.name)
            self.port, self.dies = 1, checkpoint.name.startswith("m3")
            log.write_text("INFO: started\nERROR - Error in generation loop: CUDA out of memory.\n"
                           "[transformers] The engine of m died: The continuous batching worker died: CUDA out of "
                           "memory.\nRuntimeError: An engine died (see the error above): stopping the server\n"
                           if self.dies else "INFO: started\n")
            self.proc = argparse.Namespace(poll=lambda: 1 if self.dies else None, returncode=1, wait=lambda s: None)

        def stop(self):
            pass

    _serve_with(monkeypatch, bench_server, Server)
    real_run = bench_server.run_guidellm
    monkeypatch.setattr(bench_server, "run_guidellm", lambda args, port, model, *rest: real_run(
        args, port, "dies" if "m3-" in model else model, *rest))
    code = bench_server.main(["--quick", "--out", str(tmp_path), "--guidellm", str(fake), "--seconds", "1",
                              "--warmup-seconds", "0"])
    assert code == 1 and started == ["m3-sf", "dense-sf"]
    result = json.loads((tmp_path / "bench_server.json").read_text())
    (failed,) = result["failures"]
    assert failed["config"] == "m3_sparse" and failed["run"] == "sweep"
    assert failed["why"].startswith("the server stopped (exit 1): [transformers] The engine of m died: ")
    assert "| sf | m3_sparse | default | sweep | the server stopped" in (tmp_path / "bench_server.md").read_text()


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_sigterm_stops_the_server_and_guidellm_and_keeps_the_rows_so_far(tmp_path):
    """A time limit's SIGTERM in the middle of a run: the server and guidellm, each in a session
    of its own with a worker of its own, are stopped with their workers (they once outlived a
    killed benchmark and held the GPU), the report is written with the interrupted run, and the
    exit status is 128 + 15."""
    pids = tmp_path / "pids"
    pids.mkdir()
    fake = tmp_path / "guidellm"  # the warm-up answers; the sweep hangs with a worker beside it
    fake.write_text(f"""#!{sys.executable}
import json, os, pathlib, subprocess, sys, time
out = next(a.split("path=")[1] for a in sys.argv if a.startswith("kind=json,path="))
if not any(a.startswith("kind=sweep") for a in sys.argv):
    pathlib.Path(out).write_text(json.dumps({{"benchmarks": []}}))
    sys.exit(0)
worker = subprocess.Popen(["sleep", "600"])
pathlib.Path({str(pids)!r}, "guidellm").write_text(f"{{os.getpid()}} {{worker.pid}}")
time.sleep(600)
""")
    fake.chmod(0o755)
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import subprocess, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import bench_server

class Server(bench_server.ServerProcess):  # a server process group: a shell and its worker
    def __init__(self, checkpoint, extra, args, log):
        self.port, self.log = 1, open(log, "w")
        self.proc = subprocess.Popen(["sh", "-c", "sleep 600 & echo $$ $! > {pids}/server; wait"],
                                     start_new_session=True)

def models(args, pattern, where):
    for name in ("m3", "dense"):
        (where / f"{{name}}-{{pattern}}").mkdir(parents=True, exist_ok=True)
    return where

bench_server.ServerProcess, bench_server.save_models = Server, models
sys.exit(bench_server.main(["--quick", "--out", {str(tmp_path)!r}, "--guidellm", {str(fake)!r},
                            "--seconds", "1", "--warmup-seconds", "1"]))
""")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    started = []
    try:
        deadline = time.monotonic() + 60
        while len(started) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # until both have written their two pids (a file may be half written)
            started = [int(p) for f in pids.iterdir() for p in f.read_text().split()]
        assert len(started) == 4 and all(_alive(p) for p in started), proc.poll()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, output
        deadline = time.monotonic() + 10  # a killed group's processes may take a moment to go
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)], output
    finally:
        proc.kill()
        for pid in started:  # what a failure above leaves behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    (failed,) = json.loads((tmp_path / "bench_server.json").read_text())["failures"]
    assert failed == {"layers": "sf", "config": "m3_sparse", "max_batch_tokens": None, "run": "sweep",
                      "why": "interrupted by SIGTERM"}
    assert "| sf | m3_sparse | default | sweep | interrupted by SIGTERM |" in (tmp_path / "bench_server.md").read_text()


def _reporting_guidellm(tmp_path: Path, hangs: str = "") -> Path:
    """A guidellm that answers each run with one benchmark of its profile's strategy, finishing
    requests at a rate of its own (synchronous 0.5/s, throughput 2/s, a constant rate at that
    rate, the closed loop 1.5/s), and lists every profile it was given in ``profiles.txt``. A run
    of the strategy ``hangs`` never ends."""
    fake = tmp_path / "guidellm"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys, time
argv = sys.argv
out = next(a.split("path=")[1] for a in argv if a.startswith("kind=json,path="))
profile = argv[argv.index("--profile") + 1]
with open({str(tmp_path / "profiles.txt")!r}, "a") as f:
    f.write(profile + "\\n")
fields = dict(x.split("=", 1) for x in profile.split(","))
kind = fields["kind"]
if kind == {hangs!r}:
    time.sleep(600)
req_s = {{"synchronous": 0.5, "throughput": 2.0, "concurrent": 1.5}}.get(kind) or float(fields["rate"])
strategy = {{"type_": kind}}
if kind == "constant":
    strategy["rate"] = req_s
if kind == "concurrent":
    strategy["streams"] = int(fields["streams"])
def metric(v):
    return {{"successful": {{"count": 4, "mean": v, "percentiles": {{"p50": v, "p99": 3 * v}}}}}}
ok = [{{"time_to_first_token_ms": 100.0, "inter_token_latency_ms": 5.0}}] * 4
bench = {{"config": {{"strategy": strategy}}, "duration": 4 / req_s,
         "requests": {{"successful": ok, "errored": []}},
         "metrics": {{"output_tokens_per_second": metric(8 * req_s), "requests_per_second": metric(req_s),
                     "time_to_first_token_ms": metric(100.0), "inter_token_latency_ms": metric(5.0)}}}}
pathlib.Path(out).write_text(json.dumps({{"benchmarks": [bench]}}))
""")
    fake.chmod(0o755)
    return fake


class _IdleServer:
    stack_dumps: list[str] = []  # the checkpoints whose server was asked for its stacks

    def __init__(self, checkpoint, extra, args, log):
        log.write_text("INFO: started\n")
        self.port, self.proc = 1, argparse.Namespace(poll=lambda: None, returncode=None, wait=lambda s: None)
        self.checkpoint = checkpoint

    def dump_stacks(self):
        self.stack_dumps.append(self.checkpoint.name)

    def stop(self):
        pass


def test_runs_over_several_calls_append_and_take_rates_as_shares(tmp_path, monkeypatch):
    """A configuration measured over three calls, as a time limit per call asks: the ends of the
    sweep, then constant rates given as shares of the throughput run's requests/s (from the
    first call's rows), then the closed loop. Each call adds its rows to the JSON and reports
    them all, targets included."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    from sse_stub import StubServer

    stub = StubServer(texts=("a", "b", "", "c", "d"), tokens=5)  # the per-gap probe's server

    class Server(_IdleServer):
        def __init__(self, *args):
            super().__init__(*args)
            self.port = stub.port

    _serve_with(monkeypatch, bench_server, Server)
    fake = _reporting_guidellm(tmp_path)
    base = ["--quick", "--out", str(tmp_path), "--guidellm", str(fake), "--seconds", "1", "--warmup-seconds", "0"]
    try:
        assert bench_server.main([*base, "--runs", "sync,throughput"]) == 0
        assert bench_server.main([*base, "--runs", "rates", "--rates", "0.25x,0.5x,0.9", "--append"]) == 0
    finally:
        stub.close()
    assert bench_server.main([*base, "--runs", "concurrent", "--configs", "m3_sparse", "--append"]) == 0
    profiles = (tmp_path / "profiles.txt").read_text().split()
    # Per call, m3_sparse's runs then the dense twin's; each share of 2 requests/s, the throughput run's.
    assert profiles == (["kind=synchronous", "kind=throughput,max_concurrency=512"] * 2
                        + [f"kind=constant,rate={r},max_concurrency=512" for r in ("0.5", "1", "0.9")] * 2
                        + ["kind=concurrent,streams=4"])
    result = json.loads((tmp_path / "bench_server.json").read_text())
    rows = result["rows"]
    assert [(r["config"], r["strategy"], r["rate"]) for r in rows] == [
        ("m3_sparse", "synchronous", None), ("m3_sparse", "throughput", None),
        ("dense", "synchronous", None), ("dense", "throughput", None),
        ("m3_sparse", "constant", 0.5), ("m3_sparse", "constant", 1.0), ("m3_sparse", "constant", 0.9),
        ("dense", "constant", 0.5), ("dense", "constant", 1.0), ("dense", "constant", 0.9),
        ("m3_sparse", "concurrent", 4),
    ]
    assert all(r["seconds"] == 1.0 for r in rows)
    # The probe ran beside each constant-rate run only, at a fifth of its rate, and streamed.
    probed = [r for r in rows if "probe_requests" in r]
    assert [(r["config"], r["rate"], r["probe_rate"]) for r in probed] == [
        (c, rate, 0.2 * rate) for c in ("m3_sparse", "dense") for rate in (0.5, 1.0, 0.9)]
    for r in probed:
        assert r["probe_requests"] >= 1 and r["probe_failed"] == 0 and r["tokens_per_event"] == 1.25
        assert r["probe_gaps"] == 3 * r["probe_requests"] and r["gap_itl_p99_ms"] >= r["gap_itl_p50_ms"] >= 0
    assert [b["model"] for b in stub.bodies][:1] == [str(tmp_path / "models" / "m3-sf")]
    assert (tmp_path / "guidellm-m3_sparse-sf-rate0.5.json").is_file()
    (t,) = result["targets"]
    # Half of m3_sparse's 2 requests/s is the constant run at 1/s; the twin's highest good rate too.
    assert t["m3_half_rate"] == 1.0 and t["m3_itl_p99_over_p50"] == 3.0
    gaps = next(r for r in rows if r["config"] == "m3_sparse" and r["rate"] == 1.0)
    assert t["m3_gap_itl_p99_over_p50"] == pytest.approx(gaps["gap_itl_p99_ms"] / gaps["gap_itl_p50_ms"])
    assert t["dense_rate_req_s"] == 2.0 and t["tok_s_ratio"] == 1.0
    md = (tmp_path / "bench_server.md").read_text()
    assert "| sf | m3_sparse | synchronous |" in md and "Per-gap probe" in md


def test_a_run_without_a_result_is_listed_and_the_next_runs_go_on(tmp_path, monkeypatch):
    """guidellm makes no result for the throughput run, twice, while the server still serves (the
    dense twin under hundreds of long prompts): the run is under Failed and the configuration's
    next runs are made, a share taken of its runs that finished. With the server gone, such a run
    ends its configuration as any failure does."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    dead = []

    class Server(_IdleServer):
        def __init__(self, checkpoint, *args):
            super().__init__(checkpoint, *args)
            if checkpoint.name.startswith("dense"):  # the twin's server is gone when guidellm is stopped
                dead.append(checkpoint.name)
                self.proc = argparse.Namespace(poll=lambda: 1, returncode=1, wait=lambda s: None)

    _serve_with(monkeypatch, bench_server, Server)
    monkeypatch.setattr(bench_server, "GUIDELLM_GRACE_S", 1.0)
    monkeypatch.setattr(_IdleServer, "stack_dumps", [])
    fake = _reporting_guidellm(tmp_path, hangs="throughput")
    code = bench_server.main(["--quick", "--out", str(tmp_path), "--guidellm", str(fake), "--seconds", "0.5",
                              "--warmup-seconds", "0", "--probe-share", "0",
                              "--runs", "sync,throughput,rates,concurrent", "--rates", "0.5x"])
    assert code == 1 and dead == ["dense-sf"]
    result = json.loads((tmp_path / "bench_server.json").read_text())
    assert [(r["config"], r["strategy"], r["rate"]) for r in result["rows"]] == [
        ("m3_sparse", "synchronous", None), ("m3_sparse", "constant", 0.25), ("m3_sparse", "concurrent", 4),
        ("dense", "synchronous", None)]
    runs = [(f["config"], f["run"]) for f in result["failures"]]
    assert runs == [("m3_sparse", "throughput"), ("dense", "throughput")]
    m3, dense = result["failures"]
    assert "made no result in two tries" in m3["why"] and "stacks are in its log" in m3["why"]
    assert dense["why"].startswith("the server stopped (exit 1)")
    assert _IdleServer.stack_dumps == ["m3-sf"]  # the server that still ran, before its next runs


def test_a_share_without_earlier_runs_fails_its_configuration(tmp_path, monkeypatch):
    """``--rates 0.5x`` with nothing to take a share of: the configuration fails with why, and
    no run is made at a made-up rate."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    _serve_with(monkeypatch, bench_server, _IdleServer)
    fake = _reporting_guidellm(tmp_path)
    code = bench_server.main(["--quick", "--out", str(tmp_path), "--guidellm", str(fake), "--seconds", "1",
                              "--warmup-seconds", "0", "--configs", "m3_sparse", "--runs", "rates", "--rates", "0.5x"])
    assert code == 1 and not (tmp_path / "profiles.txt").exists()
    (failed,) = json.loads((tmp_path / "bench_server.json").read_text())["failures"]
    assert failed["run"] == "rates" and "m3_sparse sf has no run with finished requests" in failed["why"]


def test_append_refuses_rows_of_other_runs(tmp_path, monkeypatch, capsys):
    """Rows of other prompts, new tokens or bounds are not mixed into one report."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    _serve_with(monkeypatch, bench_server, _IdleServer)
    fake = _reporting_guidellm(tmp_path)
    base = ["--quick", "--out", str(tmp_path), "--guidellm", str(fake), "--seconds", "1", "--warmup-seconds", "0",
            "--configs", "m3_sparse", "--runs", "sync"]
    assert bench_server.main(base) == 0
    before = (tmp_path / "bench_server.json").read_text()
    assert bench_server.main([*base, "--new-tokens", "16", "--append"]) == 2
    assert "holds runs with other new_tokens (8, here 16)" in capsys.readouterr().err
    assert (tmp_path / "bench_server.json").read_text() == before


@pytest.mark.parametrize("given, why", [
    (["--runs", "sweep,bogus"], "--runs: expected names from"),
    (["--runs", "rates"], "--rates: give rates with 'rates' in --runs, and only then"),
    (["--rates", "0.5x"], "--rates: give rates with 'rates' in --runs, and only then"),
    (["--runs", "rates", "--rates", "0.5x,-1"],
     "--rates: expected positive requests/s or shares such as 0.5x, got '-1'"),
    (["--runs", "rates", "--rates", "fast"], "got 'fast'"),
])
def test_runs_and_rates_are_checked(given, why, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_server

    with pytest.raises(SystemExit) as e:
        bench_server.parse_args(["--quick", "--guidellm", sys.executable, *given])
    assert e.value.code == 2 and why in capsys.readouterr().err
