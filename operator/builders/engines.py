"""Engine-specific container builders: image, command, args, probe paths. One function per engine."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from kubernetes.utils.quantity import parse_quantity
from pydantic.alias_generators import to_camel

from kvpilot.operator.builders.engine_flags import flag_problems, image_version
from kvpilot.operator.crd_types import InferenceServiceSpec, KVOffloadSpec
from kvpilot.server.config import EngineConfig, add_model_args
from kvpilot.server.kv_layout import capacity_tokens, kv_element_bytes
from kvpilot.server.model_files import bundled_model
from kvpilot.server.model_source import ModelSource, parse_model_source

PORT = 8000
MODEL_DIR = "/models"
PINNED_IMAGES = {
    "kvpilot": "kvpilot/engine:0.1.0",
    # The releases PyPI serves today; their flags are snapshotted in engine_flags/ (checked in CI).
    "vllm": "vllm/vllm-openai:v0.33.0",
    "sglang": "lmsysorg/sglang:v0.5.23",
}
# The operator's own defaults over PINNED_IMAGES and for every engine pod (its --engine-image ENGINE=IMAGE and
# --engine-image-pull-secret flags, the chart's engine.images and engine.imagePullSecrets, passed on through the environment).
ENGINE_IMAGES_ENV, PULL_SECRETS_ENV = "KVPILOT_ENGINE_IMAGES", "KVPILOT_ENGINE_IMAGE_PULL_SECRETS"


def default_image(engine: str) -> str:
    """The image of an engine's pods when the spec names none: the operator's setting, else the pinned release."""
    overrides = dict(item.split("=", 1) for item in os.environ.get(ENGINE_IMAGES_ENV, "").split(",") if "=" in item)
    return overrides.get(engine) or PINNED_IMAGES[engine]


def kvpilot_image(spec: InferenceServiceSpec) -> str:
    """The image that runs `kvpilot fetch-model` (downloads, model cache loaders) for a pod of any engine."""
    return spec.image if spec.engine == "kvpilot" and spec.image else default_image("kvpilot")


def image_pull_secrets() -> list[dict]:
    """The Secrets every engine pod (and model cache loader) pulls its images with: the operator's setting."""
    return [{"name": n} for n in os.environ.get(PULL_SECRETS_ENV, "").split(",") if n]


SHUTDOWN_GRACE_SECONDS = 30
# A disaggregated service's prefill pods serve the KV blocks they hold on this port (the engine's --kv-transfer-port).
KV_TRANSFER_PORT = 5600
# ...and NIXL's UCX listens for reads of them on these ports (UCX_TCP_PORT_RANGE: one per engine rank, and room)
KV_DATA_PORTS = (5601, 5699)
# With spec.adapters: a writable directory (an emptyDir) where the kvpilot engine downloads hf:// adapters,
# and under it pvc/CLAIM, each adapter claim mounted read-only. The kvpilot engine's --lora-dir.
LORA_DIR = "/var/lib/kvpilot/adapters"
# A group of pods (resources.gpusPerPod below the engine's GPUs): the port its leader hosts the ranks' rendezvous on (kvpilot
# --group-port, vLLM --master-port, SGLang --dist-init-addr's), and the variables LeaderWorkerSet gives every pod of a group
# (its webhook writes them into the containers: the kubelet expands $(NAME) in args).
GROUP_PORT = 29500
# How long a group's pods wait for each other at start (kvpilot --group-join-timeout, both sides): a pod whose download is
# slower than its group's must not time the others out (each would recreate the whole group): the startup probe's budget.
GROUP_JOIN_TIMEOUT_SECONDS = 1800
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"


# Each engine's metric names by signal (alternatives: an engine renamed one; joined with `or`): what the autoscaler
# reads (kv, queue, running; operator/autoscaler/promql.py) and the chart's dashboard draws (operator/dashboard.py).
ENGINE_METRICS: dict[str, dict[str, list[str]]] = {
    "kvpilot": {"kv": ["kvpilot:kv_cache_usage_perc"], "queue": ["kvpilot:num_requests_waiting"], "running": ["kvpilot:num_requests_running"],
                "ttft": ["kvpilot:time_to_first_token_seconds"], "itl": ["kvpilot:inter_token_latency_seconds"],
                "generation_tokens": ["kvpilot:generation_tokens_total"], "prompt_tokens": ["kvpilot:prompt_tokens_total"],
                "prefix_hit_tokens": ["kvpilot:prefix_cache_hits_total"], "prefix_query_tokens": ["kvpilot:prefix_cache_queries_total"]},
    "vllm": {"kv": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"], "queue": ["vllm:num_requests_waiting"],
             "running": ["vllm:num_requests_running"], "ttft": ["vllm:time_to_first_token_seconds"],
             "itl": ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"],
             "generation_tokens": ["vllm:generation_tokens_total"], "prompt_tokens": ["vllm:prompt_tokens_total"],
             "prefix_hit_tokens": ["vllm:prefix_cache_hits_total"], "prefix_query_tokens": ["vllm:prefix_cache_queries_total"]},
    "sglang": {"kv": ["sglang:token_usage"], "queue": ["sglang:num_queue_reqs"], "running": ["sglang:num_running_reqs"],
               "ttft": ["sglang:time_to_first_token_seconds"],
               "itl": ["sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"],
               "generation_tokens": ["sglang:generation_tokens_total"], "prompt_tokens": ["sglang:prompt_tokens_total"],
               "prefix_hit_tokens": ["sglang:cached_tokens_total"], "prefix_query_tokens": ["sglang:prompt_tokens_total"]},
}


@dataclass(slots=True)
class EngineContainer:
    image: str
    command: list[str]
    args: list[str]
    ready_path: str
    health_path: str
    env: list[dict] = field(default_factory=list)
    scheme: str = "HTTP"  # of the probes: HTTPS when the engine serves TLS (serves_tls)
    serves_http: bool = True  # False: a group's worker pod of vLLM or SGLang (headless: no probe to ask)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """One model the pod needs (the served model, or a draft model for speculative decoding): its
    source, the volume that holds it and where that volume is mounted."""

    source: str
    volume: str
    directory: str
    shared_cache: bool = False  # spec.model.cache.mode Shared
    config_only: bool = False  # a whole hf:// checkpoint whose weights the kvpilot engine makes (--load-format dummy)

    @property
    def cached(self) -> bool:
        """Held by a model cache entry (a claim filled once, mounted read-only): a downloadable source
        (https://, hf://) with the shared cache on — for every engine, hub repos included. Never a
        config-only download: its few files are fetched by each pod, and an entry holds a whole model."""
        return self.shared_cache and not self.config_only and parse_model_source(self.source).kind in ("https", "hf")

    @property
    def file_name(self) -> str:
        return parse_model_source(self.source).filename

    def downloaded(self, engine: str) -> ModelSource | None:
        """The source an init container downloads before the engine starts (no shared cache): an
        https:// file, or for the kvpilot engine an hf:// file or whole checkpoint (vLLM and SGLang
        fetch hub repos themselves); None otherwise."""
        src = parse_model_source(self.source)
        if self.cached:
            return None
        return src if src.kind == "https" or (src.kind == "hf" and engine == "kvpilot") else None

    def argument(self, engine: str) -> str:
        """What the engine is told to load: a bundled name, a path under the mount (a file, or a
        checkpoint directory), or a hub repo."""
        src = parse_model_source(self.source)
        if src.kind == "pvc":
            return f"{self.directory}/pvc/{src.path}"
        if self.cached:
            return f"{self.directory}/cache/{src.filename}"
        if self.downloaded(engine) is not None:
            return f"{self.directory}/download/{src.filename}"
        return src.name  # a bundled name, or the hub repo org/repo that vLLM/SGLang fetch themselves


def shared_cache(spec: InferenceServiceSpec) -> bool:
    """spec.model.cache.mode is Shared (the operator's default filled in: model_cache.with_defaults)."""
    return spec.model.cache is not None and spec.model.cache.mode == "Shared"


def model_files(spec: InferenceServiceSpec) -> list[ModelFiles]:
    """The served model, then (speculative method draft, any engine) the draft model, which is
    fetched and mounted the same way."""
    shared, src = shared_cache(spec), parse_model_source(spec.model.source)
    files = [ModelFiles(spec.model.source, "model", MODEL_DIR, shared, config_only=src.kind == "hf" and not src.path and makes_weights(spec))]
    spec_settings = spec.engine_settings.speculative
    if spec_settings and spec_settings.method in ("draft", "eagle3") and spec_settings.draft_model:
        files.append(ModelFiles(spec_settings.draft_model, "draft-model", f"{MODEL_DIR}/draft", shared))
    return files


def makes_weights(spec: InferenceServiceSpec) -> bool:
    """extraArgs give the kvpilot engine --load-format dummy: it makes the served model's weights from its config and a
    seed (capacity and load tests), so a checkpoint's config and tokenizer are all it reads. (A draft model is loaded.)"""
    if spec.engine != "kvpilot":
        return False
    try:  # (as the engine's `kvpilot serve` reads its flags: abbreviations too)
        return _engine_parser(allow_abbrev=True).parse_known_args(list(spec.extra_args))[0].load_format == "dummy"
    except argparse.ArgumentError:
        return False


def model_argument(spec: InferenceServiceSpec) -> str:
    return model_files(spec)[0].argument(spec.engine)


def draft_model_argument(spec: InferenceServiceSpec) -> str:
    """Where the engine finds the draft model (method draft): mounted from its claim, downloaded by the
    init container, or a hub repo the engine fetches itself — as the served model."""
    return model_files(spec)[1].argument(spec.engine)


def served_name(spec: InferenceServiceSpec, name: str) -> str:
    return spec.model.served_name or name


def adapter_claims(spec: InferenceServiceSpec) -> list[str]:
    """The claims of pvc:// adapters, each mounted once at LORA_DIR/pvc/CLAIM."""
    return sorted({src.name for a in spec.adapters if (src := parse_model_source(a.source)).kind == "pvc"})


def adapter_load_path(spec: InferenceServiceSpec, source: str) -> str:
    """The lora_path an engine's load API is given for an adapter source: pvc:// the mounted directory;
    hf:// the source itself for kvpilot (it downloads into its --lora-dir), the repo id for vLLM
    (which resolves hub repos itself)."""
    src = parse_model_source(source)
    if src.kind == "pvc":
        return f"{LORA_DIR}/pvc/{src.name}/{src.path}"
    return src.raw if spec.engine == "kvpilot" else src.name


def _lora_values(spec: InferenceServiceSpec) -> dict:
    s = spec.engine_settings
    return {f: getattr(s, f) for f in ("max_loras", "max_lora_rank") if getattr(s, f) is not None}


def kvpilot_engine_values(spec: InferenceServiceSpec, name: str, pool: str | None = None) -> dict:
    """The EngineConfig fields a kvpilot pod of the service runs with (pool: as kvpilot_container's)."""
    s = spec.engine_settings
    values = {"model": model_argument(spec), "served_model_name": served_name(spec, name),
              "tensor_parallel_size": s.tensor_parallel_size, "pipeline_parallel_size": s.pipeline_parallel_size}
    if spec.group_size > 1:
        values |= {"group_size": spec.group_size, "group_port": GROUP_PORT, "group_join_timeout": GROUP_JOIN_TIMEOUT_SECONDS}
    for f in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
              "enable_chunked_prefill", "gpu_memory_utilization", "kv_cache_memory", "dtype", "kv_cache_dtype", "quantization", "enforce_eager"):
        v = getattr(s, f)
        if v is not None:
            values[f] = v
    if s.speculative:
        values |= {"speculative_method": s.speculative.method, "num_speculative_tokens": s.speculative.num_speculative_tokens}
        if s.speculative.method != "ngram":
            values["speculative_model"] = draft_model_argument(spec)
        if s.speculative.lookup:
            values["speculative_lookup"] = True
    if spec.resources.cpu_only:
        values["device"] = "cpu"
    if spec.adapters and pool != "prefill":  # the prefill pool serves the base model only (the gateway does not disaggregate adapters)
        values |= {"enable_lora": True, **_lora_values(spec)}
    if pool is not None:
        values["kv_role"] = pool
        if spec.disaggregation and spec.disaggregation.kv_transfer_timeout_seconds is not None:
            values["kv_transfer_timeout"] = spec.disaggregation.kv_transfer_timeout_seconds
    if pool == "prefill":  # decode pods are told this address in the kv_transfer_params they are given
        values |= {"kv_transfer_host": "$(POD_IP)", "kv_transfer_port": KV_TRANSFER_PORT}
    if s.kv_offload and s.kv_offload.mode != "Off":
        values |= {"kv_offload_dir": KV_TIER_DIR, "kv_offload_size": kv_offload_bytes(s.kv_offload)}
    if s.kv_offload and s.kv_offload.host_size:
        values["kv_host_offload_size"] = parse_quantity(s.kv_offload.host_size)
    return values


def kv_capacity_problem(spec: InferenceServiceSpec, name: str, pool: str | None = None) -> str | None:
    """Why a service's KV cache cannot hold one sequence of its maxModelLen (None: it can, or the operator cannot tell),
    for a model whose KV layout the operator knows (a bundled one: by name or by its fetch address) and a budget set in
    bytes (CPU pods, or kvCacheMemory set on GPU ones): refused here as vLLM refuses at start-up, rather than served with a
    shorter context."""
    bundled = bundled_model(spec.model.source)
    config = EngineConfig(**kvpilot_engine_values(spec, name, pool))
    budget_known = spec.resources.cpu_only or "kv_cache_memory" in config.model_fields_set
    if bundled is None or bundled.kv_layout is None or config.max_model_len is None or not budget_known:
        return None
    layout, cuda = bundled.kv_layout, not spec.resources.cpu_only
    tokens = capacity_tokens(layout, config, cuda)
    if tokens is None or tokens >= min(config.max_model_len, layout.max_position):  # (past its context the engine serves the context)
        return None
    per_token = layout.token_bytes(kv_element_bytes(config, cuda), config.tensor_parallel_size)
    kinds = f"{per_token['full']:,} bytes per token on its {layout.full_layers} full-attention layers"
    if layout.window_layers:
        kinds += (f", {per_token['sliding_window']:,} on its {layout.window_layers} sliding-window layers (which keep "
                  f"{layout.window} tokens of a sequence)")
    return (f"kvCacheMemory={config.kv_cache_memory:,} bytes per rank holds {tokens:,} tokens of {spec.model.source} ({kinds}), fewer than "
            f"maxModelLen={config.max_model_len:,}: raise kvCacheMemory or lower maxModelLen")


