"""Speculative decoding: who proposes tokens, when it pays to, and what it achieved.

A step with speculation: before scheduling, the proposer's `plan` gives each decoding sequence a
proposal (n-gram: the tokens themselves; draft model, EAGLE-3 head: how many, drafted on the device
by rank 0's worker once scheduling has reserved their KV slots: engine/drafters.py). The target verifies a sequence's k proposed tokens in one pass of
k + 1 query rows (the sampler's exact acceptance rule), the accepted ones plus one more token join
the output, and the scheduler gives back the slots of the rejected ones.

The off-switch, so speculation costs little where it cannot pay: no proposals in steps with more
running sequences than `speculative_disable_batch_size` (a bigger batch already fills the hardware
that verification would use), and a sequence whose recent proposals were mostly rejected
(accepted share below `speculative_min_acceptance` over at least PAUSE_WINDOW proposed tokens)
pauses for PAUSE_STEPS steps, twice as long after each further failing window (up to MAX_PAUSE_STEPS),
back to PAUSE_STEPS after a window that passes. On this project's CPU a failed n-gram proposal of 4
costs ~12% of a decode step (measured in bench/spec.py's workloads), so the default threshold is low
(5%); a draft model's proposals cost far more, and its users may want a higher one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.server.engine.llm_engine import StepInFlight

PAUSE_WINDOW = 8   # proposed tokens a sequence's acceptance is judged over
PAUSE_STEPS = 16   # steps a sequence with low acceptance goes without proposals (the first time)
MAX_PAUSE_STEPS = 256


@dataclass(slots=True)
class SpecDecodeStats:
    """Monotonic counters, exported as vLLM's spec_decode metrics under the kvpilot: prefix."""

    num_speculative_tokens: int
    num_drafts: int = 0               # proposals verified
    num_draft_tokens: int = 0         # tokens proposed
    num_accepted_tokens: int = 0      # of them, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: proposals whose token i was accepted
    num_steps: int = 0                # engine steps with at least one decoding sequence
    num_spec_steps: int = 0           # of them, steps that verified at least one proposal
    # speculative_lookup: the counters above, of the looked-up proposals alone (the rest are the model's)
    lookup: SpecDecodeStats | None = None

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class Acceptance:
    """A sequence's recent proposals, for its off-switch (the proposer's own state, by seq_id)."""

    seq: Sequence                    # dropped once it has ended
    recent_proposed: int = 0
    recent_accepted: int = 0
    paused_steps: int = 0            # steps left without proposals
    pause_length: int = 0            # the last pause's length (0: the last window passed)


class Proposer:
    """What both methods share: which sequences get a proposal this step, how long, and the off-switch."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        # the longest proposal: a lookup's may be longer than the model's drafts (speculative_lookup_tokens)
        self.k = max(config.num_speculative_tokens, config.speculative_lookup_tokens or 0)
        self.max_model_len = max_model_len
        self.disable_batch_size = config.speculative_disable_batch_size
        self.min_acceptance = config.speculative_min_acceptance
        self.stats = SpecDecodeStats(self.k, lookup=SpecDecodeStats(self.k) if config.speculative_lookup else None)
        self.acceptance: dict[int, Acceptance] = {}

    def plan(self, running: list[Sequence]) -> None:
        """Give each decoding sequence its proposal for the coming step (or none)."""
        for seq_id in [i for i, a in self.acceptance.items() if a.seq.is_finished]:
            del self.acceptance[seq_id]
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if decoding:
            self.stats.num_steps += 1
        for seq in running:
            seq.set_spec(None)
        if not self.may_propose(len(running)):
            return
        for seq in decoding:
            acc = self.acceptance.get(seq.seq_id)
            if acc is not None and acc.paused_steps:
                acc.paused_steps -= 1
                continue
            # Room: every position stays inside the context, and no more tokens than the length limit
            # takes (a proposal of k ends in k + 1 new tokens), however many of a verification in
            # flight are accepted (async scheduling).
            room = min(self.k, self.max_model_len - seq.num_tokens - seq.num_unsettled - 1)
            if seq.max_output_tokens is not None:
                room = min(room, seq.max_output_tokens - seq.num_output_tokens - seq.num_unsettled - 1)
            if room > 0:
                self.plan_sequence(seq, room)

    def may_propose(self, running: int) -> bool:
        """Whether a step with this many running sequences has proposals (the batch-size off-switch)."""
        return not self.disable_batch_size or running <= self.disable_batch_size

    def plan_sequence(self, seq: Sequence, room: int) -> None:
        raise NotImplementedError

    def launched(self, step: StepInFlight) -> None:
        """A step was launched (its outputs still on the device)."""

    def was_looked_up(self, seq: Sequence) -> bool:
        """Whether the step just verified proposed `seq` a lookup's tokens (speculative_lookup)."""
        return False

    def verified(self, results: list[tuple[Sequence, int, int]]) -> None:
        """After a step's verifications, (sequence, tokens proposed, tokens accepted) each: count
        them, and pause the sequences whose proposals keep failing."""
        self.stats.num_spec_steps += bool(results)
        for seq, proposed, accepted in results:
            self.stats.record(proposed, accepted)
            if self.stats.lookup is not None and self.was_looked_up(seq):
                self.stats.lookup.record(proposed, accepted)
            acc = self.acceptance.setdefault(seq.seq_id, Acceptance(seq))
            acc.recent_proposed += proposed
            acc.recent_accepted += accepted
            if acc.recent_proposed >= PAUSE_WINDOW:
                if acc.recent_accepted < self.min_acceptance * acc.recent_proposed:
                    acc.pause_length = min(2 * acc.pause_length, MAX_PAUSE_STEPS) if acc.pause_length else PAUSE_STEPS
                    acc.paused_steps = acc.pause_length
                else:
                    acc.pause_length = 0
                acc.recent_proposed = acc.recent_accepted = 0


