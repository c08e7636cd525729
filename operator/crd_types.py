"""The InferenceService API (serving.kvpilot.dev/v1alpha1): spec and status as pydantic models.

This file is the single source of truth: crds/ (and the chart's copy) is generated from it by
`make crds` (kvpilot.operator.crd_gen), and a test fails when the YAML is stale. Fields are camelCase
in the API (aliases); every field is documented; CEL rules validate in the API server. Strings and
lists that CEL reads carry maxLength/maxItems so rule costs stay within the API server's budget.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvpilot.server.model_source import DOT_SEGMENT_PATTERN, MODEL_SOURCE_PATTERN, parse_model_source

GROUP, VERSION, KIND, PLURAL = "serving.kvpilot.dev", "v1alpha1", "InferenceService", "inferenceservices"
ISVC_LABEL = f"{GROUP}/inferenceservice"     # on every object we create, and every engine pod
ROLE_LABEL = f"{GROUP}/role"                 # engine pods of a disaggregated service: prefill or decode (absent: both phases)
# Set by kvpilot-gateway (an RFC 3339 time) on an InferenceService at 0 replicas when a request for it
# arrives; the autoscaler — the one writer of spec.replicas — answers by scaling to 1.
WAKE_ANNOTATION = f"{GROUP}/scale-from-zero-requested"
# Set by the operator on each engine pod: the LoRA adapters it holds, comma-separated (kvpilot-gateway routes on it).
ADAPTERS_ANNOTATION = f"{GROUP}/adapters"
MANAGED_BY = ("app.kubernetes.io/managed-by", "kvpilot")
# Set by the operator on every engine container (KVPILOT_KV_TRANSFER_SECRET: a disaggregated service's): a user's env entry must not replace them.
RESERVED_ENV = ("POD_IP", "KVPILOT_API_KEY", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HOME", "KVPILOT_KV_TRANSFER_SECRET")


def cel(rule: str, message: str, field_path: str | None = None) -> dict:
    r = {"rule": rule, "message": message}
    if field_path:
        r["fieldPath"] = field_path
    return r


# A pool's replicas within its bounds (the service's, a prefill pool's).
REPLICA_BOUNDS = (cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas", ".minReplicas"),
                  cel("!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
                      "replicas must be within [minReplicas, maxReplicas]", ".replicas"))
_NO_DOT_SEGMENTS = cel(f"!self.matches('{DOT_SEGMENT_PATTERN}')", "path segments '.' and '..' are not allowed")


def _source_field(default, description: str):
    return Field(default, max_length=512, pattern=MODEL_SOURCE_PATTERN, description=description,
                 json_schema_extra={"x-kubernetes-validations": [_NO_DOT_SEGMENTS]})


def _check_source(v: str | None) -> str | None:
    if v is not None:
        parse_model_source(v)  # the same grammar as the CRD's pattern and CEL rule, with a clear message
    return v


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelSpec(_Model):
    """Which model to serve."""

    source: str = _source_field(..., (
        "Where the weights come from: a bundled model name (e.g. smollm2-135m), an https:// URL of a .gguf "
        "file, hf://org/repo (a whole Hugging Face checkpoint: config.json, *.safetensors, tokenizer files) or "
        "hf://org/repo/file.gguf, or pvc://claim/path (a GGUF file or a checkpoint directory on a PersistentVolumeClaim). "
        "Path segments use letters, digits and ._+- only; '.' and '..' segments are refused."))
    served_name: str | None = Field(None, max_length=128, description="Model name in the OpenAI API and in metrics (default: the InferenceService name).")
    cache: ModelCacheSpec | None = Field(None, description=(
        "Where downloaded models (https:// and hf:// sources, the draft model too) are kept: unset, the operator's default "
        "(the chart's modelCache.mode)."))
    _valid_source = field_validator("source")(_check_source)


QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$"


class ModelCacheSpec(_Model):
    """A model cache entry: a PersistentVolumeClaim per source in the namespace, filled once by a loader Job and mounted
    read-only by every engine pod of every InferenceService that serves that source."""

    mode: Literal["Shared", "PerPod"] | None = Field(None, description=(
        "Shared: one ReadWriteMany claim per source, filled once, shared by every pod and InferenceService of the namespace "
        "(needs ReadWriteMany storage); PerPod: each pod downloads into its own emptyDir (no shared storage needed). "
        "Unset: the operator's default."))
    storage_class_name: str | None = Field(None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                           description="StorageClass of the entry's claim (unset: the operator's default, then the cluster's).")
    size: str | None = Field(None, max_length=32, pattern=QUANTITY_PATTERN,
                             description="Storage the entry's claim requests, e.g. 20Gi (unset: the operator's default). Set when the claim is made.")


class SpeculativeSpec(_Model):
    """Speculative decoding: a proposer drafts tokens that the model verifies in one pass."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra={"x-kubernetes-validations": [
                                  cel("self.method == 'ngram' || has(self.draftModel)", "methods draft and eagle3 need draftModel", ".draftModel"),
                                  cel("self.method != 'ngram' || !has(self.lookup) || !self.lookup",
                                      "lookup combines n-gram lookup with methods draft and eagle3", ".lookup")]})
    method: Literal["ngram", "draft", "eagle3"] = Field("ngram", description=(
        "ngram: prompt lookup; draft: a small draft model sharing the tokenizer; eagle3: an EAGLE-3 head (draftModel: its checkpoint, "
        "the published layout) drafting from the model's own hidden states."))
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Tokens proposed per step.")
    draft_model: str | None = _source_field(None, (
        "Method draft: the draft model's source; method eagle3: the EAGLE-3 head's (hf://org/repo or pvc://claim/dir); in model.source's "
        "grammar, fetched or mounted like the model."))
    lookup: bool | None = Field(None, description=(
        "Methods draft and eagle3, engine kvpilot: a sequence whose last tokens occurred earlier in it is proposed what followed them "
        "there (as ngram), the model drafts for the others (--speculative-lookup): copy-heavy text gets n-gram's speed-up, other "
        "text the model's. Its steps stay synchronous."))
    _valid_draft = field_validator("draft_model")(_check_source)


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class AdapterSpec(_Model):
    """A LoRA adapter (PEFT: adapter_config.json + adapter_model.safetensors) served over the model, by its own name."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra={"x-kubernetes-validations": [
                                  cel("self.source.startsWith('hf://') || self.source.startsWith('pvc://')",
                                      "an adapter is a directory: hf://org/repo or pvc://claim/path", ".source")]})
    name: str = Field(max_length=63, pattern=ADAPTER_NAME_PATTERN, description=(
        "The adapter's name: what clients put in `model`, in /v1/models and in metrics. It must not be another served "
        "model's or adapter's name in the namespace (a collision is Degraded)."))
    source: str = _source_field(..., (
        "Where the adapter comes from, in model.source's grammar: hf://org/repo (the repository's adapter_config.json and "
        "adapter_model.safetensors, downloaded by each engine pod; never a pickled adapter_model.bin) or pvc://claim/path "
        "(a directory on a PersistentVolumeClaim, mounted read-only: adding a claim no pod mounts yet rolls the pods)."))

    @field_validator("source")
    @classmethod
    def _adapter_source(cls, v: str) -> str:
        src = parse_model_source(v)
        if src.kind not in ("hf", "pvc") or (src.kind == "hf" and src.path):
            raise ValueError(f"adapter source {v!r}: an adapter is a directory: hf://org/repo or pvc://claim/path")
        return v


class OutputParsers(_Model):
    """How the engine reads tool calls and reasoning out of the model's outputs, in the model's own format."""

    tool_calls: Literal["hermes", "llama3_json"] | None = Field(None, description=(
        "Format of tool calls: hermes (<tool_call> blocks: Qwen2/3) or llama3_json (Llama 3.x JSON calls). kvpilot: "
        "--tool-call-parser (unset: the chat template's); vLLM: --enable-auto-tool-choice --tool-call-parser (unset: tools refused); "
        "SGLang: --tool-call-parser hermes or llama3."))
    reasoning: Literal["qwen3", "deepseek_r1"] | None = Field(None, description=(
        "Return <think> blocks as reasoning_content: qwen3 or deepseek_r1 (SGLang: deepseek-r1); unset: reasoning stays in content."))


class KVOffloadSpec(_Model):
    """The tiers below the KV cache (engine kvpilot): a host-memory tier (hostSize, --kv-host-offload-size) and a disk tier
    (--kv-offload-dir): full KV blocks kept as files named by their key, read back instead of recomputed when a prompt's prefix
    fell out of an engine's cache, after a restart, or (Shared) when another pod computed it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", json_schema_extra={
        "x-kubernetes-validations": [cel("self.mode != 'Off' || has(self.hostSize)", "mode Off (no disk tier) needs hostSize", ".mode")]})

    mode: Literal["Shared", "PerPod", "Off"] = Field("Shared", description=(
        "The disk tier. Shared: one ReadWriteMany claim per InferenceService (<name>-kv-tier), mounted by every pod: a prefix one pod "
        "computed is a tier hit on the others, and it outlives pods (needs ReadWriteMany storage); PerPod: an emptyDir per pod "
        "(sizeLimit: size), which outlives the engine's restarts within the pod only; Off: none (the host tier only)."))
    host_size: str | None = Field(None, max_length=32, pattern=QUANTITY_PATTERN, description=(
        "Host memory for the host tier, e.g. 8Gi: blocks copied off the GPU as they are computed and copied back on a hit, before "
        "the disk tier is read (unset: no host tier). It is part of the engine's memory: resources.memory must hold it."))

    @model_validator(mode="after")
    def _a_tier(self) -> KVOffloadSpec:
        if self.mode == "Off" and self.host_size is None:  # the CEL rule above, for specs the API server did not check
            raise ValueError("kvOffload mode Off (no disk tier) needs hostSize")
        return self
    size: str = Field("10Gi", max_length=32, pattern=QUANTITY_PATTERN, description=(
        "The tier's storage (the claim's request, or the emptyDir's sizeLimit); the engine keeps its files within 90% of it "
        "(least recently used files go first)."))
    storage_class_name: str | None = Field(None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                           description="Shared: the claim's StorageClass (unset: the cluster's default).")


