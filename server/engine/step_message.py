"""The one per-step message: what the scheduler decided for a step, as every tensor-parallel rank needs
it to build that step's tensors itself (rank 0 builds its own from the same decisions).

Typed with msgspec Structs and sent as msgpack bytes over the process group (one length, one byte
tensor: no pickle, no tensor, no ModelInput crosses per step). msgspec because it is a well-kept,
typed, schema-checked encoder of exactly these shapes (lists of ints and small structs), an order of
magnitude faster than pickle or json for them, with no code execution on decode.

A sequence's tokens and block table are sent in full once (NewSeq), then as deltas (SeqUpdate); each
rank keeps them in a RankMirror. Rows carry the per-row fields that later features extend (a
constraint handle, an adapter slot, KV loads and saves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvpilot.server.engine.scheduler import ScheduledBatch
from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN, Sequence


class NewSeq(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    token_ids: list[int]            # its known tokens: prompt, then known output
    num_prompt_tokens: int
    block_table: list[int]


class SeqUpdate(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    new_token_ids: list[int]        # known tokens since the last message
    num_blocks_kept: int            # the block table cut to this many (speculation gave blocks back, a preemption all)...
    new_block_ids: list[int]        # ...then these appended


class Row(msgspec.Struct, array_like=True, frozen=True):
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    num_placeholders: int
    previous_row: int               # with a placeholder: its row among the step in flight's sampled tokens
    spec_token_ids: list[int]
    num_spec_tokens: int
    prompt_logprobs: int            # -1: none; else the top-n of the request's prompt logprobs
    adapter_slot: int               # its LoRA adapter's slot, -1: none


class Step(msgspec.Struct, tag="step", array_like=True, frozen=True):
    new: list[NewSeq]
    updates: list[SeqUpdate]
    finished: list[int]             # seq ids the ranks can forget
    rows: list[Row]                 # the scheduled sequences, in the scheduler's order
    num_previous_tokens: int        # sampled tokens of the step in flight that rank 0 broadcasts after this (0: none)


class SetAdapter(msgspec.Struct, tag="set_adapter", array_like=True, frozen=True):
    slot: int
    path: str | None                # the adapter's directory (each rank reads its share), None: clear the slot


class BlockRef(msgspec.Struct, array_like=True, frozen=True):
    block_id: int
    key: bytes
    parent: bytes
    token_ids: list[int]


class SaveBlocks(msgspec.Struct, tag="save_blocks", array_like=True, frozen=True):
    blocks: list[BlockRef]          # just joined rank 0's prefix cache: each rank saves its shard to the disk tier


class LoadBlocks(msgspec.Struct, tag="load_blocks", array_like=True, frozen=True):
    block_ids: list[int]            # fresh blocks of the next step...
    shards: list[list[bytes]]       # ...filled with rank r's K/V read from the disk tier: shards[r - 1][i] (rank 0 keeps its own)


class Describe(msgspec.Struct, tag="describe", array_like=True, frozen=True):
    pass


class Stop(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    pass


Message = Step | SetAdapter | SaveBlocks | LoadBlocks | Describe | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    num_tokens: int                 # known tokens the ranks have
    block_table: list[int]          # the table the ranks have


class StepMessenger:
    """Rank 0: turns a scheduled batch into the Step message, remembering what the ranks already know."""

    def __init__(self) -> None:
        self.sent: dict[int, _Sent] = {}

    def step(self, batch: ScheduledBatch, previous: dict[int, int] | None, num_previous_tokens: int, adapter_slots: list[int] | None = None) -> Step:
        finished = [sid for sid, s in self.sent.items() if s.seq.is_finished]
        for sid in finished:
            del self.sent[sid]
        new, updates, rows = [], [], []
        for seq, n, slot in zip(batch.seqs, batch.num_new_tokens, adapter_slots or [-1] * len(batch.seqs)):
            num_known = seq.num_prompt_tokens + len(seq.output_token_ids)
            sent = self.sent.get(seq.seq_id)
            if sent is None:
                new.append(NewSeq(seq.seq_id, seq.token_ids(), seq.num_prompt_tokens, list(seq.block_table)))
                self.sent[seq.seq_id] = _Sent(seq, num_known, list(seq.block_table))
            elif num_known != sent.num_tokens or seq.block_table != sent.block_table:
                kept = _common_prefix(sent.block_table, seq.block_table)
                updates.append(SeqUpdate(seq.seq_id, seq.output_token_ids[sent.num_tokens - seq.num_prompt_tokens:], kept, seq.block_table[kept:]))
                sent.num_tokens, sent.block_table = num_known, list(seq.block_table)
            prompt_lp = seq.params.prompt_logprobs
            rows.append(Row(seq.seq_id, seq.num_computed_tokens, n, seq.num_placeholders,
                            previous.get(seq.seq_id, -1) if previous else -1, list(seq.spec_token_ids), seq.num_spec_tokens,
                            -1 if prompt_lp is None else prompt_lp, slot))
        return Step(new, updates, finished, rows, num_previous_tokens)


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
class RankSeq:
    """A sequence as a rank other than 0 knows it: what InputBuilder reads of a Sequence."""

    seq_id: int
    known_token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0
    params: RowParams = field(default_factory=lambda: RowParams(None))
    num_unsettled: int = 0  # always: proposals made on the device (draft, eagle3) run on one rank only

    @property
    def num_tokens(self) -> int:
        return len(self.known_token_ids) + self.num_placeholders

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.known_token_ids[:self.num_prompt_tokens]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        return (self.known_token_ids + [PLACEHOLDER_TOKEN] * self.num_placeholders + self.spec_token_ids)[start:end]


class RankMirror:
    """Ranks 1…N−1: the sequences rank 0 has told them about, kept up to date by each Step."""

    def __init__(self) -> None:
        self.seqs: dict[int, RankSeq] = {}

    def apply(self, step: Step) -> tuple[ScheduledBatch, dict[int, int], list[int]]:
        """The step's batch over this rank's mirrors, seq_id -> previous row for its placeholders, and
        each sequence's adapter slot."""
        for sid in step.finished:
            self.seqs.pop(sid, None)
        for s in step.new:
            self.seqs[s.seq_id] = RankSeq(s.seq_id, list(s.token_ids), s.num_prompt_tokens, list(s.block_table))
        for u in step.updates:
            seq = self.seqs[u.seq_id]
            seq.known_token_ids += u.new_token_ids
            seq.block_table = seq.block_table[:u.num_blocks_kept] + list(u.new_block_ids)
        batch, previous, slots = ScheduledBatch(), {}, []
        for row in step.rows:
            seq = self.seqs[row.seq_id]
            seq.num_computed_tokens, seq.num_placeholders = row.num_computed_tokens, row.num_placeholders
            seq.spec_token_ids, seq.num_spec_tokens = list(row.spec_token_ids), row.num_spec_tokens
            seq.params = RowParams(None if row.prompt_logprobs < 0 else row.prompt_logprobs)
            if row.previous_row >= 0:
                previous[row.seq_id] = row.previous_row
            batch.seqs.append(seq)
            batch.num_new_tokens.append(row.num_new_tokens)
            slots.append(row.adapter_slot)
        return batch, previous, slots
