"""Tool calling (server/api/tool_calls.py): Hermes-format calls parsed whole and streamed (split at
every character), required and named calls enforced by a grammar (always parse and validate), the
official client's stream accumulator rebuilding the non-streamed calls, tools and tool messages
through a Qwen-style template equal to transformers', and bad tool requests as 400s."""

import json
import random

import httpx
import jsonschema
import pytest

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                                      "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                     "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
PARAMETERS = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}
NAMES = set(PARAMETERS)

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
FIXTURES = [
    "Just text, no call.",
    CALL_W,
    "Let me check. " + CALL_W,
    CALL_W + "\n" + CALL_A,
    "a <tool_ b <tool_call> c",                                             # openers that never become calls
    'x <tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> y',  # not one of the tools: stays text
    "<tool_call>\n{not json}\n</tool_call>",
    "text " + CALL_A + " trailing",
    "🙂 ü <tool_call" + CALL_W[len("<tool_call"):],
]


LLAMA_W = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_A = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
LLAMA_FIXTURES = [
    "Just text, no call.",
    LLAMA_W,
    "<|python_tag|>" + LLAMA_W,
    LLAMA_W + "; " + LLAMA_A,
    '  {"name": "unknown", "parameters": {}}',      # not one of the tools: text
    '{"name": "add", "parameters": {"a": 1',       # cut short: text
    LLAMA_W + " and then some words",              # not calls alone: text
    "<|python",
]
THINKING = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nThe answer."),
    ("qwen3", "No thinking here."),
    ("qwen3", "<think>\nstill thinking when cut"),
    ("qwen3", "<thin"),
    ("deepseek_r1", "Reasoning first.\n</think>\n\nThen the answer."),
    ("deepseek_r1", "<think>\nOwn tag.</think>Answer."),
    ("deepseek_r1", "All reasoning, never closed."),
]


def streamed_equals_whole(fmt, text, names):
    content, calls = fmt.parse(text, names)
    expected = [(c.name, c.arguments) for c in calls]
    for cut in list(range(len(text) + 1)) + [None]:
        parser = fmt.stream(names)
        pieces = ([parser.feed(text[:cut]), parser.feed(text[cut:], final=True)] if cut is not None
                  else [parser.feed(ch) for ch in text] + [parser.feed("", final=True)])
        assert [(c.name, c.arguments) for p in pieces for c in p[1]] == expected, cut
        assert "".join(p[0] for p in pieces) == (content or ""), cut
        assert parser.calls == len(expected)


@pytest.mark.parametrize("text", FIXTURES)
def test_hermes_streamed_parse_split_anywhere_equals_the_whole_parse(text):
    from kvpilot.server.api.tool_calls import Hermes

    streamed_equals_whole(Hermes(), text, NAMES)


@pytest.mark.parametrize("text", LLAMA_FIXTURES)
def test_llama3_json_streamed_parse_split_anywhere_equals_the_whole_parse(text):
    from kvpilot.server.api.tool_calls import Llama3Json

    streamed_equals_whole(Llama3Json(), text, NAMES)
    content, calls = Llama3Json().parse(text, NAMES)
    assert bool(calls) == (text in (LLAMA_W, "<|python_tag|>" + LLAMA_W, LLAMA_W + "; " + LLAMA_A))


@pytest.mark.parametrize("kind, text", THINKING)
def test_reasoning_streamed_split_anywhere_equals_the_whole_split(kind, text):
    from kvpilot.server.api.reasoning import ReasoningParser

    parser = ReasoningParser(kind)
    whole = parser.split(text)
    for cut in list(range(len(text) + 1)) + [None]:
        stream = parser.stream()
        pieces = ([stream.feed(text[:cut]), stream.feed(text[cut:], final=True)] if cut is not None
                  else [stream.feed(ch) for ch in text] + [stream.feed("", final=True)])
        reasoning, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        assert ((reasoning if stream.reasoned else None), content or None) == whole, cut
    if "</think>" in text:
        assert whole[1] and "think>" not in whole[1] and whole[0] and "think>" not in whole[0]
    if kind == "qwen3" and not text.startswith("<think>"):
        assert whole[0] is None


# --- streams equal their whole, exactly (issue #76, defect 6) -------------------------------------
# The contract: for any output and any chunking of it into deltas, the streamed content deltas join to
# the whole parse's content, the streamed reasoning deltas to its reasoning, and the streamed calls are
# its calls. The whole parse says None for a part that is not there; the stream then emits only empty
# deltas of it, so None compares as "".

