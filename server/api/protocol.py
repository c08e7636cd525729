"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Unknown fields are rejected (400 naming them) rather than silently ignored; OpenAI fields we do not
implement are declared so that setting them gets a 400 that says so by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from kvpilot.server.engine.sampling_params import MAX_STOP_TOKEN_IDS, SEED_RANGE, SamplingParams


def _valid_unicode(text: str) -> str:
    """JSON can spell lone UTF-16 surrogates ("\\ud800"); they are not text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains an invalid character (a lone surrogate) at position {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = StrictInt  # true/false are JSON booleans, not token ids


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, detail: str = ""):
        super().__init__(f"parameter '{param}' is not supported by this server{': ' + detail if detail else ''}")
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = None
    top_p: float | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # OpenAI's end-user id: accepted, not used
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI fields we do not implement: a 400 names them when set
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "use n")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None

    def params(self) -> SamplingParams:
        if self.echo:
            raise UnsupportedParameter("echo")
        if self.suffix:
            raise UnsupportedParameter("suffix")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # not implemented: tools and structured output
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None

    def params(self) -> SamplingParams:
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise UnsupportedParameter(name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise UnsupportedParameter(name)
        if self.response_format is not None and self.response_format.type != "text":
            raise UnsupportedParameter("response_format", f"only type 'text', not {self.response_format.type!r}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[TokenId]
