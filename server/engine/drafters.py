"""The proposers that draft on the device, each owning its model and that model's KV cache: a draft
model (`DraftModel`) and an EAGLE-3 head (`Eagle3`). They live on rank 0's worker, which runs them
around the target's forward: `propose` before it (k decode steps of their own, for the rows the
Step message gives a count of proposed tokens), `after_target` right after it (their cache follows
the target's: every row of every step). Which sequences get a proposal, how long, and the off-switch
are the engine's (engine/spec_decode.py).

Under tensor parallelism a draft model is either whole on rank 0 (its proposals broadcast to the other
ranks with the step) or split over the ranks as the target is (`collective`): then every rank's worker
holds a shard and runs its steps, rank 0's proposing (drawing the tokens) and the others following
(`follow`) from the inputs rank 0 broadcasts. An EAGLE-3 head is one layer: whole on rank 0.

Their caches share the target's block tables (the same block ids index both: the block manager
needs no second account) and are carved from the same budget (Worker: a block costs the target's
bytes plus the drafter's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from kvpilot.kernels.paged_attention import FP8_KV, AttentionMetadata, kv_cache_zeros
from kvpilot.server.engine.decode_graphs import DecodeGraphs
from kvpilot.server.engine.model_io import ModelInput, Proposal, SamplingTensors, StepPlan
from kvpilot.server.engine.sampler import PendingSample
from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN
from kvpilot.server.engine.step_message import BatchSeq, StepBatch
from kvpilot.server.engine.worker import LaunchedStep, Worker, kv_block_bytes, projection_bytes
from kvpilot.server.models.decoder import DecoderModel, WeightSource, read_embedding
from kvpilot.server.models.eagle import Eagle3Head, load_head

# (the target worker's DecodeGraphs for a step function): a drafter's graphs, sized as the target's
GraphsFactory = Callable[[Callable], DecodeGraphs]


class Drafter:
    """What both drafters share: k decode steps of their own (all proposing sequences batched), each
    token drawn with the request's own sampling parameters, so that verification can compare the two
    distributions. Under async scheduling the first step starts from the step in flight's tokens and
    accepted counts, on the device: step n + 1's proposal never waits for step n's tokens to reach
    the host."""

    reads_hidden_states = False     # whether it reads the target's hidden states (its decode steps then run eagerly)
    collective = False              # split over the tensor-parallel ranks: every rank runs its steps (their collectives pair up)

    def __init__(self, worker: Worker):
        # The worker's parts it uses, not the worker (which holds it: no reference cycle keeps a dropped
        # engine's caches alive until a garbage collection).
        self.device, self.inputs, self.sampler, self.batch = worker.device, worker.inputs, worker.sampler, worker.batch
        self.block_size, self.kv_dtype = worker.block_size, worker.kv_dtype

    def block_bytes(self) -> int:
        """Its KV cache's bytes per block (beside the target's)."""
        raise NotImplementedError

    def allocate(self, num_blocks: int) -> None:
        """Its KV cache of num_blocks blocks (and the scratch block)."""
        raise NotImplementedError

    def cache_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Its KV cache's (keys, values) per layer, indexed by the target's block ids: a block saved to a
        KV tier or handed to a decode engine carries them with the target's (the drafter's cache of a
        loaded prefix is moved, not recomputed)."""
        raise NotImplementedError

    def profiled_models(self) -> list[DecoderModel]:
        """Models whose activations the CUDA budget reserves beside the target's."""
        return []

    def describe(self) -> dict:
        """What it holds on this rank (Worker.describe)."""
        return {}

    def start_graphs(self, graphs: GraphsFactory) -> None:
        """Its decode steps through graphs of the target worker's sizes (CUDA)."""

    def after_target(self, inp: ModelInput, aux: torch.Tensor | None, sample: PendingSample | None):
        """Right after the target's forward over a step's rows (aux: the target's declared aux output)."""
        raise NotImplementedError

    def launched(self, plan: StepPlan, launched: LaunchedStep) -> None:
        """A step was launched (its outputs still on the device)."""

    def propose(self, batch: StepBatch, previous: LaunchedStep | None) -> Proposal | None:
        """The proposals of the step's sequences that carry a count and no tokens, on the device (their
        tokens are placeholders; known on the host too where a sequence's masks or penalties need them),
        and the distributions random-sampling sequences' tokens were drawn from."""
        seqs = [s for s in batch.seqs if s.num_spec_tokens and not s.spec_token_ids]
        if not seqs:
            return None
        host = any(s.params.structured is not None or s.params.has_penalties for s in seqs)
        width = max(s.num_spec_tokens for s in seqs)
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
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
        return Proposal(tokens, index, {sid: torch.stack(rows) for sid, rows in probs.items()} or None,
                        {s.seq_id: list(s.spec_token_ids) for s in seqs} if host else {})

    def draft_steps(self, seqs: list[BatchSeq], previous: LaunchedStep | None) -> Iterator:
        """Yield, for draft step i = 0, 1, …: (the rows of `seqs` proposing more than i tokens, their i-th
        proposed tokens, the random rows' distributions, the draw's SamplingTensors)."""
        raise NotImplementedError

    @staticmethod
    def _narrow(seqs: list[BatchSeq], rows: list[int], i: int) -> tuple[list[int], list[int]]:
        """Of `rows` (of `seqs`), those proposing more than i tokens: (their places in `rows`, the rows)."""
        keep = [j for j, r in enumerate(rows) if seqs[r].num_spec_tokens > i]
        return keep, [rows[j] for j in keep]

    def _draw_rows(self, active: list[BatchSeq]) -> SamplingTensors | None:
        """Each row drawn as the target will judge it: with the proposed tokens so far counted as output.
        None: every row is greedy with nothing that changes its logits (the argmax alone)."""
        plain = all(s.params.greedy and not s.params.has_penalties and not s.params.logit_bias and s.params.structured is None
                    and s.num_output_tokens >= s.params.min_tokens for s in active)
        return None if plain else SamplingTensors.build(active, self.inputs.eos_token_ids, torch.float32, self.inputs.buffers, proposing=True)

    def _index(self, values: list[int]) -> torch.Tensor:
        """A host list as a device index (staged like a step's inputs: a plain torch.tensor to a GPU
        would wait for the step in flight)."""
        return self.inputs.buffers.upload(values, torch.long)

    def _in_flight(self, seqs: list[BatchSeq], previous: LaunchedStep | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per sequence, from the step in flight, on the device: its last new token (where the host has
        a placeholder; else -1) and how many positions on its rows are (the accepted count of its
        verification; else 0). (None, None) without a step in flight."""
        if previous is None:
            return None, None
        where = {sid: i for i, sid in enumerate(previous.plan.sampled)}
        at = self._index([where.get(s.seq_id, -1) if s.num_placeholders else -1 for s in seqs])
        tokens = torch.where(at >= 0, previous.tokens[at.clamp(min=0)], -1)
        counts = previous.accepted_counts
        if counts is None:
            return tokens, None
        at = self._index([where.get(s.seq_id, -1) if s.num_unsettled else -1 for s in seqs])
        return tokens, torch.where(at >= 0, counts[at.clamp(min=0)], 0)


class DraftModel(Drafter):
    """A small model sharing the tokenizer drafts k tokens. Its cache is filled by running every
    target step's rows too (after_target), so proposing needs only the k new rows: the first takes the
    sequence's last token, each further one the token drafted before it. Kept dense (it is small).

    split (tensor parallelism): sharded over the ranks as the target is (its KV heads' cache on each);
    else whole on this worker (rank 0)."""

    def __init__(self, worker: Worker, weights: WeightSource, split: bool = False, announce: Callable[[bool], None] | None = None):
        """announce (rank 0 of a split draft): tells the other ranks, before each draft step, that rank 0's
        own work before it went well (engine/parallel.py Workers.say)."""
        super().__init__(worker)
        self.collective = split and worker.tp is not None
        self.announce = announce
        self.model = worker.load(weights, "none", shard=self.collective)
        if worker.kv_dtype == FP8_KV:
            worker.set_kv_scales(self.model, weights)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None  # its proposal steps

    def block_bytes(self) -> int:
        return kv_block_bytes(self.model, self.block_size, self.kv_dtype)

    def allocate(self, num_blocks: int) -> None:
        c = self.model.config
        shape = (num_blocks + 1, self.block_size, self.model.num_kv_heads, c.head_dim)
        self.kv_caches = [(kv_cache_zeros(shape, self.kv_dtype, self.device), kv_cache_zeros(shape, self.kv_dtype, self.device))
                          for _ in range(c.num_layers)]

    def cache_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_caches

    def profiled_models(self) -> list[DecoderModel]:
        return [self.model]

    def describe(self) -> dict:
        return {"draft_projection_bytes": projection_bytes(self.model), "draft_kv_heads": self.model.num_kv_heads}

    def start_graphs(self, graphs: GraphsFactory) -> None:
        self.graphs = graphs(self._logits)

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A proposal step as its graphs run it: every row's logits."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def after_target(self, inp: ModelInput, aux: torch.Tensor | None, sample: PendingSample | None) -> None:
        """The draft over the target's rows: its cache holds every token the target's does (a decode
        step through its graphs, whose logits go unread)."""
        if self.graphs is not None and self.graphs.takes(inp):
            self.graphs.run(inp)
        else:
            self.model(inp.input_ids, inp.positions, self.kv_caches, AttentionMetadata.from_input(inp))

    def draft_steps(self, seqs: list[BatchSeq], previous: LaunchedStep | None):
        last, shift = self._in_flight(seqs, previous)
        known = self._index([s.tokens_slice(s.num_computed_tokens, s.num_computed_tokens + 1)[0] for s in seqs])
        ids = known if last is None else torch.where(last >= 0, last, known)
        rows = list(range(len(seqs)))
        for i in range(max(s.num_spec_tokens for s in seqs)):
            keep, rows = self._narrow(seqs, rows, i)
            active = [seqs[r] for r in rows]
            sampling = self._draw_rows(active)
            if self.collective:  # rank 0's own work went well: the shards' step, from the same tokens (and first shifts)
                self.announce(True)
                shared = torch.stack([ids, shift if shift is not None else torch.zeros_like(ids)]) if i == 0 else ids.contiguous()
                dist.broadcast(shared, src=0)
            inp = self.inputs.build_decode(active, [s.num_computed_tokens + i for s in active], ids[self._index(keep)],
                                           shift[self._index(rows)] if shift is not None else None)
            inp.sampling = sampling
            ids, q = self._propose_step(inp)
            yield rows, ids, q, sampling

    @torch.inference_mode()
    def follow(self, seqs: list[BatchSeq], heard: Callable[[], bool]) -> bool:
        """Ranks 1…N−1 of a split draft model: rank 0's draft steps over `seqs` (the step's proposing
        sequences), their collectives paired with rank 0's, from the tokens rank 0 broadcasts (its first
        inputs and shifts, then each step's drawn tokens); the logits are all-gathered, not drawn from.
        heard(): rank 0's word before each step; False (rank 0 failed before it): the step is dropped."""
        rows = list(range(len(seqs)))
        for i in range(max(s.num_spec_tokens for s in seqs)):
            drawn_rows = len(rows)  # the previous step's drawn tokens: one per row it had
            keep, rows = self._narrow(seqs, rows, i)
            active = [seqs[r] for r in rows]
            if not heard():
                return False
            if i == 0:
                first = torch.empty(2, len(seqs), dtype=torch.long, device=self.device)
                dist.broadcast(first, src=0)
                ids, shift = first[0], first[1]
            else:
                ids = torch.empty(drawn_rows, dtype=torch.long, device=self.device)
                dist.broadcast(ids, src=0)
            inp = self.inputs.build_decode(active, [s.num_computed_tokens + i for s in active], ids[self._index(keep)], shift[self._index(rows)])
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, AttentionMetadata.from_input(inp))
            self.model.compute_logits(hidden[inp.logits_indices])
        return True

    @torch.inference_mode()
    def _propose_step(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the draft model (it writes its own cache) and its draw per row."""
        if self.graphs is not None and self.graphs.takes(inp):
            return self.sampler.propose(self.graphs.run(inp), inp.sampling)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, AttentionMetadata.from_input(inp))
        return self.sampler.propose(self.model.compute_logits(hidden[inp.logits_indices]), inp.sampling)


class Eagle3(Drafter):
    """An EAGLE-3 head (server/models/eagle.py) drafts from the target's own hidden states, which the
    target's forward gives as a declared output (DecoderModel.declare_aux_output). Every step the head
    runs over all of that step's rows, on the device right after the target (its K/V cache stays as
    complete as the target's whether or not anything is proposed — above the batch threshold too —
    for about one target layer's cost) and keeps, per sampled sequence, its output at the row before
    the sequence's last new token: that gives the first proposed token, and each further one is a
    decode step of the head fed its own output."""

    reads_hidden_states = True

    def __init__(self, worker: Worker, head_path: str, target_weights: WeightSource | None = None):
        super().__init__(worker)
        target = worker.model
        # The head embeds its tokens with the target's table: a tensor-parallel rank holds only its vocabulary
        # shard of it, so rank 0 keeps the whole table beside (the residual stream the head reads is whole on every rank).
        embed = target.embed if worker.tp is None else read_embedding(target_weights, worker.dtype, worker.device, worker.quantization)
        # A quantized target's head is int8 too: a head step reads its weights once per row batch, so,
        # as the target's, it is bound by their bytes (float32: ~1.8 ms of a ~9 ms decode step on a
        # CPU for the bundled model's head; bench/history/).
        self.head: Eagle3Head = load_head(head_path, target.config, embed, worker.device, worker.dtype, int8=worker.quantization != "none")
        target.declare_aux_output(self.head.config.aux_layers)
        # An FP8 target cache: the head's one layer keeps its cache in the compute dtype.
        self.kv_dtype = worker.dtype if worker.kv_dtype == FP8_KV else worker.kv_dtype
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scratch_block = 0      # the worker's (set by allocate): the head's pass writes recomputed K/V there
        # seq_id -> (the head's normed and prenorm outputs of a step, the sequence's row there)
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def block_bytes(self) -> int:
        c = self.head.config
        return 2 * self.block_size * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=self.kv_dtype).element_size()

    def cache_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.kv_cache]

    def allocate(self, num_blocks: int) -> None:
        self.scratch_block = num_blocks
        c = self.head.config
        shape = (num_blocks + 1, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = (kv_cache_zeros(shape, self.kv_dtype, self.device), kv_cache_zeros(shape, self.kv_dtype, self.device))

    @torch.inference_mode()
    def after_target(self, inp: ModelInput, aux: torch.Tensor | None, sample: PendingSample | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head over every row of the step, on the device, right after it: each row takes the
        target's hidden states at its position and the token after it, writing the head's K/V there
        (its cache stays as complete as the target's, proposals or not); returns the head's (normed,
        prenorm) output at each sampled sequence's row before its last new token (the row after its
        accepted proposed tokens), which drafts its next proposal."""
        ids, hidden = inp.next_token_ids(sample.tokens if sample else None), self.head.fc(aux)
        self.head.store_kv(ids, inp.positions, hidden, self.kv_cache, inp.slot_mapping)
        if sample is None or not inp.head_states:
            return None
        sampled = torch.arange(inp.logits_indices.shape[0], device=self.device)
        if sample.accepted_counts is not None:
            sampled = inp.sampling.spec_rows[0][:, 0] + sample.accepted_counts
        rows, entries = inp.logits_indices[sampled], inp.sample_entries[sampled]
        # Those rows alone through the whole layer, each as a decode row over the cache up to its position
        # (their K/V, computed again, go to the scratch block: the cache keeps what the pass over all rows wrote).
        scratch = torch.full_like(rows, self.scratch_block * self.block_size)
        meta = AttentionMetadata(scratch, [], [], [], inp.block_tables[entries], inp.positions[rows] + 1)
        return self.head(ids[rows], inp.positions[rows], hidden[rows], self.kv_cache, meta)

    def launched(self, plan: StepPlan, launched: LaunchedStep) -> None:
        if launched.head_state is None:  # not computed (no proposals expected): its sequences' older states are stale now
            for sid in plan.sampled:
                self.last.pop(sid, None)
            return
        normed, prenorm = launched.head_state
        for i, sid in enumerate(plan.sampled):
            self.last[sid] = (normed, prenorm, i)

    def propose(self, batch: StepBatch, previous: LaunchedStep | None) -> Proposal | None:
        for sid in [sid for sid in self.last if sid not in self.batch.seqs]:  # ended
            del self.last[sid]
        return super().propose(batch, previous)

    def draft_steps(self, seqs: list[BatchSeq], previous: LaunchedStep | None):
        _, shift = self._in_flight(seqs, previous)
        normed = torch.stack([self.last[s.seq_id][0][self.last[s.seq_id][2]] for s in seqs])
        prenorm = torch.stack([self.last[s.seq_id][1][self.last[s.seq_id][2]] for s in seqs])
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
                with torch.inference_mode():
                    normed, prenorm = self.head(inp.input_ids, inp.positions, prenorm[kept], self.kv_cache, AttentionMetadata.from_input(inp))
            sampling = self._draw_rows(active)
            tokens, q = self._draw(normed, sampling)
            yield rows, tokens, q, sampling

    @torch.inference_mode()
    def _draw(self, normed: torch.Tensor, sampling: SamplingTensors | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens from the head's outputs, each drawn as the target will judge it (sampling None:
        the argmax, found in the draft vocabulary)."""
        if sampling is None:
            return self.head.draft_argmax(normed), None
        return self.sampler.propose(self.head.logits(normed), sampling)
