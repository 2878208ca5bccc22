"""Three batching strategies on one request type, to compare on the same workload.

- `StaticBatcher`: fixed batches of `batch_size` requests in arrival order. A batch starts once
  all its members have arrived and runs until its *last* request finishes: nothing joins midway,
  and rows that finished early still ride along (their last token is recomputed each step, the
  cost that padding has in HF `generate`). Prompts are prefilled together, padded to the longest.
- `DynamicBatcher`: the same run-to-completion batches, but a batch is formed from whatever has
  arrived once `max_batch_size` requests are waiting or the oldest has waited `max_wait_ms`
  (the policy of Triton Inference Server / TorchServe).
- `ContinuousBatcher`: the `LLMEngine`'s iteration-level scheduling (Orca): requests join and
  leave the running batch at every step.

All three take the same `generate(prompts, params, arrivals)`: `arrivals` are offsets in seconds
from the start (None: all at once), replayed in real time, so TTFT includes queueing. They run on
the engine's model runner, block pool and sampler, so only the scheduling differs. Outputs carry
per-token timestamps for nanoserve.tools.metrics. Taught in notebooks/03_*.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.request import Prompt, Request, draw
from ..engine.sampler import SamplingParams
from ..engine.scheduler import advance, extend, ride_along
from ..engine.structured_output import matcher_bitmasks
from ..errors import NanoserveError, RequestFailedError


def _params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise NanoserveError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one "
                             "per prompt")
    return list(params)


def _arrivals(arrivals, n: int) -> list[float]:
    if arrivals is None:
        return [0.0] * n
    if len(arrivals) != n or any(a < 0 for a in arrivals) or list(arrivals) != sorted(arrivals):
        raise NanoserveError("arrivals must be one non-negative, non-decreasing offset (seconds) "
                             "per prompt")
    return list(arrivals)


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class _RunToCompletion:
    """What static and dynamic batching share: run one fixed batch until all its requests finish."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.batch_sizes: list[int] = []  # for plots: the size of each batch run

    def _requests(self, prompts, params, arrivals, t0) -> list[Request]:
        ps = _params_list(params, len(prompts))
        if any(p.n != 1 for p in ps):
            raise NanoserveError("static and dynamic batching run n=1 requests; use the "
                                 "continuous engine for n > 1")
        if any(p.prompt_logprobs is not None for p in ps):
            raise NanoserveError("static and dynamic batching do not score prompts "
                                 "(prompt_logprobs); use the continuous engine")
        return [self.engine.new_request(p, q, arrival_time=t0 + a)
                for p, q, a in zip(prompts, ps, _arrivals(arrivals, len(prompts)))]

    def run_batch(self, reqs: list[Request]) -> None:
        """Prefill the whole batch padded to its longest prompt, then decode it until every request
        finished; rows that finished early ride along (scheduler.ride_along). Sequences change only
        through the scheduler module's functions, as in the engine."""
        e = self.engine
        alloc, runner = e.block_allocator, e.runner
        seqs = [r.samples[0].seq for r in reqs]
        self.batch_sizes.append(len(seqs))
        try:
            for seq in seqs:
                if not alloc.can_allocate(seq):
                    raise NanoserveError(f"the KV pool ({alloc.num_blocks} blocks) cannot hold "
                                         f"this batch of {len(seqs)} requests; use smaller batches "
                                         "or a larger cache")
                alloc.allocate(seq)
            now = time.perf_counter()
            for r in reqs:
                r.output.first_scheduled_time = now
            # prefill, padded to the longest
            num_new = [len(s) - s.num_computed_tokens for s in seqs]
            while any(not r.samples[0].out.finish_reason for r in reqs):
                logits = runner.run(seqs, num_new)  # B, V
                rows = [i for i, r in enumerate(reqs) if not r.samples[0].out.finish_reason]
                for i in rows:
                    advance(alloc, seqs[i], num_new[i])
                samples = [reqs[i].samples[0] for i in rows]
                bitmasks = matcher_bitmasks([s.matcher for s in samples], logits.shape[-1])
                pairs = [(reqs[i], s) for i, s in zip(rows, samples)]
                tokens, _, lps = draw(logits[rows], pairs, e.tokenizer, bitmasks)
                for i, s, token, lp in zip(rows, samples, tokens, lps):
                    if reqs[i].emit(s, token, lp):
                        reqs[i].output.finish_time = time.perf_counter()
                        # recompute its last computed position each step from now on
                        ride_along(seqs[i])
                    elif extend(alloc, seqs[i], [token])[0] != 1:
                        raise NanoserveError(f"the KV pool ({alloc.num_blocks} blocks) ran out "
                                             "during a batch")
                num_new = [1] * len(seqs)
        finally:
            for seq in seqs:
                alloc.free(seq)


