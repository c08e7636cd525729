"""Scheduling policy: which sequences run in the next step, and how many tokens each computes.

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
sequences go first (decodes and unfinished prefill chunks), then waiting ones in arrival order.
When blocks run out, the newest running sequence is preempted by recompute: its blocks are freed and
it returns to the front of the waiting queue. Nothing is dropped or duplicated.

Under policy "priority" (vLLM's --scheduling-policy priority) the waiting queue is kept in order of
(the request's priority, arrival): lower values first, a preempted sequence goes back to its place in
that order, and the running sequence preempted when blocks run out is the one with the highest value
(the latest to arrive among equals), even one already given this step's tokens (they are taken back).
As in vLLM, a waiting sequence never preempts a running one: it waits for room, ahead of worse ones.
Arrival is the order the engine took the sequences in (their seq_id).

With pipeline stages (steps_in_flight > 1, under async scheduling) several steps are in flight at
once, one per stage, on disjoint sequences (vLLM's batch queue): a sequence waiting for a step's
token is not scheduled again until it is back, and each step takes about an equal share of the
sequences (running and waiting over the steps in flight), so that every stage has a step to run.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.engine.block_manager import BlockManager
from kvpilot.server.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (sequence, block id, window block id, its BlockLoad, index there): written before the step
    kv_loads: list[tuple[Sequence, int, int, Any, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def split_by_request(self) -> list[ScheduledBatch]:
        """The same work as one batch per request (to find which request makes a step fail), less the
        sequences that ended meanwhile."""
        parts: dict[str, ScheduledBatch] = {}
        for seq, n in zip(self.seqs, self.num_new_tokens):
            if seq.is_finished:
                continue
            part = parts.setdefault(seq.request_id, ScheduledBatch())
            part.seqs.append(seq)
            part.num_new_tokens.append(n)
        return list(parts.values())


SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 max_loras: int = 0, connector: Any = None, max_block_writes: int = 0, policy: str = "fcfs", steps_in_flight: int = 1):
        """connector: the KV connector (kv_connector.py), whose lookup(seq, its in-memory prefix hits) is
        a read of the blocks after them from outside the cache (kv_tiers.BlockLoad: .done, .first_index,
        .payloads), or None. max_block_writes: how many such blocks a step writes into the cache while
        other sequences run (0: no bound).
        policy: fcfs or priority (the module's docstring). steps_in_flight: pipeline stages (the module's docstring)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.bm = block_manager
        self.connector = connector
        self.max_block_writes = max_block_writes
        self.max_loras = max_loras  # LoRA: most distinct adapters among running sequences (0: no adapters)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.steps_in_flight = steps_in_flight
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.external_hit_tokens = 0  # prompt tokens read from a KV tier or pulled from a prefill engine at admission

    def add(self, seq: Sequence) -> None:
        needed = self.bm.blocks_needed(seq.num_tokens + 1)
        if needed > self.bm.num_blocks:
            raise ValueError(f"prompt of {seq.num_tokens} tokens cannot fit in a KV cache of {self.bm.num_blocks} blocks of {self.bm.block_size}")
        seq.status = Status.WAITING
        self._enqueue(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int]:
        """Policy priority: lower goes first (waiting), higher is preempted first (running)."""
        return seq.params.priority, seq.seq_id

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue: at its place by _rank (policy priority), else at the back (or the front)."""
        if self.policy == "priority":
            bisect.insort_right(self.waiting, seq, key=self._rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _victim(self, i: int, batch: ScheduledBatch) -> tuple[Sequence, int, int]:
        """Take the running sequence to preempt out of `running` (fcfs: the newest; priority: the highest
        _rank); when it came before running[i], this step may have scheduled it: its tokens are taken
        back from the batch. Returns it, the index of running[i] after the removal, and the tokens given back."""
        j = len(self.running) - 1 if self.policy != "priority" else max(range(len(self.running)), key=lambda k: self._rank(self.running[k]))
        victim = self.running.pop(j)
        freed = 0
        if j < i:
            i -= 1
            k = next((k for k, s in enumerate(batch.seqs) if s is victim), None)
            if k is not None:
                del batch.seqs[k]
                freed = batch.num_new_tokens.pop(k)
        return victim, i, freed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        share = self.max_num_seqs if self.steps_in_flight == 1 else -(-(len(self.running) + len(self.waiting)) // self.steps_in_flight)

        i = 0
        while i < len(self.running) and budget > 0 and len(batch.seqs) < share:
            seq = self.running[i]
            if self.steps_in_flight > 1 and seq.num_placeholders:  # in a step in flight: scheduled again once its token is back
                i += 1
                continue
            if seq.kv_writes:  # its blocks from a tier are still being written: it computes once they all are
                self._write_some(seq, batch, self.max_block_writes)
                if seq.kv_writes:
                    i += 1
                    continue
            if seq.num_placeholders and seq.length_reached():  # its last token is in flight: computing after it would be wasted
                i += 1
                continue
            pending = seq.num_tokens - seq.num_computed_tokens
            n = min(pending + seq.num_spec_tokens, budget)
            if seq.num_spec_tokens > n - pending:  # the budget cuts the proposal short
                keep = max(0, n - pending)
                seq.set_spec(seq.spec_token_ids[:keep], keep)
            while not self.bm.allocate(seq, n + seq.num_unsettled):  # room for the proposal in flight's accepted tokens too
                if seq.num_spec_tokens:  # a proposal never costs another sequence its blocks
                    n -= seq.num_spec_tokens
                    seq.set_spec(None)
                    continue
                victim, i, freed = self._victim(i, batch)
                budget += freed
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break

        # Waiting sequences are admitted only when nothing had to be preempted this step. A sequence
        # whose adapter would be one too many for the slots waits, and those behind it go first.
        adapters = {seq.adapter for seq in self.running} - {0}
        passed: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(batch.seqs) < share and not batch.preempted:
            seq = self.waiting[0]
            if self._must_wait(seq, adapters):
                passed.append(self.waiting.popleft())
                continue
            cached = self.bm.match_prefix(seq) if not seq.block_table else None
            loaded = 0
            if cached is not None and self.connector is not None:
                if not seq.tier_looked_up:
                    seq.tier_looked_up, seq.kv_load = True, self.connector.lookup(seq, cached)
                if seq.kv_load is not None and not seq.kv_load.done.is_set():  # read in flight: the others go on
                    passed.append(self.waiting.popleft())
                    continue
                loaded = self._loaded_after(seq, len(cached))
            computed = (len(cached or ()) + loaded) * self.bm.block_size
            n = seq.num_tokens - seq.num_computed_tokens - computed
            if n > budget:
                if not self.chunked:
                    break
                n = budget
            counted = (seq.num_cached_tokens, dict(seq.cached_sources), loaded * self.bm.block_size) if loaded else None  # (before allocate counts the hits)
            if not self.bm.allocate(seq, n + loaded * self.bm.block_size, cached, loaded * self.bm.block_size):
                break
            if loaded:  # fresh blocks after the in-memory hits, to hold what the tier read
                seq.counted_before_load = counted
                first, load = len(cached), seq.kv_load
                start = first - load.first_index
                seq.kv_writes = [(block_id, window_id, load, start + j) for j, (block_id, window_id)
                                 in enumerate(zip(seq.block_table[first:first + loaded], self._window_ids(seq)[first:first + loaded]))]
                load.num_taken = loaded
                seq.num_computed_tokens += loaded * self.bm.block_size
                self._record_loaded(seq, len(cached or ()), loaded)
                # Alone, it is written at once; beside other sequences a few blocks per step, so that
                # their steps are not held up by one long copy.
                alone = not batch.seqs and not self.running
                self._write_some(seq, batch, 0 if alone else self.max_block_writes)
            elif seq.kv_load is not None:  # none of it continues the hits (or fits): whoever holds it may let go
                self.connector.abandon(seq.kv_load)
            seq.kv_load = None
            self.waiting.popleft()
            if seq.adapter:
                adapters.add(seq.adapter)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.kv_writes:
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(passed))  # back at the front, in their order
        return batch

    def _window_ids(self, seq: Sequence) -> list[int]:
        """seq's blocks' ids in the sliding-window layers' caches: its window table with a pool (the pool's null, whose
        writes no kernel reads, for a block out of the window), else its block table (every layer's cache)."""
        return seq.window_table if self.bm.window is not None else seq.block_table

    @staticmethod
    def _write_some(seq: Sequence, batch: ScheduledBatch, most: int) -> None:
        """Move up to `most` (0: all) of seq's blocks read from a tier into the step's writes."""
        take = len(seq.kv_writes) if most == 0 else most
        batch.kv_loads += [(seq, *write) for write in seq.kv_writes[:take]]
        del seq.kv_writes[:take]

    def _must_wait(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether a waiting sequence cannot be admitted whatever the room: preempted with a verification in
        flight (its length is known once that step's outputs are) or with its token in flight (pipeline stages), or its
        adapter one too many for the slots."""
        return bool(seq.num_unsettled or seq.num_placeholders) or bool(seq.adapter and seq.adapter not in adapters and len(adapters) >= self.max_loras)

    def num_deferred(self) -> int:
        """Waiting sequences held back by something other than room in the batch or the cache: a tier read
        or pull in flight, or what _must_wait says (vLLM's "deferred" waiting reason)."""
        adapters = {seq.adapter for seq in self.running} - {0}
        return sum(1 for seq in list(self.waiting)
                   if (seq.kv_load is not None and not seq.kv_load.done.is_set()) or self._must_wait(seq, adapters))

    def _record_loaded(self, seq: Sequence, num_cached: int, num_loaded: int) -> None:
        """seq's prompt blocks num_cached… were read from a tier or pulled: counted by where they came from."""
        load, size = seq.kv_load, self.bm.block_size
        host = max(0, min(load.first_index + load.num_host, num_cached + num_loaded) - num_cached)
        if host:
            seq.record_cached_prompt(host * size, "host")
        if num_loaded > host:
            seq.record_cached_prompt((num_loaded - host) * size, load.source)
        self.external_hit_tokens += num_loaded * size

    def _loaded_after(self, seq: Sequence, num_cached: int) -> int:
        """How many of the load's blocks continue seq's in-memory hits (none when the hits changed so that
        they do not), short of its last prompt token (always computed: its logits are needed)."""
        load = seq.kv_load
        if load is None or not load.first_index <= num_cached < load.first_index + len(load.payloads):
            return 0
        usable = (seq.num_tokens - 1) // self.bm.block_size - num_cached
        return max(0, min(usable, load.first_index + len(load.payloads) - num_cached))

    def drop_loads(self, seqs: list[Sequence], batch: ScheduledBatch) -> None:
        """Sequences whose loaded blocks could not be written on every rank: out of this step and back to
        waiting (at the front), their blocks freed; they compute their prompts past the in-memory hits
        (not looked up again until a preemption)."""
        for seq in seqs:
            if seq.status is not Status.RUNNING:
                continue
            self.running.remove(seq)
            k = next((k for k, s in enumerate(batch.seqs) if s is seq), None)
            if k is not None:
                del batch.seqs[k]
                del batch.num_new_tokens[k]
            seq.kv_writes = []
            self.bm.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.kv_load, seq.tier_looked_up = None, True
            # what its admission counted as found is counted again at the next (the loaded part computed)
            seq.num_cached_tokens, seq.cached_sources, loaded_tokens = seq.counted_before_load
            self.external_hit_tokens -= loaded_tokens
            seq.status = Status.WAITING
            self._enqueue(seq, front=True)

    def update(self, batch: ScheduledBatch, rejected: dict[int, int] | None = None) -> None:
        """After the batch ran: its tokens' K/V are in the cache, and full blocks join the prefix cache.
        rejected: seq_id -> proposed tokens the verification rejected (their K/V does not count).
        Sequences that ended meanwhile are skipped (async scheduling: a step runs sequences that the
        previous step's outputs ended)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += n - (rejected or {}).get(seq.seq_id, 0)
            self.bm.cache_full_blocks(seq, seq.num_computed_tokens)

    def settle(self, seq: Sequence, accepted: int) -> None:
        """A verification, counted as if none of its proposal was accepted (under async scheduling the
        step after it was scheduled so), accepted `accepted` tokens, now appended: their K/V count, full
        blocks join the prefix cache (unless the sequence ended or was preempted meanwhile)."""
        if seq.status is Status.RUNNING:
            seq.num_computed_tokens += accepted
            self.bm.cache_full_blocks(seq, seq.num_computed_tokens)

    def end_speculation(self, seq: Sequence, keep: int = 0) -> None:
        """After a verified proposal was appended: give back the blocks past the sequence's tokens and
        `keep` more (async scheduling: what the step in flight may still write) that only rejected
        tokens used."""
        if not seq.is_finished and seq.status is Status.RUNNING:
            self.bm.trim(seq, seq.num_tokens + keep)

    def _let_go(self, seq: Sequence) -> None:
        """seq's load from outside the cache, not all written, is given up (its sequence ended or was
        preempted): whoever holds its blocks for it may let them go (a prefill engine)."""
        load = seq.kv_load if seq.kv_load is not None else seq.kv_writes[0][2] if seq.kv_writes else None
        if load is not None and self.connector is not None:
            self.connector.abandon(load)
        seq.kv_load, seq.kv_writes = None, []

    def _preempt(self, seq: Sequence) -> None:
        seq.set_spec(None)
        self._let_go(seq)  # (read again when it is admitted again)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.tier_looked_up = False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """End seq wherever it is and free its blocks at once (why it ended is the output processor's)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.set_spec(None)
        self._let_go(seq)
        seq.status = Status.FINISHED

    def launched(self, batch: ScheduledBatch, sampled: list[Sequence], proposed: list[int]) -> None:
        """A step was launched (synchronous scheduling: nothing is counted before its outputs are here)."""

    def arrived(self, seq: Sequence) -> None:
        """The token a sequence awaited from the step in flight is here (synchronous scheduling: none is awaited)."""


class AsyncScheduler(Scheduler):
    """Async scheduling (the step after is scheduled while a step runs): the one writer of the counters
    of tokens in flight. At launch a step's computed tokens are counted and each sequence it samples
    gets a placeholder for its coming token, so that the next step is scheduled with it; a
    verification is counted as if none of its k proposed tokens were accepted, with k unsettled (the
    next step's rows are moved on by the accepted count on the device, and settle() counts them once
    the outputs arrive)."""

    def launched(self, batch: ScheduledBatch, sampled: list[Sequence], proposed: list[int]) -> None:
        self.update(batch, {seq.seq_id: k for seq, k in zip(sampled, proposed) if k})
        for seq, k in zip(sampled, proposed):
            if not seq.is_finished:
                seq.num_placeholders += 1
                seq.num_unsettled = k

    def arrived(self, seq: Sequence) -> None:
        seq.num_placeholders = 0  # its value is here (appended as any token)

    def settle(self, seq: Sequence, accepted: int) -> None:
        seq.num_unsettled = 0
        super().settle(seq, accepted)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        seq.num_placeholders = 0
