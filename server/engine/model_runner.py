"""Device side: model weights, the KV cache tensors, batch inputs (slot mapping, block tables), forward, sampling."""

from __future__ import annotations

import logging

import torch

from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.sampler import Sampler, SampleResult
from kvpilot.server.engine.scheduler import ScheduledBatch
from kvpilot.server.engine.sequence import Sequence
from kvpilot.server.gguf_loader import GGUFFile
from kvpilot.server.models.llama import LlamaModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda was asked for but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, gguf: GGUFFile, eos_token_id: int | None, show_progress: bool = True):
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        total = sum(1 for _ in gguf.tensor_names())
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"loading {gguf.path.name}", unit="tensor", leave=False)
        with torch.inference_mode():
            self.model = LlamaModel.from_gguf(gguf, self.dtype, self.device, progress=bar.update if bar else None)
        if bar:
            bar.close()
        c = self.model.config
        self.block_size = config.block_size
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.bytes_per_block = 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem
        self.num_blocks = self._kv_cache_bytes() // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one KV block ({self.bytes_per_block} bytes)")
        shape = (self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(c.num_layers)]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(eos_token_id, generator)
        log.info("model %s on %s/%s, KV cache: %d blocks of %d tokens (%.0f MiB)", c.name, self.device, self.dtype,
                 self.num_blocks, self.block_size, self.num_blocks * self.bytes_per_block / 2**20)

    def _kv_cache_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            used = total - free
            return max(0, int(total * self.config.gpu_memory_utilization) - used)
        return self.config.kv_cache_memory

    def recover(self) -> None:
        """After a failed step: give cached allocator blocks back so that the retry has room."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed % 2**64)  # seed + choice index may leave the 64-bit range
        return g

    def prepare(self, batch: ScheduledBatch):
        """Flatten the step's tokens: prefills (n > 1) first, then single-token steps."""
        bs = self.block_size
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[torch.Tensor] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_lp: list[tuple[Sequence, int, int, int]] = []  # seq, first row, first position, count
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            ids += seq.tokens_slice(start, start + n)
            pos = range(start, start + n)
            positions += pos
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in pos]
            if n > 1:
                q_lens.append(n)
                ctx_lens.append(start + n)
                tables.append(torch.tensor(table, dtype=torch.long, device=self.device))
            else:
                decode_tables.append(table)
                decode_ctx.append(start + 1)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                prompt_lp.append((seq, len(ids) - n, start, count))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        width = max((len(t) for t in decode_tables), default=0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefill_query_lens=q_lens, prefill_context_lens=ctx_lens, prefill_block_tables=tables,
            decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev).reshape(len(decode_tables), width),
            decode_context_lens=torch.tensor(decode_ctx, dtype=torch.long, device=dev),
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows, sample_seqs, prompt_lp)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None]:
        ids, positions, meta, rows, seqs, prompt_lp = self.prepare(batch)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        for seq, row, pos, count in prompt_lp:
            self._record_prompt_logprobs(seq, hidden[row:row + count], pos)
        if not seqs:
            return seqs, None
        logits = self.model.compute_logits(hidden[rows])
        return seqs, self.sampler(logits, seqs)

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, first_pos: int) -> None:
        """Logprob of each next prompt token (plus the top-n) for positions first_pos…"""
        lps = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        k = seq.params.prompt_logprobs
        top = torch.topk(lps, k) if k else None
        for j in range(lps.shape[0]):
            if first_pos + j < len(seq.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            nxt = seq.prompt_token_ids[first_pos + j + 1]
            entry = {nxt: float(lps[j, nxt])}
            if top is not None:
                for lp, tid in zip(top.values[j].tolist(), top.indices[j].tolist()):
                    entry.setdefault(tid, lp)
            seq.prompt_logprobs.append(entry)
