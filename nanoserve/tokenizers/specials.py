"""Special-token text in a prompt: "<|endoftext|>" written out as characters.

Every tokenizer here encodes text without looking for special tokens (base.py), so the thirteen
characters of "<|endoftext|>" become thirteen ordinary tokens. HF tokenizers and vLLM do the
opposite by default: an added special token written in the text is cut out and becomes its one id
(HF's `split_special_tokens=False`). `encode_with_special_tokens` does that: it cuts the text at
every special token, longest first, and encodes only the pieces between them.

Chat templates need it always (their output spells the turn markers as text). For prompts it is
the engine's `split_special_tokens` setting (LoadConfig): off by default, as in HF and vLLM, so
`/tokenize`, lm-eval's remote tokenizer and a completion prompt agree with them; on, a prompt cannot
smuggle control tokens in (a server whose prompts come from untrusted users may want that).
"""

from __future__ import annotations

import functools

import regex

from .base import Tokenizer


def encode_with_special_tokens(text: str, tokenizer: Tokenizer, bos: bool = False) -> list[int]:
    """Token ids of `text` with each special token's text as its id (`bos`: BOS first)."""
    ids = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
    specials = tokenizer.special_tokens
    if not specials:
        return ids + tokenizer.encode(text)
    pattern = _special_pattern(tuple(sorted(specials, key=len, reverse=True)))  # longest first
    start = 0
    for m in pattern.finditer(text):
        if m.start() > start:
            ids += tokenizer.encode(text[start:m.start()])
        ids.append(specials[m.group()])
        start = m.end()
    if start < len(text):
        ids += tokenizer.encode(text[start:])
    return ids


@functools.lru_cache(maxsize=8)
def _special_pattern(tokens: tuple[str, ...]) -> regex.Pattern:
    """One alternation of the special tokens, compiled once per vocabulary (not per request)."""
    return regex.compile("|".join(regex.escape(t) for t in tokens))
