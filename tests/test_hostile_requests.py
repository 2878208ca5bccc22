"""No request can crash, freeze or starve the server (serving/limits.py, engine/grammar_limits.py).

Each attack goes to the real `nanoserve serve` in a subprocess (a crash there is a dead process,
not a failed test in this one), while a thread asks /health over and over: every attack must get
its 400 naming the limit, /health must answer every time within HEALTH_BOUND, and afterwards the
process is alive and every KV block free. The in-process cases hold the grammar pool at will
(nothing here assumes how fast a compile or a step is) and count what ran. A hypothesis fuzzer
sends bounded random constraints and checks that none gets a 5xx or kills the process.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from live_server import DEADLINE, KEY, TEMPLATE  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nanoserve.parallel.launch import free_port  # noqa: E402

# /health is one small JSON reply on the event loop (~1 ms): a second is the bound, and far
# above any wait but a blocked loop
HEALTH_BOUND = 1.0
LIMIT_FLAGS = ["--max-prompts-per-request", "64", "--max-prompt-tokens-per-request", "4096",
               "--max-chat-messages", "16"]
CHAIN = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(3000)) + 'r3000: "b"\n'
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                             "required": ["next"]}}, "$ref": "#/$defs/n"}


# ----------------------------------------------------------------------------- a server process
class ServerProcess:
    """`nanoserve serve --model demo` on a free port, with a chat template and an API key."""

    def __init__(self, tmp: Path, *flags: str):
        template = tmp / "template.jinja"
        template.write_text(TEMPLATE)
        self.port = free_port()
        self.log = tmp / f"server-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoserve", "serve", "--model", "demo", "--port",
             str(self.port),
             "--api-key", KEY, "--chat-template", str(template), "--log-level", "warning", *flags],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        end = time.monotonic() + DEADLINE
        while not self.healthy():
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < end, "the server did not start"
            time.sleep(0.1)  # polling for start-up under a deadline

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body=None, key: str | None = KEY,
                timeout: float = DEADLINE) -> tuple[int, dict | bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers)
            answer = conn.getresponse()
            raw = answer.read()
        finally:
            conn.close()
        try:
            return answer.status, json.loads(raw)
        except ValueError:
            return answer.status, raw

    def free_blocks(self) -> tuple[float, float]:
        text = self.request("GET", "/metrics")[1].decode()
        values = {family.name: family.samples[0].value
                  for family in text_string_to_metric_families(text)
                  if family.name.startswith("nanoserve_kv_cache_blocks")}
        return values["nanoserve_kv_cache_blocks_free"], values["nanoserve_kv_cache_blocks_total"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class HealthProbe:
    """A thread asking /health until stopped; `worst` is the slowest answer (a refused or failed
    request counts as infinitely slow)."""

    def __init__(self, server: ServerProcess):
        self.server, self.worst, self.count = server, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                ok = self.server.request("GET", "/health", timeout=30)[0] == 200
            except OSError:
                ok = False
            took = time.monotonic() - start if ok else float("inf")
            self.worst, self.count = max(self.worst, took), self.count + 1
            self._stop.wait(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Bystander:
    """A greedy stream of TOKENS tokens in a thread: the arrival time of each chunk; `first` is set
    at the first one (an attack is sent then, so it runs while the stream does)."""

    TOKENS = 30

    def __init__(self, server: ServerProcess):
        self.server, self.times = server, []
        self.first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=DEADLINE)
        body = completion(prompt="ROMEO:", max_tokens=self.TOKENS, temperature=0, ignore_eos=True,
                          stream=True)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        for line in conn.getresponse():
            if line.startswith(b"data: {"):
                self.times.append(time.monotonic())
                self.first.set()
        conn.close()
        self.first.set()

    def largest_gap(self) -> float:
        self._thread.join(DEADLINE)
        assert len(self.times) >= self.TOKENS, "the bystander's stream was cut"
        return max(b - a for a, b in zip(self.times, self.times[1:]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("hostile"), *LIMIT_FLAGS)
    yield srv
    srv.stop()


def completion(**fields) -> dict:
    return {"model": "demo", "prompt": "ROMEO:", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields,
    }


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# ----------------------------------------------------------------------------- every attack, a 400
ATTACKS = {  # name: (path, body, what the 400 must say)
    "3,000 chained Lark rules": ("/v1/completions", completion(guided_grammar=CHAIN),
                                 "max_rules=1000"),
    "a regex of 999,000 a's, n=4": ("/v1/completions",
                                    completion(guided_regex="(a{1000}){999}", n=4),
                                    "max_regex_size=10000"),
    "one choice of a million bytes": ("/v1/completions", completion(guided_choice=["a" * 10**6]),
                                      "max_bytes=65536"),
    "an object requiring itself": ("/v1/completions", completion(guided_json=RECURSIVE),
                                   "no finite value"),
    "two arrays requiring each other": ("/v1/completions", completion(guided_json={"$defs": {
        "a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 1},
        "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"}),
        "no finite value"),
    "a -> b -> a": ("/v1/completions", completion(guided_json={"$defs": {"a": {"$ref": "#/$defs/b"},
                                                                         "b": {"$ref": "#/$defs/a"}},
                                                               "$ref": "#/$defs/a"}),
                    "no finite value"),
    "a tool whose parameters require themselves": (
        "/v1/chat/completions", chat(tools=[tool(RECURSIVE)], tool_choice="required"),
        "no finite value"),
    "start: start": ("/v1/completions", completion(guided_grammar="start: start"),
                     "admits no output"),
    "start: a, a: a": ("/v1/completions", completion(guided_grammar="start: a\na: a"),
                       "admits no output"),
    "logit_bias key ²": ("/v1/completions", completion(logit_bias={"²": 1}), "is not a token id"),
    "logit_bias key ①": ("/v1/completions", completion(logit_bias={"①": 1}), "is not a token id"),
    "logit_bias key of 5,000 digits": ("/v1/completions", completion(logit_bias={"9" * 5000: 1}),
                                       "is not a token id"),
    "top_logprobs 10**6": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=10**6),
                           "top_logprobs=1000000 must be an integer in [0, 20]"),
    "65 prompts": ("/v1/completions", completion(prompt=["a"] * 65), "max_prompts_per_request=64"),
    "64 prompts of 100 tokens": ("/v1/completions", completion(prompt=["ab" * 50] * 64),
                                 "max_prompt_tokens_per_request=4096"),
    "17 chat messages": ("/v1/chat/completions",
                         chat(messages=[{"role": "user", "content": "a"}] * 17),
                         "max_chat_messages=16"),
    "tokenize 3.9 MB": ("/tokenize", {"prompt": "ab " * 1_300_000},
                        "max_prompt_tokens_per_request=4096"),
    "tokenize 3.9 MB with strings": ("/tokenize",
                                     {"prompt": "ab " * 1_300_000, "return_token_strs": True},
                                     "max_prompt_tokens_per_request=4096"),
    "tokenize 17 messages": ("/tokenize", {"messages": [{"role": "user", "content": "a"}] * 17},
                             "max_chat_messages=16"),
    "detokenize 5,000 ids": ("/detokenize", {"tokens": [65] * 5000},
                             "max_prompt_tokens_per_request=4096"),
}


@pytest.fixture(scope="module")
def gap_alone(server) -> float:
    """The bystander's largest gap between tokens with no attack beside it."""
    return Bystander(server).largest_gap()


