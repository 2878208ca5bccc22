"""The OpenAI / vLLM surface beyond plain generation, through the real `openai` client on loopback:
logprobs (completions with echo, chat with top_logprobs, streamed and not), vLLM's sampling extras,
cached-token usage, and the tokenizer endpoints. Values are checked against the Python API
(`LLM.generate` / `LLM.logits`), bad values against a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from live_server import _http, _post, chat_server, demo_chat_model  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.serving.chat import load_chat_template  # noqa: E402

MODEL = "demo-chat"
PROMPT = "ROMEO: But soft, what light through yonder window breaks?"
CHAT = [{"role": "user", "content": "Who is there?"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return demo_chat_model(tmp_path_factory.mktemp("api") / MODEL)


@pytest.fixture(scope="module")
def server(chat_model):
    srv = chat_server(chat_model, MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(chat_model):
    return LLM(str(chat_model))


def _ref_logprobs(ref: LLM, ids: list[int]):
    return ref.logits(ids).log_softmax(-1)  # T, V


# ----------------------------------------------------------------------------- completions
def test_completion_logprobs_equal_the_python_api(server, ref):
    got = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                             temperature=0, logprobs=2)
    want = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids) == 6
    assert lp.tokens == [ref.engine.tokenizer.decode([t]) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for e, t in zip(want.outputs[0].logprobs, want.token_ids)], abs=1e-6
    )
    assert all(len(top) in (2, 3) and max(top.values()) == lp.token_logprobs[i] for i, top in
               enumerate(lp.top_logprobs))  # greedy: the chosen token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_logprobs_zero_returns_the_chosen_tokens_logprobs(server):
    got = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                             temperature=0, logprobs=0)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(x is not None for x in lp.token_logprobs)
    assert all(len(top) == 1 for top in lp.top_logprobs)


def test_echo_with_logprobs_scores_the_prompt(server, ref):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, a token-id prompt."""
    ids = ref.encode_prompt(PROMPT)
    got = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    c = got.choices[0]
    full = ids + [ref.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]]
    want = _ref_logprobs(ref, full)
    assert c.text.startswith(ref.engine.tokenizer.decode(ids))
    assert len(c.logprobs.token_logprobs) == len(full) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [want[i - 1, full[i]].item() for i in range(1, len(full))], abs=1e-5
    )
    # prompt logprobs bypass the prefix cache
    assert got.usage.prompt_tokens_details.cached_tokens == 0


def test_echo_without_logprobs_and_streamed_echo(server):
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                      echo=True, logprobs=1)
    assert plain.choices[0].logprobs is not None and plain.choices[0].text.startswith(PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    tokens = [
        t for ch in chunks if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.tokens
    ]
    offsets = [
        o for ch in chunks if ch.choices and ch.choices[0].logprobs
        for o in ch.choices[0].logprobs.text_offset
    ]
    assert text == plain.choices[0].text
    assert (
        tokens == plain.choices[0].logprobs.tokens
        and offsets == plain.choices[0].logprobs.text_offset
    )
    bare = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert bare.choices[0].text.startswith(PROMPT) and bare.choices[0].logprobs is None


def test_vllm_prompt_logprobs_field(server, ref):
    """vLLM's prompt_logprobs returns, per choice, None for the first prompt token and then {id:
    {logprob, rank, decoded_token}} per token, equal to the Python API; with stream=true it is a 400
    naming it."""
    status, _, body = _post(server.port, "/v1/completions",
                            {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                              "temperature": 0,
                             "prompt_logprobs": 1})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    want = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    ids = want.prompt_token_ids
    assert got[0] is None and len(got) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(got[1:], ids[1:])] == pytest.approx(
        [e[t].logprob for e, t in zip(want.prompt_logprobs[1:], ids[1:])], abs=1e-5)
    assert "prompt_logprobs" not in _post(server.port, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1})[2]["choices"][0]  # not asked: not sent
    status, _, chat = _post(server.port, "/v1/chat/completions",
                            {"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                                   "prompt_logprobs": 0})
    assert (
        status == 200 and chat["prompt_logprobs"][0] is None
        and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    )
    for path, extra in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": CHAT})):
        status, _, err = _post(server.port, path,
                               {"model": MODEL, "stream": True, "prompt_logprobs": 1, **extra})
        assert status == 400 and "prompt_logprobs with stream=true" in err["error"]["message"]


# ----------------------------------------------------------------------------- chat


def test_chat_logprobs_and_top_logprobs(server, ref):
    client = server.client()
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                         logprobs=True,
                                         top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    # greedy
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                              temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    pieces = [
        t for ch in streamed if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    # (the second run reads the prefix cache:
    assert [t.token for t in pieces] == [t.token for t in content]
    # float order)
    assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content], abs=1e-5)
    off = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert off.choices[0].logprobs is None


def test_chat_template_options(server, chat_model):
    """add_generation_prompt and chat_template_kwargs reach the template (the prompt the template
    renders)."""
    template = load_chat_template(chat_model, LLM(str(chat_model)).engine.tokenizer)
    for add in (True, False):
        status, _, body = _post(server.port, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "max_tokens": 1, "add_generation_prompt": add})
        assert status == 200, body
        want = template.encode(CHAT, LLM(str(chat_model)).engine.tokenizer,
                               add_generation_prompt=add)
        assert body["usage"]["prompt_tokens"] == len(want)
    status, _, body = _post(server.port, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 1,
        "chat_template_kwargs": {"messages": []}})
    assert status == 400 and "chat_template_kwargs may not set messages" in body["error"]["message"]