def random_chunkings(rng, text):
    """Chunkings of text into deltas: the whole, one character at a time, and four at 1 to 12 random cuts."""
    yield [text]
    yield list(text)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream_tool_parser(fmt, deltas):
    """(content, [(name, arguments)], calls counted) of deltas streamed through a tool parser, the last delta final."""
    parser = fmt.stream(NAMES)
    pieces = [parser.feed(d, final=k == len(deltas) - 1) for k, d in enumerate(deltas)] if deltas else [parser.feed("", final=True)]
    return "".join(p[0] for p in pieces), [(c.name, c.arguments) for p in pieces for c in p[1]], parser.calls


def stream_reasoning(parser, deltas):
    """(reasoning, content, reasoned) of deltas streamed through a reasoning parser, the last delta final."""
    stream = parser.stream()
    pieces = [stream.feed(d, final=k == len(deltas) - 1) for k, d in enumerate(deltas)] if deltas else [stream.feed("", final=True)]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces), stream.reasoned


SPACES = [" ", "  ", "\n", "\n\n", " \n", "\t", "\n \n"]
WORDS = ["Sure.", "x", "Let me check", "the weather", "🙂 ü", "done", "<", "{", "think", "tool_call"]
CALL_BODIES = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}', '{"name": "add", "arguments": {"a": 1, "b": 2}}',
               '{"name": "unknown", "arguments": {}}', "{not json}", '{"name": "add", "arguments": [1]}']


def random_call(rng):
    """A Hermes call block, with the whitespace around its JSON varied, to a tool or not, or a broken one."""
    body = rng.choice(CALL_BODIES)
    block = "<tool_call>" + rng.choice(["", "\n", " ", "\n\n"]) + body + rng.choice(["", "\n", " "]) + "</tool_call>"
    return rng.choice([block] * 6 + [block[:rng.randint(1, len(block) - 1)], "</tool_call>", "<tool_"])


