"""generate() with an M3PagedCache reads its stop flag one step late on CUDA (transformers'
``DeferredStopCheck``, switched on for the paged cache in hf/attention.py), running one step
past a stop and undoing it with ``M3PagedCache.crop``.

On the CPU: ``crop`` puts the lengths back exactly (the next step's logits match a cache
that never ran the removed steps) and refuses what it cannot do; the switch covers the
paged cache on CUDA only; and the deferred loop itself, run on the CPU with events that
need no device (a CPU op has finished when it returns), gives the tokens, scores, streamed
tokens and cache lengths of the loop that checks every step, with rows stopping early.
tests/test_cuda_graph.py runs it on the GPU as generate() does by default.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation import utils as generation

from m3_hf_attention import M3PagedCache
from model_utils import PAD, left_padded_batch, save_tiny_text_model

PAGE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-deferred")
    save_tiny_text_model(path, seed=8)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="m3_sparse").eval()


def _batch(seed=0):
    ids, mask, _ = left_padded_batch([37, 30], torch.Generator().manual_seed(seed))
    return ids, mask


def _run(model, cache, ids, mask, tokens):
    """Prefill ``ids``, then feed ``tokens`` ([steps, B]) one step at a time; the last
    step's logits."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        ones = torch.ones(ids.shape[0], 1, dtype=torch.long)
        for t in tokens:
            out = model(input_ids=t[:, None], attention_mask=ones, past_key_values=cache, use_cache=True)
    return out.logits[:, -1]


def _lengths(cache):
    return cache.sequence_lengths().tolist(), cache.slots_used


@pytest.mark.parametrize("steps", [0, 3])
def test_crop_puts_the_lengths_back(model, steps):
    """A cache that ran ``steps`` + 2 decode steps and dropped the last 2 continues exactly
    like one that ran ``steps`` (``steps`` 0: the crop reaches back into the prefill's step)."""
    ids, mask = _batch()
    feed = torch.randint(3, 150, (steps + 3, 2), generator=torch.Generator().manual_seed(1))
    kept = M3PagedCache(model.config, 2, 64, page_size=PAGE)
    _run(model, kept, ids, mask, feed[:steps])
    cropped = M3PagedCache(model.config, 2, 64, page_size=PAGE)
    _run(model, cropped, ids, mask, torch.cat([feed[:steps], feed[steps + 1:]]))  # other tokens, then undone
    cropped.crop(-2)
    assert _lengths(cropped) == _lengths(kept)
    assert cropped.get_seq_length() == ids.shape[1] + steps
    nxt = feed[steps:steps + 1]
    torch.testing.assert_close(_run_more(model, cropped, nxt), _run_more(model, kept, nxt), rtol=0, atol=0)


def _run_more(model, cache, tokens):
    with torch.no_grad():
        ones = torch.ones(tokens.shape[1], 1, dtype=torch.long)
        return model(input_ids=tokens[0][:, None], attention_mask=ones, past_key_values=cache,
                     use_cache=True).logits[:, -1]


def test_crop_forms_and_refusals(model):
    ids, mask = _batch(2)
    feed = torch.randint(3, 150, (4, 2), generator=torch.Generator().manual_seed(3))
    cache = M3PagedCache(model.config, 2, 64, page_size=PAGE)
    cache.crop(0)
    with pytest.raises(ValueError, match=r"fed 0 token slots per sequence; it cannot remove 3"):
        cache.crop(-3)
    _run(model, cache, ids, mask, feed)
    held = _lengths(cache)
    cache.crop(0)
    assert _lengths(cache) == held
    for bad, message in ((-(ids.shape[1] + 5), r"fed 41 token slots per sequence; it cannot remove 42"),
                         (1.5, r"expected an int"), (True, r"expected an int")):
        with pytest.raises(ValueError, match=message):
            cache.crop(bad)
        assert _lengths(cache) == held
    cache.crop(cache.slots_used + 4)  # the older form: keep at least what is held
    assert _lengths(cache) == held
    cache.crop(cache.slots_used - 1)  # the older form: keep this many slots
    lengths, slots = _lengths(cache)
    assert slots == held[1] - 1 and lengths == [n - 1 for n in held[0]]
    with pytest.raises(NotImplementedError, match=r"crop the whole cache"):
        cache.layers[0].crop(-1)
    assert cache.is_croppable


