"""The step boundary: one ModelInput in, one ModelOutput out.

`InputBuilder` turns one step of a worker's batch (`StepBatch`: the Step message applied to the
worker's persistent batch, engine/step_message.py) into tensors once per step, on the CPU side; it
never sees a Sequence, and every rank's worker, rank 0's included, builds its tensors the same way
from the same message. The device side (`Worker.launch`) sees nothing but the ModelInput. Sequences are laid out
prefills first (any number of query rows each: a prompt or a chunk of one), then one-row decodes.
A verification step's k + 1 rows (speculative decoding) are laid out as k + 1 decode rows of the
same block table, row j attending to the cache up to its own position: every row's K/V is stored
before attention runs, so this is exact, and it runs on the batched decode kernel instead of a
per-sequence prefill. The builder also returns a StepPlan saying which sequence (by id) each sampled
or prompt-logprob row belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.kernels.lora import LoRABatch
from kvpilot.server.engine.sampling_params import FLOAT32_MAX

if TYPE_CHECKING:
    from kvpilot.server.engine.step_message import BatchSeq, GrammarMasks, StepBatch


class InputBuffers:
    """The persistent buffers every step's inputs are written into: no allocation per step once warm.

    Per dtype, `turns` arenas used by steps in turn (`begin_step`; two, or one per pipeline stage); a
    step's uploads are carved one after another from its arena, so several inputs of one step (a
    draft model's proposal steps, the verification step, their sampling tensors) never share memory,
    and the next steps write the others: under async scheduling the steps in flight keep their inputs. An arena is a host
    buffer (pinned on CUDA) and its device twin (on CPU the host buffer itself); on CUDA an arena's
    host half is rewritten only once its last copies to the device are done (an event, long done by
    then: a step later). An arena that runs out is replaced by one twice the size; views of the old
    one stay valid."""

    def __init__(self, device: torch.device, capacity: int = 4096, turns: int = 2):
        self.device, self.capacity = device, capacity
        self.cuda = device.type == "cuda"
        self.turn = 0
        self.arenas: list[dict[torch.dtype, _Arena]] = [{} for _ in range(turns)]
        self.copied = [torch.cuda.Event() if self.cuda else None for _ in range(turns)]

    def begin_step(self) -> None:
        """The next step's uploads go to the next arena, from its start."""
        if self.cuda:
            self.copied[self.turn].record()
        self.turn = (self.turn + 1) % len(self.arenas)
        if self.cuda:
            self.copied[self.turn].synchronize()
        for arena in self.arenas[self.turn].values():
            arena.used = 0

    def upload(self, values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host list (or flat CPU tensor) as a device tensor (a view of this step's arena; on CUDA
        copied without blocking)."""
        n = len(values)
        arenas = self.arenas[self.turn]
        arena = arenas.get(dtype)
        if arena is None or arena.used + n > arena.host.numel():
            size = max(self.capacity, n, 2 * arena.host.numel() if arena is not None else 0)
            arena = arenas[dtype] = _Arena(size, dtype, self.device)
        start, arena.used = arena.used, arena.used + n
        host = arena.host[start:start + n]
        host.copy_(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype))
        if not self.cuda:
            return host
        device = arena.device[start:start + n]
        device.copy_(host, non_blocking=True)
        return device


class _Arena:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=dtype, pin_memory=cuda)
        self.device = torch.empty(size, dtype=dtype, device=device) if cuda else self.host
        self.used = 0


class Staging:
    """A step's host lists of one dtype, uploaded together: one host-to-device copy instead of one per
    list, each list coming back as a view of it. A step's inputs are a dozen short lists; uploaded one
    by one, each costs a tensor and a copy launch, host work that lengthens every step
    (bench/host_overhead.py)."""

    def __init__(self, dtype: torch.dtype, buffers: InputBuffers):
        self.dtype, self.buffers = dtype, buffers
        self.values: list = []
        self.spans: list[tuple[int, int]] = []

    def add(self, values: list) -> None:
        """Stage a flat list (upload() returns the lists in the order they were added)."""
        self.spans.append((len(self.values), len(values)))
        self.values += values

    def upload(self) -> list[torch.Tensor]:
        whole = self.buffers.upload(self.values, self.dtype)
        return [whole[start:start + n] for start, n in self.spans]


def _padded(rows: list[list[int]], buffers: InputBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one [rows, longest] tensor (padding points at column 0) and its validity mask."""
    width = max((len(r) for r in rows), default=0)
    ids = buffers.upload([t for r in rows for t in r + [0] * (width - len(r))], torch.long).view(len(rows), width)
    valid = buffers.upload([v for r in rows for v in [True] * len(r) + [False] * (width - len(r))], torch.bool).view(len(rows), width)
    return ids, valid


def _padded_tables(tables: list[list[int]]) -> list[int]:
    """Block tables as one flat [rows x longest] list, padded with block 0 (never read: context lengths stop short)."""
    width = max((len(t) for t in tables), default=0)
    return [b for t in tables for b in (t + [0] * (width - len(t)))]


@dataclass(slots=True)
class Penalties:
    """Repetition/frequency/presence penalties of the sampled rows that have any."""

    rows: torch.Tensor             # [P] long: which sampled rows
    repetition: torch.Tensor       # [P, 1]
    frequency: torch.Tensor        # [P, 1]
    presence: torch.Tensor         # [P, 1]
    output_ids: torch.Tensor       # [P, L] long, padded; output_valid marks the real entries
    output_valid: torch.Tensor
    prompt_ids: torch.Tensor       # [P, L'] long, padded
    prompt_valid: torch.Tensor
    # Async scheduling: [2, R] long: entries of output_ids (flat) that are placeholders, and the row of
    # the previous step's sampled tokens that holds each.
    from_previous: torch.Tensor | None = None


@dataclass(slots=True)
class SamplingTensors:
    """Every sampling parameter of a step's sampled rows, as tensors (host lists only where the host acts).

    A sequence has one sampled row, or k + 1 when it carries k proposed tokens (speculative decoding):
    row j is sampled as if the first j proposed tokens were already output (penalties, min_tokens),
    and is checked against proposed token j (the last row has none: it gives the bonus token)."""

    temperature: torch.Tensor      # [S, 1] (1.0 on greedy rows: they take the argmax)
    top_k: torch.Tensor            # [S] long, <= 0: off
    top_p: torch.Tensor            # [S]
    min_p: torch.Tensor            # [S]
    random_rows: list[int]         # rows that draw at random (the rest are greedy)
    random_index: torch.Tensor     # [R] long: the same rows, on the device (what the sampler indexes with)
    generators: list[torch.Generator | None]  # per random row: its request's generator (seeded) or None
    use_top_k_p: bool              # some random row filters by top-k or top-p (the one sort of a step)
    top_k_bound: int               # every random row has a top-k, this the largest (the filter then needs that many best tokens, not a sort); 0: some has none
    use_min_p: bool                # some random row filters by min-p
    penalties: Penalties | None
    banned_rows: torch.Tensor      # [N] long: (row, token) pairs that min_tokens bans this step
    banned_tokens: torch.Tensor    # [N] long
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # logit_bias: (rows, tokens, values), [B] each
    top_logprobs: list[int | None]  # per row: None (no logprobs) or how many top entries
    row_counts: list[int]          # per sampled sequence: its rows (1, or k + 1 with a proposal)
    draft_token_ids: torch.Tensor | None = None  # [S] long: the proposed token each row checks (-1: none); None: no proposals
    draft_probs: torch.Tensor | None = None      # [len(random_rows), V]: the proposer's distribution for it (None: n-gram, a certain proposal)
    # Structured outputs: the constrained rows and the tokens each may take. None: no row is constrained.
    guided_rows: torch.Tensor | None = None      # [G] long
    allowed: torch.Tensor | None = None          # [G, V] bool
    # With proposals: per sampled sequence, its rows ([S, W] long, the last repeated past its count) and
    # which of them check a proposed token ([S, W] bool): what the accepted counts are read from.
    spec_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, seqs: list[BatchSeq], eos_token_ids: tuple[int, ...], dtype: torch.dtype, buffers: InputBuffers,
              draft_probs: dict[int, torch.Tensor] | None = None, proposing: bool = False,
              previous: dict[int, int] | None = None, grammar: GrammarMasks | None = None) -> SamplingTensors:
        """draft_probs: seq_id -> [k, V] distributions a draft model drew the proposal of a random-sampling
        sequence from. proposing: the rows of a draft model's proposal step instead: one per sequence,
        after its proposed tokens so far, checking nothing. previous: as InputBuilder.build's (a
        sequence awaiting its last token counts it in its penalties from the device). grammar: the masks
        of constrained sequences (the step message's part, made by the engine's grammars); a draft
        model's proposal rows are not masked (the target's verification is)."""
        rows = [(seq, j) for seq in seqs for j in ([len(seq.spec_token_ids)] if proposing else range(len(seq.spec_token_ids) + 1))]
        params = [seq.params for seq, _ in rows]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        use_top_k_p = any(params[i].top_k > 0 or params[i].top_p < 1 for i in random_rows)
        top_k_bound = max(params[i].top_k for i in random_rows) if random_rows and all(params[i].top_k > 0 for i in random_rows) else 0
        use_min_p = any(params[i].min_p > 0 for i in random_rows)
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        penalties = None
        if pen:
            col = lambda values: buffers.upload(values, dtype).unsqueeze(1)  # noqa: E731
            # a row's output so far: the sequence's, then the proposed tokens before the row
            outputs = [rows[i][0].tokens_slice(rows[i][0].num_prompt_tokens, rows[i][0].num_tokens + rows[i][1]) for i in pen]
            out_ids, out_valid = _padded(outputs, buffers)
            prompt_ids, prompt_valid = _padded([rows[i][0].prompt_token_ids for i in pen], buffers)
            awaiting = [(k * out_ids.shape[1] + len(rows[i][0].output_token_ids), previous[rows[i][0].seq_id])
                        for k, i in enumerate(pen) if rows[i][0].num_placeholders]  # the placeholder follows the known output
            penalties = Penalties(buffers.upload(pen, torch.long), col([params[i].repetition_penalty for i in pen]),
                                  col([params[i].frequency_penalty for i in pen]), col([params[i].presence_penalty for i in pen]),
                                  out_ids, out_valid, prompt_ids, prompt_valid,
                                  buffers.upload([a for a, _ in awaiting] + [b for _, b in awaiting], torch.long).view(2, -1) if awaiting else None)
        banned_rows, banned_tokens = [], []
        for row, ((seq, j), p) in enumerate(zip(rows, params)):
            if seq.num_output_tokens + j < p.min_tokens:  # until min_tokens are out, EOS and stop ids cannot be sampled
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                banned_rows += [row] * len(banned)
                banned_tokens += banned
        biased = [(row, token, value) for row, p in enumerate(params) if p.logit_bias for token, value in p.logit_bias.items()]
        # A proposal made on the device is a placeholder here (-1), its tokens filled in there (ModelInput.take_device_values).
        drafts = [seq.spec_token_ids[j] if j < len(seq.spec_token_ids) and not proposing else -1 for seq, j in rows]
        longs, floats = Staging(torch.long, buffers), Staging(dtype, buffers)
        for values in ([p.top_k for p in params], banned_rows, banned_tokens, drafts, random_rows, [b[0] for b in biased], [b[1] for b in biased]):
            longs.add(values)
        # A temperature past float32's range would be inf there, and a banned token's -inf / inf a NaN:
        # it is taken as the largest float32 (sampling as good as uniform, as it asks).
        for values in ([1.0 if p.greedy else min(p.temperature, FLOAT32_MAX) for p in params], [p.top_p for p in params], [p.min_p for p in params],
                       [b[2] for b in biased]):
            floats.add(values)
        (top_k, banned_rows_t, banned_tokens_t, drafts_t, random_index, bias_rows, bias_tokens), (temperature, top_p, min_p, bias_values) = (
            longs.upload(), floats.upload())
        q = None
        if draft_probs and random_rows:
            vocab = next(iter(draft_probs.values())).shape[-1]
            none = torch.zeros(vocab, dtype=dtype, device=buffers.device)

            def q_row(seq: BatchSeq, j: int) -> torch.Tensor:
                if j >= len(seq.spec_token_ids):  # the row after the proposal: checks nothing
                    return none
                if seq.seq_id in draft_probs:
                    return draft_probs[seq.seq_id][j]
                # A proposal known on the host beside the model's (speculative_lookup) is certain: one-hot.
                return none.index_fill(0, buffers.upload([seq.spec_token_ids[j]], torch.long), 1.0)

            q = torch.stack([q_row(*rows[i]) for i in random_rows]).to(dtype)
        guided_rows = allowed = None
        if grammar is not None and not proposing:
            guided_rows, allowed = _allowed_tokens(seqs, grammar, buffers)
        proposed = not proposing and any(seq.spec_token_ids for seq in seqs)
        spec_rows = None
        if proposed:
            counts = [len(seq.spec_token_ids) + 1 for seq in seqs]
            width, first = max(counts), [sum(counts[:i]) for i in range(len(counts))]
            spec_rows = (buffers.upload([f + min(j, c - 1) for f, c in zip(first, counts) for j in range(width)], torch.long).view(len(seqs), width),
                         buffers.upload([j < c - 1 for c in counts for j in range(width)], torch.bool).view(len(seqs), width))
        return cls(temperature.unsqueeze(1), top_k, top_p, min_p, random_rows, random_index, [rows[i][0].generator for i in random_rows],
                   use_top_k_p, top_k_bound, use_min_p, penalties, banned_rows_t, banned_tokens_t, (bias_rows, bias_tokens, bias_values) if biased else None,
                   [p.logprobs for p in params],
                   [1 if proposing else len(seq.spec_token_ids) + 1 for seq in seqs], drafts_t if proposed else None, q,
                   guided_rows, allowed, spec_rows)


