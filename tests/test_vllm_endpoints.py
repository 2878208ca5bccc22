"""vLLM's routes and fields beyond OpenAI's (issue 46, items 4 and 5), on a live server:
/version, /ping (SageMaker's probe), /load (requests in flight), /invocations (SageMaker's route,
dispatched by the body's shape), `model` left out, several served names, vLLM's model cards
(root, parent, permission) and `echo` with `max_tokens: 0`.

Answers are checked against OpenAI's published schema as the `openai` package types it
(openai.types.Model, Completion, chat.ChatCompletion), with extra fields allowed only where vLLM
adds them (a card's root, parent, max_model_len, permission); values against the offline engine
(LLM.generate, LLM.logits) or the endpoint /invocations stands for. Negative controls: a card
missing its id or carrying an unknown field fails the check, /invocations with neither key is a
400, a refused request leaves /load at 0.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from live_server import (  # noqa: E402
    LiveServer,
    StepGate,
    _http,
    _pool_whole,
    _post,
    _wait_for,
    chat_server,
    demo_chat_model,
)
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from published_schema import conform  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve import LLM  # noqa: E402
from nanoserve.cli import build_parser  # noqa: E402
from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.errors import NanoserveError  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.server import create_app, served_names  # noqa: E402

MODEL, ALIAS = "demo-chat", "alias"
PROMPT = "ROMEO: But soft, what light"
CHAT = [{"role": "user", "content": "Who is there?"}]
VLLM_CARD = {"Model": {"root", "parent", "max_model_len", "permission"}}  # vLLM's extra fields
PERMISSION_FIELDS = {"id", "object", "created", "allow_create_engine", "allow_sampling",
                     "allow_logprobs", "allow_search_indices", "allow_view", "allow_fine_tuning",
                     "organization", "group", "is_blocking"}  # vLLM's ModelPermission


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return demo_chat_model(tmp_path_factory.mktemp("vllm") / MODEL)


@pytest.fixture(scope="module")
def server(chat_model):
    srv = chat_server(chat_model, [MODEL, ALIAS])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(chat_model):
    return LLM(str(chat_model))


def _get(port: int, path: str, **kw) -> tuple[int, dict]:
    status, _, body = _http(port, "GET", path, **kw)
    return status, json.loads(body)


def _same_answer(a: dict, b: dict) -> bool:
    """Two completions equal but for their ids and times."""
    def strip(d):
        return {k: v for k, v in d.items() if k not in ("id", "created")}
    return strip(a) == strip(b)


# ----------------------------------------------------------------------------- /version, /ping
def test_version_is_nanoserves(server):
    assert _get(server.port, "/version") == (200, {"version": nanoserve.__version__})
    assert _http(server.port, "GET", "/version", headers={"Authorization": None})[0] == 401


def test_ping_answers_as_health_without_the_key(server):
    health = _get(server.port, "/health", headers={"Authorization": None})
    assert health == (200, {"status": "ok"})
    for method in ("GET", "POST"):
        status, _, body = _http(server.port, method, "/ping", headers={"Authorization": None})
        assert (status, json.loads(body)) == health


def test_ping_is_503_once_the_engine_failed(monkeypatch):
    core = LLMEngine.from_kwargs("demo", num_blocks=64)
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        assert _http(srv.port, "GET", "/ping")[0] == 200
        monkeypatch.setattr(core, "step",
                            lambda: (_ for _ in ()).throw(AssertionError("broken bookkeeping")))
        _post(srv.port, "/v1/completions", {"model": "demo", "prompt": "a", "max_tokens": 2})
        for method in ("GET", "POST"):
            status, _, body = _http(srv.port, method, "/ping")
            assert status == 503 and json.loads(body)["error"]["type"] == "server_error"
        assert _http(srv.port, "GET", "/health")[0] == 503
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- /load
def test_load_counts_the_generation_requests_in_flight(server, monkeypatch):
    _wait_for(lambda: _pool_whole(server.engine), "an idle server")
    assert _get(server.port, "/load") == (200, {"server_load": 0})
    gate = StepGate(server, monkeypatch)
    gate.hold()  # every step waits: the requests stay in flight until released
    client = server.client()
    with ThreadPoolExecutor(3) as pool:
        try:
            plain = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT,
                                max_tokens=3)
            chat = pool.submit(lambda: list(client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3, stream=True)))
            answer = pool.submit(client.responses.create, model=MODEL, input="Hi",
                                 max_output_tokens=3)
            _wait_for(lambda: _get(server.port, "/load")[1]["server_load"] == 3,
                      "three requests in flight")
            # a refused request and the other routes are not generation in flight
            assert _post(server.port, "/v1/completions", {"model": MODEL, "prompt": 1})[0] == 400
            assert _http(server.port, "GET", "/v1/models")[0] == 200
            assert _get(server.port, "/load")[1] == {"server_load": 3}
        finally:
            gate.open()
        plain.result(), chat.result(), answer.result()
    # a stream counts until its last byte is sent: all are done now
    _wait_for(lambda: _get(server.port, "/load")[1]["server_load"] == 0, "the count back at 0")


# ----------------------------------------------------------------------------- /invocations
def test_invocations_serve_chat_and_completions_as_those_endpoints(server):
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    for body, path, schema in [(chat, "/v1/chat/completions", ChatCompletion),
                               (plain, "/v1/completions", Completion)]:
        status, _, via_sagemaker = _post(server.port, "/invocations", body)
        assert status == 200
        conform(schema, via_sagemaker)
        assert _same_answer(via_sagemaker, _post(server.port, path, body)[2])
    status, hdrs, data = _http(server.port, "POST", "/invocations",
                               json.dumps({**chat, "stream": True}).encode())
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])
    assert text == _post(server.port, "/invocations", chat)[2]["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body", [
    b'{"model": ',  # not JSON
    {"model": MODEL, "messages": CHAT, "bogus": 1},  # chat's unknown field
    {"model": MODEL, "messages": "hi"},  # chat's wrong type
    {"model": MODEL, "messages": CHAT, "temperature": -1},  # chat's bad value
    {"model": MODEL, "prompt": PROMPT, "max_tokens": "5"},  # completions' strict types
    {"model": MODEL, "prompt": PROMPT, "max_tokens": 0},  # completions' max_tokens=0 without echo
    {"model": "gpt-4", "prompt": PROMPT},  # 404
], ids=["json", "unknown-field", "type", "value", "strict", "max-tokens-0", "model"])
def test_invocations_refuse_as_the_target_endpoint_does(server, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    target = "/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"
    want = _http(server.port, "POST", target, raw)
    got = _http(server.port, "POST", "/invocations", raw)
    assert got[0] == want[0] and got[0] in (400, 404)
    assert json.loads(got[2]) == json.loads(want[2])


@pytest.mark.parametrize("body,says", [
    ({"model": MODEL, "input": "Hi"}, "this body has neither"),
    ({"model": MODEL, "prompt": PROMPT, "messages": CHAT}, "this body has both"),
    ([1, 2], "must be a JSON object"),
])
def test_invocations_without_one_known_key_is_a_400_naming_what_it_takes(server, body, says):
    status, _, got = _post(server.port, "/invocations", body)
    message = got["error"]["message"]
    assert status == 400 and says in message
    if "body has" in message:
        assert "'messages'" in message and "'prompt'" in message


def test_invocations_need_the_api_key(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert _post(server.port, "/invocations", body, headers={"Authorization": None})[0] == 401


# ----------------------------------------------------------------------------- model names
def test_model_may_be_left_out_and_the_first_served_name_answers(server):
    client = server.client()
    for path, body in [("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})]:
        status, _, got = _post(server.port, path, body)
        assert status == 200 and got["model"] == MODEL, got
    named = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, temperature=0)
    unnamed = _post(server.port, "/v1/completions",
                    {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})[2]
    assert named.model == ALIAS and named.choices[0].text == unnamed["choices"][0]["text"]
    chat = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=2)
    assert chat.model == ALIAS


def test_models_list_each_served_name_as_vllms_card(server, chat_model):
    status, models = _get(server.port, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL, ALIAS]
    for card in models["data"]:
        conform(Model, card, VLLM_CARD)
        assert card["root"] == str(chat_model) and card["parent"] is None
        assert card["max_model_len"] == server.engine.engine.max_model_len
        (permission,) = card["permission"]
        assert set(permission) == PERMISSION_FIELDS and permission["object"] == "model_permission"
        assert permission["allow_sampling"] and not permission["allow_fine_tuning"]
    assert _get(server.port, f"/v1/models/{ALIAS}")[1]["id"] == ALIAS
    listed = server.client().models.list()
    assert [m.id for m in listed.data] == [MODEL, ALIAS] and listed.data[0].root == str(chat_model)


def test_the_card_check_catches_a_missing_or_an_unknown_field(server):
    card = _get(server.port, f"/v1/models/{MODEL}")[1]
    conform(Model, card, VLLM_CARD)
    with pytest.raises(Exception, match="id"):
        conform(Model, {k: v for k, v in card.items() if k != "id"}, VLLM_CARD)
    with pytest.raises(AssertionError, match="'owner'"):
        conform(Model, {**card, "owner": "x"}, VLLM_CARD)
    with pytest.raises(AssertionError, match="'root'"):  # vLLM's fields are extras to OpenAI
        conform(Model, card)


def test_an_adapters_card_names_its_base_and_its_directory(tmp_path):
    pytest.importorskip("peft")
    from lora_helpers import make_peft_adapter
    from transformers import GPT2LMHeadModel

    from nanoserve.lora.serving import parse_lora_modules
    from nanoserve.models.loader import resolve_model_path

    hf = GPT2LMHeadModel.from_pretrained(resolve_model_path("demo")).eval()
    path = str(make_peft_adapter(hf, tmp_path / "a1", ["c_attn"])[1])
    core = LLMEngine.from_kwargs("demo", enable_lora=True, max_loras=1, max_lora_rank=8)
    srv = LiveServer(create_app(AsyncLLMEngine(core), ["demo", "d2"],
                                loras=parse_lora_modules([f"a1={path}"])))
    try:
        cards = {c["id"]: c for c in _get(srv.port, "/v1/models")[1]["data"]}
        assert list(cards) == ["demo", "d2", "a1"]
        for card in cards.values():
            conform(Model, card, VLLM_CARD)
        assert (cards["a1"]["root"], cards["a1"]["parent"]) == (path, "demo")
        assert (cards["d2"]["root"], cards["d2"]["parent"]) == ("demo", None)
    finally:
        srv.stop()


def test_served_model_names_from_the_command_line_and_their_checks():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve"]).served_model_name is None
    assert served_names("a") == ["a"] and served_names(["a", "b"]) == ["a", "b"]
    for bad in ([], ["a", "a"], [""]):
        with pytest.raises(NanoserveError, match="served model names"):
            served_names(bad)


# ----------------------------------------------------------------------------- echo, max_tokens 0
def _past_the_first_token(completion: dict) -> dict:
    """The answer with each choice's logprobs from the second token on. The SDK types every
    token_logprobs / top_logprobs entry as a number / an object, yet OpenAI's API (and vLLM) send
    null for an echoed prompt's first token, which nothing predicts."""
    choices = []
    for choice in completion["choices"]:
        lp = {key: values[1:] for key, values in choice["logprobs"].items()}
        choices.append({**choice, "logprobs": lp})
    return {**completion, "choices": choices}


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server, reference):
    status, _, got = _post(server.port, "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                            "logprobs": 1})
    assert status == 200
    conform(Completion, _past_the_first_token(got))
    (choice,) = got["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 0
    ids = reference.encode_prompt(PROMPT)
    assert got["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [reference.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = reference.logits(ids).log_softmax(-1)  # T, V: position p scores token p + 1
    assert lp["token_logprobs"][1:] == pytest.approx(
        [want[p, t].item() for p, t in enumerate(ids[1:])], abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    _wait_for(lambda: _pool_whole(server.engine), "the pool to be whole")


def test_echo_with_max_tokens_0_without_logprobs_and_streamed(server, reference):
    ids = reference.encode_prompt(PROMPT)
    plain = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True}
    got = _post(server.port, "/v1/completions", plain)[2]
    conform(Completion, got)
    assert [(c["text"], c["logprobs"], c["finish_reason"]) for c in got["choices"]] == [
        (PROMPT, None, "length")]  # a token-id prompt echoes as its text
    status, _, data = _http(server.port, "POST", "/v1/completions",
                            json.dumps({**plain, "n": 2, "stream": True}).encode())
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted((c["choices"][0]["index"], c["choices"][0]["text"],
                   c["choices"][0]["finish_reason"]) for c in chunks) == [
        (0, PROMPT, "length"), (1, PROMPT, "length")]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    _wait_for(lambda: _pool_whole(server.engine), "the pool to be whole")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
])
def test_max_tokens_0_without_echo_is_a_400_naming_it(server, path, body):
    status, _, got = _post(server.port, path, {"model": MODEL, **body})
    assert status == 400 and "max_tokens=0 must be an integer ≥ 1" in got["error"]["message"]
