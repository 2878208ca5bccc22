"""A request as the engine holds it: its parameters, its output, and one `Sample` per parallel
sample (SamplingParams.n), each with its sequence, random stream and incremental text.

`InputProcessor.make_request` builds them (validating the prompt); the engine, the async engine
and the batchers pass them around. `Request.emit` is the output side of a generated token: text,
stop conditions, timestamps. The token joins the sample's *sequence* through the scheduler
(`Scheduler.postprocess`), which owns sequences. Taught in notebooks/03_*.
"""

from __future__ import annotations

import time
from collections import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import GrammarError, first_line
from .bitmask import apply_row_bitmasks
from .logprobs import PositionLogprobs, sampled_logprobs
from .outputs import CompletionOutput, IncrementalText, RequestOutput
from .sampler import SamplingParams, sample_batch
from .sequence import Sequence

Prompt = str | abc.Sequence[int]


@dataclass(eq=False)
class Sample:
    """Decoding state of one sample: its sequence (token ids, blocks), random stream and text."""

    seq: Sequence
    generator: torch.Generator | None
    text: IncrementalText
    out: CompletionOutput
    seen: torch.Tensor | None  # prompt + generated ids, for the repetition penalty
    matcher: Any = None  # with structured outputs: the grammar's state after this sample's tokens


@dataclass(eq=False)
class Request:
    """One request: its settings, its output (all samples), and the state of each sample."""

    params: SamplingParams
    output: RequestOutput
    max_new: int  # max_tokens, capped by the context
    stop_ids: set[int]
    samples: list[Sample] = field(default_factory=list)
    # with structured outputs: the compiled grammar's start (shared), copied for each sample
    grammar: Any = None

    def emit(self, s: Sample, token: int, logprobs: PositionLogprobs | None = None) -> bool:
        """Add a generated token (and, when asked for, its logprobs) to sample `s`'s output; True
        when a stop condition hit (a stop token, a stop string, max_tokens). Before min_tokens none
        can."""
        now = time.perf_counter()
        if s.seen is not None:
            s.seen = torch.cat([s.seen, torch.tensor([token], device=s.seen.device)])
        out = s.out
        out.token_ids.append(token)
        out.token_times.append(now)
        if s.matcher is not None and (not s.matcher.consume_token(token) or s.matcher.is_error()):
            # the mask allowed it, so the grammar itself broke (a parser limit hit): its request
            # fails
            raise GrammarError(f"request {self.output.request_id!r}: token {token} breaks its "
                               f"structured output grammar ({first_line(s.matcher.get_error())})")
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs)
            out.cumulative_logprob += logprobs[token].logprob
        if self.output.first_token_time is None:
            self.output.first_token_time = now
        # (stop tokens are banned before: sampler)
        may_stop = len(out.token_ids) >= self.params.min_tokens
        if token in self.stop_ids and may_stop:
            out.finish_reason = "stop"
        else:
            _, hit = s.text.add(token, check_stop=may_stop)
            if hit:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= self.max_new:
                out.finish_reason = "length"
            elif s.matcher is not None and s.matcher.is_stopped():  # the grammar is complete
                out.finish_reason = "stop"
        if out.finish_reason:
            s.text.flush()
        # while running, only settled text (no possible stop-string prefix, no cut UTF-8 character),
        # so that out.text only ever grows and a stream can send its new part
        out.text = s.text.text[: s.text.emitted]
        return out.finish_reason is not None

    def emit_all(self, s: Sample, tokens: list[int], logprobs: list[PositionLogprobs] | None = None
                 ) -> tuple[list[int], bool]:
        """Emit tokens in order until one finishes the sample: (the tokens emitted, finished)."""
        for i, token in enumerate(tokens):
            if self.emit(s, token, None if logprobs is None else logprobs[i]):
                return tokens[: i + 1], True
        return tokens, False


def logit_rows(logits, rows: list[int]) -> torch.Tensor:
    """The rows of a step's logits that sample, [R, V]: `logits` [B, V], or speculation's ragged
    list of [1 + γ, V] / [1, V] (their last row each)."""
    if not isinstance(logits, torch.Tensor):
        return torch.stack([logits[row][-1] for row in rows])  # R, V
    if rows == list(range(logits.shape[0])):
        return logits  # every row samples once, in order: no copy (the common decode step)
    return logits.index_select(0, torch.tensor(rows, device=logits.device))  # R, V


def draw(logits: torch.Tensor, pairs: list[tuple[Request, Sample]], tokenizer=None,
         bitmasks: list | None = None) -> tuple[list, list, list]:
    """One token for each (request, sample) pair from its row of logits [R, V], all in one batched
    draw: each row's allowed-token mask (`bitmasks`, engine/bitmask.py: a structured output's
    grammar; None for a row without one, or for all), the request's processing and sampling. Returns
    the tokens, which rows held NaN, and the raw logprobs of the rows that ask for them (from the
    unmasked logits)."""
    params = [r.params for r, _ in pairs]
    allowed = logits if bitmasks is None else apply_row_bitmasks(logits, bitmasks)
    tokens, nan = sample_batch(allowed, params, [s.seen for _, s in pairs],
                               [s.generator for _, s in pairs],
                               [s.out.token_ids for _, s in pairs], [r.stop_ids for r, _ in pairs])
    return tokens, nan, sampled_logprobs(logits, params, tokens, tokenizer)