def _allowed_tokens(seqs: list[BatchSeq], grammar: GrammarMasks, buffers: InputBuffers) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """The constrained rows of a step (a sequence's rows are consecutive: one, or k + 1 when it
    carries k proposed tokens) and their allowed tokens, from the message's packed masks. They are
    unpacked to one bool per token here, on the host (numpy's unpackbits: ~0.1 ms for 16 rows of 49k
    tokens), because unpacking them with tensor ops in the sampler cost ~4 ms per step on a CPU
    (bench/structured.py)."""
    first, row = {}, 0
    for seq in seqs:
        first[seq.seq_id] = row
        row += len(seq.spec_token_ids) + 1
    rows = [first[sid] + j for sid, count in zip(grammar.seq_ids, grammar.row_counts) for j in range(count)]
    if not rows:
        return None, None
    masks = np.frombuffer(grammar.packed, dtype=np.int32).reshape(len(rows), grammar.words)
    allowed = torch.from_numpy(np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[:, :grammar.vocab_size].copy()).view(torch.bool)
    return buffers.upload(rows, torch.long), buffers.upload(allowed.reshape(-1), torch.bool).view(len(rows), -1)


@dataclass(slots=True)
class PromptLogprobRows:
    """Rows of this step's hidden states whose next-token logprobs are a prompt's (prompt_logprobs)."""

    first_row: int
    target_ids: list[int]          # the prompt token that follows each row
    top_k: int


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor        # [T] long
    positions: torch.Tensor        # [T] long
    slot_mapping: torch.Tensor     # [T] long: the KV-cache slot of each row's K/V
    query_start_loc: torch.Tensor  # [B + 1] long: sequence i's rows are query_start_loc[i]:query_start_loc[i + 1]
    seq_lens: torch.Tensor         # [B] long: tokens in the cache after this step
    block_tables: torch.Tensor     # [B, max blocks] long, padded with 0
    logits_indices: torch.Tensor   # [S] long: rows whose logits are sampled
    num_prefills: int              # the first num_prefills sequences have several query rows (or a whole prompt)
    query_lens: list[int]          # host copies of the prefills' query and context lengths (the CPU attention loop)
    context_lens: list[int]
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    sampling: SamplingTensors | None = None
    # Async scheduling: [2, R] long: input rows whose token the previous step is sampling (the host
    # has a placeholder there), and which of the previous step's sampled sequences it is the last new token of.
    from_previous: torch.Tensor | None = None
    lora: LoRABatch | None = None  # each row's adapter slot (None: no row has an adapter)
    # A proposal made on the device (Proposal): [3, P] long: input row, sampled row, entry of the
    # proposal's flattened tokens. Each such row takes that token and checks it.
    from_proposal: torch.Tensor | None = None
    # Async scheduling with speculation: [3, X] long: rows of sequences whose verification is in flight,
    # their attention entries (an index into seq_lens / block_tables) and which of the previous step's
    # sampled sequences it is. The host laid them out as if nothing was accepted: the device moves each
    # row on by the sequence's accepted count (position, slot, context length).
    shift: torch.Tensor | None = None
    block_size: int = 0
    # An EAGLE-3 head's pass over the step's rows takes each row's next token: the next row's input
    # token, except at a sequence's last row: its sampled token, or for a prefill chunk ([2, C] long:
    # row, token) the prompt's next token. It writes every row's K/V, and runs the whole layer only at
    # the rows a next proposal starts from (head_states: wanted at all; sample_entries: [S] long, each
    # sampled row's attention entry, so that those rows attend as decode rows).
    chunk_next: torch.Tensor | None = None
    sample_entries: torch.Tensor | None = None
    head_states: bool = True
    # A window pool (block_manager.WindowPool): the sliding-window layers' slots [T] and tables [B, max blocks], as the above.
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None

    def take_device_values(self, tokens: torch.Tensor | None, accepted: torch.Tensor | None = None,
                           proposal: torch.Tensor | None = None) -> None:
        """What the host left as placeholders, filled on the device: tokens the previous step is
        sampling (`tokens`: each of its sampled sequences' last new token; the input rows, and the
        output ids that penalties count), the rows shifted by the previous step's `accepted` counts,
        and the tokens of a proposal made on the device."""
        fills = [(self.input_ids, self.from_previous)]
        if self.sampling is not None and self.sampling.penalties is not None:
            fills.append((self.sampling.penalties.output_ids.view(-1), self.sampling.penalties.from_previous))
        for target, index in fills:
            if index is None:
                continue
            if tokens is None:
                raise AssertionError("this step takes tokens from the previous step, and none were given")
            at, source = index
            target[at] = tokens[source]
        if self.shift is not None:
            if accepted is None:
                raise AssertionError("this step's rows follow a verification in flight, and no accepted counts were given")
            rows, entries, source = self.shift
            moved = self.positions[rows] + accepted[source]
            self.positions[rows] = moved
            self.seq_lens[entries] = self.seq_lens[entries] + accepted[source]
            self.slot_mapping[rows] = self.block_tables[entries, moved // self.block_size] * self.block_size + moved % self.block_size
            if self.window_block_tables is not None:
                self.window_slot_mapping[rows] = self.window_block_tables[entries, moved // self.block_size] * self.block_size + moved % self.block_size
        if self.from_proposal is not None:
            if proposal is None:
                raise AssertionError("this step verifies a proposal made on the device, and none was given")
            rows, sampled, entry = self.from_proposal
            drafted = proposal.reshape(-1)[entry]
            self.input_ids[rows] = drafted
            if self.sampling is not None:  # (tensor-parallel ranks other than 0 verify nothing: they only compute the rows)
                self.sampling.draft_token_ids[sampled] = drafted

    def next_token_ids(self, sampled: torch.Tensor | None) -> torch.Tensor:
        """Each row's next token (an EAGLE-3 head's input over the step's rows), given the step's
        sampled tokens per sampled row. A verification's rows past its accepted ones get tokens that
        were not chosen: their K/V is rewritten before it is read."""
        nxt = torch.zeros_like(self.input_ids)
        nxt[:-1] = self.input_ids[1:]
        if self.chunk_next is not None:
            nxt[self.chunk_next[0]] = self.chunk_next[1]
        if sampled is not None:
            nxt[self.logits_indices] = sampled
        return nxt


@dataclass(slots=True)
class Proposal:
    """Proposed tokens made on the device (a draft model's, an EAGLE-3 head's): the host has placeholders."""

    tokens: torch.Tensor                    # [S, W] long: row i is a proposing sequence's (padded past its count)
    index: dict[int, int]                   # seq_id -> its row
    probs: dict[int, torch.Tensor] | None   # seq_id -> [k, V]: what a random-sampling sequence's tokens were drawn from
    host_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> its tokens, where a mask or penalty needs them on the host


@dataclass(slots=True)
class StepPlan:
    """The key to a step's outputs: the sequence (seq_id) of each sampled row and each prompt-logprob span."""

    sampled: list[int]
    prompt_logprobs: list[tuple[int, int]]  # with the prompt position of the span's first row
    proposed: list[int] = field(default_factory=list)  # per sampled sequence: the tokens it verifies (0: none)


@dataclass(slots=True)
class ModelOutput:
    token_ids: list[list[int]]                       # per sampled row: the tokens to append (one, or several when speculating)
    logprobs: list[list[dict[int, float]] | None]    # per sampled row, per token: {token id: logprob}
    errors: dict[int, str] = field(default_factory=dict)  # sampled row -> why it could not be sampled
    prompt_logprobs: list[list[dict[int, float]]] = field(default_factory=list)  # per PromptLogprobRows


class InputBuilder:
    def __init__(self, block_size: int, eos_token_ids: tuple[int, ...], device: torch.device, steps_in_flight: int = 1):
        """steps_in_flight: how many launched steps may not have been waited for (pipeline stages): each keeps its inputs."""
        self.block_size, self.eos_token_ids = block_size, eos_token_ids
        self.window_pool = False  # the worker's model has a window pool: inputs carry its slots and tables (BatchSeq.window_table)
        self.buffers = InputBuffers(device, turns=max(2, steps_in_flight + 1))

    def build(self, batch: StepBatch, proposal: Proposal | None = None, sample: bool = True,
              next_tokens: bool = False) -> tuple[ModelInput, StepPlan]:
        """batch: the step (its message applied to the worker's batch). Each sequence's LoRA slot (-1:
        none) lays its rows out next to those of others with its slot (prefills and decodes each
        grouped by slot), so that each slot's rows are few runs; batch.previous: seq_id -> its index
        among the sampled sequences of the step in flight, for sequences awaiting its tokens.
        proposal: the proposed tokens made on the device (their sequences hold placeholders), and what
        random-sampling ones were drawn from (see SamplingTensors.build). sample=False: no
        SamplingTensors (tensor-parallel ranks other than 0). next_tokens: the input says each row's
        next token where the host knows it (an EAGLE-3 head's pass: chunk_next)."""
        self.buffers.begin_step()
        bs = self.block_size
        slot_of = batch.adapter_slots
        previous = batch.previous or None
        order = sorted(range(len(batch.seqs)), key=lambda i: (batch.num_new_tokens[i] == 1 or batch.seqs[i].num_spec_tokens > 0, slot_of[i]))
        row_slots: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        window_slots: list[int] = []
        window_tables: list[list[int]] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        plan = StepPlan([], [])
        sampled: list[BatchSeq] = []
        prompt_lp: list[PromptLogprobRows] = []
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        proposed_rows: list[list[int]] = [[], [], []]
        shifted: list[list[int]] = [[], [], []]
        chunk_next: list[list[int]] = [[], []]
        sample_entries: list[int] = []
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            row0 = len(ids)
            ids += seq.tokens_slice(start, start + n)
            row_slots += [slot_of[i]] * n
            if seq.num_placeholders:  # its last known-count token, the placeholder, is one this step computes
                if not start < seq.num_tokens <= start + n or previous is None or seq.seq_id not in previous:
                    raise AssertionError(f"sequence {seq.seq_id} awaits a token that no step in flight samples")
                placeholder_rows.append(row0 + seq.num_tokens - 1 - start)
                previous_rows.append(previous[seq.seq_id])
            pos = range(start, start + n)
            positions += pos
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in pos]
            if self.window_pool:
                window_slots += [seq.window_table[p // bs] * bs + p % bs for p in pos]
            if seq.num_unsettled:  # every row moves on by the accepted count of the verification in flight
                shifted[0] += range(row0, row0 + n)
                shifted[1] += range(len(seq_lens), len(seq_lens) + (n if seq.num_spec_tokens else 1))
                shifted[2] += [previous[seq.seq_id]] * n
            if seq.num_spec_tokens:  # a verification: k + 1 decode rows (one per position), each one sampled
                if len(seq.spec_token_ids) != seq.num_spec_tokens or start + n != seq.num_tokens + seq.num_spec_tokens:
                    raise AssertionError(f"sequence {seq.seq_id}: the proposal does not match the tokens scheduled")
                if proposal is not None and seq.seq_id in proposal.index:
                    k, entry = seq.num_spec_tokens, proposal.index[seq.seq_id] * proposal.tokens.shape[1]
                    proposed_rows[0] += range(row0 + 1, row0 + 1 + k)
                    proposed_rows[1] += range(len(sample_rows), len(sample_rows) + k)
                    proposed_rows[2] += range(entry, entry + k)
                starts += range(row0 + 1, len(ids) + 1)
                seq_lens += [p + 1 for p in pos]
                tables += [table] * n
                window_tables += [seq.window_table] * (n if self.window_pool else 0)
                sample_entries += range(len(seq_lens) - n, len(seq_lens))
                sample_rows += range(row0, len(ids))
                sampled.append(seq)
                plan.sampled.append(seq.seq_id)
                plan.proposed.append(seq.num_spec_tokens)
                continue
            starts.append(len(ids))
            seq_lens.append(start + n)
            tables.append(table)
            if self.window_pool:
                window_tables.append(seq.window_table)
            if n > 1:
                query_lens.append(n)
                context_lens.append(start + n)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                prompt_lp.append(PromptLogprobRows(row0, seq.prompt_token_ids[start + 1:start + 1 + count], seq.params.prompt_logprobs))
                plan.prompt_logprobs.append((seq.seq_id, start))
            if start + n == seq.num_tokens:
                sample_entries.append(len(seq_lens) - 1)
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
                plan.sampled.append(seq.seq_id)
                plan.proposed.append(0)
            elif next_tokens:
                # (a token still in flight, after a preemption, is not known here: 0 stands in, costing the head's K/V at one position its accuracy)
                chunk_next[0].append(len(ids) - 1)
                chunk_next[1].append(max(seq.tokens_slice(start + n, start + n + 1)[0], 0))
        staged = Staging(torch.long, self.buffers)
        for values in (ids, positions, slots, starts, seq_lens, sample_rows, placeholder_rows + previous_rows, _padded_tables(tables),
                       [r for part in proposed_rows for r in part], [r for part in shifted for r in part], [r for part in chunk_next for r in part],
                       sample_entries if next_tokens else [], window_slots, _padded_tables(window_tables)):
            staged.add(values)
        (ids_t, positions_t, slots_t, starts_t, seq_lens_t, rows_t, previous_t, tables_t, proposed_t, shifted_t, chunk_t, entries_t,
         window_slots_t, window_tables_t) = staged.upload()
        inp = ModelInput(
            input_ids=ids_t, positions=positions_t, slot_mapping=slots_t, query_start_loc=starts_t, seq_lens=seq_lens_t,
            block_tables=tables_t.view(len(tables), -1) if tables else tables_t.view(0, 0), logits_indices=rows_t,
            num_prefills=len(query_lens), query_lens=query_lens, context_lens=context_lens, prompt_logprobs=prompt_lp,
            sampling=SamplingTensors.build(sampled, self.eos_token_ids, torch.float32, self.buffers, proposal.probs if proposal else None,
                                           previous=previous, grammar=batch.grammar)
            if sampled and sample else None,
            from_previous=previous_t.view(2, -1) if placeholder_rows else None,
            lora=self._lora_batch(row_slots) if slot_of and max(slot_of) >= 0 else None,
            from_proposal=proposed_t.view(3, -1) if proposed_rows[0] else None, shift=shifted_t.view(3, -1) if shifted[0] else None,
            block_size=bs, chunk_next=chunk_t.view(2, -1) if chunk_next[0] else None, sample_entries=entries_t if next_tokens else None,
            window_slot_mapping=window_slots_t if self.window_pool else None,
            window_block_tables=window_tables_t.view(len(window_tables), -1) if self.window_pool and window_tables else
            window_tables_t.view(0, 0) if self.window_pool else None)
        return inp, plan

    def _lora_batch(self, row_slots: list[int]) -> LoRABatch:
        runs: list[tuple[int, int, int]] = []
        for row, slot in enumerate(row_slots):
            if runs and runs[-1][0] == slot and runs[-1][2] == row:
                runs[-1] = (slot, runs[-1][1], row + 1)
            else:
                runs.append((slot, row, row + 1))
        return LoRABatch(self.buffers.upload(row_slots, torch.long), [r for r in runs if r[0] >= 0])

    def build_decode(self, seqs: list[BatchSeq], positions: list[int], input_ids: torch.Tensor, shift: torch.Tensor | None = None) -> ModelInput:
        """A decode-only step of a proposer (a draft model's or an EAGLE-3 head's): one row per sequence
        at the given positions, taking `input_ids` (on the device), all rows' logits wanted. shift: per
        row, positions to move on by on the device (the accepted count of a verification in flight)."""
        bs = self.block_size
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        staged = Staging(torch.long, self.buffers)
        for values in (positions, slots, list(range(len(seqs) + 1)), [p + 1 for p in positions], _padded_tables([s.block_table for s in seqs])):
            staged.add(values)
        positions_t, slots_t, starts_t, seq_lens_t, tables_t = staged.upload()
        inp = ModelInput(input_ids=input_ids, positions=positions_t, slot_mapping=slots_t, query_start_loc=starts_t, seq_lens=seq_lens_t,
                         block_tables=tables_t.view(len(seqs), -1), logits_indices=starts_t[:-1], num_prefills=0, query_lens=[], context_lens=[],
                         block_size=bs)
        if shift is not None:
            rows = torch.arange(len(seqs), device=shift.device)
            inp.shift = torch.stack([rows, rows, rows])
            inp.take_device_values(None, shift)
            inp.shift = None
        return inp
