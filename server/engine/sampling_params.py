"""Per-request sampling parameters (vLLM's names and meanings). torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to the model's max length
    min_tokens: int = 0
    temperature: float = 1.0             # 0 = greedy
    top_k: int = 0                       # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None          # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None   # top-n logprobs per prompt position (plus the actual next token)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
