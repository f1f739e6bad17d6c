"""A real tokenizer for the random-weight M3 checkpoints of the example, the benchmarks and the
tests: byte-level BPE trained offline on a built-in text, with a chat template.

Random weights need no particular vocabulary, but a server does need a tokenizer: chat
requests go through the chat template, stop strings are matched on decoded text, and streamed
text is detokenized piece by piece. A byte-level BPE covers every input (any UTF-8 string
encodes, every id decodes) and its merges make multi-byte tokens, so streaming really has to
join pieces. It is built with the ``tokenizers`` library from :data:`CORPUS` and nothing else,
so two builds of the same size are the same tokenizer.

    from m3_hf_attention.toy_tokenizer import save_tokenizer
    save_tokenizer(checkpoint_dir, vocab_size=512)   # the model's vocab_size

Special tokens take the first ids, matching the toy configs: ``<pad>`` 0, ``<s>`` 1 (bos),
``</s>`` 2 (eos, which also closes every chat turn), then ``<|im_start|>`` 3.
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, TURN = "<pad>", "<s>", "</s>", "<|im_start|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, TURN)

# Each message: "<|im_start|>role\ncontent</s>\n"; a generation prompt opens the assistant's
# turn. The model ends its turn with eos, which is also generate()'s stop token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text: English prose, digits, punctuation, code and a few non-ASCII words, so that the
# merges include common words and the byte alphabet covers the rest.
CORPUS = """\
MiniMax M3 attends to a few selected blocks of its context. Each query scores the key blocks
with a small index branch, keeps the sixteen best blocks and its own local block, and runs
attention over those keys only. A long prompt therefore costs far less than dense attention.
The paged cache holds keys, values and index keys for every token, page by page, and a block
table maps each sequence to its pages. Requests arrive, wait, run and finish; the server frees
their pages and hands them to the next request in the queue.
What is the capital of France? Paris is the capital of France. What is two plus two? Four.
Hello! How can I help you today? Please write a short poem about the sea and the sky.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 32768 131072.
def attention(q, k, v):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v
{"role": "user", "content": "Summarize the report in three sentences."}
Café, naïve, Zürich, São Paulo, 東京, Москва, Αθήνα, emoji 🙂 and symbols: <>[]{}()=+-*/%&|^~!?
system user assistant system user assistant
"""

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "bu", "da", "fe", "go", "hi", "ju", "pe")


def _training_text() -> list[str]:
    """:data:`CORPUS` and made-up words of two and three syllables: enough distinct pairs for
    the merges to fill a vocabulary of a few thousand ids."""
    words = [a + b for a in _SYLLABLES for b in _SYLLABLES]
    words += [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES]
    lines = [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    # The prose outweighs the made-up words, so that its words merge first; the words, twice,
    # reach min_frequency and fill larger vocabularies.
    return [CORPUS] * 256 + lines * 2


def build_tokenizer(vocab_size: int):
    """The byte-level BPE of ``vocab_size`` ids (special tokens and the 256 bytes included),
    as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(
            f"toy tokenizer: vocab_size must hold the {len(SPECIAL_TOKENS)} special tokens and the "
            f"{len(alphabet)} bytes ({len(SPECIAL_TOKENS) + len(alphabet)}), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    # Every id the model can emit must decode: fill what the merges left with plain tokens.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|unused_{i}|>" for i in range(missing)])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)])
    return tok


def save_tokenizer(path: str | Path, vocab_size: int):
    """Write the toy tokenizer (``tokenizer.json``, its config and the chat template) into the
    checkpoint directory ``path``; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[TURN],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer
