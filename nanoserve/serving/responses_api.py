"""OpenAI's Responses API, its text subset: `POST /v1/responses`, answered whole or streamed.

    {"model": "demo-chat", "instructions": "Be brief.", "input": "Who is there?",
     "max_output_tokens": 50}
    -> {"id": "resp_...", "object": "response", "status": "completed", "model": "demo-chat",
        "output": [{"type": "message", "id": "msg_...", "status": "completed",
                    "role": "assistant", "content": [{"type": "output_text", "text": "..."}]}],
        "usage": {"input_tokens": 14, "output_tokens": 9, "total_tokens": 23, ...}, ...}

The request is a chat in another spelling: `instructions` becomes a system message, `input` (a
string: one user message; or message items, each a role and its content as a string or as
input_text parts) the messages after it, and the chat goes through the model's chat template exactly
as /v1/chat/completions renders it (no template: the same 400). `max_output_tokens`,
`temperature` and `top_p` become SamplingParams; without `max_output_tokens` the model writes until
it stops or the context is full, as chat does. `model` names the base model or an adapter (left
out: the base model, answered as its first served name, as vLLM does). `metadata` and `user` come
back in the response; `tools` only empty, `tool_choice` only "none" or "auto" (there are no
tools), `background` only false, `text` only plain text. Anything else is a 400 naming the field.

**Nothing is stored.** `store` is accepted at either value, as vLLM's server does by default (it
stores only with VLLM_ENABLE_RESPONSES_API_STORE=1): OpenAI's default is true, so clients send it
without meaning it. So there is no GET /v1/responses/{id}, and `previous_response_id` (which needs a
stored response) is a 400; to continue a conversation, send its earlier turns as `input` items.

A response cut by `max_output_tokens` (or the context's end) has status "incomplete",
`incomplete_details: {"reason": "max_output_tokens"}` and an incomplete message item.

**Streaming** (`stream: true`) sends OpenAI's semantic events, each as `event: <type>` and
`data: <JSON>` with a `sequence_number` counting from 0, and no `[DONE]`:

    response.created, response.in_progress        the response, status "in_progress"
    response.output_item.added                    the message item, empty
    response.content_part.added                   its output_text part, empty
    response.output_text.delta  (× n)             the text as it comes (a step's new text each)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed                            the whole response, usage included

An incomplete response ends with `response.incomplete` instead (OpenAI's event; vLLM sends
response.completed for it too), and one that fails after the stream began with `response.failed`
(status "failed", `error` set, the text so far in its output).
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..engine.outputs import RequestOutput
from ..engine.sampler import SamplingParams
from ..engine.scheduler import QueueFullError
from ..errors import NanoserveError
from .metrics import ServerMetrics
from .openai_api import error_body, now
from .streams import collect

METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512  # OpenAI's bounds


class ContentPart(BaseModel):
    """A text part of an input message: input_text, or output_text (an earlier answer sent back)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text sent back carries these: accepted, unused
    logprobs: list | None = None