class NgramProposer(Proposer):
    """Prompt lookup: the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
    are looked up in its earlier tokens (prompt and output); the tokens that followed their most
    recent earlier occurrence are the proposal. Free to make, and right whenever the output copies
    its context: quoting, editing, code that repeats identifiers."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def plan_sequence(self, seq: Sequence, room: int) -> None:
        proposal = ngram_lookup(seq.token_ids(), self.n_min, self.n_max, room)
        if proposal:
            seq.set_spec(proposal)


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    tokens (n_max down to n_min tokens long) that occurred before."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        suffix = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram (not the suffix itself)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class DeviceProposer(Proposer):
    """The plan of a proposer that drafts on the device (engine/drafters.py: a draft model, an EAGLE-3
    head, on rank 0's worker): a count of tokens per proposing sequence, reserved by scheduling, the
    tokens drafted by the worker before the step runs. speculative_lookup: a sequence whose last
    tokens occurred earlier in it gets what followed them there (n-gram), the model drafts for the others."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self.lookup = (config.prompt_lookup_min, config.prompt_lookup_max) if config.speculative_lookup else None
        self.looked_up: set[int] = set()  # seq_ids given a lookup this step
        self.draft_tokens = config.num_speculative_tokens

    def plan(self, running: list[Sequence]) -> None:
        self.looked_up.clear()
        super().plan(running)

    def plan_sequence(self, seq: Sequence, room: int) -> None:
        if self.lookup and not seq.num_placeholders:  # (the host knows every token: never so under async scheduling)
            found = ngram_lookup(seq.token_ids(), *self.lookup, room)
            if found:
                seq.set_spec(found)
                self.looked_up.add(seq.seq_id)
                return
        if self.can_draft(seq):
            seq.set_spec(None, min(room, self.draft_tokens))  # the worker's drafter makes the tokens, once the slots are reserved

    def can_draft(self, seq: Sequence) -> bool:
        return True

    def was_looked_up(self, seq: Sequence) -> bool:
        return seq.seq_id in self.looked_up  # (the plan of the step verified: lookups keep steps synchronous)


class EagleProposer(DeviceProposer):
    """An EAGLE-3 head drafts from the state it kept of a sequence's last sampled step (engine/drafters.py):
    a sequence may draft when the head's last launched pass kept one for it, since its last preemption."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self.kept: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (the sequence, its preemptions then)

    def launched(self, step: StepInFlight) -> None:
        for seq in step.sampled:
            if step.launched.head_state is None:  # not computed (no proposals expected): its older state is stale now
                self.kept.pop(seq.seq_id, None)
            else:
                self.kept[seq.seq_id] = (seq, seq.num_preemptions)

    def plan(self, running: list[Sequence]) -> None:
        for seq_id in [i for i, (seq, _) in self.kept.items() if seq.is_finished]:
            del self.kept[seq_id]
        super().plan(running)

    def can_draft(self, seq: Sequence) -> bool:
        kept = self.kept.get(seq.seq_id)
        return kept is not None and kept[1] == seq.num_preemptions  # the head has seen every token (not so after a preemption's re-prefill began)
