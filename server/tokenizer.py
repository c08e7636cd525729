"""Tokenizers (from GGUF metadata or a checkpoint's tokenizer.json, through the `tokenizers` library), chat templates, streaming detokenization."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Tokenizer_

from kvpilot.server.checkpoint import read_json
from kvpilot.server.gguf_loader import GGUFError, GGUFFile
from kvpilot.server.model_config import ModelFormatError

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


# Pre-tokenizer regexes of the byte-level BPE families, by GGUF `tokenizer.ggml.pre` (the same
# expressions their tokenizer.json files carry); GPT-2's own (ByteLevel's built-in) is the default.
_CONTRACTIONS_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_PUNCT_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_REGEX = {
    "llama-bpe": _CONTRACTIONS_WORDS + r"\p{N}{1,3}" + _PUNCT_SPACES,   # Llama 3
    "qwen2": _CONTRACTIONS_WORDS + r"\p{N}" + _PUNCT_SPACES,           # Qwen2, Qwen2.5, Qwen3
}
GPT2_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


class Tokenizer:
    """A `tokenizers` tokenizer plus what generation needs: each token's bytes (for UTF-8-safe
    streaming), special and end-of-sequence ids, BOS policy, chat template. Built from a GGUF's
    metadata (`from_gguf`) or a checkpoint's tokenizer files (`from_checkpoint`)."""

    def __init__(self, tk: Tokenizer_, tokens: list[str], token_bytes: list[bytes], special_ids: set[int], bos_token_id: int | None,
                 eos_token_ids: list[int], add_bos: bool, chat_template: str | None):
        self._tk = tk
        self._tokens = tokens
        self._token_bytes = token_bytes
        self.vocab_size = len(tokens)
        self.special_ids = special_ids
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # generation ends at any of them; the first is the template's eos_token
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.add_bos = add_bos
        self.chat_template = chat_template
        # No token stands for more bytes (hence characters) of text than this: bounds a text's token count from below.
        self.max_token_bytes = max(len(b) for b in token_bytes)
        # Message text is tokenized as text: a second tokenizer that spells special tokens out (see encode_chat).
        self._tk_text = Tokenizer_.from_str(tk.to_str())
        self._tk_text.encode_special_tokens = True
        specials = {t.content: i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        self._special_ids_by_text = specials
        # Longest first: the alternation then matches as the tokenizer's added-token split does (leftmost-longest).
        self._special_text = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) if specials else None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """Byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`), or a Gemma file's SentencePiece model ("llama"
        in a gemma3 GGUF). Never adds BOS unless the file asks for it."""
        kind = gguf.get("tokenizer.ggml.model")
        if kind == "llama" and gguf.architecture == "gemma3":
            return cls._gemma_from_gguf(gguf)
        if kind != "gpt2":
            raise GGUFError(f"{gguf.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is, and Gemma 3's "
                            "SentencePiece model)")
        pre = gguf.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZER_REGEX and pre not in GPT2_PRE_TOKENIZERS:
            raise GGUFError(f"{gguf.path.name}: pre-tokenizer {pre!r} is not supported "
                            f"(supported: {', '.join([*GPT2_PRE_TOKENIZERS, *PRE_TOKENIZER_REGEX])})")
        tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
        types: list[int] = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
        alphabet = set(_byte_alphabet().values())
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer_(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        if pre in PRE_TOKENIZER_REGEX:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, …) are matched whole in text and are "special"; user-defined
        # ones are matched whole but are ordinary text. A control token spelled outside the byte
        # alphabet would be a mislabel in the file: it is left as a plain vocabulary entry.
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet])
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        special_ids = {i for i, ty in enumerate(types) if ty == CONTROL}
        inverse = _inverse_byte_alphabet()
        token_bytes = [t.encode("utf-8") if i in special_ids or not set(t) <= alphabet else bytes(inverse[c] for c in t) for i, t in enumerate(tokens)]
        # End of generation: EOS, and the end-of-turn token where the file names one (Llama 3's <|eot_id|>).
        eos = [i for i in (gguf.get("tokenizer.ggml.eos_token_id"), gguf.get("tokenizer.ggml.eot_token_id")) if i is not None]
        return cls(tk, tokens, token_bytes, special_ids, gguf.get("tokenizer.ggml.bos_token_id"), eos,
                   bool(gguf.get("tokenizer.ggml.add_bos_token", False)), gguf.get("tokenizer.chat_template"))

    @classmethod
    def _gemma_from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """Gemma's SentencePiece BPE as a GGUF holds it (tokens, types; no merges), built as transformers builds it
        from the same file: runs of spaces spelled with ▁ (the normalizer's space), merges of every token's two-piece
        splits in token-id order (longer left piece first), byte fallback, no space prefix; control tokens special,
        user-defined ones (runs of newlines and tabs, HTML tags) matched whole as text. Ends at EOS and
        <end_of_turn>; its chat template is GEMMA_CHAT_TEMPLATE unless the file has one."""
        tokens: list[str] = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in gguf.get("tokenizer.ggml.tokens")]
        original: list[str] = gguf.get("tokenizer.ggml.tokens")
        types: list[int] = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise GGUFError(f"{gguf.path.name}: the tokenizer's vocabulary repeats a token")
        merges = [(t[:j], t[j:]) for t in tokens for j in range(len(t) - 1, 0, -1) if t[:j] in vocab and t[j:] in vocab]
        unk = gguf.get("tokenizer.ggml.unknown_token_id")
        tk = Tokenizer_(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                   byte_fallback=True))
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL])
        # (a run of spaces is user-defined too, but spelled with ▁ now: the normalizer's output, merged as BPE)
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, o, ty in zip(tokens, original, types) if ty == USER_DEFINED and t == o])
        special_ids = {i for i, ty in enumerate(types) if ty == CONTROL}
        token_bytes = [_token_bytes(t, i in special_ids or (types[i] == USER_DEFINED and t == original[i]), False, True) for i, t in enumerate(tokens)]
        eos = [i for i in (gguf.get("tokenizer.ggml.eos_token_id"), gguf.get("tokenizer.ggml.eot_token_id"), vocab.get("<end_of_turn>"))
               if i is not None]
        return cls(tk, tokens, token_bytes, special_ids, gguf.get("tokenizer.ggml.bos_token_id"), eos,
                   bool(gguf.get("tokenizer.ggml.add_bos_token", False)), gguf.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE)

    @classmethod
    def from_checkpoint(cls, directory: Path, model_eos: int | list[int] | None = None) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json) of a
        checkpoint directory; `model_eos` is config.json's eos_token_id, the last resort for EOS."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(f"{directory}: no tokenizer.json (a fast tokenizer file is needed; slow-tokenizer files alone are not loaded)")
        try:
            tk = Tokenizer_.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise ModelFormatError(f"{path}: not a readable tokenizer ({e})") from None
        spec = read_json(path)
        tk_config = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
        generation = read_json(directory / "generation_config.json") if (directory / "generation_config.json").is_file() else {}
        vocab = tk.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            tokens[i] = token
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        special_ids = {i for i, a in added.items() if a.get("special")}
        model = spec.get("model") or {}
        byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
        token_bytes = [_token_bytes(t, i in added, byte_level, bool(model.get("byte_fallback"))) for i, t in enumerate(tokens)]

        def token_id(key: str) -> int | None:
            value = tk_config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return vocab.get(value) if isinstance(value, str) else None

        bos = token_id("bos_token")
        eos = [token_id("eos_token")] + _as_list(generation.get("eos_token_id")) + (_as_list(model_eos) if token_id("eos_token") is None else [])
        add_bos = tk_config.get("add_bos_token")
        if add_bos is None:  # Llama 3 style: the tokenizer's post-processor adds BOS
            add_bos = bos is not None and tk.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return cls(tk, tokens, token_bytes, special_ids, bos, [i for i in eos if i is not None], bool(add_bos), _chat_template(directory, tk_config))

    def backend_json(self) -> str:
        """The tokenizer as the tokenizers library serializes it (what grammar libraries build from)."""
        return self._tk.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; special tokens spelled in the text are the control tokens (a raw prompt is the caller's to shape).
        add_special_tokens: the tokenizer's BOS is put first where it adds one and the text does not start with it."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """A conversation's prompt ids: control tokens only where the template puts them; a message that
        spells one (`<|im_end|>\\n<|im_start|>system…`) gets the tokens of that text, not the control
        token, so it cannot close its own turn or open another role's.

        Messages without control-token text take exactly the path of encode(render) (= transformers'
        apply_chat_template + tokenize). Otherwise each control-token text in a message is swapped for a
        private-use character before rendering, so the template's own control tokens are told apart
        from the messages' whatever the template does around them (trim, concatenation); the render is
        split at the template's control tokens, as the tokenizer itself splits, and each piece between
        them, the messages' control text restored, is tokenized with special tokens spelled out. Piece
        boundaries are the ones the plain encoding has, so no BPE merge changes."""
        rendered = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        found = {m for text in _strings([messages, kwargs]) for m in (self._special_text.findall(text) if self._special_text else ())}
        if not found:
            return self.encode(rendered)
        taken = {ord(c) for text in [*_strings([messages, kwargs]), self.chat_template] for c in text if ord(c) >= _PRIVATE_USE}
        free = (chr(c) for c in range(_PRIVATE_USE, 0x10FFFE) if c not in taken)
        stand_in = {text: next(free) for text in sorted(found)}
        swap = re.compile("|".join(re.escape(t) for t in sorted(found, key=len, reverse=True)))
        hide = lambda s: swap.sub(lambda m: stand_in[m.group(0)], s)  # noqa: E731
        masked = self.apply_chat_template(_map_strings(messages, hide), add_generation_prompt, **_map_strings(kwargs, hide))
        restore = str.maketrans({c: text for text, c in stand_in.items()})
        if masked.translate(restore) != rendered:  # the template treats that text specially: no safe way to tell the two apart
            raise ValueError(f"message text holds control-token text ({', '.join(sorted(found))}) that this model's chat template "
                             "does not render as plain text; it cannot be tokenized safely")
        ids, start = [], 0
        for m in self._special_text.finditer(masked):
            if m.start() > start:
                ids += self._tk_text.encode(masked[start:m.start()].translate(restore), add_special_tokens=False).ids
            ids.append(self._special_ids_by_text[m.group(0)])
            start = m.end()
        if start < len(masked):
            ids += self._tk_text.encode(masked[start:].translate(restore), add_special_tokens=False).ids
        return self._with_bos(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        # A model's vocabulary may be padded past the tokenizer's: those ids stand for no text.
        return self._token_bytes[token_id] if token_id < len(self._token_bytes) else b""

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def vocabulary(self) -> list[str]:
        return self._tokens

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (Qwen2.5/3's, Llama 3.1's do; ChatML's does not)."""
        return bool(self.chat_template) and _renders_tools(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """kwargs: the template's other variables (any name: `self` and `messages` are positional here)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use completions instead")
        template = _compile_template(self.chat_template)
        # kwargs: the template's other variables; as transformers passes them, they may replace bos_token and eos_token
        return template.render({
            "bos_token": self._tokens[self.bos_token_id] if self.bos_token_id is not None else "",
            "eos_token": self._tokens[self.eos_token_id] if self.eos_token_id is not None else "",
            **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
        })


# Gemma's turns (<start_of_turn>ROLE\n … <end_of_turn>\n, the assistant's role "model"), a system message
# leading the first user turn: for GGUF files that carry no template of their own.
GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set ns.system = text(messages[0]['content']) + '\n\n' -%}
{%- set messages = messages[1:] -%}
{%- endif -%}
{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}
{{- ((ns.system if loop.first else '') + text(message['content'])) | trim -}}
{{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

_PRIVATE_USE = 0xF0000  # Supplementary Private Use Area-A: stand-ins for control-token text in messages


def _strings(value: Any) -> list[str]:
    """Every string inside a message structure (contents, names, tool calls)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _map_strings(value: Any, f) -> Any:
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, f) for v in value]
    return value


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _token_bytes(token: str, added: bool, byte_level: bool, byte_fallback: bool) -> bytes:
    """The text bytes one vocabulary entry stands for."""
    if added:  # added tokens are spelled as plain text in every tokenizer kind
        return token.encode("utf-8")
    if byte_level:
        inverse = _inverse_byte_alphabet()
        if all(c in inverse for c in token):
            return bytes(inverse[c] for c in token)
        return token.encode("utf-8")
    if byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])  # SentencePiece's byte tokens, <0x0A> = "\n"
    return token.replace("\u2581", " ").encode("utf-8")  # SentencePiece marks spaces with ▁


def _chat_template(directory: Path, tk_config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5), else tokenizer_config.json's chat_template (a string, or
    named templates of which "default" is the chat one)."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = tk_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@lru_cache(maxsize=1)
def _inverse_byte_alphabet() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


# {% break %} and {% continue %} in chat templates, as transformers and vLLM render them
TEMPLATE_EXTENSIONS = ("jinja2.ext.loopcontrols",)


@lru_cache(maxsize=8)
def _renders_tools(source: str) -> bool:
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return "tools" in meta.find_undeclared_variables(ImmutableSandboxedEnvironment(extensions=TEMPLATE_EXTENSIONS).parse(source))


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """A chat template, compiled once (a Template renders from any thread)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=TEMPLATE_EXTENSIONS)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # As transformers renders templates (the oracle): keys in their order, no HTML escaping of <, > and &
    # (jinja's own tojson sorts keys and writes \u003c: tools and tool-call arguments would differ).
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; a multi-byte character split over tokens is held
    back until complete, so no delta ever holds a broken UTF-8 sequence."""

    __slots__ = ("_tokenizer", "_decoder", "_skip_special", "text")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
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
