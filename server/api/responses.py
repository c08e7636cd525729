"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over the chat path.

A response request becomes a chat request — `instructions` a system message, `input` (text, or items:
messages, function calls and their outputs) the messages after the conversation `previous_response_id`
names, function tools and `tool_choice` the chat's, `text.format` its response_format,
`reasoning.effort` its reasoning_effort, `max_output_tokens` its max_completion_tokens — so admission,
limits, errors, tool-call parsing, reasoning parsers and constraints are the chat's own. The chat's
answer becomes output items (a reasoning item, a message with output_text, function_call items); its
stream becomes the documented event sequence (response.created, response.in_progress, for each output
item output_item.added, its content part or arguments added / delta / done, output_item.done, then
response.completed or response.incomplete), each event numbered (sequence_number).

With `store` (the default) a response is kept in this server's memory: its output and the conversation
that led to it, for `previous_response_id` and GET; the store is bounded in count, bytes and age (the
oldest go first: --responses-store-max-responses, --responses-store-max-bytes,
--responses-store-ttl-seconds). A response id is 128 random bits: holding it is what lets a client
read the response or continue from it (a tenant cannot enumerate another's). Behind kvpilot-gateway the
id also names the engine pod that stored it (a hash of its address: server/response_ids.py), so a
continuation goes back to that pod; if the pod is gone the id is unknown, a 404 that names it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvpilot.server.api.errors import APIError
from kvpilot.server.api.protocol import ChatCompletionRequest, JsonObject, Text, UnsupportedParameter, _Lenient, printable_name
from kvpilot.server.response_ids import new_response_id

# Sampling fields of vLLM's (and ours) beyond the Responses API's own, passed on to the chat request when set.
PASSED_ON = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "min_tokens",
             "priority", "skip_special_tokens")
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(_Lenient):
    model: Text | None = None
    input: Text | list[JsonObject]
    instructions: Text | None = None
    tools: list[JsonObject] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | JsonObject | None = None
    parallel_tool_calls: bool = True
    text: JsonObject | None = None
    reasoning: JsonObject | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Responses API fields this server does not implement: a 400 names them when set
    background: bool | None = None
    include: list[Text] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None

    def ignored_fields(self) -> list[str]:
        return [name for name in self.unknown_fields() if name not in PASSED_ON]

    def check_supported(self) -> None:
        if self.background:
            raise UnsupportedParameter("background", "responses are answered in the request")
        if self.truncation == "auto":
            raise UnsupportedParameter("truncation", "auto is not implemented: a conversation longer than the context is refused (disabled)")
        for name in ("top_logprobs", "max_tool_calls", "prompt", "conversation"):
            if getattr(self, name):
                raise UnsupportedParameter(name)
        other = sorted(set(self.include or ()) - {"reasoning.encrypted_content"})
        if other:  # encrypted reasoning: none here (reasoning items carry their text), and they come back as they went
            raise UnsupportedParameter("include", f"{printable_name(other[0])} is not available (reasoning.encrypted_content is accepted)")

    def chat_request(self, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this is (history: the messages of the conversation before it, without its
        instructions), and the conversation's messages after its input (what a response stored from it carries on)."""
        self.check_supported()
        conversation = history + input_messages(self.input)
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream, "temperature": self.temperature,
                                "top_p": self.top_p, "max_completion_tokens": self.max_output_tokens,
                                "parallel_tool_calls": self.parallel_tool_calls, "user": self.user}
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        response_format = chat_response_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        body.update({name: value for name, value in (self.model_extra or {}).items() if name in PASSED_ON})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate(body), conversation
        except ValidationError as e:  # named as the client sent it: the messages are its instructions and input
            first = e.errors()[0]
            loc = ["input" if p == "messages" else "max_output_tokens" if p == "max_completion_tokens" else str(p) for p in first["loc"]]
            raise APIError(400, f"{'.'.join(loc)}: {first['msg']}", loc[0] if loc else None) from None


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, or parts) as text; a part that is not text is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}]: content parts of type {printable_name(str(kind))} are not supported (input_text and "
                                "output_text are)", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: text is a user message; items are messages (roles user, system,
    developer, assistant), function_call items (an assistant's tool_calls, in the assistant message
    before them: a response's output sent back as input is one turn, as it was stored),
    function_call_output items (tool messages) and reasoning items (their text the next assistant
    message's reasoning_content, as a chat request carries it: templates such as Qwen3's keep it within
    a tool-calling turn); other item types are refused by name."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text: the next assistant message's reasoning_content (the template keeps or drops it)

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        return message

    for i, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: must be user, system, developer or assistant", "input")
            message = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise APIError(400, f"{where}: a function_call item needs call_id, name and arguments (strings)", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:  # one turn: the assistant's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output item needs call_id (a string)", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = [p.get("text") for p in item.get("content") or () if isinstance(p, dict)]
            reasoning += "".join(t for t in parts if isinstance(t, str))
        else:
            raise APIError(400, f"{where}: items of type {printable_name(str(kind))} are not supported (message, function_call, "
                                "function_call_output and reasoning are)", "input")
    return messages


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool ({"type": "function", "name", "description", "parameters", "strict"}) as the chat's."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: tools of type {printable_name(str(tool.get('type')))} are not supported (function is)", "tools")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise APIError(400, f"tools[{i}]: unknown field {printable_name(unknown[0])}", "tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise APIError(400, "tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format (text: none)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format: must be an object ({\"type\": \"text\" | \"json_object\" | \"json_schema\", ...})", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if "schema" not in fmt:
            raise APIError(400, "text.format: type json_schema needs schema", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"],
                                                        "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format: type {printable_name(str(fmt.get('type')))} is not supported (text, json_object and "
                        "json_schema are)", "text")


class ResponseStore:
    """Stored responses by id, oldest first: at most max_responses of them, max_bytes of JSON, each for
    ttl_seconds. A record: the response object and the conversation's messages after it, kept as JSON
    bytes (so the byte bound is what it holds). One queue for every client: a client storing many
    responses pushes out the oldest of anyone's; each record holds its whole conversation, so a long
    conversation costs each of its turns' records."""

    def __init__(self, max_responses: int, max_bytes: int, ttl_seconds: float):
        self.max_responses, self.max_bytes, self.ttl = max_responses, max_bytes, ttl_seconds
        # id -> (when stored, the record as JSON bytes: what max_bytes counts is what it holds)
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response: dict, conversation: list[dict]) -> None:
        blob = json.dumps([response, conversation]).encode()
        if len(blob) > self.max_bytes or self.max_responses == 0:
            return  # larger than the whole store: not kept (a later GET or continuation is a 404)
        self._records[response["id"]] = (time.monotonic(), blob)
        self.bytes += len(blob)
        self._trim()

    def get(self, response_id: str) -> tuple[dict, list] | None:
        self._trim()
        record = self._records.get(response_id)
        return tuple(json.loads(record[1])) if record else None

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is not None:
            self.bytes -= len(record[1])
        return record is not None

    def _trim(self) -> None:
        now = time.monotonic()
        while self._records:
            oldest_id, (stored, blob) = next(iter(self._records.items()))
            if len(self._records) <= self.max_responses and self.bytes <= self.max_bytes and now - stored <= self.ttl:
                return
            del self._records[oldest_id]
            self.bytes -= len(blob)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored here (never stored with store true, deleted, expired "
                         "from this server's bounded store, or stored by an engine pod that is gone)", param, "response_not_found")


class ResponsesServing:
    """The Responses API over OpenAIServing.chat, with this server's store."""

    def __init__(self, serving, store: ResponseStore):
        self.serving, self.store = serving, store

    def history(self, req: ResponsesRequest) -> list[dict]:
        if req.previous_response_id is None:
            return []
        found = self.store.get(req.previous_response_id)
        if found is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        return list(found[1])

    async def create(self, req: ResponsesRequest, chat: Callable[[ChatCompletionRequest], Awaitable[Any]]):
        """chat(chat request): the chat route's answer (a dict, or an EventSource when streaming)."""
        chat_req, conversation = req.chat_request(self.history(req))
        rid, created = new_response_id(), int(time.time())
        answer = await chat(chat_req)
        if isinstance(answer, dict):
            response = self._response(req, rid, created, *self._output(answer["choices"][0]), answer["usage"])
            self._keep(req, response, conversation)
            return response
        return type(answer)(self._events(req, rid, created, answer.events, conversation), answer.job_ids)

    def _keep(self, req: ResponsesRequest, response: dict, conversation: list[dict]) -> None:
        if req.store and response["status"] in ("completed", "incomplete"):
            self.store.put(response, conversation + output_messages(response["output"]))

    def _output(self, choice: dict) -> tuple[list[dict], str]:
        message = choice["message"]
        items = []
        if message.get("reasoning"):
            items.append(reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning"]))
        if message.get("content"):
            items.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"]))
        for call in message.get("tool_calls") or ():
            items.append(function_call_item(f"fc_{uuid.uuid4().hex}", call))
        if choice["finish_reason"] == "length" and items and items[-1]["type"] != "function_call":
            items[-1]["status"] = "incomplete"  # the length limit cut the item being written (OpenAI's status for it)
        return items, choice["finish_reason"]

    def _response(self, req: ResponsesRequest, rid: str, created: int, output: list[dict], finish_reason: str | None,
                  usage: dict | None, status: str | None = None) -> dict:
        incomplete = finish_reason == "length"
        # the reasoning's tokens: its text tokenized again (the engine counts the output's tokens, not their parts')
        reasoning_tokens = sum(len(self.serving.tokenizer.encode(part["text"], add_special_tokens=False)) for item in output
                               if item["type"] == "reasoning" for part in item["content"])
        return {
            "id": rid, "object": "response", "created_at": created, "status": status or ("incomplete" if incomplete else "completed"),
            "model": req.model or self.serving.model_name, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status is None else None,
            "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning, "metadata": req.metadata or {},
            "store": req.store, "truncation": "disabled", "background": False, "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage["completion_tokens"])}},
        }

    async def _events(self, req: ResponsesRequest, rid: str, created: int, chunks: AsyncIterator[str], conversation: list[dict]):
        """The chat stream's chunks as the Responses API's events."""
        numbers = iter(range(1 << 62))
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item whose text is streaming ...
        pieces: list[str] = []          # ... and its text so far
        finish_reason, usage = None, None

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers), **fields})}\n\n"

        def close(status: str = "completed") -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item = open_item, None
            index, part = len(output) - 1, item["content"][0]
            part["text"] = "".join(pieces)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            item["status"] = status
            if item["type"] == "reasoning":
                return [event("response.reasoning_text.done", **where, text=part["text"]), event("response.content_part.done", **where, part=part),
                        event("response.output_item.done", output_index=index, item=item)]
            return [event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                    event("response.content_part.done", **where, part=part), event("response.output_item.done", output_index=index, item=item)]

        def text(kind: str, delta: str) -> list[str]:
            nonlocal open_item
            events = []
            if open_item is None or open_item["type"] != kind:
                events += close()
                item = (reasoning_item(f"rs_{uuid.uuid4().hex}", "") if kind == "reasoning" else message_item(f"msg_{uuid.uuid4().hex}", ""))
                item["status"] = "in_progress"
                output.append(item)
                open_item = item
                pieces.clear()
                shown = {**item, "content": []}
                events += [event("response.output_item.added", output_index=len(output) - 1, item=shown),
                           event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1, content_index=0,
                                 part=dict(item["content"][0]))]
            pieces.append(delta)
            where = {"item_id": open_item["id"], "output_index": len(output) - 1, "content_index": 0}
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            return events + [event(name, **where, delta=delta, **({} if kind == "reasoning" else {"logprobs": []}))]

        try:
            yield event("response.created", response=self._response(req, rid, created, [], None, None, "in_progress"))
            yield event("response.in_progress", response=self._response(req, rid, created, [], None, None, "in_progress"))
            async for raw in chunks:
                body = raw.removeprefix("data: ").strip()
                if body == "[DONE]":
                    continue
                chunk = json.loads(body)
                if "error" in chunk:
                    error = chunk["error"]
                    yield event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
                    failed = self._response(req, rid, created, output, None, None, "failed")
                    # the Responses API's error codes: a full queue is its rate limit, anything else the server's
                    failed["error"] = {"code": "rate_limit_exceeded" if error.get("code") == "queue_full" else "server_error",
                                       "message": error.get("message")}
                    yield event("response.failed", response=failed)
                    return
                if chunk.get("usage") and not chunk["choices"]:
                    usage = chunk["usage"]
                    continue
                choice = chunk["choices"][0]
                delta = choice["delta"]
                for part in (["reasoning"] if delta.get("reasoning") else []) + (["message"] if delta.get("content") else []):
                    for e in text(part, delta["reasoning" if part == "reasoning" else "content"]):
                        yield e
                for call in delta.get("tool_calls") or ():
                    for e in close():
                        yield e
                    item = function_call_item(f"fc_{uuid.uuid4().hex}", call)
                    output.append(item)
                    index = len(output) - 1
                    yield event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                                arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=index, item=item)
                finish_reason = choice.get("finish_reason") or finish_reason
        finally:
            await chunks.aclose()  # a client that left ends the chat stream too (its engine requests are released)
        for e in close("incomplete" if finish_reason == "length" else "completed"):
            yield e
        response = self._response(req, rid, created, output, finish_reason, usage)
        self._keep(req, response, conversation)
        yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)

    def retrieve(self, response_id: str) -> dict:
        found = self.store.get(response_id)
        if found is None:
            raise not_found(response_id)
        return found[0]

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(item_id: str, call: dict) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a continuation puts after the conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message] if text or calls or reasoning else []