def kvpilot_container(spec: InferenceServiceSpec, name: str, pool: str | None = None, worker: bool = False) -> EngineContainer:
    """pool: of a disaggregated service, "prefill" or "decode" (None: one pool serves both phases). worker: a group's pod
    other than its leader (`kvpilot serve-worker`: its ranks, and /health and /ready)."""
    s, values = spec.engine_settings, kvpilot_engine_values(spec, name, pool)
    # EngineConfig validates here, in the operator, so a bad combination is a status condition, not a crash loop.
    engine_args = EngineConfig(**values).to_cli_args()
    if worker:  # (validated as a worker too: a rank and a leader address stand for LeaderWorkerSet's)
        EngineConfig(**values, group_rank=spec.group_size - 1, group_leader="leader")
        args = ["serve-worker", "--host", "$(POD_IP)", "--port", str(PORT), *engine_args, "--group-rank", WORKER_INDEX,
                "--group-leader", LEADER_ADDRESS]
        return EngineContainer(spec.image or default_image("kvpilot"), ["kvpilot"], args, "/ready", "/health")
    args = ["serve", "--host", "$(POD_IP)", "--port", str(PORT), "--shutdown-grace-seconds", str(SHUTDOWN_GRACE_SECONDS), *engine_args]
    if s.parsers and s.parsers.tool_calls:
        args += ["--tool-call-parser", s.parsers.tool_calls]
    if s.parsers and s.parsers.reasoning:
        args += ["--reasoning-parser", s.parsers.reasoning]
    if spec.adapters and pool != "prefill":  # loaded at run time by the operator (operator/adapter_sync.py)
        args += ["--allow-runtime-lora", "--lora-dir", LORA_DIR]
    if s.engine_core_process:
        args.append("--engine-core-process")
    return EngineContainer(spec.image or default_image("kvpilot"), ["kvpilot"], args, "/ready", "/health")


def vllm_container(spec: InferenceServiceSpec, name: str, worker: bool = False) -> EngineContainer:
    """worker: a group's pod other than its leader (`--headless`: its ranks only)."""
    s = spec.engine_settings
    args = ["--model", model_argument(spec), "--served-model-name", served_name(spec, name), "--host", "$(POD_IP)",
            "--port", str(PORT), "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(s.pipeline_parallel_size)]
    flags = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
             "block_size": "--block-size", "gpu_memory_utilization": "--gpu-memory-utilization", "dtype": "--dtype"}
    for f, flag in flags.items():
        if getattr(s, f) is not None:
            args += [flag, str(getattr(s, f))]
    if s.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if s.enable_prefix_caching else "--disable-prefix-caching")
    if s.enable_chunked_prefill is not None:
        args.append("--enable-chunked-prefill" if s.enable_chunked_prefill else "--disable-chunked-prefill")
    if s.enforce_eager:
        args.append("--enforce-eager")
    if s.quantization not in (None, "none"):
        args += ["--quantization", s.quantization]
    if s.kv_cache_dtype == "fp8":
        args += ["--kv-cache-dtype", ENGINE_KV_CACHE_DTYPES["vllm"]["fp8"]]
    if s.speculative:
        cfg = {"method": {"ngram": "ngram", "draft": "draft_model", "eagle3": "eagle3"}[s.speculative.method],
               "num_speculative_tokens": s.speculative.num_speculative_tokens}
        if s.speculative.method != "ngram":
            cfg["model"] = draft_model_argument(spec)
        args += ["--speculative-config", json.dumps(cfg, separators=(",", ":"))]
    if s.parsers and s.parsers.tool_calls:  # vLLM answers tool_choice auto only with both
        args += ["--enable-auto-tool-choice", "--tool-call-parser", s.parsers.tool_calls]
    if s.parsers and s.parsers.reasoning:
        args += ["--reasoning-parser", s.parsers.reasoning]
    env = []
    if spec.adapters:  # loaded at run time through vLLM's own /v1/load_lora_adapter, which this variable turns on
        args.append("--enable-lora")
        for f, v in _lora_values(spec).items():
            args += [f"--{f.replace('_', '-')}", str(v)]
        env.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"})
    if spec.group_size > 1:  # vLLM's own multi-node launch (multiprocessing, no Ray): every pod the same flags, its node rank
        args += ["--distributed-executor-backend", "mp", "--nnodes", str(spec.group_size), "--node-rank", WORKER_INDEX if worker else "0",
                 "--master-addr", LEADER_ADDRESS, "--master-port", str(GROUP_PORT), *(["--headless"] if worker else [])]
    return EngineContainer(spec.image or default_image("vllm"), ["vllm", "serve"], args, "/health", "/health", env, serves_http=not worker)