@pytest.mark.parametrize("name", ATTACKS)
def test_each_attack_is_a_400_naming_its_limit_and_health_answers_throughout(
    server, gap_alone, name
):
    """The attack's 400, /health within HEALTH_BOUND throughout, and a bystander stream that goes
    on: all its tokens, its largest gap within the larger of HEALTH_BOUND and 20× its gap alone (a
    ratio to the same stream on the same machine, not a speed)."""
    path, body, says = ATTACKS[name]
    bystander = Bystander(server)
    assert bystander.first.wait(DEADLINE)
    with HealthProbe(server) as probe:
        status, answer = server.request("POST", path, body)
    assert status == 400 and says in answer["error"]["message"], (status, answer)
    assert probe.count >= 1 and probe.worst <= HEALTH_BOUND, probe.worst
    assert bystander.largest_gap() <= max(HEALTH_BOUND, 20 * gap_alone)
    assert server.proc.poll() is None
    free, total = server.free_blocks()
    assert free == total  # every KV block back in the pool


def test_requests_under_the_limits_are_served(server):
    """The controls of the batch and tokenizer limits: at the limits, the same requests succeed."""
    status, answer = server.request("POST", "/v1/completions",
                                    completion(prompt=["a"] * 64, max_tokens=1))
    assert status == 200 and len(answer["choices"]) == 64
    status, answer = server.request("POST", "/tokenize", {"prompt": "ab " * 1300})
    assert status == 200 and answer["count"] <= 4096 and len(answer["tokens"]) == answer["count"]
    status, answer = server.request("POST", "/v1/completions",
                                    completion(guided_json={"type": "object", "properties": {
                                        "a": {"type": "integer"}}, "required": ["a"]},
                                               max_tokens=20))
    assert status == 200 and answer["choices"][0]["text"].startswith('{"a": ')
    # a tool whose parameters use their own $defs (rebased under the tool-call wrapper)
    params = {"$defs": {"n": {"enum": [1, 2]}}, "type": "object",
              "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
              "additionalProperties": False}
    status, answer = server.request("POST", "/v1/chat/completions",
                                    chat(tools=[tool(params)], tool_choice="required",
                                         max_tokens=40,
                                         parallel_tool_calls=False))
    assert status == 200, answer
    call = answer["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"])["x"] in (1, 2)


