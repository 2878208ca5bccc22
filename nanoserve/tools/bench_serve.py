"""`nanoserve bench serve`: load a live OpenAI-compatible server with Poisson arrivals and measure
what its clients see.

For each rate (requests/s), `num_requests` streamed completions are sent at Poisson arrival
times (exponential gaps, seeded) by the official `openai` client, each a random token prompt with
its own output length, greedy, ignoring EOS, so every rate does the same work. Per request the
client records when it sent the request and when each streamed chunk arrived; the server's
`continuous_usage_stats` (usage on every chunk) says how many tokens each chunk carried, so a
chunk of k tokens counts as k tokens at its arrival time. From those timestamps come TTFT, TPOT,
ITL and E2E with the definitions of nanoserve/tools/metrics.py (vLLM's benchmark_serving), their
percentiles, throughput, and goodput: requests per second meeting both SLOs (`--slo-ttft-ms`,
`--slo-tpot-ms`). A request that fails (HTTP error, timeout) counts as not good.

Works against any server that speaks the OpenAI API and vLLM's `ignore_eos` and
`continuous_usage_stats` extensions (nanoserve, vLLM). Results print as a table and save as JSON.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from datetime import date
from pathlib import Path

from ..errors import NanoserveError
from .bench import make_workload, poisson_arrivals
from .metrics import RequestMetrics, summarize

SAFE_VOCAB = 256  # prompt token ids below this exist in every vocabulary we serve


async def _one(client, model: str, prompt: list[int], max_tokens: int, delay: float,
               timeout: float):
    """Send one streamed request after `delay` seconds; its RequestMetrics, or the error's text."""
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    times: list[float] = []
    usage = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            timeout=timeout,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                times += [now] * (chunk.usage.completion_tokens - len(times))
                usage = chunk.usage
    except Exception as e:  # the benchmark reports failures; it does not stop on them
        return f"{type(e).__name__}: {e}"
    if usage is None or not times:
        return "the stream carried no usage (does the server support continuous_usage_stats?)"
    return RequestMetrics(arrival_time=sent, token_times=times, prompt_tokens=usage.prompt_tokens,
                          finish_time=time.perf_counter())


async def _run_rate(client, model, prompts, params, rate, seed, timeout) -> tuple[list, list[str]]:
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    results = await asyncio.gather(*[_one(client, model, p, sp.max_tokens, t, timeout)
                                     for p, sp, t in zip(prompts, params, arrivals)])
    return [r for r in results if isinstance(r, RequestMetrics)], [
        r for r in results if isinstance(r, str)
    ]


def bench_serve(url: str = "http://127.0.0.1:8000/v1", rates=(1.0, 4.0, 16.0), n: int = 32,
                in_range=(8, 64), out_range=(8, 64), slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None, api_key: str | None = None,
                model: str | None = None,
                seed: int = 0, timeout: float = 300.0, out: str | None = None) -> dict:
    """Run every rate against the server at `url` (its /v1 root); returns (and saves) the results.
    Inside a running event loop (a notebook), `await bench_serve_async(...)` instead."""
    return asyncio.run(bench_serve_async(url, rates, n, in_range, out_range, slo_ttft_ms,
                                         slo_tpot_ms, api_key,
                                         model, seed, timeout, out))


async def bench_serve_async(url: str = "http://127.0.0.1:8000/v1", rates=(1.0, 4.0, 16.0),
                            n: int = 32,
                            in_range=(8, 64), out_range=(8, 64), slo_ttft_ms: float | None = None,
                            slo_tpot_ms: float | None = None, api_key: str | None = None,
                            model: str | None = None,
                            seed: int = 0, timeout: float = 300.0, out: str | None = None) -> dict:
    try:
        from openai import AsyncOpenAI
    except ImportError as e:
        raise NanoserveError("bench serve needs the openai client: pip install "
                             "'nanoserve[serve]'") from e
    if not rates or any(r <= 0 for r in rates):
        raise NanoserveError(f"rates must be positive requests/s, got {list(rates)}")
    prompts, params = make_workload(n, in_range, out_range, SAFE_VOCAB, seed)
    client = AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0)
    try:
        try:
            name = model or (await client.models.list()).data[0].id
        except Exception as e:
            raise NanoserveError(f"no OpenAI-compatible server answers at {url}: "
                                 f"{type(e).__name__}: {e}") from e
        res = {"benchmark": "serve", "url": url, "model": name, "requests": n,
               "input_len": list(in_range),
               "output_len": list(out_range), "slo_ttft_ms": slo_ttft_ms,
               "slo_tpot_ms": slo_tpot_ms, "results": {}}
        for rate in rates:
            start = time.perf_counter()
            ok, failed = await _run_rate(client, name, prompts, params, rate, seed, timeout)
            duration = time.perf_counter() - start
            row = {"failed": len(failed), "errors": sorted(set(failed))[:5]}
            if ok:
                s = summarize(ok, duration=duration,
                              slo_ttft=None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                              slo_tpot=None if slo_tpot_ms is None else slo_tpot_ms / 1e3)
                row.update(s.as_dict())
            res["results"][str(rate)] = row
    finally:
        await client.close()
    res.update(date=date.today().isoformat(),
               client=f"{platform.machine()}, Python {platform.python_version()}")
    if out:
        Path(out).write_text(json.dumps(res, indent=2) + "\n")
    return res


def format_bench_serve(res: dict) -> str:
    ms = lambda d, k: "-" if not d or d.get(k) is None else f"{d[k] * 1e3:.0f}"  # noqa: E731
    head = (
        f"{'rate':>6}{'ok':>5}{'fail':>5}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'out tok/s':>11}{'goodput':>9}  (ms, req/s)"
    )
    rows = [f"{res['model']} at {res['url']}: {res['requests']} requests per rate", head]
    for rate, r in res["results"].items():
        good = "-" if r.get("goodput") is None else f"{r['goodput']:.2f}"
        tput = "-" if "output_throughput" not in r else f"{r['output_throughput']:.1f}"
        rows.append(
            f"{rate:>6}{r.get('num_requests', 0):>5}{r['failed']:>5}{ms(r.get('ttft'), 'p50'):>10}"
            f"{ms(r.get('ttft'), 'p99'):>10}{ms(r.get('tpot'), 'p50'):>10}"
            f"{ms(r.get('tpot'), 'p99'):>10}"
            f"{ms(r.get('itl'), 'p50'):>9}{ms(r.get('itl'), 'p99'):>9}{tput:>11}{good:>9}"
        )
    return "\n".join(rows)
