"""A streaming client that times every streamed event of its requests, run beside guidellm.

guidellm keeps, per request, the times of its first and last streamed tokens and their count,
and reports a request's inter-token latency as their mean gap; its percentiles are over
requests (each weighted by its gaps), so a stall inside a request only raises that request's
mean. A decode step held up by a prefill chunk is such a stall. This client sends requests of
its own to the same server while guidellm's run loads it, at a constant rate, and keeps the
arrival time of every streamed event; the gaps between consecutive events of a request, pooled
over all its requests, give the per-gap latency whose p99 shows the stalls.

An event is one ``data:`` line of the server's stream that carries text. The server's
detokenizer holds back a token whose bytes are not yet whole UTF-8 characters and sends it
with the next, and joins the texts of a stream that fell behind, so an event may carry more
than one token: its gap then spans as many decode steps. ``tokens_per_event`` (the completion
tokens the server reports, over the events) says how often; near 1, a gap is a step.

    results = run_probe("http://127.0.0.1:8000", model, prompts, rate=0.2, seconds=30, max_tokens=64)
    gap_figures(results)   # {"probe_requests": ..., "gap_itl_p50_ms": ..., "gap_itl_p99_ms": ...}
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import common

# A request the server has not finished this long after the run's arrivals end is dropped.
DRAIN_S = 120.0
STOP_POLL_S = 0.05  # how often the arrivals look at the stop flag
# Text the prompts are cut from, repeated to length: prose of the kind the toy tokenizer was trained on.
_PROMPT_WORDS = ("Each query scores the key blocks with a small index branch and keeps the best of them. "
                 "The paged cache holds keys, values and index keys for every token, page by page. ")


def make_prompts(tokenizer_file: Path, lo: int, hi: int, count: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``lo``-``hi`` tokens (drawn uniformly, seed ``seed``) for the
    tokenizer of ``tokenizer_file`` (a ``tokenizer.json``): the first tokens of a repeated
    text, decoded. A cut between two tokens may re-encode a token longer or shorter."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    ids = tok.encode(_PROMPT_WORDS * (hi // 8 + 1), add_special_tokens=False).ids
    while len(ids) < hi:
        ids = ids + ids
    rng = random.Random(seed)
    return [tok.decode(ids[: rng.randint(lo, hi)]) for _ in range(count)]


async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, events, tokens = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
            if any(c.get("text") for c in chunk.get("choices") or ()):
                events.append(time.perf_counter())
    return {"sent": sent, "events": events, "tokens": tokens}


async def probe(url: str, model: str, prompts: list[str], rate: float, seconds: float, max_tokens: int,
                stop: threading.Event | None = None) -> list:
    """Requests at ``rate`` per second for ``seconds`` (prompts in turn), each streamed; their
    results (``_one``'s dicts, or the exception that ended one) once every request ended or
    ``DRAIN_S`` passed after the last arrival. ``stop`` set ends the arrivals early, after the
    first."""
    import httpx

    if rate <= 0:
        raise ValueError(f"rate: expected requests per second > 0, got {rate}")
    async with httpx.AsyncClient(timeout=httpx.Timeout(DRAIN_S + seconds)) as client:
        tasks, start = [], time.perf_counter()
        # The first request goes out at once, even where ``stop`` is already set.
        while (now := time.perf_counter()) - start < seconds and not (tasks and stop and stop.is_set()):
            # Constant arrivals, as guidellm's constant profile: the i-th at i / rate.
            if now >= start + len(tasks) / rate:
                prompt = prompts[len(tasks) % len(prompts)]
                tasks.append(asyncio.ensure_future(_one(client, url, model, prompt, max_tokens)))
            # Short waits, so that ``stop`` ends the arrivals soon at low rates too.
            await asyncio.sleep(min(STOP_POLL_S, max(0.0, start + len(tasks) / rate - time.perf_counter())))
        done, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        return [t.exception() or t.result() if t in done else TimeoutError(f"no end in {DRAIN_S:g} s")
                for t in tasks]


class ProbeThread(threading.Thread):
    """``probe`` on a thread of its own (its own event loop), so that it runs while the caller
    waits for guidellm; ``results`` once joined."""

    def __init__(self, *args, **kwargs):
        super().__init__(daemon=True, name="stream-probe")
        self._args, self._kwargs, self.stop = args, kwargs, threading.Event()
        self.results: list = []

    def run(self) -> None:
        try:
            self.results = asyncio.run(probe(*self._args, stop=self.stop, **self._kwargs))
        except Exception as e:  # noqa: BLE001 - reported in the row instead of ending the benchmark
            self.results = [e]


def gap_figures(results: list) -> dict:
    """The figures of a probe run: requests that ended and those that failed (with the first
    failure), the pooled gaps between consecutive events (count, p50, p99, ms) and the
    completion tokens per event."""
    ok = [r for r in results if isinstance(r, dict)]
    failed = [r for r in results if not isinstance(r, dict)]
    gaps = [1000.0 * (b - a) for r in ok for a, b in zip(r["events"], r["events"][1:])]
    events = sum(len(r["events"]) for r in ok)
    tokens = [r["tokens"] for r in ok if r["tokens"] is not None]
    return {
        "probe_requests": len(ok), "probe_failed": len(failed),
        "probe_failure": f"{type(failed[0]).__name__}: {failed[0]}"[:300] if failed else None,
        "probe_gaps": len(gaps),
        "gap_itl_p50_ms": common.percentile(gaps, 50), "gap_itl_p99_ms": common.percentile(gaps, 99),
        "tokens_per_event": sum(tokens) / events if events and len(tokens) == len(ok) else None,
    }  # fmt: skip


def run_probe(url: str, model: str, prompts: list[str], rate: float, seconds: float, max_tokens: int) -> list:
    """``probe`` to the end, on the calling thread."""
    return asyncio.run(probe(url, model, prompts, rate, seconds, max_tokens))


__all__ = ["ProbeThread", "gap_figures", "make_prompts", "probe", "run_probe"]
