"""The synchronous engine: requests in, one scheduled step at a time, outputs (with text deltas) out."""

from __future__ import annotations

import bisect
import importlib.metadata
import itertools
import logging
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.server import startup
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.limits import CONSTRAINT_FAILURE, Admission, ModelNotFound, RequestLimits, RequestRejected
from kvpilot.server.engine.output_assembler import OutputAssembler
from kvpilot.server.engine.output_processor import OutputProcessor, StructuredOutputError
from kvpilot.server.engine.outputs import RequestDelta, RequestOutput
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.scheduler import ScheduledBatch
from kvpilot.server.engine.sequence import Sequence
from kvpilot.server.engine.step_message import StepMessenger
from kvpilot.server.loading import draft_model, draft_split, open_model
from kvpilot.server.model_files import default_served_name, engine_model_path, model_fingerprint, resolve_model_path
from kvpilot.server.threads import configure_threads

if TYPE_CHECKING:  # torch-side: imported in LLMEngine.__init__, after the thread settings
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.engine.lora import Adapter
    from kvpilot.server.engine.step_message import GrammarMasks, Step
    from kvpilot.server.engine.worker import LaunchedStep

log = logging.getLogger(__name__)
# Beside running sequences, a step writes at most this much K/V read from a KV tier (or pulled from a
# prefill engine) into the cache: a 4,000-token prompt's 176 MB at once held their step up by ~50 ms
# on a 2-core CPU; 16 MiB is ~5 ms there and under 1 ms over PCIe.
BLOCK_WRITE_BYTES_PER_STEP = 16 << 20
# vLLM's buckets of tokens scheduled per step (its vllm:iteration_tokens_total).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A constraint's masks may cost the first MASK_ALLOWANCE_S of a request (the library builds lexer states
# as it meets them; the first mask's were built at compile), then --structured-outputs-max-mask-ms a
# mask on average (structured.py's fill_masks times them once a step's masks are slow).
MASK_ALLOWANCE_S = 0.025


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
    external_prefix_cache_queries: int    # prompt tokens looked up in the KV tiers or at a prefill engine, past the in-memory hits
    external_prefix_cache_hits: int       # of them, read or pulled instead of computed
    num_waiting_deferred: int             # waiting sequences held back by something other than capacity (a tier read, the LoRA slots)
    step_tokens: list[int]                # steps by tokens scheduled, per ITERATION_TOKEN_BUCKETS bucket (the last: above them all)
    step_tokens_sum: int


