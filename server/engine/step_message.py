"""The one per-step message: what the scheduler decided for a step, as every rank's worker needs it to
build that step's tensors itself — rank 0's included: it builds from the same message as the others
(vLLM V1's SchedulerOutput), never from the engine's Sequences.

Typed with msgspec Structs and sent as msgpack bytes over the process group (one length, one byte
tensor: no pickle, no tensor, no ModelInput crosses per step). msgspec because it is a well-kept,
typed, schema-checked encoder of exactly these shapes (lists of ints and small structs), an order of
magnitude faster than pickle or json for them, with no code execution on decode. Rank 0's worker
takes the message in-process, never encoded.

A sequence's tokens and block table are sent in full once (NewSeq), then as deltas (SeqUpdate); each
worker keeps them in its WorkerBatch (the persistent per-rank batch). Each feature is a typed part
of the message, not a branch of the builder: a row's adapter slot, prompt-logprob count and
proposal (tokens known on the host, or a count a drafter fills on the device), the grammar masks of
constrained rows (`GrammarMasks`, rank 0 alone samples), the sampling parameters of a new sequence
(rank 0 only); KV blocks to load and save and adapters to set are messages of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpilot.server.engine.scheduler import ScheduledBatch
from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN, Sequence


class NewSeq(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    token_ids: list[int]            # its known tokens: prompt, then known output
    num_prompt_tokens: int
    block_table: list[int]
    # Rank 0's worker alone (it samples): the request's SamplingParams (in-process, never encoded: None
    # in what the other ranks get) and its generator's seed (None: unseeded).
    params: Any = None
    seed: int | None = None
    window_table: list[int] = []    # a window pool's (block_manager.WindowPool): the sliding-window layers' blocks


class SeqUpdate(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    new_token_ids: list[int]        # known tokens since the last message
    num_blocks_kept: int            # the block table cut to this many (speculation gave blocks back, a preemption all)...
    new_block_ids: list[int]        # ...then these appended
    window_table: list[int] | None = None  # a window pool's table, whole, where it changed (entries out of the window become its null block)


class Row(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    num_placeholders: int
    previous_row: int               # with a placeholder or unsettled tokens: its row among the step in flight's sampled tokens
    spec_token_ids: list[int]       # a proposal known on the host (n-gram, a lookup)...
    num_spec_tokens: int            # ...or a count of tokens a drafter proposes on the device (rank 0)
    num_unsettled: int              # proposed tokens of the verification in flight (their rows shift on the device)
    prompt_logprobs: int            # -1: none; else the top-n of the request's prompt logprobs
    adapter_slot: int               # its LoRA adapter's slot, -1: none


class GrammarMasks(msgspec.Struct, array_like=True, frozen=True):
    """Structured outputs: the allowed tokens of the constrained sequences this step samples, packed 32
    to an int32 word (what the grammar library fills): each sequence's rows (one, or k + 1 with k
    proposed tokens) one after another, in the order of seq_ids."""

    seq_ids: list[int]
    row_counts: list[int]
    words: int                      # int32 words a row
    vocab_size: int
    packed: bytes


class Step(msgspec.Struct, tag="step", array_like=True):
    new: list[NewSeq]
    updates: list[SeqUpdate]
    finished: list[int]             # seq ids the workers can forget
    rows: list[Row]                 # the scheduled sequences, in the scheduler's order
    num_previous_tokens: int        # sampled tokens of the step in flight that rank 0 broadcasts after this (0: none)
    previous_accepted: bool = False  # then as many accepted counts (rows follow a verification in flight)
    grammar: GrammarMasks | None = None  # rank 0 (set once the step's proposals are known: they are masked too)
    drafts_next: bool = True        # rank 0: the next step may carry proposals (a drafter keeps the states they start from)

    def for_other_ranks(self) -> Step:
        """What ranks 1…N−1 get: no sampling parts (rank 0 alone samples)."""
        if not self.new:
            return self
        new = [NewSeq(s.seq_id, s.token_ids, s.num_prompt_tokens, s.block_table, window_table=s.window_table) for s in self.new]
        return Step(new, self.updates, self.finished, self.rows, self.num_previous_tokens, self.previous_accepted)


class SetAdapter(msgspec.Struct, tag="set_adapter", array_like=True, frozen=True):
    slot: int
    path: str | None                # the adapter's directory (each rank reads its share), None: clear the slot


class SavedBlock(msgspec.Struct, array_like=True, frozen=True):
    """A block that joined rank 0's prefix cache: each rank copies its shard to the tiers rank 0 did."""

    block_id: int
    window_block: int               # its row in the sliding-window layers' pool (block_id without one)
    key: bytes
    parent: bytes
    token_ids: list[int]
    to_host: bool
    to_disk: bool


