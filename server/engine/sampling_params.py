"""Per-request sampling parameters (vLLM's names and meanings). torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5
# Bounds that keep every step's arithmetic finite and its cost bounded (a request must never be able
# to turn a row of logits into NaN, or make the output processor scan an unbounded list).
REPETITION_PENALTY_RANGE = (0.01, 2.0)   # logits are divided/multiplied by it: 1e-300 overflowed to inf
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
SEED_RANGE = (-(2**63), 2**64 - 1)       # what torch.Generator.manual_seed takes
MAX_LOGIT_BIAS_ENTRIES = 300               # OpenAI's limits
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_TOP_K = 2**31 - 1                    # top_k goes into an int64 tensor; any value past the vocabulary means "off"
FLOAT32_MAX = 3.4028234663852886e38      # sampling floats go into float32 tensors (a temperature past it is taken as this)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
MAX_CHOICES = 1024
PRIORITY_RANGE = (-(2**63), 2**63 - 1)    # the request's priority crosses to the engine core as a msgpack int64


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The output must match this: a JSON schema (dict), any JSON object, a regex, one of a list of
    strings, a grammar (Lark or GBNF text), or tool calls (the Lark grammar server/api/tool_calls.py
    builds from a request's tools). `param` is the request field it came from (errors name it)."""

    kind: str
    value: dict | str | list[str] | None = None
    param: str = "structured_outputs"

    def validate(self) -> None:
        ok = {"json": lambda v: isinstance(v, dict), "json_object": lambda v: v is None,
              "regex": lambda v: isinstance(v, str) and v != "", "grammar": lambda v: isinstance(v, str) and v.strip() != "",
              "tool_calls": lambda v: isinstance(v, str) and v.strip() != "",
              "choice": lambda v: isinstance(v, list) and 0 < len(v) <= MAX_CHOICES and all(isinstance(c, str) and c for c in v)}
        if self.kind not in ok:
            raise ValueError(f"{self.param}: kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not ok[self.kind](self.value):
            what = {"json": "a JSON schema (an object)", "json_object": "nothing", "regex": "a non-empty regex",
                    "grammar": "a non-empty grammar", "tool_calls": "a Lark grammar", "choice": f"a list of 1 to {MAX_CHOICES} non-empty strings"}[self.kind]
            raise ValueError(f"{self.param}: {self.kind} takes {what}")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Prefill/decode disaggregation, in vLLM's kv_transfer_params fields. A prefill request sets
    do_remote_decode: its prompt's blocks are held for a decode engine to pull, and its output carries
    the params a decode request passes on (do_remote_prefill, where to pull from, what)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None     # the transfer's id on the prefill engine
    remote_engine_id: str | None = None      # the prefill engine's KV identity: a decode engine of another model refuses it
    remote_block_ids: list[int] | None = None  # the held blocks on the prefill side (for the record: blocks are pulled by key)
    tp_size: int | None = None               # the prefill engine's tensor parallelism: a decode engine of another refuses it by name
    signature: str | None = None             # the prefill engine's HMAC over the fields above: only its pool's are pulled from (kv_transfer.py)

    @classmethod
    def from_dict(cls, value: object) -> KVTransferParams:
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"kv_transfer_params: {', '.join(unknown)} not implemented ({', '.join(cls.__dataclass_fields__)} are)")
        params = cls(**{k: v for k, v in value.items() if v is not None})
        params.validate()
        return params

    def validate(self) -> None:
        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv_transfer_params.{name} must be a boolean")
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        if self.do_remote_prefill:
            if not (isinstance(self.remote_host, str) and 0 < len(self.remote_host) <= 255):
                raise ValueError("kv_transfer_params.remote_host must name the prefill engine's host")
            if type(self.remote_port) is not int or not 0 < self.remote_port < 65536:
                raise ValueError("kv_transfer_params.remote_port must be a port number")
            if not (isinstance(self.remote_request_id, str) and 0 < len(self.remote_request_id) <= 256):
                raise ValueError("kv_transfer_params.remote_request_id must be the prefill engine's transfer id")
            if not (isinstance(self.remote_engine_id, str) and len(self.remote_engine_id) <= 128):
                raise ValueError("kv_transfer_params.remote_engine_id must be the prefill engine's id")
            if self.tp_size is not None and (type(self.tp_size) is not int or not 0 < self.tp_size <= 1024):
                raise ValueError("kv_transfer_params.tp_size must be the prefill engine's tensor-parallel size")
        if self.signature is not None and not (isinstance(self.signature, str) and re.fullmatch(r"[0-9a-f]{64}", self.signature)):
            raise ValueError("kv_transfer_params.signature must be the prefill engine's signature (64 hex digits)")

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to the model's max length
    min_tokens: int = 0
    temperature: float = 1.0             # 0 (or < 1e-5) = greedy
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
    structured: StructuredOutput | None = None  # the output must match it (engine/structured.py)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's logit_bias)
    kv_transfer: KVTransferParams | None = None  # prefill/decode disaggregation (engine/kv_transfer.py)
    # Scheduling, not sampling (vLLM passes it beside the params; here it travels with them to the engine core):
    # under --scheduling-policy priority, lower runs first (engine/scheduler.py); under fcfs only 0 is admitted.
    priority: int = 0

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
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN (JSON parsers accept it)
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1, 0 (off) or a positive integer up to {MAX_TOP_K}")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            bad("repetition_penalty", f"must be in [{lo}, {hi}]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids >= 0")
        if self.seed is not None and (type(self.seed) is not int or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if type(self.priority) is not int or not PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1]:
            bad("priority", f"must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
        if self.structured is not None:
            self.structured.validate()
        if self.kv_transfer is not None:
            self.kv_transfer.validate()
        if self.logit_bias is not None:
            lo, hi = LOGIT_BIAS_RANGE
            if (not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES
                    or any(type(t) is not int or t < 0 or not lo <= v <= hi for t, v in self.logit_bias.items())):
                bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids >= 0 to biases in [{lo:g}, {hi:g}]")

    @property
    def greedy(self) -> bool:
        # As in vLLM: below 1e-5 sampling is argmax in all but name, and dividing float32 logits by a
        # temperature that underflows float32 would give 0/0.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
