"""Faults against ``m3-serve`` (transformers' own server, continuous batching) on the toy
checkpoint: clients that leave, prompts too long for the model or the page pool, bad requests,
more requests than the pool holds, a model the server is not pinned to, SIGTERM with streams
open, and a soak of short requests with random cancellations. Each checks that nothing is lost
and that the server still serves: a greedy request afterwards returns the text it returned
before the fault.

The server has no endpoint for its page pool. From transformers 5.25 the model runs behind a
queue (``engine_connection``), so the server here runs in this process (``InProcessServer``:
transformers' app and engine on threads), where the tests read the batching manager's pool and
the requests it was asked to cancel. On older releases it is ``m3-serve`` in a process of its
own and the pool is not read."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import signal
import threading
import time

import httpx
import psutil
import pytest
import transformers
from packaging.version import Version

from serve_utils import STOP_TIMEOUT_S, InProcessServer, Server, save_checkpoint

TRANSFORMERS = Version(transformers.__version__).release
# 5.25's server runs the model behind a queue, which a thread of this process can serve.
IN_PROCESS = TRANSFORMERS >= (5, 25)
needs_max_model_len = pytest.mark.skipif(
    TRANSFORMERS < (5, 25), reason="5.17's server has no --max-model-len (5.25's has)"
)

NEW_TOKENS = 12
MAX_MODEL_LEN = 128
# Pages of 16 tokens, a pool of about 32 x 16 tokens: one request of a few hundred tokens fits,
# 32 requests of ~40 tokens do not fit together.
CB = dict(block_size=16, num_blocks=32, max_batch_tokens=48)
PROMPTS = [
    "The paged cache holds keys, values and index keys.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 and the sea.",
    "Hello!",
]


def cb_flags(cb: dict) -> list[str]:
    return [arg for name, value in cb.items() for arg in (f"--cb-{name.replace('_', '-')}", str(value))]


def start(checkpoint, tmp_path_factory, cb=CB, max_model_len=None):
    if IN_PROCESS:
        return InProcessServer(checkpoint, cb, max_model_len).start()
    return Server(checkpoint, cb_flags(cb)).start(tmp_path_factory.mktemp("serve-logs"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("toy-m3-faults"))


@pytest.fixture(scope="module")
def live(checkpoint, tmp_path_factory):
    s = start(checkpoint, tmp_path_factory, max_model_len=MAX_MODEL_LEN if IN_PROCESS else None)
    yield s
    s.stop()


def complete(server, prompt, max_tokens=NEW_TOKENS, model=None, **extra) -> httpx.Response:
    body = {"model": model or server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(server.url + "/completions", json=body, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def streamed_text(body: str) -> str:
    lines = [line[6:] for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    events = [json.loads(line) for line in lines]
    return "".join(c["text"] for e in events for c in e["choices"])


def matches(got: str, want: str, stream: bool) -> bool:
    """A stream never sends an unfinished UTF-8 character at its very end (U+FFFD in a whole decode)."""
    return got == want or (stream and want.startswith(got) and set(want[len(got):]) <= {"\ufffd"})


@pytest.fixture(scope="module")
def baseline(live):
    """Each prompt's greedy text, asked of the server before any fault."""
    return {p: text_of(complete(live, p)) for p in PROMPTS}


def reads_pool(server) -> bool:
    return isinstance(server, InProcessServer)


def wait_pool_free(server, timeout: float = 10.0) -> None:
    """The manager holds no request, its allocators no block table, and every page is free or kept
    by prefix caching (reusable by any request)."""
    if not reads_pool(server):
        return
    deadline = time.monotonic() + timeout
    while (pool := server.pool())["requests"] or pool["tables"] or pool["held"]:
        assert time.monotonic() < deadline, f"pages still held: {pool}"
        time.sleep(0.05)


