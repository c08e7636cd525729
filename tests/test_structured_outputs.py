"""Structured outputs (server/engine/structured.py): every output that ends by its constraint matches
it, in batches mixed with unconstrained rows, greedy and seeded, with speculative decoding and with
async scheduling; the request surface (response_format, structured_outputs, guided_*) over HTTP with
the official client; bad constraints are 400s naming their field, in bounded time."""

import json
import re
import time

import httpx
import jsonschema
import pytest
from structured_corpus import SCHEMAS

from kvpilot.server.api.tool_calls import Hermes, Llama3Json

SUBSET = SCHEMAS[:10]
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                     "required": ["a", "b"], "additionalProperties": False}}
OTHERS = 7  # other_requests()
PLAIN = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
REGEX = r"[0-9]{3}-[a-z]{2,8}"
CHOICES = ["positive", "negative", "neutral \"quoted\" ü"]
LARK = 'start: "x=" NUM ("+" NUM)?\nNUM: /[0-9]{1,4}/'
LARK_RE = r"x=[0-9]{1,4}(\+[0-9]{1,4})?"
GBNF = 'root ::= "color: " ("red" | "green" | "blue")'
GBNF_RE = r"color: (red|green|blue)"


def structured(kind, value=None):
    from kvpilot.server.engine.sampling_params import StructuredOutput

    return StructuredOutput(kind, value)


def params(**kw):
    from kvpilot.server import SamplingParams

    return SamplingParams(**{"max_tokens": 100, "temperature": 0, **kw})


def chat(llm, question):
    return llm.get_tokenizer().encode_chat([{"role": "user", "content": f"{question} Reply in JSON."}])


def json_requests(llm, schemas, **kw):
    """One request per schema; with a seed, schema i is drawn with seed + i."""
    return [(chat(llm, q), params(structured=structured("json", schema), **{**kw, **({"seed": kw["seed"] + i} if "seed" in kw else {})}))
            for i, (q, schema) in enumerate(schemas)]


def other_requests(llm, **kw):
    ask = lambda q: llm.get_tokenizer().encode_chat([{"role": "user", "content": q}])  # noqa: E731
    return [(ask("Give a code like 123-abc."), params(structured=structured("regex", REGEX), **kw)),
            (ask("Is 'I love it' positive or negative?"), params(structured=structured("choice", CHOICES), **kw)),
            (ask("Write a sum."), params(structured=structured("grammar", LARK), **kw)),
            (ask("Name a color."), params(structured=structured("grammar", GBNF), **kw)),
            (ask("Describe a cat."), params(structured=structured("json_object"), max_tokens=60, **kw)),
            (ask("What is 2 + 3? Use the tool."), params(structured=Hermes().constraint([ADD], "required", True), max_tokens=60, **kw)),
            (ask("What is 2 + 3? Use the tool."), params(structured=Llama3Json().constraint([ADD], "required", True), max_tokens=60, **kw))]


def plain_requests(llm):
    return [(p, params(max_tokens=20)) for p in PLAIN] + [(PLAIN[0], params(max_tokens=20, temperature=0.8, seed=4))]


def generate(llm, requests):
    return [o.outputs for o in llm.generate([p for p, _ in requests], [sp for _, sp in requests])]


def check_json(outputs, schemas) -> int:
    """Every output that its constraint ended parses and validates; returns how many the constraint ended."""
    ended = 0
    for (question, schema), (o,) in zip(schemas, outputs, strict=True):
        if o.finish_reason == "length":
            continue
        assert o.finish_reason == "stop", (question, o.finish_reason)
        ended += 1
        jsonschema.validate(json.loads(o.text), schema, format_checker=jsonschema.FormatChecker())
    return ended


def check_others(outputs) -> None:
    regex, choice, lark, gbnf, obj, hermes, llama = (o for (o,) in outputs)
    for fmt, o in ((Hermes(), hermes), (Llama3Json(), llama)):  # tool calls: the constraint a required call gets
        if o.finish_reason == "stop":
            content, calls = fmt.parse(o.text, {"add"})
            assert content is None and calls and all(set(json.loads(c.arguments)) == {"a", "b"} for c in calls), o.text
    for o, pattern in ((regex, REGEX), (lark, LARK_RE), (gbnf, GBNF_RE)):
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (pattern, o.text)
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


@pytest.fixture(scope="module")
def base_llm():
    from kvpilot.server import LLM

    return LLM(num_threads=1, show_progress=False, max_num_seqs=64)


@pytest.fixture(scope="module")
def base_outputs(base_llm):
    """The subset, the other kinds and plain rows, greedy and seeded, on the plain synchronous engine."""
    requests = json_requests(base_llm, SUBSET) + json_requests(base_llm, SUBSET, temperature=0.8, seed=3) + other_requests(base_llm) + plain_requests(base_llm)
    return generate(base_llm, requests)


