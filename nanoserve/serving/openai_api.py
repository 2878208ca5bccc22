"""The OpenAI API as nanoserve speaks it: request bodies, their mapping onto SamplingParams, and
the JSON of responses, stream chunks and errors. No HTTP here (that is server.py).

Bodies are pydantic models with `extra="forbid"`, so a field nanoserve does not implement is an
error naming it, never silently ignored (a client asking for structured output must not get a
response that looks as if it were constrained). Fields that OpenAI defines but we do not implement
are accepted only at their no-op values (`tools: []`, `response_format: {"type": "text"}`, ...),
which some clients send on every call. Beyond OpenAI's fields, vLLM's extensions are accepted with
vLLM's names: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `ignore_eos`, `prompt_logprobs`. Logprobs come in OpenAI's two
shapes (openai_logprobs.py): completions' `logprobs=k` (+ `echo`: the prompt's too), chat's
`logprobs=true` + `top_logprobs=k`.

Values are checked by `SamplingParams` (one source of truth for what is allowed); pydantic only
checks types, strictly, as the OpenAI API documents them: `"max_tokens": "5"` or `"stream": "yes"`
is a 400, not silently converted (an integer is accepted where a number is expected).
Defaults follow OpenAI: completions generate 16 tokens unless told otherwise, chat completions
until the context is full. `model` may be left out (vLLM's: the base model). `max_tokens: 0` is
allowed only with completions' `echo`: the prompt alone, which the engine prefills (scoring it)
without sampling a token.

Streaming (server-sent events): one chunk per engine step in which a choice produced tokens (its
text delta may be empty while a stop string or a cut UTF-8 character is held back), a last chunk
per choice carrying `finish_reason`, then `data: [DONE]`. `usage` comes in every non-streamed
response; in a stream, on the chunk that ends the last choice or, with
`stream_options.include_usage`, only on OpenAI's extra final chunk with empty `choices`
(`continuous_usage_stats`, from vLLM, puts the running count on every chunk).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ..engine.sampler import SamplingParams
from ..engine.sampling_params import KINDS, StructuredOutputsParams
from ..errors import NanoserveError
from .openai_logprobs import chat_logprobs, completion_logprobs, echo_text
from .openai_responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    finish_reason,
    new_id,
    now,
    usage,
    usage_chunk,
)

__all__ = ["BaseRequest", "CompletionRequest", "StreamOptions", "NO_OP_VALUES", "chat_chunk",
           "chat_logprobs", "chat_response", "completion_chunk", "completion_logprobs",
           "completion_response",
           "echo_text", "error_body", "finish_reason", "new_id", "now", "usage", "usage_chunk"]

# OpenAI fields we accept only at the value that means "off"
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""), "parallel_tool_calls": (None,), "tools": (None, []),
    "tool_choice": (None, "none"),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage so far on every chunk


class BaseRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)
    NO_OPS: ClassVar[dict] = NO_OP_VALUES  # fields accepted at these values only
    model: str | None = None  # left out: the base model (vLLM's), answered as its first name
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None  # accepted, unused
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token ids as text
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    # fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI fields accepted at their no-op values only
    parallel_tool_calls: bool | None = None
    tools: list | None = None
    tool_choice: Any = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict | None = None

    def check_no_ops(self) -> None:
        set_fields = self.model_fields_set
        bad = [k for k, allowed in self.NO_OPS.items()
               if k in set_fields and getattr(self, k, None) not in allowed]
        if bad:
            one = len(bad) == 1
            raise NanoserveError(f"unsupported field{'' if one else 's'} {', '.join(bad)}: "
                                 f"nanoserve does not implement {'it' if one else 'them'} (leave "
                                 f"{'it' if one else 'them'} unset, or at the default)")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (SamplingParams raises NanoserveError on bad values)."""
        self.check_no_ops()
        if self.stream_options is not None and not self.stream:
            raise NanoserveError("stream_options is only allowed with stream=true")
        max_tokens = _or_default(self.max_tokens, default_max_tokens)
        if max_tokens == 0 and not self.may_generate_nothing():
            raise NanoserveError("max_tokens=0 must be an integer ≥ 1 (0 only in /v1/completions "
                                 "with echo=true: the prompt alone, nothing generated)")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw = dict(temperature=_or_default(self.temperature, 1.0),
                  top_p=_or_default(self.top_p, 1.0),
                  # vLLM's -1 = off, like our 0
                  top_k=0 if self.top_k in (None, -1) else self.top_k,
                  min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
                  frequency_penalty=self.frequency_penalty or 0.0,
                  logit_bias=_token_keys(self.logit_bias),
                  repetition_penalty=_or_default(self.repetition_penalty, 1.0),
                  max_tokens=max_tokens, min_tokens=self.min_tokens, n=self.n, seed=self.seed,
                  ignore_eos=self.ignore_eos, stop_token_ids=list(self.stop_token_ids or ()),
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logprobs=self.token_logprobs(), prompt_logprobs=self.scored_prompt(),
                  structured_outputs=self.constraint(),
                  stop=stop)
        return SamplingParams(**kw)

    def token_logprobs(self) -> int | None:
        """How many top logprobs per generated token (None: none at all); each endpoint spells it
        its way."""
        raise NotImplementedError

    def scored_prompt(self) -> int | None:
        """The prompt logprobs the engine computes: vLLM's prompt_logprobs (completions' echo adds
        its own)."""
        return self.prompt_logprobs

    def may_generate_nothing(self) -> bool:
        """Whether max_tokens=0 is allowed (only completions' echo, which returns the prompt)."""
        return False

    def constraint(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the body asks for, however it is spelled; None for
        none."""
        given = {k: getattr(self, k) for k in ("response_format", "structured_outputs",
                                               "guided_json",
                                               "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, k) is not None and getattr(self, k) != {"type": "text"}}
        if len(given) > 1:
            raise NanoserveError(f"give one structured-output constraint, not {len(given)} "
                                 f"({', '.join(given)})")
        if not given:
            return None
        (field, value), = given.items()
        if field == "response_format":
            return StructuredOutputsParams(**_response_format(value))
        if field == "structured_outputs":
            keys = (*KINDS, "disable_any_whitespace")
            return StructuredOutputsParams(**_checked_keys(value, "structured_outputs", keys))
        return StructuredOutputsParams(**{field.removeprefix("guided_"): value})


def _checked_keys(value: dict, field: str, allowed: tuple) -> dict:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise NanoserveError(f"{field}: unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")
    return value


def _response_format(value: dict) -> dict:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} (or {"type": "text"}, no constraint)."""
    kind = value.get("type")
    if kind == "json_object":
        _checked_keys(value, "response_format", ("type",))
        return {"json_object": True}
    if kind == "json_schema":
        _checked_keys(value, "response_format", ("type", "json_schema"))
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise NanoserveError('response_format.json_schema must be an object {"name": ..., '
                                 '"schema": {...}}')
        _checked_keys(spec, "response_format.json_schema",
                      ("name", "schema", "strict", "description"))
        return {"json": spec.get("schema", {})}
    raise NanoserveError(f"response_format.type={kind!r}: allowed are 'text', 'json_object', "
                         "'json_schema'")


TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")  # ASCII digits (str.isdigit also takes "²" and "①")


def _or_default(value, default):
    """A field the client left out (None) as its default."""
    return default if value is None else value


def _token_keys(bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias as sent (JSON object keys are strings) with integer token ids."""
    out = {}
    for key, value in (bias or {}).items():
        if TOKEN_ID_KEY.fullmatch(key.strip()) is None:
            raise NanoserveError(
                f"logit_bias: key {key!r:.40} is not a token id; keys are token ids "
                'as decimal strings of at most 18 digits, e.g. "50256"'
            )
        out[int(key)] = value
    return out


class CompletionRequest(BaseRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the top-k per token (0: the chosen token's alone)
    echo: bool = False  # the prompt in front of the text (and its logprobs, with logprobs)
    best_of: int | None = None
    suffix: str | None = None

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def scored_prompt(self) -> int | None:
        """Echo with logprobs returns the prompt's logprobs too (the legacy format), at logprobs'
        k. Echo with max_tokens=0 returns the prompt alone: the engine prefills it, scoring it (at
        k=0 when no logprobs were asked for), and samples nothing (engine/sampling_params.py)."""
        if self.echo and self.logprobs is not None:
            if self.prompt_logprobs not in (None, self.logprobs):
                raise NanoserveError(f"echo with logprobs={self.logprobs} returns the prompt's "
                                     f"logprobs at that k; prompt_logprobs={self.prompt_logprobs} "
                                     "contradicts it")
            return self.logprobs
        if self.echo and self.max_tokens == 0 and self.prompt_logprobs is None:
            return 0
        return self.prompt_logprobs

    def may_generate_nothing(self) -> bool:
        return self.echo

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise NanoserveError("prompt is empty; give a string, a list of token ids, or a list "
                                 "of either")
        return list(p)
