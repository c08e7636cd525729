"""One worker per rank: its model, that model's KV cache and decode graphs, its persistent batch, and
the step: Step message -> StepBatch -> ModelInput -> launch -> LaunchedStep -> ModelOutput.

Every rank's worker builds its tensors from the Step message alone (engine/step_message.py); rank 0's
also samples, and holds the drafter of draft-model / EAGLE-3 speculation (engine/drafters.py: the
proposer owns its model and cache; the worker runs it around the target's forward). Rank 0 is a
worker like the others plus the engine, which sends each message to ranks 1…N−1 (engine/parallel.py)
before its own worker runs it.
"""

from __future__ import annotations

import ctypes
import logging
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.kernels import cpu_extension
from kvpilot.kernels.linear import default_layout
from kvpilot.kernels.ops import triton_kernels
from kvpilot.kernels.paged_attention import FP8_KV, AttentionMetadata, kv_cache_zeros
from kvpilot.server.config import FP8_KV_NAMES, EngineConfig
from kvpilot.server.engine import kv_scales
from kvpilot.server.engine.decode_graphs import DecodeGraphs
from kvpilot.server.engine.lora import read_adapter
from kvpilot.server.engine.model_io import InputBuilder, ModelInput, ModelOutput, PromptLogprobRows, Proposal, StepPlan
from kvpilot.server.engine.sampler import PendingSample, Sampler
from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN
from kvpilot.server.engine.step_message import Describe, DescribePeers, KVWork, SetAdapter, Step, StepBatch, Stop, WorkerBatch
from kvpilot.server.kv_layout import KVLayout, why_no_window_pool, window_pool_split
from kvpilot.server.models.decoder import DecoderModel, WeightSource
from kvpilot.server.models.sharding import PipelineStage, TensorParallel

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvpilot.server.engine.drafters import Drafter
    from kvpilot.server.engine.parallel import Channel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOAD_CHUNK = 64  # KV-tier blocks written into the cache per gather (its staging buffer: 64 blocks, 47 MB for the bundled model in float32)


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: its sampled tokens there at once, its ModelOutput when waited for."""

    sample: PendingSample | None      # None: nothing sampled (a prefill chunk)
    prompt_logprobs: list[list[dict[int, float]]]
    # With an EAGLE-3 head: its (normed, prenorm) output, on the device, at each sampled sequence's row
    # that drafts its next proposal (the row before its last new token).
    head_state: tuple[torch.Tensor, torch.Tensor] | None = None
    plan: StepPlan | None = None      # which sequence each sampled and prompt-logprob row is
    # Rank 0 under pipeline parallelism: the logits are still coming from the last stage; this waits for
    # them and gives (sample, prompt_logprobs).
    incoming: Callable[[], tuple[PendingSample | None, list[list[dict[int, float]]]]] | None = None

    def _arrived(self) -> None:
        if self.incoming is not None:
            self.sample, self.prompt_logprobs = self.incoming()
            self.incoming = None

    @property
    def tokens(self) -> torch.Tensor | None:
        """[sampled sequences] long, on the device: each one's last new token."""
        self._arrived()
        return self.sample.next_tokens if self.sample is not None else None

    @property
    def accepted_counts(self) -> torch.Tensor | None:
        """[sampled sequences] long, on the device: proposed tokens accepted (None: no proposals)."""
        self._arrived()
        return self.sample.accepted_counts if self.sample is not None else None

    def output(self) -> ModelOutput:
        """Wait for the step; its outputs on the host."""
        self._arrived()
        if self.sample is None:
            return ModelOutput([], [], prompt_logprobs=self.prompt_logprobs)
        result = self.sample.result()
        return ModelOutput(result.token_ids, result.logprobs, result.errors, self.prompt_logprobs)


@dataclass(slots=True)
class StageTime:
    """Pipeline stages: the steps this rank ran its part of, and the seconds it computed (receiving and
    handing on excluded): over a run's wall time, 1 - seconds / wall is the stage's idle share."""

    steps: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds


@dataclass(slots=True)
class HostCopy:
    """A block's K/V being copied off a GPU into pinned memory (block_bytes): its bytes once done."""

    host: torch.Tensor                # uint8, pinned
    done: torch.cuda.Event

    def result(self) -> bytes:
        self.done.synchronize()
        return self.host.numpy().tobytes()


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """rank: the process's global rank (its GPU)."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda was asked for but no CUDA device is available")
        return torch.device("cuda", rank % torch.cuda.device_count())  # ranks share GPUs only when there are too few
    return torch.device("cpu")


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def slow_half_projections(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a half compute dtype runs its projections slowly on this CPU, or None: one without AVX-512, where neither
    kvpilot's bfloat16 kernel nor oneDNN's packing takes it and torch's generic half matmul runs about 5x below its
    float32 rate (an AMD EPYC VM with AVX2 only, a 576 x 1536 projection at 16 rows on one thread: bfloat16 9 and
    float16 10 GFLOP/s against float32's 52)."""
    if device.type != "cpu" or dtype == torch.float32 or "avx512f" in cpu_extension._cpu_flags() or default_layout(torch.empty(0, 2, dtype=dtype)) != "dense":
        return None
    return (f"dtype={str(dtype).removeprefix('torch.')} on a CPU without AVX-512: neither kvpilot's bfloat16 kernel nor oneDNN's packed "
            "matmul takes it, so the projections run on torch's generic half path, about 5x slower than float32 here; "
            "--dtype float32 (the CPU default) is faster, and --kv-cache-dtype bfloat16 still halves the KV cache")


def resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the compute dtype, a narrower bfloat16 cache under float32, or FP8
    (float8_e4m3fn with per-layer scales: kv_scales.py) under any compute dtype; the kernels widen a
    narrower cache in registers (the combinations EngineConfig refuses aside)."""
    if config.kv_cache_dtype == "auto":
        return dtype
    if config.kv_cache_dtype in FP8_KV_NAMES:
        return FP8_KV
    return _DTYPES[config.kv_cache_dtype]


def resolve_quantization(requested: str, weights: WeightSource) -> str:
    """The weight format the model is loaded in: auto = a GPTQ / AWQ checkpoint's own method, else none;
    gptq / awq only for a checkpoint of that method. Any other value on such a checkpoint starts from its
    dequantized weights (none: the compute dtype; int8 / int4: quantized again)."""
    scheme = getattr(weights, "quantization", None)
    if requested == "auto":
        return scheme.method if scheme is not None else "none"
    if requested in ("gptq", "awq", "compressed-tensors", "fp8") and (scheme is None or scheme.method != requested):
        raise ValueError(f"quantization={requested} needs a {requested} checkpoint; {weights.path.name} is "
                         f"{'a ' + scheme.method + ' checkpoint' if scheme else 'not one'} (quantization=auto takes what it is)")
    return requested


def kv_block_bytes(model: DecoderModel, block_size: int, kv_dtype: torch.dtype) -> int:
    """One KV block of a model's cache (every layer's K and V; a pipeline stage's: its layers')."""
    c = model.config
    return 2 * len(model.layers) * block_size * model.num_kv_heads * c.head_dim * torch.tensor([], dtype=kv_dtype).element_size()


def projection_bytes(model: DecoderModel) -> int:
    """The bytes of a model's projection weights on this rank."""
    # Projections keep their weights as buffers (dense or oneDNN "weight"; GGUF blocks "qs", "d", "m"; a mixture of
    # experts' "w13", "w2" or each projection's panels "gate_qs", "up_d"...); norms and the embedding are parameters.
    def projection(name: str) -> bool:
        last = name.rsplit(".", 1)[-1]
        return last in ("weight", "qs", "d", "m", "w13", "w2") or last.rsplit("_", 1)[-1] in ("qs", "d", "m") and "_" in last

    return sum(b.numel() * b.element_size() for name, b in model.named_buffers() if projection(name))


def _return_freed_heap() -> None:
    """Give the heap that loading freed back to the OS. Loading makes a transient copy per tensor
    (dequantized, converted, packed); glibc keeps such freed blocks for reuse, ~200 MB of resident
    memory for SmolLM2 that the model never uses again (bench/load.py measures it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class Worker:
    """One rank's worker. With tensor parallelism every rank has one, holding its shard and the KV
    cache of its heads (kv_cache_memory is per rank: every rank gets the same number of blocks, the
    fewest any rank has room for); all run the same collective part of a step (`_forward`), rank 0's
    alone samples (`samples`). With pipeline parallelism (`stage`) a rank holds its stage's layers and
    their cache: its part of a step takes the hidden states of the stage before and hands its own to
    the next; the last stage's first rank sends rank 0 the logits it samples from.

    A drafter (draft model, EAGLE-3 head) keeps its KV cache beside the target's: the same block ids
    index both (the block manager needs no second account), carved from the same memory budget (a
    block costs the target's bytes plus the drafter's)."""

    def __init__(self, config: EngineConfig, weights: WeightSource, show_progress: bool = True, tp: TensorParallel | None = None,
                 kv_calibration_ids: list[int] | None = None, eos_token_ids: tuple[int, ...] = (),
                 drafter: Callable[[Worker], Drafter] | None = None, stage: PipelineStage | None = None):
        """drafter(worker): makes the proposer that drafts on this worker (it loads its own model), once
        the target is loaded and before the caches are sized."""
        self.config = config
        self.tp = tp
        self.stage = stage
        self.rank = stage.rank if stage else tp.rank if tp else 0  # global
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.samples = self.rank == 0
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: block_bytes' copies off the device
        self._load_staging: torch.Tensor | None = None      # write_blocks' gathering buffer (LOAD_CHUNK blocks)
        self._copies_queued = False
        self._sending: list = []  # pipeline stages: the hand-on of the step before, in flight, with its tensor
        self.stage_time = StageTime()
        self.device = resolve_device(config, self.rank)
        self.dtype = resolve_dtype(config, self.device)
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)
        self.quantization = resolve_quantization(config.quantization, weights)
        if self.quantization != "none" and self.dtype != torch.float32 and not triton_kernels(self.device):
            raise ValueError(f"quantization={self.quantization} on {self.device} computes in float32 (the C++ kernels take float32 "
                             f"activations), not {self.dtype}")
        if self.rank == 0 and (why := slow_half_projections(self.device, self.dtype)):
            log.warning("%s", why)
        self.show_progress = show_progress
        self.model = self.load(weights, self.quantization, config.quantization_group_size,
                               lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None)
        self.kv_calibration_ids = kv_calibration_ids
        # An FP8 cache: the target's per-layer (k_scale, v_scale), fixed from here on (a drafter's set on its model too).
        self.kv_scales = self.set_kv_scales(self.model, weights) if self.kv_dtype == FP8_KV else None
        self.block_size = config.block_size
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.inputs = InputBuilder(config.block_size, eos_token_ids, self.device, steps_in_flight=config.pipeline_parallel_size)
        self.batch = WorkerBatch(self.device if self.samples else None)
        self.drafter = drafter(self) if drafter is not None else None
        _return_freed_heap()
        self.model.ops.check_shapes(self.model.config.head_dim, self.block_size)  # before a step fails on them
        self.bytes_per_block = kv_block_bytes(self.model, self.block_size, self.kv_dtype) + (self.drafter.block_bytes() if self.drafter else 0)
        self.why_no_window_pool = self._why_no_window_pool()  # (before the budget: decode graphs do not run with the pool)
        budget = self._kv_cache_bytes()
        # One block of the budget is the scratch block, past those the block manager hands out: the
        # padding rows of a decode graph write there (decode_graphs.py).
        self.num_blocks = self._agreed(budget // self.bytes_per_block - 1)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than two KV blocks ({self.bytes_per_block} bytes each; "
                             "one is the scratch block)")
        self.num_window_blocks = 0  # the sliding-window layers' own pool (0: none, every layer's cache has num_blocks)
        if self.why_no_window_pool:
            if self.model.config.sliding_window:
                log.info("sliding-window layers keep every block of a sequence (no pool of their own): %s", self.why_no_window_pool)
        else:
            self.num_blocks, self.num_window_blocks = self._window_pool_split(budget)
            self.model.window_pool = self.inputs.window_pool = True
        # Every layer windowed, with a pool: the block table holds no K/V (prefix keys and a sequence's order only).
        self.bookkeeping_table = bool(self.num_window_blocks) and all(layer.attn.window for layer in self.model.layers)
        self.scratch_block = self.num_blocks
        self.kv_caches = self._kv_caches(self.model)
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        c = self.model.config
        pool = f" (+ {self.num_window_blocks} for the sliding-window layers)" if self.num_window_blocks else ""
        if self.bookkeeping_table:
            pool = f" of bookkeeping ({self.num_window_blocks} for its layers, every one sliding-window)"
        log.info("model %s on %s/%s, weights %.0f MiB (quantization %s), KV cache: %d blocks%s of %d tokens (%.0f MiB, %s)", c.name, self.device,
                 self.dtype, self.model.weight_bytes() / 2**20, self.quantization, self.num_blocks, pool, self.block_size,
                 sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches) / 2**20, self.kv_dtype)

    def _why_no_window_pool(self) -> str | None:
        """Why the model's sliding-window layers share the block table (none: a pool of their own, block_manager.WindowPool)."""
        return why_no_window_pool(KVLayout.of(self.model.config), self.config)

    def _window_pool_split(self, budget: int) -> tuple[int, int]:
        """(global blocks, window blocks) of the budget (kv_layout.window_pool_split), the fewest any rank has room for."""
        per_layer = self.bytes_per_block // len(self.model.layers)
        full, window = window_pool_split(KVLayout.of(self.model.config), budget, per_layer, self.num_blocks, self.config,
                                         self.model.config.max_position)
        return self._agreed(full), self._agreed(window)

    def _agreed(self, num_blocks: int) -> int:
        """The fewest blocks any rank has room for (the block manager hands out block ids every rank holds)."""
        if self.world_size == 1:
            return num_blocks
        import torch.distributed as dist

        fewest = torch.tensor([num_blocks], device=self.device)  # (on the device: the default group may be NCCL)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        return int(fewest.item())

    def load(self, weights: WeightSource, quantization: str, group_size: int = 32, lora: tuple[int, int] | None = None,
             shard: bool = True) -> DecoderModel:
        """A model on this worker's device, in its dtype (a drafter's too); shard=False: whole on this rank
        whatever the tensor parallelism (a draft model, replicated)."""
        bar = None
        if self.show_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(weights.checkpoint_names()), desc=f"loading {weights.path.name}", unit="tensor", leave=False)
        with torch.inference_mode():
            model = DecoderModel.load(weights, weights.config, self.dtype, self.device, progress=bar.update if bar else None,
                                      tp=self.tp if shard else None, stage=self.stage if shard else None,
                                      quantization=quantization, group_size=group_size, lora=lora)
        if bar:
            bar.close()
        return model

    def set_kv_scales(self, model: DecoderModel, weights: WeightSource) -> list[tuple[float, float]]:
        """A checkpoint's own KV scales, else calibrated (kv_scales.py); set on the model's attention layers."""
        scales = weights.kv_scales() if hasattr(weights, "kv_scales") else None
        source = "the checkpoint's"
        if scales is not None and model.stage is not None:  # a pipeline stage's layers
            scales = scales[model.first_layer:model.first_layer + len(model.layers)]
        if scales is None:
            if self.stage is not None:
                raise ValueError("kv_cache_dtype=fp8 under pipeline parallelism needs a checkpoint with KV scales: calibrating them runs "
                                 "the whole model in one process")
            if not self.kv_calibration_ids:
                raise ValueError("kv_cache_dtype=fp8: no KV scales in the checkpoint and no calibration text to compute them from")
            scales = kv_scales.calibrate(model, self.kv_calibration_ids, self.config.block_size)
            source = f"calibrated on {len(self.kv_calibration_ids)} tokens"
        for layer, pair in zip(model.layers, scales, strict=True):
            layer.attn.kv_scales = pair
        log.info("FP8 KV cache scales (%s): k %.3g-%.3g, v %.3g-%.3g", source, min(k for k, _ in scales), max(k for k, _ in scales),
                 min(v for _, v in scales), max(v for _, v in scales))
        return scales

    def _kv_caches(self, model: DecoderModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A model's per-layer (K, V) cache of num_blocks blocks plus the scratch block (its sliding-window layers' in a
        pool of their own: num_window_blocks plus the pool's null block)."""
        c = model.config

        def blocks(layer) -> int:
            return (self.num_window_blocks if model.window_pool and layer.attn.window else self.num_blocks) + 1

        return [tuple(kv_cache_zeros((blocks(layer), self.block_size, model.num_kv_heads, c.head_dim), self.kv_dtype, self.device)
                      for _ in "kv") for layer in model.layers]

    def _kv_cache_bytes(self) -> int:
        """CPU: kv_cache_memory. CUDA: gpu_memory_utilization of the GPU, less what is in use (the
        weights, other processes), the activations of the largest step (profiled) and the decode
        graphs' memory pool (a decode step at max_num_seqs rows, profiled: the pool holds the largest
        graph's activations, the smaller graphs reuse them). A kv_cache_memory set explicitly is the
        budget on CUDA too (vLLM's --kv-cache-memory-bytes: the cache's size, not a share of the GPU)."""
        if self.device.type != "cuda" or "kv_cache_memory" in self.config.model_fields_set:
            return self.config.kv_cache_memory
        prefill_peak, decode_peak = self._profile_peaks()
        free, total = torch.cuda.mem_get_info()
        reserve = prefill_peak + (0 if self._why_no_graphs() else decode_peak)
        budget = int(total * self.config.gpu_memory_utilization) - (total - free) - reserve
        log.info("KV cache budget %.0f MiB: %.0f%% of %.0f MiB, less %.0f MiB in use, %.0f MiB of peak step activations, %.0f MiB for decode graphs",
                 max(budget, 0) / 2**20, 100 * self.config.gpu_memory_utilization, total / 2**20, (total - free) / 2**20,
                 prefill_peak / 2**20, reserve - prefill_peak)
        return max(0, budget)

    @torch.inference_mode()
    def _profile_peaks(self) -> tuple[int, int]:
        """Bytes allocated at the peak of a prefill of max_num_batched_tokens tokens (with logits for
        max_num_seqs rows) and of a decode step of max_num_seqs rows, above what is allocated now; each
        run once over a throwaway KV cache just big enough (K and V one tensor: only the activations
        are measured)."""
        models = [self.model, *(self.drafter.profiled_models() if self.drafter else ())]
        tokens = min(self.config.max_num_batched_tokens, self.model.config.max_position)
        rows = min(self.config.max_num_seqs, tokens)
        blocks = -(-tokens // self.block_size)
        caches = {id(m): [(torch.zeros(blocks, self.block_size, m.num_kv_heads, m.config.head_dim, dtype=self.kv_dtype, device=self.device),) * 2
                          for _ in range(m.config.num_layers)] for m in models}
        prefill = AttentionMetadata.one_prefill(tokens, self.block_size, self.device)
        table = prefill.prefill_block_tables[0]
        # Decode tables as wide as the graphs' can be (the split-K buffers grow with the width); one token of context each.
        width = -(-self.model.config.max_position // self.block_size)
        decode = AttentionMetadata(table.new_zeros(rows), [], [], [], table.new_zeros(rows, width), table.new_ones(rows))
        peaks = []
        for positions, meta in ((prefill.slot_mapping, prefill), (decode.slot_mapping, decode)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for m in models:
                handed = None if m.embed is not None else torch.zeros(positions.shape[0], m.config.hidden_size, dtype=m.dtype, device=self.device)
                out = m(torch.zeros_like(positions), positions, caches[id(m)], meta, hidden=handed)
                hidden = out[0] if isinstance(out, tuple) else out  # (a declared aux output beside it)
                if m is self.model and m.lm_head is not None:
                    self.model.compute_logits(hidden[:rows])
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        del caches
        torch.cuda.empty_cache()
        return peaks[0], peaks[1]

    def start_decode_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Run decode-only steps through DecodeGraphs (tables wide enough for max_model_len):
        captured as CUDA graphs where that can work, else left eager (logged); a drafter's proposal
        steps too. capture=False builds the static-buffer path without graphs on any device (what
        tests check on CPU)."""
        if capture and (why_not := self._why_no_graphs()):
            if self.device.type == "cuda":
                log.info("decode steps run eagerly: %s", why_not)
            return
        width = -(-max_model_len // self.block_size)
        graphs = lambda step, lora=None: DecodeGraphs(step, self.config.max_num_seqs, width, self.scratch_block, self.block_size,  # noqa: E731
                                                      self.device, capture, lora)
        if self.drafter is not None:
            self.drafter.start_graphs(graphs)
        if self.drafter is not None and self.drafter.reads_hidden_states:  # its pass reads each step's hidden states, which the graphs do not give out
            log.info("decode steps run eagerly: an EAGLE-3 head reads each step's hidden states")
            return
        self.decode_graphs = graphs(self._decode_logits, self.model.lora.context if self.model.lora else None)

    def _why_no_graphs(self) -> str | None:
        if self.config.enforce_eager:
            return "enforce_eager is set"
        if self.device.type != "cuda":
            return "the device is not CUDA"
        if self.tp is not None:
            return "tensor parallelism runs its collectives eagerly"
        if self.stage is not None:
            return "pipeline stages hand their hidden states on eagerly"
        if not self.model.ops.graph_safe:
            return f"the {self.model.ops.name} kernels are not capturable (they read device values on the host)"
        if self.why_no_window_pool is None:
            return "the sliding-window layers' pool has tables of its own, which the graphs do not hold yet"
        if self.model.config.num_experts:
            return "a mixture of experts' decode step has not been captured on a GPU yet (its Triton op reads nothing on the host)"
        return None

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step as the graphs run it: the model and every row's logits."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def recover(self) -> None:
        """After a failed step: give cached allocator blocks back so that the retry has room."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [n, vocab] of the next token after every position of one sequence, in one
        prefill through blocks 0.. of the KV cache (for quality measurements, outside serving: it
        overwrites those blocks, so never call it while the engine has requests)."""
        n = len(token_ids)
        if self.world_size > 1:
            raise ValueError("score: one process only")
        meta = self.one_prefill(n)
        ids = torch.tensor(token_ids, device=self.device)
        out = self.model(ids, torch.arange(n, device=self.device), self.kv_caches, meta)
        return self.model.compute_logits(out[0] if isinstance(out, tuple) else out).float()  # (a declared aux output beside it)

    def one_prefill(self, n: int) -> AttentionMetadata:
        """The metadata of one sequence's whole prefill of n tokens into blocks 0.. of this worker's caches (the window
        pool's too: there blocks 0.. as well), for passes outside serving (scoring, an EAGLE-3 head's training states)."""
        blocks, most = -(-n // self.block_size), min(self.num_blocks, self.num_window_blocks or self.num_blocks)
        if blocks > most:
            raise ValueError(f"{n} tokens need {blocks} KV blocks, and this cache has {most}")
        meta = AttentionMetadata.one_prefill(n, self.block_size, self.device)
        meta.window = meta if self.num_window_blocks else None
        return meta

    # --- the KV connector: one block's K/V as bytes, every region's in turn ---------------------
    def cache_regions(self) -> list[torch.Tensor]:
        """The KV cache tensors a block has a row in: the target's keys and values of every layer, then a
        drafter's (its cache shares the block ids: a block saved or handed off carries its K/V too)."""
        layers = list(self.kv_caches) + (self.drafter.cache_layers() if self.drafter is not None else [])
        return [t for k, v in layers for t in (k, v)]

    def window_regions(self) -> list[bool]:
        """For each of cache_regions(): whether its rows are the sliding-window layers' pool's (a block's row there is its
        window table's id, not its block table's)."""
        windowed = [bool(self.model.window_pool and layer.attn.window) for layer in self.model.layers]
        return [w for w in windowed for _ in "kv"] + [False] * (len(self.cache_regions()) - 2 * len(windowed))

    def block_layout(self) -> tuple[list[list], int]:
        """The layout of block_bytes(): each region's dtype and block shape, in order; and the size."""
        regions = self.cache_regions()
        layout = [[str(r.dtype), list(r.shape[1:])] for r in regions]
        return layout, sum(r[0].numel() * r.element_size() for r in regions)

    def block_bytes(self, block_id: int, window_block: int) -> bytes | HostCopy:
        """A copy of one cache block's K/V (block_layout()), off the device, taken before the block can
        be reused (window_block: its row in the sliding-window layers' pool; block_id without one). On CUDA
        it is queued on a side stream after the work queued so far (the step that computed the block may
        still run) into pinned memory: the host goes on, and the next step waits for the copy before it can
        overwrite anything (launch)."""
        rows = [(r, window_block if w else block_id) for r, w in zip(self.cache_regions(), self.window_regions())]
        if self.device.type != "cuda":
            return b"".join(r[row].view(torch.uint8).numpy().tobytes() for r, row in rows)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            stacked = torch.cat([r[row].view(torch.uint8).flatten() for r, row in rows])
            host = torch.empty(stacked.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._copies_queued = True
        return HostCopy(host, done)

    def write_blocks(self, loads) -> None:
        """Fill cache blocks with this rank's K/V read from a tier ((block id, window block id, payload), payloads in
        block_bytes' layout; a window block id the pool's null: its rows land in the pool's scratch block, read by no
        kernel). The blocks gathered LOAD_CHUNK at a time into one staging buffer (kept: a fresh 176 MB tensor
        for a 4,000-token prompt cost more in page faults than the copy), then one copy per region (a
        block at a time was 15,000 small copies)."""
        loads = list(loads)
        if loads and self._load_staging is None:
            self.stage_block_writes()
        regions = list(zip(self.cache_regions(), self.window_regions()))
        for start in range(0, len(loads), LOAD_CHUNK):
            chunk = loads[start:start + LOAD_CHUNK]
            host = []
            for _, _, payload in chunk:
                if isinstance(payload, HostCopy):  # the host tier's pinned copy (once its copy off the device is done)
                    payload.done.synchronize()
                    host.append(payload.host)
                else:
                    with warnings.catch_warnings():  # read-only bytes, only read
                        warnings.simplefilter("ignore", UserWarning)
                        host.append(torch.frombuffer(payload, dtype=torch.uint8))
            staged = self._load_staging[:len(chunk)]
            torch.stack(host, out=staged)
            # (synchronous on CUDA: the staging buffer is refilled for the next chunk)
            moved = staged.to(self.device)
            ids = torch.tensor([block_id for block_id, _, _ in chunk], device=self.device)
            window_ids = torch.tensor([window_id for _, window_id, _ in chunk], device=self.device)
            offset = 0
            for region, windowed in regions:
                size = region[0].numel() * region.element_size()
                # as the region's dtype (a copy of bytes is 3× slower); float8 as bytes (torch has no index_copy_ for it)
                dtype = torch.uint8 if region.dtype == FP8_KV else region.dtype
                region.view(dtype).view(region.shape[0], -1).index_copy_(0, window_ids if windowed else ids,
                                                                         moved[:, offset:offset + size].view(dtype))
                offset += size

    def settle_writes(self) -> None:
        """Before blocks are filled from outside the step's stream (a NIXL read) or over it: on a GPU, the
        steps queued and the copies off the cache done (a block freed by a sequence a step in flight
        still runs, or a saved block being copied off, may be the one filled). On a CPU both are done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._copies_queued = False

    def stage_block_writes(self) -> None:
        """Make write_blocks' staging buffer now, its pages touched (at the first write their faults
        cost that step ~10 ms on a CPU)."""
        self._load_staging = torch.zeros((LOAD_CHUNK, self.block_layout()[1]), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def set_adapter(self, slot: int, tensors: dict | None) -> None:
        """Write an adapter's tensors into a LoRA slot (None: clear it)."""
        self.model.set_adapter(slot, tensors)

    def _read_adapter(self, message: SetAdapter) -> None:
        """Ranks 1…N−1: this rank's share of an adapter, read from its directory."""
        self.set_adapter(message.slot, read_adapter(message.path, self.model.config, self.config.max_lora_rank)[0] if message.path else None)

    # --- a step ----------------------------------------------------------------------------------
    def begin(self, step: Step, previous: LaunchedStep | None = None) -> tuple[StepBatch, Proposal | None]:
        """Rank 0: the step's message taken into the batch, and a drafter's proposals for it (on the
        device, known on the host where a sequence's masks or penalties need them). previous: the step
        in flight (async scheduling), whose tokens and accepted counts they start from."""
        batch = self.batch.apply(step)
        return batch, self.drafter.propose(batch, previous) if self.drafter is not None else None

    def build(self, batch: StepBatch, step: Step, proposal: Proposal | None = None) -> tuple[ModelInput, StepPlan]:
        """Rank 0: the begun step's tensors, its grammar masks set meanwhile (the engine sends the other
        ranks the message after this: nothing that can fail is left before their collectives)."""
        batch.grammar = step.grammar
        inp, plan = self.inputs.build(batch, proposal, next_tokens=self.drafter is not None and self.drafter.reads_hidden_states)
        inp.head_states = step.drafts_next
        return inp, plan

    def execute(self, inp: ModelInput, plan: StepPlan, previous: LaunchedStep | None = None, proposal: Proposal | None = None) -> LaunchedStep:
        """Rank 0: a built step launched."""
        launched = self.launch(inp, previous, proposal.tokens if proposal else None)
        launched.plan = plan
        if self.drafter is not None:
            self.drafter.launched(plan, launched)
        return launched

    @torch.inference_mode()
    def launch(self, inp: ModelInput, previous: LaunchedStep | None = None, proposal: torch.Tensor | None = None) -> LaunchedStep:
        """The one device call of a step: forward, prompt logprobs, sampling (verifying proposed tokens)
        and a drafter's pass over the step's rows, not waited for: on CUDA the step is queued and the
        host goes on (async scheduling builds the next step meanwhile); LaunchedStep.output() waits.
        previous: the step before, whose sampled tokens and accepted counts, still on the device, the
        input's placeholders take; proposal: the proposed tokens this step verifies, made on the device."""
        if self._copies_queued:  # blocks being copied off the device (block_bytes) are not written over before the copies end
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._copies_queued = False
        inp.take_device_values(previous.tokens if previous else None, previous.accepted_counts if previous else None, proposal)
        sampled = inp.sampling is not None
        if self.stage is not None:  # the first stage's part: the logits come from the last stage later
            self._forward(inp, sampled)
            return LaunchedStep(None, [], incoming=self._logits_coming(inp, sampled))
        prompt_logits, logits, aux = self._forward(inp, sampled)
        collective = self.drafter is not None and self.drafter.collective
        if collective:  # its collectives right after the target's, as the other ranks run them (nothing of rank 0's alone between)
            self.drafter.after_target(inp, aux, None)
        prompt_logprobs = [self._prompt_logprobs(lg, r) for lg, r in zip(prompt_logits, inp.prompt_logprobs)]
        sample = self.sampler.draw(logits, inp.sampling) if sampled else None
        head_state = self.drafter.after_target(inp, aux, sample) if self.drafter is not None and not collective else None
        return LaunchedStep(sample, prompt_logprobs, head_state)

    def _forward(self, inp: ModelInput, sampled: bool) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """The part of a step every rank runs alike (its all-reduces and gathers pair up across ranks):
        the forward pass, then the logits of the prompt-logprob spans and of the sampled rows, and the
        model's declared aux output (the hidden states an EAGLE-3 head reads; else None)."""
        if self.decode_graphs is not None and self.decode_graphs.takes(inp):
            return [], self.decode_graphs.run(inp), None
        meta = AttentionMetadata.from_input(inp)
        if self.model.lora is not None:
            self.model.lora.context.batch = inp.lora
        stage = self.stage
        handed = self._handed_in(inp) if stage else None
        started = time.perf_counter()
        try:
            out = self.model(inp.input_ids, inp.positions, self.kv_caches, meta, hidden=handed)
        finally:
            if self.model.lora is not None:
                self.model.lora.context.batch = None
        if stage is not None and not stage.last:
            self.stage_time.add(time.perf_counter() - started)
            self._hand_on(out, stage.next_rank)
            return [], None, None
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        prompt_logits = [self.model.compute_logits(hidden[r.first_row:r.first_row + len(r.target_ids)]) for r in inp.prompt_logprobs]
        logits = self.model.compute_logits(hidden[inp.logits_indices]) if sampled else None
        if stage is not None:
            self.stage_time.add(time.perf_counter() - started)
        if stage is not None and stage.rank == stage.last_stage_rank and (parts := [*prompt_logits, *([logits] if sampled else [])]):
            self._hand_on(torch.cat(parts), 0)
        return prompt_logits, logits, aux

    # --- pipeline stages: what crosses between them ------------------------------------------------
    # Sends do not wait to be taken (a gloo or NCCL send completes once its receiver asks for it): a stage
    # goes on to its next step while the next stage still runs the one before; a step's sends are
    # waited for when the next step hands on (taken by then unless the next stage is the slower).
    def _handed_in(self, inp: ModelInput) -> torch.Tensor | None:
        """The residual stream of the step's tokens from the stage before (None: the first stage embeds)."""
        if self.stage.first:
            return None
        import torch.distributed as dist

        hidden = torch.empty(inp.input_ids.shape[0], self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        dist.recv(hidden, src=self.stage.previous_rank)
        return hidden

    def _hand_on(self, t: torch.Tensor, rank: int) -> None:
        import torch.distributed as dist

        for work, _ in self._sending:
            work.wait()
        t = t.contiguous()
        self._sending = [(dist.isend(t, dst=rank), t)]

    def _logits_coming(self, inp: ModelInput, sampled: bool):
        """Rank 0 under pipeline parallelism: the receive of the step's logits from the last stage posted
        (the prompt-logprob spans', then the sampled rows', as _forward computes them there), and what
        waits for them and samples."""
        import torch.distributed as dist

        spans = [len(r.target_ids) for r in inp.prompt_logprobs]
        rows = sum(spans) + (inp.logits_indices.shape[0] if sampled else 0)
        if not rows:
            return lambda: (None, [])
        logits = torch.empty(rows, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        work = dist.irecv(logits, src=self.stage.last_stage_rank)

        def arrive():
            work.wait()
            parts = logits.split([*spans, rows - sum(spans)])
            with torch.inference_mode():
                prompt_logprobs = [self._prompt_logprobs(lg, r) for lg, r in zip(parts, inp.prompt_logprobs)]
                return (self.sampler.draw(parts[-1], inp.sampling) if sampled else None), prompt_logprobs
        return arrive

    # --- ranks 1…N−1 ------------------------------------------------------------------------------
    def serve(self, channel: Channel) -> None:
        """Ranks 1…N−1: run what rank 0 sends until it says stop."""
        kv = None
        if self.config.kv_offload_dir or self.config.kv_host_offload_size or self.config.kv_role != "none":
            from kvpilot.server.engine.kv_connector import KVConnectorWorker

            kv = KVConnectorWorker(self.config, self)
        self._channel = channel  # (rank 0's word before a split draft's collective parts)

        def kv_work(work: KVWork) -> None:
            failed = kv.run(work)
            if work.loads:  # every rank says which of its loads failed, and all drop every one of them
                channel.agree(failed)

        handlers = {Step: self._run_rank_step, KVWork: kv_work, SetAdapter: self._read_adapter,
                    Describe: lambda m: self._gather_description(), DescribePeers: lambda m: self._gather(kv.peer())}
        while type(message := channel.receive()) is not Stop:
            handlers[type(message)](message)
        if kv is not None:
            kv.close()  # shards queued for the disk tier are written before the rank goes

    def _run_rank_step(self, step: Step) -> None:
        """A step as ranks 1…N−1 run it: built from the message (no sampling: rank 0 samples); what rank 0
        has on its device broadcast after the message: the step in flight's tokens (placeholders) and
        accepted counts (unsettled rows), then the tokens rank 0's drafter proposed. A split draft model
        runs its proposal steps here too, between those; before each of them and before the target's
        forward rank 0 says whether its own work before it went well (else the ranks drop the step)."""
        import torch.distributed as dist

        batch = self.batch.apply(step)
        drafted = [s for s in batch.seqs if s.num_spec_tokens and not s.spec_token_ids]
        received = []
        for count in (step.num_previous_tokens, step.num_previous_tokens if step.previous_accepted else 0):
            received.append(torch.empty(count, dtype=torch.long, device=self.device) if count else None)
            if count:
                dist.broadcast(received[-1], src=0)
        if self.drafter is not None:  # (a drafter on these ranks: a split draft model)
            if drafted and not self.drafter.follow(drafted, self._channel.heard):
                return
            if not self._channel.heard():
                return
        proposal = None
        if drafted:
            for seq in drafted:
                seq.spec_token_ids = [PLACEHOLDER_TOKEN] * seq.num_spec_tokens
            tokens = torch.empty(len(drafted), max(s.num_spec_tokens for s in drafted), dtype=torch.long, device=self.device)
            proposal = Proposal(tokens, {s.seq_id: i for i, s in enumerate(drafted)}, None)
            dist.broadcast(proposal.tokens, src=0)
        inp, _ = self.inputs.build(batch, proposal, sample=False)
        inp.take_device_values(*received, proposal.tokens if proposal is not None else None)
        with torch.inference_mode():
            _, _, aux = self._forward(inp, inp.logits_indices.numel() > 0)
            if self.drafter is not None:
                self.drafter.after_target(inp, aux, None)

    def _gather_description(self) -> None:
        self._gather(self.describe())

    @staticmethod
    def _gather(value) -> None:
        import torch.distributed as dist

        dist.gather_object(value, None, dst=0)

    def describe(self) -> dict:
        """What this rank holds: projection weight bytes, KV heads and KV cache bytes (tests, logs)."""
        return {"rank": self.rank, "layers": [self.model.first_layer, self.model.first_layer + len(self.model.layers)],
                "stage_steps": self.stage_time.steps, "stage_seconds": self.stage_time.seconds,
                "projection_bytes": projection_bytes(self.model), "kv_heads": self.model.num_kv_heads,
                "kv_cache_bytes": sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches),
                **(self.drafter.describe() if self.drafter is not None else {})}

    def _prompt_logprobs(self, logits: torch.Tensor, rows: PromptLogprobRows) -> list[dict[int, float]]:
        """Logprob of each next prompt token (plus the top-n) at these rows."""
        lps = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(rows.target_ids, device=lps.device)
        chosen = lps.gather(1, targets[:, None])[:, 0].tolist()
        top = torch.topk(lps, rows.top_k) if rows.top_k else None
        entries = []
        for j, target in enumerate(rows.target_ids):
            entry = {target: chosen[j]}
            if top is not None:
                for lp, tid in zip(top.values[j].tolist(), top.indices[j].tolist()):
                    entry.setdefault(tid, lp)
            entries.append(entry)
        return entries
