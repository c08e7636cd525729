"""One generation stream as the scheduler sees it: tokens, KV blocks, progress. Pure data, no tensors.

Only what scheduling needs lives here. The output side (text, detokenizer, logprobs, timings, why it
ended) is the output processor's (OutputState), a proposer's statistics are the proposer's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.engine.sampling_params import SamplingParams

# A token not known on the host yet (async scheduling): the step that samples it is in flight, and
# the step after reads it from the device. It stands in input lists only, never in output_token_ids.
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
    max_output_tokens: int | None = None  # the output's length limit (max_tokens, and the context); set at admission
    adapter: int = 0                      # its LoRA adapter's id (0: the base model): scheduling caps the adapters of a step, KV is keyed by it
    output_token_ids: list[int] = field(default_factory=list)  # known output tokens
    num_placeholders: int = 0             # output tokens counted but not known yet (async scheduling: 0 or 1)
    # Async scheduling with speculation: the proposed tokens of the verification in flight (0..k). The
    # host counts none of them as accepted until the step's outputs arrive; their slots stay reserved
    # (the next step's rows sit that many positions further on when they are: the device shifts them).
    num_unsettled: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained keys of its full, cached blocks (block_manager.py)
    window_table: list[int] = field(default_factory=list)  # with a window pool: its sliding-window layers' blocks (block_manager.py)
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_cached_tokens: int = 0            # of the prompt, found in the prefix cache at admission
    cached_sources: dict[str, int] = field(default_factory=dict)  # those tokens by where they were: device, host, disk, p2p
    num_preemptions: int = 0
    guide: Any = None                     # structured outputs: the matcher of its constraint, advanced on each output token
    constraint_key: Any = None            # its constraint's in the grammar cache (refused there if its masks cost too much)
    mask_seconds: float = 0.0             # CPU time its masks took in the steps that timed them, over
    mask_steps: int = 0                   # this many rows (a step with k proposed tokens has k + 1)
    kv_load: Any = None                   # the KV connector: its read of blocks past the in-memory prefix hits (kv_tiers.BlockLoad), until admitted
    tier_looked_up: bool = False          # whether that read was looked for since it last waited with no blocks
    kv_writes: list = field(default_factory=list)  # admitted: (block id, window block id, its BlockLoad, index there) not yet in the cache
    # admitted with loaded blocks: what was counted as cached before, and the tokens loaded (undone if the load fails)
    counted_before_load: tuple[int, dict, int] | None = None
    # Speculative decoding: this step's proposal (verified in the step, then cleared).
    num_spec_tokens: int = 0              # tokens proposed (reserved) for this step
    spec_token_ids: list[int] = field(default_factory=list)  # the proposed tokens known on the host (n-gram, a lookup; a drafter's stay on the worker)

    def __post_init__(self) -> None:
        if self.max_output_tokens is None:
            self.max_output_tokens = self.params.max_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, the ones still in flight included."""
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def record_cached_prompt(self, tokens: int, source: str) -> None:
        """`tokens` more of the prompt found cached at admission, in the KV cache (device), the host or disk
        tier, or pulled from a prefill engine (p2p): counted at the first admission only (a preempted
        sequence's own output found cached again is not its prompt's), and never past the prompt."""
        if self.num_preemptions == 0:
            tokens = min(tokens, self.num_prompt_tokens - self.num_cached_tokens)
            self.num_cached_tokens += tokens
            self.cached_sources[source] = self.cached_sources.get(source, 0) + tokens

    def length_reached(self, more: int = 0) -> bool:
        """Whether, with `more` tokens after the ones counted now, the output is at its length limit:
        the one length rule (finishing, not scheduling a last awaited token, proposal room)."""
        return self.max_output_tokens is not None and self.num_output_tokens + more >= self.max_output_tokens

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (placeholders for those in flight) + this step's
        proposed tokens (which a verification step computes, and whose accepted part joins the output
        after it)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids + [PLACEHOLDER_TOKEN] * self.num_placeholders + self.spec_token_ids)[start:end]

    def set_spec(self, token_ids: list[int] | None, count: int | None = None) -> None:
        """This step's proposal: known tokens, or (a draft model's, filled in later) a count reserved."""
        self.spec_token_ids = list(token_ids or [])
        self.num_spec_tokens = len(self.spec_token_ids) if count is None else count

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
