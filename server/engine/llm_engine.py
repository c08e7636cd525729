"""The synchronous engine: requests in, one scheduled step at a time, outputs (with text deltas) out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.sequence import Sequence
from kvpilot.server.model_files import default_served_name, resolve_model_path
from kvpilot.server.threads import configure_threads

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        configure_threads(config.num_threads)
        # torch-side modules are imported only now, after the thread settings are in place.
        from kvpilot.server.engine.block_manager import BlockManager
        from kvpilot.server.engine.model_runner import ModelRunner
        from kvpilot.server.engine.scheduler import Scheduler
        from kvpilot.server.gguf_loader import GGUFFile
        from kvpilot.server.tokenizer import GGUFTokenizer, IncrementalDetokenizer

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.served_model_name = config.served_model_name or default_served_name(config.model)
        gguf = GGUFFile(self.model_path)
        self.model_config = gguf.llama_config()
        self.tokenizer = GGUFTokenizer(gguf)
        self._detokenizer = IncrementalDetokenizer
        self.runner = ModelRunner(config, gguf, self.tokenizer.eos_token_id, show_progress=show_progress)
        capacity = self.runner.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position, capacity)
        if config.max_model_len and config.max_model_len > self.max_model_len:
            log.warning("max_model_len %d lowered to %d (model context / KV cache capacity)", config.max_model_len, self.max_model_len)
        budget = config.max_num_batched_tokens if config.enable_chunked_prefill else max(config.max_num_batched_tokens, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, budget, config.enable_chunked_prefill)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        # Totals for metrics.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # --- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size}), got {bad[:5]}")
        return None, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's maximum context is {self.max_model_len} tokens including at least one output token")
        if max(params.stop_token_ids, default=0) >= self.model_config.vocab_size:
            raise ValueError(f"stop_token_ids must be < {self.model_config.vocab_size}")
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), params, arrival_time=now)
            seq.detokenizer = self._detokenizer(self.tokenizer, params.skip_special_tokens)
            if params.seed is not None:
                seq.generator = self.runner.make_generator(params.seed + i)
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, ids, seqs)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once (its blocks are freed); returns its final output, or None if unknown."""
        if request_id not in self.requests:
            return None
        for seq in self.requests[request_id].seqs:
            self.scheduler.finish(seq, "abort")
        return self._request_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled step. A failure is contained to the request that caused it: a row that cannot
        be sampled fails its request, and when the model step itself raises (out of memory, a kernel
        error) the batch is re-run one request at a time so that only the failing ones end."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            return self._run_batch(batch)
        except Exception as e:  # noqa: BLE001 - isolated below
            log.warning("engine step of %d sequences failed (%s: %s): re-running it request by request", len(batch.seqs), type(e).__name__, e)
            self.runner.recover()
        outputs = []
        for part in batch.split_by_request():
            try:
                outputs += self._run_batch(part)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.exception("request %s failed in the engine step", part.seqs[0].request_id)
                self.runner.recover()
                outputs.append(self.fail_request(part.seqs[0].request_id, f"the engine could not run this request ({type(e).__name__}: {e})"))
        return outputs

    def _run_batch(self, batch) -> list[RequestOutput]:
        sampled, result = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        now = time.monotonic()
        touched: dict[str, None] = {}
        failed: dict[str, str] = {}
        for i, seq in enumerate(sampled):
            if seq.request_id in failed or seq.is_finished:
                continue
            if i in result.errors:
                failed[seq.request_id] = result.errors[i]
                continue
            try:
                self._append_token(seq, result.token_ids[i], result.logprobs[i], result.sampled_logprobs[i], now)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error: this request only
                log.exception("request %s: output processing failed", seq.request_id)
                failed[seq.request_id] = f"output processing failed ({type(e).__name__}: {e})"
                continue
            touched[seq.request_id] = None
        outputs = [self._request_output(rid) for rid in touched if rid not in failed]
        return outputs + [self.fail_request(rid, why) for rid, why in failed.items()]

    def fail_request(self, request_id: str, message: str) -> RequestOutput:
        """End every sequence of a request with finish_reason "error" (blocks freed); its final output."""
        for seq in self.requests[request_id].seqs:
            if not seq.is_finished:
                seq.error = message
                self.scheduler.finish(seq, "error")
        return self._request_output(request_id)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, sampled_lp: float, now: float) -> None:
        p = seq.params
        seq.output_token_ids.append(token)
        self.num_generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.num_prompt_tokens += seq.num_prompt_tokens
        seq.last_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += sampled_lp
        old_len = len(seq.text)
        seq.detokenizer.add(token)
        seq.text = seq.detokenizer.text
        reason, stop_reason = None, None
        enough = len(seq.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token == self.tokenizer.eos_token_id:
            reason = "stop"
        elif enough and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif enough and p.stop:
            hit = self._find_stop(seq.text, old_len, p.stop)
            if hit is not None:
                at, stop = hit
                seq.text = seq.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                reason, stop_reason = "stop", stop
        if reason is None and ((p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str):  # a stop string already cut the text
                seq.text += seq.detokenizer.flush()
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    @staticmethod
    def _find_stop(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
        best = None
        for stop in stops:
            at = text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _request_output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        outputs = []
        for seq in req.seqs:
            # Text that could still turn out to be the start of a stop string is held back.
            hold = 0 if seq.is_finished else max((len(s) - 1 for s in seq.params.stop), default=0)
            end = max(seq.emitted_text_len, len(seq.text) - hold)
            delta = seq.text[seq.emitted_text_len:end]
            seq.emitted_text_len = end
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None, text_delta=delta))
        finished = all(s.is_finished for s in req.seqs)
        first = req.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.scheduled_time, min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
                                 max((s.finish_time or 0 for s in req.seqs), default=None) if finished else None,
                                 first.num_cached_tokens, sum(s.num_preemptions for s in req.seqs))
        prompt_lp = ([None] + list(first.prompt_logprobs)) if first.params.prompt_logprobs is not None else None
        if finished:
            del self.requests[request_id]
        error = next((s.error for s in req.seqs if s.error), None)
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outputs, finished, prompt_lp, metrics, first.num_cached_tokens, error)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage(), bm.num_blocks, bm.num_free_blocks,
                           bm.prefix_queries, bm.prefix_hits, self.scheduler.num_preemptions)