class NixlPeer(msgspec.Struct, array_like=True, frozen=True):
    """A prefill rank's NIXL agent: what a decode rank of the same index reads its shard with (kv_nixl.py)."""

    agent: str
    metadata: bytes
    regions: list[list[int]]        # each cache region's base address, bytes per block and device index


class LoadedBlock(msgspec.Struct, array_like=True, frozen=True):
    """A fresh block of the next step, to fill with this rank's shard of a block from outside the cache."""

    block_id: int
    window_block: int               # its row in the sliding-window layers' pool (block_id without one)
    key: bytes
    parent: bytes
    token_ids: list[int]
    source: str                     # host (the rank's host tier), disk (its shard's file), p2p (read from a prefill rank)
    remote_block: int = -1          # p2p: the prefill engine's block id
    peer: int = -1                  # p2p: its index in KVWork.peers


class KVWork(msgspec.Struct, tag="kv_work", array_like=True, frozen=True):
    """The KV connector's work for ranks 1…N−1 (kv_connector.py): saves (their copies first), then
    loads (every rank then says whether its own went well: a block is loaded on all ranks or none),
    then the host tier's evictions rank 0 decided."""

    saves: list[SavedBlock]
    loads: list[LoadedBlock]
    evicted: list[bytes]
    peers: list[list[NixlPeer]]     # per prefill engine read from: its ranks' agents
    read_seconds: list[float] = []  # per prefill engine: how long its reads may take from the start of the loads (within its hold)


class Describe(msgspec.Struct, tag="describe", array_like=True, frozen=True):
    pass


class DescribePeers(msgspec.Struct, tag="describe_peers", array_like=True, frozen=True):
    """Every rank's NIXL agent (its KV connector's), gathered at rank 0 for decode engines to read from."""


class Stop(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    pass


Message = Step | SetAdapter | KVWork | Describe | DescribePeers | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    num_tokens: int                 # known tokens the workers have
    block_table: list[int]          # the table the workers have
    window_table: list[int]         # and the window pool's


class StepMessenger:
    """The engine's side: turns a scheduled batch into the Step message, remembering what the workers
    already know."""

    def __init__(self) -> None:
        self.sent: dict[int, _Sent] = {}

    def step(self, batch: ScheduledBatch, previous: dict[int, int] | None, num_previous_tokens: int = 0,
             adapter_slots: list[int] | None = None, previous_accepted: bool = False) -> Step:
        """previous: seq_id -> its index among the sampled sequences of the step in flight (async
        scheduling); num_previous_tokens: how many tokens rank 0 broadcasts to the other ranks (0: none),
        previous_accepted: and as many accepted counts."""
        finished = [sid for sid, s in self.sent.items() if s.seq.is_finished]
        for sid in finished:
            del self.sent[sid]
        new, updates, rows = [], [], []
        for seq, n, slot in zip(batch.seqs, batch.num_new_tokens, adapter_slots or [-1] * len(batch.seqs)):
            num_known = seq.num_prompt_tokens + len(seq.output_token_ids)
            sent = self.sent.get(seq.seq_id)
            if sent is None:
                seed = None if seq.params.seed is None else seq.params.seed + seq.index
                new.append(NewSeq(seq.seq_id, seq.token_ids(), seq.num_prompt_tokens, list(seq.block_table), seq.params, seed,
                                  list(seq.window_table)))
                self.sent[seq.seq_id] = _Sent(seq, num_known, list(seq.block_table), list(seq.window_table))
            elif num_known != sent.num_tokens or seq.block_table != sent.block_table or seq.window_table != sent.window_table:
                kept = _common_prefix(sent.block_table, seq.block_table)
                window = list(seq.window_table) if seq.window_table != sent.window_table else None
                updates.append(SeqUpdate(seq.seq_id, seq.output_token_ids[sent.num_tokens - seq.num_prompt_tokens:], kept, seq.block_table[kept:],
                                         window))
                sent.num_tokens, sent.block_table = num_known, list(seq.block_table)
                if window is not None:
                    sent.window_table = window
            prompt_lp = seq.params.prompt_logprobs
            awaits = seq.num_placeholders or seq.num_unsettled
            rows.append(Row(seq.seq_id, seq.num_computed_tokens, n, seq.num_placeholders,
                            previous.get(seq.seq_id, -1) if previous and awaits else -1, list(seq.spec_token_ids), seq.num_spec_tokens,
                            seq.num_unsettled, -1 if prompt_lp is None else prompt_lp, slot))
        return Step(new, updates, finished, rows, num_previous_tokens, previous_accepted)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class RowParams:
    prompt_logprobs: int | None


@dataclass(slots=True)
class BatchSeq:
    """A sequence as a worker knows it (from the messages alone): what InputBuilder and the sampling
    tensors read of it."""

    seq_id: int
    known_token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    params: Any = None              # rank 0: the request's SamplingParams; other ranks: RowParams
    generator: Any = None           # rank 0: its torch.Generator when seeded
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0
    num_unsettled: int = 0
    window_table: list[int] = field(default_factory=list)  # a window pool's table (the sliding-window layers' blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.known_token_ids) + self.num_placeholders

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.known_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.known_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.known_token_ids) - self.num_prompt_tokens + self.num_placeholders

    def tokens_slice(self, start: int, end: int) -> list[int]:
        if end <= len(self.known_token_ids):
            return self.known_token_ids[start:end]
        return (self.known_token_ids + [PLACEHOLDER_TOKEN] * self.num_placeholders + self.spec_token_ids)[start:end]


