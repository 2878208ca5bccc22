"""The tokenizer over HTTP, as vLLM serves it, so that outside tools need no copy of it:

    POST /tokenize        {"prompt": "text", "add_special_tokens": true}   (or "messages": [...])
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": "text"}
    GET  /tokenizer_info  -> {"tokenizer_class", "bos_token", "eos_token", "pad_token",
                              "chat_template", "model_max_length", "vocab_size"}

lm-evaluation-harness checks for /tokenizer_info and /tokenize and, when both answer, tokenizes
through them (its "remote" tokenizer). A prompt is encoded exactly as /v1/completions encodes it:
special-token text ("<|endoftext|>") becomes the token's id, as HF's tokenizers and vLLM encode it
(ordinary text instead when the server runs with --split-special-tokens: its users' prompts then
cannot write control tokens; nanoserve/tokenizers/specials.py). `add_special_tokens` (vLLM's name,
default true) adds BOS where the model's prompts start with one and nothing else; `count` says how
many ids came back. `messages` go through the chat template as /v1/chat/completions renders them
(its special tokens as their ids; add_special_tokens then adds nothing, the template writes BOS).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ..errors import NanoserveError
from .limits import ServerLimits
from .openai_chat import ChatMessage
from .tool_calls import for_template


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app, core, chat_template, check_model, limits: ServerLimits) -> None:
    """Register the three routes on `app` for the engine `core` (its tokenizer and context).

    Tokenizing, decoding and encoding the reply as JSON all run in a worker thread: a 4 MB prompt
    is millions of tokens, and a reply of that size built on the event loop would hold every stream
    and /health for seconds. The token counts are bounded by `limits` (as a completion's are)."""

    def tokenizer():
        if core.tokenizer is None:
            raise NanoserveError("this model was loaded without a tokenizer: token ids only")
        return core.tokenizer

    def json_response(obj: dict) -> Response:
        return Response(json.dumps(obj, ensure_ascii=False).encode(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        tok = tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise NanoserveError("give exactly one of prompt (text) and messages (a chat)")
        if body.messages is not None:
            if chat_template is None:
                raise NanoserveError("messages need a chat template and this model has none; send "
                                     "prompt")
            limits.check_messages(len(body.messages))

        def work() -> Response:
            if body.messages is not None:
                msgs = for_template([m.as_dict() for m in body.messages])
                ids = chat_template.encode(msgs, tok, body.add_generation_prompt,
                                           body.chat_template_kwargs)
            else:
                bos = body.add_special_tokens and core.inputs.add_bos
                ids = core.inputs.encode_text(body.prompt, bos)
            limits.check_tokens(len(ids), "the prompt")
            strs = [tok.decode([t]) for t in ids] if body.return_token_strs else None
            return json_response({"count": len(ids), "max_model_len": core.max_model_len,
                                  "tokens": ids, "token_strs": strs})

        return await asyncio.to_thread(work)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        tok = tokenizer()
        limits.check_tokens(len(body.tokens), "the token list")

        def work() -> Response:
            ids = core.inputs.check_token_ids(body.tokens) if body.tokens else []
            return json_response({"prompt": tok.decode(ids)})

        return await asyncio.to_thread(work)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = tokenizer()
        by_id = {i: t for t, i in tok.special_tokens.items()}
        return {"tokenizer_class": type(tok).__name__, "bos_token": by_id.get(tok.bos_id),
                "eos_token": by_id.get(tok.eos_id), "pad_token": None,
                "chat_template": None if chat_template is None else chat_template.source,
                "model_max_length": core.max_model_len, "vocab_size": core.inputs.usable_vocab_size}
