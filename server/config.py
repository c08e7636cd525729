"""The engine's one configuration model, shared by the CLI, the offline `LLM`, the server and the operator.

This module must stay importable without torch: the operator renders engine args from it.
Field names follow vLLM's where vLLM has one, so `--max-num-seqs` means the same thing in both.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FP8_KV_NAMES = ("fp8", "fp8_e4m3")  # kv_cache_dtype values of the FP8 (float8_e4m3fn) cache
DTYPE_SPELLINGS = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings of kvpilot's values
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MiB", "2G" or "1048576"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 536870912, 512MiB or 2GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


class EngineConfig(BaseModel):
    """Everything that shapes the engine. One flag per field: `--max-num-seqs 8` sets max_num_seqs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field("smollm2-135m", description=(
        "Bundled model name, GGUF file, Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or Hugging "
        "Face Hub repository id (ORG/REPO[@REVISION], downloaded into the Hugging Face cache)."))
    served_model_name: str | None = Field(None, description="Name in the API and in metrics (default: the model's).")
    max_model_len: int | None = Field(None, ge=16, description="Longest prompt + output in tokens (default: the model's context, capped by the KV cache).")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one engine step.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Token budget of one engine step (prefill chunks + decodes).")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description=(
        "Which waiting request runs next, as vLLM's: fcfs = arrival order (a request with a non-zero priority is a 400); priority = "
        "by the request field priority (an integer, default 0; lower runs first), then arrival, and when the KV cache is full the "
        "running request with the highest priority value (the latest among equals) is preempted. A running request is never "
        "preempted for a waiting one."))
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over several steps.")
    kv_cache_memory: int = Field(1 << 30, ge=1 << 20, description=(
        "Bytes of KV cache (e.g. 1GiB). On a GPU, set: the cache's size; unset: --gpu-memory-utilization's share of the GPU."))
    structured_outputs_max_mask_ms: float = Field(3.0, gt=0, description=(
        "What a structured-output constraint's token mask may cost, in CPU time, on average after a first 25 ms (for the library "
        "to build lexer states); timed once a step's masks take longer than this. A request past it ends with an error naming its "
        "field and the constraint is refused from then on, so constrained rows cannot slow the others' steps by more than this each."))
    kv_offload_dir: str | None = Field(None, description=(
        "A disk tier for the prefix cache: full KV blocks are saved here as files named by their key, and a prompt whose prefix "
        "fell out of the cache (or was computed by another engine sharing the directory, or before a restart) is read back "
        "instead of recomputed. Off when unset."))
    kv_offload_size: int = Field(16 << 30, ge=1 << 20, description="Most bytes the disk tier's directory holds (least recently used files go first).")
    kv_host_offload_size: int = Field(0, ge=0, description=(
        "Bytes of host memory for a host tier of the prefix cache (e.g. 8GiB): full blocks are copied there as they are computed, "
        "and a prompt whose prefix fell out of the KV cache is copied back instead of recomputed (before the disk tier is read); "
        "0: off. On a CPU engine the KV cache is host memory already: this holds what a larger kv_cache_memory would."))
    kv_role: Literal["none", "prefill", "decode", "both"] = Field("none", description=(
        "Prefill/decode disaggregation: prefill = a request with kv_transfer_params.do_remote_decode has its prompt's KV blocks held "
        "for a decode engine to pull (served on kv_transfer_port), its output carrying the params to pass on; decode = a request "
        "with do_remote_prefill pulls those blocks instead of computing them; both = either; none = off."))
    kv_transfer_port: int = Field(5600, ge=0, le=65535, description="kv_role prefill or both: the TCP port held blocks are served on (0: any free port).")
    kv_transfer_host: str = Field("127.0.0.1", min_length=1, max_length=255, description=(
        "kv_role prefill or both: the address held blocks are served on and decode engines are told (in kv_transfer_params; a pod's IP)."))
    kv_transfer_timeout: float = Field(60.0, gt=0, le=3600, description=(
        "Seconds a prefill engine holds blocks nobody pulled, and a decode engine waits for a pull (then computes the blocks itself)."))
    kv_transfer_config: str | None = Field(None, description=(
        "The KV connector in vLLM's JSON shape (the connector names are kvpilot's own): the KV tiers as {\"kv_connector\": \"KVPilotTiersConnector\", \"kv_role\": \"kv_both\", "
        "\"kv_connector_extra_config\": {\"host_size\": \"8GiB\", \"disk_dir\": \"/kv\", \"disk_size\": \"100GiB\"}} sets "
        "kv_host_offload_size, kv_offload_dir and kv_offload_size (a flag given too must agree); {\"kv_connector\": \"KVPilotNixlConnector\", "
        "\"kv_role\": \"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_connector_extra_config\": {\"port\": 5600, \"host\": "
        "\"10.0.0.5\", \"timeout\": 60}} sets kv_role (prefill, decode, both) and kv_transfer_port, _host, _timeout."))
    kv_events_config: str | None = Field(None, description=(
        "KV-cache events for routers, as vLLM's JSON: {\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv@POD@MODEL\", \"buffer_steps\": 10000, \"hwm\": "
        "100000, \"max_queue_size\": 100000}: BlockStored, BlockRemoved and AllBlocksCleared in vLLM's wire format over ZeroMQ "
        "(docs/observability.md#kv-events); other keys are refused."))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of GPU memory for weights + KV cache (CUDA).")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on CUDA (vLLM's half = float16, float = float32).")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"] = Field("auto", description=(
        "KV-cache element type; auto = the compute dtype. bfloat16 with a float32 model halves the cache's bytes — twice the tokens "
        "in kv_cache_memory (or GPU memory), half the memory each decode step's attention reads (what bounds it) — at bfloat16's precision "
        "for stored keys and values (llama.cpp's default cache is float16). fp8 (alias fp8_e4m3, vLLM's spelling) stores K / k_scale and "
        "V / v_scale as float8_e4m3fn: a quarter of float32's bytes, half of bfloat16's; the per-layer scales are the checkpoint's k_scale / "
        "v_scale, else calibrated once at start on a fixed text (docs/engine.md#fp8-kv-cache)."))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs.")
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly, without the decode steps' CUDA graphs (CPU steps always run eagerly).")
    async_scheduling: Literal["auto", "on", "off"] = Field("auto", description=(
        "Overlap the host's work for the next step (scheduling, building its input) and for the last one's outputs (detokenizing, "
        "stop checks) with the device running the current step; auto = on for CUDA, and with pipeline_parallel_size > 1 on any device, "
        "unless speculative_method=ngram or speculative_lookup (any number of "
        "ranks; draft and eagle3 proposals are made on the device from the step in flight's tokens). A "
        "sequence that the last step ended still runs in the current one (its row is dropped). With pipeline stages: a step per stage "
        "in flight, on disjoint sequences. on: also on a CPU with one stage, where it cannot overlap anything (the steps run on the "
        "host): for tests."))
    quantization: Literal["auto", "none", "gguf", "int8", "int4", "gptq", "awq", "compressed-tensors", "fp8"] = Field(
        "auto", description="Weight format: auto = a GPTQ, AWQ, compressed-tensors or fp8 checkpoint's own method (its config.json's "
                            "quantization_config), else none; gptq, awq, compressed-tensors = such a checkpoint's integer (or FP8) weights kept in "
                            "block layouts the kernels dequantize in registers (act-order weights under tensor parallelism and groups of other "
                            "than whole 32-column blocks dequantized at load); fp8 = a quant_method fp8 checkpoint (E4M3 weights, per-block or "
                            "per-tensor scales), kept as its bytes the same way; none = dequantized to the compute dtype at load; gguf = a GGUF's Q4_0/Q4_1/Q8_0 and "
                            "Q4_K/Q5_K/Q6_K tensors kept in their blocks and multiplied by kernels that dequantize in registers; int8 = float weights "
                            "quantized at load (symmetric, per 32 input columns); int4 = per group of --quantization-group-size input columns, with "
                            "scales and mins (embedding and LM head int8). CPU: C++ kernels, float32 compute; CUDA: Triton kernels, any dtype.")
    load_format: Literal["auto", "dummy"] = Field("auto", description=(
        "auto = the model's weight files; dummy = its config.json alone (a checkpoint directory, weight files absent or not read), "
        "with seeded random weights made on the device (seed: --seed): a model's shapes for capacity and speed tests, as vLLM's "
        "dummy format. Float weights: quantization none, int8 or int4."))
    quantization_group_size: int = Field(32, description=(
        "int4: input columns sharing one scale and min (32, 64 or 128; coarser groups save no memory in this layout and cost quality)."))
    seed: int = Field(0, description="Seed of the engine's default random generator.")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: all cores).")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Ranks (processes; GPUs on CUDA) the model is split over; kv_cache_memory is per rank.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Stages the model's layers are split over (consecutive layers each, the embedding on the first, the final norm and LM head on the "
        "last), each stage tensor_parallel_size ranks: ranks (GPUs) = TP x PP. Not with draft or eagle3 speculation, nor a kv_role."))
    pipeline_layer_partition: list[int] | None = Field(None, description=(
        "Layers per pipeline stage, first to last (e.g. 19 11 for a 30-layer model over 2 stages; they must add up to its layers): "
        "for a model whose LM head weighs as much as several layers (vLLM's VLLM_PP_LAYER_PARTITION); unset: as even as the count "
        "allows."))
    group_size: int = Field(1, ge=1, le=64, description=(
        "Pods serving one replica together (a LeaderWorkerSet group): the TP x PP ranks split evenly over them, in rank order, each "
        "pod starting its share. The leader (group_rank 0) runs `kvpilot serve` and hosts the ranks' rendezvous on group_port; the "
        "others run `kvpilot serve-worker` with group_leader set."))
    group_rank: int = Field(0, ge=0, le=63, description="This pod's place in its group (LeaderWorkerSet's LWS_WORKER_INDEX; 0: the leader).")
    group_leader: str | None = Field(None, max_length=253, description=(
        "group_rank > 0: the leader pod's address (LeaderWorkerSet's LWS_LEADER_ADDRESS), whose group_port the ranks meet at."))
    group_port: int = Field(29500, ge=1, le=65535, description="The port the group's leader hosts the ranks' rendezvous on.")
    group_join_timeout: float = Field(300.0, gt=0, description=(
        "Seconds the leader waits for every rank of the group to join; past them it stops, naming the ranks (and pods) missing."))
    speculative_method: Literal["ngram", "draft", "eagle3"] | None = Field(
        None, description="Speculative decoding: ngram (prompt lookup), draft (a small model given by --speculative-model) or eagle3 (an "
                          "EAGLE-3 head, --speculative-model its directory, drafting from the model's own hidden states); off when unset.")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Most tokens proposed per sequence and step.")
    speculative_model: str | None = Field(None, description=(
        "Method draft: the draft model (bundled name, GGUF file or checkpoint directory) sharing the target's tokenizer; method eagle3: "
        "the EAGLE-3 head's directory (config.json + safetensors, the published layout)."))
    speculative_draft_tensor_parallel_size: int | None = Field(None, ge=1, le=64, description=(
        "Method draft under tensor parallelism: tensor_parallel_size splits the draft model over the same ranks (its query heads, KV "
        "heads and FFN width must divide as the target's), 1 keeps it whole on rank 0, its proposals broadcast to the other ranks; "
        "unset: split where it fits, else whole on rank 0 (vLLM's draft_tensor_parallel_size)."))
    prompt_lookup_max: int = Field(4, ge=1, le=32, description="ngram, speculative_lookup: longest suffix of the sequence looked up in its earlier tokens.")
    prompt_lookup_min: int = Field(2, ge=1, le=32, description="ngram, speculative_lookup: shortest suffix looked up.")
    speculative_lookup: bool = Field(False, description=(
        "draft, eagle3: a sequence whose last prompt_lookup_max…prompt_lookup_min tokens occurred earlier in it is proposed what "
        "followed them there (as ngram), the model drafts for the others: copy-heavy text gets n-gram's speed-up, other text the "
        "model's. Looked up in each step's tokens, so async scheduling is off (as for ngram)."))
    speculative_lookup_tokens: int | None = Field(None, ge=1, le=16, description=(
        "speculative_lookup: most tokens a lookup proposes (unset: num_speculative_tokens), while the model's drafts stay at "
        "num_speculative_tokens: a lookup costs nothing to make and is often right for several tokens, a small head's drafts past "
        "the first seldom are (bench/history/: eagle3 with 1 drafted and 4 looked up)."))
    speculative_disable_batch_size: int = Field(
        4, ge=0, description="Steps with more running sequences than this do not speculate (0: never switched off by batch size).")
    speculative_min_acceptance: float = Field(
        0.05, ge=0, le=1, description="A sequence whose recent proposed tokens are accepted less often than this pauses speculation (16 steps, "
                                      "doubling while it stays low; 0: never).")

    enable_lora: bool = Field(False, description="Serve LoRA adapters (PEFT format) over the base model: --lora-modules at start, more at run time.")
    lora_modules: list[str] | None = Field(None, description="Adapters loaded at start, as name=path (a PEFT adapter directory); requests pick one by its name as `model`.")
    max_loras: int = Field(1, ge=1, le=64, description="Adapters in the compute device's slots at once: rows of at most this many distinct adapters run in one step.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters whose weights are kept in host memory (default: max_loras); others are re-read from disk when they get a slot.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="Largest adapter rank accepted (the slots are sized for it).")

    @field_validator("kv_cache_memory", "kv_offload_size", "kv_host_offload_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("max_model_len", "max_num_batched_tokens", mode="before")
    @classmethod
    def _token_count(cls, v: Any) -> Any:  # vLLM's spellings: 32k = 32000, 32K = 32768
        return vllm_human_int(v) if isinstance(v, str) and re.fullmatch(r"\s*\d+(?:\.\d+)?[kmgKMG]\s*", v) else v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_spelling(cls, v: Any) -> Any:
        return DTYPE_SPELLINGS.get(v, v) if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _vllm_aliases(cls, data: Any) -> Any:
        # LLM(speculative_config={...}, kv_cache_memory_bytes=...) as vLLM's LLM takes them: the fields they mean
        if isinstance(data, dict) and any(name in data for name in VLLM_ALIASES):
            return resolve_aliases(data, cls)
        return data

    @model_validator(mode="before")
    @classmethod
    def _kv_transfer_config(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("kv_transfer_config") is None:
            return data
        settings = kv_transfer_settings(data["kv_transfer_config"])
        for name, value in settings.items():
            given = data.get(name)
            if given is not None and (parse_size(given) if name in _SIZE_FIELDS else type(value)(given)) != value:
                raise ValueError(f"kv_transfer_config sets {name}={value!r}, and {name}={given!r} was given too")
        return {**data, **settings, "kv_transfer_config": data["kv_transfer_config"] if isinstance(data["kv_transfer_config"], str)
                else json.dumps(data["kv_transfer_config"], sort_keys=True)}

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _kv_events_json(cls, v: Any) -> Any:
        if v is None:
            return None
        return KVEventsConfig.parse(v).model_dump_json(exclude_defaults=True)

    def kv_events(self) -> KVEventsConfig | None:
        """The KV events' settings when the engine publishes them (publisher zmq), else None."""
        if self.kv_events_config is None:
            return None
        settings = KVEventsConfig.model_validate_json(self.kv_events_config)
        return settings if settings.publisher_kind() == "zmq" else None

    @model_validator(mode="after")
    def _budget_fits(self) -> EngineConfig:
        if self.max_model_len is not None and not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len when chunked prefill is off")
        return self

    @model_validator(mode="after")
    def _offload_consistent(self) -> EngineConfig:
        if self.kv_offload_dir is None and self.kv_offload_size != type(self).model_fields["kv_offload_size"].default:
            raise ValueError("kv_offload_size needs kv_offload_dir")
        for tier in ("kv_offload_dir", "kv_host_offload_size"):
            if not getattr(self, tier):
                continue
            if not self.enable_prefix_caching:
                raise ValueError(f"{tier} needs enable_prefix_caching (the KV tiers hold the prefix cache's blocks)")
        return self

    @model_validator(mode="after")
    def _transfer_consistent(self) -> EngineConfig:
        if self.kv_role == "none":
            changed = [f for f in ("kv_transfer_port", "kv_transfer_host", "kv_transfer_timeout") if getattr(self, f) != type(self).model_fields[f].default]
            if changed:
                raise ValueError(f"{', '.join(changed)} need kv_role (prefill, decode or both)")
            return self
        if not self.enable_prefix_caching:
            raise ValueError(f"kv_role={self.kv_role} needs enable_prefix_caching (blocks are pulled by their prefix-cache keys)")
        if self.pipeline_parallel_size > 1:
            raise ValueError(f"kv_role={self.kv_role} with pipeline_parallel_size={self.pipeline_parallel_size}: a prefill/decode handoff "
                             "pairs the ranks of two engines of one stage each (the KV tiers work with stages)")
        return self

    @model_validator(mode="after")
    def _speculation_consistent(self) -> EngineConfig:
        # Refused, never ignored: a draft model without method draft (or the reverse) is a mistake.
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method=draft needs speculative_model (a model sharing the target's tokenizer)")
        if self.speculative_method == "eagle3" and not self.speculative_model:
            raise ValueError("speculative_method=eagle3 needs speculative_model (the EAGLE-3 head's directory)")
        if self.speculative_model and self.speculative_method not in ("draft", "eagle3"):
            raise ValueError("speculative_model is only used with speculative_method=draft or eagle3")
        if self.async_scheduling == "on" and self.speculative_method == "ngram":
            raise ValueError("async_scheduling=on with speculative_method=ngram: n-gram proposals are looked up in each step's tokens "
                             "on the host, so its steps stay synchronous (draft and eagle3 propose on the device): use auto or off")
        if self.speculative_lookup and self.speculative_method not in ("draft", "eagle3"):
            raise ValueError("speculative_lookup combines n-gram lookup with speculative_method=draft or eagle3 "
                             f"(not {self.speculative_method}: ngram looks up alone)")
        if self.speculative_lookup_tokens is not None and not self.speculative_lookup:
            raise ValueError("speculative_lookup_tokens is only used with speculative_lookup")
        if self.speculative_lookup and self.async_scheduling == "on":
            raise ValueError("async_scheduling=on with speculative_lookup: its lookups read each step's tokens on the host, so its steps "
                             "stay synchronous: use auto or off")
        draft_tp = self.speculative_draft_tensor_parallel_size
        if draft_tp is not None and self.speculative_method == "eagle3" and draft_tp != 1:
            raise ValueError(f"speculative_draft_tensor_parallel_size={draft_tp} with speculative_method=eagle3: an EAGLE-3 head (one "
                             "layer) runs whole on rank 0 (1, vLLM's EAGLE examples' value, is what it does)")
        if draft_tp is not None and self.speculative_method not in ("draft", "eagle3"):
            raise ValueError("speculative_draft_tensor_parallel_size is only used with speculative_method=draft or eagle3")
        if draft_tp is not None and self.speculative_method == "draft" and draft_tp not in (1, self.tensor_parallel_size):
            raise ValueError(f"speculative_draft_tensor_parallel_size={draft_tp}: a draft model is split over all "
                             f"tensor_parallel_size={self.tensor_parallel_size} ranks or kept whole on rank 0 (1)")
        if self.pipeline_parallel_size > 1 and self.speculative_method in ("draft", "eagle3"):
            raise ValueError(f"speculative_method={self.speculative_method} with pipeline_parallel_size={self.pipeline_parallel_size}: the "
                             "proposer would run beside the last stage, where the hidden states and logits are, and is not implemented "
                             "there (ngram speculation works: it proposes and verifies on rank 0)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max={self.prompt_lookup_max}")
        return self

    @model_validator(mode="after")
    def _partition_consistent(self) -> EngineConfig:
        p = self.pipeline_layer_partition
        if p is not None and (len(p) != self.pipeline_parallel_size or min(p) < 1):
            raise ValueError(f"pipeline_layer_partition={p}: one count of 1 or more layers per stage "
                             f"(pipeline_parallel_size={self.pipeline_parallel_size})")
        return self

    @model_validator(mode="after")
    def _group_consistent(self) -> EngineConfig:
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if ranks % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide the {ranks} ranks (tensor_parallel_size x pipeline_parallel_size): "
                             "every pod of a group holds the same number")
        if self.group_rank >= self.group_size:
            raise ValueError(f"group_rank={self.group_rank} is past group_size={self.group_size}")
        if self.group_rank > 0 and not self.group_leader:
            raise ValueError(f"group_rank={self.group_rank} needs group_leader (the leader pod's address)")
        if self.group_size == 1 and (self.group_leader or self.group_rank):
            raise ValueError("group_leader and group_rank are for a group of pods (group_size > 1)")
        return self

    @model_validator(mode="after")
    def _kv_cache_dtype_supported(self) -> EngineConfig:
        # The attention kernels read a cache as wide as the compute dtype, a bfloat16 one under float32, or FP8 under any.
        if self.kv_cache_dtype == "float32" and self.dtype in ("float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype=float32 with dtype={self.dtype}: a cache wider than the compute dtype is not implemented "
                             "(use kv_cache_dtype=auto)")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float16":
            raise ValueError("kv_cache_dtype=bfloat16 with dtype=float16 is not implemented (use kv_cache_dtype=auto)")
        return self

    @model_validator(mode="after")
    def _quantization_supported(self) -> EngineConfig:
        q = self.quantization
        if q not in ("none", "auto") and self.device == "cpu" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization={q} on CPU computes in float32 (its C++ kernels take float32 activations), not dtype={self.dtype}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, not {self.quantization_group_size}")
        if self.quantization_group_size != 32 and q != "int4":
            raise ValueError("quantization_group_size is only used with quantization=int4")
        if self.load_format == "dummy" and q not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"load_format=dummy makes float weights: quantization none, int8 or int4, not {q} (which keeps a file's packed weights)")
        return self

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: list[str] | None) -> list[str] | None:
        from kvpilot.server.adapters import parse_lora_module

        names = [parse_lora_module(spec)[0] for spec in v or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must differ, got {names}")
        return v

    @model_validator(mode="after")
    def _lora_consistent(self) -> EngineConfig:
        lora_set = [f for f in ("lora_modules", "max_cpu_loras") if getattr(self, f) is not None]
        lora_set += [f for f in ("max_loras", "max_lora_rank") if getattr(self, f) != type(self).model_fields[f].default]
        if lora_set and not self.enable_lora:
            raise ValueError(f"{', '.join(lora_set)} need enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        return self

    def to_cli_args(self, include_defaults: bool = False) -> list[str]:
        """The flags that reproduce this config (only non-defaults unless asked)."""
        return model_to_args(self, include_defaults)

    @classmethod
    def from_cli_args(cls, argv: list[str]) -> EngineConfig:
        parser = argparse.ArgumentParser(prog="kvpilot", add_help=False)
        add_model_args(parser, cls)
        values = resolve_aliases({k: v for k, v in vars(parser.parse_args(bare_switches(argv))).items() if v is not None}, cls)
        return cls(**values)


class KVEventsConfig(BaseModel):
    """vLLM's --kv-events-config (vllm/config/kv_events.py): the same keys, defaults and meaning."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when events are enabled, else null (as vLLM)
    endpoint: str = Field("tcp://*:5557", min_length=1)
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1, le=10_000_000)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1)
    topic: str = ""

    def publisher_kind(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    @model_validator(mode="after")
    def _enabled_to_publish(self) -> KVEventsConfig:
        if self.publisher == "zmq" and not self.enable_kv_cache_events:
            raise ValueError("kv_events_config: publisher zmq needs enable_kv_cache_events true")
        return self

    @classmethod
    def parse(cls, value: str | dict) -> KVEventsConfig:
        """From the flag's JSON (or a mapping); an error names the key."""
        from pydantic import ValidationError

        try:
            data = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            raise ValueError(f"kv_events_config is not JSON ({e})") from None
        if isinstance(data, KVEventsConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError("kv_events_config must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            known = ", ".join(cls.model_fields)
            why = (f"unknown key (known: {known})" if first["type"] == "extra_forbidden"
                   else str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"])
            raise ValueError(f"kv_events_config: {where + ': ' if where else ''}{why}") from None


_SIZE_FIELDS = ("kv_host_offload_size", "kv_offload_size")
# kv_connector -> (its kv_connector_extra_config keys -> engine fields, their types; the engine field its kv_role sets)
_KV_CONNECTORS: dict[str, tuple[dict[str, tuple[str, type]], str | None]] = {
    "KVPilotTiersConnector": ({"host_size": ("kv_host_offload_size", int), "disk_dir": ("kv_offload_dir", str),
                             "disk_size": ("kv_offload_size", int)}, None),
    "KVPilotNixlConnector": ({"port": ("kv_transfer_port", int), "host": ("kv_transfer_host", str), "timeout": ("kv_transfer_timeout", float)},
                     "kv_role"),
}
_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def kv_transfer_settings(value: str | dict) -> dict[str, Any]:
    """The engine fields a --kv-transfer-config sets (vLLM's JSON: kv_connector, kv_role,
    kv_connector_extra_config); what kvpilot does not implement is refused by name."""
    try:
        config = json.loads(value) if isinstance(value, str) else value
    except ValueError as e:
        raise ValueError(f"kv_transfer_config is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    unknown = sorted(set(config) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
    if unknown:
        raise ValueError(f"kv_transfer_config: {', '.join(unknown)} not implemented (kv_connector, kv_role and kv_connector_extra_config are)")
    connector = config.get("kv_connector")
    renamed = {"OffloadingConnector": "KVPilotTiersConnector", "TCPConnector": "KVPilotNixlConnector"}.get(connector)
    if renamed:
        raise ValueError(f"kv_transfer_config: kv_connector {connector!r} is now {renamed!r} (kvpilot's own name; the "
                         f"prefill/decode K/V moves over NIXL)")
    if connector not in _KV_CONNECTORS:
        raise ValueError(f"kv_transfer_config: kv_connector {connector!r} is not implemented; {' and '.join(map(repr, _KV_CONNECTORS))} "
                         "are (kvpilot's own: its host and disk tiers; prefill/decode over NIXL)")
    keys, role_field = _KV_CONNECTORS[connector]
    role = config.get("kv_role", "kv_both")
    if role not in _KV_ROLES or (role_field is None and role != "kv_both"):
        raise ValueError(f"kv_transfer_config: kv_role {role!r} is not implemented for {connector} "
                         f"({', '.join(_KV_ROLES) if role_field else 'kv_both'} {'are' if role_field else 'is'})")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - set(keys):
        raise ValueError(f"kv_transfer_config: {connector}'s kv_connector_extra_config takes {', '.join(keys)}, got {extra!r}")
    if role_field is None and not extra:
        raise ValueError(f"kv_transfer_config: {connector}'s kv_connector_extra_config must set a tier ({', '.join(keys)})")
    settings: dict[str, Any] = {field: _extra_value(connector, key, extra[key], field, kind)
                                for key, (field, kind) in keys.items() if key in extra}
    if role_field:
        settings[role_field] = _KV_ROLES[role]
    return settings


def _extra_value(connector: str, key: str, value: Any, field: str, kind: type) -> Any:
    """A kv_connector_extra_config value as its engine field's type; a value of another type (a list, an infinite number,
    a float port) is a ValueError naming the key, never a TypeError or OverflowError."""
    if field in _SIZE_FIELDS:
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return parse_size(value) if ok else parse_size(repr(value))  # parse_size's ValueError names the value
    if kind is str and isinstance(value, str):
        return value
    if kind is not str and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
            if math.isfinite(number) and (kind is float or number == int(number)):
                return kind(number)
        except ValueError:
            pass
    what = {int: "an integer", float: "a finite number", str: "a string"}[kind]
    raise ValueError(f"kv_transfer_config: {connector}'s kv_connector_extra_config {key} must be {what}, not {value!r}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def format_size(n: int) -> str:
    """The shortest exact binary spelling of a byte count: 1073741824 -> "1GiB", 4194304 -> "4MiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# --help's argument groups: a field's group is the first that names it (an entry ending in "_" names a prefix).
_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("model", ("model", "served_model_name", "max_model_len", "dtype", "quantization", "quantization_group_size", "load_format", "seed", "device",
               "num_threads", "enforce_eager", "tensor_parallel_size", "pipeline_", "group_", "generation_config", "chat_template", "tokenizer", "revision")),
    ("cache", ("block_size", "enable_prefix_caching", "kv_cache_memory", "kv_cache_dtype", "gpu_memory_utilization",
               "kv_offload_", "kv_host_offload_size")),
    ("KV transfer (prefill/decode)", ("kv_role", "kv_transfer_")),
    ("scheduling", ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "enable_chunked_prefill", "async_scheduling",
                    "structured_outputs_")),
    ("speculative decoding", ("speculative_", "num_speculative_tokens", "prompt_lookup_")),
    ("LoRA", ("enable_lora", "lora_", "max_loras", "max_cpu_loras", "max_lora_rank", "allow_runtime_lora")),
    ("TLS", ("ssl_", "tls_", "enable_ssl_refresh")),
    ("tools and reasoning", ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")),
]


def _group_of(name: str, model: type[BaseModel]) -> str:
    for title, names in _GROUPS:
        if any(name == n or (n.endswith("_") and name.startswith(n)) for n in names):
            return title
    return "server" if model.__name__ == "ServerConfig" else "engine"


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _choices(annotation: Any) -> list[str] | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in args]
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return [str(a) for a in typing.get_args(args[0])]
    return None


def _help(description: str | None, default: Any, name: str) -> str:
    text = (description or "").replace("%", "%%")
    if "(default:" in text:  # the description names its default itself
        return text
    if default is None:
        shown = "unset"
    elif name in SIZE_FLAG_FIELDS:
        shown = format_size(default)
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = str(default)
    return f"{text} (default: {shown})"


# Fields given in bytes, shown as sizes in --help (e.g. "default: 1GiB").
SIZE_FLAG_FIELDS = ("kv_cache_memory", "kv_offload_size", "kv_host_offload_size", "max_request_body_bytes", "max_buffered_request_bytes",
                    "kv_cache_memory_bytes", "responses_store_max_bytes")
# Fields whose flag also works bare, as vLLM's switch of the same name: `--async-scheduling` = on, `--no-async-scheduling` = off.
BARE_SWITCHES = {"async_scheduling": ("on", "off")}
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "quantization": "-q"}  # vLLM's short spellings


def bare_switches(argv: list[str]) -> list[str]:
    """argv with a bare switch of BARE_SWITCHES followed by something other than its values written `--flag=on`, so that
    `--async-scheduling MODEL` does not take MODEL for its value."""
    values = {_flag(name): EngineConfig.model_fields[name].annotation for name in BARE_SWITCHES}
    out = list(argv)
    for i, arg in enumerate(argv):
        if arg in values and (i + 1 == len(argv) or argv[i + 1] not in typing.get_args(values[arg])):
            out[i] = f"{arg}={BARE_SWITCHES[arg[2:].replace('-', '_')][0]}"
    return out


def add_model_args(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per field of `model` (in --help's argument groups), plus vLLM's spellings (VLLM_ALIASES); unset flags parse
    as None so the model's defaults apply."""
    for name, field in model.model_fields.items():
        default = field.default
        group = _group(parser, _group_of(name, model))
        help_text = _help(field.description, default, name)
        choices = _choices(field.annotation)
        if name == "dtype":
            choices = [*choices, *DTYPE_SPELLINGS]
        if isinstance(default, bool):
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            if name.startswith("enable_"):  # vLLM's other spelling of --no-enable-X
                group.add_argument("--disable-" + name[len("enable_"):].replace("_", "-"), dest=name, action="store_const", const=False,
                                   default=None, help="= --no-" + name.replace("_", "-"))
        elif typing.get_origin(field.annotation) is types.UnionType and {list[str], list[int]} & set(typing.get_args(field.annotation)):
            group.add_argument(_flag(name), dest=name, nargs="+", default=None, help=help_text)
        elif name in BARE_SWITCHES:
            on, off = BARE_SWITCHES[name]
            group.add_argument(_flag(name), dest=name, nargs="?", const=on, choices=choices, default=None,
                               help=f"{help_text}; bare {_flag(name)} = {on} (vLLM's switch)")
            group.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_const", const=off, default=None,
                               help=f"= {_flag(name)} {off}")
        else:
            group.add_argument(*[f for f in (SHORT_FLAGS.get(name),) if f], _flag(name), dest=name, default=None, choices=choices,
                               help=help_text)
    for name, alias in VLLM_ALIASES.items():
        if alias.model != model.__name__:
            continue
        group = _group(parser, _group_of(alias.group_of, model))
        if alias.switch:
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=f"vLLM's: {alias.help}")
        else:
            group.add_argument(_flag(name), dest=name, default=None, metavar=alias.metavar, help=f"vLLM's: {alias.help}")


def model_to_args(config: BaseModel, include_defaults: bool = False) -> list[str]:
    args: list[str] = []
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if value is None or (not include_defaults and value == field.default):
            continue
        if isinstance(value, bool):
            args.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            args += [_flag(name), *map(str, value)]
        else:
            args += [_flag(name), str(value)]
    return args


# vLLM's flags that are no field of kvpilot's: each is translated into the fields it means (or refused with the reason)
# when the flags are parsed, so `--kv-cache-memory-bytes 1073741824` makes the same EngineConfig as `--kv-cache-memory 1GiB`.
class _Alias(typing.NamedTuple):
    model: str                                     # the config whose flags it is among: EngineConfig or ServerConfig
    help: str
    maps_to: str                                   # kvpilot's spelling, for docs/coming-from-vllm.md ("": none, its help says)
    translate: typing.Callable[[Any, dict[str, Any]], dict[str, Any]]  # (its value, all given values) -> fields it sets
    group_of: str                                  # the field whose --help group it is shown in
    switch: bool = False
    metavar: str | None = None
    refines: bool = False                          # it sets its field from the field's own value (--revision: MODEL@REVISION)


_SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft", "eagle3": "eagle3"}
_SPECULATIVE_KEYS = {"method": "speculative_method", "model": "speculative_model", "num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
                     "disable_by_batch_size": "speculative_disable_batch_size",
                     "draft_tensor_parallel_size": "speculative_draft_tensor_parallel_size"}


_SPECULATIVE_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size", "draft_tensor_parallel_size")
_VLLM_NGRAM_LOOKUP = 5  # vLLM's prompt_lookup_min and _max for ngram when the JSON sets neither (vllm/config/speculative.py)


def _speculative_method(config: dict[str, Any]) -> str:
    """The method vLLM's SpeculativeConfig runs: "method" when given, else inferred from "model" as vLLM does (ngram / [ngram]:
    ngram; otherwise a draft model), and a draft model whose name says EAGLE is run as EAGLE (vLLM: "eagle-" in the name
    = eagle, "eagle3" = eagle3, "dflash" = dflash)."""
    method, model = config.get("method"), config.get("model")
    if method is None:
        if model is None:
            raise ValueError("--speculative-config: needs \"method\" (or \"model\": a draft model)")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method == "draft_model" and model is not None:
        name = model.lower()
        method = "eagle" if "eagle-" in name else "eagle3" if "eagle3" in name else "dflash" if "dflash" in name else method
    return method


def speculative_settings(value: str | dict, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine fields vLLM's --speculative-config JSON sets, meaning what vLLM makes of it: {"method": "ngram" |
    "draft_model" | "eagle3", "model": ..., "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": n,
    "disable_by_batch_size": n, "draft_tensor_parallel_size": n}. Without "method" it is inferred from "model" as vLLM does; for ngram, one of
    prompt_lookup_min/_max given sets the other too, and neither given is vLLM's 5 and 5 (unless kvpilot's own
    --prompt-lookup-min/-max flags are given)."""
    given = given or {}
    try:
        config = json.loads(value) if isinstance(value, str) else value
    except ValueError as e:
        raise ValueError(f"--speculative-config: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config: must be a JSON object")
    config = dict(config)
    unknown = sorted(str(k) for k in set(config) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported (known keys: {', '.join(_SPECULATIVE_KEYS)})")
    for key in ("method", "model"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ValueError(f"--speculative-config: {key} must be a string, not {json.dumps(config[key])}")
    for key in _SPECULATIVE_INT_KEYS:
        if config.get(key) is not None and (isinstance(config[key], bool) or not isinstance(config[key], int)):
            raise ValueError(f"--speculative-config: {key} must be an integer, not {json.dumps(config[key])}")
    config = {k: v for k, v in config.items() if v is not None}
    method = _speculative_method(config)
    if method not in _SPECULATIVE_METHODS:
        inferred = "" if method == config.get("method") else f" (vLLM's method for model {config.get('model')!r})"
        raise ValueError(f"--speculative-config: method {method!r}{inferred} not supported ({', '.join(_SPECULATIVE_METHODS)} are)")
    settings = {field: config[key] for key, field in _SPECULATIVE_KEYS.items() if key in config and key != "method"}
    settings["speculative_method"] = _SPECULATIVE_METHODS[method]
    if method == "ngram":
        if config.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling of the method
            del settings["speculative_model"]
        low, high = (config.get(field, given.get(field)) for field in ("prompt_lookup_min", "prompt_lookup_max"))
        low, high = (low, high) if low is not None or high is not None else (_VLLM_NGRAM_LOOKUP, _VLLM_NGRAM_LOOKUP)
        for field, mirrored in (("prompt_lookup_min", high if low is None else low), ("prompt_lookup_max", low if high is None else high)):
            if field not in config and given.get(field) is None:
                settings[field] = mirrored
    return settings


def _kv_cache_memory_bytes(value: str, given: dict[str, Any]) -> dict[str, Any]:
    return {"kv_cache_memory": vllm_human_int(value, "--kv-cache-memory-bytes")}


def _gib(value: str | float) -> int:
    try:
        gib = float(value)
    except (ValueError, TypeError):
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:  # inf would overflow int(), nan is no size
        raise ValueError(f"--kv-offloading-size: must be a finite positive number of GiB, not {value!r}")
    return int(gib * 2**30)


def _offloading_backend(value: str, given: dict[str, Any]) -> dict[str, Any]:
    if value != "native":
        raise ValueError(f"--kv-offloading-backend: {value!r} not supported (native is: kvpilot's host tier)")
    if given.get("kv_offloading_size") is None:
        raise ValueError("--kv-offloading-backend: needs --kv-offloading-size")
    return {}


def _spec_method(value: str) -> str:
    if value not in _SPECULATIVE_METHODS:
        raise ValueError(f"--spec-method: {value!r} not supported ({', '.join(_SPECULATIVE_METHODS)} are)")
    return _SPECULATIVE_METHODS[value]


def vllm_human_int(value: str | int, flag: str | None = None) -> int:
    """vLLM's human_readable_int: 1k = 1000, 1K = 1024 (m/M, g/G alike; no decimals with the binary ones), else an integer."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", value.strip())
    try:
        if m and m.group(2).islower():
            return int(float(m.group(1)) * {"k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])
        if m:
            return int(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]
        return int(value)
    except (ValueError, TypeError):
        raise ValueError(f"{flag + ': ' if flag else ''}not a number: {value!r} (e.g. 1073741824, 1G = 2**30 or 1g = 10**9)") from None


def _same_model(value: str, given: dict[str, Any]) -> dict[str, Any]:
    import os

    model = str(given.get("model") or EngineConfig.model_fields["model"].default)
    if value == model or os.path.realpath(os.path.expanduser(value)) == os.path.realpath(os.path.expanduser(model)):
        return {}
    raise ValueError(f"--tokenizer: not supported: kvpilot uses the model's own tokenizer ({model}), not {value}")


def _revision(value: str, given: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --revision: the revision of a hub repository id (= MODEL@REVISION); anything else has none."""
    from kvpilot.server.fetch import parse_hub_model
    from kvpilot.server.model_files import is_hub_model

    model = str(given.get("model") or "")
    hub = parse_hub_model(model) if is_hub_model(model) else None
    if hub is None:
        raise ValueError(f"--revision: only for a Hugging Face Hub repository id (ORG/REPO); the model {model or '(bundled)'} is not one")
    if hub.revision is not None and hub.revision != value:
        raise ValueError(f"--revision {value}: the model names revision {hub.revision} already")
    return {"model": model if hub.revision is not None else f"{model}@{value}"}


def _auto_tool_choice(value: bool, given: dict[str, Any]) -> dict[str, Any]:
    if not value:  # kvpilot has no switch that turns tool_choice auto off: refused rather than accepted and ignored
        raise ValueError("--no-enable-auto-tool-choice: not supported (kvpilot always answers tool_choice auto: with "
                         "--tool-call-parser's format, or without it the chat template's)")
    if not given.get("tool_call_parser"):
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser (as in vLLM)")
    return {}


VLLM_ALIASES: dict[str, _Alias] = {
    "kv_cache_memory_bytes": _Alias("EngineConfig", "bytes of KV cache, as vLLM reads them (1k = 1000, 1K = 1024; = --kv-cache-memory); on a GPU, the KV cache's size "
                                    "(instead of --gpu-memory-utilization's share)",
                                    "--kv-cache-memory", _kv_cache_memory_bytes, "kv_cache_memory", metavar="BYTES"),
    "speculative_config": _Alias(
        "EngineConfig", "speculative decoding as JSON: {\"method\": \"ngram\" | \"draft_model\" | \"eagle3\", \"model\": ..., "
        "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": n, \"disable_by_batch_size\": n} "
        "(= --speculative-method (draft_model: draft), --speculative-model, --num-speculative-tokens, --prompt-lookup-max, "
        "--prompt-lookup-min, --speculative-disable-batch-size); other keys are refused. As in vLLM: no method = inferred from "
        "model; ngram with one of prompt_lookup_min/_max sets both, with neither 5 and 5",
        "--speculative-method, --speculative-model, --num-speculative-tokens, --prompt-lookup-max, --prompt-lookup-min, "
        "--speculative-disable-batch-size", speculative_settings, "speculative_method", metavar="JSON"),
    "spec_method": _Alias("EngineConfig", "= --speculative-method (draft_model: draft)", "--speculative-method",
                          lambda v, _: {"speculative_method": _spec_method(v)}, "speculative_method", metavar="METHOD"),
    "spec_model": _Alias("EngineConfig", "= --speculative-model", "--speculative-model", lambda v, _: {"speculative_model": v},
                         "speculative_method", metavar="MODEL"),
    "spec_tokens": _Alias("EngineConfig", "= --num-speculative-tokens", "--num-speculative-tokens",
                          lambda v, _: {"num_speculative_tokens": v}, "speculative_method", metavar="K"),
    "device_memory_utilization": _Alias("EngineConfig", "= --gpu-memory-utilization", "--gpu-memory-utilization",
                                        lambda v, _: {"gpu_memory_utilization": v}, "gpu_memory_utilization", metavar="FRACTION"),
    "kv_offloading_size": _Alias("EngineConfig", "GiB of host memory for offloaded KV blocks (= --kv-host-offload-size in bytes)",
                                 "--kv-host-offload-size", lambda v, _: {"kv_host_offload_size": _gib(v)}, "kv_host_offload_size",
                                 metavar="GIB"),
    "kv_offloading_backend": _Alias("EngineConfig", "native only (kvpilot's host tier); needs --kv-offloading-size", "--kv-host-offload-size",
                                    _offloading_backend, "kv_host_offload_size", metavar="native"),
    "tokenizer": _Alias("EngineConfig", "only the model's own tokenizer: accepted when it names the model itself, any other "
                        "tokenizer is an error", "", _same_model, "model"),
    "revision": _Alias("EngineConfig", "the revision (branch, tag or commit) of a hub repository id: = MODEL@REVISION",
                       "MODEL@REVISION", _revision, "model", metavar="REVISION", refines=True),
    "enable_auto_tool_choice": _Alias(
        "ServerConfig", "requires --tool-call-parser (as in vLLM) and changes nothing else: kvpilot answers tool_choice auto "
        "with the parser set (and without either flag, with the chat template's format); --no-enable-auto-tool-choice is an error",
        "", _auto_tool_choice, "tool_call_parser", switch=True),
}


def _same_value(field: str, a: Any, b: Any) -> bool:
    if field in SIZE_FLAG_FIELDS:
        return parse_size(a) == parse_size(b)
    return str(a) == str(b)


def resolve_aliases(values: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """`values` (flag dests -> values) with the vLLM aliases of `model` translated into its fields; an alias that
    disagrees with the field's own flag, or that kvpilot cannot honour, is a ValueError naming the flag."""
    out = dict(values)
    for name, alias in VLLM_ALIASES.items():
        if alias.model != model.__name__ or out.get(name) is None:
            continue
        for field, value in alias.translate(out.pop(name), values).items():
            if not alias.refines and values.get(field) is not None and not _same_value(field, values[field], value):
                raise ValueError(f"{_flag(name)} sets {_flag(field)} {value}, and {_flag(field)} {values[field]} was given too")
            out[field] = value
    return out


_PYDANTIC_MESSAGES = {
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}", "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}", "literal_error": "must be one of {expected}", "int_parsing": "must be an integer",
    "int_from_float": "must be an integer", "float_parsing": "must be a number", "bool_parsing": "must be true or false",
    "extra_forbidden": "unknown flag", "string_too_short": "must not be empty", "string_too_long": "is too long",
}


def flag_error(error: Exception) -> str:
    """A pydantic ValidationError of EngineConfig or ServerConfig as the command line's terms: `--max-num-seqs: must be >= 1`
    (field names in a refusal's text are written as flags too); any other error's text as is."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    fields = {*EngineConfig.model_fields, *ServerConfig.model_fields}

    def flags(text: str) -> str:
        # an identifier on its own: not part of a file name or path (generation_config.json, /x/chat_template) or a longer word
        return re.sub(r"(?<![\w./\\-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/\\-]|\.\w)", lambda m: _flag(m.group(0)) if m.group(0) in fields else m.group(0), text)

    parts = []
    for e in error.errors():
        template = _PYDANTIC_MESSAGES.get(e["type"])
        text = template.format(**e.get("ctx", {})) if template else str((e.get("ctx") or {}).get("error", e["msg"]))
        loc = [str(p) for p in e["loc"]]
        parts.append(f"{_flag(loc[0])}: {flags(text)}" if loc else flags(text))
    return "; ".join(parts)


def config_file_args(path: str, switches: typing.Container[str] = ()) -> list[str]:
    """vLLM's --config FILE.yaml: a mapping of flag names (dashes or underscores) to values, as flags (command-line flags,
    given after these, override them). true = the bare switch, false = its --no- form; a list = the values in turn;
    a mapping = its JSON (--speculative-config, --kv-transfer-config). For the flags in `switches` (those that take no
    value) the strings "true" and "false" are true and false too, and any other value is an error; a nested `config` key
    is an error."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config: cannot read {path} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path} is not YAML ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must be a mapping of flag names to values")
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config: {path} sets config (a config file naming another is not supported)")
        if flag in switches and not isinstance(value, bool) and value is not None:
            if not isinstance(value, str) or value.strip().lower() not in ("true", "false"):
                raise ValueError(f"--config: {path}: {key} is a switch: true or false, not {value!r}")
            value = value.strip().lower() == "true"
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


class ServerConfig(BaseModel):
    """HTTP-server settings of `kvpilot serve` (engine settings stay in EngineConfig)."""

    model_config = ConfigDict(extra="forbid")

    @property
    def bind_host(self) -> str:
        import os

        return self.host or ("0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1")

    host: str | None = Field(None, description=(
        "Address to bind (unset: 127.0.0.1; in a Kubernetes pod, where KUBERNETES_SERVICE_HOST is set, 0.0.0.0, every interface, "
        "as vLLM binds by default: a pod template written for vllm serve passes no --host, and the kubelet's probes come to the pod's IP)."))
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 = any free port).")
    api_key: str | None = Field(None, description="Require `Authorization: Bearer <key>` (or env KVPILOT_API_KEY).")
    max_waiting_requests: int = Field(256, ge=1, description="Requests allowed to wait; beyond it, 429 with Retry-After.")
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    enable_log_requests: bool = Field(True, description=(
        "A log line per request (its id, endpoint, status, token counts and timings; never the prompt). vLLM's --disable-log-requests "
        "turns it off."))
    max_request_body_bytes: int = Field(4 << 20, ge=1024, description="Largest request body (e.g. 4MiB); larger ones get 413.")
    request_header_timeout_seconds: float = Field(10.0, gt=0, description="A connection that has not sent a whole request line and headers in this time is closed.")
    request_body_timeout_seconds: float = Field(30.0, gt=0, description="A request body not received in full in this time gets 408.")
    max_buffered_request_bytes: int = Field(64 << 20, ge=1024, description=(
        "Most bytes of request bodies held at once over all connections while they arrive (e.g. 64MiB); a body that would "
        "go past it gets 429 with Retry-After. Bodies of requests without the API key are never read."))
    tokenizer_workers: int = Field(2, ge=1, le=64, description=(
        "Threads that tokenize prompts, apply chat templates and serve /tokenize and /detokenize (off the event loop)."))
    max_pending_tokenizations: int = Field(64, ge=0, description=(
        "Tokenization tasks that may wait for a tokenizer thread; beyond it, 429 with Retry-After."))
    reject_unknown_fields: bool = Field(False, description=(
        "Refuse (400) request fields this server does not know, at a request's top level, in its messages and stream_options; "
        "by default they are ignored, as vLLM does, and named in the x-kvpilot-ignored-fields response header and a log line. "
        "Unknown fields inside constraints and tools are always refused."))
    enable_tokenizer_info_endpoint: bool = Field(False, description=(
        "Serve GET /tokenizer_info (vLLM's: the special tokens, chat template and length limit, which lm-evaluation-harness's "
        "remote tokenizer reads); off by default, as in vLLM, since it shows the chat template."))
    max_compiles_per_client: int = Field(1, ge=1, description=(
        "Structured-output constraints one client (by address) may have compiling at once (on the compile threads, not the "
        "tokenizer pool); beyond it, 429 with Retry-After. A constraint already compiled is a cache hit and does not count."))
    max_pending_compiles: int = Field(16, ge=1, description="Constraints compiling or waiting to, over all clients; beyond it, 429.")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(None, description=(
        "The format of tool calls: hermes (<tool_call> blocks: Qwen2/3) or llama3_json (Llama 3.x JSON calls); unset: the one the "
        "chat template writes (a template with <|python_tag|> or \"parameters\" calls: llama3_json; otherwise hermes)."))
    allow_runtime_lora: bool = Field(False, description=(
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key when one is set); adapters load only from "
        "under --lora-dir. Needs the engine's --enable-lora."))
    lora_dir: str | None = Field(None, description="The directory run-time loaded adapters must be in (no path or symlink leads out of it).")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(None, description=(
        "Return <think>...</think> as reasoning_content: qwen3 (the block opens the output) or deepseek_r1 (the template opens "
        "it: everything before </think> is reasoning); unset: reasoning stays in content."))
    chat_template: str | None = Field(None, description=(
        "The chat template instead of the model's own: a file (Jinja) or the template itself (vLLM's; unset: the model's)."))
    generation_config: str = Field("auto", description=(
        "Request defaults from a generation_config.json, as vLLM: auto = the model's (beside the checkpoint's config.json or the "
        "GGUF file), DIR = DIR/generation_config.json, vllm = none. Its temperature, top_p, top_k, min_p, repetition_penalty and "
        "max_new_tokens (as max_tokens) apply to requests that do not set them."))

    engine_core_process: bool = Field(False, description=(
        "Run the scheduler and the model runner in a process of their own (the engine core), behind a local socket; this process "
        "keeps HTTP, tokenization, chat templates, detokenizing and stop strings, so their Python never holds the step loop's GIL "
        "(vLLM V1's and SGLang's split). Off by default until measured to pay (docs/engine.md#the-engine-core-in-its-own-process)."))
    responses_store_max_responses: int = Field(1000, ge=0, description=(
        "Responses API (/v1/responses): the most stored responses kept (store true, the default) for previous_response_id and "
        "GET /v1/responses/{id}; beyond it the oldest go. 0 = none kept."))
    responses_store_max_bytes: int = Field(64 << 20, ge=0, description=(
        "The most bytes the stored responses take (their conversations and outputs as JSON, e.g. 64MiB); beyond it the oldest go."))
    responses_store_ttl_seconds: float = Field(3600.0, gt=0, description="How long a stored response is kept.")
    engine_stall_timeout_seconds: float = Field(60.0, gt=0, le=3600, description=(
        "With requests open, an engine loop that shows no progress for this long (a hung step, a stopped engine core) turns /health "
        "and /ready to 503 (code engine_stalled), so the liveness probe restarts the pod; an idle engine is never stalled."))

    # TLS, as vLLM's flags (KServe's LLMInferenceService template serves HTTPS with them); read at start, before the model loads.
    ssl_keyfile: str | None = Field(None, description="Serve HTTPS: the PEM private key of --ssl-certfile's certificate (unset: the key is in that file).")
    ssl_certfile: str | None = Field(None, description="Serve HTTPS with this PEM certificate (chain); unset: plain HTTP.")
    ssl_ca_certs: str | None = Field(None, description="PEM CA certificates that client certificates are verified against (with --ssl-cert-reqs 1 or 2).")
    ssl_cert_reqs: int = Field(0, ge=0, le=2, description=(
        "Client certificates, as Python's ssl.VerifyMode: 0 = not asked for (CERT_NONE), 1 = verified if sent (CERT_OPTIONAL), "
        "2 = required (CERT_REQUIRED)."))
    enable_ssl_refresh: bool = Field(False, description=(
        "Reload the certificate, key and CA certificates when their files change (checked every second; a rotated Kubernetes "
        "Secret included) without a restart: new connections get the new certificate, open ones keep theirs. A pair that does "
        "not load (a half-written rotation) is logged and the old one kept until the files change again."))

    @field_validator("max_request_body_bytes", "max_buffered_request_bytes", "responses_store_max_bytes", mode="before")
    @classmethod
    def _body_size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, v: str) -> str:
        import os

        if v not in ("auto", "vllm") and not os.path.isdir(os.path.expanduser(v)):
            raise ValueError(f"must be auto, vllm or a directory (with generation_config.json), not {v!r}")
        return v

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v is not None:
            load_chat_template(v)
        return v

    @model_validator(mode="after")
    def _runtime_lora(self) -> ServerConfig:
        if self.allow_runtime_lora and not self.lora_dir:
            raise ValueError("allow_runtime_lora needs lora_dir (the only directory adapters are loaded from at run time)")
        if self.lora_dir and not self.allow_runtime_lora:
            raise ValueError("lora_dir is only used with allow_runtime_lora")
        return self

    @model_validator(mode="after")
    def _one_body_fits(self) -> ServerConfig:
        if self.max_buffered_request_bytes < self.max_request_body_bytes:
            raise ValueError("max_buffered_request_bytes must be >= max_request_body_bytes (one largest body must fit)")
        return self

    @model_validator(mode="after")
    def _tls_consistent(self) -> ServerConfig:
        needs_cert = [f for f in ("ssl_keyfile", "ssl_ca_certs") if getattr(self, f) is not None]
        needs_cert += [f for f in ("ssl_cert_reqs", "enable_ssl_refresh") if getattr(self, f)]
        if needs_cert and self.ssl_certfile is None:
            raise ValueError(f"{', '.join(needs_cert)}: only with ssl_certfile (HTTPS is served only with a certificate)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError(f"ssl_cert_reqs={self.ssl_cert_reqs} needs ssl_ca_certs (the CAs client certificates are verified against)")
        return self


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a Jinja template (vLLM's rule: a value with none
    of {{ {% {# that names no file is a mistake)."""
    import os

    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise ValueError(f"not a file and not a Jinja template: {value!r}")


GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(setting: str, model_path: str | None) -> dict[str, Any]:
    """--generation-config: the request defaults (request field -> value) of a generation_config.json, as vLLM takes them:
    auto = the one beside the model (a checkpoint directory's, or in a GGUF file's directory), DIR = DIR's, vllm = none.
    A missing file is no defaults."""
    import os

    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_path is None:
            return {}
        directory = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    else:
        directory = os.path.expanduser(setting)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ValueError(f"--generation-config: {path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    defaults = {field: config[key] for key, field in GENERATION_DEFAULT_KEYS.items() if config.get(key) is not None}
    for field, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"--generation-config: {path}: {field} must be a finite number, got {value!r}")
    return defaults