@pytest.mark.timeout(400)
def test_json_corpus_in_mixed_batches_with_gguf_weights(capsys, row_invariant_gguf_kernels):
    """The whole corpus, greedy and seeded (a seed per schema), in one batch with unconstrained rows: every output the
    schema ended validates, >= 90% end by the schema, and the unconstrained rows' tokens are those
    they get without constrained neighbours."""
    from kvpilot.server import LLM

    llm = LLM(num_threads=1, show_progress=False, quantization="gguf", max_num_seqs=128)
    greedy, sampled = json_requests(llm, SCHEMAS), json_requests(llm, SCHEMAS, temperature=0.8, seed=7)
    outs = generate(llm, greedy + sampled + plain_requests(llm))
    n = len(SCHEMAS)
    ended = [check_json(outs[:n], SCHEMAS), check_json(outs[n:2 * n], SCHEMAS)]
    with capsys.disabled():
        print(f"\nstructured outputs, {n} schemas, gguf weights: ended by the schema greedy {ended[0]}/{n}, sampled {ended[1]}/{n}")
    assert min(ended) >= 0.9 * n
    alone = generate(llm, plain_requests(llm))
    assert [o.token_ids for (o,) in outs[2 * n:]] == [o.token_ids for (o,) in alone]


def test_other_constraints_and_seeds_alone_and_batched(base_llm, base_outputs):
    check_json(base_outputs[:10], SUBSET)
    check_json(base_outputs[10:20], SUBSET)
    check_others(base_outputs[20:20 + OTHERS])
    # Sampled: the kinds again, seeded; a seeded constrained request alone draws what it drew in the batch.
    check_others(generate(base_llm, other_requests(base_llm, temperature=0.9, seed=11)))
    alone = generate(base_llm, json_requests(base_llm, SUBSET[:3], temperature=0.8, seed=3))
    assert [o.token_ids for (o,) in alone] == [o.token_ids for (o,) in base_outputs[10:13]]


def test_n_greater_than_one_gives_each_sequence_its_own_matcher(base_llm):
    (q, schema), = SCHEMAS[:1]
    (out,) = base_llm.generate([chat(base_llm, q)], [params(n=3, temperature=1.0, seed=5, structured=structured("json", schema))])
    assert len(out.outputs) == 3 and len({o.text for o in out.outputs}) > 1
    check_json([[o] for o in out.outputs], [(q, schema)] * 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_args", [dict(speculative_method="ngram", num_speculative_tokens=3),
                                         dict(async_scheduling="on"),
                                         dict(max_num_batched_tokens=16, block_size=8, kv_cache_memory=21 * 368640)],
                         ids=["ngram", "async", "chunked+preempting"])
def test_other_engine_modes_give_the_same_outputs(base_llm, base_outputs, engine_args):
    """Greedy rows give the plain engine's tokens exactly, under speculation (drafts masked row by
    row), async scheduling (steps stop overlapping while a constrained row runs), and 16-token
    chunked prefill with a KV cache small enough to preempt; seeded rows still match their constraint."""
    from kvpilot.server import LLM

    llm = LLM(num_threads=1, show_progress=False, max_num_seqs=64, **engine_args)
    # Seeded rows only where they meet something new (random rows' verification under masks).
    sampled = json_requests(llm, SUBSET, temperature=0.8, seed=3) if "speculative_method" in engine_args else []
    outs = generate(llm, json_requests(llm, SUBSET) + other_requests(llm) + plain_requests(llm) + sampled)
    same_as_base = base_outputs[:10] + base_outputs[20:]  # the greedy subset, the other kinds, the plain rows
    assert [o.token_ids for (o,) in outs[:len(same_as_base)]] == [o.token_ids for (o,) in same_as_base]
    check_json(outs[len(same_as_base):], SUBSET[:len(sampled)])
    if "speculative_method" in engine_args:
        assert llm.engine.proposer.stats.num_accepted_tokens > 0
    if "kv_cache_memory" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_compile_errors_are_request_rejections_naming_the_field(base_llm):
    from kvpilot.server.engine.limits import RequestRejected
    from kvpilot.server.engine.sampling_params import StructuredOutput

    cases = [(StructuredOutput("json", {"type": "objectx"}, "response_format"), "objectx"),
             (StructuredOutput("json", {"type": "object", "if": {}}, "guided_json"), "if"),
             (StructuredOutput("regex", "(ab", "guided_regex"), "unclosed group"),
             (StructuredOutput("grammar", "start: foo", "structured_outputs"), "unknown name"),
             (StructuredOutput("grammar", 'root ::= "a" | (', "structured_outputs"), "Expected ')'"),
             (StructuredOutput("grammar", "root ::= other", "guided_grammar"), "'other' not found")]
    for spec, needle in cases:
        with pytest.raises(RequestRejected, match=re.escape(needle)) as e:
            base_llm.engine.add_request("x", params(structured=spec))
        assert e.value.param == spec.param
    grammars = base_llm.engine.grammars
    hits = grammars.cache_hits
    base_llm.engine.grammars.compile(StructuredOutput("json", {"b": 1, "a": {"type": "string"}} | {"type": "object"}))
    base_llm.engine.grammars.compile(StructuredOutput("json", {"type": "object", "a": {"type": "string"}, "b": 1}))
    assert grammars.cache_hits == hits + 1  # the same schema, keys in another order: one entry
    assert len(grammars.cache) <= grammars.cache_size


