"""What the server answers, as schemas: the response bodies of openai_api.py as pydantic models,
and `document_responses`, which makes /openapi.json tell the truth about them.

FastAPI documents every route as "200: application/json, any object" plus a 422 for bad bodies.
Ours differ: bad bodies are 400 with OpenAI's error object, the two generation endpoints stream
server-sent events when asked, /metrics is Prometheus text, and 401/404/413/429/500/503 can all
happen. A client generator or a schema fuzzer reading the document must see exactly that (a test
checks real responses against it). The models are documentation: the handlers build plain dicts
(openai_api.py); `extra="forbid"` makes the schemas say no other field is ever sent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Doc):
    """The legacy shape: one entry per token (with echo the prompt's first, the very first null)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Doc):
    logprob: float
    rank: int
    decoded_token: str | None


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]  # empty on the include_usage chunk
    usage: Usage | None = None


class FunctionCall(_Doc):
    name: str
    arguments: str  # JSON text


class ToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class FunctionCallDelta(_Doc):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Doc):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Doc):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    status: Literal["ok"]


class Tokens(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Doc):
    prompt: str


class TokenizerInfo(_Doc):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


ERRORS = {
    400: "a bad body: invalid JSON, a wrong type, an unknown or unsupported field, a value out of "
         "range, a prompt longer than the context",
    401: "a missing or wrong API key (only when the server has one)",
    404: "an unknown model name",
    413: "a body larger than the server's --max-body-bytes",
    429: "the waiting queue is full (with a Retry-After header)",
    500: "this request failed inside the engine (the others go on), or a bug",
    503: "the engine stopped after a fatal error; restart the server",
}
_GENERATION = (400, 401, 404, 413, 429, 500, 503)
SSE_NOTE = ("with stream=true: server-sent events, one `data: <JSON>` per step in which a choice "
            "advanced, then `data: [DONE]`; x-sse-data is the schema of each JSON (an error after "
            "the stream began is an ErrorResponse event)")
# (path, method) -> (the 200 body's model or media type, the stream chunk's model, error statuses)
ROUTES: dict[
    tuple[str, str], tuple[type[BaseModel] | str, type[BaseModel] | None, tuple[int, ...]]
] = {
    ("/v1/completions", "post"): (CompletionResponse, CompletionChunk, _GENERATION),
    ("/v1/chat/completions", "post"): (ChatCompletionResponse, ChatCompletionChunk, _GENERATION),
    ("/v1/models", "get"): (ModelList, None, (401,)),
    ("/v1/models/{name}", "get"): (ModelCard, None, (401, 404)),
    ("/tokenize", "post"): (Tokens, None, (400, 404, 413)),
    ("/detokenize", "post"): (Detokenized, None, (400, 404, 413)),
    ("/tokenizer_info", "get"): (TokenizerInfo, None, (400,)),
    ("/health", "get"): (Health, None, (503,)),
    ("/metrics", "get"): ("text/plain", None, ()),
}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


def document_responses(app) -> None:
    """Replace FastAPI's generated responses in app.openapi() with the ones the server really
    gives."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = generate()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):  # the 422 nobody sends
            schemas.pop(name, None)
        models = [ErrorResponse, CompletionResponse, CompletionChunk, ChatCompletionResponse,
                  ChatCompletionChunk,
                  ModelList, ModelCard, Health, Tokens, Detokenized, TokenizerInfo]
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for (path, method), (ok, chunk, errors) in ROUTES.items():
            if isinstance(ok, str):
                content = {ok: {"schema": {"type": "string"}}}
            else:
                content = _json(ok)
            if chunk is not None:
                content["text/event-stream"] = {
                    "schema": {"type": "string", "description": SSE_NOTE},
                    "x-sse-data": {"oneOf": [_ref(chunk), _ref(ErrorResponse)]},
                }
            responses = {"200": {"description": "OK", "content": content}}
            for status in errors:
                responses[str(status)] = {"description": ERRORS[status],
                                          "content": _json(ErrorResponse)}
            spec["paths"][path][method]["responses"] = responses
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