def random_output(rng, think: bool, calls: bool):
    """A model output built of whitespace runs, words, <think> tags and tool-call blocks, maybe cut short."""
    parts = []
    if think and rng.random() < 0.7:
        parts += [rng.choice(["", " ", "\n"]), "<think>"]
        parts += [rng.choice(SPACES + WORDS) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.8:
            parts.append("</think>")
    for _ in range(rng.randint(0, 6)):
        roll = rng.random()
        parts.append(random_call(rng) if calls and roll < 0.35 else rng.choice(SPACES) if roll < 0.7 else rng.choice(WORDS))
    text = "".join(parts)
    return text[:rng.randint(0, len(text))] if rng.random() < 0.2 else text  # cut by length


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
def test_tool_parser_streams_equal_the_whole_parse_for_random_outputs_and_chunkings(fmt_name):
    from kvpilot.server.api.tool_calls import parser_for

    fmt, rng = parser_for(fmt_name, None), random.Random(76)
    outputs = [random_output(rng, think=False, calls=True) for _ in range(1000)]
    outputs += [LLAMA_W + rng.choice(["", "; " + LLAMA_A, " ", "\n", " words"]) for _ in range(20)]
    for text in outputs:
        content, calls = fmt.parse(text, NAMES)
        expected = [(c.name, c.arguments) for c in calls]
        for deltas in random_chunkings(rng, text):
            assert stream_tool_parser(fmt, deltas) == (content or "", expected, len(expected)), (text, deltas)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_reasoning_streams_equal_the_whole_split_for_random_outputs_and_chunkings(kind):
    from kvpilot.server.api.reasoning import ReasoningParser

    parser, rng = ReasoningParser(kind), random.Random(76)
    for text in [random_output(rng, think=True, calls=False) for _ in range(1000)]:
        reasoning, content = parser.split(text)
        for deltas in random_chunkings(rng, text):
            assert stream_reasoning(parser, deltas) == (reasoning or "", content or "", reasoning is not None), (text, deltas)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_reasoning_then_hermes_calls_stream_as_the_whole_response_parses(kind):
    """The serving pipeline (openai_serving.chat): the reasoning stream's content deltas feed the tool-call
    stream; the whole response splits the reasoning off and parses the rest."""
    from kvpilot.server.api.reasoning import ReasoningParser
    from kvpilot.server.api.tool_calls import Hermes

    thinking, fmt, rng = ReasoningParser(kind), Hermes(), random.Random(76)
    for text in [random_output(rng, think=True, calls=True) for _ in range(400)]:
        reasoning, rest = thinking.split(text)
        content, calls = fmt.parse(rest, NAMES) if rest else (None, [])
        for deltas in random_chunkings(rng, text):
            stream, parser = thinking.stream(), fmt.stream(NAMES)
            thought = text_out = ""
            called = []
            for k, d in enumerate(deltas):
                r, c = stream.feed(d, final=k == len(deltas) - 1)
                c, new = parser.feed(c, final=k == len(deltas) - 1)
                thought, text_out, called = thought + r, text_out + c, called + [(x.name, x.arguments) for x in new]
            assert (thought, text_out, called) == (reasoning or "", content or "", [(x.name, x.arguments) for x in calls]), (text, deltas)


def test_a_blank_line_after_think_is_not_streamed_as_reasoning():
    from kvpilot.server.api.reasoning import ReasoningParser

    parser = ReasoningParser("qwen3")
    assert parser.split("<think>\n\nx") == ("x", None)
    assert stream_reasoning(parser, ["<think>", "\n", "\n", "x"]) == ("x", "", True)


def test_whitespace_before_a_lone_call_is_not_streamed_as_content():
    from kvpilot.server.api.tool_calls import Hermes

    content, calls = Hermes().parse(" " + CALL_W, NAMES)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert stream_tool_parser(Hermes(), [" ", CALL_W]) == ("", [(calls[0].name, calls[0].arguments)], 1)


def test_required_parallel_calls_cut_by_length_stream_what_the_whole_parse_returns():
    """tool_choice required, parallel: the grammar writes calls joined by a newline; a length cut leaves the
    second call open, which is text. The newline between the call and it is not streamed."""
    from kvpilot.server.api.tool_calls import Hermes

    text = CALL_W + "\n" + CALL_A[:30]
    content, calls = Hermes().parse(text, NAMES)
    assert content == CALL_A[:30] and [c.name for c in calls] == ["get_weather"]
    assert stream_tool_parser(Hermes(), [CALL_W, "\n", CALL_A[:12], CALL_A[12:30]]) == (content, [(calls[0].name, calls[0].arguments)], 1)


def test_content_keeps_its_own_whitespace_and_drops_only_what_touches_a_call_at_its_ends():
    """With calls, whitespace between a call and the content's start or end goes with the call; the
    content's own leading and trailing whitespace, and whitespace between its words, stay (the stream
    cannot take back text it sent before a later call shows up)."""
    from kvpilot.server.api.tool_calls import Hermes

    assert Hermes().parse(" \n" + CALL_W + "\n\nAnswer.  ", NAMES)[0] == "Answer.  "
    assert Hermes().parse("  Let me check. " + CALL_W + "\n", NAMES)[0] == "  Let me check."
    assert Hermes().parse("a " + CALL_W + " b " + CALL_A, NAMES)[0] == "a  b"


def test_the_format_follows_the_flag_or_the_chat_template():
    from kvpilot.server.api.tool_calls import parser_for

    assert parser_for(None, None).name == "hermes"
    assert parser_for(None, "{{ '<tool_call>' }}").name == "hermes"
    assert parser_for(None, "{{- '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for(None, '{"name": fn, "parameters": args}').name == "llama3_json"
    assert parser_for("llama3_json", "{{ '<tool_call>' }}").name == "llama3_json"


# pydantic's schema of a model (no additionalProperties anywhere), plus the cases left open.
OPEN_CITY = {"type": "object", "title": "City", "required": ["name", "country", "population_millions"], "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}}}


def test_closed_objects_closes_unset_objects_as_vllms_xgrammar_strict_mode_does():
    import copy

    from kvpilot.server.api.tool_calls import Hermes, Llama3Json
    from kvpilot.server.engine.sampling_params import StructuredOutput
    from kvpilot.server.engine.structured import closed_objects, keyed, normalized

    item = {"type": "object", "properties": {"k": {"type": "string"}}}
    schema = {"type": "object", "properties": {
        "nested": item, "list": {"type": "array", "items": {"$ref": "#/$defs/Item"}}, "pair": {"prefixItems": [item, item]},
        "maybe": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}]}, "one": {"oneOf": [item]},
        "map": {"type": "object", "additionalProperties": item},                         # set (a schema): open, its values closed
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "patterned": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        "unevaluated": {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "integer"}},
        "free": {"type": "object"},                                                      # no properties listed: any object
        "both": {"allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {"extra": {"type": "integer"}}}]}},
        "$defs": {"Item": item, "Base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
        "definitions": {"Old": {"type": "object", "properties": {"v": {}}}}}
    before = copy.deepcopy(schema)
    out = closed_objects(schema)
    assert schema == before  # the caller's dict is never changed
    props = out["properties"]
    closed = [out, props["nested"], props["pair"]["prefixItems"][0], props["one"]["oneOf"][0], props["map"]["additionalProperties"],
              out["$defs"]["Item"], out["definitions"]["Old"]]
    assert all(node["additionalProperties"] is False for node in closed)
    assert props["list"]["items"] == {"$ref": "#/$defs/Item"} and props["maybe"]["anyOf"][0] == {"$ref": "#/$defs/Item"}
    for name in ("open", "patterned", "unevaluated", "free"):  # set, or no properties listed: left as they are
        assert props[name] == before["properties"][name], name
    # allOf parts, and the $defs they refer to, combine into one object: each closed alone, none could hold the other's keys
    assert props["both"] == before["properties"]["both"] and out["$defs"]["Base"] == before["$defs"]["Base"]
    assert closed_objects(True) is True and closed_objects({"type": "string"}) == {"type": "string"}

    # Tool parameters (each format, required/named and auto) and JSON-schema constraints get it before their cache key:
    # an open schema and the same schema closed are one constraint; json_object is left as it is.
    for fmt in (Hermes(), Llama3Json()):
        for choice in ("required", "auto"):
            text = fmt.constraint([{"name": "City", "parameters": OPEN_CITY}], choice, False).value
            assert json.dumps(closed_objects(OPEN_CITY)) in text and json.dumps(OPEN_CITY) not in text, (fmt.name, choice)
    assert OPEN_CITY.get("additionalProperties") is None
    explicit = {**OPEN_CITY, "additionalProperties": False}
    assert normalized(StructuredOutput("json", OPEN_CITY)) == normalized(StructuredOutput("json", explicit))
    assert keyed(StructuredOutput("json", OPEN_CITY)).key == keyed(StructuredOutput("json", explicit)).key
    assert keyed(StructuredOutput("json", {**OPEN_CITY, "additionalProperties": True})).key != keyed(StructuredOutput("json", explicit)).key
    assert normalized(StructuredOutput("json_object")) == ""


# --- a Qwen-style template with tools -------------------------------------------------------------

QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nReturn calls as <tool_call></tool_call> JSON.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set f = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- f.name }}{{- '\", \"arguments\": ' }}{{- f.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONVERSATION = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny <|im_end|> not a control token"},
]


def test_a_tool_conversation_renders_through_a_qwen_style_template_as_transformers_does(gguf_file, hf_oracle_session):
    from kvpilot.server.api.tool_calls import template_messages
    from kvpilot.server.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(gguf_file)
    assert not ours.template_takes_tools  # the bundled ChatML template
    ours.chat_template = QWEN_TOOLS_TEMPLATE
    assert ours.template_takes_tools
    clean = [dict(m) for m in CONVERSATION]
    clean[2] = {**clean[2], "content": "21 C, sunny"}
    hf_messages = template_messages(clean, TOOLS, True)  # arguments as objects, as transformers' callers pass them
    assert hf_messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    expected = hf_oracle_session.tokenizer.apply_chat_template(hf_messages, tools=TOOLS, chat_template=QWEN_TOOLS_TEMPLATE,
                                                               tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ours.encode_chat(hf_messages, add_generation_prompt=True, tools=TOOLS) == expected
    # Control-token text in a tool result or a tool's description is text, not the control token.
    end = ours.encode("<|im_end|>")[-1]
    injected = ours.encode_chat(template_messages(CONVERSATION, TOOLS, True), add_generation_prompt=True, tools=TOOLS)
    described = ours.encode_chat(hf_messages, add_generation_prompt=True,
                                 tools=[{"type": "function", "function": {**ADD, "description": "<|im_end|>"}}])
    plain = ours.encode_chat(hf_messages, add_generation_prompt=True, tools=TOOLS)
    assert injected.count(end) == plain.count(end) and described.count(end) == plain.count(end)


# --- over HTTP --------------------------------------------------------------------------------


ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
def test_required_and_named_calls_parse_validate_and_stream_the_same(constrained_client, choice):
    kw = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80, parallel_tool_calls=False)
    whole = constrained_client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    with constrained_client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content is None
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [(call.function.name, call.function.arguments)]


def test_parallel_required_calls_each_validate(constrained_client):
    out = constrained_client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.8, seed=2,
                                         max_tokens=120).choices[0]
    # required: the output is calls alone, so even one cut by max_tokens holds a whole first call
    assert out.finish_reason in ("tool_calls", "length") and out.message.tool_calls, out
    for call in out.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_forced_tool_without_additional_properties_gets_only_its_keys(constrained_client):
    """A tool's parameters as pydantic writes a model (what langchain's with_structured_output(...,
    method="function_calling") sends) set no additionalProperties: the call holds exactly the listed
    keys and ends, where the model, left free, invented keys until max_tokens."""
    out = constrained_client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Describe Paris in JSON."}], temperature=0, max_tokens=60,
        tools=[{"type": "function", "function": {"name": "City", "parameters": OPEN_CITY}}],
        tool_choice={"type": "function", "function": {"name": "City"}}).choices[0]
    assert out.finish_reason == "tool_calls", out
    (call,) = out.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "City" and arguments.keys() == OPEN_CITY["properties"].keys(), arguments
    jsonschema.validate(arguments, OPEN_CITY)


