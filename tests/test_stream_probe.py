"""benchmarks/stream_probe.py: the per-gap latency of streamed requests, against a stub server
that streams known events, and the gap figures against hand-made timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import stream_probe  # noqa: E402
from sse_stub import StubServer  # noqa: E402

pytest.importorskip("httpx")


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.close()


def test_probe_times_each_event_with_text(stub):
    results = stream_probe.run_probe(f"http://127.0.0.1:{stub.port}", "m", ["p0", "p1"], rate=20.0, seconds=0.2,
                                     max_tokens=4)
    assert len(results) >= 2 and all(isinstance(r, dict) for r in results)
    # Three events carry text; the empty one is no event.
    assert all(len(r["events"]) == 3 and r["tokens"] == 4 and r["sent"] <= r["events"][0] for r in results)
    # The prompts go out in turn.
    assert [b["prompt"] for b in stub.bodies] == [f"p{i % 2}" for i in range(len(stub.bodies))]
    body = stub.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 4 and body["model"] == "m"
    f = stream_probe.gap_figures(results)
    assert f["probe_requests"] == len(results) and f["probe_failed"] == 0 and f["probe_gaps"] == 2 * len(results)
    assert f["tokens_per_event"] == pytest.approx(4 / 3)


def test_a_refused_request_is_counted_as_failed(stub):
    results = stream_probe.run_probe(f"http://127.0.0.1:{stub.port}", "m", ["refuse"], rate=10.0, seconds=0.05,
                                     max_tokens=4)
    f = stream_probe.gap_figures(results)
    assert f["probe_requests"] == 0 and f["probe_failed"] == len(results) >= 1
    assert "HTTP 400" in f["probe_failure"] and f["gap_itl_p99_ms"] is None


def test_gaps_are_pooled_over_requests_not_averaged_per_request():
    """Two requests of four gaps: three of 10 ms and, in one of them, a stall of 300 ms. Pooled,
    the stall is the top eighth of the gaps; per-request means (guidellm's ITL) would put the
    worst request at 82.5 ms."""
    even = {"sent": 0.0, "events": [0.1, 0.11, 0.12, 0.13, 0.14], "tokens": 5}
    stalled = {"sent": 0.0, "events": [0.1, 0.11, 0.41, 0.42, 0.43], "tokens": 5}
    f = stream_probe.gap_figures([even, stalled, ValueError("lost")])
    assert f["probe_requests"] == 2 and f["probe_failed"] == 1 and f["probe_failure"] == "ValueError: lost"
    assert f["probe_gaps"] == 8 and f["tokens_per_event"] == 1.0
    assert f["gap_itl_p50_ms"] == pytest.approx(10.0)
    # p99 of [10 x 7, 300]: 7 x 0.99 = 6.93 of the way, between the 10 and the 300.
    assert f["gap_itl_p99_ms"] == pytest.approx(10.0 + 0.93 * 290.0)


def test_percentile_interpolates_between_order_statistics():
    assert common.percentile([], 50) is None
    assert common.percentile([4.0], 99) == 4.0
    assert common.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert common.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0


def test_prompts_have_the_asked_lengths(tmp_path):
    from m3_hf_attention.toy_tokenizer import save_tokenizer
    from tokenizers import Tokenizer

    save_tokenizer(tmp_path, 512)
    prompts = stream_probe.make_prompts(tmp_path / "tokenizer.json", 20, 150, 16, seed=3)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lengths = [len(tok.encode(p, add_special_tokens=False).ids) for p in prompts]
    # A cut between two tokens may re-encode a few tokens differently.
    assert all(18 <= n <= 152 for n in lengths) and len(set(lengths)) > 8
    assert prompts == stream_probe.make_prompts(tmp_path / "tokenizer.json", 20, 150, 16, seed=3)


def test_a_probe_needs_a_positive_rate():
    with pytest.raises(ValueError, match="rate"):
        stream_probe.run_probe("http://127.0.0.1:1", "m", ["p"], rate=0.0, seconds=1.0, max_tokens=1)
