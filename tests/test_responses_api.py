"""POST /v1/responses (OpenAI's Responses API, text and streaming) through the real `openai`
client on loopback. Every answer is checked against OpenAI's published schema as the `openai`
package types it (responses.Response, responses.ResponseStreamEvent), with no field beyond it; the
text against the offline engine on the same chat template (`LLM.generate`); the event stream's order
and sequence numbers against OpenAI's spec. Negative controls: a Response missing a field or
carrying an extra one fails the schema check; refused fields are 400s naming them.

The demo model never writes its end-of-text token, so the server's engine also stops at a newline
(as a chat model stops at its end-of-turn token): some answers then complete, others are cut by
max_output_tokens, and both statuses are tested.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from live_server import (  # noqa: E402
    DEADLINE,
    LiveServer,
    StepGate,
    _http,
    _pool_whole,
    _post,
    _request_bytes,
    _wait_for,
    chat_server,
    demo_chat_model,
)
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from published_schema import conform  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.chat import load_chat_template  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

MODEL, ALIAS = "demo-chat", "alias"
NEWLINE = 10  # the demo's byte-level id of "\n": its end of turn here
INSTRUCTIONS, QUESTION = "Speak as Romeo.", "Who goes there?"
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
DONE_ORDER = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return demo_chat_model(tmp_path_factory.mktemp("responses") / MODEL)


@pytest.fixture(scope="module")
def server(chat_model):
    srv = chat_server(chat_model, [MODEL, ALIAS])
    srv.engine.engine.inputs.eos_ids.add(NEWLINE)  # before any request
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(chat_model):
    return LLM(str(chat_model))


def _want(reference, chat_model, messages: list[dict], max_tokens: int):
    """The offline engine's greedy answer to `messages` rendered by the same template."""
    ids = load_chat_template(chat_model, reference.tokenizer).encode(messages, reference.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[NEWLINE])
    return ids, reference.generate([ids], params)[0]


def _raw_events(port: int, body: dict) -> list[tuple[str, dict]]:
    """(the `event:` line's type, the data) of each event of a streamed response, off the wire."""
    status, hdrs, data = _http(port, "POST", "/v1/responses", json.dumps(body).encode())
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            data = json.loads(payload.removeprefix("data: "))
            events.append((kind.removeprefix("event: "), data))
    return events


# ----------------------------------------------------------------------------- plain
def test_a_response_is_openais_response_object_with_the_engines_text(server, reference,
                                                                      chat_model):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    ids, want = _want(reference, chat_model, messages, 100)
    assert want.outputs[0].finish_reason == "stop"  # the newline: a complete answer
    body = {"model": MODEL, "input": QUESTION, "instructions": INSTRUCTIONS, "temperature": 0,
            "metadata": {"run": "t1"}, "user": "u-1", "store": False}
    status, _, raw = _post(server.port, "/v1/responses", body)
    assert status == 200
    got = conform(Response, raw)
    assert got.id.startswith("resp_") and got.object == "response" and got.status == "completed"
    assert got.model == MODEL and got.instructions == INSTRUCTIONS
    assert got.incomplete_details is None
    assert got.metadata == {"run": "t1"} and got.user == "u-1" and got.error is None
    assert got.temperature == 0 and got.top_p == 1 and got.tools == [] and not got.background
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    assert got.output_text == want.text
    usage = got.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(ids), len(want.token_ids))
    assert usage.total_tokens == len(ids) + len(want.token_ids)
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the real client parses the same answer
    client = server.client()
    same = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS,
                                   temperature=0)
    assert same.output_text == want.text and same.status == "completed"


def test_max_output_tokens_cuts_the_answer_as_incomplete(server, reference, chat_model):
    _, want = _want(reference, chat_model, [{"role": "user", "content": QUESTION}], 6)
    got = server.client().responses.create(model=MODEL, input=QUESTION, max_output_tokens=6,
                                           temperature=0)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.output[0].status == "incomplete" and got.max_output_tokens == 6
    assert got.output_text == want.text and got.usage.output_tokens == 6