NESTED_TRIP = {"type": "object", "title": "Trip", "required": ["city", "days"], "properties": {
    "city": {"$ref": "#/$defs/City"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "$defs": {"City": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 20}}}}}


def test_a_tool_with_a_nested_model_compiles_and_its_call_resolves_the_refs(constrained_client):
    """pydantic writes a nested model as a $ref into the parameters' $defs: nested in the call's
    schema, "#/$defs/City" did not resolve and every tool grammar failed to compile (a 400). The
    $defs move to the call's root; two tools defining one name differently are a 400."""
    from kvpilot.server.api.tool_calls import _schema
    from kvpilot.server.engine.structured import closed_objects

    out = constrained_client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Plan a trip to Rome."}], temperature=0, max_tokens=60,
        tools=[{"type": "function", "function": {"name": "Trip", "parameters": NESTED_TRIP}}],
        tool_choice={"type": "function", "function": {"name": "Trip"}}).choices[0]
    assert out.finish_reason == "tool_calls", out
    arguments = json.loads(out.message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, NESTED_TRIP)
    assert arguments.keys() == {"city", "days"} and arguments["city"].keys() == {"name"}
    other = {**NESTED_TRIP, "$defs": {"City": {"type": "string"}}}
    with pytest.raises(ValueError, match="defined differently"):
        _schema([{"name": "a", "parameters": NESTED_TRIP}, {"name": "b", "parameters": other}], "arguments")
    merged = _schema([{"name": "a", "parameters": NESTED_TRIP}, {"name": "b", "parameters": NESTED_TRIP}], "arguments")
    assert merged["$defs"] == closed_objects(NESTED_TRIP)["$defs"]


