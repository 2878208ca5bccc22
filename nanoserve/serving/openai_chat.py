"""Chat-completion request bodies: messages (text, the assistant's tool calls, tool results), tools
and tool_choice (tool_calls.py), logprobs, and vLLM's template options; the fields both endpoints
share are openai_api.BaseRequest's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ..engine.sampler import SamplingParams
from ..engine.sampling_params import MAX_LOGPROBS
from ..engine.structured_output import StructuredOutputsParams
from ..errors import NanoserveError
from . import tool_calls
from .openai_api import NO_OP_VALUES, BaseRequest


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # the assistant's earlier calls
    tool_call_id: str | None = None  # which call a role "tool" message answers

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        """OpenAI's content parts: only {"type": "text", "text": ...} (no images, audio, files)."""
        if v is None or isinstance(v, str):
            return v
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in v
        ):
            raise ValueError('content parts must all be {"type": "text", "text": ...}; nanoserve '
                             'serves text only')
        return "".join(p["text"] for p in v)

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a role 'tool' message needs tool_call_id (and only it may have one)")
        return self

    def as_dict(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(BaseRequest):
    NO_OPS: ClassVar[dict] = {k: v for k, v in NO_OP_VALUES.items()
                              if k not in ("tools", "tool_choice", "parallel_tool_calls")}
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # each generated token's logprob ...
    top_logprobs: int | None = None  # ... and the top k (0 to 20), only with logprobs
    # vLLM's: end the rendered prompt with the assistant's header
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template

    def token_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise NanoserveError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise NanoserveError(f"top_logprobs={self.top_logprobs} must be an integer in "
                                 f"[0, {MAX_LOGPROBS}]")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise NanoserveError("give max_tokens or max_completion_tokens, not two different "
                                     "values")
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def tool_mode(self) -> tuple[str | None, dict | None]:
        """tool_calls.forced for this request's tools and tool_choice."""
        return tool_calls.forced(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self) -> StructuredOutputsParams | None:
        """A named or required tool_choice constrains the output like a JSON schema (alone)."""
        own = super().constraint()
        mode, schema = self.tool_mode()
        if mode is None:
            return own
        if own is not None:
            raise NanoserveError(f"tool_choice={self.tool_choice!r:.60} already constrains the "
                                 "output; drop response_format / structured_outputs")
        return StructuredOutputsParams(json=schema)

    def template_options(self) -> dict:
        """ChatTemplate.encode's options: add_generation_prompt, chat_template_kwargs (vLLM's),
        tools."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "kwargs": self.chat_template_kwargs,
                "tools": self.tools or None}

    def message_dicts(self) -> list[dict]:
        return tool_calls.for_template([m.as_dict() for m in self.messages])
