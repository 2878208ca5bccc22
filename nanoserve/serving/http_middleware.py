"""ASGI middleware around the OpenAI server (server.py), outermost first:

    CountStatus   count every response by endpoint and status code (for /metrics)
    RequireKey    with an API key set, every path but /health, /ping and /metrics needs
                  `Authorization: Bearer <key>` (401 before any body is read)
    LimitBody     refuse a body larger than `max_body_bytes` (413) before it is parsed or tokenized

Each is a plain ASGI callable, so a reader sees the whole protocol: `scope` describes the request,
`receive()` yields its body in pieces, `send()` writes the response. Taught in notebooks/09_*.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from . import openai_api as api
from .metrics import ServerMetrics

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
             "/metrics", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations", "/ping",
             "/version", "/load")


class CountStatus:
    """ASGI middleware around the whole app: count every HTTP response by endpoint and status code
    (streams too; a crash as 500). Paths we do not serve count as "other", so scanners cannot grow
    the metric without bound."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.state = app.state  # engine and metrics, for whoever holds the app (tests, notebooks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_response(endpoint, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # FastAPI's outermost error middleware answered 500 and re-raised
                self.metrics.count_response(endpoint, 500)
            raise


# what probes and Prometheus read without a key (/ping: SageMaker's probe, vllm_routes.py)
OPEN_PATHS = ("/health", "/ping", "/metrics")


class RequireKey:
    """ASGI middleware: with an API key set, every request needs `Authorization: Bearer <key>` (401
    otherwise, before the body is read): /v1/*, /invocations, the tokenizer routes, /docs and
    /openapi.json alike. Only OPEN_PATHS stay open, for probes."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        guarded = scope["type"] == "http" and scope["path"] not in OPEN_PATHS
        if self.expected is not None and guarded:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = api.error_body("missing or invalid API key: send the header "
                                      "'Authorization: Bearer <key>'",
                                      "authentication_error", "invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)



DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: far above any prompt a context window holds


class LimitBody:
    """ASGI middleware: a request body over `max_bytes` gets 413 with an OpenAI error body, before
    FastAPI parses it. The declared Content-Length is checked first; a chunked body is counted as
    it arrives, so a client cannot stream past the limit either. The body read here is handed to
    the app unchanged, and later `receive()` calls go to the client (disconnects still arrive).

    Refusing politely takes care: a client that is still sending when the server closes gets a TCP
    reset instead of the 413 (most HTTP clients send the whole body before reading). So the rest of
    the body is read and dropped first, up to `DRAIN_FACTOR` × the limit; a client that sent
    `Expect: 100-continue` (curl does, for big bodies) has sent nothing yet and is answered at
    once."""

    DRAIN_FACTOR = 16

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await self._refuse(scope, receive, send, 400,
                                      f"Content-Length {declared.decode('latin-1')!r} is not a "
                                      "number of bytes")
        if declared is not None and int(declared) > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await self._drain(receive, int(declared))
            return await self._refuse(scope, receive, send, 413,
                                      self._too_large(f"{int(declared)} bytes"))
        pieces, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            pieces.append(message.get("body", b""))
            size += len(pieces[-1])
            if size > self.max_bytes:
                more = message.get("more_body", False) and await self._drain(receive, size)
                return await self._refuse(scope, receive, send, 413,
                                          self._too_large(f"{'more than ' if more else ''}{size} "
                                                          "bytes"))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(pieces), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> str:
        return (f"the request body is {size}; this server accepts at most {self.max_bytes} bytes "
                "(start it with a larger --max-body-bytes to allow more)")

    async def _drain(self, receive, seen: int) -> bool:
        """Read and drop the rest of the body, up to the cap; True if any of it was read."""
        read = False
        while seen <= self.DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            read = True
            if not message.get("more_body"):
                break
        return read

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:
        body = api.error_body(message, "invalid_request_error",
                              "request_too_large" if status == 413 else None)
        await JSONResponse(body, status_code=status, headers={"Connection": "close"})(
            scope, receive, send
        )
