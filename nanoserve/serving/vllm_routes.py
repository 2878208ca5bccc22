"""The operational routes of vLLM's server that are not OpenAI's, so that what probes, routers and
Amazon SageMaker send to a vLLM server works here too:

    GET  /version          {"version": "0.1.0"}: nanoserve's version (vLLM answers with its own)
    GET, POST /ping        SageMaker's health probe: exactly /health (200 alive, 503 once the
                           engine failed); open without the API key, as /health is
    GET  /load             {"server_load": n}: the generation requests in flight
    POST /invocations      SageMaker's one inference route: a body with `messages` is a chat
                           completion, one with `prompt` a completion, served by those endpoints
                           (same validation, same errors, streamed when asked)

**What /load counts** (vLLM's `load_aware_call`): HTTP requests to the generation routes
(completions, chat completions, responses, invocations) from the moment they arrive until their
response's last byte is sent or the client leaves — a stream counts until it ends. It is the
load a router balancing several servers wants (vLLM's docs pair it with llm-d's and the production
stack's routers). vLLM counts only when started with `--enable-server-load-tracking` and answers 0
otherwise; nanoserve always counts (an integer per request, nothing to switch off).

**How /invocations picks its endpoint.** vLLM tries the body against each request type in turn
(chat first) and takes the first that validates. nanoserve's bodies are strict (an unknown field is
a 400, never ignored), so it dispatches on the key instead: `messages` → chat, `prompt` →
completions, both or neither → 400 naming what it takes. The body is then validated exactly as the
target endpoint validates it (a chat body with a wrong field gets chat's 400) and handed to that
endpoint's handler. Unlike vLLM, which opens every route outside /v1 to all, /invocations needs the
API key when the server has one: it generates text, as /v1 does.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..errors import NanoserveError
from .openai_api import CompletionRequest
from .openai_chat import ChatCompletionRequest

# the routes whose requests /load counts (vLLM: those that use the GPU)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
# /invocations: the body's key, the route it means, the body that route takes
INVOCATION_TARGETS: dict[str, tuple[str, type[BaseModel]]] = {
    "messages": ("/v1/chat/completions", ChatCompletionRequest),
    "prompt": ("/v1/completions", CompletionRequest),
}


class ServerLoad:
    """The number /load reports: generation requests in flight (changed only on the event loop)."""

    def __init__(self):
        self.value = 0


class TrackLoad:
    """ASGI middleware: count a POST to GENERATION_PATHS in `load` while it is being answered (until
    its response ends, or its client leaves)."""

    def __init__(self, app, load: ServerLoad):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send):
        counted = (scope["type"] == "http" and scope["method"] == "POST"
                   and scope["path"] in GENERATION_PATHS)
        if not counted:
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


def add_vllm_routes(app: FastAPI) -> None:
    """Register /version, /ping, /load and /invocations on `app`, after its /health and generation
    routes (/ping and /invocations call their handlers)."""
    load = ServerLoad()
    app.add_middleware(TrackLoad, load=load)
    health = _handler(app, "/health", "GET")
    targets = {path: _handler(app, path, "POST") for path, _ in INVOCATION_TARGETS.values()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/ping")
    async def ping():
        return await health()

    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    @app.get("/load")
    async def server_load():
        return {"server_load": load.value}

    @app.post("/invocations", openapi_extra=_INVOCATION_BODY)
    async def invocations(request: Request):
        body = _json_body(await request.body())
        path, model = _invocation_target(body)
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:  # the target endpoint's own 400 (server.validation_message)
            raise RequestValidationError(e.errors()) from e
        return await targets[path](parsed, request)


def _handler(app: FastAPI, path: str, method: str):
    """The function registered for `method path` on `app`."""
    for route in app.routes:
        if getattr(route, "path", None) == path and method in getattr(route, "methods", ()):
            return route.endpoint
    raise LookupError(f"no {method} {path} route to hand requests to")


def _json_body(raw: bytes) -> dict:
    """The body as a JSON object; invalid JSON is FastAPI's own 400 (json_invalid)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                 "input": {}, "ctx": {"error": reason}}
        raise RequestValidationError([error]) from e
    if not isinstance(body, dict):
        raise NanoserveError(f"POST /invocations: the body must be a JSON object, not "
                             f"{type(body).__name__}")
    return body


def _invocation_target(body: dict) -> tuple[str, type[BaseModel]]:
    """(route, request type) for a body: chat for `messages`, completions for `prompt`."""
    keys = [key for key in INVOCATION_TARGETS if key in body]
    if len(keys) != 1:
        found = "both" if keys else "neither"
        raise NanoserveError(
            "POST /invocations takes a chat completion body (with 'messages', served as "
            "/v1/chat/completions) or a completion body (with 'prompt', served as "
            f"/v1/completions); this body has {found}")
    return INVOCATION_TARGETS[keys[0]]


# /openapi.json: the body is one of the two requests (their schemas are the endpoints' own)
_INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "oneOf": [{"$ref": f"#/components/schemas/{model.__name__}"}
              for _, model in INVOCATION_TARGETS.values()]}}}}}
