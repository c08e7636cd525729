"""What a request must satisfy to enter the engine, checked once, where it enters, into a typed
Admission; refusals are typed errors that name the field (the API maps them to HTTP 400s).
torch-free: the API checks a request with the engine's own limits before it streams anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.server.engine.kv_trust import params_verify
from kvpilot.server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.server.engine.structured import Grammar, GrammarCompiler


# How an engine output's error begins when the grammar library failed the request's constraint
# mid-generation (the API answers it as the request's fault: api/async_engine.py ConstraintFailedError).
CONSTRAINT_FAILURE = "structured output:"


class RequestRejected(ValueError):
    """The engine cannot take this request as it is; `param` names the field, `code` the OpenAI error code."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(RequestRejected):
    code = "context_length_exceeded"


class ModelNotFound(RequestRejected):
    """The request names a model or LoRA adapter this engine does not serve (HTTP 404)."""

    code = "model_not_found"


@dataclass(frozen=True, slots=True)
class Admission:
    """A request the engine will take: its prompt ids, its parameters (never changed by the engine)
    and the output's length limit they come to (max_tokens, else what the context leaves)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int
    grammar: Grammar | None = None       # params.structured, compiled
    adapter: str | None = None           # the LoRA adapter it runs with, by name (None: the base model)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int                      # the model's (it may be padded past the tokenizer's)
    grammars: GrammarCompiler | None = None  # compiles structured-output constraints (None: they are refused)
    kv_role: str = "none"                # prefill/decode disaggregation: which kv_transfer_params this engine takes
    kv_transfer_secret: bytes | None = None  # the pool's: a decode request's params must be signed with it (kv_transfer.py)
    scheduling_policy: str = "fcfs"      # the engine's --scheduling-policy: under fcfs a request's priority must be 0 (as vLLM)

    def admit(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
              grammar: Grammar | None = None) -> Admission:
        """grammar: params.structured already compiled (the server compiles it off the tokenizer pool)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestRejected("prompt must not be empty", "prompt")
        bad = [t for t in ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", "prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthExceeded(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                                        "(at least one output token must fit)", "prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthExceeded(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                                        f"and max_tokens is {params.max_tokens}", "max_tokens")
        max_output = room if params.max_tokens is None else params.max_tokens
        if params.priority != 0 and self.scheduling_policy != "priority":
            raise RequestRejected(f"priority {params.priority} needs an engine started with --scheduling-policy priority "
                                  f"(this one's: {self.scheduling_policy}); leave it 0 or unset", "priority")
        if params.min_tokens > max_output:
            raise RequestRejected(f"min_tokens must be <= the output's length limit ({max_output} tokens), got {params.min_tokens}", "min_tokens")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be < {self.vocab_size} (this model's vocabulary)", "stop_token_ids")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be < {self.vocab_size} (this model's vocabulary)", "logit_bias")
        transfer = params.kv_transfer
        if transfer is not None and (transfer.do_remote_decode or transfer.do_remote_prefill):
            side = "prefill" if transfer.do_remote_decode else "decode"
            if self.kv_role not in (side, "both"):
                raise RequestRejected(f"kv_transfer_params.do_remote_{'decode' if side == 'prefill' else 'prefill'} needs an engine whose "
                                      f"kv_role is {side} or both (this one's: {self.kv_role})", "kv_transfer_params")
            if params.n != 1:
                raise RequestRejected("kv_transfer_params with n > 1 is not implemented", "kv_transfer_params")
            if transfer.do_remote_prefill:
                if self.kv_transfer_secret is None or not params_verify(self.kv_transfer_secret, transfer):
                    raise RequestRejected("kv_transfer_params.do_remote_prefill: the params are not signed by a prefill engine of this "
                                          "engine's pool (only the params a prefill engine's answer carries are taken, unchanged)",
                                          "kv_transfer_params")
        if params.structured is not None and grammar is None:
            if self.grammars is None:
                raise RequestRejected("structured outputs are not available in this engine", params.structured.param)
            grammar = self.grammars.compile(params.structured)
        return Admission(ids, params, max_output, grammar, adapter)
