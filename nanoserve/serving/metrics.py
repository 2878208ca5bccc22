"""Prometheus metrics of the OpenAI-compatible server (`GET /metrics`, text format 0.0.4), under
vLLM's names.

**Names.** Every quantity vLLM's server also measures is served under vLLM's exact name, type,
label names and meaning (those of vLLM V1's Prometheus logger), so a dashboard or autoscaler built
for vLLM, its example Grafana dashboard included, reads a nanoserve server unchanged, and no
quantity is exported twice. What vLLM has no metric for keeps a `nanoserve_` prefix. Every sample
carries `model_name`, the served model name (requests under a LoRA adapter count under it, as in
vLLM); the `vllm:` ones also carry vLLM's `engine` label, always "0" (vLLM numbers its
data-parallel engines; nanoserve runs one). Histograms use vLLM's bucket boundaries, so one query
can sum nanoserve's and vLLM's by `le`.

**Per request**, observed when it leaves the engine (finished, aborted or failed), from the
engine's timestamps: arrival a, first scheduled s (a preemption does not move it), a sample's first
and last token t_1 and t_n, finish f.

    vllm:time_to_first_token_seconds            t_1 − a
    vllm:inter_token_latency_seconds            every t_{i+1} − t_i
    vllm:e2e_request_latency_seconds            f − a
    vllm:request_queue_time_seconds             s − a
    vllm:request_prefill_time_seconds           t_1 − s
    vllm:request_decode_time_seconds            t_n − t_1
    vllm:request_inference_time_seconds         t_n − s
    vllm:request_time_per_output_token_seconds  (t_n − t_1) / (n − 1); 0 with one token
    vllm:request_prompt_tokens, vllm:request_generation_tokens   sizes (histograms)
    vllm:request_success_total{finished_reason}   stop, length, abort or error
    vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   prompt tokens looked up in
                                                 the prefix cache, and found there
    vllm:request_params_n, vllm:request_max_num_generation_tokens   once per prompt
    vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total
                                                 (only with speculative decoding on)

vLLM runs the n samples of a request as n requests, so each sample counts as one here too (its
prompt included); `request_params_n` and `request_max_num_generation_tokens` (the longest sample)
count the request once, as vLLM's do.

**Per engine step** (the async engine's `on_step`): vllm:iteration_tokens_total, a histogram of
the tokens each step's forward computed: prompt chunks, one token per decoding sample, drafts.

**State**, read from the engine at scrape time (a custom collector, so a value is never stale):
vllm:num_requests_running, vllm:num_requests_waiting (requests accepted but not yet in the engine
included), vllm:kv_cache_usage_perc (fraction of blocks held, 0..1), vllm:num_preemptions_total;
nanoserve's own: KV blocks in the pool and free, compiled grammars kept and the bytes they may hold.
**HTTP**: nanoserve_http_requests_total{endpoint, status} (middleware, http_middleware.py).

Where the numbers are not vLLM's to the letter:
- arrival is taken after tokenization, so TTFT and E2E leave out the tokenizer's time, which vLLM
  counts (its queue time starts after tokenization too: the two agree there);
- vLLM derives iteration tokens from a step's outputs (the whole prompt in the step its prefill
  ends, plus the tokens sampled); nanoserve counts what the forward computed, so prefix-cache hits
  are left out and a chunked prompt counts chunk by chunk. Summed over requests that finish
  unpreempted: prompt − prefix hits + generated − 1 per sample (the last token is never fed back);
- prefix-cache tokens are counted when the request leaves (vLLM: when it is scheduled), once per
  prompt (samples fork after the prefill and look nothing up);
- with speculative decoding, a step emits several tokens and each counts an inter-token gap
  (vLLM: one gap per step).
Not served: vllm:request_params_max_tokens (the output does not carry its parameters), the cache
config and LoRA info gauges, per-position draft acceptance, vLLM's deprecated names.

Each server owns a `CollectorRegistry`, so several servers (tests) live in one process. Taught in
notebooks/09_*.
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import CompletionOutput, RequestOutput
from .async_engine import AsyncLLMEngine

VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # vLLM's data-parallel engine number; nanoserve runs one engine
FINISH_REASONS = ("stop", "length", "abort", "error")  # shown at 0 before any request finishes

# vLLM's boundaries (seconds; tokens), so that histograms of both servers add up bucket by bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: the buckets of token-count histograms."""
    values = (m * 10**e for e in itertools.count() for m in (1, 2, 5))
    return list(itertools.takewhile(lambda v: v <= limit, values))


