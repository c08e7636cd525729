"""Speculative decoding: who proposes tokens, when it pays to, and what it achieved.

A step with speculation: before scheduling, the proposer's `plan` gives each decoding sequence a
proposal (n-gram: the tokens themselves; draft model: how many, drawn after scheduling has reserved
their KV slots, by `propose`). The target verifies a sequence's k proposed tokens in one pass of
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
import torch

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.model_io import InputBuilder, Proposal, SamplingTensors
from kvpilot.server.engine.scheduler import ScheduledBatch
from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN, Sequence

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

    def propose(self, batch: ScheduledBatch, previous: StepInFlight | None = None) -> Proposal | None:
        """After scheduling: make the proposals that need the reserved KV slots, on the device (the
        sequences hold placeholders for them; a sequence whose mask or penalties need its proposed
        tokens on the host gets them there too), and the distributions random-sampling sequences' were
        drawn from. previous: the step in flight (async scheduling), whose tokens and accepted counts
        the proposals start from on the device."""
        return None

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
    """A proposer that drafts on the device, k decode steps of its own (all proposing sequences
    batched), each token drawn with the request's own sampling parameters, so that verification can
    compare the two distributions. Under async scheduling its first step starts from the step in
    flight's tokens and accepted counts, on the device: step n + 1's proposal never waits for step n's
    tokens to reach the host."""

    def __init__(self, config: EngineConfig, max_model_len: int, runner, inputs: InputBuilder, eos_token_ids: tuple[int, ...]):
        super().__init__(config, max_model_len)
        self.runner, self.inputs, self.eos_token_ids = runner, inputs, eos_token_ids
        # speculative_lookup: a sequence whose last tokens occurred earlier in it gets what followed them
        # there (n-gram), the model drafts for the others; seq_ids given a lookup this step.
        self.lookup = (config.prompt_lookup_min, config.prompt_lookup_max) if config.speculative_lookup else None
        self.looked_up: set[int] = set()
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
            seq.set_spec(None, min(room, self.draft_tokens))  # the tokens come in propose(), once the slots are reserved

    def can_draft(self, seq: Sequence) -> bool:
        return True

    def was_looked_up(self, seq: Sequence) -> bool:
        return seq.seq_id in self.looked_up  # (the plan of the step verified: lookups keep steps synchronous)

    def propose(self, batch: ScheduledBatch, previous: StepInFlight | None = None) -> Proposal | None:
        seqs = [s for s in batch.seqs if s.num_spec_tokens and s.seq_id not in self.looked_up]
        if not seqs:
            return None
        # Penalties count the proposed tokens as output, and a grammar's masks follow them: those
        # sequences' tokens come to the host (their steps never overlap the previous one: llm_engine.py).
        host = any(s.guide is not None or s.params.has_penalties for s in seqs)
        for seq in seqs:
            seq.spec_token_ids = []  # a re-run of a failed step proposes again
        width = max(s.num_spec_tokens for s in seqs)
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=self.runner.device)
        probs: dict[int, list[torch.Tensor]] = {}
        for i, (rows, drawn, q, sampling) in enumerate(self.draft_steps(seqs, previous)):
            active = [seqs[r] for r in rows]
            tokens[self._index(rows), i] = drawn
            known = drawn.tolist() if host else [PLACEHOLDER_TOKEN] * len(active)
            for seq, token in zip(active, known):
                seq.spec_token_ids.append(token)
            if q is not None:
                for j, row in enumerate(sampling.random_rows):
                    probs.setdefault(active[row].seq_id, []).append(q[j])
        return Proposal(tokens, index, {sid: torch.stack(rows) for sid, rows in probs.items()} or None)

    def draft_steps(self, seqs: list[Sequence], previous: StepInFlight | None):
        """Yield, for draft step i = 0, 1, …: (the rows of `seqs` proposing more than i tokens, their i-th
        proposed tokens, the random rows' distributions, the draw's SamplingTensors)."""
        raise NotImplementedError

    @staticmethod
    def _narrow(seqs: list[Sequence], rows: list[int], i: int) -> tuple[list[int], list[int]]:
        """Of `rows` (of `seqs`), those proposing more than i tokens: (their places in `rows`, the rows)."""
        keep = [j for j, r in enumerate(rows) if seqs[r].num_spec_tokens > i]
        return keep, [rows[j] for j in keep]

    def _draw_rows(self, active: list[Sequence]) -> SamplingTensors | None:
        """Each row drawn as the target will judge it: with the proposed tokens so far counted as output.
        None: every row is greedy with nothing that changes its logits (the argmax alone)."""
        plain = all(s.params.greedy and not s.params.has_penalties and not s.params.logit_bias and s.guide is None
                    and s.num_output_tokens >= s.params.min_tokens for s in active)
        return None if plain else SamplingTensors.build(active, self.eos_token_ids, torch.float32, self.inputs.buffers, proposing=True)

    def _index(self, values: list[int]) -> torch.Tensor:
        """A host list as a device index (staged like a step's inputs: a plain torch.tensor to a GPU
        would wait for the step in flight)."""
        return self.inputs.buffers.upload(values, torch.long)

    def _in_flight(self, seqs: list[Sequence], previous: StepInFlight | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per sequence, from the step in flight, on the device: its last new token (where the host has
        a placeholder; else -1) and how many positions on its rows are (the accepted count of its
        verification; else 0). (None, None) without a step in flight."""
        if previous is None:
            return None, None
        where = previous.sampled_rows()
        at = self._index([where.get(s.seq_id, -1) if s.num_placeholders else -1 for s in seqs])
        tokens = torch.where(at >= 0, previous.launched.tokens[at.clamp(min=0)], -1)
        counts = previous.launched.accepted_counts
        if counts is None:
            return tokens, None
        at = self._index([where.get(s.seq_id, -1) if s.num_unsettled else -1 for s in seqs])
        return tokens, torch.where(at >= 0, counts[at.clamp(min=0)], 0)


