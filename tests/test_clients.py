"""The requests real clients send (#77): the official `openai` client's tool-calling chat loop (each reply
appended with `message.model_dump()`) and its `chat.completions.parse`, and langchain-openai's
`ChatOpenAI` with `bind_tools` and `with_structured_output`, and lm-evaluation-harness's
`local-completions` model (echo + logprobs loglikelihoods, greedy generation, the server's tokenizer
through /tokenizer_info, /tokenize and /detokenize) against its own `hf` model on the same weights,
against a real server in both modes.

Every HTTP exchange goes through an httpx event hook that records it: each must be a 200, and the server
must have understood every field the client sent (it names the fields it ignores in
x-kvpilot-ignored-fields; a client's field silently dropped is a request answered differently from how
the client meant it)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server_harness import SERVER_MODES, ServerProcess

MODEL = "smollm2-135m"
FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--max-num-seqs", "4", "--tool-call-parser", "hermes",
         "--enable-tokenizer-info-endpoint")
LM_EVAL_TASKS = Path(__file__).parent / "data" / "lm_eval_task"  # kvpilot_mc (multiple choice) and kvpilot_gen (generate_until)

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Adds two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                      "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
PARAMETERS = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A server in each mode (server_harness.SERVER_MODES), started at once so that their start-ups
    overlap; each must exit cleanly at the end."""
    started = {mode: ServerProcess(*FLAGS, *extra, log_path=tmp_path_factory.mktemp("server") / "server.log")
               for mode, extra in SERVER_MODES.items()}
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            codes = dict(zip(started, pool.map(ServerProcess.terminate, started.values())))
    assert codes == dict.fromkeys(SERVER_MODES, 0)


@pytest.fixture(params=list(SERVER_MODES))
def served(request, servers):
    return servers[request.param]


class Exchanges:
    """The (request body, response) pairs one httpx client saw, by its event hooks."""

    def __init__(self):
        self.seen: list[tuple[dict, httpx.Response]] = []

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=120, event_hooks={"response": [self._record]})

    def _record(self, response: httpx.Response) -> None:
        response.read()
        body = json.loads(response.request.content) if response.request.content else {}
        self.seen.append((body, response))

    def check(self, count: int) -> list[dict]:
        """The bodies sent, after checking there were `count` exchanges, all 200s with no field ignored."""
        assert len(self.seen) == count, [(b, r.status_code) for b, r in self.seen]
        for body, r in self.seen:
            assert r.status_code == 200, (body, r.text)
            assert "x-kvpilot-ignored-fields" not in r.headers, (r.headers["x-kvpilot-ignored-fields"], body)
        return [b for b, _ in self.seen]


@pytest.fixture
def exchanges():
    return Exchanges()


@pytest.fixture
def openai_client(served, exchanges):
    from openai import OpenAI

    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, http_client=exchanges.client())


def chat_model(served, exchanges, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=served.url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=kw.pop("max_tokens", 60),
                      max_retries=0, http_client=exchanges.client(), **kw)


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMETERS[name])
    return args


# --- openai ---------------------------------------------------------------------------------------


def test_openai_three_turn_tool_chat_appending_model_dump(openai_client, exchanges):
    """The SDK's usual loop: each reply goes back as `message.model_dump()` (which carries refusal,
    annotations, audio and function_call as nulls), each tool call is answered by a tool message, and
    the next turn is sent: two forced calls (one per tool), then the answer in text."""
    history = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    kw = dict(model=MODEL, tools=TOOLS, temperature=0, parallel_tool_calls=False)
    results = {"get_weather": "21 C, sunny", "add": "5"}
    prompt_tokens = []
    for name in ("get_weather", "add"):
        r = openai_client.chat.completions.create(messages=history, tool_choice={"type": "function", "function": {"name": name}},
                                                  max_tokens=60, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        check_call(call, name)
        dumped = choice.message.model_dump()
        assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
        history += [dumped, {"role": "tool", "tool_call_id": call.id, "content": results[name]}]
        prompt_tokens.append(r.usage.prompt_tokens)
    answer = openai_client.chat.completions.create(messages=history, tool_choice="none", max_tokens=8, **kw)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    prompt_tokens.append(answer.usage.prompt_tokens)
    assert prompt_tokens == sorted(set(prompt_tokens)), prompt_tokens  # each turn's prompt holds the one before
    bodies = exchanges.check(3)
    # what went back is what the SDK dumped: the calls it was given, each answered by its id
    sent_calls = [m["tool_calls"][0] for m in bodies[-1]["messages"] if m["role"] == "assistant"]
    assert [c["function"]["name"] for c in sent_calls] == ["get_weather", "add"]
    assert [m["tool_call_id"] for m in bodies[-1]["messages"] if m["role"] == "tool"] == [c["id"] for c in sent_calls]


def test_openai_stream_with_continuous_usage_stats(openai_client, exchanges):
    """The openai client's chat stream with stream_options include_usage + continuous_usage_stats
    (vLLM's): every chunk with a choice carries the usage so far, the last one the totals."""
    stream = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6,
                                                   temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    with_choice = [c for c in chunks if c.choices]
    counted = [c.usage.completion_tokens for c in with_choice]
    assert counted[0] == 0 and counted == sorted(counted), counted  # the role preamble: none yet
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == counted[-1] == 6
    assert final.usage.prompt_tokens_details.cached_tokens >= 0 and final.usage.total_tokens == final.usage.prompt_tokens + 6
    exchanges.check(1)


def test_openai_parse_returns_the_pydantic_instance(openai_client, exchanges):
    completion = openai_client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris in JSON."}],
                                                      response_format=City, temperature=0, max_tokens=80)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and City.model_validate_json(message.content) == message.parsed
    (body,) = exchanges.check(1)
    assert body["response_format"]["type"] == "json_schema" and body["response_format"]["json_schema"]["strict"] is True