def mean_time_per_output_token(token_times: list[float]) -> float:
    """(t_n − t_1) / (n − 1), the decode time per token after the first; 0 with one token."""
    if len(token_times) < 2:
        return 0.0
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def sample_intervals(out: RequestOutput, sample: CompletionOutput) -> dict[str, float]:
    """One sample's per-request intervals (seconds), by the key of `ServerMetrics.intervals`. An
    interval whose end the sample never reached is left out (an abort before the first token has
    no TTFT)."""
    arrival, scheduled = out.arrival_time, out.first_scheduled_time
    found = {}
    if out.finish_time is not None:
        found["e2e"] = out.finish_time - arrival
    if scheduled is not None:
        found["queue"] = scheduled - arrival
    if sample.token_times and scheduled is not None:
        first, last = sample.token_times[0], sample.token_times[-1]
        found["ttft"] = first - arrival
        found["prefill"] = first - scheduled
        found["decode"] = last - first
        found["inference"] = last - scheduled
        found["per_output_token"] = mean_time_per_output_token(sample.token_times)
    return found


class ServerMetrics:
    """The metrics of one server: `observe` each request that leaves the engine, `observe_step`
    after each engine step (registered with the async engine), `count_response` for each HTTP
    answer; `render` answers a scrape."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.vllm_labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        counter, histogram = self._vllm_counter, self._vllm_histogram
        sizes = one_two_five(engine.engine.max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled (per sample)")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (not computed)")
        self.success = Counter("vllm:request_success",
                               "Requests (samples) that left the engine, by finish reason",
                               [*VLLM_LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.success.labels(**self.vllm_labels, finished_reason=reason)
        self.intervals = {
            "ttft": histogram("vllm:time_to_first_token_seconds",
                              "Arrival to the first token, seconds", TTFT_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "Arrival to finish, seconds",
                             REQUEST_BUCKETS),
            "queue": histogram("vllm:request_queue_time_seconds",
                               "Arrival to first scheduled (waiting), seconds", REQUEST_BUCKETS),
            "prefill": histogram("vllm:request_prefill_time_seconds",
                                 "First scheduled to the first token, seconds", REQUEST_BUCKETS),
            "decode": histogram("vllm:request_decode_time_seconds",
                                "First token to last token, seconds", REQUEST_BUCKETS),
            "inference": histogram("vllm:request_inference_time_seconds",
                                   "First scheduled to last token (running), seconds",
                                   REQUEST_BUCKETS),
            "per_output_token": histogram("vllm:request_time_per_output_token_seconds",
                                          "A request's decode time per token after the first",
                                          ITL_BUCKETS),
        }
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive tokens of a sample, seconds", ITL_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt length of a request (per sample)", sizes)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens a sample generated", sizes)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Tokens the longest sample of a request generated",
                                               sizes)
        self.params_n = histogram("vllm:request_params_n", "Samples per request (n)", N_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens one engine step computed", STEP_TOKEN_BUCKETS)
        self.spec_counters: list[tuple[Counter, str]] = []  # (metric, SpecStats field)
        if engine.engine.spec is not None:
            self.spec_counters = [
                (counter("vllm:spec_decode_num_drafts", "Drafts verified"), "num_steps"),
                (counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed"),
                 "num_draft_tokens"),
                (counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
                 "num_accepted_tokens"),
            ]
        self.http_requests = Counter("nanoserve_http_requests",
                                     "HTTP responses by endpoint and status code",
                                     ["model_name", "endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))
        engine.on_step.append(self.observe_step)

    def _vllm_counter(self, name: str, doc: str):
        return Counter(name, doc, VLLM_LABELS, registry=self.registry).labels(**self.vllm_labels)

    def _vllm_histogram(self, name: str, doc: str, buckets):
        metric = Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=self.registry)
        return metric.labels(**self.vllm_labels)

    # ------------------------------------------------------------------ observations
    def observe(self, out: RequestOutput) -> None:
        """Record a request that left the engine (finished, aborted or failed)."""
        prompt_len = len(out.prompt_token_ids)
        scheduled = out.first_scheduled_time is not None  # so its prompt was looked up, prefilled
        for sample in out.outputs:
            self._observe_sample(out, sample, scheduled)
        longest = max((len(sample.token_ids) for sample in out.outputs), default=0)
        self.max_generation_tokens.observe(longest)
        self.params_n.observe(len(out.outputs))
        if scheduled:  # one lookup per prompt, when it was first scheduled
            self.prefix_queries.inc(prompt_len)
            self.prefix_hits.inc(out.num_cached_tokens)

    def _observe_sample(self, out: RequestOutput, sample: CompletionOutput,
                        scheduled: bool) -> None:
        """One sample, counted as a request (as vLLM runs each of n samples)."""
        reason = sample.finish_reason or "abort"
        self.success.labels(**self.vllm_labels, finished_reason=reason).inc()
        prompt_len = len(out.prompt_token_ids)
        if scheduled:
            self.prompt_tokens.inc(prompt_len)
        self.request_prompt_tokens.observe(prompt_len)
        self.generation_tokens.inc(len(sample.token_ids))
        self.request_generation_tokens.observe(len(sample.token_ids))
        for name, seconds in sample_intervals(out, sample).items():
            self.intervals[name].observe(seconds)
        for earlier, later in zip(sample.token_times, sample.token_times[1:]):
            self.itl.observe(later - earlier)
        if sample.spec_stats is not None:
            for metric, field in self.spec_counters:
                metric.inc(getattr(sample.spec_stats, field))

    def observe_step(self, engine: LLMEngine) -> None:
        """After each engine step: how many tokens its forward computed (none: nothing ran)."""
        if engine.last_num_tokens:
            self.iteration_tokens.observe(engine.last_num_tokens)

    def count_response(self, endpoint: str, status: int | str) -> None:
        """One HTTP response (or a crash, as 500) on `endpoint`."""
        self.http_requests.labels(model_name=self.model_name, endpoint=endpoint,
                                  status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _family(kind, name: str, doc: str, labels: dict[str, str], value: float):
    """A one-sample metric family for the collector."""
    family = kind(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class _EngineCollector:
    """The engine's state, read whenever /metrics is scraped."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.vllm_labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        self.own_labels = {"model_name": model_name}

    def collect(self):
        core = self.engine.engine
        s = core.stats()
        waiting = s.num_waiting + self.engine.num_pending  # accepted, entering at the next step
        vllm_gauges = [
            ("vllm:num_requests_running", "Requests in the running batch", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled", waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks held (1 = all)",
             1 - s.num_free_blocks / s.num_blocks),
        ]
        for name, doc, value in vllm_gauges:
            yield _family(GaugeMetricFamily, name, doc, self.vllm_labels, value)
        yield _family(CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted so far",
                      self.vllm_labels, s.num_preemptions)
        grammars = core.inputs.grammars
        own_gauges = [
            ("nanoserve_kv_cache_blocks_total", "KV cache blocks in the pool", s.num_blocks),
            ("nanoserve_kv_cache_blocks_free", "KV cache blocks no sequence holds",
             s.num_free_blocks),
            ("nanoserve_grammar_cache_entries", "Compiled structured-output grammars kept",
             grammars.num_cached),
            ("nanoserve_grammar_cache_bytes_bound", "The most the kept grammars can hold (bytes)",
             grammars.cached_bytes_bound),
        ]
        for name, doc, value in own_gauges:
            yield _family(GaugeMetricFamily, name, doc, self.own_labels, value)
