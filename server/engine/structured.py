"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) compiled into a
grammar, and per sequence a matcher that says which tokens may come next. torch-free.

The library is llguidance (bench/grammar_libs.py has the comparison with xgrammar behind the choice):
its compile is lazy and cheap (1-5 ms for our schemas, against xgrammar's 10-350 ms) and bounded by
its own limits (a grammar past them is an error after a bounded time, never a compile that cannot be
cancelled), each step's mask is bounded by its lexer fuel, and it needs neither transformers nor a
JIT. Compiling happens where requests are admitted (the server's tokenizer pool, never the step
loop); each compiled grammar is kept as a pristine matcher in a bounded LRU cache keyed by its
normalized text, and every sequence gets its own copy, advanced on the tokens it accepts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvpilot.server.engine.limits import RequestRejected
from kvpilot.server.engine.sampling_params import StructuredOutput

# JSON as Python's json.dumps writes it: ", " and ": " between items, no other whitespace. Flexible
# whitespace lets a small model write newlines and spaces until max_tokens instead of the value.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 512


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled constraint; `matcher()` gives a fresh matcher for one sequence."""

    kind: str
    pristine: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.pristine.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caches them, and fills token masks for a step's rows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int = 1,
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        # The model's vocabulary may be padded past the tokenizer's: masks cover every logit.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads=num_threads)
        self.cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.requests_by_kind: dict[str, int] = {}
        self.cache_hits = 0
        self.observe_compile: Callable[[float], None] = lambda seconds: None  # the server's histogram, when serving

    def compile(self, spec: StructuredOutput) -> Grammar:
        """The constraint's grammar, from the cache or compiled now (RequestRejected naming the
        request's field when it is not a valid constraint, or breaks the library's limits)."""
        key = (spec.kind, normalized(spec))
        with self.lock:
            self.requests_by_kind[spec.kind] = self.requests_by_kind.get(spec.kind, 0) + 1
            grammar = self.cache.get(key)
            if grammar is not None:
                self.cache.move_to_end(key)
                self.cache_hits += 1
                return grammar
        started = time.perf_counter()
        try:
            text = grammar_text(spec.kind, key[1])
        except Exception as e:  # noqa: BLE001 - the library's converters raise several types on bad input
            raise RequestRejected(f"{spec.param}: not a valid {spec.kind} constraint: {first_lines(str(e))}", spec.param) from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        self.observe_compile(time.perf_counter() - started)
        if matcher.is_error():
            raise RequestRejected(f"{spec.param}: not a valid {spec.kind} constraint: {first_lines(matcher.get_error())}", spec.param)
        grammar = Grammar(spec.kind, matcher)
        with self.lock:
            self.cache[key] = grammar
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return grammar

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], address: int, num_rows: int) -> None:
        """Write the allowed-token bitmasks of a step's constrained rows into host memory at `address`
        ([num_rows, mask_words] int32, bit t of a row: token t allowed). Each entry is (matcher, its
        first row, the tokens proposed for it): row first + j is the mask after the first j proposed
        tokens (speculative decoding), the matcher itself left where it was."""
        plain = [(m, first) for m, first, proposed in rows if not proposed]
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, address, self.mask_words * 4, num_rows)
        speculated = [row for row in rows if row[2]]
        if speculated:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(speculated, address, self.mask_words * 4, num_rows)


def normalized(spec: StructuredOutput) -> str:
    """The constraint as one canonical text (the cache key): JSON with sorted keys, or the text itself."""
    if spec.kind == "json":
        return json.dumps(spec.value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if spec.kind == "choice":
        return json.dumps(spec.value, ensure_ascii=False)
    return spec.value if spec.kind != "json_object" else ""


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a normalized constraint."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # One alternative per choice, each a Lark string literal (JSON's escapes are the same).
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text)))
    if kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "grammar":
        # Lark (llguidance's dialect); a GBNF grammar (llama.cpp's, rules written `name ::= ...`) is converted.
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    raise ValueError(f"unknown constraint kind {kind!r}")


def first_lines(message: str, lines: int = 6, chars: int = 600) -> str:
    return "\n".join(message.strip().splitlines()[:lines])[:chars]