class StaticBatcher(_RunToCompletion):
    def __init__(self, engine: LLMEngine, batch_size: int = 8):
        super().__init__(engine)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise NanoserveError(f"batch_size={batch_size!r} must be an integer ≥ 1")
        self.batch_size = batch_size

    def generate(self, prompts: Sequence[Prompt], params=None,
                 arrivals=None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        reqs = self._requests(prompts, params, arrivals, t0)
        for i in range(0, len(reqs), self.batch_size):
            batch = reqs[i:i + self.batch_size]
            _sleep_until(batch[-1].output.arrival_time)  # a fixed batch waits for its last member
            self.run_batch(batch)
        return [r.output for r in reqs]


class DynamicBatcher(_RunToCompletion):
    def __init__(self, engine: LLMEngine, max_batch_size: int = 8, max_wait_ms: float = 50.0):
        super().__init__(engine)
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise NanoserveError(f"max_batch_size={max_batch_size!r} must be an integer ≥ 1")
        if not max_wait_ms >= 0:
            raise NanoserveError(f"max_wait_ms={max_wait_ms!r} must be ≥ 0")
        self.max_batch_size, self.max_wait = max_batch_size, max_wait_ms / 1e3

    def generate(self, prompts: Sequence[Prompt], params=None,
                 arrivals=None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        reqs = self._requests(prompts, params, arrivals, t0)
        pending = list(reqs)
        while pending:
            now = time.perf_counter()
            arrived = [r for r in pending if r.output.arrival_time <= now]
            if not arrived:
                _sleep_until(pending[0].output.arrival_time)
                continue
            deadline = arrived[0].output.arrival_time + self.max_wait
            more_coming = len(arrived) < len(pending)
            if len(arrived) < self.max_batch_size and now < deadline and more_coming:
                _sleep_until(min(deadline, pending[len(arrived)].output.arrival_time))
                continue
            batch = arrived[: self.max_batch_size]
            for r in batch:
                pending.remove(r)
            self.run_batch(batch)
        return [r.output for r in reqs]


class ContinuousBatcher:
    """The LLMEngine behind the batchers' common interface."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.batch_sizes: list[int] = []  # sequences in each forward

    def generate(self, prompts: Sequence[Prompt], params=None,
                 arrivals=None) -> list[RequestOutput]:
        e = self.engine
        t0 = time.perf_counter()
        ps, offs = _params_list(params, len(prompts)), _arrivals(arrivals, len(prompts))
        todo = list(zip(prompts, ps, offs))
        ids, done = [], {}
        while todo or e.has_unfinished_requests():
            now = time.perf_counter()
            while todo and t0 + todo[0][2] <= now:
                p, q, a = todo.pop(0)
                ids.append(e.add_request(p, q, arrival_time=t0 + a))
            if not e.has_unfinished_requests():
                _sleep_until(t0 + todo[0][2])
                continue
            for out in e.step():
                if out.error is not None:
                    raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                if out.finished:
                    done[out.request_id] = out
            self.batch_sizes.append(e.last_num_seqs)
        return [done[i] for i in ids]
