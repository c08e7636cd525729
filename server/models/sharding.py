"""How a model is laid out over tensor-parallel ranks: which rows, heads and vocabulary each holds.
Pure arithmetic (the processes and collectives are engine/parallel.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.server.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among the ranks, and the layout of the model's pieces over them."""

    rank: int
    world_size: int

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
    return problems


def check_tensor_parallel(c: ModelConfig, n: int) -> None:
    """Refuses a world size the model cannot be split over, naming the counts that decide it."""
    if problems := tensor_parallel_problems(c, n):
        raise ValueError(f"tensor_parallel_size={n} does not fit {c.name}: it must divide {', '.join(problems)} "
                         f"(the model has {c.num_heads} query heads, {c.num_kv_heads} KV heads, FFN width {c.intermediate_size})")
