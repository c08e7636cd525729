"""Tokenizer built from GGUF metadata with the `tokenizers` library, plus chat template and streaming detokenization."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvpilot.server.gguf_loader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class GGUFTokenizer:
    """Byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`). Never adds BOS unless the file asks for it."""

    def __init__(self, gguf: GGUFFile):
        kind = gguf.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{gguf.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
        tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
        types: list[int] = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
        alphabet = set(_byte_alphabet().values())
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, …) are matched whole in text and are "special"; user-defined
        # ones are matched whole but are ordinary text. A control token spelled outside the byte
        # alphabet would be a mislabel in the file: it is left as a plain vocabulary entry.
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet])
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        self._tk = tk
        self.vocab_size = len(tokens)
        self.special_ids = {i for i, ty in enumerate(types) if ty == CONTROL}
        self.bos_token_id = gguf.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = gguf.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = gguf.get("tokenizer.chat_template")
        self._tokens = tokens
        inverse = {c: b for b, c in _byte_alphabet().items()}
        self._token_bytes = [
            t.encode("utf-8") if i in self.special_ids or not set(t) <= alphabet else bytes(inverse[c] for c in t)
            for i, t in enumerate(tokens)
        ]
        # No token stands for more bytes (hence characters) of text than this: bounds a text's token count from below.
        self.max_token_bytes = max(len(b) for b in self._token_bytes)

    def encode(self, text: str) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use completions instead")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._tokens[self.bos_token_id] if self.bos_token_id is not None else "",
            eos_token=self._tokens[self.eos_token_id] if self.eos_token_id is not None else "", **kwargs,
        )


@lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; a multi-byte character split over tokens is held
    back until complete, so no delta ever holds a broken UTF-8 sequence."""

    __slots__ = ("_tokenizer", "_decoder", "_skip_special", "text")

    def __init__(self, tokenizer: GGUFTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_special = skip_special_tokens
        self.text = ""

    def add(self, token_id: int) -> str:
        if self._skip_special and token_id in self._tokenizer.special_ids:
            return ""
        delta = self._decoder.decode(self._tokenizer.token_bytes(token_id))
        self.text += delta
        return delta

    def flush(self) -> str:
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta
