"""Prometheus metrics of the engine (names and meanings: docs/observability.md), labelled model_name.

Gauges and the engine's own monotonic counters (prefix cache, preemptions) are read at scrape time,
so they are never stale; per-request histograms and counters are recorded as outputs arrive.

The signals that routers and autoscalers built for vLLM read (llm-d's inference scheduler, the Gateway
API Inference Extension's endpoint picker, KEDA recipes, vLLM's dashboards) are exported a second
time under vLLM's names: the same samples, renamed at scrape time, so the two can never disagree.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.server import startup
from kvpilot.server.engine.llm_engine import ITERATION_TOKEN_BUCKETS, LLMEngine
from kvpilot.server.engine.outputs import RequestOutput
from kvpilot.server.engine.sampling_params import STRUCTURED_KINDS

disable_created_metrics()  # no *_created series: they double the output and nothing here reads them
P = "kvpilot:"
VLLM = "vllm:"
# Our families that vLLM exports under the same name and meaning (its v1 engine's names, vllm/v1/metrics/loggers.py).
VLLM_ALIASED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds",
                "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds", "prefix_cache_queries",
                "prefix_cache_hits", "prompt_tokens", "generation_tokens", "num_preemptions", "request_success", "lora_requests_info",
                "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos", "cache_config_info", "num_requests_waiting_by_reason", "request_params_max_tokens",
                "request_max_num_generation_tokens", "request_num_preemptions", "request_prefill_kv_computed_tokens", "iteration_tokens_total",
                "external_prefix_cache_queries", "external_prefix_cache_hits", "prompt_tokens_cached", "prompt_tokens_by_source",
                "prompt_tokens_cached_by_source", "admission_rejections")
# vLLM's older names of the same families, still read by routers and recipes written against vLLM before 0.10.
VLLM_OLDER_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}
VLLM_ENGINE_LABEL = ("engine", "0")  # vLLM labels every family with its engine index (one engine core here) ...
VLLM_FRONTEND = ("admission_rejections",)  # ... but its API server's own
COMPILE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# vLLM's bucket boundaries, so that dashboards and rules written for vLLM read the same le= values.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                           1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
CACHED_SOURCES = ("device", "host", "disk", "p2p")


@dataclass(frozen=True)
class Family:
    kind: str                       # gauge, counter or histogram
    help: str                       # its HELP line and its row in docs/observability.md
    labels: tuple[str, ...] = ()    # beyond model_name


def _spec(of: str = "") -> dict[str, Family]:
    return {"num_drafts": Family("counter", "Proposals verified (one per sequence and step that speculated)." + of),
            "num_draft_tokens": Family("counter", "Tokens proposed." + of),
            "num_accepted_tokens": Family("counter", "Proposed tokens accepted." + of),
            "num_accepted_tokens_per_pos": Family("counter", "Proposals whose token at this position was accepted." + of, ("position",))}


# Every family the engine exports under kvpilot:, in the order docs/observability.md lists them (generated from
# here: metrics_markdown(); the collectors take their HELP text from here, and tests check every scrape against it).
FAMILIES: dict[str, Family] = {
    "kv_cache_usage_perc": Family("gauge", "KV-cache blocks held by live requests, 0-1; evictable prefix-cache blocks count as free "
                                  "(otherwise usage would never fall back and nothing would scale down)."),
    "num_requests_running": Family("gauge", "Requests in the running batch."),
    "num_requests_waiting": Family("gauge", "Sequences waiting to be scheduled, those submitted and not yet seen by the engine included."),
    "num_requests_waiting_by_reason": Family("gauge", "The waiting sequences by reason: capacity (room in the batch or the KV cache), "
                                             "deferred (a KV tier read or pull in flight, the LoRA slots); they sum to num_requests_waiting.",
                                             ("reason",)),
    "cache_config_info": Family("gauge", "The KV cache's configuration in the labels, the value 1 (num_gpu_blocks: the cache's blocks, on "
                                "whatever device; the Gateway API Inference Extension reads block_size and num_gpu_blocks).",
                                ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization")),
    "time_to_first_token_seconds": Family("histogram", "Arrival to first token."),
    "inter_token_latency_seconds": Family("histogram", "Time between consecutive output tokens."),
    "e2e_request_latency_seconds": Family("histogram", "Arrival to finish."),
    "request_queue_time_seconds": Family("histogram", "Arrival to first scheduling."),
    "request_prefill_time_seconds": Family("histogram", "First scheduling to first token (finished requests)."),
    "request_decode_time_seconds": Family("histogram", "First token to finish (finished requests)."),
    "request_inference_time_seconds": Family("histogram", "First scheduling to finish (finished requests)."),
    "request_time_per_output_token_seconds": Family("histogram", "A finished request's decode time over its output tokens after the first "
                                                    "(its longest choice's)."),
    "request_prompt_tokens": Family("histogram", "Prompt tokens of each finished request."),
    "request_generation_tokens": Family("histogram", "Tokens generated for each finished request (all its choices)."),
    "request_params_n": Family("histogram", "Choices (n) of each finished request."),
    "request_params_max_tokens": Family("histogram", "The max_tokens parameter of each finished request that set it."),
    "request_max_num_generation_tokens": Family("histogram", "Tokens generated by the longest choice of each finished request."),
    "request_num_preemptions": Family("histogram", "Times each finished request was preempted."),
    "request_prefill_kv_computed_tokens": Family("histogram", "Prompt tokens each finished request computed (the cached ones not counted)."),
    "iteration_tokens_total": Family("histogram", "Tokens scheduled per engine step."),
    "prompt_tokens": Family("counter", "Prompt tokens processed."),
    "generation_tokens": Family("counter", "Tokens generated."),
    "request_success": Family("counter", "Finished requests by finish reason: stop, length, abort, error.", ("finished_reason",)),
    "prefix_cache_queries": Family("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": Family("counter", "Prompt tokens found in the prefix cache."),
    "external_prefix_cache_queries": Family("counter", "Prompt tokens looked up past the prefix cache's hits, in the KV tiers or at a "
                                            "prefill engine."),
    "external_prefix_cache_hits": Family("counter", "Of them, tokens read from a tier or pulled instead of computed."),
    "prompt_tokens_cached": Family("counter", "Prompt tokens found cached at admission (the prefix cache, the KV tiers, a prefill engine)."),
    "prompt_tokens_by_source": Family("counter", "Prompt tokens by where their K/V came from: local_compute, local_cache_hit (the "
                                      "prefix cache), external_kv_transfer (a KV tier, a prefill engine).", ("source",)),
    "prompt_tokens_cached_by_source": Family("counter", "Cached prompt tokens by the cache that held them: device (the KV cache), host, "
                                             "disk (the tiers), p2p (a prefill engine).", ("source",)),
    "num_preemptions": Family("counter", "Requests preempted (recomputed) for lack of KV blocks."),
    "admission_rejections": Family("counter", "Requests refused at admission with a 429 by a queue limit (max_num_queued_reqs: "
                                   "--max-waiting-requests).", ("reason",)),
    **{"spec_decode_" + name: family for name, family in _spec(" Speculative decoding, when on.").items()},
    **{"spec_decode_lookup_" + name: family for name, family in _spec(" Of them (spec_decode_*), looked-up proposals' "
                                                                      "(--speculative-lookup; the rest are the model's).").items()},
    "kv_host_tier_hit_blocks": Family("counter", "KV blocks copied back from the host tier (--kv-host-offload-size) instead of computed."),
    "kv_host_tier_miss_blocks": Family("counter", "Lookups whose chain the host tier did not hold to its end (one per lookup)."),
    "kv_host_tier_loaded_bytes": Family("counter", "Bytes of K/V copied back from the host tier."),
    "kv_host_tier_saved_blocks": Family("counter", "KV blocks copied into the host tier."),
    "kv_host_tier_saved_bytes": Family("counter", "Bytes copied into the host tier."),
    "kv_host_tier_evicted_blocks": Family("counter", "Host tier blocks dropped to stay within kv_host_offload_size."),
    "kv_host_tier_bytes": Family("gauge", "Bytes of K/V the host tier holds."),
    "kv_offload_hit_blocks": Family("counter", "KV blocks read back from the disk tier (--kv-offload-dir) instead of computed."),
    "kv_offload_miss_blocks": Family("counter", "Prompt blocks past the prefix cache's hits that the disk tier did not have (or refused)."),
    "kv_offload_refused_files": Family("counter", "Disk tier files refused on read: torn, corrupted, foreign or another block's."),
    "kv_offload_loaded_bytes": Family("counter", "Bytes of K/V read from the disk tier."),
    "kv_offload_saved_blocks": Family("counter", "KV blocks written to the disk tier."),
    "kv_offload_saved_bytes": Family("counter", "Bytes written to the disk tier."),
    "kv_offload_dropped_saves": Family("counter", "Blocks not saved: the disk tier's writer was too far behind."),
    "kv_offload_evicted_files": Family("counter", "Disk tier files removed to keep it within kv_offload_size."),
    "kv_offload_load_seconds": Family("counter", "Seconds spent reading and verifying disk tier files."),
    "kv_offload_save_seconds": Family("counter", "Seconds spent writing disk tier files."),
    "kv_offload_bytes": Family("gauge", "Bytes of the disk tier's files this engine knows of."),
    "kv_transfer_held_transfers": Family("counter", "Prefill engines (--kv-role prefill): prefill requests whose prompt blocks were held "
                                         "for a decode engine."),
    "kv_transfer_sent_blocks": Family("counter", "KV blocks a decode engine was told to read from this one."),
    "kv_transfer_sent_bytes": Family("counter", "Bytes of K/V of those blocks, over every rank."),
    "kv_transfer_expired_transfers": Family("counter", "Holds released after kv_transfer_timeout, not read."),
    "kv_transfer_held_blocks": Family("gauge", "KV blocks held now for decode engines' pulls."),
    "kv_transfer_pulled_blocks": Family("counter", "Decode engines (--kv-role decode): KV blocks pulled from prefill engines instead of "
                                        "computed."),
    "kv_transfer_pulled_bytes": Family("counter", "Bytes of K/V pulled from prefill engines, over every rank."),
    "kv_transfer_failed_pulls": Family("counter", "Pulls that gave fewer blocks than asked for, or whose reads failed on a rank "
                                       "(those blocks computed here)."),
    "kv_transfer_pull_seconds": Family("counter", "Seconds pulls took: asking the prefill engine, then the ranks' NIXL reads."),
    "lora_requests_info": Family("gauge", "LoRA adapters of the running and waiting requests (labels, comma-separated) and the most "
                                 "adapters a step runs; the value is when it was read (vLLM's).",
                                 ("running_lora_adapters", "waiting_lora_adapters", "max_lora")),
    "lora_requests": Family("counter", "Requests run with each loaded LoRA adapter.", ("adapter",)),
    "structured_output_requests": Family("counter", "Requests with a structured-output constraint, by kind: json, json_object, regex, "
                                         "choice, grammar, tool_calls.", ("kind",)),
    "structured_output_compile_seconds": Family("histogram", "Time to compile a structured-output constraint (cache misses)."),
    "structured_output_grammar_cache_hits": Family("counter", "Structured-output constraints found compiled in the grammar cache."),
    "engine_start_time_seconds": Family("gauge", "When the engine process started (Unix time): where its start-up phases begin."),
    "engine_startup_phase_seconds": Family("gauge", "Seconds of each start-up phase: import (process start to the engine's construction), "
                                           "load (weights, KV cache), warmup (decode graphs, grammar compiler), listen (HTTP server up).",
                                           ("phase",)),
}


def metrics_markdown() -> str:
    """docs/observability.md's table of the kvpilot: families (a test keeps it current)."""
    rows = ["| metric | kind | labels (beyond `model_name`) | meaning |", "|---|---|---|---|"]
    for name, family in FAMILIES.items():
        total = "_total" if family.kind == "counter" else ""
        labels = ", ".join(f"`{label}`" for label in family.labels)
        rows.append(f"| `{P}{name}{total}` | {family.kind} | {labels} | {family.help.replace('|', '/')} |")
    return "\n".join(rows)


def _family(kind, name: str):
    """An empty metric family of FAMILIES[name] (labels: model_name and the family's own)."""
    family = FAMILIES[name]
    return kind(P + name, family.help, labels=["model_name", *family.labels])


def token_count_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to max_model_len (vLLM's request-size buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def vllm_names_markdown() -> str:
    """docs/observability.md's list of the families exported under vLLM's names (a test keeps it current)."""
    rows = []
    for name in VLLM_ALIASED:
        kind = FAMILIES[name].kind
        total = "_total" if kind == "counter" else ""
        older = f" (also `vllm:{VLLM_OLDER_NAMES[name]}`, vLLM's older name)" if name in VLLM_OLDER_NAMES else ""
        rows.append(f"- `vllm:{name}{total}`: {kind}, = `kvpilot:{name}{total}`{older}")
    return "\n".join(rows)


class EngineCollector:
    """The engine's gauges and own counters, read from it at collection time (in the engine core's
    process when it runs in its own, engine_core.py)."""

    def __init__(self, engine: LLMEngine, model_name: str, pending: callable = lambda: 0):
        self.engine, self.model_name, self.pending = engine, model_name, pending

    def _one(self, kind, name: str, value, *labels: str):
        family = _family(kind, name)
        family.add_metric([self.model_name, *labels], value)
        return family

    def _spec_decode(self, prefix: str, spec):
        yield self._one(CounterMetricFamily, prefix + "num_drafts", spec.num_drafts)
        yield self._one(CounterMetricFamily, prefix + "num_draft_tokens", spec.num_draft_tokens)
        yield self._one(CounterMetricFamily, prefix + "num_accepted_tokens", spec.num_accepted_tokens)
        per_pos = _family(CounterMetricFamily, prefix + "num_accepted_tokens_per_pos")
        for position, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos

    def collect(self):
        s = self.engine.stats()
        gauge = lambda name, value: self._one(GaugeMetricFamily, name, value)  # noqa: E731
        counter = lambda name, value: self._one(CounterMetricFamily, name, value)  # noqa: E731

        yield gauge("kv_cache_usage_perc", s.kv_cache_usage)
        c = self.engine.config
        yield self._one(GaugeMetricFamily, "cache_config_info", 1, str(c.block_size), str(s.num_blocks), c.kv_cache_dtype,
                        str(c.enable_prefix_caching), str(c.gpu_memory_utilization))
        yield gauge("num_requests_running", s.num_running)
        waiting = s.num_waiting + self.pending()
        yield gauge("num_requests_waiting", waiting)
        by_reason = _family(GaugeMetricFamily, "num_requests_waiting_by_reason")
        by_reason.add_metric([self.model_name, "capacity"], waiting - s.num_waiting_deferred)
        by_reason.add_metric([self.model_name, "deferred"], s.num_waiting_deferred)
        yield by_reason
        steps = _family(HistogramMetricFamily, "iteration_tokens_total")
        cumulative = list(itertools.accumulate(s.step_tokens))
        steps.add_metric([self.model_name], [(str(float(le)), n) for le, n in zip(ITERATION_TOKEN_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])],
                         s.step_tokens_sum)
        yield steps
        yield counter("prefix_cache_queries", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", s.prefix_cache_hits)
        yield counter("external_prefix_cache_queries", s.external_prefix_cache_queries)
        yield counter("external_prefix_cache_hits", s.external_prefix_cache_hits)
        yield counter("num_preemptions", s.num_preemptions)
        if self.engine.proposer is not None:  # vLLM's speculative-decoding counters, under our prefix
            spec = self.engine.proposer.stats
            yield from self._spec_decode("spec_decode_", spec)
            if spec.lookup is not None:  # --speculative-lookup: the looked-up proposals' share of them
                yield from self._spec_decode("spec_decode_lookup_", spec.lookup)
        connector = self.engine.kv_connector  # (kv_connector.py: the tiers and prefill/decode)
        host = connector.host if connector is not None else None
        if host is not None:  # the host tier (kv_tiers.py)
            h = host.stats
            for name in ("hit_blocks", "miss_blocks", "loaded_bytes", "saved_blocks", "saved_bytes", "evicted_blocks"):
                yield counter("kv_host_tier_" + name, getattr(h, name))
            yield gauge("kv_host_tier_bytes", host.total_bytes())
        sender, receiver = (connector.sender, connector.receiver) if connector is not None else (None, None)
        if sender is not None:  # prefill/decode disaggregation (kv_transfer.py), the prefill side
            for name in ("held_transfers", "sent_blocks", "sent_bytes", "expired_transfers"):
                yield counter("kv_transfer_" + name, getattr(sender.stats, name))
            yield gauge("kv_transfer_held_blocks", sender.num_held_blocks())
        if receiver is not None:  # the decode side
            for name in ("pulled_blocks", "pulled_bytes", "failed_pulls", "pull_seconds"):
                yield counter("kv_transfer_" + name, getattr(receiver.stats, name))
        tier = connector.disk if connector is not None else None
        if tier is not None:  # the disk tier (kv_tiers.py)
            for name in ("hit_blocks", "miss_blocks", "refused_files", "loaded_bytes", "saved_blocks", "saved_bytes", "dropped_saves",
                         "evicted_files", "load_seconds", "save_seconds"):
                yield counter("kv_offload_" + name, getattr(tier.stats, name))
            yield gauge("kv_offload_bytes", tier.total_bytes())
        lora = self.engine.lora
        if lora is not None:  # vLLM's lora_requests_info: the adapters of running and waiting requests in its labels, a timestamp as its value
            names = lambda seqs: ",".join(sorted({lora.by_id[s.adapter].name for s in list(seqs) if s.adapter in lora.by_id}))  # noqa: E731
            yield self._one(GaugeMetricFamily, "lora_requests_info", time.time(), names(self.engine.scheduler.running),
                            names(self.engine.scheduler.waiting), str(lora.max_loras))
            per_adapter = _family(CounterMetricFamily, "lora_requests")
            for adapter in list(lora.by_name.values()):
                per_adapter.add_metric([self.model_name, adapter.name], adapter.requests)
            yield per_adapter
        grammars = self.engine.grammars
        by_kind = _family(CounterMetricFamily, "structured_output_requests")
        for kind in STRUCTURED_KINDS:
            by_kind.add_metric([self.model_name, kind], grammars.requests_by_kind.get(kind, 0))
        yield by_kind
        yield counter("structured_output_grammar_cache_hits", grammars.cache_hits)


class StartupCollector:
    """The server process's start and its start-up phases (server/startup.py)."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def collect(self):
        start = _family(GaugeMetricFamily, "engine_start_time_seconds")
        start.add_metric([self.model_name], startup.process_start_time())
        yield start
        phases = _family(GaugeMetricFamily, "engine_startup_phase_seconds")
        for phase, seconds in startup.phases().items():
            phases.add_metric([self.model_name, phase], seconds)
        yield phases


class CoreFamilies:
    """The engine core's EngineCollector families when the core runs in its own process: `text` is its
    latest scrape (Prometheus text format), refreshed by the server right before each /metrics."""

    def __init__(self):
        self.text = ""

    def collect(self):
        yield from text_string_to_metric_families(self.text)


class _WithVllmNames:
    """Every family of `source`, and right after each aliased one the same samples renamed
    kvpilot: -> vllm: with vLLM's engine label added, under its older name too where it had one (one
    collection: the names always carry the same values)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source
        self.names = {P + name for name in VLLM_ALIASED}

    def collect(self):
        for family in self.source.collect():
            yield family
            if family.name in self.names:
                name = family.name[len(P):]
                engine = {} if name in VLLM_FRONTEND else dict([VLLM_ENGINE_LABEL])
                for vllm_name in (name, *([VLLM_OLDER_NAMES[name]] if name in VLLM_OLDER_NAMES else [])):
                    alias = Metric(VLLM + vllm_name, family.documentation, family.type, family.unit)
                    alias.samples = [s._replace(name=VLLM + vllm_name + s.name[len(P) + len(name):], labels={**s.labels, **engine})
                                     for s in family.samples]
                    yield alias


class EngineMetrics:
    """`registry` is what /metrics serves: our families, each aliased one followed by its vLLM-named copy."""

    def __init__(self, engine: LLMEngine | None, model_name: str, max_model_len: int, pending: callable = lambda: 0):
        """engine None: the engine core runs in its own process; its families come from `core` (CoreFamilies)."""
        own = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_WithVllmNames(own))
        self.model_name = model_name
        self.core = CoreFamilies() if engine is None else None
        own.register(StartupCollector(model_name))
        own.register(self.core or EngineCollector(engine, model_name, pending))
        kw = dict(labelnames=["model_name"], registry=own)

        def counter(name: str):
            return Counter(P + name, FAMILIES[name].help, **kw).labels(model_name)

        def histogram(name: str, buckets):
            return Histogram(P + name, FAMILIES[name].help, buckets=buckets, **kw).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens")
        self.generation_tokens = counter("generation_tokens")
        self.success = Counter(P + "request_success", FAMILIES["request_success"].help, labelnames=["model_name", "finished_reason"], registry=own)
        self.ttft = histogram("time_to_first_token_seconds", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)
        # A finished request's phases (vLLM's): prefill = first scheduling to first token, decode = first token to finish,
        # inference = both; time per output token = decode over the tokens after the first.
        self.prefill_time = histogram("request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS)
        sizes = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", sizes)
        self.request_generation_tokens = histogram("request_generation_tokens", sizes)
        self.request_n = histogram("request_params_n", N_BUCKETS)
        self.request_max_tokens = histogram("request_params_max_tokens", sizes)
        self.request_longest = histogram("request_max_num_generation_tokens", sizes)
        self.request_preemptions = histogram("request_num_preemptions", PREEMPTION_BUCKETS)
        self.request_computed = histogram("request_prefill_kv_computed_tokens", sizes)
        self.prompt_tokens_cached = counter("prompt_tokens_cached")

        def by_source(name: str, sources):
            family = Counter(P + name, FAMILIES[name].help, labelnames=["model_name", "source"], registry=own)
            return {source: family.labels(model_name, source) for source in sources}  # every source's series, from 0

        self.prompt_sources = by_source("prompt_tokens_by_source", ("local_compute", "local_cache_hit", "external_kv_transfer"))
        self.cached_sources = by_source("prompt_tokens_cached_by_source", CACHED_SOURCES)
        rejections = Counter(P + "admission_rejections", FAMILIES["admission_rejections"].help, labelnames=["model_name", "reason"], registry=own)
        self.queue_full = rejections.labels(model_name, "max_num_queued_reqs")
        self.grammar_compile = histogram("structured_output_compile_seconds", COMPILE_BUCKETS)
        if engine is not None:
            engine.grammars.observe_compile = self.grammar_compile.observe
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (output tokens so far, time of last token)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Called with each step's outputs (and aborted requests): from the engine thread, or from the
        thread that receives the engine core's outputs."""
        now = time.monotonic()
        for out in outputs:
            total = sum(len(o.token_ids) for o in out.outputs)
            prev = self._seen.get(out.request_id)
            m = out.metrics
            if prev is None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self._prompt_sources(len(out.prompt_token_ids), out.num_cached_tokens, m.cached_sources if m else {})
                if m and m.scheduled_time is not None:
                    self.queue_time.observe(m.scheduled_time - m.arrival_time)
                if m and m.first_token_time is not None and total:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                prev = (0, m.first_token_time if m and m.first_token_time else now)
            elif total > prev[0]:
                new = total - prev[0]
                gap = (now - prev[1]) / new
                for _ in range(new):
                    self.itl.observe(gap)
            self.generation_tokens.inc(total - prev[0])
            self._seen[out.request_id] = (total, now if total > prev[0] else prev[1])
            if out.finished:
                self._seen.pop(out.request_id, None)
                for o in out.outputs:
                    self.success.labels(self.model_name, o.finish_reason or "abort").inc()
                self.request_prompt_tokens.observe(len(out.prompt_token_ids))
                self.request_generation_tokens.observe(total)
                self.request_n.observe(len(out.outputs))
                self.request_longest.observe(max((len(o.token_ids) for o in out.outputs), default=0))
                self.request_computed.observe(len(out.prompt_token_ids) - out.num_cached_tokens)
                if m:
                    self.request_preemptions.observe(m.num_preemptions)
                    if m.max_tokens is not None:
                        self.request_max_tokens.observe(m.max_tokens)
                    self._phases(m, m.finish_time or now, max((len(o.token_ids) for o in out.outputs), default=0))

    def _prompt_sources(self, prompt: int, cached: int, sources: dict[str, int]) -> None:
        self.prompt_tokens_cached.inc(cached)
        device = sources.get("device", 0)
        self.prompt_sources["local_compute"].inc(prompt - cached)
        self.prompt_sources["local_cache_hit"].inc(device)
        self.prompt_sources["external_kv_transfer"].inc(cached - device)
        for source, tokens in sources.items():
            self.cached_sources[source].inc(tokens)

    def _phases(self, m, finished: float, tokens: int) -> None:
        """tokens: the longest choice's (the choices decode side by side)."""
        self.e2e.observe(finished - m.arrival_time)
        if m.scheduled_time is None:  # never scheduled (aborted while waiting)
            return
        self.inference_time.observe(finished - m.scheduled_time)
        if m.first_token_time is None:
            return
        self.prefill_time.observe(m.first_token_time - m.scheduled_time)
        self.decode_time.observe(finished - m.first_token_time)
        if tokens > 1:
            self.tpot.observe((finished - m.first_token_time) / (tokens - 1))
