"""What the server answers, as schemas: the response bodies of openai_api.py as pydantic models,
and `document_responses`, which makes /openapi.json tell the truth about them.

FastAPI documents every route as "200: application/json, any object" plus a 422 for bad bodies.
Ours differ: bad bodies are 400 with OpenAI's error object, the generation endpoints stream
server-sent events when asked (/v1/responses: OpenAI's typed events, responses_api.py), /metrics
is Prometheus text, and 401/404/413/429/500/503 can all happen. A client generator or a schema
fuzzer reading the document must see exactly that (a test checks real responses against it).
The models are documentation: the handlers build plain dicts (openai_api.py); `extra="forbid"`
makes the schemas say no other field is ever sent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, RootModel


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


class ModelPermission(_Doc):
    """vLLM's one permission object per model card (OpenAI's retired shape)."""
    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: str | None
    is_blocking: bool


class ModelCard(_Doc):
    """OpenAI's Model, with vLLM's root, parent, max_model_len and permission."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # what it was loaded from: the model's path or id, an adapter's directory
    parent: str | None  # an adapter's base model; null for a base model
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    status: Literal["ok"]


class Version(_Doc):
    version: str


class ServerLoad(_Doc):
    server_load: int  # generation requests in flight (vllm_routes.py)


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


# ----------------------------------------------------------------------------- /v1/responses
class OutputText(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]  # always empty
    logprobs: list[dict]  # always empty


class OutputMessage(_Doc):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]  # empty while in progress, then one part


class InputTokensDetails(_Doc):
    cached_tokens: int  # served from the prefix cache
    cache_write_tokens: int  # computed into full blocks, kept by the prefix cache


class OutputTokensDetails(_Doc):
    reasoning_tokens: int  # always 0


class ResponseUsage(_Doc):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Doc):
    reason: Literal["max_output_tokens"]


class ResponseError(_Doc):
    code: Literal["server_error", "rate_limit_exceeded"]
    message: str


class TextFormat(_Doc):
    type: Literal["text"]


class TextConfig(_Doc):
    format: TextFormat


class ResponseObject(_Doc):
    """OpenAI's Response object, as responses_api.py fills it."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: Literal[False]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: None
    temperature: float
    top_p: float
    text: TextConfig
    tool_choice: Literal["auto", "none"]
    tools: list[dict]  # always empty
    truncation: Literal["disabled"]
    usage: ResponseUsage | None  # null until the response is finished
    user: str | None
    metadata: dict[str, str]


class ResponseLifecycleEvent(_Doc):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(_Doc):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputMessage


class ContentPartEvent(_Doc):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Doc):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict]  # always empty


class OutputTextDoneEvent(_Doc):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict]  # always empty


class ResponseStreamEvent(RootModel[ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent
                                    | OutputTextDeltaEvent | OutputTextDoneEvent]):
    """One `data:` of a /v1/responses stream (its `event:` line names the same type)."""


# ----------------------------------------------------------------------------- /invocations
class InvocationResponse(RootModel[ChatCompletionResponse | CompletionResponse]):
    """/invocations answers as the endpoint its body went to."""


class InvocationChunk(RootModel[ChatCompletionChunk | CompletionChunk]):
    """A stream chunk of /invocations: the target endpoint's."""


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
RESPONSES_SSE_NOTE = ("with stream=true: OpenAI's semantic events, each an `event: <type>` line "
                      "and a `data: <JSON>` line, with no [DONE]; x-sse-data is the schema of "
                      "each JSON (a failure after the stream began is a response.failed event)")
TYPED_EVENT_STREAMS = ("/v1/responses",)  # streams of typed events, not chunks ending in [DONE]
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
    ("/v1/responses", "post"): (ResponseObject, ResponseStreamEvent, _GENERATION),
    ("/invocations", "post"): (InvocationResponse, InvocationChunk, _GENERATION),
    ("/ping", "get"): (Health, None, (503,)),
    ("/ping", "post"): (Health, None, (503,)),
    ("/version", "get"): (Version, None, (401,)),
    ("/load", "get"): (ServerLoad, None, (401,)),
}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


def _event_stream(path: str, chunk: type[BaseModel]) -> dict:
    """A route's text/event-stream: OpenAI's typed events, or chunks (and error events)."""
    if path in TYPED_EVENT_STREAMS:
        return {"schema": {"type": "string", "description": RESPONSES_SSE_NOTE},
                "x-sse-data": {"oneOf": [_ref(chunk)]}}
    return {"schema": {"type": "string", "description": SSE_NOTE},
            "x-sse-data": {"oneOf": [_ref(chunk), _ref(ErrorResponse)]}}


def _documented_models() -> list[type[BaseModel]]:
    """Every model a route answers with (and ErrorResponse): the schemas /openapi.json holds."""
    models: list[type[BaseModel]] = [ErrorResponse]
    for ok, chunk, _ in ROUTES.values():
        models += [m for m in (ok, chunk) if m is not None and not isinstance(m, str)]
    return models


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
        for model in _documented_models():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for (path, method), (ok, chunk, errors) in ROUTES.items():
            if isinstance(ok, str):
                content = {ok: {"schema": {"type": "string"}}}
            else:
                content = _json(ok)
            if chunk is not None:
                content["text/event-stream"] = _event_stream(path, chunk)
            responses = {"200": {"description": "OK", "content": content}}
            for status in errors:
                responses[str(status)] = {"description": ERRORS[status],
                                          "content": _json(ErrorResponse)}
            spec["paths"][path][method]["responses"] = responses
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
