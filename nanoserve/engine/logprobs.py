"""Log-probabilities of tokens: what `SamplingParams(logprobs=k, prompt_logprobs=k)` returns.

A position's entry is a dict {token id: Logprob} holding the token that is there (sampled, or the
prompt's) and the k most likely tokens — k or k + 1 entries, the chosen one first (vLLM's shape).
They are *raw*: `log_softmax` of the model's logits (ids past the tokenizer's vocabulary at -inf),
before the request's penalties, bias and temperature, so they measure the model, not the sampler
(vLLM's default, `logprobs_mode="raw_logprobs"`). `rank` is 1 + the number of tokens strictly
more likely.

Prompt logprobs need the logits of every prompt position, which a prefix-cache hit skips: a
request that asks for them never reads the prefix cache (its blocks still enter it for others),
as vLLM does. The logit at position p scores the token at p + 1, so a prefill chunk covering
positions [start, start + n) scores prompt tokens start + 1 .. start + n; the last prompt
position's logit scores the first generated token instead. Taught in notebooks/11_*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import NanoserveError, RequestFailedError

PositionLogprobs = dict  # {token id: Logprob}, the chosen token first


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's name and fields)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None  # the token alone, decoded (None without a tokenizer)


@torch.inference_mode()
def compute_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int],
                     tokenizer=None) -> list[PositionLogprobs]:
    """For each row of logits [R, V]: the logprob and rank of token_ids[r] and the top ks[r] tokens,
    with one device→host transfer for all rows."""
    lp = logits.float().log_softmax(dim=-1)  # R, V
    chosen_ids = torch.tensor(list(token_ids), device=lp.device)[:, None]  # R, 1
    chosen = lp.gather(-1, chosen_ids)  # R, 1
    rank = (lp > chosen).sum(-1, keepdim=True)  # R, 1: tokens strictly more likely
    k = max(ks, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen_ids[:, :0])  # R, k
    host_lp = torch.cat([chosen, top_lp], dim=-1).tolist()  # R, 1 + k
    host_ids = torch.cat([rank, top_ids], dim=-1).tolist()
    decode = _Decoder(tokenizer)
    out = []
    for r, tok in enumerate(token_ids):
        entry = {tok: Logprob(host_lp[r][0], host_ids[r][0] + 1, decode(tok))}
        for j in range(ks[r]):
            t = host_ids[r][1 + j]
            if t not in entry:
                entry[t] = Logprob(host_lp[r][1 + j], j + 1, decode(t))
        out.append(entry)
    return out


class _Decoder:
    """tokenizer.decode([id]) with a memo for one call (a prompt's top-k repeat tokens a lot)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.memo = tokenizer, {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token_id not in self.memo:
            try:
                self.memo[token_id] = self.tokenizer.decode([token_id])
            except NanoserveError:
                # an id the vocabulary has no text for: no text, not a failed batch
                self.memo[token_id] = None
        return self.memo[token_id]


def sampled_logprobs(logits: torch.Tensor, params: Sequence, tokens: Sequence[int],
                     tokenizer=None) -> list[PositionLogprobs | None]:
    """The entry of each sampled token whose request asks for logprobs (None for the others), from
    the step's logits [R, V] (before the requests' processing): one transfer for them all."""
    out: list[PositionLogprobs | None] = [None] * len(tokens)
    for text in (True, False):  # (detokenize=False: no decoded tokens)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and p.detokenize == text]
        if rows:
            sub = logits if len(rows) == len(tokens) else logits[rows]  # S, V
            got = compute_logprobs(sub, [tokens[i] for i in rows],
                                   [params[i].logprobs for i in rows],
                                   tokenizer if text else None)
            for i, entry in zip(rows, got):
                out[i] = entry
    return out


def wants_prompt_logits(prompt_logprobs: list | None, seq) -> bool:
    """Whether this step's chunk of `seq` must return all its logits: the request asked for prompt
    logprobs, this is its first sample, and some prompt token in reach is not scored yet."""
    if prompt_logprobs is None or seq.sample_index != 0:
        return False
    return (len(prompt_logprobs) < seq.num_prompt_tokens
            and seq.num_computed_tokens < seq.num_prompt_tokens)


def record_prompt_logprobs(prompt_logprobs: list, seq, logits: torch.Tensor, params,
                           tokenizer=None) -> None:
    """Append the entries this chunk scores to `prompt_logprobs` (entry i is prompt token i's; entry
    0 is None), with params.prompt_logprobs top tokens each (decoded unless params.detokenize is
    False). logits [n, V] are the chunk's, positions start .. start + n − 1 with start =
    seq.num_computed_tokens before the chunk. A recomputed chunk (after preemption) adds nothing
    twice."""
    start, P = seq.num_computed_tokens, seq.num_prompt_tokens
    # a 1-token chunk in a step of single logits: [V]
    logits = logits if logits.dim() == 2 else logits[None]
    # prompt tokens to score now
    first, last = len(prompt_logprobs), min(start + logits.shape[0], P - 1)
    if first > last:
        return
    # a bug: the chunk skipped positions (a prefix-cache hit should have been refused)
    if first - 1 < start:
        raise RequestFailedError(f"prompt logprobs of request {seq.request_id!r}: position "
                                 f"{first - 1} was not computed (the chunk starts at {start})")
    rows = logits[first - 1 - start:last - start]  # the logit at position p scores token p + 1
    ks = [params.prompt_logprobs] * (last + 1 - first)
    if not params.detokenize:
        tokenizer = None
    prompt_logprobs += compute_logprobs(rows, seq.token_ids[first:last + 1], ks, tokenizer)
