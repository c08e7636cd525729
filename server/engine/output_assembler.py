"""The one place where a request's output is made from the engine's token deltas: incremental
detokenizing, stop strings, the text held back while it could still become one, logprobs and the
RequestOutput a client reads. Every server mode and the offline LLM use it: the engine runs one itself
(LLMEngine(assemble=True), the one-process server and LLM), or the API process runs it on the deltas
the engine core sends (api/core_client.py).

A stop string found here ends its sequence for the client at once, and is reported back
(stop_sequence) so that the engine frees its blocks; tokens the engine made after it are dropped. A
request whose output cannot be made (a detokenizer error, say) fails alone: its output is an error,
and the engine is told to drop it (abort); no other request, and not the engine, is affected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, SeqDelta
from kvpilot.server.engine.sampling_params import SamplingParams

log = logging.getLogger("kvpilot.engine")


@dataclass(slots=True)
class TextState:
    """One sequence's text: detokenized token by token, cut at the stop string it completes, and handed
    out in deltas that never end inside what could still become a stop string."""

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


def stop_check_applies(token: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether a token's text is matched against the stop strings: not before min_tokens, and not when
    the token itself ends the sequence (EOS, a stop token id)."""
    if num_output_tokens < params.min_tokens:
        return False
    return not ((not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids)


@dataclass(slots=True)
class _SeqOutput:
    text: TextState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _RequestOutputState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_SeqOutput]
    prompt_logprobs: list | None = None
    finish_time: float | None = None   # when stop strings here ended its last sequence
    awaiting_engine: bool = False      # a prefill request a stop string ended: its final delta (kv_transfer_params) is to come


class OutputAssembler:
    """Every open request's output, made from the engine's deltas."""

    def __init__(self, tokenizer, stop_sequence: Callable[[str, int, str], None], abort: Callable[[str], None]):
        """stop_sequence(request_id, index, stop): tell the engine that a stop string ended a sequence;
        abort(request_id): that the request failed here."""
        self.tokenizer, self.stop_sequence, self.abort = tokenizer, stop_sequence, abort
        self.requests: dict[str, _RequestOutputState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from kvpilot.server.tokenizer import IncrementalDetokenizer

        seqs = [_SeqOutput(TextState(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens), params.stop,
                                     params.include_stop_str_in_output)) for _ in range(params.n)]
        self.requests[request_id] = _RequestOutputState(prompt, list(prompt_token_ids), params, seqs)

    def apply(self, delta: RequestDelta) -> RequestOutput | None:
        """The request's output after this delta; None once it ended here (stop strings): what the
        engine made since is dropped."""
        req = self.requests.get(delta.request_id)
        if req is None:
            return None
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs = delta.prompt_logprobs
        error = delta.error
        try:
            for seq_delta in delta.seqs:
                seq = req.seqs[seq_delta.index]
                if seq.finish_reason is None:
                    self._extend(delta.request_id, req, seq, seq_delta)
        except Exception as e:  # noqa: BLE001 - this request's output alone: it fails, the engine drops it
            log.exception("request %s: making its output failed", delta.request_id)
            error = f"output processing failed ({type(e).__name__}: {e})"
            for seq in req.seqs:
                seq.finish_reason = seq.finish_reason or "error"
            req.awaiting_engine = False
            if not all(d.finish_reason is not None for d in delta.seqs):
                self.abort(delta.request_id)
        if req.awaiting_engine and all(d.finish_reason is not None for d in delta.seqs):
            req.awaiting_engine = False
        finished = all(s.finish_reason is not None for s in req.seqs) and not req.awaiting_engine
        p = req.params
        outputs = [CompletionOutput(i, s.text.text, list(s.token_ids), s.finish_reason, s.stop_reason,
                                    list(s.logprobs) if p.logprobs is not None else None,
                                    s.cumulative_logprob if p.logprobs is not None else None, s.text.delta(s.finish_reason is not None))
                   for i, s in enumerate(req.seqs)]
        metrics = delta.metrics
        if finished:
            del self.requests[delta.request_id]
            if metrics.finish_time is None:
                metrics.finish_time = req.finish_time
        return RequestOutput(delta.request_id, req.prompt, req.prompt_token_ids, outputs, finished, req.prompt_logprobs, metrics,
                             delta.num_cached_tokens, error, delta.kv_transfer_params if finished else None)

    def _extend(self, request_id: str, req: _RequestOutputState, seq: _SeqOutput, delta: SeqDelta) -> None:
        """Append a sequence's new tokens until a stop string ends it, then the engine's finish, if any."""
        eos = self.tokenizer.eos_token_ids
        last = len(delta.token_ids) - 1
        for j, token in enumerate(delta.token_ids):
            seq.token_ids.append(token)
            if delta.logprobs is not None:
                seq.logprobs.append(delta.logprobs[j])
                seq.cumulative_logprob += delta.logprobs[j][token]
            stop = seq.text.add(token, stop_check_applies(token, len(seq.token_ids), req.params, eos))
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                req.finish_time = time.monotonic()
                if not (j == last and delta.finish_reason is not None):  # the engine still runs it
                    transfer = req.params.kv_transfer
                    req.awaiting_engine = transfer is not None and transfer.do_remote_decode
                    self.stop_sequence(request_id, delta.index, stop)
                return
        if delta.finish_reason is not None:
            if delta.finish_reason in ("stop", "length"):
                seq.text.flush()
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason


def _find_stop(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        at = text.find(stop, max(0, old_len - len(stop) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    return best
