"""Benchmarks of the batching strategies: `nanoserve bench throughput` and `nanoserve bench
latency`.

throughput — offline: every request arrives at t = 0. The nano-vllm workload is 256 requests
    with input and output lengths U[100, 1024]; on a CPU with the 128-byte-context demo model we
    scale it down (defaults: 64 requests, U[8, 64] in and out: 1/4 of the requests, 1/16 of the
    lengths, so prompt + output always fits the context). Static, dynamic
    and continuous batching run on the same model, and HF `transformers` `generate` on the same
    weights in padded static batches (left padding; each batch generates its longest request's
    length; the best of a few batch sizes is kept).
latency — online: Poisson arrivals at several rates (requests/s); TTFT, TPOT, ITL and E2E
    percentiles per batcher and rate.
speculative — one request at a time (batch 1, where decoding is slowest per token), the target
    alone vs speculative decoding with a draft model for γ = 1..8 (adaptive γ off, so each γ is
    what it says) at temperature 0 and 1, plus n-gram prompt lookup on a prompt that repeats a
    passage: α, tokens per step (measured, and predicted from α as (1 − α^(γ+1)) / (1 − α)), and
    wall-clock speedup over the target alone, all in one run.

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

from ..engine.llm_engine import LLMEngine
from ..engine.sampler import SamplingParams
from ..errors import NanoserveError
from .batching import ContinuousBatcher, DynamicBatcher, StaticBatcher
from .metrics import RequestMetrics, summarize


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  seed: int = 0):
    """Random token prompts and per-request output lengths, reproducible from the seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(*out_range),
                             ignore_eos=True) for _ in range(n)]
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
    from ..models.loader import load_model

    ctx = load_model(model)[1].max_position_embeddings
    return LLMEngine.from_kwargs(model, dtype="float32", device="cpu", max_num_seqs=batch_size * 2,
                                 max_num_batched_tokens=512, enable_prefix_caching=False,
                                 num_blocks=2 * batch_size * -(-ctx // 16))


def _check_lengths(engine: LLMEngine, in_range, out_range) -> None:
    if in_range[1] + out_range[1] > engine.max_model_len:
        raise NanoserveError(f"input up to {in_range[1]} + output up to {out_range[1]} tokens "
                             f"exceeds the model's context of {engine.max_model_len}; choose "
                             "shorter lengths")


def _batchers(engine: LLMEngine, batch_size: int, max_wait_ms: float):
    return {"static": StaticBatcher(engine, batch_size),
            "dynamic": DynamicBatcher(engine, batch_size, max_wait_ms),
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
        n_out = slots = 0
        for i in range(0, len(prompts), bs):
            batch, ps = prompts[i:i + bs], params[i:i + bs]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            new = max(p.max_tokens for p in ps)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False,
                            pad_token_id=0)
            n_out += sum(p.max_tokens for p in ps)  # tokens past a request's own length are waste
            slots += len(batch) * (width + new)  # token positions the padded batch computes
        elapsed = time.perf_counter() - start
        useful = n_out + sum(len(p) for p in prompts)
        run = {"batch_size": bs, "duration": elapsed, "output_throughput": n_out / elapsed,
               "total_throughput": useful / elapsed,
               # > 1: padding and finished rows. Where a token costs the same in any batch (a
               # compute-bound CPU), removing them is all batching can win: continuous / HF ≲ this
               # ratio.
               "computed_per_useful_token": slots / useful}
        if best is None or run["output_throughput"] > best["output_throughput"]:
            best = run
    return best


def throughput(model: str = "demo", n: int = 64, in_range=(8, 64), out_range=(8, 64),
               batch_size: int = 16,
               max_wait_ms: float = 20.0, hf: bool = True, seed: int = 0,
               out: str | None = None) -> dict:
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
        from ..models.loader import resolve_model_path

        res["strategies"]["hf_generate"] = hf_generate_throughput(
            resolve_model_path(model), prompts, params
        )
    return _finish(res, out)


def latency(model: str = "demo", n: int = 48, rates=(2.0, 8.0, 32.0), in_range=(8, 64),
            out_range=(8, 64),
            batch_size: int = 16, max_wait_ms: float = 20.0, seed: int = 0,
            out: str | None = None) -> dict:
    engine = _engine(model, batch_size)
    _check_lengths(engine, in_range, out_range)
    prompts, params = make_workload(n, in_range, out_range, engine.config.vocab_size, seed)
    res = {"benchmark": "latency", "model": model, "requests": n, "rates": list(rates),
           "batch_size": batch_size,
           "max_wait_ms": max_wait_ms, "results": {}}
    for rate in rates:
        arrivals = poisson_arrivals(n, rate, seed)
        res["results"][str(rate)] = {
            name: _summary(b.generate(prompts, params, arrivals=arrivals), prompts)
            for name, b in _batchers(engine, batch_size, max_wait_ms).items()
        }
    return _finish(res, out)


SPEC_PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo, Romeo",
                "First Citizen:\nBefore we proceed any further",
                "KING HENRY:\n", "MENENIUS:\nWhat work's, my countrymen", "DUKE VINCENTIO:\n")


def text_table(rows: list[dict], cols: list[str]) -> str:
    """`rows` as a right-aligned text table of `cols` (floats with 3 decimals, None as —), for the
    benchmarks."""
    fmt = lambda v: "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    return "\n".join(["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
                     + ["  ".join(fmt(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows])


def _timed_generate(llm, prompts, params, repeats: int = 2) -> tuple[float, list]:
    """Best of `repeats` wall times (this machine is shared and noisy) for the prompts one at a
    time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]  # batch 1
        best = min(best, time.perf_counter() - start)
    return best, outs


def _spec_row(outs, seconds: float, base_seconds: float, gamma: int) -> dict:
    """Totals over the requests; `draft_cost` is c in "a speculative step costs (1 + γc) target
    steps", solved from the wall times (what a draft forward really costs here, overheads
    included)."""
    from ..spec.rejection_sampler import expected_tokens_per_step

    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    tot = {k: sum(getattr(s, k) for s in stats) for k in
           ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
            "num_rejections")}
    checked = tot["num_accepted_tokens"] + tot["num_rejections"]
    alpha = tot["num_accepted_tokens"] / checked if checked else None
    n_out = sum(len(o.token_ids) for o in outs)
    # tokens from plain decode steps (e.g. the first one)
    plain_steps = n_out - tot["num_emitted_tokens"]
    step = base_seconds / n_out  # one target decode step (the baseline generates the same count)
    draft_cost = (
        ((seconds / step - plain_steps) / tot["num_steps"] - 1) / gamma if tot["num_steps"]
        else None
    )
    return {
        "gamma": gamma, **tot, "alpha": alpha,
        "tokens_per_step": tot["num_emitted_tokens"] / tot["num_steps"] if tot["num_steps"]
        else None, "predicted_tokens_per_step": expected_tokens_per_step(alpha, gamma)
        if alpha is not None else None, "seconds": seconds, "speedup": base_seconds / seconds,
        "output_tokens": sum(len(o.token_ids) for o in outs), "draft_cost": draft_cost,
    }


def speculative(model: str = "demo", draft: str = "demo-draft", n: int = 4, max_tokens: int = 64,
                gammas=tuple(range(1, 9)), temperatures=(0.0, 1.0), seed: int = 0,
                out: str | None = None) -> dict:
    """Target alone vs speculative decoding (draft model, γ = 1..8; n-gram lookup), batch 1."""
    from ..engine.llm import LLM

    if not 1 <= n <= len(SPEC_PROMPTS):
        raise NanoserveError(f"n={n} prompts: allowed 1..{len(SPEC_PROMPTS)}")
    prompts = list(SPEC_PROMPTS[:n])
    target = LLM(model)
    res = {"benchmark": "speculative", "model": model, "draft": draft, "prompts": prompts,
           "max_tokens": max_tokens,
           "batch_size": 1, "results": {}}
    for temp in temperatures:
        params = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        _timed_generate(target, prompts[:1], params)  # warm-up
        base, _ = _timed_generate(target, prompts, params)
        rows = []
        for gamma in gammas:
            llm = LLM(model, speculative_model=draft, num_speculative_tokens=gamma,
                      speculative_adaptive=False)
            _timed_generate(llm, prompts[:1], params)
            seconds, outs = _timed_generate(llm, prompts, params)
            rows.append(_spec_row(outs, seconds, base, gamma))
        res["results"][str(temp)] = {"target_seconds": base, "draft_model": rows}
    # n-gram prompt lookup: the prompt holds a passage, then asks for it again (an "edit this text"
    # task)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    passage = target.generate([SPEC_PROMPTS[0]],
                              SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    # fits a 128 context
    greedy = SamplingParams(temperature=0, max_tokens=min(max_tokens, 48), ignore_eos=True)
    repeat = [SPEC_PROMPTS[0] + passage + "\n\n" + SPEC_PROMPTS[0]]
    base, _ = _timed_generate(target, repeat, greedy)
    ngram = []
    for gamma in (2, 4, 8):
        llm = LLM(model, speculative="ngram", num_speculative_tokens=gamma,
                  speculative_adaptive=False)
        seconds, outs = _timed_generate(llm, repeat, greedy)
        ngram.append(_spec_row(outs, seconds, base, gamma))
    res["ngram"] = {"prompt_tokens": len(target.encode_prompt(repeat[0])), "target_seconds": base,
                    "rows": ngram}
    return _finish(res, out)


def format_speculative(res: dict) -> str:
    def row(r):
        f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        return (
            f"{r['gamma']:>3}{f(r['alpha']):>7}{f(r['tokens_per_step']):>10}"
            f"{f(r['predicted_tokens_per_step']):>11}{f(r['speedup']):>9}{f(r['draft_cost']):>14}"
        )
    head = f"{'γ':>3}{'α':>7}{'tok/step':>10}{'predicted':>11}{'speedup':>9}{'draft cost c':>14}"
    lines = [f"speculative decoding, batch 1, {res['model']} with draft {res['draft']}"]
    for temp, by in res["results"].items():
        lines += [f"temperature {temp} (target alone: {by['target_seconds']:.2f} s)", head]
        lines += [row(r) for r in by["draft_model"]]
    ng = res["ngram"]
    lines += [f"n-gram prompt lookup, greedy, a {ng['prompt_tokens']}-token prompt that repeats a "
              f"passage (target alone: {ng['target_seconds']:.2f} "
              "s)", head] + [row(r) for r in ng["rows"]]
    return "\n".join(lines)


def _finish(res: dict, out: str | None) -> dict:
    res.update(date=date.today().isoformat(),
               device=f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
               torch=torch.__version__)
    if out:
        Path(out).write_text(json.dumps(res, indent=2) + "\n")
    return res


def format_throughput(res: dict) -> str:
    rows = [f"{'strategy':<12}{'out tok/s':>10}{'total tok/s':>12}"
            f"{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}"]
    for name, s in res["strategies"].items():
        ttft = s.get("ttft") or {}
        p50 = f"{ttft['p50'] * 1e3:.0f}" if ttft.get("p50") is not None else "-"
        p99 = f"{ttft['p99'] * 1e3:.0f}" if ttft.get("p99") is not None else "-"
        rows.append(
            f"{name:<12}{s['output_throughput']:>10.1f}{s['total_throughput']:>12.1f}{p50:>12}{p99:>12}"
        )
    hf = res["strategies"].get("hf_generate")
    if hf:
        rows.append(
            f"continuous / HF output throughput: "
            f"{res['strategies']['continuous']['output_throughput'] / hf['output_throughput']:.2f}x"
        )
        if "computed_per_useful_token" in hf:
            rows.append(f"HF (batch {hf['batch_size']}) computes "
                        f"{hf['computed_per_useful_token']:.2f} token positions per useful token "
                        "(padding, finished rows)")
    return "\n".join(rows)


def format_latency(res: dict) -> str:
    rows = [f"{'rate':>6} "
            f"{'strategy':<12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'E2E p99':>10}  "
            "(ms)"]
    for rate, by in res["results"].items():
        for name, s in by.items():
            f = lambda d, k: "-" if d is None or d.get(k) is None else f"{d[k] * 1e3:.0f}"  # noqa: E731
            rows.append(f"{rate:>6} {name:<12}{f(s['ttft'], 'p50'):>10}{f(s['ttft'], 'p99'):>10}"
                        f"{f(s['tpot'], 'p50'):>10}{f(s['e2e'], 'p99'):>10}")
    return "\n".join(rows)