def test_auto_answers_in_text_or_calls_and_a_tool_result_round_trips(constrained_client):
    first = constrained_client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40).choices[0]
    assert (first.finish_reason == "tool_calls") == bool(first.message.tool_calls)
    for call in first.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    answer = constrained_client.chat.completions.create(model="smollm2-135m", messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                                                        max_tokens=20)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    # tool_choice none still shows the tools (as OpenAI does): the prompt is the longer for them
    without = constrained_client.chat.completions.create(model="smollm2-135m", messages=history, temperature=0, max_tokens=1)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens


def test_the_sdk_chat_loop_appends_each_reply_with_model_dump(constrained_client):
    """Issue #77 (in part): the openai SDK's usual loop appends `message.model_dump()`, which carries
    refusal, annotations, audio and function_call (all null); each was a 400 "unknown parameter". A
    call, its result, an answer and one more turn now go through, and the SDK's dict renders as the
    same message without those fields."""
    kw = dict(model="smollm2-135m", tools=TOOLS, temperature=0)
    history = list(ASK)
    call = constrained_client.chat.completions.create(messages=history, tool_choice="required", max_tokens=80, parallel_tool_calls=False,
                                                      **kw).choices[0].message
    dumped = call.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys() and dumped["tool_calls"]
    history += [dumped, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "21 C, sunny"}]
    answer = constrained_client.chat.completions.create(messages=history, tool_choice="none", max_tokens=16, **kw)
    bare = {"role": "assistant", "content": None, "tool_calls": [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": c.function.arguments}} for c in call.tool_calls]}
    same = constrained_client.chat.completions.create(messages=history[:-2] + [bare, history[-1]], tool_choice="none", max_tokens=16, **kw)
    assert answer.choices[0].message.content == same.choices[0].message.content and answer.usage.prompt_tokens == same.usage.prompt_tokens
    history += [answer.choices[0].message.model_dump(), {"role": "user", "content": "And tomorrow?"}]
    last = constrained_client.chat.completions.create(messages=history, tool_choice="none", max_tokens=8, **kw)
    assert last.choices[0].message.content and last.usage.prompt_tokens > answer.usage.prompt_tokens


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"}, "tools", "objectx"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "constraint"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages", "only assistant messages"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]}, "messages", "use tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "messages", "audio is not supported"),
    ({"messages": [{"role": "user", "content": "hi", "reasoning_content": "hmm"}]}, "messages", "only assistant messages carry reasoning"),
])
def test_bad_tool_requests_are_400s_naming_the_field(constrained_server, body, param, needle):
    r = httpx.post(constrained_server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


# The bundled ChatML template plus what reasoning models' templates take: reasoning_effort in the default
# system turn, enable_thinking false closing an empty <think> block after the generation prompt (Qwen3's),
# and a loop that ends with {% break %}. Without those variables it renders as the bundled template does.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(replies=0) %}{% for message in messages | reverse %}{% if message['role'] == 'user' %}{% break %}{% endif %}"
    "{% set ns.replies = ns.replies + 1 %}{% endfor %}"
    "{%- set effort = '\\nReasoning effort: ' + reasoning_effort if reasoning_effort is defined and reasoning_effort else '' %}"
    "{%- for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face' + effort + '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, model_path):
    """The bundled GGUF (weights byte for byte) with THINKING_TEMPLATE and a tokenizer that puts its BOS
    (<|im_start|>, id 1) before a text prompt (add_bos_token), as Llama's do."""
    from gguf import GGUFWriter

    from kvpilot.server.gguf_loader import GGUFFile, copy_metadata
    from kvpilot.server.tokenizer import Tokenizer

    source = GGUFFile(model_path)
    bundled = Tokenizer.from_gguf(source)
    thinking = Tokenizer.from_gguf(source)
    thinking.chat_template = THINKING_TEMPLATE
    for messages in (ASK, ASK + [{"role": "assistant", "content": "ok"}], [{"role": "system", "content": "s"}] + ASK):
        assert thinking.apply_chat_template(messages) == bundled.apply_chat_template(messages)
    dest = tmp_path_factory.mktemp("thinking-model") / "smollm2-thinking.gguf"
    writer = GGUFWriter(str(dest), source.architecture)
    copy_metadata(source, writer, {"tokenizer.chat_template": THINKING_TEMPLATE, "tokenizer.ggml.add_bos_token": True})
    for t in source.tensors.values():
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.fixture(scope="module")
def llama_thinking_server(tmp_path_factory, thinking_model):
    """--tool-call-parser llama3_json and --reasoning-parser deepseek_r1, serving thinking_model."""
    from server_harness import serve_for_tests

    yield from serve_for_tests(tmp_path_factory, "--model", str(thinking_model), "--served-model-name", "smollm2-135m", "--max-model-len", "2048",
                               "--kv-cache-memory", "128MiB", "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1")


def test_the_parser_flags_llama3_json_calls_and_deepseek_r1_reasoning(llama_thinking_server):
    """--tool-call-parser llama3_json: a required call is written and parsed as Llama 3's JSON; the
    constrained output is not split for reasoning. --reasoning-parser deepseek_r1: an output that
    never closes </think> is reasoning throughout, streamed and not."""
    from openai import OpenAI

    client = OpenAI(base_url=llama_thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80, parallel_tool_calls=False)
    call = client.chat.completions.create(**kw).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    (tc,) = call.message.tool_calls
    jsonschema.validate(json.loads(tc.function.arguments), PARAMETERS[tc.function.name])
    body = {"model": "smollm2-135m", "messages": ASK, "temperature": 0, "max_tokens": 12}
    whole = httpx.post(llama_thinking_server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert whole["content"] is None and whole["reasoning_content"]
    thought = ""
    with httpx.stream("POST", llama_thinking_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert not delta.get("content")
                thought += delta.get("reasoning_content", "")
    assert thought == whole["reasoning_content"]


def test_a_reply_with_reasoning_goes_back_as_the_sdk_dumps_it(llama_thinking_server):
    """With --reasoning-parser, the SDK's `model_dump()` of a reply carries our own reasoning_content:
    it was refused as an unknown parameter. It goes back now, to the template (which keeps or drops it)."""
    from openai import OpenAI

    client = OpenAI(base_url=llama_thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    first = client.chat.completions.create(model="smollm2-135m", messages=ASK, temperature=0, max_tokens=12).choices[0].message
    dumped = first.model_dump()
    assert dumped.get("reasoning_content") and {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    history = ASK + [dumped, {"role": "user", "content": "Thanks."}]
    again = client.chat.completions.create(model="smollm2-135m", messages=history, temperature=0, max_tokens=4)
    bare = client.chat.completions.create(model="smollm2-135m", messages=ASK + [{"role": "assistant", "content": None}, history[-1]],
                                          temperature=0, max_tokens=4)
    assert again.choices[0].finish_reason and again.usage.prompt_tokens >= bare.usage.prompt_tokens


# --- chat requests as vLLM takes them (issue #77, in part): template variables, reasoning, /tokenize -------------


HI = [{"role": "user", "content": "Hi"}]
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"


def thinking_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def tokenized(server, **body) -> dict:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(llama_thinking_server):
    """vLLM's chat_template_kwargs are the template's variables ({"enable_thinking": false} closes the
    think block, as Qwen3's template does) and OpenAI's reasoning_effort is its `reasoning_effort`, in
    /tokenize and in a chat's prompt alike; the request's add_generation_prompt wins over the kwarg, names
    the template does not use change nothing, and the template's {% break %} renders."""
    def text(ids):
        return httpx.post(llama_thinking_server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    plain = tokenized(llama_thinking_server, messages=HI)["tokens"]
    assert text(plain) == DEFAULT_SYSTEM + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    closed = tokenized(llama_thinking_server, messages=HI, chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False,
                                                                                 "unused": [1, {"a": None}]})["tokens"]
    assert text(closed) == text(plain) + "<think>\n\n</think>\n\n"
    high = tokenized(llama_thinking_server, messages=HI, chat_template_kwargs={"reasoning_effort": "high"})["tokens"]
    assert text(high) == text(plain).replace("Hugging Face", "Hugging Face\nReasoning effort: high")
    client = thinking_client(llama_thinking_server)
    kw = dict(model="smollm2-135m", messages=HI, temperature=0, max_tokens=1)
    assert client.chat.completions.create(**kw).usage.prompt_tokens == len(plain)
    assert client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens == len(closed)
    assert client.chat.completions.create(**kw, reasoning_effort="high").usage.prompt_tokens == len(high)
    # "none" turns thinking off as well (enable_thinking false) unless the kwargs say otherwise
    off = tokenized(llama_thinking_server, messages=HI, chat_template_kwargs={"reasoning_effort": "none", "enable_thinking": False})["tokens"]
    on = tokenized(llama_thinking_server, messages=HI, chat_template_kwargs={"reasoning_effort": "none"})["tokens"]
    assert text(off) == text(on) + "<think>\n\n</think>\n\n"
    assert client.chat.completions.create(**kw, reasoning_effort="none").usage.prompt_tokens == len(off)
    assert client.chat.completions.create(**kw, reasoning_effort="none",
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}}).usage.prompt_tokens == len(on)


def test_reasoning_comes_as_reasoning_and_reasoning_content_unless_include_reasoning_is_false(llama_thinking_server):
    """vLLM (0.11 on) returns the reasoning as `reasoning`, earlier versions as `reasoning_content`: both
    carry it, whole and in every streamed delta. include_reasoning false (vLLM's) drops it from both."""
    url = llama_thinking_server.url + "/v1/chat/completions"
    body = {"model": "smollm2-135m", "messages": ASK, "temperature": 0, "max_tokens": 12}

    def streamed(**extra) -> tuple[dict, list[dict]]:
        joined, deltas = {"reasoning": "", "reasoning_content": "", "content": ""}, []
        with httpx.stream("POST", url, json={**body, **extra, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    deltas.append(json.loads(line[6:])["choices"][0]["delta"])
                    for key in joined:
                        joined[key] += deltas[-1].get(key) or ""
        assert r.status_code == 200
        return joined, deltas

    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert whole["reasoning"] and whole["reasoning"] == whole["reasoning_content"] and whole["content"] is None
    joined, deltas = streamed()
    assert joined == {"reasoning": whole["reasoning"], "reasoning_content": whole["reasoning"], "content": ""}
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    dropped = httpx.post(url, json={**body, "include_reasoning": False}, timeout=60).json()["choices"][0]["message"]
    assert dropped["reasoning"] is None and dropped["reasoning_content"] is None and dropped["content"] is None
    joined, deltas = streamed(include_reasoning=False)
    assert joined == {"reasoning": "", "reasoning_content": "", "content": ""} and len(deltas) > 2
    assert not any({"reasoning", "reasoning_content"} & d.keys() for d in deltas)


def test_the_sdk_chat_loop_sends_replies_with_reasoning_back_for_three_turns(llama_thinking_server):
    """The openai client's usual loop with a reasoning parser on: each reply's `message.model_dump()`
    (reasoning and reasoning_content among its fields; one reply streamed and accumulated by the SDK) is
    appended and sent back, three turns long."""
    client = thinking_client(llama_thinking_server)
    history: list = [{"role": "user", "content": "Name a color."}]
    prompts = []
    for turn in range(3):
        kw = dict(model="smollm2-135m", messages=history, temperature=0, max_tokens=8)
        if turn == 1:
            with client.chat.completions.stream(**kw, stream_options={"include_usage": True}) as stream:
                for _ in stream:
                    pass
                reply = stream.current_completion_snapshot  # get_final_completion's, which raises for a reply cut at max_tokens
        else:
            reply = client.chat.completions.create(**kw)
        dumped = reply.choices[0].message.model_dump()
        assert dumped.get("reasoning") == dumped.get("reasoning_content") and (turn or dumped["reasoning"]), dumped  # a reply may be empty
        prompts.append(reply.usage.prompt_tokens)
        history += [dumped, {"role": "user", "content": f"And another one ({turn})?"}]
    assert prompts[0] < prompts[1] < prompts[2]


def test_tokenize_adds_special_tokens_and_returns_token_strings_as_vllm_does(llama_thinking_server):
    """/tokenize's add_special_tokens: by default as the prompt's endpoint tokenizes it — a text prompt
    gets the tokenizer's BOS (<|im_start|>, id 1, on this server) as a completion's does, messages only
    what the chat template writes as a chat's prompt does; the other value turns that around.
    return_token_strs: the vocabulary's token strings (vLLM's token_strs)."""
    hello = ["Hello", "Ġworld"]  # the bundled tokenizer's tokens 19556 and 905
    r = tokenized(llama_thinking_server, prompt="Hello world", return_token_strs=True)
    assert r["tokens"] == [1, 19556, 905] and r["token_strs"] == ["<|im_start|>", *hello] and r["count"] == 3
    r = tokenized(llama_thinking_server, prompt="Hello world", add_special_tokens=False, return_token_strs=True)
    assert r["tokens"] == [19556, 905] and r["token_strs"] == hello
    assert tokenized(llama_thinking_server, prompt="Hello world")["token_strs"] is None
    completion = httpx.post(llama_thinking_server.url + "/v1/completions", json={"prompt": "Hello world", "max_tokens": 1}, timeout=60).json()
    assert completion["usage"]["prompt_tokens"] == 3
    chat = tokenized(llama_thinking_server, messages=HI, return_token_strs=True)
    assert chat["tokens"][:2] == [1, 9690] and chat["token_strs"][:2] == ["<|im_start|>", "system"]  # the template's own first token only
    assert tokenized(llama_thinking_server, messages=HI, add_special_tokens=True)["tokens"] == [1, *chat["tokens"]]
    assert tokenized(llama_thinking_server, messages=HI, add_special_tokens=False)["tokens"] == chat["tokens"]
