"""After a step, everything that happens to the requests' outputs, in one place: tokens appended
(several at once when speculating, stopping at the first that ends the sequence), incremental
detokenizing, EOS / stop token ids / stop strings / the length limit, logprobs and prompt logprobs,
timings, and the RequestOutput handed back.

The output state of every sequence (OutputState: text, detokenizer, logprobs, timings, why it ended)
is owned here, keyed by request id; the scheduler's Sequence holds none of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.server.engine.scheduler import Scheduler
from kvpilot.server.engine.sequence import Sequence


@dataclass(slots=True)
class TextState:
    """One sequence's text: detokenized token by token, cut at the stop string it completes, and handed
    out in deltas that never end inside what could still become a stop string. The engine keeps one per
    sequence; with the engine core in its own process the API process does (engine_core.py)."""

    detokenizer: Any
    stops: list[str]
    include_stop: bool = False
    text: str = ""
    emitted_len: int = 0

    def add(self, token: int, check_stops: bool) -> str | None:
        """Append a token's text; the stop string it completes, if any (the text is cut there)."""
        old_len = len(self.text)
        self.detokenizer.add(token)
        self.text = self.detokenizer.text
        if check_stops and self.stops:
            hit = _find_stop(self.text, old_len, self.stops)
            if hit is not None:
                at, stop = hit
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                return stop
        return None

    def flush(self) -> None:
        """The sequence ended other than at a stop string: what the decoder still held back."""
        self.text += self.detokenizer.flush()

    def delta(self, finished: bool) -> str:
        """Text new since the last delta; while the sequence runs, text that could still turn out to
        be the start of a stop string is held back."""
        hold = 0 if finished else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.emitted_len, len(self.text) - hold)
        delta = self.text[self.emitted_len:end]
        self.emitted_len = end
        return delta


def stop_check_applies(token: int, num_output_tokens: int, params, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether a token's text is matched against the stop strings: not before min_tokens, and not when
    the token itself ends the sequence (EOS, a stop token id)."""
    if num_output_tokens < params.min_tokens:
        return False
    return not ((not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids)


@dataclass(slots=True)
class OutputState:
    """One sequence's output as the client sees it."""

    text: TextState | None                # None: the engine core hands out tokens, the API process the text
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None              # why it failed (finish_reason "error")


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    outputs: list[OutputState]            # per sequence, in the same order
    arrival_time: float
    scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # entry j: the token at j + 1
    kv_transfer_params: dict | None = None  # a prefill request's: where a decode engine pulls its blocks (kv_transfer.py)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], hold_blocks: Callable[[Sequence], dict] | None = None):
        """hold_blocks: a prefill request's sequence that ended well has its prompt's blocks held for a
        decode engine (before they are freed); it returns the params the output carries."""
        self.scheduler, self.eos_token_ids, self.hold_blocks = scheduler, eos_token_ids, hold_blocks
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence], detokenizer, arrival_time: float) -> None:
        """Start the output state of a request's sequences; detokenizer() makes one per sequence (None:
        no text here, the API process makes it from the tokens)."""
        p = seqs[0].params
        texts = [TextState(detokenizer(), p.stop, p.include_stop_str_in_output) if detokenizer else None for _ in seqs]
        self.requests[request_id] = Request(request_id, prompt, prompt_token_ids, seqs, [OutputState(t) for t in texts], arrival_time)

    def state(self, seq: Sequence) -> OutputState:
        return self.requests[seq.request_id].outputs[seq.index]

    def scheduled(self, seqs: list[Sequence], now: float) -> None:
        """A step was scheduled with these sequences: the first time a request's is, its queue time ends."""
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = now

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None, now: float) -> None:
        """Append tokens in order until one finishes the sequence; the ones after it are dropped."""
        out = self.state(seq)
        for i, token in enumerate(tokens):
            self._append_one(seq, out, token, logprobs[i] if logprobs is not None else None, now)
            if seq.is_finished:
                return

    def record_prompt_logprobs(self, seq: Sequence, first_pos: int, entries: list[dict[int, float]]) -> None:
        """The request's prompt logprobs, as its first sequence's prefill computes them (the others'
        prefills compute the same values, or skip cached spans)."""
        if seq.index != 0:
            return
        recorded = self.requests[seq.request_id].prompt_logprobs
        for j, entry in enumerate(entries):
            if first_pos + j >= len(recorded):  # recomputed after a preemption: already recorded
                recorded.append(entry)

    def _append_one(self, seq: Sequence, out: OutputState, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        p = seq.params
        seq.output_token_ids.append(token)
        if seq.guide is not None and not seq.guide.consume_token(token):
            # The mask allowed only tokens the constraint takes: this is the grammar library's own failure.
            raise StructuredOutputError(f"the output left its structured-output constraint: {seq.guide.get_error()[:300]}")
        if out.first_token_time is None:
            out.first_token_time = now
        out.last_token_time = now
        if logprobs is not None:
            out.logprobs.append(logprobs)
            out.cumulative_logprob += logprobs[token]
        reason, stop_reason = None, None
        stop = out.text.add(token, stop_check_applies(token, len(seq.output_token_ids), p, self.eos_token_ids)) if out.text else None
        enough = len(seq.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif enough and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif stop is not None:
            reason, stop_reason = "stop", stop
        if reason is None and seq.guide is not None and seq.guide.is_stopped():
            reason = "stop"  # the constraint is complete and takes nothing more
        if reason is None and seq.length_reached():
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str) and out.text:  # a stop string already cut the text
                out.text.flush()
            out.stop_reason = stop_reason
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End seq wherever it is (its blocks are freed at once) and record why and when."""
        if seq.is_finished:
            return
        transfer = seq.params.kv_transfer
        if reason in ("stop", "length") and transfer is not None and transfer.do_remote_decode and self.hold_blocks is not None:
            self.requests[seq.request_id].kv_transfer_params = self.hold_blocks(seq)
        self.scheduler.finish(seq)
        out = self.state(seq)
        out.finish_reason, out.error, out.finish_time = reason, error, time.monotonic()

    def abort(self, request_id: str) -> RequestOutput:
        for seq in self.requests[request_id].seqs:
            self.finish(seq, "abort")
        return self.request_output(request_id)

    def fail(self, request_id: str, message: str) -> RequestOutput:
        """End every sequence of a request with finish_reason "error" (blocks freed); its final output."""
        for seq in self.requests[request_id].seqs:
            self.finish(seq, "error", message)
        return self.request_output(request_id)

    def request_output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        outputs = []
        for seq, out in zip(req.seqs, req.outputs):
            delta = out.text.delta(seq.is_finished) if out.text else ""
            outputs.append(CompletionOutput(
                index=seq.index, text=out.text.text if out.text else "", token_ids=list(seq.output_token_ids), finish_reason=out.finish_reason,
                stop_reason=out.stop_reason, logprobs=list(out.logprobs) if seq.params.logprobs is not None else None,
                cumulative_logprob=out.cumulative_logprob if seq.params.logprobs is not None else None, text_delta=delta))
        finished = all(s.is_finished for s in req.seqs)
        first = req.seqs[0]
        metrics = RequestMetrics(req.arrival_time, req.scheduled_time, min((o.first_token_time for o in req.outputs if o.first_token_time), default=None),
                                 max((o.finish_time or 0 for o in req.outputs), default=None) if finished else None,
                                 first.num_cached_tokens, sum(s.num_preemptions for s in req.seqs))
        prompt_lp = ([None] + list(req.prompt_logprobs)) if first.params.prompt_logprobs is not None else None
        if finished:
            del self.requests[request_id]
        error = next((o.error for o in req.outputs if o.error), None)
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outputs, finished, prompt_lp, metrics, first.num_cached_tokens, error,
                             req.kv_transfer_params if finished else None)


class StructuredOutputError(RuntimeError):
    pass


def _find_stop(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        at = text.find(stop, max(0, old_len - len(stop) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best
