"""/openapi.json tells the truth (issue 16): every real response the server gives — its status,
its content type and, for JSON, its body (and each server-sent event's data) — is one the
document lists, validated with jsonschema against the document's own schemas. Then a bounded
hypothesis fuzz of the request bodies: no client mistake is ever a 5xx, and every answer
matches the document. Negative controls show the validator rejects what the document forbids.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from live_server import (  # noqa: E402
    KEY,
    POISON,
    LiveServer,
    _http,
    _pool_whole,
    _post,
    _wait_for,
    demo_chat_model,
    poisoned_engine,
)

from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.chat import load_chat_template  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = demo_chat_model(tmp_path_factory.mktemp("openapi") / "demo-chat")
    core = poisoned_engine(str(path))
    server = LiveServer(create_app(AsyncLLMEngine(core), "demo", api_key=KEY,
                                   max_body_bytes=32 * 1024,
                                   chat_template=load_chat_template(path, core.tokenizer)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spec(srv) -> dict:
    status, hdrs, body = _http(srv.port, "GET", "/openapi.json")
    assert status == 200 and hdrs["content-type"] == "application/json"
    return json.loads(body)


def _validate(spec: dict, schema: dict, value) -> None:
    jsonschema.Draft202012Validator({**schema, "components": spec["components"]}).validate(value)


def check(spec: dict, path: str, method: str, reply: tuple) -> None:
    """The reply (status, headers, body bytes) is documented for (path, method), body included."""
    status, hdrs, body = reply
    responses = spec["paths"][path][method]["responses"]
    assert str(status) in responses, (
        f"{method.upper()} {path} answered {status}, not in {sorted(responses)}"
    )
    media = hdrs["content-type"].split(";")[0]
    content = responses[str(status)]["content"]
    assert media in content, (
        f"{method.upper()} {path} {status} sent {media}, documented {sorted(content)}"
    )
    if media == "application/json":
        _validate(spec, content[media]["schema"], json.loads(body))
    elif media == "text/event-stream" and body.startswith(b"event: "):
        # OpenAI's typed events (/v1/responses): `event: <type>` then `data: <JSON>`, no [DONE]
        for block in filter(None, body.split(b"\n\n")):
            kind, data = block.split(b"\n")
            event = json.loads(data.removeprefix(b"data: "))
            assert kind.removeprefix(b"event: ").decode() == event["type"]
            _validate(spec, content[media]["x-sse-data"], event)
    elif media == "text/event-stream":
        events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        for e in events[:-1]:
            _validate(spec, content[media]["x-sse-data"], json.loads(e))


def _completion(srv, spec, body: dict, path="/v1/completions", headers=None) -> tuple:
    reply = _http(srv.port, "POST", path,
                  json.dumps(body).encode() if isinstance(body, dict) else body, headers)
    check(spec, path, "post", reply)
    return reply


def test_the_document_lists_what_the_server_really_does(spec):
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"):
        responses = spec["paths"][path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "429", "500", "503"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_real_responses_match_the_document(srv, spec):
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    plain = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 4}
    assert _completion(srv, spec, plain)[0] == 200
    usage = {"include_usage": True}
    assert _completion(srv, spec,
                       {**plain, "n": 2, "stream": True, "stream_options": usage})[0] == 200
    assert _completion(srv, spec, {**plain, "prompt": ["a", "b"], "stream": True})[0] == 200
    assert _completion(srv, spec, chat, "/v1/chat/completions")[0] == 200
    assert _completion(srv, spec, {**chat, "stream": True}, "/v1/chat/completions")[0] == 200
    assert _completion(srv, spec, b'{"model": ')[0] == 400
    assert _completion(srv, spec, {**plain, "temperature": -1})[0] == 400
    assert _completion(srv, spec, {**plain, "model": "gpt-4"})[0] == 404
    assert _completion(srv, spec, plain, headers={"Authorization": None})[0] == 401
    assert _completion(srv, spec, {**plain, "prompt": "x" * 40_000})[0] == 413
    assert _completion(srv, spec, {**plain, "prompt": POISON})[0] == 500
    # an error event
    assert _completion(srv, spec, {**plain, "prompt": POISON, "stream": True})[0] == 200
    for path in ("/v1/models", "/health", "/metrics"):
        reply = _http(srv.port, "GET", path)
        assert reply[0] == 200
        check(spec, path, "get", reply)
    # logprobs in both shapes, streamed and not; cached-token usage; the tokenizer and model routes
    scored = {**plain, "logprobs": 2, "echo": True}
    assert _completion(srv, spec, scored)[0] == 200
    assert _completion(srv, spec, {**plain, "prompt_logprobs": 1})[0] == 200
    assert _completion(srv, spec, {**chat, "prompt_logprobs": 1}, "/v1/chat/completions")[0] == 200
    assert _completion(srv, spec, {**scored, "stream": True})[0] == 200
    chat_lp = {**chat, "logprobs": True, "top_logprobs": 2}
    assert _completion(srv, spec, chat_lp, "/v1/chat/completions")[0] == 200
    assert _completion(srv, spec, {**chat_lp, "stream": True}, "/v1/chat/completions")[0] == 200
    named = {**chat, "tools": [_TOOL],
             "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 12}
    assert _completion(srv, spec, named, "/v1/chat/completions")[0] == 200
    assert _completion(srv, spec, {**named, "stream": True}, "/v1/chat/completions")[0] == 200
    for path, body, status in [("/tokenize", {"prompt": "Hi"}, 200),
                               ("/tokenize", {"messages": chat["messages"]}, 200),
                               ("/detokenize", {"tokens": [72, 105]}, 200),
                               ("/detokenize", {"tokens": [-1]}, 400),
                               ("/tokenize", {"prompt": "Hi", "model": "x"}, 404)]:
        assert _completion(srv, spec, body, path)[0] == status
    for path, status in [("/tokenizer_info", 200), ("/v1/models/{name}", 200),
                         ("/v1/models/{name}", 404)]:
        real = path.replace("{name}", "demo" if status == 200 else "gpt-4")
        reply = _http(srv.port, "GET", real)
        assert reply[0] == status
        check(spec, path, "get", reply)


def test_vllm_routes_and_the_responses_api_match_the_document(srv, spec, monkeypatch):
    ask = {"model": "demo", "input": "Hi", "max_output_tokens": 4}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    for path, body, status in [
        ("/v1/responses", ask, 200), ("/v1/responses", {**ask, "stream": True}, 200),
        ("/v1/responses", {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 2,
                           "metadata": {"a": "b"}, "store": True}, 200),
        ("/v1/responses", {**ask, "tools": [_TOOL]}, 400),
        ("/v1/responses", {**ask, "model": "gpt-4"}, 404),
        ("/v1/responses", {**ask, "input": "x" * 40_000}, 413),
        ("/invocations", chat, 200), ("/invocations", {**chat, "stream": True}, 200),
        ("/invocations", {"prompt": "ROMEO:", "max_tokens": 2, "stream": True}, 200),
        ("/invocations", {"prompt": "ROMEO:", "max_tokens": 0, "echo": True}, 200),
        ("/invocations", {"prompt": POISON, "model": "demo"}, 500),
        ("/invocations", {"input": "Hi"}, 400), ("/invocations", {**chat, "model": "x"}, 404),
        ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 0, "echo": True, "logprobs": 1},
         200),
        ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 0, "echo": True, "n": 2,
                             "stream": True}, 200),
    ]:
        assert _completion(srv, spec, body, path)[0] == status, (path, body)
    assert _completion(srv, spec, ask, "/v1/responses", {"Authorization": None})[0] == 401
    for method, path in [("get", "/ping"), ("post", "/ping"), ("get", "/version"),
                         ("get", "/load"), ("get", "/v1/models")]:
        reply = _http(srv.port, method.upper(), path)
        assert reply[0] == 200
        check(spec, path, method, reply)
    # a failure after the stream began: a response.failed event
    monkeypatch.setattr(srv.engine.engine, "_emit",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    status, _, body = _completion(srv, spec, {**ask, "stream": True}, "/v1/responses")
    assert status == 200 and b"event: response.failed" in body
    monkeypatch.undo()
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole", timeout=60)


def test_a_dead_engine_is_documented_503(spec, monkeypatch):
    core = poisoned_engine()
    server = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        monkeypatch.setattr(core, "step",
                            lambda: (_ for _ in ()).throw(AssertionError("broken bookkeeping")))
        _post(server.port, "/v1/completions", {"model": "demo", "prompt": "a", "max_tokens": 2})
        reply = _http(server.port, "POST", "/v1/completions",
                      json.dumps({"model": "demo", "prompt": "a"}).encode())
        assert reply[0] == 503
        check(spec, "/v1/completions", "post", reply)
        check(spec, "/health", "get", _http(server.port, "GET", "/health"))
        check(spec, "/ping", "get", _http(server.port, "GET", "/ping"))
    finally:
        server.stop()


def test_validator_negative_controls(srv, spec):
    """The checks above can fail: undocumented fields, statuses and media types are caught."""
    ok = {"id": "x", "object": "text_completion", "created": 1, "model": "demo", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"}]}
    body = json.dumps(ok).encode()
    check(spec, "/v1/completions", "post", (200, {"content-type": "application/json"}, body))
    json_reply = lambda obj: (200, {"content-type": "application/json"}, json.dumps(obj).encode())  # noqa: E731
    for bad in ({**ok, "extra": 1},
                {**ok, "choices": [{**ok["choices"][0], "finish_reason": "abort"}]}):
        with pytest.raises(jsonschema.ValidationError):
            check(spec, "/v1/completions", "post", json_reply(bad))
    with pytest.raises(AssertionError, match="not in"):
        check(spec, "/v1/completions", "post", (422, {"content-type": "application/json"}, body))
    with pytest.raises(AssertionError, match="documented"):
        check(spec, "/metrics", "get", (200, {"content-type": "application/json"}, b"{}"))
    # /v1/responses' typed events: the data must match the document and the `event:` line it
    delta = {"type": "response.output_text.delta", "sequence_number": 0, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "a", "logprobs": []}

    def events(kind: str, data: dict) -> tuple:
        block = f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
        return 200, {"content-type": "text/event-stream"}, block

    check(spec, "/v1/responses", "post", events(delta["type"], delta))
    with pytest.raises(jsonschema.ValidationError):
        check(spec, "/v1/responses", "post", events(delta["type"], {**delta, "extra": 1}))
    with pytest.raises(AssertionError):
        check(spec, "/v1/responses", "post", events("response.completed", delta))
    card = json.loads(_http(srv.port, "GET", "/v1/models/demo")[2])
    with pytest.raises(jsonschema.ValidationError):  # vLLM's fields are required in the document
        check(spec, "/v1/models/{name}", "get", json_reply({k: v for k, v in card.items()
                                                            if k != "permission"}))


# ----------------------------------------------------------------------------- fuzzing the bodies
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(-3, 600), max_size=4))
FIELDS = {
    "prompt": st.one_of(st.text(max_size=30), st.just("\ud800 lone surrogate"),
                        st.lists(st.integers(-2, 300), max_size=6),
                        st.lists(st.text(max_size=5), max_size=3),
                        st.lists(st.lists(st.integers(0, 256), max_size=3), max_size=2), _ANY),
    "max_tokens": st.one_of(st.integers(-2, 4), _ANY),
    "n": st.one_of(st.integers(0, 3), st.just(10**9), _ANY),
    "temperature": st.one_of(st.floats(0, 3), st.just(1e-300), _ANY),
    "top_p": st.one_of(st.floats(0, 1.5), _ANY),
    "top_k": st.one_of(st.integers(-2, 300), _ANY),
    "seed": st.one_of(st.integers(-2**64, 2**65), _ANY),
    "repetition_penalty": st.one_of(st.floats(0, 1e40), st.just(1e-300), _ANY),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), _ANY),
    "stream": st.one_of(st.booleans(), _ANY), "ignore_eos": st.one_of(st.booleans(), _ANY),
    "logprobs": st.one_of(st.integers(-1, 22), _ANY), "echo": st.one_of(st.booleans(), _ANY),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": _ANY}), _ANY),
    "min_tokens": st.one_of(st.integers(-1, 6), _ANY),
    "min_p": st.one_of(st.floats(-0.5, 1.5), _ANY),
    "presence_penalty": st.one_of(st.floats(-3, 3), _ANY), "frequency_penalty": _ANY,
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["0", "65", "256", "300", "-1", "x"]),
                                            st.one_of(st.floats(-150, 150), _ANY), max_size=3), _ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 400), max_size=3), _ANY),
    "prompt_logprobs": st.one_of(st.integers(-1, 22), _ANY), "include_stop_str_in_output": _ANY,
    "response_format": st.one_of(st.sampled_from([
        {"type": "json_object"}, {"type": "text"}, {"type": "xml"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}},
        {"type": "json_schema", "json_schema": {"schema": 1}}]), _ANY),
    "guided_regex": st.one_of(st.sampled_from(["[0-9]{2}", "((", "a|b", ""]), _ANY),
    "guided_choice": st.one_of(st.lists(st.text(max_size=3), max_size=3), _ANY),
    "structured_outputs": st.one_of(st.fixed_dictionaries({"choice": st.lists(st.text(max_size=3), max_size=2)}),
                                    st.fixed_dictionaries({"grammar": st.sampled_from(['start: "a"+', "start: ?"])}),
                                    _ANY),
    "unknown_field": _ANY,
}


# what the fuzzers got, to check they reach the engine and not only the validator
STATUSES: list[int] = []


def _mutated(valid: dict, fields: dict):
    """A valid body with 0-3 of `fields` set to fuzzed values (most bodies reach the engine, some do
    not)."""
    changes = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))
    return st.tuples(st.fixed_dictionaries(valid), changes).map(lambda t: {**t[0], **t[1]})


VALID_COMPLETION = {"model": st.sampled_from(["demo"] * 9 + ["other"]),
                    "max_tokens": st.integers(1, 4),
                    "prompt": st.one_of(st.text(min_size=1, max_size=20),
                                        st.lists(st.integers(0, 256), min_size=1,
                                                                                    max_size=6))}


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(body=_mutated(VALID_COMPLETION, FIELDS))
def test_fuzzed_bodies_never_get_a_5xx_and_always_match_the_document(srv, spec, body):
    if body.get("stream") is True and body.get("max_tokens") not in range(1, 5):
        body["max_tokens"] = 4  # keep each example short: a stream runs to its end
    if body.get("prompt") == POISON:
        body["prompt"] = "poison"
    status, hdrs, data = _completion(srv, spec, body)
    STATUSES.append(status)
    assert status < 500, (body, data[:300])
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole", timeout=60)


_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                           "content": st.one_of(st.text(max_size=20),
                                                st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["text", "image_url"]),
                                "text": st.text(max_size=5)}),
                               max_size=2))}),
    st.fixed_dictionaries({"role": _ANY, "content": _ANY}), _ANY)


VALID_CHAT = {"model": st.just("demo"), "max_tokens": st.integers(1, 3),
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                          "content": st.text(max_size=20)}),
                                   min_size=1, max_size=3)}
_TOOL = {"type": "function",
         "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}
CHAT_FIELDS = {"messages": st.one_of(st.lists(_MESSAGE, max_size=3), _ANY),
               "max_tokens": FIELDS["max_tokens"],
               "max_completion_tokens": _ANY, "stream": FIELDS["stream"], "n": FIELDS["n"],
               "seed": FIELDS["seed"],
               "temperature": FIELDS["temperature"], "prompt": _ANY,
               "tools": st.one_of(st.just([_TOOL]), st.lists(_ANY, max_size=2), _ANY),
               "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "maybe",
                                                         {"type": "function",
                                                          "function": {"name": "f"}},
                                                         {"type": "function",
                                                          "function": {"name": "g"}}]), _ANY),
               "logprobs": st.one_of(st.booleans(), _ANY),
               "top_logprobs": st.one_of(st.integers(-1, 22), _ANY),
               "response_format": FIELDS["response_format"], "add_generation_prompt": _ANY,
               "chat_template_kwargs": st.one_of(st.fixed_dictionaries({"messages": _ANY}), _ANY)}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_mutated(VALID_CHAT, CHAT_FIELDS))
def test_fuzzed_chat_bodies_never_get_a_5xx_and_always_match_the_document(srv, spec, body):
    status, hdrs, data = _completion(srv, spec, body, "/v1/chat/completions")
    STATUSES.append(status)
    assert status < 500, (body, data[:300])
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole", timeout=60)


_RESPONSE_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer",
                                                    "tool"]),
                           "content": st.one_of(st.text(max_size=20), st.lists(
                               st.fixed_dictionaries({"type": st.sampled_from(
                                   ["input_text", "output_text", "input_image"]),
                                   "text": st.text(max_size=5)}), max_size=2))}),
    _ANY)
VALID_RESPONSES = {"model": st.sampled_from(["demo"] * 9 + ["other"]),
                   "input": st.text(min_size=1, max_size=20),
                   "max_output_tokens": st.integers(1, 4)}
RESPONSES_FIELDS = {
    "input": st.one_of(st.lists(_RESPONSE_ITEM, max_size=3), _ANY), "instructions": _ANY,
    "max_output_tokens": FIELDS["max_tokens"], "temperature": FIELDS["temperature"],
    "top_p": FIELDS["top_p"], "stream": FIELDS["stream"], "store": _ANY, "user": _ANY,
    "metadata": st.one_of(st.dictionaries(st.text(max_size=70), st.text(max_size=5), max_size=3),
                          _ANY),
    "tools": st.one_of(st.just([]), st.lists(_ANY, max_size=2), _ANY),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), _ANY),
    "background": _ANY, "text": st.one_of(st.just({"format": {"type": "text"}}), _ANY),
    "parallel_tool_calls": _ANY, "unknown_field": _ANY,
}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_mutated(VALID_RESPONSES, RESPONSES_FIELDS))
def test_fuzzed_responses_bodies_never_get_a_5xx_and_always_match_the_document(srv, spec, body):
    if body.get("stream") is True and body.get("max_output_tokens") not in range(1, 5):
        body["max_output_tokens"] = 4  # keep each example short: a stream runs to its end
    status, hdrs, data = _completion(srv, spec, body, "/v1/responses")
    STATUSES.append(status)
    assert status < 500, (body, data[:300])
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole", timeout=60)


def test_the_fuzzers_reached_the_engine():
    """A fuzz that only ever got 400s would test the validator alone."""
    if not STATUSES:
        pytest.skip("run with the fuzz tests")
    assert STATUSES.count(200) >= 10 and STATUSES.count(400) >= 10, sorted(set(STATUSES))
