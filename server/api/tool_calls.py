"""Tool calling: the formats models write calls in, and for each the prompt side (tools for the chat
template, or a system turn for templates that take none), the constraint that makes `required` and
named calls always parse and validate, the one that makes `auto` calls parse, and the parsers of the
output, whole and streamed. torch-free.

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2,
  Qwen3 and the models trained on Hermes' format);
- llama3_json: the whole output is `{"name": ..., "parameters": {...}}`, calls joined by `; `, after
  an optional `<|python_tag|>` (Llama 3.1/3.2's JSON tool calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from kvpilot.server.api.reasoning import partial_tag_suffix
from kvpilot.server.engine.sampling_params import StructuredOutput
from kvpilot.server.engine.structured import JSON_LAYOUT, closed_objects

PARSERS = ("hermes", "llama3_json")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                        # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for(name: str | None, chat_template: str | None) -> ToolFormat:
    """The format named, or (unset) the one the chat template writes: a template that writes
    `<|python_tag|>` or calls with "parameters" is Llama 3's, anything else gets Hermes'."""
    if name is None:
        template = chat_template or ""
        name = "llama3_json" if "<tool_call>" not in template and ("<|python_tag|>" in template or '"parameters"' in template) else "hermes"
    return {"hermes": Hermes, "llama3_json": Llama3Json}[name]()


def _arguments_object(value: dict[str, Any], key: str, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get(key, {}), dict):
        return None
    return ToolCall(value["name"], json.dumps(value.get(key, {}), ensure_ascii=False))


def _schema(functions: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The JSON of one call to any of the functions: its name, and under `key` arguments matching its
    parameters, their objects closed to unlisted keys as vLLM's default backend closes them (closed_objects).
    A parameters schema's `$defs`/`definitions` move to the root, where its `#/$defs/…` pointers
    resolve once it is nested in the call (pydantic writes a nested model so); a name two tools define
    differently is a 400."""
    shared: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    options = []
    for f in functions:
        parameters = dict(closed_objects(f.get("parameters") or {"type": "object", "properties": {}}))
        for section, defs in shared.items():
            moved = parameters.pop(section, None) or {}
            if not isinstance(moved, dict):
                raise ValueError(f"tools: {f['name']!r} parameters' {section} must be an object")
            for name, definition in moved.items():
                if defs.setdefault(name, definition) != definition:
                    raise ValueError(f"tools: the {section} entry {name!r} is defined differently by two tools ({f['name']!r} and another)")
        options.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                        "properties": {"name": {"const": f["name"]}, key: parameters}})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **{section: defs for section, defs in shared.items() if defs}, "x-guidance": JSON_LAYOUT}


class ToolFormat:
    name: str
    system_prompt: str     # for templates without a `tools` variable: {tools} is the listing

    def constraint(self, functions: list[dict[str, Any]], choice: str, parallel: bool) -> StructuredOutput:
        raise NotImplementedError

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, or None when there is none; the calls that parse)."""
        raise NotImplementedError

    def stream(self, names: set[str]) -> StreamParser:
        raise NotImplementedError

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (name + arguments object) as the model would have written them."""
        raise NotImplementedError


class StreamParser:
    """Splits streamed text into content deltas and whole calls; `calls`: how many so far. However the
    text is split into deltas, the content deltas join to the whole `parse`'s content ("" where it is
    None) and the calls are its calls."""

    calls: int

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
    # Hermes' wording, shortened.
    system_prompt = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. "
                     "You may call one or more functions to assist with the user query. Here are the available tools:\n<tools>\n{tools}\n"
                     "</tools>\nFor each function call, return a json object with the function name and arguments within "
                     '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

    def constraint(self, functions, choice, parallel):
        schema = _schema(functions, "arguments")
        if choice == "auto":  # free text; from an opening tag on, a call that parses (a lazy trigger)
            tag = llguidance.StructTag(trigger=self.OPEN, begin=self.OPEN + "\n", grammar=schema, end="\n" + self.CLOSE)
            return StructuredOutput("tool_calls", llguidance.StructTag.to_grammar([tag], assume_special=False), "tools")
        more = ' ("\\n" call)*' if parallel else ""
        lark = f"start: call{more}\ncall: {json.dumps(self.OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + self.CLOSE)}\n"
        return StructuredOutput("tool_calls", lark, "tools")

    def call(self, body: str, names: set[str]) -> ToolCall | None:
        try:
            return _arguments_object(json.loads(body), "arguments", names)
        except ValueError:
            return None

    def parse(self, text, names):
        calls, kept, start = [], [], 0
        for m in self.CALL.finditer(text):
            call = self.call(m.group(1), names)
            if call is None:  # not a call to one of the functions: it stays text
                continue
            calls.append(call)
            kept.append(text[start:m.start()])
            start = m.end()
        kept.append(text[start:])
        if not calls:
            return (text or None), calls
        # Whitespace between a call and the content's start or end goes with the call; the content's own
        # leading and trailing whitespace stays, since a stream has sent it before it can know of a later call.
        content = "".join(kept)
        if not kept[0].strip():
            content = content.lstrip()
        if not kept[-1].strip():
            content = content.rstrip()
        return (content or None), calls

    def stream(self, names):
        return HermesStream(self, names)

    def write_calls(self, calls):
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}\n{self.CLOSE}"
                         for c in calls)


