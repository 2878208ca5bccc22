"""What a request gives back: `RequestOutput` (one per prompt) with one `CompletionOutput` per
sample, and `IncrementalText`, which turns tokens into text deltas as they are generated.

Shared by every batcher (static, dynamic, continuous), so a learner can compare them on the same
outputs and timestamps; names follow vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .logprobs import PositionLogprobs


@dataclass
class SpecStats:
    """Speculative decoding of one sample: verification steps and tokens drafted / accepted /
    emitted."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    # steps that ended on a rejected draft (the others accepted all of theirs)
    num_rejections: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (drafts after a rejection are never checked and count as not
        accepted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def alpha(self) -> float | None:
        """α, the per-token acceptance probability: accepted / (accepted + rejections). Each checked
        draft is a coin with P(accept) = α, and the coins checked are the accepted drafts and, on a
        step that rejects, the one rejected (the estimate of α in a geometric model)."""
        checked = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / checked if checked else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens per target forward over the speculative steps (plain decoding: 1)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else None


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name); a request with SamplingParams(n=k) has k of them."""

    index: int
    text: str = ""
    # generated ids, a final stop/EOS id included
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # when each token was sampled (perf_counter)
    token_times: list[float] = field(default_factory=list)
    spec_stats: SpecStats | None = None  # with speculative decoding: α, tokens per step
    # with SamplingParams.logprobs: one per token_ids entry
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None  # their sum (with logprobs)


def _snapshot_completion(o: CompletionOutput) -> CompletionOutput:
    """A copy of `o` whose lists and statistics later steps do not change."""
    logprobs = None if o.logprobs is None else list(o.logprobs)
    spec_stats = None if o.spec_stats is None else replace(o.spec_stats)
    return replace(o, token_ids=list(o.token_ids), token_times=list(o.token_times),
                   logprobs=logprobs, spec_stats=spec_stats)


@dataclass
class RequestOutput:
    """One request's result (vLLM's name): its prompt, one CompletionOutput per sample, timestamps,
    error."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs; [0] is None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # queue time = first_scheduled_time - arrival_time
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # set when this request failed on its own (the others go on)
    error_is_bad_input: bool = False  # ... and the fault was its grammar's (a server's 400)

    # the first sample, for the common n = 1 case
    @property
    def text(self) -> str:
        """The first sample's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first sample's generated token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """The first sample's finish reason; None while it runs."""
        return self.outputs[0].finish_reason

    @property
    def token_times(self) -> list[float]:
        """When each of the first sample's tokens was sampled (perf_counter)."""
        return self.outputs[0].token_times

    @property
    def finished(self) -> bool:
        """Whether every sample has a finish reason."""
        return all(o.finish_reason for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish, seconds; None until the request finishes."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def snapshot(self) -> RequestOutput:
        """A copy that later steps do not change (the engine keeps growing this object in place)."""
        outs = [_snapshot_completion(o) for o in self.outputs]
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        return replace(self, outputs=outs, prompt_logprobs=prompt_logprobs)


class IncrementalText:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    The text is always what decoding every id at once gives (`decode(ids)`), but each token costs
    O(its own length), not O(everything so far): the ids up to an *anchor* are decoded once, and
    each new token decodes only the ids after the anchor, behind a window of a few ids before it
    (so merges and leading spaces come out as they would in context). The anchor moves up whenever
    the text decoded so far ends on a complete character. Text that could still become part of a
    stop string, and a trailing incomplete UTF-8 character, are held back until they settle.
    With no tokenizer (a checkpoint without one) there is no text: only token ids.
    """

    WINDOW = 4  # ids decoded in front of the new ones, then cut off again

    def __init__(self, tokenizer, stop: list[str], prompt_ids: Sequence[int] = (),
                 include_stop: bool = False):
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        # Prompt ids in front of the output: whether a continuation starts with a space can depend
        # on what precedes it (SentencePiece drops the space of a text's first word, not of a
        # continuation).
        self.ids: list[int] = list(prompt_ids[-self.WINDOW:])
        self.anchor = len(self.ids)  # ids[:anchor] are settled
        self.anchor_text = ""  # the output's text up to the anchor
        self.text = ""  # final text so far (stop string excluded)
        self.emitted = 0
        self.checked = 0  # stop strings cannot start before this index of the text any more

    def add(self, token_id: int | None, check_stop: bool = True) -> tuple[str, bool]:
        """Append a token (None: no text, e.g. EOS); return (new text, whether a stop string hit).
        With check_stop False (before min_tokens) no stop string is looked for."""
        if token_id is not None:
            self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        window = self.ids[max(0, self.anchor - self.WINDOW):self.anchor]
        settled = self.tokenizer.decode(window)
        tail = self.tokenizer.decode(window + self.ids[self.anchor:])[len(settled):]
        full = self.anchor_text + tail
        if not full.endswith("\ufffd"):  # settled: later tokens cannot change this text
            self.anchor, self.anchor_text = len(self.ids), full
        for s in self.stop if check_stop else ():
            at = full.find(s, self.checked)
            if at >= 0:
                self.text = full[:at + len(s) if self.include_stop else at]
                return self.flush(), True
        # text no later token or stop string can change
        safe = len(full.rstrip("\ufffd")) - self.hold
        self.checked, self.text = max(0, safe), full
        if safe <= self.emitted:
            return "", False
        delta = full[self.emitted:safe]
        self.emitted = safe
        return delta, False

    def flush(self) -> str:
        """Release the text held back so far (at a stop string or the end); return it."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for monitoring; requests count once whatever their n."""

    num_running: int  # requests admitted to the batch (a preempted one waits again)
    num_waiting: int  # requests in the waiting queue
    num_blocks: int  # KV blocks in the pool ...
    num_free_blocks: int  # ... and how many no sequence holds (cached prefix blocks count as free)
    prefix_cache_hits: int  # prompt blocks found in the prefix cache ...
    prefix_cache_queries: int  # ... out of all full prompt blocks looked up
    num_preemptions: int

    @classmethod
    def of(cls, scheduler, num_requests: int) -> EngineStats:
        """The stats of an engine whose scheduler holds `num_requests` requests (queued or
        running)."""
        waiting = {seq.request_id for seq in scheduler.waiting}
        alloc = scheduler.block_allocator
        return cls(num_running=num_requests - len(waiting), num_waiting=len(waiting),
                   num_blocks=alloc.num_blocks,
                   num_free_blocks=alloc.num_free_blocks(), prefix_cache_hits=alloc.stats.hits,
                   prefix_cache_queries=alloc.stats.hits + alloc.stats.misses,
                   num_preemptions=scheduler.num_preemptions)
