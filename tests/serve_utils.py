"""A running ``m3-serve`` (transformers' own server) on the toy checkpoint, for the server tests:
the tiny M3 model with the toy tokenizer, fp32 on the CPU (or the GPU), continuous batching,
loopback only, on a free port."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from m3_hf_attention.toy_tokenizer import save_tokenizer
from model_utils import save_tiny_text_model

ROOT = Path(__file__).resolve().parents[1]
# Where the servers run their model: the CPU in CI; M3_SERVE_TEST_DEVICE=cuda on a GPU machine.
DEVICE = os.environ.get("M3_SERVE_TEST_DEVICE", "cpu")
# The servers run the model in fp32 (greedy tokens equal generate()'s). On a GPU their
# continuous batching runs eagerly: transformers' MoE experts (grouped_mm) copy from the host in
# fp32, which a CUDA-graph capture refuses (H100, torch 2.11, transformers 5.25). The captured
# steps run in the bf16 benchmarks (bench_serve.py, bench_server.py).
CUDA_GRAPHS = {} if DEVICE == "cpu" else {"use_cuda_graph": False}
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 30


# The toy tokenizer's vocabulary holds its special tokens and the 256 bytes: larger than the
# other tests' tiny model.
VOCAB = 512


def save_checkpoint(path: Path, seed: int = 11) -> Path:
    save_tiny_text_model(path, seed=seed, vocab_size=VOCAB)
    save_tokenizer(path, VOCAB)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One ``m3-serve`` process; ``url`` is its OpenAI base URL (``.../v1``)."""

    checkpoint: Path
    args: list[str] = field(default_factory=list)
    device: str = DEVICE
    proc: subprocess.Popen | None = None
    port: int = 0
    log: Path | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    @property
    def model(self) -> str:
        return str(self.checkpoint)

    def start(self, log_dir: Path) -> Server:
        self.port = free_port()
        self.log = log_dir / f"server-{self.port}.log"
        hub_cache = log_dir / "hub"  # empty: the server finds nothing but the model it is given
        hub_cache.mkdir(exist_ok=True)
        env = dict(
            os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"
        )
        cmd = [
            sys.executable, "-m", "m3_hf_attention.serve", str(self.checkpoint),
            "--continuous-batching", "--device", self.device, "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
            *(["--no-cb-use-cuda-graph"] if CUDA_GRAPHS else []),
        ]  # fmt: skip
        with open(self.log, "w") as out:
            # Its own process group: a stop signal reaches the server and nothing else.
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"m3-serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"m3-serve did not answer within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log is not None and self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` and wait; kill the group if it has not stopped in time. Returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"m3-serve did not stop within {STOP_TIMEOUT_S} s of signal {sig}:\n{self.tail()}")


class InProcessServer:
    """transformers' server app (its handlers and ``build_server``) served by uvicorn on a thread of
    this process, with the model's engine, transformers' own ``EngineClient.run_engine``, on
    another thread instead of a process of its own: the API side reaches it through the
    ``engine_connection`` that transformers' API servers use (5.25). So a test can read the
    continuous-batching manager and its page pool (:meth:`pool`), which the server has no
    endpoint for. Same options as :class:`Server`'s ``--cb-*`` / ``--max-model-len`` flags."""

    def __init__(self, checkpoint: Path, cb: dict, max_model_len: int | None = None):
        self.checkpoint, self.cb, self.max_model_len = checkpoint, cb, max_model_len
        self.manager = None  # the ContinuousBatchingManager, once the engine has started it
        self.cancelled: list[str] = []  # the requests the engine asked the manager to cancel
        self.models = None  # transformers' ModelManager: the models the API side knows
        self.port = 0

    base, url, model = Server.base, Server.url, Server.model

    def _load(self, loader, model_id: str, on_progress=None):
        model, processor = loader.load_model_and_processor(model_id, on_progress)
        start = model.init_continuous_batching

        def init_and_keep(*args, **kwargs):  # the engine keeps its manager to itself: note it here
            manager = self.manager = start(*args, **kwargs)
            cancel = manager.cancel_request

            def note_and_cancel(request_id):
                self.cancelled.append(request_id)
                cancel(request_id)

            manager.cancel_request = note_and_cancel
            return manager

        model.init_continuous_batching = init_and_keep
        return model, processor

    def start(self) -> InProcessServer:
        import uvicorn
        from transformers import ContinuousBatchingConfig
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.model_manager import EngineClient, ModelLoader, ModelManager
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.cli.serving.utils import GenerationState, canonical_model_id
        from transformers.utils import logging

        from m3_hf_attention.serve import serve_args

        args, env = serve_args([])
        hub = args[-1]
        state = GenerationState(
            continuous_batching=True, cb_config=ContinuousBatchingConfig(**self.cb, **CUDA_GRAPHS), max_model_len=self.max_model_len
        )
        loader = ModelLoader(device=DEVICE, dtype="float32", attn_implementation=hub, continuous_batching=True)
        requests, results = queue.Queue(), queue.Queue()
        reader, writer = multiprocessing.Pipe(duplex=False)
        load = partial(self._load, loader, canonical_model_id(self.model))
        engine_args = (load, state, requests, [results], writer, False, logging.WARNING)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # LOCAL_KERNELS, as m3-serve sets it, while the model loads
        try:
            threading.Thread(target=EngineClient.run_engine, args=engine_args, name="engine", daemon=True).start()
            if not reader.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the model did not load within {START_TIMEOUT_S} s")
            loaded = reader.recv()  # None once the model is loaded and its manager started, else the error
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
        if loaded is not None:
            raise loaded
        manager = self.models = ModelManager(
            loader, state, force_model=self.model, engine_connection=(requests, results, 0)
        )
        handlers = dict(model_manager=manager, generation_state=state)
        app = build_server(
            manager,
            ChatCompletionHandler(**handlers),
            completion_handler=CompletionHandler(**handlers),
            response_handler=ResponseHandler(**handlers),
            transcription_handler=TranscriptionHandler(manager),
            systemone_handler=SystemOneHandler(**handlers),
        )
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stops serving. The engine's threads idle until the process exits: stopping the manager
        would leave transformers' output thread polling a stopped manager in a busy loop."""
        self.uvicorn.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)

    def pool(self) -> dict:
        """The page pool as the requests left it: ``requests`` the manager still holds (running or
        waiting), ``tables`` the block tables its allocators still keep, ``held`` the bytes of
        blocks neither free nor kept by prefix caching (unreferenced blocks with a known content,
        which any request may take back), ``total`` the pool's bytes."""
        processor = self.manager.batch_processor
        cache, scheduler = processor.cache, processor.scheduler
        allocators = cache.cache_allocators.values()
        total = cache.num_sectors * cache.bytes_per_sector
        free = int(cache.compute_free_capacity(relative=False))
        cached = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in allocators)
        return {
            "requests": len(scheduler.active_requests) + len(scheduler.waiting_requests),
            "tables": sum(len(a.block_table) for a in allocators),
            "held": total - free - cached,
            "total": total,
        }
