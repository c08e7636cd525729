"""How a model is laid out over its ranks: which layers each pipeline stage holds, and within a stage
which rows, heads and vocabulary each tensor-parallel rank holds. Arithmetic (the processes and
collectives are engine/parallel.py's; a stage's process group is carried, not made, here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.server.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among the ranks, and the layout of the model's pieces over them."""

    rank: int        # within the stage's ranks
    world_size: int  # the stage's ranks (tensor_parallel_size)
    group: Any = None  # the stage's process group (pipeline parallelism); None: every rank (the default group)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (n is a multiple of the world size)."""
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads: its share when there are at least as many as ranks, else the one
        KV head its query heads read (replicated on world_size / num_kv_heads ranks)."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.world_size
        return head, head + 1

    def padded_vocab(self, vocab_size: int) -> int:
        return -(-vocab_size // self.world_size) * self.world_size


def tensor_parallel_problems(c: ModelConfig, n: int) -> list[str]:
    """What keeps the model from being split over n ranks (empty: it can be)."""
    problems = []
    if c.num_heads % n:
        problems.append(f"the {c.num_heads} query heads")
    if c.num_kv_heads % n and n % c.num_kv_heads:
        problems.append(f"the {c.num_kv_heads} KV heads (or be a multiple of them)")
    if c.intermediate_size % n:
        problems.append(f"the FFN width {c.intermediate_size}")
    if c.num_experts and c.moe_intermediate_size % n:
        problems.append(f"each expert's inner width {c.moe_intermediate_size}")
    if c.shared_expert_intermediate_size % n:
        problems.append(f"the shared expert's inner width {c.shared_expert_intermediate_size}")
    return problems


def check_tensor_parallel(c: ModelConfig, n: int) -> None:
    """Refuses a world size the model cannot be split over, naming the counts that decide it."""
    if problems := tensor_parallel_problems(c, n):
        raise ValueError(f"tensor_parallel_size={n} does not fit {c.name}: it must divide {', '.join(problems)} "
                         f"(the model has {c.num_heads} query heads, {c.num_kv_heads} KV heads, FFN width {c.intermediate_size})")


def stage_layers(num_layers: int, num_stages: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's [start, end) of the layers: `partition`'s counts, else as even as the count allows, the
    earlier stages one more where it does not divide (the last stage also holds the final norm and the LM head)."""
    size, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + (partition[s] if partition else size + (s < extra)))
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This process's stage among pipeline_parallel_size stages of tensor_parallel_size ranks each.
    Global ranks run stage by stage (rank = stage * tp_size + rank within the stage: rank 0, the engine,
    is in the first); a stage hands its hidden states to the rank of the same place in the next."""

    index: int
    num_stages: int
    layers: tuple[int, int]  # [start, end) of the model's layers
    rank: int                # global
    tp_size: int

    @classmethod
    def of(cls, rank: int, tp_size: int, num_stages: int, num_layers: int, partition: list[int] | None = None) -> PipelineStage:
        index = rank // tp_size
        return cls(index, num_stages, stage_layers(num_layers, num_stages, partition)[index], rank, tp_size)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def previous_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def last_stage_rank(self) -> int:
        """The last stage's first rank: it sends rank 0 the step's logits."""
        return (self.num_stages - 1) * self.tp_size


def check_pipeline_parallel(c: ModelConfig, n: int, partition: list[int] | None = None) -> None:
    """Refuses more stages than the model has layers, and a partition that does not add up to them."""
    if n > c.num_layers:
        raise ValueError(f"pipeline_parallel_size={n} does not fit {c.name}: a stage holds at least one of its {c.num_layers} layers")
    if partition is not None and sum(partition) != c.num_layers:
        raise ValueError(f"pipeline_layer_partition={partition} adds up to {sum(partition)} layers; {c.name} has {c.num_layers}")
