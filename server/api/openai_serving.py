"""Completions and chat completions over the AsyncEngine: request -> engine streams -> OpenAI JSON / SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.server.api import tool_calls
from kvpilot.server.api.async_engine import AsyncEngine, EngineDeadError, Job, RequestFailedError, ServerShutdownError
from kvpilot.server.api.errors import APIError, param_of, sse_error, status_of
from kvpilot.server.api.protocol import StreamOptions, ToolUse
from kvpilot.server.api.reasoning import ReasoningParser
from kvpilot.server.api.tokenizer_pool import TokenizerPool
from kvpilot.server.engine.limits import Admission, RequestLimits
from kvpilot.server.engine.outputs import RequestOutput
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvpilot.server.api.constraint_compiles import ConstraintCompiles
    from kvpilot.server.engine.structured import Grammar

log = logging.getLogger("kvpilot.requests")


@dataclass
class RequestLog:
    """One structured line per request; never the prompt text."""

    request_id: str
    endpoint: str
    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None
    status: str = "ok"

    def emit(self) -> None:
        now = time.monotonic()
        log.info(json.dumps({"request_id": self.request_id, "endpoint": self.endpoint, "status": self.status,
                             "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                             "ttft_s": round(self.first_token - self.arrival, 4) if self.first_token else None,
                             "total_s": round(now - self.arrival, 4)}))


@dataclass(slots=True)
class EventSource:
    """A streaming answer: its SSE lines, and the engine requests to release when the response ends."""

    events: AsyncIterator[str]
    job_ids: list[str]


class ClientDisconnected(Exception):
    """The client closed the connection before a non-streaming response was ready."""


class OpenAIServing:
    """limits: the engine's (RequestLimits), with which every request is admitted before it is submitted."""

    generation_defaults: dict = {}  # --generation-config: request field -> default, for requests that do not set it

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, limits: RequestLimits, pool: TokenizerPool,
                 compiles: ConstraintCompiles | None, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.engine, self.tokenizer, self.model_name, self.limits, self.pool = engine, tokenizer, model_name, limits, pool
        self.compiles = compiles  # None: the engine takes no constraints (admission refuses them)
        self.tool_format = tool_calls.parser_for(tool_call_parser, tokenizer.chat_template)
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.max_model_len = limits.max_model_len
        self._token_texts: dict[int, str] = {}  # token id -> its text (_token_text): at most the vocabulary

    # --- shared -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.model_names():
            return model
        served = ", ".join(repr(n) for n in self.engine.model_names())
        raise APIError(404, f"the model '{model}' does not exist; this server serves {served}", "model", "model_not_found")

    def check_text_length(self, characters: int, param: str) -> None:
        """Every token covers at most max_token_bytes bytes: a text longer than the context could hold at
        that rate cannot fit, and is refused without tokenizing it (megabytes take seconds)."""
        if characters > self.max_model_len * self.tokenizer.max_token_bytes:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the {param} "
                                f"({characters} characters) is far longer", param, "context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; {param} has {len(ids)}",
                           param, "context_length_exceeded")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {self.tokenizer.vocab_size})", param)

    def prepare(self, prompt: str | list[int], params: SamplingParams, adapter: str | None, grammar: Grammar | None) -> Admission:
        """Tokenize, then admit with the engine's own limits, before anything is streamed (a refusal
        is a plain 400). Runs on the tokenizer pool (see jobs()): a long prompt must not stall the
        event loop."""
        if isinstance(prompt, str):
            self.check_text_length(len(prompt), "prompt")
            prompt = self.tokenizer.encode(prompt)
        default = self.generation_defaults.get("max_tokens")
        if params.max_tokens is None and default is not None:  # the model's max_new_tokens: a cap, as vLLM applies it
            params = dataclasses.replace(params, max_tokens=max(1, min(int(default), self.max_model_len - len(prompt))))
        return self.limits.admit(prompt, params, adapter, grammar)

    async def jobs(self, prompts: list[str | list[int]] | Callable[[], list[int]], params: SamplingParams, rid: str,
                   client: str, adapter: str | None = None) -> list[Job]:
        """One admitted engine request per prompt, tokenized on the tokenizer pool; `prompts` may be a
        function that makes one prompt's ids there (a chat's template and tokenization). The output
        constraint is compiled first, off that pool, as `client`'s (constraint_compiles.py)."""
        grammar = None
        if params.structured is not None and self.compiles is not None:
            grammar = await self.compiles.grammar(params.structured, client)

        def build():
            made = [prompts()] if callable(prompts) else prompts
            return [Job(f"{rid}-{i}", self.prepare(prompt, params, adapter, grammar)) for i, prompt in enumerate(made)]

        return await self.pool.run(build)

    # --- render: the requests a request becomes, not run (vLLM's /render endpoints) ---------------
    async def render(self, prompts: list[str | list[int]] | Callable[[], list[int]], params: SamplingParams, rid: str, client: str,
                     adapter: str | None, stream: bool, stream_options: StreamOptions | None) -> list[dict]:
        """Each prompt tokenized and admitted exactly as its request would be (the same template, limits
        and errors; a constraint compiled), not submitted: per prompt, vLLM's GenerateRequest (the token
        ids a router hashes, the sampling parameters as resolved: max_tokens the output limit)."""
        jobs = await self.jobs(prompts, params, rid, client, adapter)
        return [{"request_id": job.request_id, "token_ids": job.admission.prompt_token_ids, "features": None,
                 "sampling_params": _rendered_params(job.admission), "model": adapter or self.model_name, "stream": stream,
                 "stream_options": stream_options.model_dump(exclude_none=True) if stream and stream_options else None,
                 "cache_salt": None, "priority": params.priority,
                 "kv_transfer_params": dataclasses.asdict(params.kv_transfer) if params.kv_transfer else None} for job in jobs]

    async def render_completions(self, prompts: list[str | list[int]], params: SamplingParams, client: str, adapter: str | None,
                                 stream: bool, stream_options: StreamOptions | None) -> list[dict]:
        return await self.render(prompts, params, f"cmpl-{uuid.uuid4().hex}", client, adapter, stream, stream_options)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, params: SamplingParams, client: str,
                          tools: ToolUse | None, adapter: str | None, variables: dict[str, Any] | None, stream: bool,
                          stream_options: StreamOptions | None) -> dict:
        rendered = await self.render(lambda: self.chat_ids(messages, add_generation_prompt, tools, variables), params,
                                     f"chatcmpl-{uuid.uuid4().hex}", client, adapter, stream, stream_options)
        return rendered[0]

    # --- tokenizer endpoints ----------------------------------------------------------------------
    async def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None, add_generation_prompt: bool,
                       variables: dict[str, Any] | None = None, add_special_tokens: bool | None = None, return_token_strs: bool = False) -> dict:
        """vLLM's /tokenize. add_special_tokens (None: as the prompt's own endpoint tokenizes it): for a
        prompt, whether the tokenizer's BOS is put first (completions: true); for messages, whether it is
        put before what the chat template renders as well (chat: false, the ids a chat completion's prompt gets)."""
        def run() -> list[int]:
            if prompt is not None:
                self.check_text_length(len(prompt), "prompt")
                return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
            ids = self.chat_ids(messages, add_generation_prompt, variables=variables)
            bos = self.tokenizer.bos_token_id
            return [bos, *ids] if add_special_tokens and self.tokenizer.add_bos and bos is not None else ids

        ids = await self.pool.run(run)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if return_token_strs else None
        return {"tokens": ids, "token_strs": strs, "count": len(ids), "max_model_len": self.max_model_len}

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        token = lambda tid: tok.id_to_token(tid) if tid is not None else None  # noqa: E731
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(tok.bos_token_id), "eos_token": token(tok.eos_token_id),
                "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
                "model_max_length": self.max_model_len}

    async def detokenize(self, ids: list[int]) -> dict:
        self.check_token_ids(ids, "tokens")
        return {"prompt": await self.pool.run(lambda: self.tokenizer.decode(ids))}

    async def _merged(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Read several submitted engine requests at once and yield (job index, output) as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str):
            try:
                async for out in self.engine.stream(rid):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, job.request_id)) for i, job in enumerate(jobs)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()  # client gone or error: abort the engine requests still running
            await asyncio.gather(*tasks, return_exceptions=True)
            self.engine.release([job.request_id for job in jobs])

    def _token_text(self, token_id: int) -> str:
        """A token's text alone (logprobs name each token so): cached, as prompt logprobs name up to 21
        tokens per prompt position."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # --- completions ----------------------------------------------------------------------------
    def completion_logprobs(self, entries: list[dict[int, float]], token_ids: list[int], offset: int = 0) -> tuple[dict, int]:
        """The legacy logprobs object, text offsets counted from `offset`; and the offset after it."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = self._token_text(tid)
            tokens.append(text)
            token_lps.append(entry[tid] if entry is not None else None)  # None: an echoed prompt's first token
            tops.append({self._token_text(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])} if entry is not None else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat_logprobs(self, entries: list[dict[int, float]], token_ids: list[int], top_n: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self._token_text(tid)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": text, "logprob": entry[tid], "bytes": list(self.tokenizer.token_bytes(tid)),
                            "top_logprobs": [{"token": self._token_text(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))} for t, lp in top]})
        return {"content": content}

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
        """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache (or a tier)."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    def prompt_logprobs(self, entries: list[dict[int, float] | None], prompt_ids: list[int], top_n: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first has none), its logprob and the top_n ones,
        keyed by token id, each with its rank (1: the most likely; None for the prompt's own token when
        it is outside the top_n, whose rank the engine does not compute)."""
        out: list[dict | None] = []
        for tid, entry in zip(prompt_ids, entries):
            if entry is None:
                out.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            outside = len(entry) > top_n  # the prompt's token was added to the top_n
            out.append({str(t): {"logprob": lp, "rank": None if outside and t == tid else r, "decoded_token": self._token_text(t)}
                        for r, (t, lp) in enumerate(ranked, 1)})
        return out

    async def _collect(self, jobs, rlog: RequestLog, disconnected: Callable[[], Awaitable[None]]) -> dict[int, RequestOutput]:
        """Non-streaming: run every job to the end (the final output of each), unless the client
        leaves first: then the jobs are aborted and ClientDisconnected is raised."""
        finals: dict[int, RequestOutput] = {}

        async def gather() -> None:
            async for i, out in self._merged(jobs):
                rlog.first_token = rlog.first_token or time.monotonic()
                if out.finished:
                    finals[i] = out

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                rlog.status = "client_disconnected"
                raise ClientDisconnected()
            work.result()
        except ClientDisconnected:
            raise
        except BaseException:
            rlog.status = "error"
            raise
        finally:
            for t in (work, watch):
                t.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
            rlog.output_tokens = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
            rlog.emit()
        return finals

    async def _sse(self, jobs, rlog: RequestLog, render, base: dict, options: StreamOptions | None, preamble: list[dict] = (),
                   output_counts: bool = True) -> AsyncIterator[str]:
        """Streaming: one chunk per choice with news (text, tokens or the finish), then usage and [DONE].
        render(job index, output, choice, first new token index) -> chunk body. stream_options: usage
        at the end (include_usage), and in every chunk, that choice's so far (continuous_usage_stats).
        output_counts=False: the output tokens are not the answer's (echo with max_tokens 0)."""
        sent: dict[tuple[int, int], int] = {}
        cached: dict[int, int] = {}
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        try:
            for chunk in preamble:
                yield f"data: {json.dumps({**chunk, 'usage': self._usage(rlog.prompt_tokens, 0)} if continuous else chunk)}\n\n"
            async for i, out in self._merged(jobs):
                rlog.first_token = rlog.first_token or time.monotonic()
                cached[i] = out.num_cached_tokens
                for o in out.outputs:
                    start = sent.get((i, o.index), 0)
                    if not o.text_delta and not o.finish_reason and start == len(o.token_ids):
                        continue
                    sent[(i, o.index)] = len(o.token_ids)
                    chunk = render(i, out, o, start)
                    if continuous:
                        chunk["usage"] = self._usage(len(out.prompt_token_ids), len(o.token_ids) if output_counts else 0)
                    yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                usage = self._usage(rlog.prompt_tokens, sum(sent.values()) if output_counts else 0, sum(cached.values()))
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            rlog.status = "client_disconnected"
            raise
        except (EngineDeadError, RequestFailedError, ServerShutdownError, ValueError) as e:  # after the 200 went out: report in-stream
            rlog.status = "error"
            yield sse_error(status_of(e), str(e), param_of(e) if isinstance(e, ValueError) else None, getattr(e, "code", None))
            yield "data: [DONE]\n\n"
        finally:
            rlog.output_tokens = sum(sent.values())
            rlog.emit()

    async def completions(self, prompts: list[str | list[int]], params: SamplingParams, stream: bool, stream_options: StreamOptions | None,
                          disconnected: Callable[[], Awaitable[None]], client: str, adapter: str | None = None,
                          echo: bool = False, prompt_only: bool = False, show_prompt_logprobs: bool = False) -> dict | EventSource:
        """echo: each choice begins with its prompt (its text as given, a token-id prompt decoded; its
        logprobs too when logprobs are asked for, the first token having none); prompt_only (echo with
        max_tokens 0): the choice is the prompt alone. show_prompt_logprobs: vLLM's prompt_logprobs field."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = await self.jobs(prompts, params, rid, client, adapter)
        self.engine.submit(jobs)  # admission: a 429 or 400 here is a plain HTTP error, before any byte of a stream
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": adapter or self.model_name}
        rlog = RequestLog(rid, "completions", prompt_tokens=sum(len(j.admission.prompt_token_ids) for j in jobs))
        n = params.n
        offsets: dict[tuple[int, int], int] = {}  # streamed text_offset goes on from chunk to chunk
        begun: set[tuple[int, int]] = set()       # choices whose first chunk went out (streams)
        prompt_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if echo else []

        def choice(i: int, out: RequestOutput, o, text: str, token_ids: list[int], logprobs) -> dict:
            first = (i, o.index) not in begun
            begun.add((i, o.index))
            if prompt_only:
                text, token_ids, logprobs = "", [], [] if logprobs is not None else None
            if echo and first:  # the prompt goes first: in the whole answer, or in a stream's first chunk
                text = prompt_texts[i] + text
                if logprobs is not None:
                    token_ids, logprobs = out.prompt_token_ids + token_ids, (out.prompt_logprobs or [None]) + logprobs
            lp = None
            if logprobs is not None:
                lp, offsets[(i, o.index)] = self.completion_logprobs(logprobs, token_ids, offsets.get((i, o.index), 0))
            finish_reason, stop_reason = ("length" if o.finish_reason else None, None) if prompt_only else (o.finish_reason, o.stop_reason)
            body = {"index": i * n + o.index, "text": text, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason}
            if show_prompt_logprobs:
                body["prompt_logprobs"] = self.prompt_logprobs(out.prompt_logprobs or [None], out.prompt_token_ids, params.prompt_logprobs) if first else None
            return body

        if stream:
            def render(i, out, o, start):
                lp = o.logprobs[start:] if o.logprobs is not None else None
                return {**base, "choices": [choice(i, out, o, o.text_delta, o.token_ids[start:], lp)]}

            return EventSource(self._sse(jobs, rlog, render, base, stream_options, output_counts=not prompt_only), [j.request_id for j in jobs])
        finals = await self._collect(jobs, rlog, disconnected)
        choices = [choice(i, finals[i], o, o.text, o.token_ids, o.logprobs) for i in sorted(finals) for o in finals[i].outputs]
        usage = self._usage(rlog.prompt_tokens, 0 if prompt_only else rlog.output_tokens, sum(f.num_cached_tokens for f in finals.values()))
        return {**base, "choices": choices, "usage": usage, **_transfer(finals[0])}

    # --- chat ----------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: ToolUse | None = None,
                 variables: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt ids, message text tokenized as text (Tokenizer.encode_chat); tools
        rendered by the template when it takes them, else in a system turn (api/tool_calls.py);
        variables: the template's others (protocol.template_variables)."""
        self.check_text_length(len(json.dumps(messages)) + (len(json.dumps(tools.tools)) if tools else 0) + len(json.dumps(variables or {})),
                               "messages")
        takes_tools = self.tokenizer.template_takes_tools
        extra = {**(variables or {}), **({"tools": tools.tools} if tools and takes_tools else {})}
        try:
            return self.tokenizer.encode_chat(tool_calls.template_messages(messages, tools.tools if tools else None, takes_tools, self.tool_format),
                                              add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # template errors (e.g. raise_exception for a bad role order) are the client's
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, params: SamplingParams, stream: bool,
                   stream_options: StreamOptions | None, top_logprobs: int, disconnected: Callable[[], Awaitable[None]], client: str,
                   tools: ToolUse | None = None, adapter: str | None = None, variables: dict[str, Any] | None = None,
                   include_reasoning: bool = True) -> dict | EventSource:
        """tools: the request's tools (rendered into the prompt); unless tool_choice is none, calls in
        the output are returned as message.tool_calls / delta.tool_calls with finish_reason tool_calls.
        With a reasoning parser, the <think> block is `reasoning` and `reasoning_content` (vLLM's name
        since 0.11, and its older one: the same text) and only the rest is parsed; include_reasoning
        false drops it (null). variables: the chat template's other variables (chat_ids)."""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = await self.jobs(lambda: self.chat_ids(messages, add_generation_prompt, tools, variables), params, rid, client, adapter)
        self.engine.submit(jobs)
        created = int(time.time())
        rlog = RequestLog(rid, "chat.completions", prompt_tokens=len(jobs[0].admission.prompt_token_ids))

        def logprobs(o, start: int = 0):
            return self.chat_logprobs(o.logprobs[start:], o.token_ids[start:], top_logprobs) if o.logprobs is not None else None

        parsing = tools if tools and tools.calls else None
        # A constrained output is the constraint's from its first token: it holds no <think> block (auto
        # tool calls excepted: free text until a call).
        thinking = self.reasoning if params.structured is None or (tools and tools.choice == "auto") else None
        if stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": adapter or self.model_name}
            # the role comes first, as OpenAI sends it; content null when the output is calls alone
            # (tool_choice required or a named function)
            opening = None if tools and tools.choice not in ("auto", "none") else ""
            preamble = [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": opening}, "logprobs": None, "finish_reason": None}]}
                        for i in range(params.n)]
            calls_seen = dict.fromkeys(range(params.n), 0)
            splitters = {i: thinking.stream() for i in range(params.n)} if thinking else {}
            parsers = {i: self.tool_format.stream(parsing.names) for i in range(params.n)} if parsing else {}

            def render(i, out, o, start):
                ended = o.finish_reason is not None
                thought, text = splitters[o.index].feed(o.text_delta, final=ended) if splitters else ("", o.text_delta)
                text, calls = parsers[o.index].feed(text, final=ended) if parsing else (text, [])
                held = bool(parsing or splitters)
                delta = {"content": text} if text or not (ended or held) else {}  # held-back text is not an empty content
                if thought and include_reasoning:
                    delta["reasoning"] = delta["reasoning_content"] = thought
                if calls:
                    delta["tool_calls"] = [{"index": calls_seen[o.index] + k, **c.message()} for k, c in enumerate(calls)]
                    calls_seen[o.index] += len(calls)
                return {**base, "choices": [{"index": o.index, "delta": delta, "logprobs": logprobs(o, start),
                                             "finish_reason": finish(o.finish_reason, calls_seen[o.index] > 0), "stop_reason": o.stop_reason}]}

            return EventSource(self._sse(jobs, rlog, render, base, stream_options, preamble), [j.request_id for j in jobs])
        final = (await self._collect(jobs, rlog, disconnected))[0]
        choices = []
        for o in final.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": o.text}
            if self.reasoning:
                thought, message["content"] = thinking.split(o.text) if thinking else (None, o.text or None)
                message["reasoning"] = message["reasoning_content"] = thought if include_reasoning else None
            calls = []
            if parsing and message["content"]:
                message["content"], calls = self.tool_format.parse(message["content"], parsing.names)
                if calls:
                    message["tool_calls"] = [c.message() for c in calls]
            choices.append({"index": o.index, "message": message, "logprobs": logprobs(o),
                            "finish_reason": finish(o.finish_reason, bool(calls)), "stop_reason": o.stop_reason})
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": adapter or self.model_name,
                  "choices": choices, "usage": self._usage(rlog.prompt_tokens, rlog.output_tokens, final.num_cached_tokens), **_transfer(final)}
        if params.prompt_logprobs is not None:  # vLLM's, beside the choices
            answer["prompt_logprobs"] = self.prompt_logprobs(final.prompt_logprobs or [None], final.prompt_token_ids, params.prompt_logprobs)
        return answer


def _rendered_params(admission: Admission) -> dict:
    """A request's sampling parameters as /render shows them (vLLM's field names where they differ)."""
    p = admission.params
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("structured", "kv_transfer")}
    out["max_tokens"] = admission.max_output_tokens
    out["structured_outputs"] = {p.structured.kind: p.structured.value} if p.structured is not None else None
    return out


def _transfer(output) -> dict:
    """A prefill request's answer carries what its decode request passes on (vLLM's field)."""
    return {"kv_transfer_params": output.kv_transfer_params} if output.kv_transfer_params is not None else {}


def finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: tool_calls when the output ended by itself after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason
