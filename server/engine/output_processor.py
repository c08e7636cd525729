"""After a step, everything that happens to the requests' tokens, in one place: tokens appended
(several at once when speculating, stopping at the first that ends the sequence), EOS / stop token ids
/ the length limit / a complete constraint, logprobs and prompt logprobs, timings, and the RequestDelta
handed back (the text is made from it by output_assembler.py, in whichever process serves it).

The output state of every sequence (OutputState: logprobs, timings, why it ended, what was handed out)
is owned here, keyed by request id; the scheduler's Sequence holds none of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.server.engine.outputs import RequestDelta, RequestMetrics, SeqDelta
from kvpilot.server.engine.scheduler import Scheduler
from kvpilot.server.engine.sequence import Sequence


@dataclass(slots=True)
class OutputState:
    """One sequence's output, as far as the engine makes it."""

    logprobs: list[dict[int, float]] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None              # why it failed (finish_reason "error")
    sent: int = 0                         # tokens handed out in deltas so far


@dataclass(slots=True)
class Request:
    request_id: str
    seqs: list[Sequence]
    outputs: list[OutputState]            # per sequence, in the same order
    arrival_time: float
    scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # entry j: the token at j + 1
    prompt_logprobs_sent: bool = False
    kv_transfer_params: dict | None = None  # a prefill request's: where a decode engine pulls its blocks (kv_transfer.py)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], hold_blocks: Callable[[Sequence], dict] | None = None):
        """hold_blocks: a prefill request's sequence that ended well has its prompt's blocks held for a
        decode engine (before they are freed); it returns the params the output carries."""
        self.scheduler, self.eos_token_ids, self.hold_blocks = scheduler, eos_token_ids, hold_blocks
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, seqs: list[Sequence], arrival_time: float) -> None:
        """Start the output state of a request's sequences."""
        self.requests[request_id] = Request(request_id, seqs, [OutputState() for _ in seqs], arrival_time)

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
        if logprobs is not None:
            out.logprobs.append(logprobs)
        reason, stop_reason = None, None
        enough = len(seq.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif enough and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        if reason is None and seq.guide is not None and seq.guide.is_stopped():
            reason = "stop"  # the constraint is complete and takes nothing more
        if reason is None and seq.length_reached():
            reason = "length"
        if reason is not None:
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

    def abort(self, request_id: str) -> RequestDelta:
        for seq in self.requests[request_id].seqs:
            self.finish(seq, "abort")
        return self.delta(request_id)

    def fail(self, request_id: str, message: str) -> RequestDelta:
        """End every sequence of a request with finish_reason "error" (blocks freed); its final output."""
        for seq in self.requests[request_id].seqs:
            self.finish(seq, "error", message)
        return self.delta(request_id)

    def delta(self, request_id: str) -> RequestDelta:
        """What is new for a request since its last delta (its prompt logprobs in the first); a request
        all of whose sequences ended is dropped."""
        req = self.requests[request_id]
        seqs = []
        for seq, out in zip(req.seqs, req.outputs):
            logprobs = out.logprobs[out.sent:] if seq.params.logprobs is not None else None
            seqs.append(SeqDelta(seq.index, seq.output_token_ids[out.sent:], logprobs, out.finish_reason, out.stop_reason))
            out.sent = len(seq.output_token_ids)
        finished = all(s.is_finished for s in req.seqs)
        first = req.seqs[0]
        metrics = RequestMetrics(req.arrival_time, req.scheduled_time, min((o.first_token_time for o in req.outputs if o.first_token_time), default=None),
                                 max((o.finish_time or 0 for o in req.outputs), default=None) if finished else None,
                                 first.num_cached_tokens, sum(s.num_preemptions for s in req.seqs), dict(first.cached_sources),
                                 first.params.max_tokens)
        prompt_lp = None
        if first.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:  # a delta comes once the prompt is done
            prompt_lp, req.prompt_logprobs_sent = [None] + list(req.prompt_logprobs), True
        if finished:
            del self.requests[request_id]
        error = next((o.error for o in req.outputs if o.error), None)
        return RequestDelta(request_id, seqs, metrics, first.num_cached_tokens, prompt_lp, error, req.kv_transfer_params if finished else None)


class StructuredOutputError(RuntimeError):
    pass