@dataclass(slots=True)
class StepBatch:
    """One step as a worker runs it: the scheduled sequences (its BatchSeqs, in the scheduler's order),
    their new tokens and adapter slots, and where their awaited tokens come from."""

    seqs: list[BatchSeq]
    num_new_tokens: list[int]
    adapter_slots: list[int]
    previous: dict[int, int]        # seq_id -> its row among the step in flight's sampled tokens
    grammar: GrammarMasks | None = None


class WorkerBatch:
    """Every worker's persistent batch: the sequences the messages told it about, kept up to date by each Step."""

    def __init__(self, sampling_device=None) -> None:
        """sampling_device: rank 0's worker samples there, and makes a seeded sequence's generator there
        (None: no sampling on this rank)."""
        self.seqs: dict[int, BatchSeq] = {}
        self.sampling_device = sampling_device

    def apply(self, step: Step) -> StepBatch:
        for sid in step.finished:
            self.seqs.pop(sid, None)
        for s in step.new:
            generator = _generator(s.seed, self.sampling_device) if self.sampling_device is not None and s.seed is not None else None
            self.seqs[s.seq_id] = BatchSeq(s.seq_id, list(s.token_ids), s.num_prompt_tokens, list(s.block_table), s.params, generator,
                                           window_table=list(s.window_table))
        for u in step.updates:
            seq = self.seqs[u.seq_id]
            seq.known_token_ids += u.new_token_ids
            if u.num_blocks_kept != len(seq.block_table) or u.new_block_ids:
                seq.block_table = seq.block_table[:u.num_blocks_kept] + list(u.new_block_ids)
            if u.window_table is not None:
                seq.window_table = list(u.window_table)
        batch = StepBatch([], [], [], {})
        for row in step.rows:
            seq = self.seqs[row.seq_id]
            seq.num_computed_tokens, seq.num_placeholders, seq.num_unsettled = row.num_computed_tokens, row.num_placeholders, row.num_unsettled
            seq.spec_token_ids, seq.num_spec_tokens = list(row.spec_token_ids), row.num_spec_tokens
            if self.sampling_device is None:
                seq.params = RowParams(None if row.prompt_logprobs < 0 else row.prompt_logprobs)
            if row.previous_row >= 0:
                batch.previous[row.seq_id] = row.previous_row
            batch.seqs.append(seq)
            batch.num_new_tokens.append(row.num_new_tokens)
            batch.adapter_slots.append(row.adapter_slot)
        return batch


def _generator(seed: int, device):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)  # seed + choice index may leave the 64-bit range
    return g