class EngineSettings(_Model):
    """Engine settings; each maps to the engine's own flag (for kvpilot: kvpilot.server.config.EngineConfig)."""

    max_model_len: int | None = Field(None, ge=16, description="Longest prompt + output in tokens (default: the model's).")
    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="Most sequences batched in one step.")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="Token budget of one step.")
    block_size: int | None = Field(None, ge=1, le=256, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks of identical prompt prefixes.")
    enable_chunked_prefill: bool | None = Field(None, description="Split long prompts over several steps.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Fraction of GPU memory for weights and KV cache.")
    kv_cache_memory: str | None = Field(None, max_length=32, pattern=r"^\d+(\.\d+)?([KMG]i?)?B?$", description=(
        "KV-cache size for CPU engines (per rank), e.g. 1GiB. For a model whose KV layout the operator knows (a bundled one), a "
        "cache that cannot hold one sequence of maxModelLen is refused (InvalidEngineSettings, with its bytes per token per kind of layer)."))
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(None, description="Compute dtype.")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8"] | None = Field(None, description=(
        "KV-cache element type; auto = the compute dtype. bfloat16 under a float32 model halves the cache: twice the tokens in the same "
        "memory, half the memory each decode step's attention reads. fp8 (E4M3 with per-layer scales: the checkpoint's, else calibrated "
        "at start) holds twice bfloat16's tokens; every engine takes it (vLLM --kv-cache-dtype fp8, SGLang fp8_e4m3). vLLM and SGLang: "
        "auto or fp8 (float32 and bfloat16 are kvpilot's; reported as Degraded)."))
    enforce_eager: bool | None = Field(None, description=(
        "GPU: run every step eagerly, without CUDA graphs (kvpilot and vLLM --enforce-eager, SGLang --disable-cuda-graph): slower decode, "
        "less GPU memory held, faster start."))
    quantization: Literal["none", "gguf", "int8", "int4", "fp8", "awq", "gptq", "compressed-tensors"] | None = Field(None, description=(
        "Weight quantization, each engine's own (unset: the engine's default, which for kvpilot, vLLM and SGLang detects a pre-quantized "
        "checkpoint): kvpilot takes gguf (a GGUF model's Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K blocks kept and multiplied as they "
        "are), int8 and int4 (weight-only, quantized at load; int4 groups of 32 columns unless extraArgs sets "
        "--quantization-group-size), gptq, awq and compressed-tensors (such checkpoints' integer or FP8 weights kept packed) and fp8 (a "
        "quant_method fp8 checkpoint, its E4M3 weights kept as they are), on CPU and GPU; vLLM "
        "takes fp8, awq, gptq, compressed-tensors; SGLang fp8, awq, gptq, gguf, compressed-tensors. A value the engine does not take is reported as Degraded."))
    tensor_parallel_size: int = Field(1, ge=1, le=16, description=(
        "Ranks each pipeline stage's layers are split over (vLLM --tensor-parallel-size, SGLang --tp-size); the engine's GPUs are "
        "tensorParallelSize x pipelineParallelSize (one pod's unless resources.gpusPerPod is fewer)."))
    pipeline_parallel_size: int = Field(1, ge=1, le=16, description=(
        "Stages of consecutive layers the model is split over, each tensorParallelSize ranks (vLLM --pipeline-parallel-size, SGLang "
        "--pp-size); the engine's GPUs are tensorParallelSize x pipelineParallelSize (one pod's unless resources.gpusPerPod is fewer)."))

    @property
    def gpus(self) -> int:
        """The GPUs of one replica of the service (every rank of every stage): one pod's unless resources.gpusPerPod is fewer."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
    speculative: SpeculativeSpec | None = Field(None, description="Speculative decoding (off when absent).")
    kv_offload: KVOffloadSpec | None = Field(None, description="The KV tiers below the engine's KV cache: disk and host memory (engine kvpilot; off when absent).")
    parsers: OutputParsers | None = Field(None, description="Tool-call and reasoning formats of the model's outputs.")
    engine_core_process: bool | None = Field(None, description=(
        "kvpilot: run the scheduler and model runner in a process of their own, the server's process keeping HTTP, tokenization and "
        "detokenizing (--engine-core-process; off by default until measured to pay). vLLM's V1 and SGLang "
        "always run theirs apart: the field is kvpilot's."))
    max_loras: int | None = Field(None, ge=1, le=64, description=(
        "With spec.adapters: adapters in the compute device's slots at once (--max-loras; default 1, as vLLM's); requests of "
        "other adapters wait for a slot."))
    max_lora_rank: int | None = Field(None, ge=1, le=512, description=(
        "With spec.adapters: the largest adapter rank accepted (--max-lora-rank; default 16, as vLLM's); a bigger adapter is refused at load."))


class Toleration(_Model):
    key: str | None = Field(None, max_length=253, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, max_length=253, description="Taint value (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(None, description="Taint effect.")
    toleration_seconds: int | None = Field(None, description="For NoExecute: how long the pod stays bound.")


GPUS_PER_POD_MESSAGE = "resources.gpusPerPod must divide the engine's GPUs (engineSettings.tensorParallelSize x pipelineParallelSize)"


class ResourceSpec(_Model):
    """Where and with what the engine pods run. GPUs per pod: gpusPerPod, by default every rank's
    (engineSettings.tensorParallelSize x pipelineParallelSize)."""

    gpu_product: str | None = Field(None, max_length=128, description="Required GPU model, matched on the node label nvidia.com/gpu.product.")
    gpu_resource: str = Field("nvidia.com/gpu", max_length=128, description="Extended resource name of a GPU.")
    cpu_only: bool = Field(False, description="Run without GPUs (the kvpilot engine's CPU path; for tests and demos).")
    gpus_per_pod: int | None = Field(None, ge=1, le=16, description=(
        "GPUs (engine ranks) of one pod. Unset: all of the engine's, tensorParallelSize x pipelineParallelSize, one pod per replica. "
        "Fewer: each replica is a group of tensorParallelSize x pipelineParallelSize / gpusPerPod pods, a LeaderWorkerSet "
        "<name>-group (it must divide; the LWS controller must be installed): the leader serves the API, the other pods run their "
        "ranks, and the group is recreated as a unit when one of its pods fails. Not with disaggregation."))
    cpu: str | None = Field(None, max_length=32, description="CPU request and limit, e.g. '4'.")
    memory: str | None = Field(None, max_length=32, description="Memory request and limit, e.g. 16Gi.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra node labels pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Taints the pods tolerate.")


class AutoscalingSpec(_Model):
    """Scaling on the engines' KV-cache utilization and queue depth, read from Prometheus."""

    enabled: bool = Field(True, description="Off: spec.replicas is honoured as set.")
    target_kv_cache_utilization: float = Field(0.7, gt=0, le=1, description="Mean KV-cache utilization per ready pod to aim for (0-1).")
    target_queue_depth: float = Field(4.0, gt=0, description="Mean waiting requests per ready pod to aim for.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while every signal is within this fraction of its target.")
    interval_seconds: int = Field(15, ge=1, le=600, description="How often to evaluate.")
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600, description="Scale down only to the highest recommendation of this window.")
    metrics_stale_after_seconds: int | None = Field(None, ge=1, description="A sample older than this is stale (default 3 x interval).")
    scale_to_zero_idle_seconds: int = Field(300, ge=5, le=86400, description=(
        "With minReplicas 0: scale from 1 to 0 pods once the gateway's fresh request metrics (and the engines' own) have shown no "
        "request for this long. Missing or stale gateway metrics never scale to zero. A request through kvpilot-gateway wakes "
        "the service again (it is held until a pod is Ready)."))