# --- langchain-openai -----------------------------------------------------------------------------


def test_langchain_bind_tools_forced_call_matches_the_schema(served, exchanges):
    llm = chat_model(served, exchanges).bind_tools(TOOLS, tool_choice="add")
    reply = llm.invoke("What is 2 + 3?")
    (call,) = reply.tool_calls
    assert call["name"] == "add" and call["id"] and not reply.invalid_tool_calls
    jsonschema.validate(call["args"], PARAMETERS["add"])
    (body,) = exchanges.check(1)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}} and body["max_completion_tokens"] == 60


def test_langchain_structured_output_defaults_to_json_schema():
    """The default method sends what method="json_schema" sends (so one request covers both below)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", model=MODEL, temperature=0)
    default, explicit = (llm.with_structured_output(City, **kw).first.kwargs for kw in ({}, {"method": "json_schema"}))
    assert default == explicit and default["response_format"] is City
    assert default["ls_structured_output_format"]["kwargs"]["method"] == "json_schema"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_instance(served, exchanges, method):
    """function_calling sends the schema as a forced tool: `City` has no additionalProperties, as
    pydantic writes a model by default (OpenAI's strict mode and vLLM's default xgrammar backend allow no
    unlisted keys then)."""
    city = chat_model(served, exchanges).with_structured_output(City, method=method).invoke("Describe Paris in JSON.")
    assert isinstance(city, City)
    (body,) = exchanges.check(1)
    if method == "function_calling":
        assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    else:
        assert body["response_format"]["type"] == "json_schema"


def run_lm_eval(model, model_args: dict | None = None) -> dict:
    """Both shipped lm-eval tasks, offline: per task, each document's responses (loglikelihood and
    is_greedy per choice; the generated text) and the metric."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["kvpilot_mc", "kvpilot_gen"], batch_size=1,
                                  bootstrap_iters=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(LM_EVAL_TASKS), include_defaults=False))
    return {task: ({s["doc_id"]: s["resps"] for s in out["samples"][task]}, out["results"][task]) for task in ("kvpilot_mc", "kvpilot_gen")}


@pytest.fixture(scope="module")
def lm_eval_hf(hf_oracle_session):
    from lm_eval.models.huggingface import HFLM

    return run_lm_eval(HFLM(pretrained=hf_oracle_session.model, tokenizer=hf_oracle_session.tokenizer, batch_size=1))


def test_lm_eval_local_completions_scores_and_generates_as_its_hf_model(served, lm_eval_hf, monkeypatch):
    """Issue #77's done-when: lm-eval's local-completions against the server (its tokenizer the server's
    own, by /tokenizer_info) and lm-eval's hf model on the same weights: the same accuracy, each
    choice's loglikelihood within 1e-3 and the same is_greedy; the same greedy answers."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = run_lm_eval("local-completions", {"base_url": served.url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                                             "max_retries": 1, "max_length": 2048})
    docs, results = ours["kvpilot_mc"]
    ref_docs, ref_results = lm_eval_hf["kvpilot_mc"]
    assert docs.keys() == ref_docs.keys() and len(docs) == 8
    for doc, ref in ref_docs.items():
        got = [tuple(r[0]) for r in docs[doc]]
        want = [tuple(r[0]) for r in ref]
        assert [greedy for _, greedy in got] == [greedy for _, greedy in want], doc
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) < 1e-3, (doc, got, want)
    assert results["acc,none"] == ref_results["acc,none"]
    gen_docs, gen_results = ours["kvpilot_gen"]
    ref_gen_docs, ref_gen_results = lm_eval_hf["kvpilot_gen"]
    assert gen_docs == ref_gen_docs and any(r[0][0].strip() for r in gen_docs.values())
    assert gen_results["exact_match,none"] == ref_gen_results["exact_match,none"]
