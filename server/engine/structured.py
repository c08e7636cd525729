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
or 2,800 chained rules did. So every compile runs on one of a few threads with COMPILE_STACK_BYTES of
stack (address space: only the pages a compile touches are memory), and a constraint whose chains could
be deeper than MAX_CONSTRAINT_DEPTH is refused before the library sees it (5,000 levels of 9 KB is a
sixth of that stack). tests/structured_corpus.py has the shapes measured.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvpilot.server.engine.limits import RequestRejected
from kvpilot.server.engine.sampling_params import StructuredOutput

# JSON as Python's json.dumps writes it: ", " and ": " between items, no other whitespace. Flexible
# whitespace lets a small model write newlines and spaces until max_tokens instead of the value.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 512
COMPILE_STACK_BYTES = 256 << 20
COMPILE_THREADS = 2            # compiles at once in a process (as many as the server's tokenizer pool runs by default)
MAX_CONSTRAINT_DEPTH = 5_000
MAX_SCHEMA_OBJECTS = 50_000    # objects in one JSON schema: the library refuses ~40,000 subschemas as too large anyway
# The library fails a sequence, mid-generation, once one parser row holds more than ROW_ITEMS items
# (its max_items_in_row; raising it made a 10,000-property schema cost 0.57 s a mask). Rows grow with
# what may come next at one point, so the constructs that widen them are refused up front instead:
ROW_ITEMS = 2_000
MAX_ALTERNATIVES = ROW_ITEMS - 1          # anyOf/oneOf branches, non-string enum values, a grammar's `|`s
MAX_OPTIONAL_PROPERTIES = (ROW_ITEMS - 8) // 4  # a row held 4n + 7 items for n optional properties
MAX_PATTERN_PROPERTIES = 64               # compile time grows steeply with them: 200 took 0.8 s, 400 took 12 s
# A compile ends by computing the first token mask (off the step loop: the library builds its lexer's
# states there, and every sequence's copy shares them): a constraint whose first mask costs more than
# this is refused, and one whose masks cost past the engine's bound later is refused from then on.
FIRST_MASK_BOUND_S = 0.1
TIMED_STEPS = 32                          # steps that time each row once a step's masks were slow (fill_masks)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Keyed:
    """A constraint with its normalized text and its cache key: a digest, not the text (a cache of
    4 MiB constraints would hold GBs). Made once per request (~20 ms a MiB), off the event loop."""

    spec: StructuredOutput
    text: str
    key: tuple[str, bytes]