class PrefillPoolSpec(_Model):
    """The prefill pool of a disaggregated service: engine pods that run each prompt and hold its KV blocks until a decode pod
    pulls them (--kv-role prefill). They scale on their own queue depth."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", json_schema_extra={
        "x-kubernetes-validations": [*REPLICA_BOUNDS]})
    replicas: int | None = Field(None, ge=1, description="Prefill pods; written by the autoscaler when spec.autoscaling is on (unset: minReplicas).")
    min_replicas: int = Field(1, ge=1, description="Fewest prefill pods.")
    max_replicas: int = Field(3, ge=1, le=1000, description="Most prefill pods.")
    target_queue_depth: float = Field(2.0, gt=0, description=(
        "Mean waiting requests per ready prefill pod to aim for (the prefill pool's scaling signal; the service's tolerance, interval and "
        "scale-down window apply)."))
    resources: ResourceSpec | None = Field(None, description="The prefill pods' GPUs, CPU/memory and placement (unset: spec.resources).")

    @model_validator(mode="after")
    def _bounds(self) -> PrefillPoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"disaggregation.prefill: minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        return self


class DisaggregationSpec(_Model):
    """Prefill/decode disaggregation (engine kvpilot): a prefill pool beside the service's own pods, which become its decode pool.
    kvpilot-gateway sends each request to a prefill pod (prefix affinity), then to a decode pod with the kv_transfer_params it
    answered; the decode pod pulls the prompt's KV blocks over TCP and decodes. The decode pool is the service's replicas,
    minReplicas, maxReplicas, resources and autoscaling (on KV-cache use and queue depth; the scale subresource scales it).
    A request sent to the Service directly (past the gateway) is served by a decode pod alone."""

    prefill: PrefillPoolSpec = Field(default_factory=PrefillPoolSpec, description="The prefill pool.")
    kv_transfer_timeout_seconds: float | None = Field(None, gt=0, le=3600, description=(
        "How long a prefill pod holds a prompt's blocks for the decode pod to pull (--kv-transfer-timeout; the engine's default when "
        "unset); a pull after it recomputes the prompt on the decode pod."))


class PodTemplatePatch(_Model):
    """spec.podTemplate: what is merged into the engine pods' template."""

    spec: dict[str, Any] = Field(default_factory=dict, description=(
        "Merged into the pods' spec as a strategic-merge patch: maps by key, containers, volumes, env and mounts by name, other "
        "lists replaced."), json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


class InferenceServiceSpec(_Model):
    """An LLM served by engine pods, autoscaled on KV-cache utilization and queue depth."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", json_schema_extra={
        "x-kubernetes-validations": [
            *REPLICA_BOUNDS,
            cel("self.engine == 'kvpilot' || !has(self.resources) || !self.resources.cpuOnly",
                "resources.cpuOnly is only possible with engine kvpilot", ".resources.cpuOnly"),
            cel("self.engine != 'sglang' || !has(self.adapters) || size(self.adapters) == 0",
                "adapters are loaded into engine kvpilot or vllm pods", ".adapters"),
            cel("!has(self.disaggregation) || self.engine == 'kvpilot'", "disaggregation needs engine kvpilot", ".disaggregation"),
            cel("!has(self.disaggregation) || self.minReplicas >= 1", "a disaggregated service does not scale to zero (minReplicas >= 1)",
                ".minReplicas"),
            cel("!has(self.resources) || !has(self.resources.gpusPerPod) || "
                "(self.engineSettings.tensorParallelSize * self.engineSettings.pipelineParallelSize) % self.resources.gpusPerPod == 0",
                GPUS_PER_POD_MESSAGE, ".resources.gpusPerPod"),
            cel("!has(self.disaggregation) || !has(self.resources) || !has(self.resources.gpusPerPod) || "
                "self.resources.gpusPerPod == self.engineSettings.tensorParallelSize * self.engineSettings.pipelineParallelSize",
                "groups of pods (resources.gpusPerPod below the engine's GPUs) are not disaggregated yet", ".resources.gpusPerPod"),
            cel("!has(self.disaggregation) || !has(self.disaggregation.prefill.resources) || "
                "!has(self.disaggregation.prefill.resources.gpusPerPod)", "the prefill pool's pods hold every rank (no gpusPerPod)",
                ".disaggregation.prefill.resources.gpusPerPod"),
        ]})
    model: ModelSpec = Field(description="The model to serve.")
    engine: Literal["kvpilot", "vllm", "sglang"] = Field("kvpilot", description="Inference engine: kvpilot (bundled), vllm or sglang.")
    image: str | None = Field(None, max_length=512, description="Engine image (default per engine).")
    engine_settings: EngineSettings = Field(default_factory=EngineSettings, description="Engine settings.")
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=32, description=(
        "LoRA adapters served over the model, each by its name. The operator loads each into every Ready pod through the engine's "
        "run-time loading API (no restart; new pods get them too), unloads removed ones, and reports per adapter how many pods hold "
        "it (status.adapters, condition AdaptersReady). The first adapter (or removing the last) rolls the pods once: LoRA compute is "
        "on only with adapters."),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    resources: ResourceSpec = Field(default_factory=ResourceSpec, description="GPUs, CPU/memory and placement.")
    replicas: int | None = Field(None, ge=0, description="Desired pods; written by the autoscaler (scale subresource) when autoscaling is on.")
    min_replicas: int = Field(1, ge=0, description=(
        "Fewest pods. 0 = scale to zero after autoscaling.scaleToZeroIdleSeconds without traffic; requests must then come "
        "through kvpilot-gateway, which holds them and wakes the service (a direct call to the Service finds no pod)."))
    max_replicas: int = Field(3, ge=1, le=1000, description="Most pods.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Autoscaling on engine metrics.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment variables of the engine container.")
    api_key_secret_ref: SecretKeyRef | None = Field(None, description=(
        "The API key the engine requires (Authorization: Bearer), read from a Secret into KVPILOT_API_KEY; absent = no key."))
    extra_args: list[str] = Field(default_factory=list, max_length=64, description=(
        "Extra engine command-line arguments (appended). For vLLM and SGLang on their pinned images (no `image` set), each flag is "
        "checked against that release's own parser (a snapshot): an unknown, deprecated or mis-valued flag is reported as Degraded."))
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations of the engine pods.")
    pod_labels: dict[str, str] = Field(default_factory=dict, description="Extra labels of the engine pods.")
    pod_template: PodTemplatePatch | None = Field(None, description=(
        "A strategic-merge patch over the engine pods (affinity, priorityClassName, runtimeClassName, extra volumes and mounts, envFrom, "
        "sidecars …): docs/operator.md says what is allowed; a patch that weakens the security context, replaces the engine "
        "container's command, args or image, uses a host namespace or mounts a host path is refused (Degraded, InvalidPodTemplate)."))
    disaggregation: DisaggregationSpec | None = Field(None, description=(
        "Prefill/decode disaggregation: a prefill pool (Deployment <name>-prefill) hands each prompt's KV to the service's own pods, "
        "which decode (off when absent)."))

    @model_validator(mode="after")
    def _disaggregation(self) -> InferenceServiceSpec:
        if self.disaggregation is not None and self.engine != "kvpilot":  # the CEL rules above, for specs the API server did not check
            raise ValueError("disaggregation needs engine kvpilot")
        if self.disaggregation is not None and self.min_replicas < 1:
            raise ValueError("a disaggregated service does not scale to zero (minReplicas >= 1)")
        return self

    @property
    def group_size(self) -> int:
        """Pods per replica: 1, or with resources.gpusPerPod below the engine's GPUs, a LeaderWorkerSet group's."""
        per_pod = self.resources.gpus_per_pod
        return self.engine_settings.gpus // per_pod if per_pod else 1

    @property
    def gpus_per_pod(self) -> int:
        return self.resources.gpus_per_pod or self.engine_settings.gpus

    @model_validator(mode="after")
    def _groups(self) -> InferenceServiceSpec:
        per_pod, gpus = self.resources.gpus_per_pod, self.engine_settings.gpus  # the CEL rules above, again
        if per_pod and gpus % per_pod:
            raise ValueError(f"{GPUS_PER_POD_MESSAGE} (resources.gpusPerPod={per_pod}, the engine's GPUs {gpus})")
        if self.disaggregation is not None and self.group_size > 1:
            raise ValueError("groups of pods (resources.gpusPerPod below the engine's GPUs) are not disaggregated yet")
        if self.disaggregation is not None and (self.disaggregation.prefill.resources or ResourceSpec()).gpus_per_pod:
            raise ValueError("the prefill pool's pods hold every rank (no gpusPerPod)")
        return self

    @model_validator(mode="after")
    def _adapters_unique(self) -> InferenceServiceSpec:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: names must be unique ({', '.join(sorted({n for n in names if names.count(n) > 1}))} repeated)")
        if self.adapters and self.engine == "sglang":
            raise ValueError("adapters are loaded into engine kvpilot or vllm pods")
        return self

    @model_validator(mode="after")
    def _min_not_above_max(self) -> InferenceServiceSpec:
        # The CEL rules above, again: the autoscaler's evaluate() takes this model, and must not trust
        # that every object it reads went through the API server's validation.
        # (replicas is not held to the bounds here: the autoscaler clamps it, and /scale may set it.)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        return self


class EnvVarSource(_Model):
    secret_key_ref: SecretKeyRef = Field(description="A key of a Secret in the same namespace.")


class EnvVar(_Model):
    """An environment variable: a value, or a Secret's key (for HF_TOKEN: then it is in neither the object nor the pod spec)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra={"x-kubernetes-validations": [
                                  cel("!(has(self.value) && self.value != '' && has(self.valueFrom))", "give value or valueFrom, not both")]})
    name: str = Field(max_length=256, description=f"Variable name (not one the operator sets: {', '.join(RESERVED_ENV)}).",
                      json_schema_extra={"x-kubernetes-validations": [
                          cel(f"!({' || '.join(repr(n) + ' == self' for n in RESERVED_ENV)})".replace("'", '"'),
                              f"is set by the operator and cannot be overridden ({', '.join(RESERVED_ENV)})")]})
    value: str = Field("", max_length=4096, description="Value.")
    value_from: EnvVarSource | None = Field(None, description="Where the value comes from instead (a Secret's key).")

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError(f"env {self.name}: give value or valueFrom, not both")
        return self

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_ENV:
            raise ValueError(f"env {v} is set by the operator and cannot be overridden (reserved: {', '.join(RESERVED_ENV)})")
        return v


