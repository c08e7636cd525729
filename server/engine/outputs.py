"""What the engine hands back for a request: each step, a RequestDelta (the tokens new since the last,
and how sequences ended), which an OutputAssembler (output_assembler.py) turns into the RequestOutput a
client reads (vLLM's RequestOutput / CompletionOutput shapes: text, stop strings, all tokens so far).
Deltas are what crosses from the engine core's process to the API process."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    text_delta: str = ""                 # text new since the previous output of this request


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    cached_sources: dict[str, int] = field(default_factory=dict)  # the cached prompt tokens by where they were (Sequence.cached_sources)
    max_tokens: int | None = None        # the request's max_tokens parameter


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = field(default=0)
    error: str | None = None             # set when the request failed in the engine (it is also finished)
    kv_transfer_params: dict | None = None  # a finished prefill request's (do_remote_decode): what a decode request passes on


class SeqDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]                       # new since the request's previous delta
    logprobs: list[dict[int, float]] | None    # one entry per new token, when asked for
    finish_reason: str | None                  # the engine's: EOS / stop token id / stop string / length / abort / error
    stop_reason: int | str | None              # the stop token id or stop string that ended it


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    metrics: RequestMetrics
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None  # in the request's first delta only
    error: str | None                          # the request failed in the engine (every sequence ended)
    kv_transfer_params: dict | None            # a finished prefill request's