def keyed(spec: StructuredOutput) -> Keyed:
    text = normalized(spec)
    return Keyed(spec, text, (spec.kind, hashlib.sha256(text.encode()).digest()))


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled constraint; `matcher()` gives a fresh matcher for one sequence."""

    kind: str
    pristine: llguidance.LLMatcher
    key: tuple[str, bytes]

    def matcher(self) -> llguidance.LLMatcher:
        return self.pristine.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caches them, and fills token masks for a step's rows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int = 1,
                 mask_budget_s: float = 0.003, cache_size: int = GRAMMAR_CACHE_SIZE):
        # The model's vocabulary may be padded past the tokenizer's: masks cover every logit.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads=num_threads)
        self.mask_budget_s = mask_budget_s
        self.timed_steps_left = 0            # fill_masks: steps that still time each row (see there)
        self.cache: OrderedDict[tuple[str, bytes], Grammar | str] = OrderedDict()  # a grammar, or why it is refused
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.requests_by_kind: dict[str, int] = {}
        self.cache_hits = 0
        self.observe_compile: Callable[[float], None] = lambda seconds: None  # the server's histogram, when serving

    def compile(self, spec: StructuredOutput) -> Grammar:
        """The constraint's grammar, from the cache or compiled now (RequestRejected naming the
        request's field when it is not a valid constraint or breaks the library's limits). A refusal
        is cached as a grammar is: a retry costs no second compile."""
        constraint = keyed(spec)
        return self.lookup(constraint) or self.compile_new(constraint)

    def lookup(self, constraint: Keyed) -> Grammar | None:
        """The cached grammar (a cached refusal raised as RequestRejected), or None; counts a request."""
        spec = constraint.spec
        with self.lock:
            self.requests_by_kind[spec.kind] = self.requests_by_kind.get(spec.kind, 0) + 1
            compiled = self.cache.get(constraint.key)
            if compiled is None:
                return None
            self.cache.move_to_end(constraint.key)
            self.cache_hits += 1
        if isinstance(compiled, str):
            raise RequestRejected(f"{spec.param}: {compiled}", spec.param)
        return compiled

    def compile_new(self, constraint: Keyed) -> Grammar:
        """Compile (after a lookup that missed) and cache the grammar or the refusal."""
        started = time.perf_counter()
        compiled = self._compile(constraint)
        self.observe_compile(time.perf_counter() - started)
        with self.lock:
            self.cache[constraint.key] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        if isinstance(compiled, str):
            raise RequestRejected(f"{constraint.spec.param}: {compiled}", constraint.spec.param)
        return compiled

    def refuse(self, key: tuple[str, bytes], reason: str) -> None:
        """From now on, refuse this constraint at admission: the engine ended a request of it for what
        its masks cost (in CPU time), and sending it again must not cost the steps again."""
        with self.lock:
            self.cache[key] = reason

    def _compile(self, constraint: Keyed) -> Grammar | str:
        """The grammar, or why the constraint is refused."""
        spec, text, kind = constraint.spec, constraint.text, constraint.spec.kind
        too_deep = depth_problem(spec, text)  # before a GBNF grammar's conversion: a 6,000-rule one's took 13 s
        if too_deep:
            return too_deep
        if kind == "grammar":  # Lark (llguidance's dialect), or a GBNF grammar (llama.cpp's, `name ::= ...`) converted
            try:
                text, kind = any_to_lark(text), "lark"
            except Exception as e:  # noqa: BLE001 - the converter raises several types on bad input
                return f"not a valid grammar constraint: {first_lines(str(e))}"
        if kind in ("lark", "tool_calls"):
            alternatives = count_alternatives(text)
            if alternatives > MAX_ALTERNATIVES:
                return (f"the {spec.kind} constraint has {alternatives} alternatives ('|', and the '?', '*', '+' and '[' that make "
                        f"one); at most {MAX_ALTERNATIVES} are allowed (the grammar library's parser rows)")
        matcher = deep_stack_threads().run(lambda: self._matcher(kind, text))
        if isinstance(matcher, str):
            return f"not a valid {spec.kind} constraint: {first_lines(matcher)}"
        started = time.thread_time()  # CPU time: waiting for the GIL must not refuse a constraint
        matcher.compute_bitmask()  # on this thread; leaves the matcher where it is
        cost = time.thread_time() - started
        if matcher.is_error():
            return f"the {spec.kind} constraint fails at its first token: {first_lines(matcher.get_error())}"
        if cost > FIRST_MASK_BOUND_S:
            return (f"the {spec.kind} constraint's first token mask took {cost * 1000:.0f} ms to compute; at most "
                    f"{FIRST_MASK_BOUND_S * 1000:g} ms are allowed")
        return Grammar(spec.kind, matcher, constraint.key)

    def _matcher(self, kind: str, text: str) -> llguidance.LLMatcher | str:
        """The compiled matcher, or the library's reason for refusing the text."""
        try:
            grammar = grammar_text(kind, text)
        except Exception as e:  # noqa: BLE001 - the library's converters raise several types on bad input
            return str(e)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        return matcher.get_error() if matcher.is_error() else matcher

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], address: int, num_rows: int) -> list[float] | None:
        """Write the allowed-token bitmasks of a step's constrained rows into host memory at `address`
        ([num_rows, mask_words] int32, bit t of a row: token t allowed). Each entry is (matcher, its
        first row, the tokens proposed for it): row first + j is the mask after the first j proposed
        tokens (speculative decoding), the matcher itself left where it was.

        What each entry cost, in CPU seconds, when this step timed them, else None. The entries are
        filled in one call over the library's threads while that is cheap; once a step's masks take
        longer than mask_budget_s (one row's bound), the next TIMED_STEPS steps fill each entry in a
        call of its own on this thread and return its thread time (waiting for the GIL is not counted),
        so that the engine can end the rows whose masks cost past the bound (one 19-byte regex made
        every co-batched stream 3.7x slower)."""
        if self.timed_steps_left:
            self.timed_steps_left -= 1
            seconds = []
            for entry in rows:
                started = time.thread_time()
                self._fill([entry], address, num_rows)  # one entry: computed on this thread
                seconds.append(time.thread_time() - started)
            return seconds
        started = time.perf_counter()
        self._fill(rows, address, num_rows)
        if time.perf_counter() - started > self.mask_budget_s:
            self.timed_steps_left = TIMED_STEPS
        return None

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], address: int, num_rows: int) -> None:
        plain = [(m, first) for m, first, proposed in rows if not proposed]
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, address, self.mask_words * 4, num_rows)
        speculated = [row for row in rows if row[2]]
        if speculated:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(speculated, address, self.mask_words * 4, num_rows)


