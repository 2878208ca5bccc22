"""Reading a request's outputs as the engine produces them, for the server's two kinds of answer:
all of them at the end (`collect`, a plain JSON response) or a chunk per step (`sse`, server-sent
events). Both merge the streams of a batched request (several prompts) and abort every one of
them when the client goes away. Taught in notebooks/09_*.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.outputs import RequestOutput
from ..errors import NanoserveError
from . import openai_api as api
from .metrics import ServerMetrics


class ClientGone(Exception):
    """The client closed the connection before its plain response was ready (the request is
    aborted)."""


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests as they come; leaving early cancels (aborts)
    all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while True:
                i, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield i, item
    finally:
        for t in tasks:
            # a pump still running is a request still in the engine: cancelling aborts it
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(streams, request: Request, metrics: ServerMetrics) -> list[RequestOutput]:
    """The finished output of each request; if the client leaves first, abort them all."""
    last: dict[int, RequestOutput] = {}

    async def drain():
        async for i, out in _merge(streams):
            last[i] = out

    work, gone = asyncio.create_task(drain()), asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, gone):
            t.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
        for out in last.values():
            metrics.observe(out)
    if not work.done() or work.cancelled():
        raise ClientGone("client closed the request")  # nobody reads this; the request is aborted
    work.result()  # re-raise an engine error
    return [last[i] for i in range(len(streams))]


def sse(streams, n: int, chunk, options: api.StreamOptions | None, rid: str, model: str,
        created: int,
         obj: str, metrics: ServerMetrics) -> StreamingResponse:
    """Server-sent events: `data: {chunk}` per step with new tokens per choice, then `data: [DONE]`.
    chunk(index, new text, finish reason, first?, the RequestOutput, the choice, chars and tokens
    sent before) builds one choice's chunk (its logprobs are those of the tokens after `tokens`)."""
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats

    async def events():
        last: dict[int, RequestOutput] = {}
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) → (chars, tokens) sent
        try:
            async for i, out in _merge(streams):
                last[i] = out
                done = len(last) == len(streams) and all(o.finished for o in last.values())
                chunks = []
                for c in out.outputs:
                    chars, tokens = sent.get((i, c.index), (0, 0))
                    ended = tokens < 0  # the choice's final chunk was sent
                    if ended or (len(c.token_ids) == tokens and not c.finish_reason):
                        continue
                    chunks.append(chunk(i * n + c.index, c.text[chars:], c.finish_reason,
                                        (i, c.index) not in sent,
                                        out, c, chars, tokens))
                    sent[(i, c.index)] = (len(c.text), -1 if c.finish_reason else len(c.token_ids))
                if continuous:
                    for ch in chunks:
                        ch["usage"] = api.usage(list(last.values()))
                # with include_usage, only OpenAI's final chunk has it
                if done and chunks and not include_usage:
                    chunks[-1]["usage"] = api.usage([last[j] for j in range(len(streams))])
                for ch in chunks:
                    yield f"data: {json.dumps(ch, ensure_ascii=False)}\n\n"
            if include_usage:
                usage = api.usage_chunk(rid, model, created, obj,
                                        [last[j] for j in range(len(streams))])
                yield f"data: {json.dumps(usage)}\n\n"
        except Exception as e:
            # after the stream began: the queue filled meanwhile (rare), or the engine broke
            kind = "invalid_request_error" if isinstance(e, NanoserveError) else "server_error"
            yield f"data: {json.dumps(api.error_body(str(e), kind))}\n\n"
        finally:
            for out in last.values():
                metrics.observe(out)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