class HermesStream(StreamParser):
    """Text that may be the start of a call is held back until it is one (a call) or cannot be (content).
    Whitespace is held back until the next content character or the end shows whether it touches a call
    at the content's start or end (dropped, as the whole parse drops it) or is the content's own."""

    def __init__(self, fmt: Hermes, names: set[str]):
        self.fmt, self.names, self.buffer, self.calls = fmt, names, "", 0
        self.spaces = ""              # whitespace since the last content character (or the start)
        self.begun = False            # a content character other than whitespace has been sent
        self.call_since = False       # a call since the last content character (or the start)

    def feed(self, delta, final=False):
        open_, close = self.fmt.OPEN, self.fmt.CLOSE
        self.buffer += delta
        content, calls = "", []
        while True:
            at = self.buffer.find(open_)
            if at < 0:
                keep = 0 if final else partial_tag_suffix(self.buffer, open_)
                content += self.text(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(close, at)
            if end < 0:
                content += self.text(self.buffer[:at])
                self.buffer = self.buffer[at:]
                if final:
                    content += self.text(self.buffer)
                    self.buffer = ""
                break
            call = self.fmt.call(self.fmt.CALL.fullmatch(self.buffer[at:end + len(close)]).group(1), self.names)
            if call is None:
                content += self.text(self.buffer[:end + len(close)])
            else:
                content += self.text(self.buffer[:at])
                calls.append(call)
                self.call_since = True
            self.buffer = self.buffer[end + len(close):]
        self.calls += len(calls)
        if final and not self.call_since:  # whitespace at the end that no call follows is content
            content, self.spaces = content + self.spaces, ""
        return content, calls

    def text(self, piece: str) -> str:
        """The content to send for text outside the calls: whitespace at its end is held back."""
        body = piece.rstrip()
        if not body:
            self.spaces += piece
            return ""
        out = self.spaces + body
        if not self.begun and self.call_since:  # the content starts after a call: the whitespace between goes with it
            out = out.lstrip()
        self.spaces, self.begun, self.call_since = piece[len(body):], True, False
        return out


class Llama3Json(ToolFormat):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    SEPARATOR = "; "
    system_prompt = ("You have access to the following functions:\n{tools}\nTo call functions, respond only with JSON of the form "
                     '{{"name": function name, "parameters": dictionary of argument name and its value}}; '
                     "separate several calls with \"; \". Otherwise answer in plain text.")

    def constraint(self, functions, choice, parallel):
        call = f"%json {json.dumps(_schema(functions, 'parameters'))}"
        calls = f"call ({json.dumps(self.SEPARATOR)} call)*" if parallel else "call"
        if choice == "auto":  # plain text that does not open with "{", or calls alone
            lark = f'start: calls | TEXT\ncalls: {calls}\ncall: {call}\nTEXT: /([^{{](.|\\n)*)?/\n'
        else:
            lark = f"start: {calls}\ncall: {call}\n"
        return StructuredOutput("tool_calls", lark, "tools")

    def split(self, text: str, names: set[str]) -> list[ToolCall] | None:
        """The calls the whole output is, or None when it is not calls."""
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return None
            call = _arguments_object(value, "parameters", names) or _arguments_object(value, "arguments", names)
            if call is None:
                return None
            calls.append(call)
            at = end
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            at = len(body) - len(rest)
        return calls

    def parse(self, text, names):
        calls = self.split(text, names)
        return (None, calls) if calls else ((text or None), [])

    def stream(self, names):
        return Llama3Stream(self, names)

    def write_calls(self, calls):
        return self.SEPARATOR.join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls)


class Llama3Stream(StreamParser):
    """An output that opens with `{` (or the python tag) may be calls: held back to the end, then
    emitted as calls or, if it is not calls, as content; any other output streams as content."""

    def __init__(self, fmt: Llama3Json, names: set[str]):
        self.fmt, self.names, self.buffer, self.calls, self.text = fmt, names, "", 0, None

    def feed(self, delta, final=False):
        self.buffer += delta
        if self.text is None:
            head = self.buffer.lstrip()
            maybe_calls = head.startswith("{") or head.startswith(self.fmt.TAG) or self.fmt.TAG.startswith(head)
            if maybe_calls and not final:
                return "", []
            if not maybe_calls:
                self.text = True  # plain text from here on
        if self.text:
            content, self.buffer = self.buffer, ""
            return content, []
        if not final:
            return "", []
        text, self.buffer = self.buffer, ""
        calls = self.fmt.split(text, self.names)
        self.calls += len(calls or [])
        return ("", calls) if calls else (text, [])


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_takes_tools: bool,
                      fmt: ToolFormat | None = None) -> list[dict[str, Any]]:
    """The messages as the chat template gets them. A template with a `tools` variable renders tools,
    assistant tool_calls and tool results itself (tool_calls' arguments as objects, as transformers
    passes them). For one without, the tools go in a system turn and calls and results are written
    into the text in the format's own syntax (Hermes' by default)."""
    fmt = fmt or Hermes()
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}} for c in m["tool_calls"]]
            if template_takes_tools:
                m["tool_calls"] = calls
            else:
                del m["tool_calls"]
                text = fmt.write_calls([c["function"] for c in calls])
                m["content"] = ((m.get("content") or "") + "\n" + text).lstrip("\n")
        if m["role"] == "tool" and not template_takes_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not template_takes_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out.insert(0, {"role": "system", "content": fmt.system_prompt.format(tools=listing)})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
