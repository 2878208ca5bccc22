"""Logprobs as the OpenAI API spells them: two JSON shapes for one list of `Logprob` dicts per token
(engine/logprobs.py: the token there first, then the top-k).

Completions (the legacy shape; with `echo`, the prompt's tokens come first, the very first with
null logprobs — nothing predicts it):

    {"tokens": ["ROM", "EO"], "token_logprobs": [null, -2.1],
     "top_logprobs": [null, {"EO": -2.1, ...}], "text_offset": [0, 3]}

Chat completions:

    {"content": [{"token": "EO", "logprob": -2.1, "bytes": [69, 79],
                  "top_logprobs": [{"token": "EO", "logprob": -2.1, "bytes": [69, 79]}, ...]}],
     "refusal": null}

JSON has no infinity: a token the model rules out (logprob -inf) reads -9999.0, as in OpenAI's and
vLLM's answers. A token's text is it decoded alone; a byte-level token holding part of a UTF-8
character decodes to "\ufffd", which is why chat also sends `bytes`. Taught in notebooks/11_*.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.logprobs import Logprob
from ..engine.outputs import CompletionOutput, RequestOutput

FLOOR = -9999.0  # what -inf is sent as


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


def _text(lp: Logprob | None, token: int, tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def echo_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as text, for `echo`: as sent, or its token ids decoded."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def legacy(entries: Sequence[dict | None], token_ids: Sequence[int], tokenizer,
           offset: int = 0) -> dict:
    """Completions' shape for tokens `token_ids` with their entries (None: no logprob, the first
    prompt token); `offset` is where the first token's text starts in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for entry, token in zip(entries, token_ids):
        text = _text(None if entry is None else entry[token], token, tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else _value(entry[token]))
        out["top_logprobs"].append(None if entry is None else {_text(lp, t, tokenizer): _value(lp)
                                                               for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_logprobs(out: RequestOutput, c: CompletionOutput, start: int, echo: bool, tokenizer,
                        offset: int) -> dict | None:
    """A choice's logprobs for its tokens from `start` on (a stream sends them in pieces), the
    prompt's first when echoing; None when the request did not ask for logprobs."""
    if c.logprobs is None:
        return None
    entries, ids = list(c.logprobs[start:]), list(c.token_ids[start:])
    if echo:
        entries, ids = list(out.prompt_logprobs) + entries, list(out.prompt_token_ids) + ids
    return legacy(entries, ids, tokenizer, offset)


def _chat_token(lp: Logprob, token: int, tokenizer) -> dict:
    text = _text(lp, token, tokenizer)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, start: int, k: int, tokenizer) -> dict | None:
    """Chat's shape for a choice's tokens from `start` on; k = top_logprobs. None without
    logprobs."""
    if c.logprobs is None:
        return None
    content = []
    for entry, token in zip(c.logprobs[start:], c.token_ids[start:]):
        top = sorted(((t, lp) for t, lp in entry.items() if len(entry) <= k or t != token),
                     key=lambda x: x[1].rank)
        content.append({**_chat_token(entry[token], token, tokenizer),
                        "top_logprobs": [_chat_token(lp, t, tokenizer) for t, lp in top[:k]]})
    return {"content": content, "refusal": None}


def prompt_logprobs_json(entries: Sequence[dict | None]) -> list:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}, ids as JSON keys (strings)."""
    return [None if e is None else {str(t): {"logprob": _value(lp), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