def test_message_items_with_input_text_parts_equal_the_string_and_instructions(server):
    client = server.client()
    as_string = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS,
                                        max_output_tokens=12, temperature=0)
    items = [{"role": "system", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Who goes "},
                          {"type": "input_text", "text": "there?"}]}]
    as_items = client.responses.create(model=MODEL, input=items, max_output_tokens=12,
                                       temperature=0)
    assert as_items.output_text == as_string.output_text
    assert as_items.usage.input_tokens == as_string.usage.input_tokens
    # the control: another question is another prompt
    other = client.responses.create(model=MODEL, input="What light?", max_output_tokens=12,
                                    temperature=0)
    assert other.usage.input_tokens != as_string.usage.input_tokens


def test_an_earlier_answer_sent_back_as_input_continues_the_chat(server, reference, chat_model):
    client = server.client()
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8,
                                    temperature=0)
    turn = first.output[0].model_dump(exclude_none=True)  # the output item, as agents send it
    again = [{"role": "user", "content": QUESTION}, turn, {"role": "user", "content": "And?"}]
    got = client.responses.create(model=MODEL, input=again, max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And?"}]
    _, want = _want(reference, chat_model, messages, 8)
    assert got.output_text == want.text


# ----------------------------------------------------------------------------- streaming
def test_the_stream_is_openais_events_in_order_with_the_plain_text(server):
    body = {"model": MODEL, "input": QUESTION, "instructions": INSTRUCTIONS, "temperature": 0,
            "stream": True}
    events = _raw_events(server.port, body)
    for kind, data in events:
        assert kind == data["type"]  # the `event:` line names the data's type
        conform(ResponseStreamEvent, data)
    kinds = [kind for kind, _ in events]
    deltas = [data for kind, data in events if kind == "response.output_text.delta"]
    assert kinds == EVENT_ORDER + ["response.output_text.delta"] * len(deltas) + DONE_ORDER + [
        "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert len(deltas) > 1 and all(d["delta"] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    final = events[-1][1]["response"]
    plain = server.client().responses.create(model=MODEL, input=QUESTION,
                                             instructions=INSTRUCTIONS, temperature=0)
    assert text == events[-4][1]["text"] == final["output"][0]["content"][0]["text"]
    assert text == plain.output_text
    assert final["usage"] == plain.usage.model_dump(exclude_none=True)
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == final["id"]
    assert {d["item_id"] for d in deltas} == {final["output"][0]["id"]}


def test_a_cut_stream_ends_with_response_incomplete(server):
    events = _raw_events(server.port, {"model": MODEL, "input": QUESTION, "max_output_tokens": 5,
                                       "temperature": 0, "stream": True})
    kind, last = events[-1]
    assert kind == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2][1]["item"]["status"] == "incomplete"


def test_the_openai_clients_stream_helpers_read_it(server):
    client = server.client()
    seen = [e.type for e in client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                                    max_output_tokens=20, stream=True)]
    assert seen[:4] == EVENT_ORDER and seen[-1] in ("response.completed", "response.incomplete")
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text


def test_a_failure_after_the_stream_began_is_response_failed_and_the_server_goes_on(server,
                                                                                   monkeypatch):
    core = server.engine.engine

    def fail(*args):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(core, "_emit", fail)
    events = _raw_events(server.port, {"model": MODEL, "input": QUESTION, "stream": True})
    kind, last = events[-1]
    conform(ResponseStreamEvent, last)
    assert kind == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert "injected fault" in last["response"]["error"]["message"]
    monkeypatch.undo()
    _wait_for(lambda: _pool_whole(server.engine), "the pool to be whole")
    assert _http(server.port, "GET", "/health")[0] == 200
    assert server.client().responses.create(model=MODEL, input="Hi",
                                            max_output_tokens=2).status == "incomplete"


