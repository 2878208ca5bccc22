"""An OpenAI-compatible HTTP server on top of the engine: `nanoserve serve --model demo`.

Endpoints (what vLLM and TGI give their users, so existing clients work unchanged):

    POST /v1/completions       text completion, streamed (server-sent events) or not
    POST /v1/chat/completions  chat, for models that carry a chat template
                               (nanoserve/serving/chat.py)
    POST /v1/responses         OpenAI's Responses API, text and streaming (responses_api.py)
    GET  /v1/models            each served name and LoRA adapter, with vLLM's root, parent and
                               permission fields (/v1/models/{id}: one, or 404)
    POST /tokenize, /detokenize, GET /tokenizer_info   the tokenizer, as vLLM serves it
                                                       (tokenize_api.py)
    GET  /health               200 while the engine loop is alive, 503 after it failed
    GET  /metrics              Prometheus text format (nanoserve/serving/metrics.py)
    GET  /version, /load; GET and POST /ping; POST /invocations   vLLM's and SageMaker's: the
                               version, the requests in flight, a probe (as /health), and chat or
                               completions by the body's shape (vllm_routes.py)

A request's `model` names a served name (`--served-model-name a b ...`: each serves the base model)
or an adapter; left out, it means the base model, and the answer names the first served name.

The request path: the middleware (http_middleware.py) checks the key and the body's size,
FastAPI parses the body into a pydantic model (openai_api.py, strict types), the fields become
SamplingParams, a worker thread tokenizes and validates (`LLMEngine.new_request`; the event loop
never tokenizes), `AsyncLLMEngine.submit` queues the request (errors raise before any response
starts), and the handler reads the request's outputs as the engine steps: all of them for a
plain response, a chunk per step for a stream.

Failure is part of the interface, and /openapi.json documents it (openai_schema.py):
- bad JSON, wrong types, unknown or unsupported fields, bad values, a prompt longer than the
  context → 400 with OpenAI's error body, the message naming the value (and, for a long prompt,
  both lengths);
- a wrong or missing API key when the server has one → 401, before the body is read (only /v1/*:
  probes and Prometheus stay open); an unknown model name or path → 404;
- a body over `--max-body-bytes` (4 MiB) → 413, before it is parsed;
- a full waiting queue (`--max-waiting`) → 429 with Retry-After; nothing is queued;
- a request that fails inside the engine → 500 (or an error event in its stream) for it alone:
  its blocks go back, other requests and /health go on (errors.py draws the line);
- an error that breaks shared state (errors.is_fatal) → /health and every later request 503; `serve`
  then stops once the responses in flight are out and exits with status 1, as vLLM's server does (a
  supervisor restarts it);
- a client that disconnects — mid-stream, or while waiting for a plain response — aborts its
  request, which leaves the engine and frees its KV blocks before the next step.

The server binds to 127.0.0.1 unless told otherwise. Needs the `serve` extra (FastAPI, uvicorn,
prometheus-client). Taught in notebooks/09_*.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..engine.outputs import RequestOutput
from ..engine.scheduler import QueueFullError
from ..errors import NanoserveError, RequestFailedError
from . import openai_api as api
from . import tool_call_stream, tool_calls
from .async_engine import AsyncLLMEngine, EngineDeadError
from .chat import ChatTemplate
from .http_middleware import DEFAULT_MAX_BODY_BYTES, CountStatus, LimitBody, RequireKey
from .limits import ServerLimits
from .metrics import ServerMetrics
from .openai_chat import ChatCompletionRequest
from .openai_responses import model_card
from .openai_schema import document_responses
from .responses_api import add_responses_routes
from .streams import ClientGone, collect, sse
from .tokenize_api import add_tokenizer_routes
from .vllm_routes import add_vllm_routes

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers


def create_app(engine: AsyncLLMEngine, model_name: str | list[str], api_key: str | None = None,
               chat_template: ChatTemplate | None = None, retry_after: int = 1,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, loras: dict | None = None,
               limits: ServerLimits | None = None,
               tool_config: tool_calls.ToolCallConfig | None = None) -> CountStatus:
    """The ASGI app serving `engine` under `model_name` (a list: under each of its names, as
    vLLM's --served-model-name a b), and each LoRARequest of `loras` under its name (a request's
    `model` picks one, as vLLM's --lora-modules); run it with uvicorn (see `serve`). `limits`: what
    one request may ask for (limits.py); `tool_config`: whether and how tool_choice auto reads
    calls out of the text (tool_calls.py)."""
    served = served_names(model_name)
    model_name = served[0]  # the name answered when a request names no model
    core, loras = engine.engine, loras or {}
    limits = limits or ServerLimits()
    tool_config = tool_config or tool_calls.ToolCallConfig()
    metrics = ServerMetrics(engine, model_name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    # outside LimitBody: no key, no body read at all
    app.add_middleware(RequireKey, api_key=api_key)

    # ------------------------------------------------------------------ errors
    def error(status: int, message: str, type_="invalid_request_error", code=None,
              headers=None) -> JSONResponse:
        return JSONResponse(api.error_body(message, type_, code), status_code=status,
                            headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error(e.status, e.message, e.type, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return error(400, validation_message(e.errors()))

    @app.exception_handler(NanoserveError)
    async def _bad_value(request, e: NanoserveError):
        if isinstance(e, QueueFullError):
            return error(429, str(e), "rate_limit_error", "queue_full",
                         {"Retry-After": str(retry_after)})
        return error(400, str(e))

    @app.exception_handler(ClientGone)
    # nobody reads it: the client left, its requests were aborted
    async def _gone(request, e: ClientGone):
        return error(499, str(e))

    @app.exception_handler(RequestFailedError)
    async def _failed(request, e: RequestFailedError):  # this request alone; the engine serves on
        return error(500, str(e), "server_error", "request_failed")

    @app.exception_handler(EngineDeadError)
    async def _dead(request, e: EngineDeadError):
        return error(503, str(e), "server_error", "engine_unavailable")

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):  # unknown routes and methods, in OpenAI's shape too
        return error(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                     code=e.status_code)

    @app.exception_handler(Exception)
    # logged by uvicorn with its traceback; the client gets JSON
    async def _bug(request, e: Exception):
        return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def check_model(name: str | None):
        """The LoRARequest that `name` serves under, None for the base model (any served name, or
        no name); 404 for any other name."""
        if name is not None and name not in served and name not in loras:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, [*served, *loras]))}",
                           code="model_not_found")
        return loras.get(name)

    def resolve_model(name: str | None) -> tuple:
        """(the LoRARequest or None, the name to answer with): the one asked for, or the first
        served name when the request names none (vLLM's)."""
        return check_model(name), model_name if name is None else name

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if engine.errored:
            return error(503, "the engine loop failed; see the server's log", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def card(name: str) -> dict:  # an adapter: loaded from its path, the base model its parent
        if name in loras:
            return model_card(name, loras[name].lora_path, model_name, core.max_model_len)
        return model_card(name, core.engine_config.model, None, core.max_model_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in [*served, *loras]]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return card(name)

    add_tokenizer_routes(app, core, chat_template, check_model, limits)  # /tokenize, ...

    # ------------------------------------------------------------------ generation
    async def add_all(prompts: list, params, rid: str, chat_messages: list[dict] | None = None,
                      template_options: dict | None = None,
                      lora=None) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt or none. Tokenizing and validating run in a worker thread (a 4 MB
        prompt takes a second to tokenize, and the event loop must keep serving /health and the
        streams); queueing runs here on the loop, and undoes the queued ones if one is refused. The
        batch's size is bounded before any prompt is tokenized, its tokens as each one is."""
        if chat_messages is not None:
            limits.check_messages(len(chat_messages))
        limits.check_prompts(len(prompts))
        if params.structured_outputs is not None:  # compiled in the grammar pool; no thread waits
            await core.inputs.grammars.compile_async(params.structured_outputs)

        def prepare():
            ps = ([chat_template.encode(chat_messages, core.tokenizer, **(template_options or {}))]
                  if chat_messages is not None else prompts)
            reqs, tokens = [], 0
            for i, p in enumerate(ps):
                reqs.append(core.new_request(p, params, f"{rid}-{i}", lora_request=lora))
                tokens += len(reqs[-1].output.prompt_token_ids)
                limits.check_tokens(tokens, f"the first {i + 1} prompts")
            return reqs

        reqs = await asyncio.to_thread(prepare)
        streams = []
        try:
            for req in reqs:
                streams.append(engine.outputs(*engine.submit(req)))
        except (NanoserveError, EngineDeadError):
            for req in reqs[:len(streams)]:
                engine.abort(req.output.request_id)
            raise
        return streams

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        # the name answered: the one asked for
        lora, answered_as = resolve_model(body.model)
        params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
        rid, created = api.new_id("cmpl"), api.now()
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400,
                           "prompt_logprobs with stream=true is not supported; use stream=false "
                           "(or echo with logprobs, which streams the prompt's logprobs in the "
                           "first chunk)")
        streams = await add_all(body.prompts(), params, rid, lora=lora)
        tok = core.tokenizer
        if body.stream:
            def chunk(index, delta, reason, first, out, c, chars, tokens):
                echo = body.echo and first  # the prompt (and its logprobs) lead the first chunk
                prefix = api.echo_text(out, tok) if body.echo else ""
                lps = api.completion_logprobs(out, c, tokens, echo, tok,
                                              0 if echo else len(prefix) + chars)
                return api.completion_chunk(rid, answered_as, created, index,
                                            (prefix if echo else "") + delta,
                                            reason, lps)
            return sse(streams, params.n, chunk, body.stream_options, rid, answered_as, created,
                       "text_completion",
                        metrics)
        outs = await collect(streams, request, metrics)
        return api.completion_response(rid, answered_as, created, outs, body.echo, tok,
                                       body.prompt_logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        # (an adapter's name, or the model's)
        lora, answered_as = resolve_model(body.model)
        if chat_template is None:
            raise APIError(400,
                           f"the model {model_name!r} has no chat template, so it cannot serve "
                           "chat completions; use /v1/completions, or start the server with "
                           "--chat-template FILE",
                           code="no_chat_template")
        params = body.sampling_params(core.max_model_len)  # the engine stops at the context's end
        rid, created = api.new_id("chatcmpl"), api.now()
        # tool calls: constrained (named, required) or parsed (auto), tool_calls.py
        mode, _ = body.tool_mode()
        hermes = tool_config.auto_parser(body.tools, body.tool_choice) == "hermes"
        calls = (lambda text: tool_calls.extract(text, mode, body.tool_choice, hermes,
                                                 body.parallel_tool_calls)
                 ) if mode or hermes else None
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400,
                           "prompt_logprobs with stream=true is not supported; use stream=false")
        streams = await add_all(
            [], params, rid, body.message_dicts(), body.template_options(), lora
        )
        k, tok = params.logprobs or 0, core.tokenizer
        if body.stream:
            readers: dict[int, object] = {}  # choice -> its reader of calls (tool_call_stream.py)

            def chunk(index, delta, reason, first, out, c, chars, tokens):
                calls_in = readers.setdefault(index, tool_call_stream.reader(
                    mode, body.tool_choice, hermes, body.parallel_tool_calls))
                d = calls_in.feed(delta, reason is not None)
                if first:
                    d = {"role": "assistant", **(d or {"content": ""})}
                ch = api.chat_chunk(rid, answered_as, created, index, d, reason,
                                    api.chat_logprobs(c, tokens, k, tok))
                if calls_in.num_calls and reason == "stop":
                    ch["choices"][0]["finish_reason"] = "tool_calls"
                return ch
            return sse(streams, params.n, chunk, body.stream_options, rid, answered_as, created,
                       "chat.completion.chunk", metrics)
        outs = await collect(streams, request, metrics)
        return api.chat_response(rid, answered_as, created, outs[0], k, tok, calls)

    add_responses_routes(app, core, chat_template, resolve_model, add_all, metrics)
    add_vllm_routes(app)  # /version, /ping, /load, /invocations (after the routes they call)
    # /openapi.json: 400 (not 422), 401/404/413/429/500/503, SSE and text/plain
    document_responses(app)
    # outermost, around FastAPI's own error middleware, so that its 500s are counted too
    return CountStatus(app, metrics)


def served_names(name: str | list[str]) -> list[str]:
    """The names a server answers to for its base model: one, or several (vLLM's
    --served-model-name a b), each a non-empty string, none twice."""
    names = [name] if isinstance(name, str) else list(name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise NanoserveError(f"served model names {names!r}: give at least one, each a non-empty "
                             "string")
    if len(set(names)) < len(names):
        raise NanoserveError(f"served model names {names!r}: a name appears twice")
    return names


def validation_message(errors: list[dict]) -> str:
    """One readable line from pydantic's errors: which field, what was wrong."""
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON "
                         f"({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}: nanoserve does not implement it")
        elif e.get("type") == "missing":
            parts.append(f"field {loc!r} is required")
        else:
            parts.append(f"field {loc!r}: {e.get('msg')} (got {e.get('input')!r:.80})")
    return "; ".join(parts) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")


# ----------------------------------------------------------------------------- running it
def serve(model: str = "demo", host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None,
          served_model_name: str | list[str] | None = None, chat_template: str | None = None,
          log_level: str = "info",
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, lora_modules: list[str] | None = None,
          limits: ServerLimits | None = None,
          tool_config: tool_calls.ToolCallConfig | None = None, **engine_kwargs) -> None:
    """Load the model and serve it until interrupted, or until the engine fails (then SystemExit,
    status 1); what `nanoserve serve` runs. `served_model_name`: the name clients send, or a list
    of names that each serve the model (default: `model`); `lora_modules`: name=path of each LoRA
    adapter, read before the server starts."""
    import uvicorn

    from ..engine.llm_engine import LLMEngine
    from ..lora.serving import parse_lora_modules
    from .chat import load_chat_template, read_chat_template_file

    names = served_names(served_model_name or str(model))
    loras = parse_lora_modules(lora_modules or [])
    if loras:
        engine_kwargs = {**engine_kwargs, "enable_lora": True}
    core = LLMEngine.from_kwargs(model, **engine_kwargs)
    for req in loras.values():
        core.inputs.lora.add(req)
    template = (read_chat_template_file(chat_template, core.tokenizer) if chat_template
                else load_chat_template(model, core.tokenizer))
    limits = limits or ServerLimits()
    engine = AsyncLLMEngine(core)
    app = create_app(engine, names, api_key, template,
                     max_body_bytes=max_body_bytes, loras=loras, limits=limits,
                     tool_config=tool_config)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"[nanoserve] warning: serving on {host} without --api-key: anyone who can reach it "
              "can use it",
              file=sys.stderr)
    print(f"[nanoserve] serving {', '.join(names)} on http://{host}:{port}/v1 "
          f"(chat: {'yes' if template else 'no template'}; device {core.device})", file=sys.stderr)
    # SIGTERM: responses in flight get shutdown_grace_s to finish, then are cut; the engine stops
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=limits.shutdown_grace_s))
    # finish what is in flight, then stop
    engine.on_fatal.append(lambda e: setattr(server, "should_exit", True))
    with suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn shuts down gracefully, then raises it again
        server.run()
    if engine.error is not None:  # exit status 1 (SystemExit with a message), as vLLM's server
        raise SystemExit(f"[nanoserve] the engine failed ({type(engine.error).__name__}: "
                         f"{engine.error}); the server stopped")