class SecretKeyRef(_Model):
    name: str = Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="Secret name (same namespace).")
    key: str = Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret.")


ModelSpec.model_rebuild()
InferenceServiceSpec.model_rebuild()


# --- status -------------------------------------------------------------------------------------

class Condition(_Model):
    type: str = Field(description="Ready, Progressing, Degraded, ScalingActive or AdaptersReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="Condition status.")
    reason: str = Field("", description="CamelCase reason.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, description="Generation this condition was computed for.")


class MetricsSnapshot(_Model):
    kv_cache_utilization: str | None = Field(None, description="Mean KV-cache utilization of ready pods (0-1), as last seen.")
    queue_depth: str | None = Field(None, description="Mean waiting requests per ready pod, as last seen.")
    pods: int | None = Field(None, description="Pods the metrics came from.")
    time: str | None = Field(None, description="When they were read (RFC 3339); rewritten only with changed values (status is not written for a timestamp alone).")


class ScalingEvent(_Model):
    time: str = Field(description="When (RFC 3339).")
    from_replicas: int = Field(alias="from", description="Replicas before.")
    to_replicas: int = Field(alias="to", description="Replicas after.")
    reason: str = Field(description="Why, with the numbers behind it.")


class RecommendationLevel(_Model):
    replicas: int = Field(description="Replicas recommended.")
    until: str | None = Field(None, description="The last time they were (RFC 3339, rounded up); absent: the latest recommendation, still standing.")


class ScaleDownWindow(_Model):
    """The autoscaler's scale-down stabilization window, kept so that a new leader resumes it (a scale-down
    waits for the highest recommendation of the window): written only when a level appears or goes,
    never because time passed."""

    since: str | None = Field(None, description="When recommendations began (RFC 3339, rounded up): a scale-down waits until a whole window of them has been seen.")
    levels: list[RecommendationLevel] = Field(default_factory=list, description=(
        "Each recommendation not outdone by a later one, oldest (highest) first: the window's highest recommendation at any "
        "later time is the first level still inside it."))


class ModelCacheEntryStatus(_Model):
    claim: str = Field(description="The entry's PersistentVolumeClaim.")
    source: str = Field(description="The model source it holds.")
    state: Literal["Filling", "Ready", "Failed"] = Field(description="Filling: its loader Job runs (or retries); Ready: pods mount it; Failed: the last fill failed.")
    revision: str | None = Field(None, description="What was fetched: an hf:// source's commit, resolved when the entry was filled.")
    bytes: int | None = Field(None, description="Bytes of model files in the entry.")
    message: str | None = Field(None, description="Why the last fill failed (the loader's own words).")


class ColdStartPhase(_Model):
    name: Literal["scheduling", "model", "import", "load", "warmup", "listen", "ready"] = Field(description=(
        "scheduling: created to scheduled; model: scheduled to the engine's process start (image pull, the model download, "
        "or nothing with the model cache); import, load (weights, KV cache), warmup (graphs, grammar compiler), listen: the "
        "kvpilot engine's own; ready: to the pod Ready (probes)."))
    seconds: float = Field(description="Seconds (pod timestamps have whole-second resolution).")


class ColdStart(_Model):
    pod: str = Field(description="The pod.")
    ready_time: str = Field(description="When it turned Ready (RFC 3339).")
    total_seconds: float = Field(description="Created to Ready, seconds.")
    phases: list[ColdStartPhase] = Field(default_factory=list, description="Where the time went, in order.")


class AdapterStatus(_Model):
    name: str = Field(description="The adapter.")
    source: str = Field(description="Its source, as the spec gives it.")
    loaded_pods: int = Field(0, description="Ready pods that hold it (as their own /v1/models says).")
    message: str | None = Field(None, description="Why the last load failed (the engine's own words).")


class GroupStatus(_Model):
    """One replica of a service whose replicas are groups of pods (a LeaderWorkerSet group)."""

    name: str = Field(description="The group: its leader pod's name (<name>-group-<index>).")
    pods: int = Field(description="The group's pods that exist.")
    ready_pods: int = Field(description="Of them, Ready (a worker is Ready once its ranks run; the leader once the whole group joined).")
    ready: bool = Field(description="Every pod of the group exists and is Ready: the leader serves.")
    not_ready: list[str] = Field(default_factory=list, description="The group's pods that are not Ready, by name.")


class PoolStatus(_Model):
    """The prefill pool of a disaggregated service (the decode pool is the status's own replicas)."""

    replicas: int = Field(0, description="Prefill pods that exist.")
    ready_replicas: int = Field(0, description="Prefill pods that are ready.")
    desired_replicas: int = Field(0, description="What the autoscaler (or disaggregation.prefill.replicas) asks for.")
    last_metrics: MetricsSnapshot | None = Field(None, description="The prefill pods' metrics last seen by the autoscaler.")
    scaling: str | None = Field(None, description="The autoscaler's last decision for the pool, with the numbers behind it.")


class InferenceServiceStatus(_Model):
    observed_generation: int | None = Field(None, description="The spec generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, ScalingActive.")
    replicas: int | None = Field(None, description="Pods that exist (scale subresource status).")
    ready_replicas: int | None = Field(None, description="Pods that are ready.")
    updated_replicas: int | None = Field(None, description="Pods running the current spec.")
    desired_replicas: int | None = Field(None, description="What the autoscaler (or spec.replicas) asks for.")
    selector: str | None = Field(None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(None, description="In-cluster OpenAI API base URL.")
    last_metrics: MetricsSnapshot | None = Field(None, description="Engine metrics last seen by the autoscaler.")
    last_scale_time: str | None = Field(None, description="When replicas last changed (RFC 3339).")
    scaling_history: list[ScalingEvent] = Field(default_factory=list, description="The last few scaling decisions, newest last.")
    scale_down_window: ScaleDownWindow | None = Field(None, description="The autoscaler's scale-down window (survives a leader change).")
    model_cache: list[ModelCacheEntryStatus] = Field(default_factory=list, description="The model cache entries the pods mount (mode Shared).")
    last_cold_start: ColdStart | None = Field(None, description="The newest engine pod's start, phase by phase.")
    adapters: list[AdapterStatus] = Field(default_factory=list, description="spec.adapters, each with how many Ready pods hold it.")
    groups: list[GroupStatus] = Field(default_factory=list, description=(
        "With resources.gpusPerPod below the engine's GPUs: each replica's group of pods and its readiness (replicas and readyReplicas "
        "count groups)."))
    adapter_count: int | None = Field(None, description="How many adapters spec.adapters names (kubectl get's ADAPTERS column).")
    prefill: PoolStatus | None = Field(None, description=(
        "With spec.disaggregation: the prefill pool (replicas, readyReplicas and the scale subresource above are then the decode pool's)."))


class InferenceService(_Model):
    api_version: str = Field(f"{GROUP}/{VERSION}")
    kind: str = Field(KIND)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
