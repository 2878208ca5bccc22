"""Test helpers for the HTTP server: a real uvicorn on 127.0.0.1 in a thread, raw-socket HTTP, and
waiting on conditions with a deadline (never a sleep that assumes a speed).

Imported by name (`from live_server import LiveServer`), like testdata.py.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import openai
import uvicorn

from nanoserve.engine import LLMEngine
from nanoserve.models.loader import resolve_model_path
from nanoserve.serving.async_engine import AsyncLLMEngine

KEY = "sk-test-key"
# turns separated by the special token <|endoftext|> (id 256 in the demo's byte-level vocabulary)
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant:\n{% endif %}")
DEADLINE = 120  # seconds: no test waits longer for a server


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a thread of this process, on a port the OS picked."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        _wait_for(lambda: self.server.started, "the server to start")
        self.url = f"http://127.0.0.1:{self.port}/v1"

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.app.state.engine

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", KEY), max_retries=0,
                             timeout=DEADLINE, **kw)

    def aclient(self):
        return openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=DEADLINE)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _wait_for(cond, what: str, timeout: float = DEADLINE, interval: float = 0.002):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _pool_whole(engine: AsyncLLMEngine) -> bool:
    core = engine.engine
    return (not core.has_unfinished_requests() and engine.num_pending == 0
            and core.block_allocator.num_free_blocks() == core.block_allocator.num_blocks)


def chat_server(path: Path, names, **engine_kwargs) -> LiveServer:
    """A LiveServer of the checkpoint at `path` (demo_chat_model's) under `names`, with the API key
    KEY and the checkpoint's chat template; `engine_kwargs` go to its LLMEngine (256 blocks unless
    they say otherwise)."""
    from nanoserve.serving.chat import load_chat_template
    from nanoserve.serving.server import create_app

    core = LLMEngine.from_kwargs(str(path), **{"num_blocks": 256, **engine_kwargs})
    return LiveServer(create_app(AsyncLLMEngine(core), names, api_key=KEY,
                                 chat_template=load_chat_template(path, core.tokenizer)))


def demo_chat_model(path: Path) -> Path:
    """The demo model copied to `path`, with a chat template added (the shipped one has none)."""
    shutil.copytree(resolve_model_path("demo"), path)
    # the shipped one, for HF tools
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


# ----------------------------------------------------------------------------- raw HTTP
def _http(port: int, method: str, path: str, body: bytes | None = None,
          headers: dict | None = None):
    """One request over a plain socket: (status, headers, body bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
        s.sendall(_request_bytes(method, path, body, headers))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    hdrs = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return int(lines[0].split()[1]), hdrs, rest


def _request_bytes(method, path, body=None, headers=None) -> bytes:
    hdrs = {"Host": "127.0.0.1", "Connection": "close", "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/json", **(headers or {})}
    if body is not None:
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in hdrs.items() if v is not None
    )
    return head.encode() + b"\r\n" + (body or b"")


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def _post(port, path, obj, headers=None):
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    status, hdrs, data = _http(port, "POST", path, body, headers)
    return status, hdrs, json.loads(data) if data.startswith(b"{") else data


class StepGate:
    """Hold the engine's steps at will: once `hold()` is called, each step waits for a permit
    (`release(k)` lets k more steps run). Tests then count steps instead of assuming how fast one
    is."""

    def __init__(self, srv: LiveServer, monkeypatch):
        self.engine = srv.engine
        self.holding = threading.Event()
        self.permits = threading.Semaphore(0)
        step = srv.engine._step

        def gated():
            if self.holding.is_set():
                assert self.permits.acquire(timeout=DEADLINE), "the test never released the engine"
            return step()

        monkeypatch.setattr(srv.engine, "_step", gated)

    def hold(self) -> None:
        self.holding.set()

    def release(self, k: int = 1) -> None:
        """Let k more steps run, and wait until they have."""
        target = self.engine.num_steps + k
        for _ in range(k):
            self.permits.release()
        _wait_for(
            lambda: (
                self.engine.num_steps >= target or not self.engine.engine.has_unfinished_requests()
            ),
            f"{k} released steps",
        )

    def open(self) -> None:
        self.holding.clear()
        for _ in range(64):
            self.permits.release()


POISON = "POISON"  # the prompt whose row `poisoned_engine`'s injected fault hits


def poisoned_engine(model: str = "demo", isolated: bool = True, **kw) -> LLMEngine:
    """An engine whose sampling raises for the request with prompt POISON (a bug in one row).
    isolated=False: the fault escapes step(), as before issue 16 (the negative control)."""
    core = LLMEngine.from_kwargs(model, **{"num_blocks": 64, **kw})
    emit = core._emit

    def _emit(req, s, token, *rest):
        if req.output.prompt == POISON:
            raise RuntimeError("injected fault in the POISON row")
        return emit(req, s, token, *rest)

    core._emit = _emit
    if not isolated:
        def _fail_request(req, error):
            raise error
        core._fail_request = _fail_request
    return core