def sglang_container(spec: InferenceServiceSpec, name: str, worker: bool = False) -> EngineContainer:
    """worker: a group's pod other than its leader (node rank > 0: SGLang serves no HTTP there)."""
    s = spec.engine_settings
    args = ["--model-path", model_argument(spec), "--served-model-name", served_name(spec, name), "--host", "$(POD_IP)",
            "--port", str(PORT), "--tp-size", str(s.tensor_parallel_size),
            "--enable-metrics"]  # SGLang exports no metrics without it, and the autoscaler needs them
    if s.pipeline_parallel_size > 1:
        args += ["--pp-size", str(s.pipeline_parallel_size)]
    flags = {"max_model_len": "--context-length", "max_num_seqs": "--max-running-requests",
             "max_num_batched_tokens": "--chunked-prefill-size", "gpu_memory_utilization": "--mem-fraction-static", "dtype": "--dtype"}
    for f, flag in flags.items():
        if getattr(s, f) is not None:
            args += [flag, str(getattr(s, f))]
    if s.enable_prefix_caching is False:
        args.append("--disable-radix-cache")
    if s.enforce_eager:
        args.append("--disable-cuda-graph")
    if s.quantization not in (None, "none"):
        args += ["--quantization", s.quantization]
    if s.kv_cache_dtype == "fp8":
        args += ["--kv-cache-dtype", ENGINE_KV_CACHE_DTYPES["sglang"]["fp8"]]
    if s.speculative:
        algo = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle3": "EAGLE3"}[s.speculative.method]
        args += ["--speculative-algorithm", algo, "--speculative-num-draft-tokens", str(s.speculative.num_speculative_tokens)]
        if s.speculative.method != "ngram":
            args += ["--speculative-draft-model-path", draft_model_argument(spec)]
    if s.parsers and s.parsers.tool_calls:
        args += ["--tool-call-parser", SGLANG_PARSERS[s.parsers.tool_calls]]
    if s.parsers and s.parsers.reasoning:
        args += ["--reasoning-parser", SGLANG_PARSERS[s.parsers.reasoning]]
    if spec.group_size > 1:
        args += ["--nnodes", str(spec.group_size), "--node-rank", WORKER_INDEX if worker else "0", "--dist-init-addr",
                 f"{LEADER_ADDRESS}:{GROUP_PORT}"]
    return EngineContainer(spec.image or default_image("sglang"), ["python3", "-m", "sglang.launch_server"], args, "/health", "/health",
                           serves_http=not worker)


# engineSettings.parsers values as SGLang names its parsers (kvpilot's and vLLM's names are the CRD's).
SGLANG_PARSERS = {"hermes": "hermes", "llama3_json": "llama3", "qwen3": "qwen3", "deepseek_r1": "deepseek-r1"}

# engineSettings.quantization values vLLM's and SGLang's own --quantization flag takes (a value an engine
# does not take would crash-loop its pods, so it is a status condition instead): no int8/int4 values at
# all, and vLLM 0.33 no gguf (checked against the flag snapshots in CI). kvpilot takes every value.
ENGINE_QUANTIZATION = {"vllm": {"fp8", "awq", "gptq", "compressed-tensors"}, "sglang": {"fp8", "awq", "gptq", "gguf", "compressed-tensors"}}
# kvpilot's values that name a pre-quantized checkpoint's method (not a GGUF's blocks, not quantized at load).
CHECKPOINT_QUANTIZATION = ("gptq", "awq", "compressed-tensors", "fp8")


# engineSettings.kvCacheDtype values other than auto as vLLM's and SGLang's --kv-cache-dtype spell them
# (kvpilot's flag takes the CRD's values); what is missing here they do not take.
ENGINE_KV_CACHE_DTYPES = {"vllm": {"fp8": "fp8"}, "sglang": {"fp8": "fp8_e4m3"}}

KV_TIER_DIR = "/var/lib/kvpilot/kv-tier"  # where the pods mount the disk tier's volume