def test_the_deferred_check_is_on_for_the_paged_cache_on_cuda_only(model):
    check = generation.DeferredStopCheck
    paged = M3PagedCache(model.config, 1, 32)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert check.is_supported(cuda, paged, True, is_assistant=False)
    assert not check.is_supported(cuda, paged, True, is_assistant=True)
    assert not check.is_supported(cpu, paged, True, is_assistant=False)
    assert not check.is_supported(cuda, DynamicCache(), False, is_assistant=False)  # transformers' choice: MPS only
    assert check.is_supported(torch.device("mps"), None, False, is_assistant=False)


class _HostEvent:
    """An event for CPU tensors: a CPU op has finished when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


class _Tokens:
    """A streamer that keeps what it is given and how many forward passes had run then."""

    def __init__(self, forwards):
        self.puts, self.forwards, self.seen = [], forwards, []

    def put(self, value):
        self.puts.append(value.clone())
        self.seen.append(len(self.forwards))

    def end(self):
        self.puts.append("end")


def _generate(model, ids, mask, eos, deferred, monkeypatch):
    check = generation.DeferredStopCheck
    if deferred:
        def on_cpu_too(device, cache, cache_is_returned, is_assistant):
            return isinstance(cache, M3PagedCache) and not is_assistant

        monkeypatch.setattr(check, "is_supported", staticmethod(on_cpu_too))
        monkeypatch.setattr(generation.torch, "Event", _HostEvent)
    made = []  # the stop checks the loop made
    real_init = generation.StopCheck.__init__

    def spy(self, *args, **kwargs):
        made.append(type(self).__name__)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(generation.StopCheck, "__init__", spy)
    cache = M3PagedCache(model.config, ids.shape[0], ids.shape[1] + 12, page_size=PAGE)
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    streamer = _Tokens(forwards)
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False,
        pad_token_id=PAD, eos_token_id=eos, disable_compile=True, return_dict_in_generate=True,
        output_scores=True, streamer=streamer,
    )
    hook.remove()
    monkeypatch.undo()
    return out, _lengths(cache), streamer, made


def _eos_for_early_stop(model, ids, mask):
    """A token row 0 generates at its 4th step and row 1 not before: with it as EOS, row 0
    stops early and row 1 runs on."""
    with torch.no_grad():
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              pad_token_id=PAD, eos_token_id=None, disable_compile=True)
    new = free[:, ids.shape[1]:]
    for step in range(3, 10):
        token = int(new[0, step])
        if token not in new[0, :step].tolist() and token not in new[1, :step + 2].tolist():
            return token, new
    pytest.skip("no token ends row 0 early and row 1 later with this seed")


@pytest.mark.parametrize("stop", ["row0_early", "all_early", "first_token", "length"])
def test_the_deferred_loop_gives_the_checked_loop_result(model, monkeypatch, stop):
    ids, mask = _batch(4)
    eos, free = _eos_for_early_stop(model, ids, mask)
    if stop == "all_early":  # both rows end on their own tokens: the loop stops before max_new_tokens
        eos = [eos, int(free[1, 5])]
    elif stop == "first_token":  # every row ends on the prefill's token: no decode step runs
        eos = free[:, 0].tolist()
    elif stop == "length":
        eos = None
    with torch.no_grad():
        want, want_lengths, want_puts, checks = _generate(model, ids, mask, eos, False, monkeypatch)
        got, got_lengths, got_puts, deferred = _generate(model, ids, mask, eos, True, monkeypatch)
    # The prompt, then the prefill's token before any decode step ran (it is read at once);
    # the later tokens one step late.
    assert got_puts.seen[:2] == want_puts.seen[:2] == [0, 1]
    if stop != "first_token":
        assert got_puts.seen[2] == want_puts.seen[2] + 1
    assert checks == ["StopCheck"] and deferred == ["DeferredStopCheck"]
    assert torch.equal(got.sequences, want.sequences)
    if stop == "all_early":
        assert want.sequences.shape[1] < ids.shape[1] + 12
    assert len(got.scores) == len(want.scores) == want.sequences.shape[1] - ids.shape[1]
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if stop == "first_token":
        assert want.sequences.shape[1] == ids.shape[1] + 1
    assert got_lengths == want_lengths  # the step run past the stop was undone
    got_puts, want_puts = got_puts.puts, want_puts.puts
    assert len(got_puts) == len(want_puts) and got_puts[-1] == "end"
    for a, b in zip(got_puts[:-1], want_puts[:-1]):
        assert torch.equal(a, b)