@pytest.mark.parametrize("abort_works", [True, False], ids=["abort", "control-no-abort"])
def test_a_client_that_leaves_mid_stream_aborts_its_request(server, monkeypatch, abort_works):
    """Read two text deltas, hold the engine, hang up: the request leaves the engine within the
    one step released after. The control, an engine that ignores aborts, keeps it running."""
    _wait_for(lambda: _pool_whole(server.engine), "an idle server")
    if not abort_works:
        monkeypatch.setattr(server.engine, "abort", lambda rid: None)
    gate = StepGate(server, monkeypatch)
    body = json.dumps({"model": MODEL, "input": QUESTION, "temperature": 0, "stream": True})
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as s:
        s.sendall(_request_bytes("POST", "/v1/responses", body.encode()))
        seen = b""
        while seen.count(b"event: response.output_text.delta") < 2:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream early"
            seen += chunk
        rid = next(iter(server.engine.engine.requests))
        gate.hold()
    _wait_for(lambda: rid not in server.engine._queues, "the server to notice the hang-up")
    try:
        gate.release(1)
        assert (rid in server.engine.engine.requests) is not abort_works
    finally:
        monkeypatch.undo()
        server.engine.abort(rid)
        gate.open()
    _wait_for(lambda: _pool_whole(server.engine), "the blocks to return")


# ----------------------------------------------------------------------------- names and refusals
def test_model_is_optional_and_each_served_name_answers_as_itself(server):
    client = server.client()
    plain = {"input": QUESTION, "max_output_tokens": 3, "temperature": 0}
    status, _, unnamed = _post(server.port, "/v1/responses", plain)
    assert status == 200 and unnamed["model"] == MODEL  # the first served name
    assert client.responses.create(model=ALIAS, **plain).model == ALIAS
    with pytest.raises(openai.NotFoundError, match="'demo-chat', 'alias'"):
        client.responses.create(model="gpt-4o", **plain)


@pytest.mark.parametrize("fields,says", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"background": True}, "background=true"),
    ({"previous_response_id": "resp_1"}, "unknown field 'previous_response_id'"),
    ({"text": {"format": {"type": "json_object"}}}, "only plain text"),
    ({"max_output_tokens": 0}, "max_output_tokens=0 must be an integer ≥ 1"),
    ({"max_output_tokens": "5"}, "field 'max_output_tokens'"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16"),
    ({"input": []}, "input is an empty list"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}]},
     "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"temperature": -1}, "temperature=-1"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_what_is_not_implemented_is_a_400_naming_it(server, fields, says):
    status, _, body = _post(server.port, "/v1/responses", {"model": MODEL, "input": "Hi", **fields})
    assert status == 400 and says in body["error"]["message"], body


def test_store_is_accepted_either_way_and_nothing_is_kept(server):
    client = server.client()
    for store in (True, False):
        got = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=store)
        assert got.status == "incomplete"
    status, _, _ = _http(server.port, "GET", f"/v1/responses/{got.id}")
    assert status == 404  # nothing to fetch


def test_a_model_without_a_chat_template_is_400(chat_model):
    srv = LiveServer(create_app(AsyncLLMEngine(LLMEngine.from_kwargs("demo")), "demo"))
    try:
        status, _, body = _post(srv.port, "/v1/responses", {"input": "Hi"})
        assert status == 400 and body["error"]["code"] == "no_chat_template"
        assert "has no chat template" in body["error"]["message"]
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- the schema check
def test_the_schema_check_catches_a_missing_or_an_extra_field(server):
    status, _, raw = _post(server.port, "/v1/responses",
                           {"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert status == 200
    conform(Response, raw)
    missing = {k: v for k, v in raw.items() if k != "output"}
    with pytest.raises(Exception, match="output"):
        conform(Response, missing)
    with pytest.raises(AssertionError, match="'store'"):
        conform(Response, {**raw, "store": False})
    usage = {**raw["usage"], "input_tokens_details": {"cached_tokens": 0}}
    with pytest.raises(Exception, match="cache_write_tokens"):
        conform(Response, {**raw, "usage": usage})
    event = {"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "a", "logprobs": []}
    conform(ResponseStreamEvent, event)
    with pytest.raises(Exception, match="sequence_number"):
        conform(ResponseStreamEvent, {k: v for k, v in event.items() if k != "sequence_number"})