class DeepStackThreads:
    """COMPILE_THREADS threads with COMPILE_STACK_BYTES of stack each, started once, that run compiles.
    threading.stack_size is process-wide: it is changed only while they are created."""

    def __init__(self, count: int):
        self._jobs: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            for i in range(count):
                threading.Thread(target=self._work, name=f"{_THREAD_PREFIX}{i}", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[[], T]) -> Future:
        """fn() on one of the threads; the future of its result."""
        done: Future = Future()
        self._jobs.put((fn, done))
        return done

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on one of the threads (at once when called on one): its result, or its exception raised here."""
        if threading.current_thread().name.startswith(_THREAD_PREFIX):
            return fn()
        return self.submit(fn).result()

    def _work(self) -> None:
        while True:
            fn, done = self._jobs.get()
            if not done.set_running_or_notify_cancel():  # cancelled while it waited; once running it cannot be
                continue
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                done.set_exception(e)


_THREAD_PREFIX = "kvpilot-grammar-compile-"
_deep_stack_lock = threading.Lock()
_deep_stack_threads: DeepStackThreads | None = None


def deep_stack_threads() -> DeepStackThreads:
    """The process's compile threads (started on first use)."""
    global _deep_stack_threads
    with _deep_stack_lock:
        if _deep_stack_threads is None:
            _deep_stack_threads = DeepStackThreads(COMPILE_THREADS)
        return _deep_stack_threads


def depth_problem(spec: StructuredOutput, text: str) -> str | None:
    """Why the library could recurse too deep on the constraint (or, for a JSON schema, fail it
    mid-generation on a row too wide, or compile it for seconds), or None. A JSON schema: more than
    MAX_SCHEMA_OBJECTS objects, an object wider than the bounds above, or a longest path through its
    subschemas and $refs (a cycle of references counts all its members: its recursion is bounded by
    them) past MAX_CONSTRAINT_DEPTH. A grammar (Lark, GBNF, a tool-call grammar with %json schemas in
    it): more definitions plus '{'s (each subschema of an embedded schema has one) than
    MAX_CONSTRAINT_DEPTH, since no chain can visit one twice (its alternatives are counted once it is
    Lark: count_alternatives). A regex or a choice: its nesting is bounded by the library's own parsers."""
    if spec.kind == "json":
        depth = schema_depth_bound(spec.value)
        if isinstance(depth, str):
            return depth
        what = "its subschemas and $refs"
    elif spec.kind in ("grammar", "tool_calls"):
        depth, what = len(_DEFINITION.findall(text)) + text.count("{"), "its rules (and embedded schemas)"
    else:
        return None
    if depth <= MAX_CONSTRAINT_DEPTH:
        return None
    return f"the {spec.kind} constraint's chains through {what} could nest {depth} deep; at most {MAX_CONSTRAINT_DEPTH} are allowed"


def width_problem(node: dict) -> str | None:
    """Why one object of a JSON schema would widen the library's rows past their limit (or make its
    compile take seconds), or None."""
    properties = node.get("properties")
    if isinstance(properties, dict):
        required = node.get("required")
        optional = len(properties.keys() - set(required if isinstance(required, list) and all(isinstance(r, str) for r in required) else ()))
        if optional > MAX_OPTIONAL_PROPERTIES:
            return f"an object of the JSON schema has {optional} optional properties; at most {MAX_OPTIONAL_PROPERTIES} are allowed"
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) > MAX_PATTERN_PROPERTIES:
        return f"an object of the JSON schema has {len(patterns)} patternProperties; at most {MAX_PATTERN_PROPERTIES} are allowed"
    for key in ("anyOf", "oneOf", "enum"):
        branches = node.get(key)
        if isinstance(branches, list):
            # a string enum is one lexeme of alternatives for the library's lexer, not a row's items
            count = len(branches) if key != "enum" else sum(1 for b in branches if not isinstance(b, str))
            if count > MAX_ALTERNATIVES:
                return f"a {key} of the JSON schema has {count} branches; at most {MAX_ALTERNATIVES} are allowed"
    return None


# A Lark rule or terminal (`name:`, `?name:`, `name.2:`) or a GBNF rule (`name ::=`) at a line's start.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)
# What makes an alternative in a Lark grammar ('|', and '?', '*', '+', '[' each make an implicit one:
# group 1), passing over what may hold those characters: comments, string literals, regexes, a `?rule:`
# prefix (it inlines the rule), and %json schemas (their objects are bounded as a schema's are not).
_GRAMMAR_TOKEN = re.compile(r'//[^\n]*|"(?:\\.|[^"\\\n])*"|/(?:\\.|[^/\\\n])+/[imslux]*|^[ \t]*\?(?=\w)|%json\b|([|?*+\[])', re.M)


