"""Benchmarks of the batching strategies: `nanoserve bench throughput` and `nanoserve bench latency`.

throughput — offline: every request arrives at t = 0. The nano-vllm workload is 256 requests
    with input and output lengths U[100, 1024]; on a CPU with the 128-byte-context demo model we
    scale it down (defaults: 64 requests, U[8, 64] in and out: 1/4 of the requests, 1/16 of the
    lengths, so prompt + output always fits the context). Static, dynamic
    and continuous batching run on the same model, and HF `transformers` `generate` on the same
    weights in padded static batches (left padding; each batch generates its longest request's
    length; the best of a few batch sizes is kept).
latency — online: Poisson arrivals at several rates (requests/s); TTFT, TPOT, ITL and E2E
    percentiles per batcher and rate.

Every request ignores EOS so all strategies generate exactly the same number of tokens.
Results print as tables and are saved as JSON.
"""

from __future__ import annotations

import json
import platform
import random
import time
from datetime import date
from pathlib import Path

import torch

from .batching import ContinuousBatcher, DynamicBatcher, StaticBatcher
from .engine import LLMEngine
from .errors import NanoserveError
from .metrics import RequestMetrics, summarize
from .sampling import SamplingParams


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int = 0):
    """Random token prompts and per-request output lengths, reproducible from the seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(*out_range), ignore_eos=True) for _ in range(n)]
    return prompts, params


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _engine(model: str, batch_size: int) -> LLMEngine:
    """fp32 on CPU, no prefix caching (random prompts share nothing), a pool that holds twice the
    static batch at full context (so batching, not memory, is what the strategies differ in)."""
    from .loader import load_model

    ctx = load_model(model)[1].max_position_embeddings
    return LLMEngine(model, dtype="float32", device="cpu", max_num_seqs=batch_size * 2, max_num_batched_tokens=512,
                     enable_prefix_caching=False, num_blocks=2 * batch_size * -(-ctx // 16))


def _check_lengths(engine: LLMEngine, in_range, out_range) -> None:
    if in_range[1] + out_range[1] > engine.max_model_len:
        raise NanoserveError(f"input up to {in_range[1]} + output up to {out_range[1]} tokens exceeds the model's "
                             f"context of {engine.max_model_len}; choose shorter lengths")


def _batchers(engine: LLMEngine, batch_size: int, max_wait_ms: float):
    return {"static": StaticBatcher(engine, batch_size), "dynamic": DynamicBatcher(engine, batch_size, max_wait_ms),
            "continuous": ContinuousBatcher(engine)}


def _summary(outs, prompts, duration=None) -> dict:
    s = summarize([RequestMetrics.from_output(o) for o in outs], duration=duration).as_dict()
    s["output_tokens"] = sum(len(o.token_ids) for o in outs)
    s["prompt_tokens"] = sum(len(p) for p in prompts)
    return s


def hf_generate_throughput(model_path: Path, prompts, params, batch_sizes=(8, 16, 32)) -> dict:
    """HF generate in padded static batches on the same weights; the best batch size wins."""
    try:
        import transformers
    except ImportError as e:
        raise NanoserveError("the HF baseline needs `pip install transformers`") from e
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    best = None
    for bs in batch_sizes:
        start = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), bs):
            batch, ps = prompts[i:i + bs], params[i:i + bs]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            new = max(p.max_tokens for p in ps)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0)
            n_out += sum(p.max_tokens for p in ps)  # tokens past a request's own length are waste
        elapsed = time.perf_counter() - start
        run = {"batch_size": bs, "duration": elapsed, "output_throughput": n_out / elapsed,
               "total_throughput": (n_out + sum(len(p) for p in prompts)) / elapsed}
        if best is None or run["output_throughput"] > best["output_throughput"]:
            best = run
    return best


def throughput(model: str = "demo", n: int = 64, in_range=(8, 64), out_range=(8, 64), batch_size: int = 16,
               max_wait_ms: float = 20.0, hf: bool = True, seed: int = 0, out: str | None = None) -> dict:
    engine = _engine(model, batch_size)
    _check_lengths(engine, in_range, out_range)
    prompts, params = make_workload(n, in_range, out_range, engine.config.vocab_size, seed)
    res = {"benchmark": "throughput", "model": model, "requests": n, "input_len": list(in_range),
           "output_len": list(out_range), "batch_size": batch_size, "strategies": {}}
    for name, batcher in _batchers(engine, batch_size, max_wait_ms).items():
        start = time.perf_counter()
        outs = batcher.generate(prompts, params)
        res["strategies"][name] = _summary(outs, prompts, duration=time.perf_counter() - start)
    if hf:
        from .loader import resolve_model_path

        res["strategies"]["hf_generate"] = hf_generate_throughput(resolve_model_path(model), prompts, params)
    return _finish(res, out)


def latency(model: str = "demo", n: int = 48, rates=(2.0, 8.0, 32.0), in_range=(8, 64), out_range=(8, 64),
            batch_size: int = 16, max_wait_ms: float = 20.0, seed: int = 0, out: str | None = None) -> dict:
    engine = _engine(model, batch_size)
    _check_lengths(engine, in_range, out_range)
    prompts, params = make_workload(n, in_range, out_range, engine.config.vocab_size, seed)
    res = {"benchmark": "latency", "model": model, "requests": n, "rates": list(rates), "batch_size": batch_size,
           "max_wait_ms": max_wait_ms, "results": {}}
    for rate in rates:
        arrivals = poisson_arrivals(n, rate, seed)
        res["results"][str(rate)] = {name: _summary(b.generate(prompts, params, arrivals=arrivals), prompts)
                                     for name, b in _batchers(engine, batch_size, max_wait_ms).items()}
    return _finish(res, out)


def _finish(res: dict, out: str | None) -> dict:
    res.update(date=date.today().isoformat(), device=f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
               torch=torch.__version__)
    if out:
        Path(out).write_text(json.dumps(res, indent=2) + "\n")
    return res


def format_throughput(res: dict) -> str:
    rows = [f"{'strategy':<12}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}"]
    for name, s in res["strategies"].items():
        ttft = s.get("ttft") or {}
        p50 = f"{ttft['p50'] * 1e3:.0f}" if ttft.get("p50") is not None else "-"
        p99 = f"{ttft['p99'] * 1e3:.0f}" if ttft.get("p99") is not None else "-"
        rows.append(f"{name:<12}{s['output_throughput']:>10.1f}{s['total_throughput']:>12.1f}{p50:>12}{p99:>12}")
    hf = res["strategies"].get("hf_generate")
    if hf:
        rows.append(f"continuous / HF output throughput: "
                    f"{res['strategies']['continuous']['output_throughput'] / hf['output_throughput']:.2f}x")
    return "\n".join(rows)


def format_latency(res: dict) -> str:
    rows = [f"{'rate':>6} {'strategy':<12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'E2E p99':>10}  (ms)"]
    for rate, by in res["results"].items():
        for name, s in by.items():
            f = lambda d, k: "-" if d is None or d.get(k) is None else f"{d[k] * 1e3:.0f}"  # noqa: E731
            rows.append(f"{rate:>6} {name:<12}{f(s['ttft'], 'p50'):>10}{f(s['ttft'], 'p99'):>10}"
                        f"{f(s['tpot'], 'p50'):>10}{f(s['e2e'], 'p99'):>10}")
    return "\n".join(rows)