def assert_still_serves(server, baseline) -> None:
    wait_pool_free(server)
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    assert {p: text_of(complete(server, p)) for p in baseline} == baseline
    wait_pool_free(server)


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_pages(live, baseline):
    """The stream's client closes after a few chunks while another request runs beside it: the
    server cancels it in the manager (before it could finish), its pages go back to the pool, and
    the request beside it gets exactly its own text."""
    body = {"model": live.model, "prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True}
    cancelled_before = len(live.cancelled) if reads_pool(live) else 0
    streaming, leave = threading.Event(), threading.Event()

    def stream_then_leave() -> bool:
        """Whether the answer ended before the client left."""
        chunks = 0
        with httpx.stream("POST", live.url + "/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]" or any(c.get("finish_reason") for c in json.loads(line[6:])["choices"]):
                    return True
                chunks += 1
                if chunks == 3:
                    streaming.set()
                if chunks >= 3 and leave.is_set():
                    break  # leaving the block closes the connection mid-stream
        return False

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leaving = pool.submit(stream_then_leave)
        assert streaming.wait(60)
        beside = pool.submit(complete, live, PROMPTS[1])
        # The client leaves once the other request is in the manager beside its own.
        deadline = time.monotonic() + 10
        while reads_pool(live) and live.pool()["requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0 if reads_pool(live) else 0.2)
        leave.set()
        assert not leaving.result(), "the answer ended before its client left"
        assert text_of(beside.result()) == baseline[PROMPTS[1]]
    if reads_pool(live):
        deadline = time.monotonic() + 10
        while len(live.cancelled) == cancelled_before:
            assert time.monotonic() < deadline, "the stream's request was never cancelled"
            time.sleep(0.05)
        assert len(live.cancelled) == cancelled_before + 1
    assert_still_serves(live, baseline)


@needs_max_model_len
def test_a_prompt_longer_than_the_model_length_is_a_400(live, baseline):
    prompt = "x" * (MAX_MODEL_LEN + 10)  # a token a byte at most
    r = complete(live, prompt)
    assert r.status_code == 400
    assert "--max-model-len" in r.json()["detail"]
    assert_still_serves(live, baseline)


@pytest.mark.parametrize("prompt_len,max_tokens", [(300, 4), (60, 300)], ids=["prompt", "prompt-and-answer"])
def test_a_request_larger_than_the_pool_is_refused_and_the_server_serves_on(
    checkpoint, tmp_path_factory, prompt_len, max_tokens
):
    """Shorter than the model's context (4096), larger than a pool of 8 pages of 16 tokens: the
    package's add_request refuses it (transformers' scheduler would take it and stop the
    batching worker); 5.25's server turns the ValueError into a 400, 5.17's into a 500, and both
    serve on."""
    server = start(checkpoint, tmp_path_factory, cb=dict(CB, num_blocks=8))
    try:
        r = complete(server, "".join(chr(97 + i * 7 % 26) for i in range(prompt_len)), max_tokens=max_tokens)
        if IN_PROCESS:
            assert r.status_code == 400 and "cache slots" in r.text and "nothing was queued" in r.text, r.text[:300]
        else:  # 5.17's handlers answer any exception with a bare 500
            assert r.status_code == 500, (r.status_code, r.text[:300])
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        assert text_of(complete(server, PROMPTS[2]))
        wait_pool_free(server)
    finally:
        server.stop()


def test_malformed_requests_get_a_4xx(live, baseline):
    """Malformed JSON: FastAPI's 422. A model name the server does not serve: 400."""
    r = httpx.post(live.url + "/completions", content=b'{"prompt": "Hi', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = complete(live, "Hello!", model="no-such-org/no-such-model")
    assert r.status_code == 400 and "pinned" in r.json()["detail"]
    assert_still_serves(live, baseline)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_degenerate_requests_are_answered_harmlessly(live, baseline, stream):
    """transformers takes these rather than refusing them (OpenAI's API answers 400 to the first
    two): ``max_tokens`` 0 or negative returns no text, ``finish_reason`` "length" (the manager
    computes one token and drops it); an empty prompt generates after the tokenizer's own start
    token. Nothing is held afterwards."""

    def ask(prompt, max_tokens):
        r = complete(live, prompt, max_tokens=max_tokens, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            return streamed_text(r.text), None
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

    for max_tokens in (0, -1):
        text, tokens = ask("Hello!", max_tokens)
        assert text == "" and tokens in (0, None)
    assert ask("", 4)[1] in (4, None)
    assert_still_serves(live, baseline)


def test_more_requests_than_the_pool_holds_wait_and_all_finish(live, baseline):
    prompts = [PROMPTS[i % 2] for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(complete, [live] * len(prompts), prompts))
    # Together they need far more tokens than the pool holds.
    assert sum(r.json()["usage"]["total_tokens"] for r in replies) > 1.5 * CB["num_blocks"] * CB["block_size"]
    assert [text_of(r) for r in replies] == [baseline[p] for p in prompts]
    assert_still_serves(live, baseline)


def test_another_model_than_the_pinned_one_is_refused_and_not_loaded(live, baseline, tmp_path_factory):
    other = save_checkpoint(tmp_path_factory.mktemp("another-m3"), seed=12)  # loadable: only the pin stops it
    r = complete(live, "Hello!", model=str(other))
    assert r.status_code == 400 and "pinned" in r.json()["detail"]
    if TRANSFORMERS >= (5, 25):  # earlier /v1/models lists the hub cache's models
        models = httpx.get(live.url + "/models", timeout=10).json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in models] == [(live.model, "loaded")]
    if reads_pool(live):
        assert list(live.models.engines) == [live.model]
    assert_still_serves(live, baseline)


def test_sigterm_with_streams_open_stops_the_server_and_its_processes(checkpoint, tmp_path_factory):
    """SIGTERM to the server's main process, as a supervisor sends it, while three streams are
    open: the process exits within the stop timeout and leaves no process of its group behind
    (5.25 runs the model in a child process)."""
    server = Server(checkpoint, cb_flags(dict(CB, num_blocks=64))).start(tmp_path_factory.mktemp("serve-logs"))
    group = os.getpgid(server.proc.pid)
    opened = threading.Barrier(4)
    body = {"model": server.model, "prompt": "Hello!", "max_tokens": 200, "temperature": 0, "stream": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                opened.wait(60)
                for _ in lines:
                    time.sleep(0.01)  # a slow reader: the streams stay open
        except httpx.HTTPError:
            pass  # the server went away mid-stream

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            opened.wait(60)
            stopping = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(STOP_TIMEOUT_S)
            stopped = time.monotonic() - stopping
            for s in streams:
                s.result(60)
        assert stopped < STOP_TIMEOUT_S

        def left() -> list[psutil.Process]:
            procs = []
            for p in psutil.process_iter(["status"]):
                try:
                    if os.getpgid(p.pid) == group and p.info["status"] != psutil.STATUS_ZOMBIE:
                        procs.append(p)
                except (ProcessLookupError, psutil.Error):
                    pass
            return procs

        deadline = time.monotonic() + 10  # a child sees its parent gone within a second or so
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left(), [p.cmdline() for p in left()]
    finally:
        server.stop(signal.SIGKILL)
        try:
            os.killpg(group, signal.SIGKILL)  # whatever the test found left
        except ProcessLookupError:
            pass


SOAK_REQUESTS = 1000
SOAK_CONCURRENCY = 24
SOAK_TOKENS = 6
SOAK_CANCEL = 0.2
SOAK_RSS_GROWTH = 32 << 20  # bytes, between the end of the first half and the end of the second


def rss(server) -> int:
    """The server's resident memory: this process in-process, else the server's process and its children."""
    if reads_pool(server):
        return psutil.Process().memory_info().rss
    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def test_soak_of_short_requests_with_random_cancellations(live, baseline):
    """1,000 short greedy requests, 24 at a time, a fifth of them left by their client (a few
    milliseconds after sending, or after the first streamed chunk): every other one gets exactly
    its prompt's text, the server's memory does not keep growing from the first half to the
    second, and the pool is free after each half."""
    rng = random.Random(1234)
    prompts = [f"Item {i}: the sea." for i in range(8)]
    want = {p: text_of(complete(live, p, max_tokens=SOAK_TOKENS)) for p in prompts}
    # (prompt, cancelled, when it leaves, streamed)
    plan = [
        (rng.choice(prompts), rng.random() < SOAK_CANCEL, rng.random(), rng.random() < 0.5)
        for _ in range(SOAK_REQUESTS)
    ]
    failures: list[str] = []
    memory: list[int] = []
    cancelled_before = len(live.cancelled) if reads_pool(live) else 0

    async def one(client, gate, prompt, cancel, when, stream):
        body = {"model": live.model, "prompt": prompt, "max_tokens": SOAK_TOKENS, "temperature": 0}
        body["stream"] = stream or cancel
        async with gate:
            if cancel:
                return await leave_early(client, body, when)
            r = await client.post("/completions", json=body)
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:200]}")
                return
            got = streamed_text(r.text) if stream else r.json()["choices"][0]["text"]
            if not matches(got, want[prompt], stream):
                failures.append(f"{prompt!r}: {got!r} != {want[prompt]!r}")

    async def leave_early(client, body, when):
        if when < 0.2:  # leaves while the request is queued, prefilled or before it is sent
            try:
                await asyncio.wait_for(client.post("/completions", json=body), timeout=0.002 + when / 50)
            except (asyncio.TimeoutError, httpx.HTTPError):
                pass
            return
        async with client.stream("POST", "/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leaves after the first chunk

    async def soak():
        gate = asyncio.Semaphore(SOAK_CONCURRENCY)
        limits = httpx.Limits(max_connections=SOAK_CONCURRENCY + 4)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            half = SOAK_REQUESTS // 2
            for part in (plan[:half], plan[half:]):
                await asyncio.gather(*(one(client, gate, *item) for item in part))
                wait_pool_free(live)
                memory.append(rss(live))

    asyncio.run(soak())
    assert not failures, failures[:5]
    assert memory[1] - memory[0] < SOAK_RSS_GROWTH, memory
    if reads_pool(live):  # the clients' leaving reached the manager
        assert len(live.cancelled) > cancelled_before
    assert_still_serves(live, baseline)

