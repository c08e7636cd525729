"""What a model's KV cache costs, by kind of layer, and how an engine's budget splits into blocks: torch-free, so that the
operator sizes a service with the numbers the engine's worker uses (one source of truth).

A full-attention layer keeps every token of a sequence; a sliding-window layer (Gemma 3's five in six, Mistral v0.1's
every one: block_manager.WindowPool) keeps, in a pool of its own, only the blocks its next query sees. The worker splits
its budget into the two pools (window_pool_split); where every layer is windowed, the pool has all of it and a
sequence's block table is bookkeeping (prefix keys, the order of its blocks) over no memory. Without a pool (the
reasons: why_no_window_pool) every layer keeps every block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.model_config import ModelConfig

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A model's attention layers as the KV cache sees them."""

    num_kv_heads: int
    head_dim: int
    full_layers: int
    window_layers: int
    window: int = 0  # tokens a sliding-window layer's query sees (0: none)
    max_position: int = 0  # the model's context (the engine serves no longer a sequence whatever its cache)

    @classmethod
    def of(cls, config: ModelConfig) -> KVLayout:
        windowed = sum(1 for i in range(config.num_layers) if config.window(i))
        return cls(config.num_kv_heads, config.head_dim, config.num_layers - windowed, windowed, config.sliding_window if windowed else 0,
                   config.max_position)

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """A rank's KV heads (sharding.py: split when there are enough, else one replicated)."""
        return self.num_kv_heads // tensor_parallel_size if self.num_kv_heads >= tensor_parallel_size else 1

    def layer_block_bytes(self, block_size: int, element_bytes: int, tensor_parallel_size: int = 1) -> int:
        """One layer's K and V of one block, on one rank."""
        return 2 * block_size * self.kv_heads_per_rank(tensor_parallel_size) * self.head_dim * element_bytes

    def token_bytes(self, element_bytes: int, tensor_parallel_size: int = 1) -> dict[str, int]:
        """Bytes one token's K and V take on one rank, over each kind of layer: full (kept for the whole sequence) and
        sliding_window (kept while a query sees it)."""
        per_layer = self.layer_block_bytes(1, element_bytes, tensor_parallel_size)
        return {"full": per_layer * self.full_layers, "sliding_window": per_layer * self.window_layers}


def kv_element_bytes(config: EngineConfig, cuda: bool) -> int:
    """The KV cache's element size (worker.resolve_kv_dtype's choice: the compute dtype unless kv_cache_dtype says otherwise)."""
    name = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else config.dtype
    if name == "auto":
        name = "bfloat16" if cuda else "float32"
    return ELEMENT_BYTES[name]


def why_no_window_pool(layout: KVLayout, config: EngineConfig) -> str | None:
    """Why a model's sliding-window layers share the block table (None: a pool of their own). From the config alone,
    which every rank has (a drafter may live on rank 0 only)."""
    if not layout.window_layers:
        return "the model has no sliding-window layers"
    for on, what in ((config.kv_role != "none", "prefill/decode handoffs move whole blocks"),
                     (config.pipeline_parallel_size > 1, "pipeline stages split the layers"),
                     (config.speculative_method in ("draft", "eagle3"), "a drafter's cache shares the block table"),
                     (not config.enable_chunked_prefill, "without chunked prefill a whole prompt's blocks are held at once")):
        if on:
            return what
    return None


def window_pool_split(layout: KVLayout, budget: int, layer_block_bytes: int, shared_blocks: int, config: EngineConfig,
                      max_position: int) -> tuple[int, int]:
    """(full-attention blocks, window blocks) of a budget: the window layers' pool holds a window and two blocks for
    each of max_num_seqs sequences, and a step's tokens (a chunk's blocks are all held while it runs), but never more
    than one shared table would have (shared_blocks); the full layers take the rest (never fewer than shared_blocks).
    Every layer windowed: the pool takes the whole budget (shared_blocks), and the block table (bookkeeping only) has
    room for max_num_seqs sequences of max_position tokens — when the pool holds at least one sequence's window and a
    step's tokens (else as many as the pool: a sequence no longer than the cache, as without a pool, or it could
    never be scheduled). layer_block_bytes: one layer's K and V of one block."""
    bs = config.block_size
    if not layout.full_layers:
        one_sequence = -(-layout.window // bs) + 2 + -(-config.max_num_batched_tokens // bs)
        return (config.max_num_seqs * -(-max_position // bs) if shared_blocks >= one_sequence else shared_blocks), shared_blocks
    wanted = config.max_num_seqs * (-(-layout.window // bs) + 2) + -(-config.max_num_batched_tokens // bs)
    window_blocks = min(wanted, shared_blocks)
    full_blocks = (budget - (window_blocks + 1) * layout.window_layers * layer_block_bytes) // (layout.full_layers * layer_block_bytes) - 1
    return max(full_blocks, shared_blocks), window_blocks


def capacity_tokens(layout: KVLayout, config: EngineConfig, cuda: bool = False) -> int | None:
    """Tokens of one sequence the engine's cache holds with a budget of config.kv_cache_memory per rank (the engine lowers
    max_model_len to it): its full-attention layers' blocks, the window pool split off as the worker splits it (one block
    of each pool is the scratch block; every layer windowed, a pool that holds a sequence's window: max_num_seqs
    sequences of the model's context). None where the model's layout alone does not say (a
    drafter's cache in the same blocks, pipeline stages' layers)."""
    if config.speculative_method in ("draft", "eagle3") or config.pipeline_parallel_size > 1:
        return None
    layer_block_bytes = layout.layer_block_bytes(config.block_size, kv_element_bytes(config, cuda), config.tensor_parallel_size)
    shared = config.kv_cache_memory // (layer_block_bytes * (layout.full_layers + layout.window_layers)) - 1
    if shared < 1 or why_no_window_pool(layout, config):
        return max(shared, 0) * config.block_size
    full, _ = window_pool_split(layout, config.kv_cache_memory, layer_block_bytes, shared, config, layout.max_position)
    return full * config.block_size