# --- HTTP -------------------------------------------------------------------------------------


def test_openai_client_parse_returns_the_pydantic_object(constrained_client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=100)

    completion = constrained_client.chat.completions.parse(model="smollm2-135m", messages=[{"role": "user", "content": "Describe Paris in JSON."}],
                                               response_format=City, temperature=0, max_tokens=80)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[4][1], "strict": True}}},
    {"structured_outputs": {"regex": REGEX}},
    {"guided_choice": CHOICES},
    {"structured_outputs": {"grammar": GBNF}},
    {"guided_json": json.dumps(SCHEMAS[0][1])},
])
def test_streamed_equals_non_streamed_and_matches(constrained_server, constraint):
    body = {"messages": [{"role": "user", "content": "Answer in the required format."}], "temperature": 0, "max_tokens": 60, **constraint}
    whole = httpx.post(constrained_server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    text, reason = "", None
    with httpx.stream("POST", constrained_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content", "")
                reason = choice["finish_reason"] or reason
    assert (text, reason) == (whole["message"]["content"], whole["finish_reason"]) and reason == "stop"
    # Completions take the same fields.
    done = httpx.post(constrained_server.url + "/v1/completions", json={"prompt": "Answer:", "temperature": 0, "max_tokens": 60, **constraint},
                      timeout=60).json()["choices"][0]
    assert done["finish_reason"] in ("stop", "length")
    if "guided_choice" in constraint:
        assert done["text"] in CHOICES and text in CHOICES


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"json": {"type": "object", "if": {}}}}, "structured_outputs", "Unimplemented keys"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"lark": "start: x"}}, "structured_outputs.lark", "unknown parameter"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one output constraint"),
    ({"guided_json": [1, 2]}, "guided_json", None),
])
def test_bad_constraints_are_400s_naming_the_field(constrained_server, body, param, needle):
    r = httpx.post(constrained_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert needle is None or needle in err["message"], err


def test_a_grammar_past_the_librarys_limits_is_a_400_in_bounded_time_and_the_server_goes_on(constrained_server):
    started = time.monotonic()
    r = httpx.post(constrained_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "guided_json": {"enum": [f"v{i}" for i in range(100000)]}},
                   timeout=60)
    assert r.status_code == 400 and "too big" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < 10
    assert httpx.get(constrained_server.url + "/health").status_code == 200
    ok = httpx.post(constrained_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "guided_choice": ["a", "b"]}, timeout=60).json()
    assert ok["choices"][0]["text"] in ("a", "b")


def test_metrics_count_constrained_requests_compiles_and_cache_hits(constrained_server):
    for _ in range(2):
        httpx.post(constrained_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_regex": "[ab]{3}"}, timeout=60).raise_for_status()
    text = httpx.get(constrained_server.url + "/metrics").text
    value = lambda name: float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))  # noqa: E731
    assert value('kvpilot:structured_output_requests_total{kind="regex",model_name="smollm2-135m"}') >= 2
    assert value("kvpilot:structured_output_grammar_cache_hits_total") >= 1
    assert value("kvpilot:structured_output_compile_seconds_count") >= 1


def test_logit_bias_moves_only_its_own_rows(base_llm):
    """+100 on one token makes greedy decoding emit only it; -100 on the unbiased first token makes
    another come first; an unbiased neighbour in the same batch is unchanged."""
    prompt = "The capital of France is"
    (plain,) = generate(base_llm, [(prompt, params(max_tokens=6))])
    first = plain[0].token_ids[0]
    forced, banned, neighbour = generate(base_llm, [(prompt, params(max_tokens=6, logit_bias={42: 100.0})),
                                                    (prompt, params(max_tokens=6, logit_bias={first: -100.0})),
                                                    (prompt, params(max_tokens=6))])
    assert forced[0].token_ids == [42] * 6
    assert banned[0].token_ids[0] != first
    assert neighbour[0].token_ids == plain[0].token_ids


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_sample_under_rank_zeros_masks():
    """Three ranks: rank 0 builds and applies the masks where it samples; the others only run the model."""
    from kvpilot.server import LLM

    llm = LLM(num_threads=1, show_progress=False, tensor_parallel_size=3, kv_cache_memory="64MiB")
    try:
        outs = generate(llm, json_requests(llm, SUBSET[:3]) + other_requests(llm))
        assert check_json(outs[:3], SUBSET[:3]) == 3
        check_others(outs[3:])
    finally:
        llm.engine.close()
