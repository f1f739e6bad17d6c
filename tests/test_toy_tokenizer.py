"""m3_hf_attention.toy_tokenizer: the random checkpoints' byte-level BPE and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from m3_hf_attention.toy_tokenizer import CORPUS, build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-tokenizer")
    save_tokenizer(path, 512)
    return AutoTokenizer.from_pretrained(path)


def test_ids_of_the_special_tokens_are_the_toy_configs(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 3
    assert len(tokenizer) == 512


@pytest.mark.parametrize("text", [CORPUS, "naïve 東京 🙂 x" * 3, "zzz unseen words qqq", ""])
def test_any_text_round_trips_and_merges_shorten_it(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    if text == CORPUS:
        assert len(ids) < len(text.encode()) / 2  # merges, not bytes


def test_every_id_decodes(tokenizer):
    """A random model may emit any id: each one must decode (merges, bytes or fillers)."""
    for i in range(len(tokenizer)):
        assert isinstance(tokenizer.decode([i]), str)
    assert build_tokenizer(4096).get_vocab_size() == 4096


def test_chat_template_opens_the_assistant_turn(tokenizer):
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|im_start|>user\nHi</s>\n<|im_start|>assistant\n"


def test_too_small_a_vocabulary_is_refused():
    with pytest.raises(ValueError, match="must hold the 4 special tokens and the 256 bytes"):
        build_tokenizer(200)
