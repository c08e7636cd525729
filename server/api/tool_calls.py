"""Tool calling in the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what
Qwen2/Qwen3 and the models trained on it write): the prompt side (tools for the chat template, or a
system prompt for templates that take none), the constraint that makes `required` and named calls
always parse and validate, the structural tag that makes `auto` calls parse, and the parsers of the
output, whole and streamed. torch-free."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from kvpilot.server.engine.sampling_params import StructuredOutput
from kvpilot.server.engine.structured import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)

# For chat templates without a `tools` variable (the bundled SmolLM2's is plain ChatML): the tools and
# the format, in a system turn of their own before the conversation's (Hermes' wording, shortened).
SYSTEM_PROMPT = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. "
                 "You may call one or more functions to assist with the user query. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
                 "For each function call, return a json object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
                 '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON of one call to any of the functions: its name and arguments matching its parameters."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object", "properties": {}}}}
               for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def constraint(functions: list[dict[str, Any]], choice: str, parallel: bool) -> StructuredOutput | None:
    """required / a named function: one call (or several, parallel) and nothing else; auto: free text,
    and from an opening tag on, a call that parses (a lazy trigger: the text before it is free)."""
    schema = call_schema(functions)
    if choice == "auto":
        tag = llguidance.StructTag(trigger=OPEN, begin=OPEN + "\n", grammar=schema, end="\n" + CLOSE)
        return StructuredOutput("tool_calls", llguidance.StructTag.to_grammar([tag], assume_special=False), "tools")
    more = ' ("\\n" call)*' if parallel else ""
    lark = f'start: call{more}\ncall: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}\n'
    return StructuredOutput("tool_calls", lark, "tools")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                        # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments", {}), dict):
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None when there is none; the calls that parse). A block that is
    not a call to one of the functions stays in the text."""
    calls, kept, start = [], [], 0
    for m in CALL.finditer(text):
        call = parse_call(m.group(1), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[start:m.start()])
        start = m.end()
    kept.append(text[start:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class StreamParser:
    """Splits streamed text into content deltas and whole calls: text that may be the start of a call
    is held back until it is one (emitted as a call) or cannot be (emitted as content)."""

    def __init__(self, names: set[str]):
        self.names, self.buffer, self.calls = names, "", 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            at = self.buffer.find(OPEN)
            if at < 0:
                keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, at)
            if end < 0:
                content += self.buffer[:at]
                self.buffer = self.buffer[at:]
                if final:
                    content += self.buffer
                    self.buffer = ""
                break
            block = self.buffer[at:end + len(CLOSE)]
            call = parse_call(CALL.fullmatch(block).group(1), self.names)
            if call is None:
                content += self.buffer[:end + len(CLOSE)]
            else:
                content += self.buffer[:at]
                calls.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]
        self.calls += len(calls)
        if self.calls and not final:
            content = content if content.strip() else ""  # the newlines between calls are not content
        return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_takes_tools: bool) -> list[dict[str, Any]]:
    """The messages as the chat template gets them. A template with a `tools` variable renders tools,
    assistant tool_calls and tool results itself (tool_calls' arguments as objects, as transformers
    passes them). For one without, the tools go in a system turn and calls and results are written
    into the text in the Hermes format."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}} for c in m["tool_calls"]]
            if template_takes_tools:
                m["tool_calls"] = calls
            else:
                del m["tool_calls"]
                text = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{CLOSE}"
                                 for c in calls)
                m["content"] = ((m.get("content") or "") + "\n" + text).lstrip("\n")
        if m["role"] == "tool" and not template_takes_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not template_takes_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out.insert(0, {"role": "system", "content": SYSTEM_PROMPT.format(tools=listing)})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
