"""After a step, everything that happens to the requests' outputs, in one place: tokens appended
(several at once when speculating, stopping at the first that ends the sequence), incremental
detokenizing, EOS / stop token ids / stop strings / max_tokens, logprobs and prompt logprobs, and
the RequestOutput handed back."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.server.engine.scheduler import Scheduler
from kvpilot.server.engine.sequence import Sequence


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.scheduler, self.eos_token_ids, self.max_model_len = scheduler, eos_token_ids, max_model_len
        self.requests: dict[str, Request] = {}

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None, now: float) -> None:
        """Append tokens in order until one finishes the sequence; the ones after it are dropped."""
        for i, token in enumerate(tokens):
            self._append_one(seq, token, logprobs[i] if logprobs is not None else None, now)
            if seq.is_finished:
                return

    def record_prompt_logprobs(self, seq: Sequence, first_pos: int, entries: list[dict[int, float]]) -> None:
        for j, entry in enumerate(entries):
            if first_pos + j >= len(seq.prompt_logprobs):  # recomputed after a preemption: already recorded
                seq.prompt_logprobs.append(entry)

    def _append_one(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        p = seq.params
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        old_len = len(seq.text)
        seq.detokenizer.add(token)
        seq.text = seq.detokenizer.text
        reason, stop_reason = None, None
        enough = len(seq.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif enough and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif enough and p.stop:
            hit = _find_stop(seq.text, old_len, p.stop)
            if hit is not None:
                at, stop = hit
                seq.text = seq.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                reason, stop_reason = "stop", stop
        if reason is None and self.length_reached(seq):
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str):  # a stop string already cut the text
                seq.text += seq.detokenizer.flush()
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    def length_reached(self, seq: Sequence, more: int = 0) -> bool:
        """Whether seq, with `more` tokens after its current ones, is at max_tokens or the context limit."""
        p = seq.params
        return (p.max_tokens is not None and len(seq.output_token_ids) + more >= p.max_tokens) or seq.num_tokens + more >= self.max_model_len

    def fail(self, request_id: str, message: str) -> RequestOutput:
        """End every sequence of a request with finish_reason "error" (blocks freed); its final output."""
        for seq in self.requests[request_id].seqs:
            if not seq.is_finished:
                seq.error = message
                self.scheduler.finish(seq, "error")
        return self.request_output(request_id)

    def request_output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        outputs = []
        for seq in req.seqs:
            # Text that could still turn out to be the start of a stop string is held back.
            hold = 0 if seq.is_finished else max((len(s) - 1 for s in seq.params.stop), default=0)
            end = max(seq.emitted_text_len, len(seq.text) - hold)
            delta = seq.text[seq.emitted_text_len:end]
            seq.emitted_text_len = end
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None, text_delta=delta))
        finished = all(s.is_finished for s in req.seqs)
        first = req.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.scheduled_time, min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
                                 max((s.finish_time or 0 for s in req.seqs), default=None) if finished else None,
                                 first.num_cached_tokens, sum(s.num_preemptions for s in req.seqs))
        prompt_lp = ([None] + list(first.prompt_logprobs)) if first.params.prompt_logprobs is not None else None
        if finished:
            del self.requests[request_id]
        error = next((s.error for s in req.seqs if s.error), None)
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outputs, finished, prompt_lp, metrics, first.num_cached_tokens, error)


def _find_stop(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        at = text.find(stop, max(0, old_len - len(stop) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best
