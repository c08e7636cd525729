"""Decode-only steps replayed from CUDA graphs, one per batch-size bucket (the GPU-path issue).

A decode step of a small model on a GPU is launch-bound: run eagerly it costs the same ~10 ms at any
batch size, the GPU waiting on Python and hundreds of kernel launches. Captured once as a graph, the
whole forward (every layer, the LM head) is one launch.

A graph replays fixed addresses and shapes, so the step's inputs live in static buffers sized for the
largest bucket, and a step of n rows runs the graph of the smallest bucket ≥ n with its inputs copied
in. The rows past n are padding, made harmless: each writes its K/V to the scratch block (one KV block
past those the block manager hands out, `scratch_block`) and attends to that block's first slot alone,
so it can never overwrite a live sequence's cache; their logits are dropped. The block tables are as
wide as the longest context (`table_width` blocks), so the attention kernel's split-K layout (a
function of the tables' width) is the same for every step and every graph.

A worker keeps one set for its model's decode steps (speculative verifications included); a draft
model (engine/drafters.py) one for its own steps (its proposals, and its pass over the target's rows).

Capturing needs kernels that never read a device value on the host (`Ops.graph_safe`: the Triton
kernels); prefills, mixed steps, prompt-logprob steps and batches past the largest bucket run
eagerly. With `capture=False` the same static-buffer path runs eagerly: how CI (no GPU) checks the
padding and the scratch block against plain steps (tests/test_decode_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvpilot.kernels.lora import LoRABatch, LoRAContext
from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.server.engine.model_io import ModelInput

log = logging.getLogger(__name__)

# (input_ids [b], positions [b], attention metadata) -> float32 logits [b, vocab]
DecodeStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, … below max_rows, then max_rows: a step pads to at most twice its rows."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return sizes + [max_rows]


class DecodeGraphs:
    """lora: the model's LoRA context (when it has adapter slots): each row's slot is one more static
    input (padding rows -1), so one graph serves any mix of adapters; a graph is captured with the
    delta kernels in it (rows without an adapter skip them on the device)."""

    def __init__(self, step: DecodeStep, max_rows: int, table_width: int, scratch_block: int, block_size: int, device: torch.device,
                 capture: bool = True, lora: LoRAContext | None = None):
        self.step = step
        self.lora = lora
        self.buckets = batch_buckets(max_rows)
        self.table_width = table_width
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, table_width), scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.token_slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.runs: list[tuple[int, int, int]] = []  # eager static steps: the step's runs of rows per slot (host)
        self.capturing = False
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:rows], [], [], [], self.block_tables[:rows], self.context_lens[:rows])

    def _run_static(self, rows: int) -> torch.Tensor:
        if self.lora is None:
            return self.step(self.input_ids[:rows], self.positions[:rows], self._meta(rows))
        # Captured: always with the delta kernels, the slots read on the device. Eager: as the step has it.
        if self.capturing:
            self.lora.batch = LoRABatch(self.token_slots[:rows], None)
        elif self.runs:
            self.lora.batch = LoRABatch(self.token_slots[:rows], self.runs)
        try:
            return self.step(self.input_ids[:rows], self.positions[:rows], self._meta(rows))
        finally:
            self.lora.batch = None

    def _capture_all(self) -> None:
        """Largest bucket first, all graphs in one memory pool (a smaller graph reuses the larger one's
        blocks: they never run at once). Each bucket runs once eagerly first, so that Triton compiles
        its kernels outside the capture."""
        pool = None
        self.capturing = True
        with torch.inference_mode():  # as the steps run (Worker.launch)
            for rows in reversed(self.buckets):
                self._run_static(rows)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._run_static(rows)
                pool = graph.pool()
                self.graphs[rows] = (graph, logits)
        torch.cuda.synchronize()
        self.capturing = False
        log.info("decode steps captured as CUDA graphs for batch sizes %s", self.buckets)

    def takes(self, inp: ModelInput) -> bool:
        """Whether this step is a decode-only step the buffers hold: one row per sequence, every row
        sampled, no prompt logprobs, at most the largest bucket's rows."""
        rows = inp.input_ids.shape[0]
        return (inp.num_prefills == 0 and not inp.prompt_logprobs and rows <= self.buckets[-1] and inp.logits_indices.shape[0] == rows
                and inp.block_tables.shape[1] <= self.table_width)

    def run(self, inp: ModelInput) -> torch.Tensor:
        """The step's float32 logits [rows, vocab] (its K/V stored in the cache, as an eager step's)."""
        rows = inp.input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= rows)
        self.input_ids[:rows].copy_(inp.input_ids)
        self.positions[:rows].copy_(inp.positions)
        self.slot_mapping[:rows].copy_(inp.slot_mapping)
        self.block_tables[:rows, :inp.block_tables.shape[1]].copy_(inp.block_tables)
        self.context_lens[:rows].copy_(inp.seq_lens)
        if self.lora is not None:
            if inp.lora is not None:
                self.token_slots[:rows].copy_(inp.lora.token_slots)
            else:
                self.token_slots[:rows].fill_(-1)
            self.token_slots[rows:bucket].fill_(-1)
            self.runs = inp.lora.runs if inp.lora is not None else []
        if rows < bucket:
            # Padding rows may hold a previous, larger step's slots: live sequences' cache slots, which
            # they would overwrite. Back to the scratch block, context one token.
            self.slot_mapping[rows:bucket].fill_(self.scratch_slot)
            self.block_tables[rows:bucket, 0].fill_(self.scratch_block)
            self.context_lens[rows:bucket].fill_(1)
        if not self.graphs:
            return self._run_static(bucket)[:rows]
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:rows]
