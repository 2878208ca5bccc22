"""The OpenAI-compatible server, tested as its users meet it: a real uvicorn server on loopback,
the official `openai` client, raw sockets for what clients do badly (malformed JSON, hanging up).

Oracles: `LLM.generate` on the same model (greedy outputs, seeded samples, token counts) and the
engine's own state (no request left, every KV block back in the pool). Every request loop is
bounded in count and time, and every connection targets 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from live_server import (  # noqa: E402
    DEADLINE,
    KEY,
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
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.chat import load_chat_template  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return demo_chat_model(tmp_path_factory.mktemp("chat") / "demo-chat")


@pytest.fixture(scope="module")
def server(chat_model):
    srv = chat_server(chat_model, "demo-chat", max_num_seqs=64)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(chat_model):
    return LLM(str(chat_model))


# ----------------------------------------------------------------------------- correctness
PROMPTS = ["ROMEO:", "First Citizen:\nWe are accounted poor citizens", [72, 101, 108, 108, 111]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long", "token-ids"])
def test_greedy_completion_equals_llm_generate_with_usage(server, reference, prompt):
    params = SamplingParams(temperature=0, max_tokens=24)
    want = reference.generate([prompt], params)[0]
    got = server.client().completions.create(model="demo-chat", prompt=prompt, max_tokens=24,
                                             temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(reference.encode_prompt(prompt))
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_equals_llm_generate(server, reference):
    want = reference.generate(["JULIET:"], SamplingParams(temperature=0, max_tokens=30))[0]
    stream = server.client().completions.create(model="demo-chat", prompt="JULIET:", max_tokens=30,
                                                temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    # one chunk per generated token (no speculative decoding here)
    assert sum(1 for c in chunks if c.choices) == len(want.token_ids)


def test_include_usage_puts_usage_on_exactly_one_chunk(server):
    chunks = list(server.client().completions.create(model="demo-chat", prompt="KING:",
                                                     max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []


def test_streamed_n_and_batched_prompts_equal_the_plain_response(server):
    kw = dict(model="demo-chat", prompt=["ROMEO:", "JULIET:"], max_tokens=12, temperature=0.9,
              seed=5, n=2)
    plain = server.client().completions.create(**kw)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in server.client().completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1, 2, 3]
    assert [texts[c.index] for c in plain.choices] == [c.text for c in plain.choices]
    assert [reasons[c.index] for c in plain.choices] == [c.finish_reason for c in plain.choices]


def test_stream_is_server_sent_events_ending_with_done(server):
    status, hdrs, body = _http(server.port, "POST", "/v1/completions", json.dumps(
        {"model": "demo-chat", "prompt": "ROMEO:", "max_tokens": 5, "temperature": 0,
         "stream": True}).encode())
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    # usage rides on the chunk that ends the stream
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_seeded_samples_and_n_equal_llm_generate(server, reference):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=7, n=3)
    want = reference.generate(["KING:"], params)[0]
    got = server.client().completions.create(model="demo-chat", prompt="KING:", max_tokens=20,
                                             temperature=0.9,
                                             top_p=0.95, seed=7, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert len({c.text for c in got.choices}) > 1  # the samples differ: n really sampled n times
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


def test_stop_strings_and_batched_prompts(server, reference):
    params = SamplingParams(temperature=0, max_tokens=40, stop=[" matter", "xyz"])
    want = reference.generate(["ROMEO:\n", "JULIET:\n"], params)
    got = server.client().completions.create(model="demo-chat", prompt=["ROMEO:\n", "JULIET:\n"],
                                             max_tokens=40,
                                             temperature=0, stop=[" matter", "xyz"])
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert all(c.finish_reason == "stop" and "matter" not in c.text for c in got.choices)


def test_streamed_text_with_stop_strings_equals_the_plain_response(server, reference):
    """Text that could still turn into a stop string is held back, never sent and then taken
    back."""
    kw = dict(model="demo-chat", prompt="ROMEO:\n", max_tokens=40, temperature=0,
              stop=[" the state", " matter"])
    plain = server.client().completions.create(**kw)
    streamed = "".join(
        c.choices[0].text for c in server.client().completions.create(**kw, stream=True)
    )
    want = reference.generate([kw["prompt"]],
                              SamplingParams(temperature=0, max_tokens=40, stop=kw["stop"]))[0]
    assert streamed == plain.choices[0].text == want.text and want.finish_reason == "stop"


def test_chat_completion_equals_llm_generate_on_the_template(server, reference, chat_model):
    messages = [{"role": "system", "content": "Speak as Romeo."},
                {"role": "user", "content": "Who goes there?"}]
    ids = load_chat_template(chat_model, reference.tokenizer).encode(messages, reference.tokenizer)
    assert ids.count(256) == 3  # the special token became its id, not the bytes of "<|endoftext|>"
    want = reference.generate([ids], SamplingParams(temperature=0, max_tokens=25))[0]
    client = server.client()
    got = client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=25,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want.token_ids))
    chunks = list(client.chat.completions.create(model="demo-chat", messages=messages,
                                                 max_tokens=25, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["demo-chat"]
    status, _, body = _http(server.port, "GET", "/health", headers={"Authorization": None})
    assert status == 200 and json.loads(body) == {"status": "ok"}


# ----------------------------------------------------------------------------- load and
# cancellation
def test_64_concurrent_streams_finish_and_the_pool_is_whole(server):
    lengths = [8 + (i * 7) % 40 for i in range(64)]  # 8..47 tokens each

    async def one(client, i):
        stream = await client.completions.create(
            model="demo-chat", prompt=f"Citizen {i}:", max_tokens=lengths[i], temperature=0.8,
            seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, usage = 0, None
        async for chunk in stream:
            pieces += bool(chunk.choices)
            usage = chunk.usage or usage
        return pieces, usage.completion_tokens

    async def main():
        client = server.aclient()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*[one(client, i) for i in range(64)]), DEADLINE
            )
        finally:
            await client.close()

    before = server.engine.num_steps
    results = asyncio.run(main())
    assert [tokens for _, tokens in results] == lengths
    assert [pieces for pieces, _ in results] == lengths  # every token streamed as its own chunk
    # they were batched, not served one by one
    assert server.engine.num_steps - before < sum(lengths) / 4
    _wait_for(lambda: _pool_whole(server.engine), "the pool to be whole", timeout=10)
    server.engine.engine.block_allocator.check_invariants()


def _hang_up_held(server, monkeypatch) -> tuple[StepGate, str]:
    """Stream, read two events, hold the engine, hang up, and wait until the server has seen it
    (the request's consumer is gone). Steps are then released one by one: nothing depends on
    speed."""
    _wait_for(lambda: _pool_whole(server.engine), "an idle server", timeout=30)
    gate = StepGate(server, monkeypatch)
    body = json.dumps({"model": "demo-chat", "prompt": "ROMEO:", "max_tokens": 120, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as s:
        s.sendall(_request_bytes("POST", "/v1/completions", body))
        seen = b""
        while seen.count(b"data: ") < 2:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream early"
            seen += chunk
        rid = next(iter(server.engine.engine.requests))
        gate.hold()  # from here each step waits for a permit (a step already running finishes)
    _wait_for(lambda: rid not in server.engine._queues, "the server to notice the "
                                                        "hang-up", timeout=30)
    return gate, rid


def test_client_disconnect_mid_stream_aborts_within_a_step(server, monkeypatch):
    gate, rid = _hang_up_held(server, monkeypatch)
    try:
        # the abort is applied now (between steps) or right after the step in flight
        assert rid not in server.engine.engine.requests or rid in server.engine._aborts
        gate.release(1)
        assert rid not in server.engine.engine.requests
    finally:
        gate.open()
    _wait_for(lambda: _pool_whole(server.engine), "the blocks to return", timeout=10)


def test_disconnect_negative_control_without_abort_the_request_runs_on(server, monkeypatch):
    """The test above must fail on an engine that ignores aborts."""
    monkeypatch.setattr(server.engine, "abort", lambda rid: None)
    gate, rid = _hang_up_held(server, monkeypatch)
    try:
        for _ in range(3):
            gate.release(1)
            assert rid in server.engine.engine.requests  # the check above would fail here
    finally:
        monkeypatch.undo()
        server.engine.abort(rid)
        gate.open()
    _wait_for(lambda: _pool_whole(server.engine), "the pool after the manual abort", timeout=10)


def test_client_disconnect_while_waiting_for_a_plain_response_aborts(server):
    _wait_for(lambda: _pool_whole(server.engine), "an idle server", timeout=30)
    aborted = ("vllm:request_success_total",
               (("engine", "0"), ("finished_reason", "abort"), ("model_name", "demo-chat")))
    before = _scrape(server.port).get(aborted, 0)
    core = server.engine.engine
    body = json.dumps({"model": "demo-chat", "prompt": "ROMEO:", "max_tokens": 120,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as s:
        s.sendall(_request_bytes("POST", "/v1/completions", body))
        _wait_for(lambda: core.requests, "the request to start", timeout=30)
        rid = next(iter(core.requests))
        _wait_for(lambda: len(core.requests[rid].samples[0].out.token_ids) >= 2 if rid in core.requests else True,
                  "two tokens", timeout=30)
    _wait_for(lambda: _pool_whole(server.engine), "the abort", timeout=10)
    assert _scrape(server.port)[aborted] == before + 1


# ----------------------------------------------------------------------------- bad input
def test_malformed_json_is_400_with_an_openai_error_body(server):
    status, _, body = _post(server.port, "/v1/completions", b'{"model": "demo-chat", "prompt": ')
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (
        body["error"]["type"] == "invalid_request_error"
        and "not valid JSON" in body["error"]["message"]
    )


@pytest.mark.parametrize("extra, says", [
    ({"foo": 1}, "unknown field 'foo'"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"tools": [{"type": "function"}]}, "unsupported field tools"),
    ({"temperature": -1}, "temperature=-1"),
    ({"top_p": "high"}, "field 'top_p'"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"n": 0}, "n=0"),
    ({"stream_options": {"include_usage": True}},
     "stream_options is only allowed with stream=true"),
])
def test_bad_fields_are_400_naming_them(server, extra, says):
    status, _, body = _post(server.port, "/v1/completions",
                            {"model": "demo-chat", "prompt": "Hi", **extra})
    assert status == 400, body
    assert says in body["error"]["message"]


def test_no_op_values_of_unimplemented_fields_are_accepted(server):
    got = server.client().completions.create(model="demo-chat", prompt="Hi", max_tokens=2,
                                             frequency_penalty=0,
                                             presence_penalty=0.0, logprobs=None, echo=False)
    assert got.usage.completion_tokens == 2


def test_oversized_prompt_is_400_with_both_lengths(server, reference):
    prompt = "x" * 300
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="demo-chat", prompt=prompt, max_tokens=4)
    message = e.value.body["message"]
    assert "300 tokens" in message and str(reference.max_model_len) in message


def test_missing_required_fields_and_wrong_model(server):
    status, _, body = _post(server.port, "/v1/completions", {"model": "demo-chat"})
    assert status == 400 and "'prompt' is required" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-4", prompt="Hi")
    assert "gpt-4" in e.value.body["message"] and "demo-chat" in e.value.body["message"]


def test_api_key_is_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model="demo-chat", prompt="Hi",
                                                          max_tokens=2)
    status, _, body = _post(server.port, "/v1/completions", {"model": "demo-chat", "prompt": "Hi"},
                            headers={"Authorization": None})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics"):  # probes and Prometheus stay open
        assert _http(server.port, "GET", path, headers={"Authorization": None})[0] == 200


def test_the_key_is_checked_before_the_body_is_read(server):
    status, _, body = _post(server.port, "/v1/completions", b'{"not json',
                            headers={"Authorization": None})
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_unknown_routes_are_404_with_an_openai_body_and_one_metric_label(server):
    other = ("nanoserve_http_requests_total",
             (("endpoint", "other"), ("model_name", "demo-chat"), ("status", "404")))
    before = _scrape(server.port).get(other, 0)
    for path in ("/v1/embeddings", "/nope-1", "/nope-2"):
        status, _, data = _http(server.port, "GET", path)
        assert status == 404 and json.loads(data)["error"]["message"].startswith(f"GET {path}")
    after = _scrape(server.port)
    assert after[other] == before + 3
    assert not any("nope" in str(labels) for _, labels in after)


@pytest.fixture(scope="module")
def small_server():
    """The plain demo model (no chat template, no key), one sequence at a time, one waiting slot."""
    core = LLMEngine.from_kwargs("demo", max_num_seqs=1, max_waiting=1, num_blocks=64)
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo", retry_after=2))
    yield srv
    srv.stop()


def _paused(srv: LiveServer, monkeypatch) -> threading.Event:
    """Hold every engine step until the returned event is set: requests queue up
    deterministically."""
    go = threading.Event()
    step = srv.engine._step

    def held():
        assert go.wait(DEADLINE), "the test never released the engine"
        return step()

    monkeypatch.setattr(srv.engine, "_step", held)
    return go


def test_full_queue_is_429_with_retry_after(small_server, monkeypatch):
    srv = small_server
    _wait_for(lambda: _pool_whole(srv.engine), "an idle server", timeout=30)
    go = _paused(srv, monkeypatch)
    long = json.dumps({"model": "demo", "prompt": "A", "max_tokens": 120, "ignore_eos": True,
                       "stream": True}).encode()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=DEADLINE) as waiting:
            waiting.sendall(_request_bytes("POST", "/v1/completions", long))
            _wait_for(
                lambda: len(srv.engine.engine.scheduler.waiting) + srv.engine.num_pending == 1,
                "the first request to take the one waiting slot", timeout=30,
            )
            status, hdrs, body = _post(srv.port, "/v1/completions",
                                       {"model": "demo", "prompt": "B"})
            go.set()
    finally:
        go.set()
    assert status == 429 and hdrs["retry-after"] == "2"
    assert (
        body["error"]["type"] == "rate_limit_error" and "max_waiting=1" in body["error"]["message"]
    )
    _wait_for(lambda: _pool_whole(srv.engine), "the hung-up request to be aborted", timeout=30)


def test_a_refused_batch_leaves_nothing_behind(small_server):
    """Two prompts, one waiting slot: the first is queued, the second refused, and the first
    undone."""
    srv = small_server
    _wait_for(lambda: _pool_whole(srv.engine), "an idle server", timeout=30)
    status, _, body = _post(srv.port, "/v1/completions",
                            {"model": "demo", "prompt": ["a", "b"], "max_tokens": 4})
    assert status == 429
    assert srv.engine._queues == {} and srv.engine.num_pending == 0 and _pool_whole(srv.engine)


def test_chat_on_a_model_without_template_is_400(small_server):
    status, _, body = _post(small_server.port, "/v1/chat/completions",
                            {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and "no chat template" in body["error"]["message"]


# ----------------------------------------------------------------------------- metrics
def _scrape(port) -> dict[tuple[str, tuple], float]:
    status, hdrs, body = _http(port, "GET", "/metrics")
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_metrics_parse_and_count_what_was_sent(small_server):
    srv = small_server
    _wait_for(lambda: _pool_whole(srv.engine), "an idle server", timeout=30)
    before = _scrape(srv.port)
    client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=DEADLINE)
    lengths = [3, 5, 9]
    # 40 token ids: 3 blocks of 16, of which 2 full blocks can be prefix hits
    prompt = list(range(65, 105))
    outs = [client.completions.create(model="demo", prompt=prompt, max_tokens=k,
                                      extra_body={"ignore_eos": True})
            for k in lengths]
    for bad in ({"temperature": -1}, {"foo": 1}):
        assert _post(srv.port, "/v1/completions", {"model": "demo", "prompt": "x", **bad})[0] == 400
    after = _scrape(srv.port)
    d = lambda name, **labels: (
        after.get((name, tuple(sorted(labels.items()))), 0)
        - before.get(  # noqa: E731
            (name, tuple(sorted(labels.items()))), 0
        )
    )
    v = {"model_name": "demo", "engine": "0"}  # the labels of vLLM's metrics
    http = {"model_name": "demo", "endpoint": "/v1/completions"}
    assert d("nanoserve_http_requests_total", **http, status="200") == 3
    assert d("nanoserve_http_requests_total", **http, status="400") == 2
    assert d("vllm:request_success_total", **v, finished_reason="length") == 3
    assert d("vllm:generation_tokens_total", **v) == sum(lengths)
    assert d("vllm:prompt_tokens_total", **v) == sum(o.usage.prompt_tokens for o in outs)
    assert d("vllm:time_to_first_token_seconds_count", **v) == 3
    assert d("vllm:e2e_request_latency_seconds_count", **v) == 3
    assert d("vllm:inter_token_latency_seconds_count", **v) == sum(k - 1 for k in lengths)
    vllm_labels = tuple(sorted(v.items()))
    assert after[("vllm:num_requests_running", vllm_labels)] == 0
    assert after[("vllm:num_requests_waiting", vllm_labels)] == 0
    own = (("model_name", "demo"),)
    assert after[("nanoserve_kv_cache_blocks_free",
                  own)] == after[("nanoserve_kv_cache_blocks_total", own)] == 64
    # each request looks up its 40 prompt tokens; the 2nd and 3rd find the first 2 blocks (32
    # tokens) cached (the block of the last token is always computed)
    assert d("vllm:prefix_cache_queries_total", **v) == 120
    assert d("vllm:prefix_cache_hits_total", **v) == 64


def test_metrics_show_speculative_acceptance_when_enabled():
    core = LLMEngine.from_kwargs("demo", speculative_model="demo-draft", num_speculative_tokens=3,
                     speculative_cost=0.1)  # pinned: it speculates whatever the machine's speed
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=DEADLINE)
        client.completions.create(model="demo", prompt="ROMEO:", max_tokens=30, temperature=0)
        m = _scrape(srv.port)
        v = (("engine", "0"), ("model_name", "demo"))
        drafts, drafted, accepted = (m[(f"vllm:spec_decode_num_{k}_total", v)]
                                     for k in ("drafts", "draft_tokens", "accepted_tokens"))
        # acceptance rate = accepted / drafted, mean acceptance length = 1 + accepted / drafts
        assert 0 < drafts <= drafted and 0 <= accepted <= drafted
    finally:
        srv.stop()


def test_a_failed_engine_answers_500_then_503_and_health_stays_503(monkeypatch):
    core = LLMEngine.from_kwargs("demo", num_blocks=32)
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        def broken():
            raise RuntimeError("boom")
        monkeypatch.setattr(core, "step", broken)
        status, _, body = _post(srv.port, "/v1/completions",
                                {"model": "demo", "prompt": "Hi", "max_tokens": 3})
        assert (
            status == 500 and body["error"]["type"] == "server_error"
            and "boom" in body["error"]["message"]
        )
        assert _http(srv.port, "GET", "/health")[0] == 503
        status, _, body = _post(srv.port, "/v1/completions",
                                {"model": "demo", "prompt": "Hi", "max_tokens": 3})
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        # a new request does not revive a broken engine
        assert _http(srv.port, "GET", "/health")[0] == 503
        m = _scrape(srv.port)
        for code in ("500", "503"):
            assert m[("nanoserve_http_requests_total", (("endpoint", "/v1/completions"),
                                                         ("model_name", "demo"),
                                                         ("status", code)))] == 1
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- the CLI, a real
# process
def test_nanoserve_serve_cli_answers_the_openai_client_and_stops_on_sigint(reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("nanoserve")
    proc = subprocess.Popen([str(exe), "serve", "--model", "demo", "--port", str(port),
                             "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NANOSERVE_API_KEY": ""})
    try:
        def up():
            assert proc.poll() is None, proc.stderr.read()
            try:
                return _http(port, "GET", "/health")[0] == 200
            except OSError:
                return False
        _wait_for(up, "nanoserve serve to answer /health", timeout=DEADLINE, interval=0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        got = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=12, temperature=0)
        want = LLM("demo").generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=12))[0]
        assert got.choices[0].text == want.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    assert "serving demo on http://127.0.0.1:" in proc.stderr.read()


def test_nanoserve_serve_cli_bad_input_is_one_line():
    exe = Path(sys.executable).with_name("nanoserve")
    r = subprocess.run(
        [str(exe), "serve", "--port", "70000"], capture_output=True, text=True, timeout=60
    )
    assert (
        r.returncode == 2
        and r.stderr.strip() == "nanoserve: error: --port 70000 is not a TCP port (1..65535)"
    )


# ----------------------------------------------------------------------------- bench serve
def test_bench_serve_counts_every_token_it_asked_for(server, tmp_path):
    from nanoserve.tools.bench import make_workload
    from nanoserve.tools.bench_serve import SAFE_VOCAB, bench_serve, format_bench_serve

    out = tmp_path / "serve.json"
    res = bench_serve(server.url, rates=(50.0,), n=8, in_range=(4, 12), out_range=(4, 12),
                      slo_ttft_ms=60_000,
                      slo_tpot_ms=60_000, api_key=KEY, out=str(out))
    row = res["results"]["50.0"]
    assert row["failed"] == 0 and row["num_requests"] == 8
    _, params = make_workload(8, (4, 12), (4, 12), SAFE_VOCAB, 0)
    assert row["output_throughput"] * row["duration"] == pytest.approx(
        sum(p.max_tokens for p in params)
    )
    # SLOs of a minute: every request is good
    assert row["goodput"] == pytest.approx(row["request_throughput"])
    assert 0 < row["ttft"]["p50"] <= row["ttft"]["p99"] and row["itl"]["p50"] > 0
    assert json.loads(out.read_text())["results"]["50.0"]["num_requests"] == 8
    assert "50.0" in format_bench_serve(res)
