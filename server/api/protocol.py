"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Fields this server does not know are ignored where clients send them (a request's top level, its
messages, stream_options), as vLLM does, and named: `ignored_fields()` (the server puts them in a
response header and a log line, or refuses them with --reject-unknown-fields). Inside what shapes
the output (constraints, tools, tool_choice) an unknown field is a 400, since ignoring it would
change the answer unseen. OpenAI fields we do not implement are declared so that setting them gets a
400 that says so by name.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from kvpilot.server.api import tool_calls
from kvpilot.server.engine.sampling_params import MAX_STOP_TOKEN_IDS, PRIORITY_RANGE, SEED_RANGE, KVTransferParams, SamplingParams, StructuredOutput


def _valid_unicode(text: str) -> str:
    """JSON can spell lone UTF-16 surrogates ("\\ud800"); they are not text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains an invalid character (a lone surrogate) at position {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _valid_unicode_within(value: Any) -> Any:
    """Every string in a JSON value (keys too) is text (_valid_unicode); walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _valid_unicode(item)
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_within)]
TokenId = StrictInt  # true/false are JSON booleans, not token ids


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, detail: str = ""):
        super().__init__(f"parameter '{param}' is not supported by this server{': ' + detail if detail else ''}")
        self.param = param


class _Lenient(BaseModel):
    """A part of a request where fields this server does not know are ignored (and named)."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        return [f"{prefix}{printable_name(name)}" for name in self.model_extra or ()]


def printable_name(name: str) -> str:
    """A client's field name as a response header, a log line and an error message can carry it: a
    name may hold any character ("\\r" would make the header illegal and drop the response), so all
    but letters, digits and `_-.` are percent-encoded (UTF-8), and the empty name is `""` (named as
    nothing, it left a header ending in ", ": trailing whitespace, as illegal as "\\r")."""
    return urllib.parse.quote(name, safe="_-.") if name else '""'


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Text = Field(max_length=64)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None  # outputs always match the schema, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs: exactly one constraint. Grammars are Lark (llguidance's dialect) or
    GBNF (llama.cpp's, rules written `name ::= ...`)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{param}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{param}: a JSON schema must be an object")
    return value


class _SamplingFields(_Lenient):
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
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's prefill/decode disaggregation fields (engine/kv_transfer.py)
    # vLLM's: lower runs first under --scheduling-policy priority; under fcfs anything but 0 is refused (engine/limits.py)
    priority: StrictInt = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: the prompt tokens' logprobs and the top n at each
    # OpenAI fields we do not implement: a 400 names them when set
    best_of: int | None = None

    def ignored_fields(self) -> list[str]:
        """The fields of this request that were ignored, by path (e.g. "store", "messages.1.audio_id")."""
        names = self.unknown_fields()
        if self.stream_options is not None:
            names += self.stream_options.unknown_fields("stream_options.")
        return names

    def token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if not all(k.isascii() and k.isdigit() for k in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (non-negative integers as strings)")
        return {int(k): v for k, v in self.logit_bias.items()}

    def _check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of", "use n")

    def structured(self) -> StructuredOutput | None:
        """The request's one output constraint, from whichever field states it."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", None, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            found.append(StructuredOutput("json", _json_schema(rf.json_schema.json_schema, "response_format"), "response_format"))
        so = self.structured_outputs
        if so is not None:
            given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, name) not in (None, False)]
            if len(given) != 1:
                raise ValueError("structured_outputs: set exactly one of json, regex, choice, grammar, json_object")
            kind = given[0].rstrip("_")
            value = _json_schema(so.json_, "structured_outputs") if kind == "json" else None if kind == "json_object" else getattr(so, kind)
            found.append(StructuredOutput(kind, value, "structured_outputs"))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(StructuredOutput(kind, _json_schema(value, "guided_json") if kind == "json" else value, f"guided_{kind}"))
        if len(found) > 1:
            raise ValueError(f"{found[1].param}: only one output constraint per request ({found[0].param} sets one already)")
        return found[0] if found else None

    def kv_transfer(self) -> KVTransferParams | None:
        if self.kv_transfer_params is None:
            return None
        transfer = KVTransferParams.from_dict(self.kv_transfer_params)
        if transfer.do_remote_decode and self.stream:
            raise ValueError("kv_transfer_params.do_remote_decode: a prefill request is answered whole (stream must be false)")
        return transfer

    def with_defaults(self, defaults: dict[str, Any]):
        """This request with the server's defaults (--generation-config: field -> value) in the sampling fields it left
        unset or null, as vLLM applies them. max_tokens is not among them: its default is a cap the prompt's length
        decides (OpenAIServing.prepare)."""
        update = {k: v for k, v in defaults.items() if k != "max_tokens" and k in type(self).model_fields and getattr(self, k) is None}
        return self.model_copy(update=update) if update else self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured=self.structured(), logit_bias=self.token_biases(),
            kv_transfer=self.kv_transfer(), priority=self.priority)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False                   # the prompt (and its logprobs, with logprobs) first in each choice
    suffix: Text | None = None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (lm-evaluation-harness's loglikelihood): the prompt is the answer."""
        return self.echo and self.max_tokens == 0

    def params(self) -> SamplingParams:
        if self.suffix:
            raise UnsupportedParameter("suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (the answer is then the prompt alone)")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:  # the echoed prompt's, as many top ones as the output's (vLLM's)
            prompt_logprobs = self.logprobs
        # the engine makes at least one token: with max_tokens 0 it is dropped
        return self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if self.kv_transfer_params is not None and len(p) > 1:
            raise ValueError("kv_transfer_params: one prompt per request (its blocks are one transfer)")
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text                      # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None                    # a tool message: the call it answers
    # What the SDKs send back with a reply they returned (openai's `message.model_dump()`, the usual chat
    # loop): taken as OpenAI takes them. A refusal and annotations are not part of the prompt; reasoning
    # (ours, under either name) goes to the template, which keeps or drops it; audio and the legacy
    # function_call must be empty (this server never returns them).
    refusal: Text | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.function_call is not None:
            raise ValueError("messages: function_call is not supported (use tool_calls)")
        if self.audio is not None:
            raise ValueError("messages: audio is not supported")
        reasoning = self.reasoning_content or self.reasoning
        if reasoning:
            if self.role != "assistant":
                raise ValueError("messages: only assistant messages carry reasoning")
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            if self.role != "assistant":
                raise ValueError("messages: only assistant messages carry tool_calls")
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None                # calls always match the parameters, strict or not


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat request's tools as the server uses them: the definitions for the template, the functions
    a call may name, and the mode (none, auto, required, or one function's name)."""

    tools: list[dict[str, Any]]
    functions: list[dict[str, Any]]
    choice: str

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    @property
    def calls(self) -> bool:
        """Whether the output is parsed for calls (tool_choice none: the tools are only shown)."""
        return self.choice != "none"


# OpenAI's reasoning_effort values (the openai client's ReasoningEffort; vLLM takes the same)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# chat_template_kwargs names that are not the client's to set, as vLLM refuses them: the template and
# whether to tokenize are the server's; the messages and tools are the request's own fields.
REFUSED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "tools")


def template_variables(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None = None) -> dict[str, Any]:
    """The chat template's variables beyond the messages, tools and add_generation_prompt, merged as vLLM
    merges them: chat_template_kwargs (`{"enable_thinking": false}`), under the request's own fields —
    add_generation_prompt is the request's field, never the kwarg; reasoning_effort, when set, is the
    template's `reasoning_effort`, and `enable_thinking` (unless the kwargs set it) is whether it is
    other than "none". Names a template does not use change nothing."""
    variables = dict(chat_template_kwargs or {})
    for name in REFUSED_TEMPLATE_KWARGS:
        if name in variables:
            raise ValueError(f"chat_template_kwargs: '{name}' cannot be set there" + (" (use the request's own field)" if name in ("messages", "tools") else ""))
    variables.pop("add_generation_prompt", None)
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
        variables.setdefault("enable_thinking", reasoning_effort != "none")
    return variables


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the chat template's own variables (template_variables); include_reasoning: false drops a --reasoning-parser's reasoning
    chat_template_kwargs: JsonObject | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    # OpenAI's deprecated forms of tools: a 400 names them
    functions: list[Any] | None = None
    function_call: Any = None

    def ignored_fields(self) -> list[str]:
        return super().ignored_fields() + [name for i, m in enumerate(self.messages) for name in m.unknown_fields(f"messages.{i}.")]

    def tool_use(self) -> ToolUse | None:
        """The tools this request renders (and, unless tool_choice is none, parses); None: no tools."""
        choice = self.tool_choice
        if choice is not None and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        if not self.tools:
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(f"tool_choice: names {choice.function.name!r}, which is not among the tools ({', '.join(names)})")
            return ToolUse([t.model_dump(exclude_none=True) for t in self.tools], [f for f in functions if f["name"] == choice.function.name],
                           choice.function.name)
        return ToolUse([t.model_dump(exclude_none=True) for t in self.tools], functions, choice or "auto")

    def params(self, tool_format: tool_calls.ToolFormat | None = None) -> SamplingParams:
        """tool_format: the server's format of tool calls (api/tool_calls.py), whose constraint a call gets."""
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise UnsupportedParameter(name, "use tools and tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule: a chat stream has no place for them
            raise ValueError("prompt_logprobs: not available when stream is true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        use = self.tool_use()
        if use is not None and use.calls:
            if params.structured is not None:
                raise ValueError(f"tools: a call is a constraint of its own; {params.structured.param} sets another")
            params.structured = (tool_format or tool_calls.Hermes()).constraint(
                use.functions, "auto" if use.choice == "auto" else "required", self.parallel_tool_calls and use.choice in ("auto", "required"))
        return params


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JsonObject | None = None  # with messages: as a chat request's
    # vLLM's: the token strings too; special tokens added (the tokenizer's BOS): by default as the prompt's
    # own endpoint adds them, true for a prompt (completions), false for messages (the chat template's)
    return_token_strs: bool = False
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): the adapter's name and its directory under --lora-dir, or hf://org/repo (downloaded there)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Text
    lora_int_id: int | None = None