def kv_offload_bytes(tier: KVOffloadSpec) -> int:
    """The engine's bound on the tier's files: 90% of the volume (temporary files, the filesystem's own)."""
    return int(parse_quantity(tier.size) * 9 // 10)


def unsupported_settings(spec: InferenceServiceSpec) -> list[str]:
    """Settings the chosen engine cannot honour yet: reported as Degraded instead of starting pods
    that would fail or silently ignore them."""
    s, problems = spec.engine_settings, []
    if spec.engine == "kvpilot":  # every engineSettings.quantization value is one of its own (tests/test_operator_builders.py)
        if s.quantization == "gguf" and not _is_gguf_source(spec.model.source):
            problems.append(f"engineSettings.quantization=gguf needs a GGUF model (a bundled name or a .gguf file), not {spec.model.source!r}")
        if s.quantization in CHECKPOINT_QUANTIZATION and _is_gguf_source(spec.model.source):
            problems.append(f"engineSettings.quantization={s.quantization} needs a {s.quantization} checkpoint (an hf:// repository or a "
                            f"checkpoint directory), not {spec.model.source!r} (unset: the engine detects one)")
    else:
        if s.quantization not in (None, "none") and s.quantization not in ENGINE_QUANTIZATION[spec.engine]:
            problems.append(f"engineSettings.quantization={s.quantization} is not a {spec.engine} quantization method "
                            f"(it takes {', '.join(sorted(ENGINE_QUANTIZATION[spec.engine]))})")
        if s.kv_cache_dtype not in (None, "auto", *ENGINE_KV_CACHE_DTYPES[spec.engine]):  # not a bfloat16 cache under float32
            problems.append(f"engineSettings.kvCacheDtype={s.kv_cache_dtype} is a kvpilot setting; {spec.engine} keeps its cache in the "
                            "compute dtype (auto) or in fp8")
        if s.engine_core_process is not None:
            problems.append(f"engineSettings.engineCoreProcess is a kvpilot setting; {spec.engine} always runs its engine core in a process "
                            "of its own")
        if s.speculative and s.speculative.lookup:
            problems.append(f"engineSettings.speculative.lookup is a kvpilot setting; {spec.engine} does not combine n-gram lookup with "
                            "a draft model or EAGLE head")
        if s.kv_offload is not None:
            problems.append(f"engineSettings.kvOffload is the kvpilot engine's KV tiers; {spec.engine} offloads KV through its own connectors "
                            "(extraArgs)")
        if spec.image is None and default_image(spec.engine) == PINNED_IMAGES[spec.engine]:  # its flags are known (a custom image's are not)
            version = image_version(PINNED_IMAGES[spec.engine])
            problems += [f"extraArgs: {p}" for p in flag_problems(spec.engine, version, list(spec.extra_args))]
    host = s.kv_offload.host_size if s.kv_offload else None
    if host and spec.resources.memory and parse_quantity(host) >= parse_quantity(spec.resources.memory):
        problems.append(f"engineSettings.kvOffload.hostSize={host} does not fit in resources.memory={spec.resources.memory} (the host "
                        "tier is part of the engine's memory, with its weights and buffers)")
    if s.speculative and s.speculative.method == "ngram" and s.speculative.draft_model:
        problems.append("engineSettings.speculative.draftModel is only used with methods draft and eagle3")
    if spec.adapters and spec.group_size > 1:
        problems.append("adapters are loaded into one-pod replicas only: a group's worker pods (resources.gpusPerPod below the engine's "
                        "GPUs) would not hold them")
    if not spec.adapters and _lora_values(spec):
        problems.append(f"engineSettings.{', '.join(to_camel(f) for f in _lora_values(spec))} only apply with spec.adapters")
    return problems


def _is_gguf_source(source: str) -> bool:
    return "://" not in source or source.endswith(".gguf")  # bundled models are GGUF files


BUILDERS = {"kvpilot": kvpilot_container, "vllm": vllm_container, "sglang": sglang_container}


TLS_FLAG = "--ssl-certfile"


def serves_tls(spec: InferenceServiceSpec) -> bool:
    """The engine serves HTTPS: extraArgs give it a certificate (--ssl-certfile: the flag of kvpilot, vLLM and SGLang alike,
    with --ssl-keyfile). The files must be in the image: the spec mounts no Secret for them (docs/operator.md)."""
    return _has_tls_flag(spec.extra_args)


def _has_tls_flag(args: list[str]) -> bool:
    return any(a == TLS_FLAG or a.startswith(TLS_FLAG + "=") for a in args)


class _EngineArgsParser(argparse.ArgumentParser):
    """The engine's flags as the operator reads extraArgs: a value the engine refuses raises (its own error, at start,
    says it); argparse's own would print a usage to the operator's log and exit."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)


def _engine_parser(allow_abbrev: bool = False) -> argparse.ArgumentParser:
    parser = _EngineArgsParser(add_help=False, allow_abbrev=allow_abbrev)
    add_model_args(parser, EngineConfig)
    parser.add_argument("--config")  # (a file in the image: its engine settings reach every pod of a group alike)
    return parser


def _is_flag(arg: str) -> bool:
    if not arg.startswith("-"):
        return False
    try:
        float(arg)  # a negative number is a value
    except ValueError:
        return True
    return False


def _engine_flags_only(args: list[str]) -> list[str]:
    """Of extraArgs, the kvpilot flags a group's worker pod takes (EngineConfig's, and --config: every rank must agree on
    them) with their values; the server's (TLS, parsers…) are the leader's alone."""
    known, out, keep = set(_engine_parser()._option_string_actions), [], False
    for a in args:
        if _is_flag(a):
            keep = a.split("=", 1)[0] in known
        if keep:
            out.append(a)
    return out


def group_flag_problems(spec: InferenceServiceSpec, name: str) -> list[str]:
    """A group's worker pods and leader must run the same engine settings (their ranks are one engine): the settings the
    leader's command line gives that the workers' would not, e.g. an abbreviated flag in extraArgs."""
    if spec.engine != "kvpilot" or spec.group_size == 1:
        return []
    def settings(args: list[str], allow_abbrev: bool = False) -> dict:  # (less what the pod's variables give: address, rank)
        args = [a for i, a in enumerate(args) if "$(" not in a and "$(" not in (args[i + 1:i + 2] or [""])[0]]
        try:
            return vars(_engine_parser(allow_abbrev).parse_known_args(args)[0])
        except argparse.ArgumentError:
            return {}

    # (the leader's `kvpilot serve` takes abbreviated flags, as argparse does by default)
    leader, worker = settings(engine_container(spec, name).args[1:], True), settings(engine_container(spec, name, worker=True).args[1:])
    if not leader or not worker:
        return []
    differ = sorted(k for k, v in leader.items() if k not in ("group_rank", "group_leader") and worker.get(k) != v)
    return [f"extraArgs: {', '.join(differ)} would reach the group's leader but not its worker pods (spell each flag out in "
            "full, with its value)"] if differ else []


def engine_container(spec: InferenceServiceSpec, name: str, pool: str | None = None, worker: bool = False) -> EngineContainer:
    """pool: of a disaggregated service (engine kvpilot), "prefill" or "decode". worker: a group's pod other than its
    leader (resources.gpusPerPod below the engine's GPUs)."""
    c = kvpilot_container(spec, name, pool) if pool is not None else BUILDERS[spec.engine](spec, name, worker=worker)
    c.args += _engine_flags_only(list(spec.extra_args)) if worker and spec.engine == "kvpilot" else list(spec.extra_args)
    if _has_tls_flag(c.args):  # (a kvpilot worker's /health and /ready are plain HTTP: TLS is the leader's)
        c.scheme = "HTTPS"
    return c
