"""Chat with tools (serving/tool_calls.py): histories with tool calls and tool results rendered
through the chat template exactly as transformers' apply_chat_template renders them (the outside
reference); a named or required tool_choice constrains the output to the functions' schemas
(jsonschema validates the arguments); tool_choice auto parses Hermes-style <tool_call> blocks; bad
tool fields are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from live_server import LiveServer, _post  # noqa: E402

from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.serving import tool_call_stream, tool_calls  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.chat import load_chat_template  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

MODEL = "demo-tools"
# A Hermes-style template (the layout of Qwen2.5's, in the demo's byte vocabulary): tools in a
# system turn, the assistant's calls as <tool_call> JSON, tool results in their own turns.
TEMPLATE = (
    "{%- if tools %}<|endoftext|>system:\nYou may call these functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{%- endif %}'
    "{%- for m in messages %}<|endoftext|>{{ m.role }}:\n"
    "{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|endoftext|>assistant:\n{%- endif %}")
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False}}}
HISTORY = [
    {"role": "system", "content": "You are a herald."},
    {"role": "user", "content": "Weather in Verona?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Verona", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "Fair, 21 degrees."},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random GPT-2 with the demo's byte tokenizer and a 2,048-token context (tool lists are
    long; the demo's context is 128), with the template in its tokenizer_config.json."""
    import torch
    import transformers

    from nanoserve.tokenizers import byte_level_tokenizer, save_hf_tokenizer, save_tiktoken

    path = tmp_path_factory.mktemp("tools") / MODEL
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=2048, vocab_size=257,
                                  bos_token_id=256, eos_token_id=256)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    save_tiktoken(byte_level_tokenizer(), path)
    save_hf_tokenizer(byte_level_tokenizer(), path, 2048, chat_template=TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    core = LLMEngine.from_kwargs(str(checkpoint), num_blocks=256)
    srv = LiveServer(
        create_app(
            AsyncLLMEngine(core), MODEL,
            chat_template=load_chat_template(checkpoint, core.tokenizer),
            tool_config=tool_calls.ToolCallConfig(True, "hermes"),
        )
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(checkpoint):
    """The same model without --enable-auto-tool-choice: tool_choice auto is a 400, as in vLLM."""
    core = LLMEngine.from_kwargs(str(checkpoint), num_blocks=64)
    srv = LiveServer(create_app(AsyncLLMEngine(core), MODEL,
                                chat_template=load_chat_template(checkpoint, core.tokenizer)))
    yield srv
    srv.stop()


def test_rendering_with_tools_equals_transformers(checkpoint):
    """The same template, messages and tools through transformers' apply_chat_template give the same
    text."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ours = load_chat_template(checkpoint)
    messages = tool_calls.for_template(HISTORY)
    for tools in ([WEATHER, TIME], None):
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True)
        assert ours.render(messages, True, None, tools) == want
    # the history's call, arguments as an object
    assert "<tool_call>" in want and '"city": "Verona"' in want


def _chat(server, **body):
    status, _, got = _post(server.port, "/v1/chat/completions",
                           {"model": MODEL, "messages": HISTORY,
                                                                  "max_tokens": 60, **body})
    assert status == 200, got
    return got["choices"][0]


def test_named_tool_choice_returns_a_call_with_valid_arguments(server):
    for seed in range(5):
        choice = _chat(server, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            WEATHER["function"]["parameters"])


def test_named_tool_call_streamed_in_pieces(server):
    """OpenAI's streamed shape: the id and name first, the arguments in pieces; joined, they equal
    the non-streamed call's (same seed)."""
    client = server.client(api_key="none")
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=HISTORY, max_tokens=60, tools=[WEATHER, TIME],
              tool_choice=named, seed=7,
              temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    first = chunks[0].choices[0].delta.tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    args = "".join(
        d.function.arguments for c in chunks for d in (c.choices[0].delta.tool_calls or [])
    )
    assert args == whole.function.arguments and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_returns_calls_of_listed_functions(server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(5):
        choice = _chat(server, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
                       tool_choice="required",
                       parallel_tool_calls=False, max_tokens=120)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                schemas[call["function"]["name"]])


def test_auto_parses_hermes_tool_call_blocks(server):
    """The model is steered into a <tool_call> block (a regex constraint) and the server parses it
    out."""
    block = r'Let me check\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>'
    choice = _chat(server, tools=[WEATHER, TIME], tool_choice="auto", guided_regex=block,
                   max_tokens=120)
    assert (
        choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    )
    assert [(c["function"]["name"],
             json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
            ] == [("get_time", {"zone": "CET"})]
    plain = _chat(
        server, tools=[WEATHER, TIME], tool_choice="none", guided_regex=block, max_tokens=120
    )  # no parse
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]


def test_extract_unit():
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>{"name": "g"}</tool_call>'
    content, calls = tool_calls.extract(text, None, "auto", hermes=True)
    assert content == "a  b" and [(c["function"]["name"],
                                   c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x": 1}'), ("g", "{}")]
    assert tool_calls.extract("<tool_call>{broken</tool_call>", None, "auto", True) == (
        "<tool_call>{broken</tool_call>", [])
    assert tool_calls.extract("no calls", None, "auto", True) == ("no calls", [])
    _, first_only = tool_calls.extract(text, None, "auto", hermes=True, parallel=False)
    assert [c["function"]["name"] for c in first_only] == ["f"]  # parallel_tool_calls=false


@pytest.mark.parametrize("body, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "'fly'"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice='sometimes'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "allowed are"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "already constrains"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "content may be null only"),
])
def test_bad_tool_fields_are_400(server, body, says):
    status, _, got = _post(server.port, "/v1/chat/completions",
                           {"model": MODEL, "messages": HISTORY,
                                                                  "max_tokens": 4, **body})
    assert status == 400 and says in got["error"]["message"], got


# ----------------------------------------------------------------------------- auto needs a parser
@pytest.mark.parametrize("choice", [{"tool_choice": "auto"}, {}])
def test_auto_without_a_parser_is_vllms_400(plain_server, choice):
    status, _, got = _post(plain_server.port, "/v1/chat/completions",
                           {"model": MODEL, "messages": HISTORY, "max_tokens": 4,
                            "tools": [WEATHER], **choice})
    assert status == 400 and got["error"]["message"] == tool_calls.AUTO_NEEDS_PARSER
    for ok in ({"tool_choice": "none", "tools": [WEATHER]}, {}):  # no auto: served as before
        status, _, got = _post(plain_server.port, "/v1/chat/completions",
                               {"model": MODEL, "messages": HISTORY, "max_tokens": 4, **ok})
        assert status == 200, got


def test_tool_call_config_refuses_bad_flags():
    with pytest.raises(Exception, match="allowed: hermes"):
        tool_calls.ToolCallConfig(True, "pythonic")
    with pytest.raises(Exception, match="needs tool_call_parser"):
        tool_calls.ToolCallConfig(True, None)


# ----------------------------------------------------------------------------- strict schemas
LOOSE = {"type": "object", "properties": {  # no additionalProperties anywhere, as LiteLLM sends it
    "city": {"type": "string", "maxLength": 10},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "tags": {"type": "array", "items": {"properties": {"k": {"type": "string", "maxLength": 4}}}},
    "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                         {"type": "null"}]},
    "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                       {"properties": {"y": {"type": "integer"}}}]},
    "free": {"type": "object", "additionalProperties": {"type": "integer"}},
    "properties": {"type": "object", "properties": {"type": {"const": "object"}}}},
    "required": ["city"]}


def test_strict_schema_closes_every_object_but_allofs_parts():
    strict = tool_calls.strict_schema(LOOSE)
    props = strict["properties"]
    closed = [strict, props["where"], props["tags"]["items"], props["either"]["anyOf"][0],
              props["properties"]]
    assert all(s["additionalProperties"] is False for s in closed)
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])  # left open
    assert props["free"]["additionalProperties"] == {"type": "integer"}  # it says what it allows
    assert "additionalProperties" not in props  # a map of names is no schema
    assert "additionalProperties" not in props["properties"]["properties"]
    assert "additionalProperties" not in LOOSE  # a copy


def _strict_validator():
    """jsonschema's check of the arguments: LOOSE with every object closed, written by hand."""
    closed = json.loads(json.dumps(LOOSE))
    closed["additionalProperties"] = False
    for key in ("where", "properties"):
        closed["properties"][key]["additionalProperties"] = False
    closed["properties"]["tags"]["items"]["additionalProperties"] = False
    closed["properties"]["either"]["anyOf"][0]["additionalProperties"] = False
    return closed


def test_a_loose_tool_schema_gives_arguments_without_unlisted_keys(server):
    """A schema lacking additionalProperties: every call parses, has only listed keys, and ends
    by itself. Negative control: the same request with `response_format` and the loose schema
    (not a tool, so not strict) writes unlisted keys on some of these seeds."""
    tool = {"type": "function", "function": {"name": "find", "parameters": LOOSE}}
    closed = _strict_validator()
    unlisted = 0
    for seed in range(6):
        choice = _chat(server, tools=[tool], temperature=1.0, seed=seed, max_tokens=400,
                       tool_choice={"type": "function", "function": {"name": "find"}})
        assert choice["finish_reason"] == "tool_calls", choice
        jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]),
                            closed)
        loose = _chat(server, temperature=1.0, seed=seed, max_tokens=400,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "find", "schema": LOOSE}})
        try:
            jsonschema.validate(json.loads(loose["message"]["content"]), closed)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            unlisted += 1
    assert unlisted >= 1