def _weakly(method):
    """A callable for the engine's own parts to call back into it or into each other: a strong reference
    would make a cycle that only the garbage collector frees, the KV cache and weights with it; dropping
    the last LLM must free them at once."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, assemble: bool = True):
        """assemble=False: step() and abort_request() return RequestDeltas (token ids only), and whoever
        receives them makes the outputs with an OutputAssembler (the engine core in its own process: the
        API process does, api/core_client.py); True: the engine runs that assembler itself."""
        configure_threads(config.num_threads)
        # torch-side modules are imported only now, after the thread settings are in place.
        from kvpilot.server.engine.block_manager import BlockManager, WindowPool, cache_salt
        from kvpilot.server.engine.kv_scales import kv_calibration_ids
        from kvpilot.server.engine.scheduler import AsyncScheduler, Scheduler
        from kvpilot.server.engine.structured import GrammarCompiler
        from kvpilot.server.engine.worker import Worker

        startup.mark("engine_init")
        self.config = config
        self.model_path = engine_model_path(config)
        self.served_model_name = config.served_model_name or default_served_name(config.model)
        weights, self.tokenizer = open_model(self.model_path, config.load_format, config.seed)
        self.model_config = weights.config
        self.assembler = OutputAssembler(self.tokenizer, _weakly(self.stop_sequence), _weakly(self._drop_request)) if assemble else None
        self._stopped_transfers: list[RequestDelta] = []  # see stop_sequence
        draft = draft_model(config, self.tokenizer) if config.speculative_method == "draft" else None
        split = draft is not None and draft_split(config, draft)
        self.workers = self._start_other_ranks(draft.path if split else None)
        self.worker = Worker(config, weights, show_progress=show_progress, tp=self.workers.tp if self.workers else None,
                             stage=self.workers.stage if self.workers else None, kv_calibration_ids=kv_calibration_ids(config, self.tokenizer),
                             eos_token_ids=self.tokenizer.eos_token_ids, drafter=self._drafter(weights, draft, split))
        startup.mark("loaded")
        capacity = self.worker.num_blocks * config.block_size
        limits = [self.model_config.max_position, capacity]
        self.max_model_len = min(config.max_model_len or min(limits), *limits)
        if config.max_model_len and config.max_model_len > self.max_model_len:
            log.warning("max_model_len %d lowered to %d (model context / KV cache capacity)", config.max_model_len, self.max_model_len)
        self.worker.start_decode_graphs(self.max_model_len)
        self.kv_events, self.kv_event_publisher = self._kv_events()
        self._step_seconds = 0.0  # the last step's time (a tier read's slice is a share of it)
        self._step_tokens, self._step_tokens_sum = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1), 0
        self.lora = self._lora_registry()
        window = WindowPool(self.worker.num_window_blocks, config.block_size, self.model_config.sliding_window) \
            if self.worker.num_window_blocks else None
        self.block_manager = BlockManager(self.worker.num_blocks, config.block_size, config.enable_prefix_caching,
                                          cache_salt(self._kv_identity()), self.lora.fingerprint if self.lora else None, events=self.kv_events,
                                          window=window)
        self.kv_connector = self._kv_connector()
        # N-gram proposals are looked up in the host's tokens: that method keeps its steps synchronous.
        # Pipeline stages: auto is on (several steps in flight, one per stage) on any device.
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and (self.worker.device.type == "cuda" or config.pipeline_parallel_size > 1)
            and config.speculative_method != "ngram" and not config.speculative_lookup)
        self.steps_in_flight = config.pipeline_parallel_size if self.async_scheduling else 1
        budget = config.max_num_batched_tokens if config.enable_chunked_prefill else max(config.max_num_batched_tokens, self.max_model_len)
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            self.block_manager, config.max_num_seqs, budget, config.enable_chunked_prefill, config.max_loras if config.enable_lora else 0,
            connector=self.kv_connector, max_block_writes=max(1, BLOCK_WRITE_BYTES_PER_STEP // self.worker.block_layout()[1]),
            policy=config.scheduling_policy, steps_in_flight=self.steps_in_flight)
        self.grammars = GrammarCompiler(self.tokenizer.backend_json(), self.model_config.vocab_size, self.tokenizer.eos_token_ids,
                                        num_threads=config.num_threads or os.cpu_count() or 1,
                                        mask_budget_s=config.structured_outputs_max_mask_ms / 1000)
        startup.mark("warm")
        receiver = self.kv_connector.receiver if self.kv_connector else None
        self.output = OutputProcessor(self.scheduler, self.tokenizer.eos_token_ids,
                                      self.kv_connector.request_finished if self.kv_connector and self.kv_connector.sender else None)
        self.limits = RequestLimits(self.max_model_len, self.model_config.vocab_size, self.grammars, config.kv_role,
                                    receiver.secret if receiver else None, config.scheduling_policy)
        self.proposer = self._proposer()
        self.requests = self.output.requests
        self.messenger = StepMessenger()
        self._in_flight: StepInFlight | None = None
        self._pipeline: deque[StepInFlight] = deque()  # pipeline stages: the steps in flight, oldest first
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    # --- the parts each feature adds ------------------------------------------------------------
    def _start_other_ranks(self, split_draft):
        """Tensor or pipeline parallelism: ranks 1…N−1 started (their handle, which has rank 0's place);
        else None. split_draft: the draft model's file when it is split over the ranks."""
        config = self.config
        if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
            return None
        import torch

        from kvpilot.server.engine.parallel import Workers
        from kvpilot.server.engine.worker import resolve_device
        from kvpilot.server.models.sharding import check_pipeline_parallel, check_tensor_parallel

        if config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, config.tensor_parallel_size)
        check_pipeline_parallel(self.model_config, config.pipeline_parallel_size, config.pipeline_layer_partition)
        device = resolve_device(config).type
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        if device == "cuda" and config.pipeline_parallel_size > 1 and (gpus := torch.cuda.device_count()) < ranks:
            raise ValueError(f"pipeline_parallel_size={config.pipeline_parallel_size} on CUDA needs a GPU per rank (stages hand tensors on "
                             f"point-to-point over NCCL; gloo, the fallback when GPUs are shared, sends none from a GPU): {ranks} ranks, {gpus} GPUs")
        return Workers(config, self.model_path, device, self.model_config.num_layers, split_draft)

    def _drafter(self, target_weights, draft, split: bool):
        """What makes rank 0's drafter on its worker (draft model, EAGLE-3 head), or None. draft: the draft
        model's weights; split: over the tensor-parallel ranks."""
        from kvpilot.server.engine.drafters import DraftModel, Eagle3

        if draft is not None:
            return lambda worker: DraftModel(worker, draft, split, announce=self.workers.say if split else None)
        if self.config.speculative_method == "eagle3":
            head = str(resolve_model_path(self.config.speculative_model))
            return lambda worker: Eagle3(worker, head, target_weights)
        return None

    def _proposer(self):
        """The engine's side of speculative decoding: which sequences propose, how long, the off-switch."""
        from kvpilot.server.engine.spec_decode import DeviceProposer, EagleProposer, NgramProposer

        kind = {"ngram": NgramProposer, "draft": DeviceProposer, "eagle3": EagleProposer}.get(self.config.speculative_method)
        return kind(self.config, self.max_model_len) if kind else None

    def _kv_connector(self):
        """The KV connector (kv_connector.py) when the engine has KV tiers or a prefill/decode role, else None."""
        config = self.config
        if not (config.kv_offload_dir or config.kv_host_offload_size or config.kv_role != "none"):
            return None
        from kvpilot.server.engine.kv_connector import KVConnector, KVConnectorWorker

        connector = KVConnector(config, KVConnectorWorker(config, self.worker, self.kv_events), self.workers, self.block_manager,
                                self.max_model_len)
        if connector.host is not None or connector.disk is not None:  # (weakly: the block manager and the connector are not a cycle)
            self.block_manager.on_cached = _weakly(connector.block_cached)
        return connector

    def _kv_events(self):
        """KV events for routers (--kv-events-config): (where the block manager and tiers record them, the
        publisher), or (None, None)."""
        settings = self.config.kv_events()
        if settings is None:
            return None, None
        from kvpilot.server.engine.kv_events import KVEventRecorder, ZmqEventPublisher

        recorder = KVEventRecorder(self.config.block_size, _weakly(self._adapter_name), _weakly(self._is_root))
        publisher = ZmqEventPublisher(recorder, settings.endpoint, settings.replay_endpoint, settings.buffer_steps, settings.hwm,
                                      settings.max_queue_size, settings.topic)
        weakref.finalize(self, publisher.close)
        log.info("KV events: publishing on %s%s, topic %r", publisher.endpoint,
                 f" (replay on {publisher.replay_endpoint})" if publisher.replay_endpoint else "", settings.topic)
        return recorder, publisher

    def _adapter_name(self, adapter_id: int) -> str | None:
        adapter = self.lora.by_id.get(adapter_id) if self.lora else None
        return adapter.name if adapter else None

    def _is_root(self, key: bytes) -> bool:
        """Whether a key is a chain's root (the cache's salt, a LoRA adapter's root): no block's."""
        from kvpilot.server.engine.block_manager import adapter_root

        bm = self.block_manager
        # a copy of the adapters: the disk tier's writer thread asks too, while the engine's may register one
        return key == bm.salt or self.lora is not None and any(key == adapter_root(bm.salt, a.fingerprint) for a in list(self.lora.by_id.values()))

    def _lora_registry(self):
        if not self.config.enable_lora:
            return None
        from kvpilot.server.adapters import parse_lora_module
        from kvpilot.server.engine.lora import LoRARegistry

        config = self.config
        registry = LoRARegistry(self.model_config, config.max_loras, config.max_cpu_loras or config.max_loras, config.max_lora_rank,
                                _weakly(self._set_adapter), base_names=(self.served_model_name,))
        for spec in config.lora_modules or ():
            registry.add(*parse_lora_module(spec))
        return registry

    def _set_adapter(self, slot: int, adapter: Adapter | None) -> None:
        """Write an adapter into a LoRA slot (None: clear it), on every rank (the others read their share
        from the adapter's directory)."""
        if self.workers is not None:
            from kvpilot.server.engine.step_message import SetAdapter

            self.workers.send(SetAdapter(slot, str(adapter.path) if adapter else None))
        self.worker.set_adapter(slot, adapter.tensors if adapter else None)

    def _kv_identity(self) -> dict:
        """What this engine's K/V depend on, the root of its prefix cache's keys: equal in every replica
        of the same model and settings, different wherever a cached block would differ."""
        config = self.config
        speculative = None
        if config.speculative_method in ("draft", "eagle3"):  # their K/V share the target's blocks
            speculative = [config.speculative_method, model_fingerprint(resolve_model_path(config.speculative_model))]
        # block_format: how a block's K/V is laid out in a tier file or handed off (2: every cache region in turn, a
        # drafter's too); another format's blocks are other keys, never files refused and deleted by each other's replicas
        return {"kvpilot": importlib.metadata.version("kvpilot"), "block_format": 2, "model": model_fingerprint(self.model_path),
                "block_size": config.block_size, "dtype": str(self.worker.dtype), "kv_dtype": str(self.worker.kv_dtype),
                "kv_scales": self.worker.kv_scales,
                "quantization": self.worker.quantization, "tensor_parallel_size": config.tensor_parallel_size, "speculative": speculative,
                # (a tier's blocks are per-rank shards: another split's are other files; absent at 1, the keys as before stages)
                **({"pipeline_parallel_size": config.pipeline_parallel_size} if config.pipeline_parallel_size > 1 else {}),
                # (made weights: the seed and the device's generator are the model; a directory's real weights are another)
                **({"load_format": "dummy", "seed": config.seed, "device": self.worker.device.type} if config.load_format == "dummy" else {})}

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> str:
        """Tokenize (a text prompt), admit (RequestRejected when the request breaks a limit) and queue.
        lora_request: the adapter it runs with (registered here on first use)."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        adapter = None
        if lora_request is not None:
            if self.lora is None:
                raise RequestRejected("a LoRA adapter was asked for, and this engine has none (enable_lora)", "lora_request")
            adapter = lora_request.lora_name
            if self.lora.lookup(adapter) is None:
                self.lora.add(adapter, lora_request.lora_path)
        return self.add_admitted(self.limits.admit(ids, params, adapter), request_id, arrival_time, text)

    def model_names(self) -> list[str]:
        """The served model's name, then the LoRA adapters' (what a request's `model` may name)."""
        return [self.served_model_name, *(self.lora.names() if self.lora else ())]

    def load_adapter(self, adapter: Adapter) -> None:
        """Register an adapter read by self.lora.read (AdapterError when the name is taken meanwhile)."""
        self.lora.register(adapter)

    def unload_adapter(self, name: str) -> None:
        """Unregister an adapter (KeyError: none by that name); its running sequences finish with it."""
        self.lora.remove(name, self._adapters_in_use())

    def _adapters_in_use(self) -> set[int]:
        in_flight = [*([self._in_flight] if self._in_flight else []), *self._pipeline]
        return {seq.adapter for seq in (*self.scheduler.running, *self.scheduler.waiting)} | {
            seq.adapter for step in in_flight for seq in step.batch.seqs}

    def add_admitted(self, admission: Admission, request_id: str | None = None, arrival_time: float | None = None,
                     prompt_text: str | None = None) -> str:
        """Queue a request already admitted by self.limits (the server admits in its own threads, before
        it streams anything): one Sequence per output, the output processor's state for each."""
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        params = admission.params
        adapter = 0
        if admission.adapter is not None:
            registered = self.lora.lookup(admission.adapter) if self.lora else None
            if registered is None:
                raise ModelNotFound(f"the model {admission.adapter!r} does not exist (an adapter unloaded meanwhile?)", "model")
            registered.requests += 1
            adapter = registered.id
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, list(admission.prompt_token_ids), params, admission.max_output_tokens, adapter)
            if admission.grammar is not None:
                seq.guide, seq.constraint_key = admission.grammar.matcher(), admission.grammar.key
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)
        self.output.add(request_id, seqs, now)
        if self.assembler is not None:
            self.assembler.add(request_id, prompt_text, admission.prompt_token_ids, params)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | RequestDelta | None:
        """Stop a request at once (its blocks are freed); returns its final output, or None if unknown."""
        if request_id not in self.requests:
            return None
        outputs = self._assembled([self.output.abort(request_id)])
        return outputs[0] if outputs else None

    def _assembled(self, deltas: list[RequestDelta]) -> list[RequestOutput] | list[RequestDelta]:
        """What step() and abort_request() hand back: the outputs (assemble=True), else the deltas."""
        if self.assembler is None:
            return deltas
        outputs = [out for out in map(self.assembler.apply, deltas) if out is not None]
        while self._stopped_transfers:  # prefill requests a stop string ended while applying: their final deltas
            out = self.assembler.apply(self._stopped_transfers.pop(0))
            if out is not None:
                outputs.append(out)
        return outputs

    def _drop_request(self, request_id: str) -> None:
        """The output assembler failed this request (its output is the error): end it, free its blocks."""
        if request_id in self.requests:
            self.output.abort(request_id)

    def stop_sequence(self, request_id: str, index: int, stop: str) -> RequestDelta | None:
        """End one sequence at a stop string its text completed (the output assembler matches them);
        a request all of whose sequences ended is dropped. A prefill request's (do_remote_decode) final
        delta is returned: it carries the kv_transfer_params of the blocks now held, which the
        assembler waits for (with assemble=True it is applied after the step's others)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        seq = req.seqs[index]
        if not seq.is_finished:
            self.output.state(seq).stop_reason = stop
            self.output.finish(seq, "stop")
        if not all(s.is_finished for s in req.seqs):
            return None
        final = self.output.delta(request_id)
        transfer = seq.params.kv_transfer
        if transfer is None or not transfer.do_remote_decode:
            return None
        if self.assembler is not None:
            self._stopped_transfers.append(final)
        return final

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._pipeline)

    def needs_step(self) -> bool:
        """Unfinished requests, or held transfer blocks to give back now (pulled or expired), which a
        step releases: the serving loops step on either (an idle prefill engine kept a pulled prompt's
        blocks held until its next request)."""
        return self.has_unfinished_requests() or (self.kv_connector is not None and self.kv_connector.needs_step())

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput] | list[RequestDelta]:
        """One scheduled step: the outputs of the requests it moved (deltas: assemble=False). A failure is contained to the request that caused it: a row that cannot
        be sampled fails its request, and when the model step itself raises (out of memory, a kernel
        error) the batch is re-run one request at a time so that only the failing ones end.

        With async scheduling the step is launched before the previous step's outputs are processed:
        the device runs step n while the host reads step n - 1's tokens, detokenizes, checks stops and
        hands outputs back, then schedules and builds step n + 1. Step n's sequences hold a placeholder
        for the token step n - 1 samples, whose value its input takes on the device. A sequence that
        step n - 1 ends still runs in step n; that row is dropped."""
        return self._assembled(self._step() if self.steps_in_flight == 1 else self._pipelined_step())

    def _pipelined_step(self) -> list[RequestDelta]:
        """Pipeline stages under async scheduling: a step launched on sequences no step in flight has (rank
        0 runs the first stage's part and goes on), then the oldest step in flight completed once there
        are as many as stages (or nothing new could be launched): while rank 0 runs the first stage of
        one step, the later stages run the steps before it."""
        self._between_steps()
        started = time.perf_counter()
        outputs: list[RequestDelta] = []
        batch = self._schedule()
        launched = failed = None
        if batch:
            try:
                launched = self._launch(batch, None)
            except Exception as e:  # noqa: BLE001 - isolated below
                log.warning("engine step of %d sequences failed (%s: %s): re-running it request by request", len(batch.seqs), type(e).__name__, e)
                self.worker.recover()
                failed = batch
        elif not self._pipeline and self.kv_connector is not None:
            self.kv_connector.wait(self.scheduler.waiting)
        if launched is not None:
            self._count_launched(launched)
            self._pipeline.append(launched)
        if self._pipeline and (len(self._pipeline) >= self.steps_in_flight or launched is None):
            outputs += self._complete(self._pipeline.popleft())
        if failed is not None:
            while self._pipeline:  # (their inputs stay theirs: the re-runs build one input each)
                outputs += self._complete(self._pipeline.popleft())
            outputs += self._isolate(failed)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.flush()
        self._step_seconds = time.perf_counter() - started
        return outputs

    def _step(self) -> list[RequestDelta]:
        self._between_steps()
        started = time.perf_counter()
        outputs: list[RequestDelta] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and any(self._needs_host_tokens(seq) for seq in self.scheduler.running):
            outputs += self._complete(previous)  # the next step's masks or proposals need its tokens on the host
            previous = None
        batch = self._schedule()
        launched = failed = None
        if batch:
            try:
                launched = self._launch(batch, previous)
                if not self.async_scheduling:
                    outputs += self._complete(launched)
                    launched = None
            except Exception as e:  # noqa: BLE001 - isolated below
                log.warning("engine step of %d sequences failed (%s: %s): re-running it request by request", len(batch.seqs), type(e).__name__, e)
                self.worker.recover()
                failed = batch
        elif previous is None and self.kv_connector is not None:
            self.kv_connector.wait(self.scheduler.waiting)
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None:
            self._begin_awaiting(launched)
        if failed is not None:
            outputs += self._isolate(failed)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.flush()  # the step's KV events go out as one batch
        self._step_seconds = time.perf_counter() - started
        return outputs

    def _between_steps(self) -> None:
        """The KV connector's part between steps: held blocks given back, a slice of the disk tier's reads."""
        if self.kv_connector is not None:
            self.kv_connector.between_steps(self._step_seconds, bool(self.scheduler.running))

    def _needs_host_tokens(self, seq: Sequence) -> bool:
        """A constrained sequence's mask for the next step needs the token the step in flight samples
        (with proposals, so do penalties and min_tokens: how many tokens it adds): while any runs,
        steps do not overlap (the previous one completes first)."""
        if seq.guide is not None:
            return True
        return self.proposer is not None and (seq.params.has_penalties or seq.num_output_tokens < seq.params.min_tokens)

    def _schedule(self) -> ScheduledBatch:
        """Proposals planned, adapters no longer needed let go, the step scheduled, the blocks it loads
        from outside the cache written on every rank (sequences whose loads failed somewhere compute
        their prompts instead: out of this step, back to waiting)."""
        if self.proposer:
            self.proposer.plan(self.scheduler.running)
        if self.lora is not None and len(self.lora.by_id) > len(self.lora.by_name):  # an unloaded adapter may be done with
            self.lora.release_unused(self._adapters_in_use())
        batch = self.scheduler.schedule()
        if batch.kv_loads:
            failed = self.kv_connector.load(batch.kv_loads)
            batch.kv_loads = []  # the last references to the payloads: their read buffers are free again (kv_tiers.py)
            if failed:
                self.scheduler.drop_loads(failed, batch)
        if batch:
            tokens = sum(batch.num_new_tokens)
            self._step_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self._step_tokens_sum += tokens
        self.output.scheduled(batch.seqs, time.monotonic())
        return batch

    def step_or_fail_open(self) -> list[RequestOutput] | list[RequestDelta]:
        """step(), where a failure outside the model step (a bug) fails the open requests and the
        engine goes on (the model step's own failures are contained by step())."""
        try:
            return self.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed outside the model: failing the open requests")
            return self._assembled([self._fail(rid, f"engine step failed ({type(e).__name__}: {e})") for rid in list(self.requests)])

    def _isolate(self, batch: ScheduledBatch) -> list[RequestDelta]:
        """Re-run a failed batch one request at a time: only the requests whose own step fails end."""
        outputs = []
        for part in batch.split_by_request():
            try:
                outputs += self._complete(self._launch(part, None))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.exception("request %s failed in the engine step", part.seqs[0].request_id)
                self.worker.recover()
                outputs.append(self._fail(part.seqs[0].request_id, f"the engine could not run this request ({type(e).__name__}: {e})"))
        return outputs

    def _launch(self, batch: ScheduledBatch, previous: StepInFlight | None) -> StepInFlight:
        """The step's message, run by every rank's worker (queued on the device: on a CPU it runs here)."""
        slots = None
        if self.lora is not None and any(seq.adapter for seq in batch.seqs):
            slots = self.lora.slots_for([seq.adapter for seq in batch.seqs], {seq.adapter for seq in self.scheduler.running})
        in_flight = previous.launched if previous else None
        awaited = in_flight is not None and any(seq.num_placeholders for seq in batch.seqs)
        unsettled = in_flight is not None and any(seq.num_unsettled for seq in batch.seqs)
        step = self.messenger.step(batch, previous.sampled_rows() if previous else None,
                                   in_flight.tokens.shape[0] if awaited or unsettled else 0, slots, unsettled)
        if self.proposer is not None:  # (an EAGLE-3 head keeps the states the next proposals start from only if there may be any)
            step.drafts_next = self.proposer.may_propose(len(self.scheduler.running))
        # The other ranks get the message, then what it says follows from rank 0's device: once rank 0 has built
        # the step (nothing that can fail is left before their collectives), unless a split draft model's
        # proposals, collective, come first: then before each collective part rank 0 says whether its own
        # work before it went well (the drafter before each draft step, here before the target's), and on a
        # failure every rank drops the step.
        collective_proposals = self.workers is not None and self.worker.drafter is not None and self.worker.drafter.collective
        if collective_proposals:
            self._send_step(step, in_flight, unsettled)
        try:
            worker_batch, proposal = self.worker.begin(step, in_flight)
            step.grammar = self._grammar_masks(batch, proposal)
            inp, plan = self.worker.build(worker_batch, step, proposal)
        except Exception:
            if collective_proposals:
                self.workers.say(False)
            raise
        if collective_proposals:
            self.workers.say(True)
        elif self.workers is not None:
            self._send_step(step, in_flight, unsettled)
        if self.workers is not None and proposal is not None:
            self.workers.broadcast_tokens(proposal.tokens)
        launched = self.worker.execute(inp, plan, in_flight, proposal)
        by_id = {seq.seq_id: seq for seq in batch.seqs}
        flight = StepInFlight(batch, launched, [by_id[sid] for sid in plan.sampled], plan.proposed,
                              [(by_id[sid], start) for sid, start in plan.prompt_logprobs])
        if self.proposer:
            self.proposer.launched(flight)
        return flight

    def _send_step(self, step: Step, in_flight: LaunchedStep | None, unsettled: bool) -> None:
        """The step's message to ranks 1…N−1, then the step in flight's sampled tokens and accepted counts
        its placeholders and unsettled rows take, from rank 0's device."""
        self.workers.send(step.for_other_ranks())
        if step.num_previous_tokens:
            self.workers.broadcast_tokens(in_flight.tokens)
        if unsettled:
            self.workers.broadcast_tokens(in_flight.accepted_counts)

    def _grammar_masks(self, batch: ScheduledBatch, proposal) -> GrammarMasks | None:
        """The allowed tokens of the constrained sequences the step samples (after their proposed tokens
        so far, one row each), filled by the grammar library; the CPU time each cost is charged to it."""
        guided = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.guide is not None and seq.num_computed_tokens + n >= seq.num_tokens]
        if not guided:
            return None
        import numpy as np

        from kvpilot.server.engine.step_message import GrammarMasks

        proposed = [proposal.host_tokens.get(seq.seq_id, seq.spec_token_ids) if proposal else seq.spec_token_ids for seq in guided]
        counts = [len(tokens) + 1 for tokens in proposed]
        masks = np.zeros((sum(counts), self.grammars.mask_words), dtype=np.int32)
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        timed = self.grammars.fill_masks([(seq.guide, first, list(tokens)) for seq, first, tokens in zip(guided, firsts, proposed)],
                                         masks.ctypes.data, masks.shape[0])
        for seq, seconds, count in zip(guided, timed or (), counts):  # charged against the engine's bound (_complete), per row
            seq.mask_seconds += seconds
            seq.mask_steps += count
        return GrammarMasks([seq.seq_id for seq in guided], counts, self.grammars.mask_words, self.grammars.vocab_size, masks.tobytes())

    def _begin_awaiting(self, step: StepInFlight) -> None:
        """Async scheduling, after the step before `step` is complete: the scheduler counts `step` as
        launched (placeholders for its coming tokens), so that the next step is scheduled with it."""
        self._count_launched(step)
        self._in_flight = step

    def _count_launched(self, step: StepInFlight) -> None:
        """Async scheduling: the scheduler counts a launched step's tokens (placeholders for those it samples)."""
        self.scheduler.launched(step.batch, step.sampled, step.proposed)
        self._save_cached()
        step.updated = True

    def _save_cached(self) -> None:
        """After the scheduler counted computed tokens: the blocks that joined the prefix cache are saved
        by the KV connector on every rank, before any later step can reuse them."""
        if self.kv_connector is not None:
            self.kv_connector.save_cached()

    def _complete(self, step: StepInFlight) -> list[RequestDelta]:
        """Wait for a launched step and hand its outputs to the requests."""
        out = step.launched.output()
        for (seq, first_pos), entries in zip(step.prompt_logprobs, out.prompt_logprobs):
            self.output.record_prompt_logprobs(seq, first_pos, entries)
        # A proposal of k with a accepted adds a + 1 tokens: the K/V of the k - a rejected ones does not count.
        verified = [(seq, k, 0 if i in out.errors else len(out.token_ids[i]) - 1)
                    for i, (seq, k) in enumerate(zip(step.sampled, step.proposed)) if k]
        if not step.updated:  # counted as launched() counts them: the accepted tokens are settled once appended
            self.scheduler.update(step.batch, {seq.seq_id: k for seq, k, _ in verified})
            self._save_cached()
        now = time.monotonic()
        touched: dict[str, None] = {}
        failed: dict[str, str] = {}
        for i, seq in enumerate(step.sampled):
            if seq.request_id in failed or seq.is_finished:
                continue
            self.scheduler.arrived(seq)
            why = self._failure(seq, out.errors.get(i))
            if why is None:
                try:
                    self.output.append(seq, out.token_ids[i], out.logprobs[i], now)
                except StructuredOutputError as e:  # the library failed the constraint (e.g. a parser row past its limit)
                    log.warning("request %s: %s", seq.request_id, e)
                    why = f"{CONSTRAINT_FAILURE} {e}"
                except Exception as e:  # noqa: BLE001 - appending failed (a bug): this request only
                    log.exception("request %s: output processing failed", seq.request_id)
                    why = f"output processing failed ({type(e).__name__}: {e})"
            if why is not None:
                failed[seq.request_id] = why
            else:
                touched[seq.request_id] = None
        if verified:
            for seq, _, accepted in verified:
                self.scheduler.settle(seq, accepted)
                # (the step after it, if in flight, may write up to k positions past the accepted tokens)
                self.scheduler.end_speculation(seq, self.proposer.k if self.async_scheduling else 0)
            self.proposer.verified(verified)
            self._save_cached()  # (blocks the accepted tokens completed)
        outputs = [self.output.delta(rid) for rid in touched if rid not in failed]
        return outputs + [self._fail(rid, why) for rid, why in failed.items()]

    def _failure(self, seq: Sequence, error: str | None) -> str | None:
        """Why a sampled sequence fails this step: its constraint's masks cost past the bound, or its
        row could not be sampled (None: it did not)."""
        budget = self.grammars.mask_budget_s
        if seq.guide is not None and seq.mask_seconds > MASK_ALLOWANCE_S + budget * seq.mask_steps:
            why = (f"the constraint's token masks took {seq.mask_seconds * 1000:.0f} ms of CPU over {seq.mask_steps} masks, past "
                   f"this server's bound ({budget * 1000:g} ms a mask after {MASK_ALLOWANCE_S * 1000:g} ms; "
                   "--structured-outputs-max-mask-ms)")
            self.grammars.refuse(seq.constraint_key, why)
            return f"{CONSTRAINT_FAILURE} {why}"
        if error is not None:
            guide_error = seq.guide.get_error() if seq.guide is not None and seq.guide.is_error() else None
            return f"{CONSTRAINT_FAILURE} {guide_error[:300]}" if guide_error else error
        return None

    def _fail(self, request_id: str, message: str) -> RequestDelta:
        """End every sequence of a request with finish_reason "error" (blocks freed); its final delta."""
        return self.output.fail(request_id, message)

    def reset_prefix_cache(self, external: bool = False) -> int:
        """vLLM's /reset_prefix_cache: the prefix cache forgets every block (AllBlocksCleared in the KV
        events); running requests keep theirs, so it never waits for them and never fails. external: the
        KV tiers drop theirs too (the disk tier's files this engine knows of, other replicas' included:
        the directory is one cache). The number of blocks forgotten."""
        forgotten = self.block_manager.reset_prefix_cache()
        if external and self.kv_connector is not None:
            forgotten += self.kv_connector.reset()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.flush()
        log.info("prefix cache reset%s: %d blocks forgotten", " (and the KV tiers)" if external else "", forgotten)
        return forgotten

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (each writes what it queued for the disk tier first), and
        write what this rank queued; the KV events recorded go out."""
        if self.workers is not None:
            self.workers.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def describe_ranks(self) -> list[dict]:
        """What each rank's worker holds (Worker.describe), rank 0's first (tests, logs; not on the step path)."""
        own = self.worker.describe()
        return self.workers.describe(own) if self.workers is not None else [own]

    def stats(self) -> EngineStats:
        bm, scheduler = self.block_manager, self.scheduler
        memory = bm.window if self.worker.bookkeeping_table else bm  # (the blocks that hold K/V)
        return EngineStats(len(scheduler.running), len(scheduler.waiting), bm.usage(), len(memory.blocks), len(memory.free),
                           bm.prefix_queries, bm.prefix_hits, scheduler.num_preemptions,
                           self.kv_connector.external_queries if self.kv_connector else 0, scheduler.external_hit_tokens,
                           scheduler.num_deferred(), list(self._step_tokens), self._step_tokens_sum)


@dataclass(slots=True)
class StepInFlight:
    """A launched step whose outputs the requests have not had yet, keyed to the engine's sequences."""

    batch: ScheduledBatch
    launched: LaunchedStep
    sampled: list[Sequence]         # the sequence of each sampled row
    proposed: list[int]             # per sampled sequence: the tokens it verifies (0: none)
    prompt_logprobs: list[tuple[Sequence, int]]  # per prompt-logprob span: its sequence and first position
    updated: bool = False           # the scheduler has counted its computed tokens

    def sampled_rows(self) -> dict[int, int]:
        """seq_id -> its index among the step's sampled sequences (LaunchedStep.tokens, accepted_counts)."""
        return {seq.seq_id: i for i, seq in enumerate(self.sampled)}
