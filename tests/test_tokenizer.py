"""The GGUF tokenizer equals HF's tokenizer for the same file; chat template; UTF-8-safe streaming."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

TEXTS = [
    "Hello, world!",
    "  two leading spaces, then   three, then a tab\tand\nnewlines\n\n\n",
    "naïve café, Straße, 日本語のテキスト, Ελληνικά, עברית, emoji 🙂🚀👩‍👩‍👧",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12345))",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Numbers: 3.14159, 1,000,000 and 2024-11-22T10:00:00Z",
    "don't won't I'LL we're they've",
    "{\"json\": [1, 2, {\"k\": null}], \"url\": \"https://example.com/a?b=c&d=e\"}",
    "<|endoftext|>text after the end marker",
    "\u200b zero-width and \u00a0 non-breaking spaces",
    "",
]


@pytest.fixture(scope="module")
def tok(gguf_file):
    from kvpilot.server.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_file)


@pytest.fixture(scope="module")
def hf_tok(hf_oracle_session):
    return hf_oracle_session.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_to_hf(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text).input_ids
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids) == text


def test_never_prepends_bos(tok):
    assert tok.add_bos is False
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.encode("hello")[0] != 1
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>user") [0] == 1
    assert tok.encode("x<|im_end|>")[-1] == 2


def test_chat_template_equal_to_hf(tok, hf_tok):
    conversations = [
        [{"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_detokenization_reassembles_text(tok, text):
    from kvpilot.server.tokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    deltas = [d.add(t) for t in tok.encode(text)] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_streaming_holds_back_split_characters(tok):
    """A character spread over several byte tokens appears only once complete."""
    from kvpilot.server.tokenizer import IncrementalDetokenizer

    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji is split into byte tokens in this vocabulary
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🙂"


def test_skip_special_tokens_in_stream(tok):
    from kvpilot.server.tokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(d.add(t) for t in tok.encode("a<|im_end|>b")) == "ab"


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_text_roundtrips_and_streams_cleanly(tok, text):
    from kvpilot.server.tokenizer import IncrementalDetokenizer, _byte_alphabet

    # This vocabulary has no token for a few bytes (e.g. 0xF1, lead byte of planes 4-7): text using
    # them cannot be represented by any tokenizer of this model, HF's included.
    vocab = set(tok._tokens)
    assume("\ufffd" not in text and all(_byte_alphabet()[b] in vocab for b in text.encode()))
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    deltas = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)


def test_sentencepiece_style_checkpoint_tokenizer_streams_the_same_text(tmp_path):
    """A Llama 2 / Mistral-style tokenizer.json (BPE over ▁-marked text with <0xNN> byte fallback, no
    byte-level alphabet): each generated token's bytes, streamed, add up to what the tokenizer itself
    decodes after a prompt token, multi-byte characters split over byte tokens included."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    from kvpilot.server.tokenizer import IncrementalDetokenizer, Tokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "llo", "▁hello", "▁world"]
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    pieces += [a + b for a, b in merges if a + b not in pieces]
    tk = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(["<s>", "</s>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
    tok = Tokenizer.from_checkpoint(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), True)
    text = "hello world é日 hello"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[1:] == tk.encode(text, add_special_tokens=False).ids
    assert any(3 <= i < 259 for i in ids)  # é and 日 went through byte fallback
    d = IncrementalDetokenizer(tok)
    streamed = "".join(d.add(t) for t in ids[2:]) + d.flush()
    assert streamed == tk.decode(ids[1:])[len(tk.decode(ids[1:2])):]  # what follows the first word
    assert streamed == " world é日 hello"
