"""``m3-serve`` (transformers' own server, continuous batching, the kernel named by its hub string)
driven by real clients on loopback: the official ``openai`` SDK and raw HTTP (httpx), chat
completions and completions, streamed and not. Greedy requests on the fp32 toy model return
exactly the text of that prompt's own ``generate()`` on ``attn_implementation="m3_sparse"``."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import m3_hf_attention  # noqa: F401  (registers m3_sparse for the reference generate())
from m3_hf_attention.serve import SERVE_STEP_TOKENS, serve_args
from packaging.version import Version
from serve_utils import DEVICE, Server, save_checkpoint

NEW_TOKENS = 12
# Small pages and steps: the prompts below span several pages and are chunked.
SERVER_ARGS = ["--cb-block-size", "16", "--cb-num-blocks", "96", "--cb-max-batch-tokens", "48"]
PROMPTS = [
    "The paged cache holds keys, values and index keys for every token.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 and then the sea and the sky, "
    "Zürich, São Paulo, 東京 and a short poem about attention over a few selected blocks.",
    "Hello!",
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("toy-m3-serve"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint, SERVER_ARGS).start(tmp_path_factory.mktemp("serve-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(tokenizer, prompt ids -> the text of its own greedy generate() on m3_sparse)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse", dtype=torch.float32)
    model.eval().to(DEVICE)

    def text(ids: list[int]) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return tokenizer, text


def assert_streamed(got: str, want: str) -> None:
    """A stream's text is the whole text, except that an unfinished UTF-8 character at the very
    end (random tokens can end mid-character: U+FFFD in a whole decode) is never sent: the
    streaming detokenizer waits for the bytes that would finish it."""
    assert want.startswith(got) and set(want[len(got):]) <= {"\ufffd"}, (got, want)


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def test_m3_serve_names_this_kernel_and_passes_the_rest_on(monkeypatch):
    monkeypatch.delenv("M3_SPARSE_KERNEL", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    args, env = serve_args(["/m", "--continuous-batching", "--port", "9"])
    step = ["--cb-max-batch-tokens", str(SERVE_STEP_TOKENS)]
    hub = m3_hf_attention._kernel.HUB_REPO_ID
    assert args == [*step, "/m", "--continuous-batching", "--port", "9", "--attn-implementation", hub]
    assert env == {"LOCAL_KERNELS": f"{m3_hf_attention._kernel.HUB_REPO_ID}={m3_hf_attention._kernel.REPO_ROOT}"}
    # m3_sparse, which transformers' server would refuse, becomes the hub string; others pass through.
    assert serve_args(["/m", "--attn-implementation", "m3_sparse"])[0][-1] == m3_hf_attention._kernel.HUB_REPO_ID
    assert serve_args(["/m", "--attn-implementation=m3_sparse"])[0][-1].endswith("=" + m3_hf_attention._kernel.HUB_REPO_ID)
    assert serve_args(["/m", "--attn-implementation", "paged|m3_sparse"])[0][-1] == m3_hf_attention._kernel.HUB_REPO_ID
    assert serve_args(["/m", "--attn-implementation", "sdpa"])[0][-1] == "sdpa"
    # The step size is m3-serve's for this kernel under continuous batching only, and the user's wins.
    for given in (["/m", "--continuous-batching"], ["/m", "--continuous-batching", "--attn-implementation=m3_sparse"],
                  ["/m", "--continuous-batching", "--attn-implementation", m3_hf_attention._kernel.HUB_REPO_ID]):
        assert serve_args(given)[0][:2] == step, given
    for given in (["/m"], ["/m", "--continuous-batching", "--attn-implementation", "sdpa"],
                  ["/m", "--continuous-batching", "--attn-implementation=paged|sdpa"]):
        assert "--cb-max-batch-tokens" not in serve_args(given)[0], given
    for given in (["/m", "--continuous-batching", "--cb-max-batch-tokens", "512"],
                  ["/m", "--continuous-batching", "--cb-max-batch-tokens=512"]):
        assert serve_args(given)[0][:-2] == given
    monkeypatch.setenv("LOCAL_KERNELS", "a/b=/c")
    assert serve_args(["/m"])[1] == {}  # the user's mapping is kept
    monkeypatch.setenv("M3_SPARSE_KERNEL", "org/m3-sparse@abc")
    assert serve_args(["/m"])[0][-1] == "org/m3-sparse@abc"


TRANSFORMERS = Version(transformers.__version__).release


@pytest.mark.skipif(TRANSFORMERS < (5, 25), reason="up to 5.24 /v1/models lists the hub cache's models")
def test_models_lists_the_pinned_model(server):
    data = httpx.get(server.url + "/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [server.model]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_completions_are_generate_s_tokens(server, client, reference, stream):
    tokenizer, text = reference
    for prompt in PROMPTS:
        want = text(tokenizer(prompt)["input_ids"])
        kwargs = dict(model=server.model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
            assert_streamed(got, want)
        else:
            assert client.completions.create(**kwargs).choices[0].text == want, f"prompt {prompt!r}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_chat_is_generate_s_tokens_through_the_chat_template(server, client, reference, stream):
    tokenizer, text = reference
    want = text(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    kwargs = dict(model=server.model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
        assert_streamed("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), want)
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].message.content == want
        assert reply.usage.completion_tokens <= NEW_TOKENS


def test_raw_http_stream_is_server_sent_events(server, reference):
    tokenizer, text = reference
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
    pieces = []
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert_streamed("".join(pieces), text(tokenizer(PROMPTS[0])["input_ids"]))


def test_concurrent_requests_each_get_their_own_tokens(server, reference):
    """Requests that share the server's steps: each one's text is its prompt's own."""
    import concurrent.futures

    tokenizer, text = reference
    want = [text(tokenizer(p)["input_ids"]) for p in PROMPTS]

    def ask(prompt):
        body = {"model": server.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        return httpx.post(server.url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        got = list(pool.map(ask, PROMPTS * 2))
    assert got == want * 2


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_prints_the_stacks_of_the_model_s_threads_and_the_server_serves_on(server, reference):
    """``kill -USR1`` to the server and the process it runs its model in (where transformers'
    server spawns one), for a request that makes no progress: the log gets the Python stack of
    each thread, the continuous-batching manager's among them, and the server answers as before."""
    psutil = pytest.importorskip("psutil")
    tokenizer, text = reference
    before = len(server.log.read_text(errors="replace"))
    main = psutil.Process(server.proc.pid)
    # The model's process, not multiprocessing's resource tracker (which SIGUSR1 would end).
    spawned = [p for p in main.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    for proc in [main, *spawned]:
        proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    # Each process writes its dump from its signal handler: the manager's frames come in time.
    while "continuous_batching" not in (dumped := server.log.read_text(errors="replace")[before:]):
        assert time.monotonic() < deadline and server.proc.poll() is None, dumped[-4000:] or server.tail()
        time.sleep(0.2)
    assert dumped.count("(most recent call first)") >= 2, dumped[:2000]
    body = {"model": server.model, "prompt": PROMPTS[2], "max_tokens": NEW_TOKENS, "temperature": 0}
    got = httpx.post(server.url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert got == text(tokenizer(PROMPTS[2])["input_ids"])