# ----------------------------------------------------------------------------- sampling extras
EXTRAS = [
    ({"min_tokens": 4, "logit_bias": {"256": 100}}, dict(min_tokens=4, logit_bias={256: 100})),
    ({"stop_token_ids": [101]}, dict(stop_token_ids=[101])),
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
     dict(frequency_penalty=1.5, presence_penalty=0.5)),
    ({"logit_bias": {"101": -100, "32": 5}}, dict(logit_bias={101: -100, 32: 5})),
    ({"min_p": 0.2, "temperature": 0.9, "seed": 4}, dict(min_p=0.2, temperature=0.9, seed=4)),
]


@pytest.mark.parametrize("fields, kw", EXTRAS,
                         ids=["min_tokens", "stop_token_ids", "penalties", "bias", "min_p"])
def test_extras_equal_the_python_api(server, ref, fields, kw):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    status, _, got = _post(server.port, "/v1/completions", body)
    assert status == 200, got
    want = ref.generate([PROMPT], SamplingParams(**{"temperature": 0, "max_tokens": 12, **kw}))[0]
    assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == len(
        want.token_ids
    )


def test_include_stop_str_in_output(server, ref):
    text = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0].text
    stop = text[4:7]
    kept = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                              temperature=0, stop=[stop],
                                              extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and text.startswith(kept.choices[0].text)


def test_cached_tokens_in_usage(server):
    long = "Now is the winter of our discontent made glorious summer by this sun of York."
    first = server.client().completions.create(model=MODEL, prompt=long, max_tokens=1)
    again = server.client().completions.create(model=MODEL, prompt=long, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (
        (first.usage.prompt_tokens - 1) // 16
    )


@pytest.mark.parametrize("extra, says", [
    ({"presence_penalty": 3}, "presence_penalty=3"),
    ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5"),
    ({"logit_bias": {"abc": 1}}, "logit_bias: key 'abc'"),
    ({"logit_bias": {"5": 200}}, "logit_bias="),
    ({"logit_bias": {"9999999": 1}}, "outside the vocabulary"), ({"min_p": 2.0}, "min_p=2.0"),
    ({"min_tokens": 50, "max_tokens": 4}, "min_tokens=50"), ({"logprobs": 21}, "logprobs=21"),
    ({"logprobs": True}, "field 'logprobs'"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt_logprobs": 2, "echo": True, "logprobs": 1}, "contradicts"),
])
def test_bad_extras_are_400_naming_the_field(server, extra, says):
    status, _, body = _post(server.port, "/v1/completions",
                            {"model": MODEL, "prompt": "Hi", **extra})
    assert status == 400 and says in body["error"]["message"], body


def test_chat_top_logprobs_needs_logprobs(server):
    status, _, body = _post(server.port, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                                  "top_logprobs": 2})
    assert status == 400 and "top_logprobs=2 needs logprobs=true" in body["error"]["message"]


# ----------------------------------------------------------------------------- tokenizer and models
def test_tokenize_detokenize_and_tokenizer_info(server, ref):
    status, _, body = _post(server.port, "/tokenize", {"prompt": PROMPT + "<|endoftext|>"})
    # as /v1/completions encodes it: special-token text is the token's id, as in HF and vLLM
    # (tests/test_special_tokens.py: and the other way with split_special_tokens)
    assert status == 200 and body["tokens"] == ref.encode_prompt(PROMPT + "<|endoftext|>")
    assert body["tokens"][-1] == 256 and 256 not in body["tokens"][:-1]
    assert body["count"] == len(body["tokens"])
    status, _, back = _post(server.port, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT + "<|endoftext|>"
    status, _, info = _http(server.port, "GET", "/tokenizer_info")
    info = json.loads(info)
    assert status == 200 and info["eos_token"] == "<|endoftext|>" and "{%" in info["chat_template"]
    status, _, body = _post(server.port, "/tokenize", {"messages": CHAT})
    assert status == 200 and body["count"] > 3
    for path, bad, says in [("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
                            ("/tokenize", {"prompt": "a", "messages": CHAT}, "exactly one of"),
                            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "does not exist")]:
        status, _, body = _post(server.port, path, bad)
        assert status in (400, 404) and says in body["error"]["message"], body


def test_model_by_id(server):
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# ----------------------------------------------------------------------------- structured outputs
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(server):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    client = server.client()
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(5):
        got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, seed=seed,
                                             temperature=1.0,
                                             response_format=fmt)
        jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                    extra_body={
        "response_format": {"type": "json_object"}})
    assert got.choices[0].finish_reason == "stop" and isinstance(
        json.loads(got.choices[0].text), dict
    ), got


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'start: "x" "y"+'}, lambda t: t.startswith("xy") and set(t[1:]) == {"y"}),
])
def test_vllm_structured_fields(server, extra, check):
    pytest.importorskip("llguidance")
    status, _, body = _post(server.port, "/v1/completions",
                            {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                              **extra})
    assert status == 200 and check(body["choices"][0]["text"]), body


@pytest.mark.parametrize("extra, says", [
    ({"response_format": {"type": "xml"}}, "response_format.type='xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema"),
    ({"guided_regex": "(("}, "does not compile"),
    ({"structured_outputs": {"foo": 1}}, "unknown key 'foo'"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "not 2 (guided_regex, guided_choice)"),
])
def test_bad_structured_fields_are_400(server, extra, says):
    pytest.importorskip("llguidance")
    status, _, body = _post(server.port, "/v1/completions",
                            {"model": MODEL, "prompt": "Hi", **extra})
    assert status == 400 and says in body["error"]["message"], body
