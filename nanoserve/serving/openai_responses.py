"""The JSON the server answers with, as OpenAI shapes it: completion and chat responses, their
stream chunks, `usage`, and the error object. Plain dicts (openai_schema.py documents them as
schemas); logprobs come from openai_logprobs.py. Re-exported by openai_api.py.
"""

from __future__ import annotations

import time
import uuid

from ..engine.outputs import RequestOutput
from .openai_logprobs import chat_logprobs, completion_logprobs, echo_text, prompt_logprobs_json


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outs: list[RequestOutput]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every sample (a final EOS included), and
    the prompt tokens the prefix cache served (`prompt_tokens_details.cached_tokens`)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_response(rid: str, model: str, created: int, outs: list[RequestOutput],
                        echo: bool = False,
                        tokenizer=None, prompt_logprobs: bool = False) -> dict:
    """`outs`: one finished RequestOutput per prompt, in prompt order; choice index = prompt · n +
    sample. With `echo` each choice's text (and logprobs) starts with its prompt's; with
    `prompt_logprobs` (vLLM's field) each choice carries them too."""
    n, choices = len(outs[0].outputs), []
    for i, o in enumerate(outs):
        prefix = echo_text(o, tokenizer) if echo else ""
        extra = (
            {"prompt_logprobs": prompt_logprobs_json(o.prompt_logprobs)} if prompt_logprobs else {}
        )
        choices += [{"index": i * n + c.index, "text": prefix + c.text,
                     "logprobs": completion_logprobs(o, c, 0, echo, tokenizer, 0),
                     "finish_reason": finish_reason(c.finish_reason), **extra} for c in o.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage(outs)}


def chat_response(rid: str, model: str, created: int, out: RequestOutput, top_logprobs: int = 0,
                  tokenizer=None, calls=None) -> dict:
    """`calls(text) -> (content, tool_calls)` parses each choice's text for tool calls
    (tool_calls.py); the prompt's logprobs (vLLM's `prompt_logprobs`) ride at the top level when the
    request asked for them."""
    choices = []
    for c in out.outputs:
        content, found = calls(c.text) if calls is not None else (c.text, [])
        message = {"role": "assistant", "content": content,
                   **({"tool_calls": found} if found else {})}
        reason = (
            "tool_calls" if found and c.finish_reason != "length"
            else finish_reason(c.finish_reason)
        )
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c, 0, top_logprobs, tokenizer),
                        "finish_reason": reason})
    extra = (
        {} if out.prompt_logprobs is None
        else {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
    )
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage([out]), **extra}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason(reason)}]}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason(reason)}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, outs: list[RequestOutput]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(outs)}


def model_card(name: str, root: str, parent: str | None, max_model_len: int) -> dict:
    """A /v1/models entry as vLLM shapes it: OpenAI's Model (id, object, created, owned_by) and
    vLLM's fields: `root`, what it was loaded from (the model's path or id; an adapter's
    directory), `parent` (an adapter's base model, null for a base model), `max_model_len`, and
    `permission`, one model_permission object (OpenAI's retired shape, filled as vLLM fills it)."""
    return {"id": name, "object": "model", "created": now(), "owned_by": "nanoserve",
            "root": root, "parent": parent, "max_model_len": max_model_len,
            "permission": [model_permission()]}


def model_permission() -> dict:
    """vLLM's one permission object per model: sampling and logprobs allowed, nothing else."""
    return {"id": new_id("modelperm"), "object": "model_permission", "created": now(),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


def error_body(message: str, type_: str = "invalid_request_error", code: str | int | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def now() -> int:
    return int(time.time())