def count_alternatives(lark: str) -> int:
    """The alternatives a Lark grammar makes in all (what may come next at one point is among them);
    its embedded %json schemas are skipped."""
    count, at = 0, 0
    while match := _GRAMMAR_TOKEN.search(lark, at):
        at = match.end()
        if match.group(0) == "%json":
            at = _after_json_object(lark, at)
        elif match.group(1):
            count += 1
    return count


def _after_json_object(text: str, at: int) -> int:
    """Where the JSON object that starts at or after `at` ends (its braces balanced, strings skipped)."""
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if in_string:
            in_string, escaped = (not (c == '"' and not escaped)), (c == "\\" and not escaped)
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def schema_depth_bound(schema) -> int | str:
    """An upper bound on the longest path, in objects, from the root of a JSON schema through nested
    objects and local $refs ("#", "#/json/pointer"), a strongly connected set (recursive definitions)
    counting all its members; or why the schema is refused (past MAX_SCHEMA_OBJECTS objects, or an
    object too wide). A $ref this cannot resolve, or a nested $id (a resource whose refs resolve
    against its own base), makes the bound the count of all objects."""
    if not isinstance(schema, dict):
        return 0
    nodes: list[dict] = [schema]
    index = {id(schema): 0}
    edges: list[list[int]] = [[]]
    count_all = False
    for i, node in enumerate(nodes):  # grows while it runs: breadth first over every object
        count_all = count_all or (i > 0 and "$id" in node)
        too_wide = width_problem(node)
        if too_wide:
            return too_wide
        targets, children = [], list(node.values())
        while children:  # through lists (allOf, prefixItems, ...) to the nested objects
            child = children.pop()
            if isinstance(child, dict):
                targets.append(child)
            elif isinstance(child, list):
                children.extend(child)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve_pointer(schema, ref)
            if isinstance(target, dict):
                targets.append(target)
            else:
                count_all = True
        for target in targets:
            j = index.get(id(target))
            if j is None:
                if len(nodes) >= MAX_SCHEMA_OBJECTS:
                    return f"the JSON schema has more than {MAX_SCHEMA_OBJECTS} objects"
                j = index[id(target)] = len(nodes)
                nodes.append(target)
                edges.append([])
            edges[i].append(j)
    if count_all or len(nodes) <= MAX_CONSTRAINT_DEPTH:
        return len(nodes)
    return _longest_path(edges)


