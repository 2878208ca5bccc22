"""`AsyncLLMEngine`: the engine behind an asyncio server. Many coroutines await their own
request's outputs while one background task drives `LLMEngine.step()`.

    engine = AsyncLLMEngine(LLMEngine.from_kwargs("demo"))
    async for out in engine.generate("ROMEO:", SamplingParams(max_tokens=50)):
        print(out.text)                     # the output so far; the last one is finished

**Who touches the engine when.** A step is a model forward: milliseconds to seconds. Run in the
event loop, it would freeze every connection for that long (no bytes sent, no disconnects seen,
no /health answered). So the step runs in a worker thread (`step_in_thread=True`, the default)
while the loop goes on serving HTTP, and the loop changes the engine only *between* steps:

    loop thread                                   worker thread
    generate(): validate (new_request) ──┐
                put in `_new`            │
    abort():    put in `_aborts`         │
    _run():  apply `_new` and `_aborts` ─┘  ──►   engine.step()  ──► snapshots of the outputs
             hand each snapshot to its consumer's queue     ◄──
             (repeat while anything is unfinished)

`new_request` reads only the model's configuration (LLMEngine documents that), so validation
happens at once in `generate()`: a bad prompt or a full queue raises there, before a stream
starts. Outputs are handed over as snapshots (`RequestOutput.snapshot()`), because the engine
keeps growing its own objects during the next step while consumers read theirs.

A consumer that stops iterating (a client that disconnected) aborts its request; the abort is
applied before the next step, which frees its blocks. A request that fails inside a step (the
engine already freed its blocks) raises `RequestFailedError` in its own consumer only; an error
that escapes `step()` is fatal by construction (errors.is_fatal), so every consumer gets it and
the engine takes no more requests (`on_fatal` tells whoever asked, e.g. the server, which then
exits). vLLM's AsyncLLMEngine has this shape (requests and aborts queued, applied between steps); it
later moved the engine to its own process. Taught in notebooks/09_*.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.request import Prompt, Request
from ..engine.sampler import SamplingParams
from ..engine.scheduler import QueueFullError
from ..errors import NanoserveError, RequestFailedError


class EngineDeadError(RuntimeError):
    """The engine cannot take or finish requests (it failed, or it is shutting down): HTTP 503."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, step_in_thread: bool = True):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}  # request id → its consumer's outputs
        # validated requests (by id) waiting for a gap between steps
        self._new: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-step")
            if step_in_thread else None
        )
        self._loop_task: asyncio.Task | None = None
        self._stepping = False  # a step is running on the worker thread: leave the engine alone
        # a step failed: the engine may be inconsistent, serve no more
        self.error: BaseException | None = None
        # called with that error once every consumer has it (a server exits: serve())
        self.on_fatal: list = []
        self.num_steps = 0  # steps run so far (tests count how many steps an abort takes)
        # called with the LLMEngine after each step, on the event loop (a server's /metrics)
        self.on_step: list = []

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    priority: int = 0) -> tuple[str, asyncio.Queue]:
        """Validate and queue a request (entering the engine at the next gap between steps).

        Raises NanoserveError for bad input and QueueFullError when the waiting queue, counting
        the requests not yet applied, is at `max_waiting`. Must be called from the event loop; a
        server validates in a worker thread with `engine.new_request` and then calls `submit`."""
        self._check_alive()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        return self.submit(self.engine.new_request(prompt, params, rid, priority))

    def submit(self, req: Request) -> tuple[str, asyncio.Queue]:
        """Queue a request made by `LLMEngine.new_request` (which may run on any thread); returns
        its id and the queue its outputs arrive on. Must be called from the event loop."""
        self._check_alive()
        rid = req.output.request_id
        if rid in self._queues:
            raise NanoserveError(f"request id {rid!r} is already in use")
        limit = self.engine.scheduler.config.max_waiting
        waiting = len(self.engine.scheduler.waiting) + len(self._new)
        if limit is not None and waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({waiting} requests, "
                                 f"max_waiting={limit}); retry later")
        self._new[rid] = req
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return rid, queue

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier ({type(self.error).__name__}: "
                                  f"{self.error}) and takes no more requests; restart the server")

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output (a snapshot) each step it advances; the last one is finished.

        Validation errors raise at the first `__anext__`, before anything is yielded."""
        rid, queue = self.add_request(prompt, params, request_id, priority)
        async for out in self.outputs(rid, queue):
            yield out

    async def outputs(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued with `add_request`; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                # this request alone failed inside a step; the engine goes on
                if out.error is not None:
                    finished = True
                    # its grammar went over a limit: the client's to mend
                    if out.error_is_bad_input:
                        raise NanoserveError(f"request {rid} failed: {out.error}")
                    raise RequestFailedError(f"request {rid} failed inside the engine: {out.error}")
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request: it leaves the engine and frees its blocks now, or, while a step is in
        flight, right after that step. Its consumer's queue goes too (it may never have started)."""
        self._queues.pop(request_id, None)
        self._new.pop(request_id, None)
        if self._stepping:
            self._aborts.add(request_id)
        else:
            self.engine.abort_request(request_id)

    @property
    def num_pending(self) -> int:
        """Requests accepted but not yet in the engine (they enter at the next gap between
        steps)."""
        return len(self._new)

    @property
    def errored(self) -> bool:
        """A step failed (every consumer got the error) and no request is taken since: report
        unhealthy."""
        return self.error is not None

    # ------------------------------------------------------------------ the loop
    def _apply_pending(self) -> None:
        """Between steps: new requests enter the scheduler, aborted ones leave it."""
        new, self._new = self._new, {}
        for req in new.values():
            try:
                self.engine.enqueue(req)
            except NanoserveError as e:  # the queue filled up with preempted sequences meanwhile
                self._deliver(req.output.request_id, e)
        aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            self.engine.abort_request(rid)

    def _step(self) -> list[RequestOutput]:
        return [out.snapshot() for out in self.engine.step()]

    async def _run(self) -> None:
        while self._new or self._aborts or self.engine.has_unfinished_requests():
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outs = await self._step_async()
            except Exception as e:
                # shared state broke (step() keeps per-request faults to their request):
                # every consumer gets the error, no one new is let in; a server reports 503
                self.error = e
                for rid in list(self._queues):
                    self._deliver(rid, e)
                for callback in self.on_fatal:
                    callback(e)
                return
            self.num_steps += 1
            for callback in self.on_step:
                callback(self.engine)
            for out in outs:
                self._deliver(out.request_id, out)
            await asyncio.sleep(0)  # let consumers (and new requests) run between steps

    async def _step_async(self) -> list[RequestOutput]:
        if self._executor is None:
            return self._step()
        future = self._executor.submit(self._step)
        self._stepping = True
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # a step cannot stop halfway: wait for it, so no one touches the engine mid-step
            concurrent.futures.wait([future])
            raise
        finally:
            self._stepping = False
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:  # the consumers that left during the step
                self.engine.abort_request(rid)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(item)

    async def shutdown(self) -> None:
        """Stop the loop (after its step in flight), abort everything, stop the worker thread."""
        task, self._loop_task = self._loop_task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._new.clear()
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        for rid in list(self._queues):
            self._deliver(rid, EngineDeadError("the engine is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