class DraftModelProposer(DeviceProposer):
    """A small model sharing the tokenizer drafts k tokens. Its cache is filled by running every
    target step's rows too (ModelRunner.launch), so proposing needs only the k new rows: the first
    takes the sequence's last token, each further one the token drafted before it."""

    def draft_steps(self, seqs: list[Sequence], previous: StepInFlight | None):
        last, shift = self._in_flight(seqs, previous)
        known = self._index([s.tokens_slice(s.num_computed_tokens, s.num_computed_tokens + 1)[0] for s in seqs])
        ids = known if last is None else torch.where(last >= 0, last, known)
        rows = list(range(len(seqs)))
        for i in range(max(s.num_spec_tokens for s in seqs)):
            keep, rows = self._narrow(seqs, rows, i)
            active = [seqs[r] for r in rows]
            inp = self.inputs.build_decode(active, [s.num_computed_tokens + i for s in active], ids[self._index(keep)],
                                           shift[self._index(rows)] if shift is not None else None)
            inp.sampling = self._draw_rows(active)
            ids, q = self.runner.draft_propose(inp)
            yield rows, ids, q, inp.sampling


class EagleProposer(DeviceProposer):
    """An EAGLE-3 head (server/models/eagle.py) drafts from the target's own hidden states. Every step
    the head runs over all of that step's rows, on the device right after the target (ModelRunner:
    its K/V cache stays as complete as the target's whether or not anything is proposed — above the
    batch threshold too — for about one target layer's cost) and keeps, per sampled sequence, its
    output at the row before the sequence's last new token: that gives the first proposed token, and
    each further one is a decode step of the head fed its own output."""

    def __init__(self, config: EngineConfig, max_model_len: int, runner, inputs: InputBuilder, eos_token_ids: tuple[int, ...]):
        super().__init__(config, max_model_len, runner, inputs, eos_token_ids)
        # seq_id -> (the sequence, its preemptions then, the head's normed and prenorm outputs of a step, its row there)
        self.last: dict[int, tuple[Sequence, int, torch.Tensor, torch.Tensor, int]] = {}

    def launched(self, step: StepInFlight) -> None:
        if step.launched.head_state is None:  # not computed (no proposals expected): its sequences' older states are stale now
            for seq in step.plan.sampled:
                self.last.pop(seq.seq_id, None)
            return
        normed, prenorm = step.launched.head_state
        for i, seq in enumerate(step.plan.sampled):
            self.last[seq.seq_id] = (seq, seq.num_preemptions, normed, prenorm, i)

    def plan(self, running: list[Sequence]) -> None:
        for seq_id in [i for i, entry in self.last.items() if entry[0].is_finished]:
            del self.last[seq_id]
        super().plan(running)

    def can_draft(self, seq: Sequence) -> bool:
        entry = self.last.get(seq.seq_id)
        return entry is not None and entry[1] == seq.num_preemptions  # the head has seen every token (not so after a preemption's re-prefill began)

    def draft_steps(self, seqs: list[Sequence], previous: StepInFlight | None):
        _, shift = self._in_flight(seqs, previous)
        normed = torch.stack([self.last[s.seq_id][2][self.last[s.seq_id][4]] for s in seqs])
        prenorm = torch.stack([self.last[s.seq_id][3][self.last[s.seq_id][4]] for s in seqs])
        rows = list(range(len(seqs)))  # every sequence proposes at least one token
        tokens = None
        for i in range(max(s.num_spec_tokens for s in seqs)):
            keep, rows = self._narrow(seqs, rows, i)
            active = [seqs[r] for r in rows]
            if i:
                # The row after the last proposed token's: that token in, the head's previous output as the hidden state.
                kept = self._index(keep)
                inp = self.inputs.build_decode(active, [s.num_tokens - 2 + i for s in active], tokens[kept],
                                               shift[self._index(rows)] if shift is not None else None)
                normed, prenorm = self.runner.head_propose(inp, prenorm[kept])
            sampling = self._draw_rows(active)
            tokens, q = self.runner.head_draw(normed, sampling)
            yield rows, tokens, q, sampling
