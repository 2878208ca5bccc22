"""Async scheduling: step N + 1 is scheduled and launched before step N's tokens reach the host
(vLLM's `async_scheduling`; SGLang calls it the overlap scheduler):
`LLM(..., async_scheduling=True)`, `nanoserve serve --async-scheduling`.

**Why.** In the synchronous step (`LLMEngine.sync_step`) the device idles while the host does its
part: it waits for the sampled tokens, emits them (text, stop conditions), schedules the next step
and builds its inputs. On the first GPU pass that was ~0.6 ms of a 2.7 ms batch-1 token
(benchmarks/RESULTS.md), and it grows with the batch. Here the host does that work while the
device runs the next step:

    host    sched N+1, inputs, launch N+1 │ wait for N's tokens, emit them │ sched N+2, inputs, …
    device  ········ step N ············· │ ··············· step N+1 ······················

**How.** The sampled tokens stay on the device, and the next forward reads them from there:
1. After launching a step, each sequence that samples gets a `PLACEHOLDER` token
   (`Scheduler.postprocess`): its length, slots and blocks are right, only the id is unknown on
   the host.
2. The next step is scheduled and its inputs built on the host as always; `LateTokens.fill` then
   copies the ids still on the device into the placeholders' places in `input_ids`, on the device.
3. The tokens are copied to pinned host memory behind the step that sampled them, and an event is
   recorded. Once the next step is launched, the host waits on that event (the device is busy with
   the next step meanwhile), fills the placeholders in (`Scheduler.fill_in`) and emits the tokens.
4. So stop conditions apply one step late: a sequence that stopped at step N ran in step N + 1 too;
   that token is dropped (its compute is wasted) and its blocks return to the pool at once. A
   sequence whose last token is known by its length (max_tokens) leaves the batch as soon as that
   token is launched, and no step is wasted on it.
Outputs come back one step late. On a CPU nothing overlaps (torch runs each op before returning),
so the mode costs there what it saves on a GPU: the same tokens, no faster.

**Where it falls back** to `sync_step`, after taking in the tokens in flight: whenever a live
request needs its tokens on the host before its next forward (`needs_host_tokens`): a grammar (its
next mask follows the last token), logprobs (computed against the sampled token), n > 1 (the
samples fork after the prefill), and penalties or min_tokens (they read the generated ids).
Speculative decoding and models split over ranks are refused with async scheduling
(config/engine.py). Not done yet: sampling inside the decode CUDA graph, and positions and slots
advanced on the device (the host builds them while the device runs the step before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import is_fatal
from .late_tokens import PLACEHOLDER, LateTokens
from .llm_engine import EngineStep, LLMEngine
from .outputs import RequestOutput
from .request import Request, Sample, logit_rows
from .sampler import sample_batch_on_device
from .sequence import Sequence, SequenceStatus

LIVE = (SequenceStatus.RUNNING, SequenceStatus.WAITING)  # not finished, not aborted


def needs_host_tokens(req: Request) -> bool:
    """Whether `req` needs each sampled token on the host before its next forward."""
    params = req.params
    penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0
                 or params.frequency_penalty != 0)
    wants_logprobs = params.logprobs is not None or params.prompt_logprobs is not None
    return (req.grammar is not None or wants_logprobs or params.n > 1 or penalties
            or params.min_tokens > 0)


@dataclass
class LateRow:
    """A sample whose token is in flight: in row `index` of the step's tokens, due at
    `position` of its sequence."""

    req: Request
    sample: Sample
    position: int
    index: int


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""

    tokens: torch.Tensor  # R, on the device: the next forward reads them there (LateTokens)
    host: torch.Tensor  # 2R: the tokens, then the NaN flags; filled once `ready` has fired
    ready: torch.cuda.Event | None  # recorded behind the copy (None: on a CPU, already there)
    rows: list[LateRow]

    def index_of(self) -> dict[int, tuple[int, int]]:
        """{seq_id: (its token's index in `tokens`, its position)}, as LateTokens reads them."""
        return {row.sample.seq.seq_id: (row.index, row.position) for row in self.rows}

    def host_values(self) -> tuple[list[int], list[bool]]:
        """The tokens and NaN flags on the host, waiting for the copy if it is still running:
        the one blocking wait of a steady step."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        R = len(values) // 2
        return values[:R], [bool(v) for v in values[R:]]


class OverlappedStep:
    """`LLMEngine.step` under async scheduling: launch this step, then take in the last one's
    tokens, so the host's work runs while the device computes."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.in_flight: InFlight | None = None
        self.num_sync_steps = 0  # steps run synchronously (a request needed its tokens)
        self._pinned: list[torch.Tensor] = []  # two host buffers on a GPU, used in turn
        self._launches = 0

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then emit the tokens of the one before it."""
        engine = self.engine
        if any(needs_host_tokens(req) for req in engine.requests.values()):
            self.num_sync_steps += 1
            return self._sync_step()
        step = EngineStep(engine.scheduler.schedule())
        engine.last_num_seqs = len(step.sched.seqs)
        engine.last_num_tokens = step.sched.num_tokens  # (no step hooks run here)
        launched = None
        if engine._prepare(step.sched):
            launched = self._launch(step)
        self._take_in(step.done)  # the step before: its tokens, while the device runs this one
        if launched is not None:
            self.in_flight = self._hold(step, *launched)
        return engine._collect(step.done)

    def _sync_step(self) -> list[RequestOutput]:
        """The tokens in flight taken in, then one synchronous step; both steps' outputs."""
        done: dict[str, RequestOutput] = {}
        self._take_in(done)
        outputs = {out.request_id: out for out in self.engine._collect(done)}
        for out in self.engine.sync_step():
            outputs[out.request_id] = out
        return list(outputs.values())

    def _launch(self, step: EngineStep) -> tuple[list[int], tuple | None] | None:
        """The forward (reading the tokens in flight on the device) and the draw, both left
        running: (the rows that sample, (their tokens, their NaN flags) or None when the draw
        failed), or None when the forward failed (every request in it did)."""
        engine = self.engine
        if self.in_flight is not None:
            engine.runner.late_tokens = LateTokens(self.in_flight.tokens[:, None],
                                                   self.in_flight.index_of())
        try:
            logits = self._isolated(step.sched.seqs, step.done, engine._forward, step)
        finally:
            engine.runner.late_tokens = None
        if logits is None:
            return None
        sched = step.sched
        due = [row for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_new))
               if seq.num_computed_tokens + n == len(seq)]  # the rest: prefill chunks
        seqs = [sched.seqs[row] for row in due]
        return due, self._isolated(seqs, step.done, self._draw, logits, due, seqs)

    def _isolated(self, seqs: list[Sequence], done: dict, fn, *args):
        """`LLMEngine.isolated` for this step's forward and draw: on a fault the tokens in flight
        are taken in first, so a request they finish ends as it would have (not failed by a
        step it no longer needed); the rest of `seqs` fail."""
        try:
            return fn(*args)
        except Exception as e:
            if is_fatal(e):
                raise
            self._take_in(done)
            live = [seq for seq in seqs if seq.status in LIVE]
            return self.engine.isolated(live, done, _reraise, e)

    def _draw(self, logits, due: list[int], seqs: list[Sequence]):
        """(tokens [R], NaN flags [R]) on the device for the rows in `due`."""
        samples = [self._sample_of(seq) for seq in seqs]
        params = [self.engine.requests[seq.request_id].params for seq in seqs]
        rows = logit_rows(logits, due)  # R, V
        generators = [sample.generator for sample in samples]
        return sample_batch_on_device(rows, params, [None] * len(due), generators)

    def _sample_of(self, seq: Sequence) -> Sample:
        return self.engine.requests[seq.request_id].samples[seq.sample_index]

    def _hold(self, step: EngineStep, due: list[int], drawn: tuple | None) -> InFlight | None:
        """After the step before is taken in: this step's rows advance, and each row that
        sampled gets a placeholder for its token (its last token by length: the sequence leaves
        the batch now). The tokens in flight, or None when the draw failed (so did its rows)."""
        scheduler, sched = self.engine.scheduler, step.sched
        for seq, n in zip(sched.seqs, sched.num_new):
            if seq.status is SequenceStatus.RUNNING:  # else it stopped (or failed) a step ago
                scheduler.advance(seq, n)
        if drawn is None:
            return None
        tokens, nan = drawn
        rows = []
        for index, row in enumerate(due):
            seq = sched.seqs[row]
            if seq.status is not SequenceStatus.RUNNING:
                continue  # its token of this step is dropped
            req, sample = self.engine.requests[seq.request_id], self._sample_of(seq)
            last = len(sample.out.token_ids) + 1 >= req.max_new
            rows.append(LateRow(req, sample, len(seq), index))
            scheduler.postprocess(seq, [PLACEHOLDER], finished=last)
        host, ready = self._copy_to_host(torch.cat([tokens, nan.long()]))
        return InFlight(tokens, host, ready, rows)

    def _copy_to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying `values` to the host behind the work queued so far: (the host tensor,
        the event that fires when it is filled). On a CPU the values are there already."""
        if values.device.type != "cuda":
            return values, None
        if not self._pinned or self._pinned[0].numel() < values.numel():
            size = 2 * self.engine.engine_config.scheduler.max_num_seqs
            size = max(size, values.numel())
            self._pinned = [torch.empty(size, dtype=values.dtype, pin_memory=True)
                            for _ in range(2)]
        # the buffer the step in flight does not use: it is read after this copy is queued
        self._launches += 1
        host = self._pinned[self._launches % 2][: values.numel()]
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _take_in(self, done: dict[str, RequestOutput]) -> None:
        """The step in flight's tokens, on the host at last: each fills its placeholder and is
        emitted (stop conditions, text) into `done`; none is left in flight."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        tokens, nan = in_flight.host_values()
        for row in in_flight.rows:
            if self.engine.requests.get(row.req.output.request_id) is not row.req:
                continue  # aborted or failed since its step was launched (its id maybe reused)
            self.engine.isolated([row.sample.seq], done, self._emit, row, tokens[row.index],
                                 nan[row.index], done)

    def _emit(self, row: LateRow, token: int, has_nan: bool, done: dict) -> None:
        """One token taken in: into its sequence's placeholder, then into the output; a sequence
        it stops leaves the scheduler."""
        seq = row.sample.seq
        self.engine.scheduler.fill_in(seq, row.position, token)
        if has_nan:
            raise self.engine.nan_error(row.req, row.position)
        finished = row.req.emit(row.sample, token)
        if finished and seq.status in LIVE:
            self.engine.scheduler.finish(seq)
        done[row.req.output.request_id] = row.req.output


def _reraise(error: Exception):
    raise error