def test_only_health_and_metrics_are_open_without_the_key(server):
    for path in ("/tokenize", "/detokenize"):
        assert server.request("POST", path, {"prompt": "a"}, key=None)[0] == 401
    for path in ("/tokenizer_info", "/docs", "/openapi.json", "/v1/models"):
        assert server.request("GET", path, key=None)[0] == 401
    for path in ("/health", "/metrics"):
        assert server.request("GET", path, key=None)[0] == 200
    assert server.request("GET", "/tokenizer_info")[0] == 200  # control: with the key


# ----------------------------------------------------------------------------- a fuzzer
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))
SCHEMAS = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": st.integers(0, 3),
                                        "maxItems": st.integers(0, 3)}),
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.sampled_from("abcd"), inner, max_size=3)},
                              optional={"required": st.lists(st.sampled_from("abcde"), max_size=3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/x", "#/properties/a"])}),
        st.fixed_dictionaries({"enum": st.lists(JSON_SCALARS, min_size=1, max_size=3)})),
    max_leaves=10)
REGEX_TEXT = st.text(alphabet="ab()[]{}|*+?\\.,0123456789^$-", max_size=40)
LARK_TEXT = st.lists(st.sampled_from(["start: ", "a", " | ", '"x"', "\n", "a: ", "start", "(", ")", "*",
                                      "/[a-z]+/", "B: ", "B", "~", "3", "?", "%ignore "]),
                     max_size=25).map("".join)
CONSTRAINTS = st.one_of(
    st.builds(lambda s: {"guided_json": s}, SCHEMAS),
    st.builds(lambda r: {"guided_regex": r}, REGEX_TEXT),
    st.builds(lambda g: {"guided_grammar": g}, LARK_TEXT),
    st.builds(lambda c: {"guided_choice": c}, st.lists(st.text(max_size=8), max_size=4)),
    st.builds(lambda s: {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": s}}},
              SCHEMAS),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(constraint=CONSTRAINTS, via_tools=st.booleans())
def test_fuzzed_constraints_never_get_a_5xx_or_kill_the_server(server, constraint, via_tools):
    if via_tools and "guided_json" in constraint:
        body = chat(tools=[tool(constraint["guided_json"])], tool_choice="required")
        path = "/v1/chat/completions"
    else:
        body, path = completion(**constraint, max_tokens=3), "/v1/completions"
    status, answer = server.request("POST", path, body)
    assert status in (200, 400), (status, answer, body)
    assert server.proc.poll() is None


# ----------------------------------------------------------------------------- budget and SIGTERM
def test_a_mask_over_its_budget_fails_alone_and_sigterm_cuts_what_is_in_flight(tmp_path):
    """A server whose mask budget nothing meets: a grammar request compiles (the first mask is the
    compile's, off the step) and then fails at its first step with a 400 naming the budget, while a
    plain request beside it is served. Then SIGTERM during a request of 64 prompts, one sequence per
    step (thousands of steps of work): the server exits 0 after its grace, the response is cut."""
    srv = ServerProcess(tmp_path, "--grammar-mask-budget-ms", "0.000001", "--shutdown-grace", "1",
                        "--max-num-seqs", "1")
    try:
        results = {}
        plain = threading.Thread(target=lambda: results.update(
            plain=srv.request("POST", "/v1/completions", completion(max_tokens=8))))
        plain.start()
        status, answer = srv.request("POST", "/v1/completions", completion(guided_regex="[a-z]+@x"))
        plain.join()
        assert status == 400 and "GrammarLimits.mask_budget_ms=" in answer["error"]["message"], (
            answer
        )
        assert results["plain"][0] == 200 and results["plain"][1]["usage"]["completion_tokens"] == 8
        free, total = srv.free_blocks()
        assert free == total

        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=DEADLINE)
        body = completion(prompt=["a"] * 64, max_tokens=120, ignore_eos=True, stream=True)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")  # tokens flow
        srv.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises it at exit
        assert srv.proc.wait(timeout=DEADLINE) in (0, -signal.SIGTERM)
        try:
            rest = stream.read()
        except http.client.IncompleteRead as cut:  # the chunked body ends mid-way
            rest = cut.partial
        assert b"data: [DONE]" not in rest  # cut after the grace, not served to the end
        conn.close()
    finally:
        srv.stop()
