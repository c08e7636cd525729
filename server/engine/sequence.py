"""One generation stream's state: tokens, KV blocks, progress, timing. Pure data, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.engine.sampling_params import SamplingParams

# An output token not known on the host yet (async scheduling): the step that samples it is in flight,
# and the step after reads it from the device.
PLACEHOLDER_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    index: int                            # which of the request's n outputs this is
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full, cached blocks
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_cached_tokens: int = 0            # of the prompt, found in the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None              # why it failed (finish_reason "error")
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Output text state (maintained by the engine's output processor).
    text: str = ""
    emitted_text_len: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # entry j: the token at j + 1
    cumulative_logprob: float = 0.0
    # Timing for metrics (time.monotonic seconds).
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    detokenizer: Any = None
    generator: Any = None                 # torch.Generator when the request is seeded
    # Speculative decoding: this step's proposal (verified in the step, then cleared) and the
    # proposer's recent acceptance, for its per-sequence off-switch.
    num_spec_tokens: int = 0              # tokens proposed (reserved) for this step
    spec_token_ids: list[int] = field(default_factory=list)  # the proposed tokens themselves, once known
    spec_recent_proposed: int = 0
    spec_recent_accepted: int = 0
    spec_paused_steps: int = 0            # steps left without proposals
    spec_pause_length: int = 0            # the last pause's length (0: the last window passed)
    awaiting_token: bool = False          # the last output token is PLACEHOLDER_TOKEN (async scheduling)
    awaiting_last_token: bool = False     # ... and it ends the sequence whatever its value (length): nothing to schedule

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + this step's proposed tokens (which a verification
        step computes, and whose accepted part joins the output after it)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids + self.spec_token_ids)[start:end]

    def set_spec(self, token_ids: list[int] | None, count: int | None = None) -> None:
        """This step's proposal: known tokens, or (a draft model's, filled in later) a count reserved."""
        self.spec_token_ids = list(token_ids or [])
        self.num_spec_tokens = len(self.spec_token_ids) if count is None else count

    def await_token(self, last: bool) -> None:
        """A step that samples this sequence's next token is in flight: count the token already (the
        next step is scheduled with it) as a placeholder until its value comes back. last: that token
        reaches max_tokens or the context limit, so the sequence ends with it."""
        self.output_token_ids.append(PLACEHOLDER_TOKEN)
        self.awaiting_token, self.awaiting_last_token = True, last

    def drop_awaited_token(self) -> None:
        """Take the placeholder out: its value arrived (and is appended as any token is) or the
        sequence ended before it."""
        if self.awaiting_token:
            self.output_token_ids.pop()
            self.awaiting_token = self.awaiting_last_token = False

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