class InputMessage(BaseModel):
    """One message item of `input` (OpenAI's EasyInputMessage, or an output message sent back)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None  # an earlier output item's: accepted, unused
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def as_chat_message(self) -> dict:
        """The message as the chat template takes it: its parts' texts joined."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": "".join(part.text for part in self.content)}


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses that nanoserve implements (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted at either value: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    # accepted at their no-op values only
    tools: list | None = None
    tool_choice: Literal["none", "auto"] | None = None
    background: bool | None = None
    text: dict | None = None

    def check(self) -> None:
        """The values pydantic's types cannot check, each a NanoserveError (400) naming it."""
        if self.tools:
            raise NanoserveError("tools: nanoserve's /v1/responses serves text only; send no tools "
                                 "(or use /v1/chat/completions, which calls tools)")
        if self.background:
            raise NanoserveError("background=true needs a stored response to fetch later, and "
                                 "nanoserve stores none; leave background unset or false")
        if self.text not in (None, {"format": {"type": "text"}}):
            raise NanoserveError(f"text={self.text!r:.80}: only plain text is implemented "
                                 '({"format": {"type": "text"}}, the default)')
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise NanoserveError(f"max_output_tokens={self.max_output_tokens} must be an integer "
                                 "≥ 1")
        _check_metadata(self.metadata or {})

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """The request's SamplingParams; without max_output_tokens, until the context is full."""
        self.check()
        max_tokens = max_model_len if self.max_output_tokens is None else self.max_output_tokens
        return SamplingParams(temperature=_or_default(self.temperature, 1.0),
                              top_p=_or_default(self.top_p, 1.0), max_tokens=max_tokens)

    def messages(self) -> list[dict]:
        """The chat: instructions as its system message, then the input."""
        chat = [] if self.instructions is None else [{"role": "system",
                                                      "content": self.instructions}]
        if isinstance(self.input, str):
            return [*chat, {"role": "user", "content": self.input}]
        if not self.input:
            raise NanoserveError("input is an empty list; give a string or at least one message")
        return [*chat, *(item.as_chat_message() for item in self.input)]


def _check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
    if len(metadata) > METADATA_MAX_PAIRS:
        raise NanoserveError(f"metadata has {len(metadata)} pairs; at most {METADATA_MAX_PAIRS}")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY or len(value) > METADATA_MAX_VALUE:
            raise NanoserveError(f"metadata[{key[:20]!r}]: keys are at most {METADATA_MAX_KEY} "
                                 f"characters, values at most {METADATA_MAX_VALUE}")


def _or_default(value, default):
    return default if value is None else value


# ----------------------------------------------------------------------------- the JSON
class ResponseBuilder:
    """The JSON of one response: the Response object at each stage, its message item, its usage.
    `cache` is the engine's block allocator (for usage's cache counts)."""

    def __init__(self, body: ResponsesRequest, params: SamplingParams, model: str, cache):
        self.body, self.params, self.model, self.cache = body, params, model, cache
        self.id, self.item_id = _new_id("resp"), _new_id("msg")
        self.created = now()

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        """OpenAI's Response object (status: in_progress, completed, incomplete or failed)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "background": False, "error": error,
                "incomplete_details": incomplete, "instructions": self.body.instructions,
                "max_output_tokens": self.body.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": self.body.parallel_tool_calls is not False,
                "previous_response_id": None, "temperature": self.params.temperature,
                "top_p": self.params.top_p, "text": {"format": {"type": "text"}},
                "tool_choice": self.body.tool_choice or "auto", "tools": [],
                "truncation": "disabled", "usage": usage, "user": self.body.user,
                "metadata": self.body.metadata or {}}

    def message(self, status: str, text: str | None) -> dict:
        """The assistant's message item; text None: not begun (no content part yet)."""
        content = [] if text is None else [output_text(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    def finished(self, out: RequestOutput) -> dict:
        """The response of a finished request."""
        status = status_of(out)
        return self.response(status, [self.message(status, out.outputs[0].text)],
                             self.usage(out))

    def usage(self, out: RequestOutput) -> dict:
        """Tokens in and out. `cached_tokens`: prompt tokens the prefix cache served;
        `cache_write_tokens`: those this request computed into full blocks, which the prefix cache
        keeps for later requests (none with prefix caching off)."""
        prompt, written = len(out.prompt_token_ids), 0
        if self.cache.enable_prefix_caching:
            full = prompt // self.cache.block_size * self.cache.block_size
            written = max(0, full - out.num_cached_tokens)
        generated = len(out.outputs[0].token_ids)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                         "cache_write_tokens": written},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + generated}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def status_of(out: RequestOutput) -> str:
    """'incomplete' when a token limit cut the text, else 'completed'."""
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _error_code(e: Exception) -> str:
    """ResponseError's code for a failure after the stream began."""
    return "rate_limit_exceeded" if isinstance(e, QueueFullError) else "server_error"


# ----------------------------------------------------------------------------- streaming
async def stream_events(build: ResponseBuilder, stream: AsyncIterator[RequestOutput],
                        metrics: ServerMetrics) -> AsyncIterator[str]:
    """The server-sent events of one response (module docstring), its text a delta per step."""
    numbers = itertools.count()

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    where = {"item_id": build.item_id, "output_index": 0, "content_index": 0}
    begun = build.response("in_progress", [])
    yield event("response.created", response=begun)
    yield event("response.in_progress", response=begun)
    yield event("response.output_item.added", output_index=0,
                item=build.message("in_progress", None))
    yield event("response.content_part.added", **where, part=output_text(""))
    sent, last = 0, None
    try:
        async for out in stream:
            last, text = out, out.outputs[0].text
            if len(text) > sent:  # (text only grows: a held-back stop string is not in it yet)
                yield event("response.output_text.delta", **where, delta=text[sent:], logprobs=[])
                sent = len(text)
    except Exception as e:  # after the stream began: the engine failed this request, or broke
        text = "" if last is None else last.outputs[0].text
        error = {"code": _error_code(e), "message": str(e)}
        yield event("response.failed",
                    response=build.response("failed", [build.message("incomplete", text)],
                                            error=error))
        return
    finally:
        await stream.aclose()  # a client that left: its request is aborted
        if last is not None:
            metrics.observe(last)
    status, text = status_of(last), last.outputs[0].text
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where, part=output_text(text))
    yield event("response.output_item.done", output_index=0, item=build.message(status, text))
    final = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(final, response=build.finished(last))


# ----------------------------------------------------------------------------- the route
def add_responses_routes(app: FastAPI, core, chat_template, resolve_model: Callable, add_all,
                         metrics: ServerMetrics) -> None:
    """Register POST /v1/responses on `app`, serving the engine `core` through the server's own
    machinery: `resolve_model(name)` -> (LoRARequest or None, the name to answer with), `add_all`
    (queue the request; server.py) and the chat template."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        lora, answered_as = resolve_model(body.model)
        if chat_template is None:
            return JSONResponse(error_body(
                f"the model {answered_as!r} has no chat template, so it cannot serve "
                "/v1/responses; use /v1/completions, or start the server with --chat-template FILE",
                code="no_chat_template"), status_code=400)
        params = body.sampling_params(core.max_model_len)
        build = ResponseBuilder(body, params, answered_as, core.block_allocator)
        template_options = {"add_generation_prompt": True, "kwargs": None, "tools": None}
        streams = await add_all([], params, build.id, body.messages(), template_options, lora)
        if body.stream:
            return StreamingResponse(stream_events(build, streams[0], metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await collect(streams, request, metrics)
        return build.finished(outs[0])
