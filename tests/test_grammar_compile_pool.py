"""Compiling a grammar holds no one else up (engine/structured_output.py, GrammarCompiler).

The pool's compiles are held at will (a gate in front of each), so nothing here assumes how fast a
compile is: while every pool thread is held, plain completions, /tokenize and /health are served;
the grammar requests get a 400 naming the compile deadline once it passes; two requests for the
same constraint share one compile; a request whose compile never started gets a 429 and its job is
dropped; and once released, the held constraints serve from the cache.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from live_server import DEADLINE, LiveServer, _pool_whole, _post, _wait_for  # noqa: E402

from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.engine.grammar_limits import GrammarLimits  # noqa: E402
from nanoserve.engine.structured_output import GrammarCompiler  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

REGEXES = ["[a-c]{2}x", "[d-f]{2}y", "[g-i]{2}z"]


def test_held_compiles_hold_nothing_else_and_time_out_by_name(monkeypatch):
    limits = GrammarLimits(compile_timeout_s=1.0, compile_threads=2)
    srv = LiveServer(
        create_app(
            AsyncLLMEngine(LLMEngine.from_kwargs("demo", grammar_limits=limits)), "demo",
            api_key="sk-test-key",
        )
    )
    gate, started = threading.Event(), []
    compile_for_real = GrammarCompiler._compile

    def held(self, params, key):
        started.append(params.regex)
        gate.wait(DEADLINE)
        return compile_for_real(self, params, key)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)
    answers: dict[int, tuple] = {}

    def ask(i: int, regex: str) -> None:
        body = {"model": "demo", "prompt": "a", "max_tokens": 4, "guided_regex": regex}
        answers[i] = _post(srv.port, "/v1/completions", body)[::2]

    # the first regex six times (one compile for all: more requests than the event loop's worker
    # threads, which none of them holds), then two more: 2 pool threads, 3 compiles
    regexes = REGEXES[:1] * 5 + REGEXES
    asks = [threading.Thread(target=ask, args=(i, r)) for i, r in enumerate(regexes)]
    try:
        for t in asks:
            t.start()
        _wait_for(lambda: len(started) == 2, "both pool threads to hold a compile")
        # while every pool thread is held: the rest of the server is not
        plain = _post(srv.port, "/v1/completions",
                      {"model": "demo", "prompt": "a", "max_tokens": 5})
        assert plain[0] == 200 and plain[2]["usage"]["completion_tokens"] == 5
        assert _post(srv.port, "/tokenize", {"prompt": "hello"})[0] == 200
        for t in asks:
            t.join(DEADLINE)
        assert len(started) == 2  # still held: the grammar requests gave up on their own deadline
        held = list(started)
        for i, (status, body) in sorted(answers.items()):
            message = body["error"]["message"]
            if regexes[i] in held:  # compiles that ran past the deadline: too slow for the limits
                assert status == 400 and "GrammarLimits.compile_timeout_s=1.0" in message, body
            else:  # never started, behind the others: busy, retry (and its job was dropped)
                assert status == 429 and "without starting" in message, body
    finally:
        gate.set()
    compiler = srv.engine.engine.inputs.grammars
    _wait_for(lambda: compiler.num_cached == 2, "the two held compiles to finish")
    # one compile each (the held ones: 7 requests, 2 compiles)
    assert sorted(started) == sorted(held)
    for regex in REGEXES:  # cached now, or (the dropped one) compiled now: served
        body = {"model": "demo", "prompt": "a", "max_tokens": 3, "guided_regex": regex}
        status, _, answer = _post(srv.port, "/v1/completions", body)
        assert status == 200 and answer["choices"][0]["text"][:2].isalpha()
    assert sorted(started) == sorted(REGEXES)
    _wait_for(lambda: _pool_whole(srv.engine), "the pool to be whole")
    srv.stop()