def _longest_path(edges: list[list[int]]) -> int:
    """The longest path in nodes from node 0 (every node reachable from it), a strongly connected set
    counting all its members: Tarjan's algorithm without recursion, then the longest path over the
    components, which it finds successors first."""
    n = len(edges)
    order, low, component = [-1] * n, [0] * n, [-1] * n
    on_stack, stack, components = [False] * n, [], []
    order[0], on_stack[0], visited = 0, True, 1
    stack.append(0)
    work = [(0, 0)]
    while work:
        v, k = work[-1]
        if k < len(edges[v]):
            work[-1] = (v, k + 1)
            w = edges[v][k]
            if order[w] < 0:
                order[w] = low[w] = visited
                visited += 1
                stack.append(w)
                on_stack[w] = True
                work.append((w, 0))
            elif on_stack[w]:
                low[v] = min(low[v], order[w])
            continue
        work.pop()
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[v])
        if low[v] == order[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack[w], component[w] = False, len(components)
                members.append(w)
                if w == v:
                    break
            components.append(members)
    longest = []
    for c, members in enumerate(components):
        after = max((longest[component[w]] for v in members for w in edges[v] if component[w] != c), default=0)
        longest.append(len(members) + after)
    return longest[component[0]]


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


# closed_objects: keywords that leave an object open to other keys; keywords whose subschemas are
# combined with the object they sit in (their properties count as its own); where subschemas sit.
_OPEN_KEYS = frozenset(("additionalProperties", "patternProperties", "unevaluatedProperties"))
_COMBINING_KEYS = frozenset(("allOf", "if", "then", "else", "not", "dependentSchemas", "dependencies"))
_BRANCHES = frozenset(("anyOf", "oneOf"))
_ADDS_PROPERTIES = _OPEN_KEYS | _COMBINING_KEYS | {"properties", "$ref"}    # a branch of an object's own anyOf/oneOf with these combines with it
_REF_COMBINED = _COMBINING_KEYS | _BRANCHES | {"properties", "patternProperties"}  # a $ref beside these combines with them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf")


def closed_objects(schema):
    """The JSON schema with each object subschema that lists `properties` and sets none of
    additionalProperties, patternProperties, unevaluatedProperties closed to other keys
    (`additionalProperties: false`). vLLM's default structured-output backend, xgrammar, compiles
    every JSON schema so (its compile_json_schema's strict_mode, on by default, allows no unlisted
    property); left open, a small model invents keys until max_tokens and its output is cut (a
    forced tool call from pydantic's schema came back as text).

    Closed through properties, patternProperties, additionalProperties, items, prefixItems, anyOf
    and oneOf subschemas and $defs/definitions targets; not where an object is combined with other
    subschemas whose properties count as its own: allOf parts (and if/then/else, not,
    dependentSchemas), an object beside a `$ref` or those, the anyOf/oneOf branches of an object
    with properties or a `$ref` of its own, and any target of a `$ref` from there. Closing each part
    alone would forbid the others' properties and make their combination unsatisfiable. The input
    is never changed (the result shares the subschemas it leaves as they are)."""
    if not isinstance(schema, dict):
        return schema
    mixed_in = _mixed_in_refs(schema)
    copies = {id(schema): dict(schema)}
    work = [(copies[id(schema)], "#")]
    while work:
        node, pointer = work.pop()
        own = "properties" in node or "$ref" in node
        branches = [b for k in ("anyOf", "oneOf") if own and isinstance(node.get(k), list) for b in node[k]]
        combined = "$ref" in node or not _COMBINING_KEYS.isdisjoint(node) or any(
            isinstance(b, dict) and not _ADDS_PROPERTIES.isdisjoint(b) for b in branches)
        if isinstance(node.get("properties"), dict) and not combined and pointer not in mixed_in and _OPEN_KEYS.isdisjoint(node):
            node["additionalProperties"] = False
        slots = [(node, key, f"{pointer}/{key}") for key in ("additionalProperties", "items") if isinstance(node.get(key), dict)]
        for key in _SCHEMA_MAPS + _SCHEMA_LISTS:
            value = node.get(key)
            if (key in ("anyOf", "oneOf") and own) or not isinstance(value, dict if key in _SCHEMA_MAPS else list):
                continue  # an object's own anyOf/oneOf branches are combined with it: left as they are
            value = node[key] = type(value)(value)
            names = value.keys() if isinstance(value, dict) else range(len(value))
            slots += [(value, name, f"{pointer}/{key}/{str(name).replace('~', '~0').replace('/', '~1')}") for name in names]
        for parent, slot, at in slots:
            sub = parent[slot]
            if isinstance(sub, dict):
                if id(sub) not in copies:
                    copies[id(sub)] = dict(sub)
                    work.append((copies[id(sub)], at))
                parent[slot] = copies[id(sub)]
    return copies[id(schema)]


def _mixed_in_refs(schema) -> set[str]:
    """The local $refs (as JSON pointers) that closed_objects must not close: those within subschemas
    combined with an object (see there)."""
    refs, seen, work = set(), set(), [(schema, False)]
    while work:
        node, mixed = work.pop()
        if (id(node), mixed) in seen:
            continue
        seen.add((id(node), mixed))
        if isinstance(node, list):
            work += [(v, mixed) for v in node if isinstance(v, (dict, list))]
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and (mixed or not _REF_COMBINED.isdisjoint(node)):
            refs.add(urllib.parse.unquote(ref))
        own = "properties" in node or "$ref" in node
        work += [(v, mixed or k in _COMBINING_KEYS or (own and k in _BRANCHES))
                 for k, v in node.items() if isinstance(v, (dict, list))]
    return refs


def normalized(spec: StructuredOutput) -> str:
    """The constraint as one canonical text (the cache key): JSON with sorted keys (a schema's objects
    closed first, closed_objects), or the text itself."""
    if spec.kind == "json":
        return json.dumps(closed_objects(spec.value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
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
    if kind in ("tool_calls", "lark"):  # lark: a grammar constraint already converted (GrammarCompiler._compile)
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "grammar":
        # Lark (llguidance's dialect); a GBNF grammar (llama.cpp's, rules written `name ::= ...`) is converted.
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    raise ValueError(f"unknown constraint kind {kind!r}")


def first_lines(message: str, lines: int = 6, chars: int = 600) -> str:
    return "\n".join(message.strip().splitlines()[:lines])[:chars]
