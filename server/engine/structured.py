"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) compiled into a
grammar, and per sequence a matcher that says which tokens may come next. torch-free.

The library is llguidance (bench/grammar_libs.py has the comparison with xgrammar behind the choice):
its compile is lazy and cheap (1-5 ms for our schemas, against xgrammar's 10-350 ms) and bounded by
its own limits (a grammar past them is an error after a bounded time, never a compile that cannot be
cancelled), each step's mask is bounded by its lexer fuel, and it needs neither transformers nor a
JIT. Compiling happens where requests are admitted (the server's tokenizer pool, never the step
loop); each compiled grammar is kept as a pristine matcher in a bounded LRU cache keyed by its
normalized text, and every sequence gets its own copy, advanced on the tokens it accepts.

The library recurses in native code along a constraint's chains of definitions (a $ref chain of
objects took ~9 KB of stack a level, a chain of Lark rules ~3 KB), and a stack overflow there is a
SIGSEGV that takes the whole server down: on a thread's default 8 MiB, 950 chained schema definitions
or 2,800 chained rules did. So every compile runs on a thread of its own with COMPILE_STACK_BYTES of
stack (address space: only the pages a compile touches are memory), and a constraint whose chains could
be deeper than MAX_CONSTRAINT_DEPTH is refused before the library sees it (5,000 levels of 9 KB is a
sixth of that stack). tests/test_structured_outputs.py holds the shapes measured.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvpilot.server.engine.limits import RequestRejected
from kvpilot.server.engine.sampling_params import StructuredOutput

# JSON as Python's json.dumps writes it: ", " and ": " between items, no other whitespace. Flexible
# whitespace lets a small model write newlines and spaces until max_tokens instead of the value.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
T = TypeVar("T")
GRAMMAR_CACHE_SIZE = 512
COMPILE_STACK_BYTES = 256 << 20
MAX_CONSTRAINT_DEPTH = 5_000


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
        depth = chain_depth_bound(spec, key[1])
        if depth > MAX_CONSTRAINT_DEPTH:
            raise RequestRejected(f"{spec.param}: the {spec.kind} constraint may nest definitions up to {depth} deep (through its "
                                  f"references); at most {MAX_CONSTRAINT_DEPTH} are allowed", spec.param)
        try:
            text = on_deep_stack(lambda: grammar_text(spec.kind, key[1]))
        except Exception as e:  # noqa: BLE001 - the library's converters raise several types on bad input
            raise RequestRejected(f"{spec.param}: not a valid {spec.kind} constraint: {first_lines(str(e))}", spec.param) from None
        matcher = on_deep_stack(lambda: llguidance.LLMatcher(self.tokenizer, text, log_level=0))
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


_stack_size_lock = threading.Lock()


def on_deep_stack(fn: Callable[[], T]) -> T:
    """fn() on a new thread with COMPILE_STACK_BYTES of stack (its result or its exception here).
    threading.stack_size is process-wide: it is set only for the moment this thread is created."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((False, e))

    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="kvpilot-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def chain_depth_bound(spec: StructuredOutput, text: str) -> int:
    """An upper bound on the longest chain of nested definitions the library can follow in the
    constraint. A JSON schema: the longest path through its subschemas and $refs (a cycle of
    references counts all its members: its recursion is bounded by them). A grammar (Lark, GBNF, a
    tool-call grammar with %json schemas in it): its definitions plus its '{' (each subschema of an
    embedded schema has one), since no chain can visit one twice. A regex or a choice: its nesting
    is bounded by the library's own parsers."""
    if spec.kind == "json":
        return schema_depth_bound(spec.value)
    if spec.kind in ("grammar", "tool_calls"):
        return len(_DEFINITION.findall(text)) + text.count("{")
    return 0


# A Lark rule or terminal (`name:`, `?name:`, `name.2:`) or a GBNF rule (`name ::=`) at a line's start.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)


def schema_depth_bound(schema) -> int:
    """The longest path, in subschemas, from the root of a JSON schema through nested subschemas and
    local $refs ("#", "#/json/pointer"); a strongly connected set (recursive definitions) counts as
    all its members. A $ref this cannot resolve makes the bound the count of all subschemas."""
    import networkx as nx

    if not isinstance(schema, dict):
        return 0
    graph, stack, unresolved = nx.DiGraph(), [schema], False
    graph.add_node(id(schema))
    seen = {id(schema)}

    def visit(parent, child) -> None:
        graph.add_edge(id(parent), id(child))
        if id(child) not in seen:
            seen.add(id(child))
            stack.append(child)

    while stack:
        node = stack.pop()
        children = list(node.values())
        while children:  # through lists (allOf, prefixItems, ...) to the nested dicts
            child = children.pop()
            if isinstance(child, dict):
                visit(node, child)
            elif isinstance(child, list):
                children.extend(child)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve_pointer(schema, ref)
            if isinstance(target, dict):
                visit(node, target)
            else:
                unresolved = True
    if unresolved or graph.number_of_nodes() <= MAX_CONSTRAINT_DEPTH:
        return graph.number_of_nodes()
    condensed = nx.condensation(graph)
    longest: dict[int, int] = {}
    for component in reversed(list(nx.topological_sort(condensed))):
        longest[component] = len(condensed.nodes[component]["members"]) + max((longest[s] for s in condensed.successors(component)), default=0)
    return max(longest.values())


def _resolve_pointer(schema, ref: str):
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None
    node = schema
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


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
