"""The server under bad input and faults (issue 16), through a real uvicorn on loopback.

- The bodies that used to pass validation and then kill the engine in `step()` are 400s, and
  after each a normal request and /health still succeed with the pool whole.
- A fault injected into one request's row fails that request alone (a 500, or an error event in
  its stream) while a stream beside it completes; negative control: an engine that lets the
  fault escape `step()`, as before, fails the same check.
- Strict types, a body-size limit (413), tokenization off the event loop.
"""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from live_server import (  # noqa: E402
    DEADLINE,
    POISON,
    LiveServer,
    StepGate,
    _dechunk,
    _http,
    _pool_whole,
    _post,
    _request_bytes,
    _wait_for,
    poisoned_engine,
)

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def srv():
    server = LiveServer(create_app(AsyncLLMEngine(poisoned_engine()), "demo",
                                   max_body_bytes=64 * 1024))
    yield server
    server.stop()


def _ok_afterwards(srv) -> None:
    """A normal request and /health succeed, and every block is back in the pool."""
    status, _, body = _post(srv.port, "/v1/completions",
                            {"model": "demo", "prompt": "ROMEO:", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    assert _http(srv.port, "GET", "/health")[0] == 200
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole", timeout=30)
    srv.engine.engine.block_allocator.check_invariants()


# ----------------------------------------------------------------------------- the bodies from the
# issue
@pytest.mark.parametrize("body, says", [
    ({"prompt": "a", "max_tokens": 3, "n": 2, "seed": 18446744073709551615},
     "seed=18446744073709551615"),
    ({"prompt": "a", "max_tokens": 3, "n": 2, "seed": 2**63 - 1}, "n=2"),
    ({"prompt": "hi", "max_tokens": 3, "top_p": 1e-300}, "top_p=1e-300"),
    ({"prompt": "aaaa", "max_tokens": 5, "repetition_penalty": 1e-300},
     "repetition_penalty=1e-300"),
    ({"prompt": "a", "seed": 2**64}, "seed=18446744073709551616"),
    ({"prompt": "a", "seed": -2**63 - 1}, "seed=-9223372036854775809"),
    ({"prompt": "a", "max_tokens": "5"}, "field 'max_tokens'"),
    ({"prompt": "a", "stream": "yes"}, "field 'stream'"),
    ({"prompt": "a", "n": 2.0}, "field 'n'"),
    ({"prompt": "a", "seed": "1"}, "field 'seed'"),
    ({"prompt": [1, 2.5]}, "field 'prompt"),
])
def test_bodies_that_used_to_kill_the_engine_are_400(srv, body, says):
    status, _, reply = _post(srv.port, "/v1/completions", {"model": "demo", **body})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert says in reply["error"]["message"], reply
    _ok_afterwards(srv)


# ----------------------------------------------------------------------------- a fault in one row
def _read_stream(port: int, body: dict, into: dict) -> None:
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
        s.sendall(_request_bytes("POST", "/v1/completions", raw))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    events = [e[len(b"data: "):] for e in _dechunk(rest).split(b"\n\n") if e.startswith(b"data: ")]
    into["events"] = [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def _poison_beside_a_stream(srv, monkeypatch, poison_stream: bool = False) -> dict:
    """Stream A runs; the engine is held while a POISON request joins; then both run in one
    batch."""
    _wait_for(lambda: _pool_whole(srv.engine), "an idle server", timeout=30)
    gate = StepGate(srv, monkeypatch)
    a: dict = {}
    body_a = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 40, "ignore_eos": True,
              "stream": True,
              "temperature": 0}
    ta = threading.Thread(target=_read_stream, args=(srv.port, body_a, a))
    ta.start()
    core = srv.engine.engine
    _wait_for(
        lambda: any(len(r.samples[0].out.token_ids) >= 1 for r in list(core.requests.values())),
        "stream A's first token", timeout=DEADLINE,
    )
    gate.hold()
    b: dict = {}
    body_b = {"model": "demo", "prompt": POISON, "max_tokens": 5, "stream": poison_stream}
    if poison_stream:
        tb = threading.Thread(target=_read_stream, args=(srv.port, body_b, b))
    else:
        tb = threading.Thread(
            target=lambda: b.update(reply=_post(srv.port, "/v1/completions", body_b))
        )
    tb.start()
    _wait_for(lambda: srv.engine.num_pending + len(core.scheduler.waiting) >= 1,
              "the POISON request to queue")
    gate.open()
    tb.join(DEADLINE)
    ta.join(DEADLINE)
    return {"a": a["events"], "b": b, "health": _http(srv.port, "GET", "/health")[0]}


def _isolated(outcome: dict, expected_a: str) -> bool:
    chunks = [e for e in outcome["a"] if isinstance(e, dict) and "choices" in e]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return (
        outcome["a"][-1] == "[DONE]"
        and not any("error" in e for e in outcome["a"] if isinstance(e, dict))
        and text == expected_a and outcome["health"] == 200
    )


@pytest.fixture(scope="module")
def expected_a() -> str:
    return LLM("demo").generate("ROMEO:",
                                SamplingParams(temperature=0, max_tokens=40,
                                               ignore_eos=True))[0].text


def test_a_fault_in_one_row_is_a_500_for_that_request_alone(srv, monkeypatch, expected_a):
    outcome = _poison_beside_a_stream(srv, monkeypatch)
    status, _, body = outcome["b"]["reply"]
    assert status == 500 and body["error"]["code"] == "request_failed", body
    assert "injected fault in the POISON row" in body["error"]["message"]
    assert _isolated(outcome, expected_a)
    _ok_afterwards(srv)


def test_a_fault_in_a_streamed_row_ends_that_stream_with_an_error_event(
    srv, monkeypatch, expected_a
):
    outcome = _poison_beside_a_stream(srv, monkeypatch, poison_stream=True)
    events = outcome["b"]["events"]
    assert events[-1] == "[DONE]" and "injected fault" in events[-2]["error"]["message"], events
    assert _isolated(outcome, expected_a)
    _ok_afterwards(srv)


def test_isolation_negative_control_an_escaping_fault_fails_the_check(monkeypatch, expected_a):
    server = LiveServer(create_app(AsyncLLMEngine(poisoned_engine(isolated=False)), "demo"))
    try:
        outcome = _poison_beside_a_stream(server, monkeypatch)
        assert not _isolated(outcome, expected_a)
        assert outcome["health"] == 503 and any(
            "error" in e for e in outcome["a"] if isinstance(e, dict)
        )
    finally:
        server.stop()


# ----------------------------------------------------------------------------- body size, threads
def test_a_body_over_the_limit_is_413_with_an_openai_error(srv):
    big = json.dumps({"model": "demo", "prompt": "a" * (64 * 1024)}).encode()
    status, _, body = _post(srv.port, "/v1/completions", big)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"{len(big)} bytes" in body["error"]["message"] and "65536" in body["error"]["message"]
    _ok_afterwards(srv)


def _raw(port: int, head: bytes, body_pieces=()) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
        s.sendall(head)
        for piece in body_pieces:
            s.sendall(piece)
        data = b""
        # a reset here means the server closed before reading our body
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_a_chunked_body_is_counted_as_it_arrives(srv):
    piece = b" " * 8192
    head = _request_bytes("POST", "/v1/completions", None, {"Transfer-Encoding": "chunked"})
    # 80 KB, no Content-Length
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 10 + [b"0\r\n\r\n"]
    data = _raw(srv.port, head, chunks)
    # the size is exact when the last chunk arrived with the one that crossed the limit, else "more
    # than N"
    assert data.startswith(b"HTTP/1.1 413") and re.search(rb"body is (more than \d+|81920) bytes",
                                                          data), data[:400]
    _ok_afterwards(srv)


def test_a_client_expecting_100_continue_is_refused_before_it_sends(srv):
    head = _request_bytes("POST", "/v1/completions", None,
                          {"Content-Length": str(10 << 20), "Expect": "100-continue"})
    data = _raw(srv.port, head)  # the 10 MB body is never sent: the answer comes first
    assert data.startswith(b"HTTP/1.1 413") and b"10485760 bytes" in data, data[:300]


def test_prompts_are_tokenized_off_the_event_loop_and_health_answers_meanwhile(srv, monkeypatch):
    """The tokenizer is held until /health has answered: on the event loop, /health would wait."""
    tok = srv.engine.engine.tokenizer
    encode, entered, health_done, threads = tok.encode, threading.Event(), threading.Event(), []

    def held_encode(text, bos=False):
        threads.append(threading.current_thread())
        entered.set()
        assert health_done.wait(DEADLINE), (
            "/health never answered while a prompt was being tokenized"
        )
        return encode(text, bos=bos)

    monkeypatch.setattr(tok, "encode", held_encode)
    reply: dict = {}
    t = threading.Thread(
        target=lambda: reply.update(
            r=_post(
                srv.port, "/v1/completions", {"model": "demo", "prompt": "slow", "max_tokens": 2}
            )
        )
    )
    t.start()
    assert entered.wait(DEADLINE)
    assert _http(srv.port, "GET", "/health")[0] == 200
    health_done.set()
    t.join(DEADLINE)
    assert reply["r"][0] == 200 and threads[0] is not srv.thread