# ----------------------------------------------------------------------------- streamed calls
def _streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, joined arguments) of each call in a stream's deltas, by index."""
    calls: dict[int, list] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def _whole_calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_streamed_equals_the_whole_answer(server, seed):
    client = server.client(api_key="none")
    kw = dict(model=MODEL, messages=HISTORY, max_tokens=160, tools=[WEATHER, TIME],
              tool_choice="required", seed=seed, temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = [(name, json.loads(args)) for name, args in _streamed_calls(chunks)]
    assert streamed == _whole_calls(whole.message) and streamed
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"
    assert all(c.choices[0].delta.content in (None, "") for c in chunks)


def test_auto_hermes_calls_streamed(server):
    """Content before, two calls (one of them cut into many pieces by the steps), content after."""
    block = (r'Let me check\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}'
             r'</tool_call>\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}'
             r'</tool_call> Done\.')
    client = server.client(api_key="none")
    kw = dict(model=MODEL, messages=HISTORY, max_tokens=200, tools=[WEATHER, TIME],
              extra_body={"guided_regex": block})
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [(name, json.loads(args)) for name, args in _streamed_calls(chunks)]
    assert streamed == _whole_calls(whole.message) == [("get_time", {"zone": "CET"}),
                                                      ("get_weather", {"city": "Rome"})]
    assert content == whole.message.content == "Let me check. \n Done."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # parallel_tool_calls=false: the first call only, streamed or not
    one = client.chat.completions.create(stream=True, parallel_tool_calls=False, **kw)
    assert [n for n, _ in _streamed_calls([c for c in one if c.choices])] == ["get_time"]


def _feed_in_pieces(reader, text: str, size: int) -> list[dict]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    return [reader.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_required_reader_any_cut(size):
    text = ('[ {"name": "f", "parameters": {"s": "a\\"]}{,", "n": [1, {"x": null}]}},'
            '{"name":"g","parameters":3} ,{"parameters": {"k": true}, "name": "h\\u00e9"}]')
    deltas = _feed_in_pieces(tool_call_stream.RequiredCalls(), text, size)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            calls.setdefault(c["index"], [c["function"].get("name"), ""])
            calls[c["index"]][1] += c["function"]["arguments"]
    got = [(name, json.loads(args)) for name, args in calls.values()]
    assert got == [(c["name"], c["parameters"]) for c in json.loads(text)]


@pytest.mark.parametrize("size", [1, 4, 11, 1000])
def test_hermes_reader_any_cut(size):
    text = (' Hi <tool_call {"x"} <tool_call>{"name": "f", "arguments": {"a": "</tool"}}'
            '</tool_call>\n\n<tool_call>not json</tool_call> bye <tool_call>{"name": "g"')
    deltas = _feed_in_pieces(tool_call_stream.HermesCalls(), text, size)
    content = "".join(d.get("content", "") for d in deltas)
    names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])]
    assert names == ["f"]
    assert content == ('Hi <tool_call {"x"} \n\n<tool_call>not json</tool_call> bye '
                       '<tool_call>{"name": "g"')


def test_negative_control_a_reader_that_ignores_cuts_fails():
    """Fed all at once, a block split over pieces must still be found; a reader that only looks
    inside each piece (the bug the held-back tag prevents) misses it."""
    text = 'x <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    naive = [tool_call_stream.HermesCalls().feed(text[i:i + 4], True)
             for i in range(0, len(text), 4)]
    assert not any(d.get("tool_calls") for d in naive)
    assert [c["function"]["name"] for d in _feed_in_pieces(tool_call_stream.HermesCalls(), text, 4)
            for c in d.get("tool_calls", [])] == ["f"]
