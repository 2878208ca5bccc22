"""Prometheus metrics of the OpenAI-compatible server (`GET /metrics`, text format 0.0.4).

Two kinds, as vLLM has them:
- **events**, counted as they happen: HTTP requests by endpoint and status code; finished
  requests by finish reason; prompt and generated tokens; latency histograms observed when a
  request finishes, from the engine's own timestamps (TTFT = first token − arrival, every
  inter-token gap, E2E = finish − arrival: the definitions of nanoserve/tools/metrics.py);
  speculative decoding's drafted and accepted tokens.
- **state**, read from the engine at scrape time (a custom collector, so a value is never stale):
  running and waiting requests, KV blocks total / free and the usage fraction, prefix-cache
  queries and hits (block lookups; hit rate = hits / queries), preemptions, and the speculative
  acceptance rate.

Each server owns a `CollectorRegistry`, so several servers (tests) live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput

# seconds; TTFT and E2E span a CPU's tens of ms to a long generation's minutes
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, pending=lambda: 0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("nanoserve_http_requests",
                                     "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("nanoserve_request_finished",
                                "Finished requests by finish reason (per choice)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("nanoserve_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "nanoserve_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.spec_draft = Counter(
            "nanoserve_spec_decode_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.spec_accepted = Counter("nanoserve_spec_decode_accepted_tokens",
                                     "Draft tokens accepted", registry=r)
        self.spec_totals = [0, 0]  # drafted, accepted: for the acceptance-rate gauge
        self.registry.register(_EngineCollector(engine, pending, self))

    def observe(self, out: RequestOutput) -> None:
        """Record a request that left the engine (finished or aborted)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for c in out.outputs:
            self.finished.labels(c.finish_reason or "abort").inc()
            self.generation_tokens.inc(len(c.token_ids))
            for a, b in zip(c.token_times, c.token_times[1:]):
                self.itl.observe(b - a)
            if c.spec_stats is not None:
                self.spec_draft.inc(c.spec_stats.num_draft_tokens)
                self.spec_accepted.inc(c.spec_stats.num_accepted_tokens)
                self.spec_totals[0] += c.spec_stats.num_draft_tokens
                self.spec_totals[1] += c.spec_stats.num_accepted_tokens
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        if out.finish_time is not None:
            self.e2e.observe(out.finish_time - out.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine whenever /metrics is scraped."""

    def __init__(self, engine: LLMEngine, pending, metrics: ServerMetrics):
        self.engine, self.pending, self.metrics = engine, pending, metrics

    def collect(self):
        s = self.engine.stats()
        gauges = [("nanoserve_num_requests_running", "Requests in the running batch",
                   s.num_running),
                  ("nanoserve_num_requests_waiting", "Requests waiting to be scheduled",
                   s.num_waiting + self.pending()),
                  ("nanoserve_kv_cache_blocks_total", "KV cache blocks in the pool", s.num_blocks),
                  ("nanoserve_kv_cache_blocks_free", "KV cache blocks no sequence holds",
                   s.num_free_blocks),
                  ("nanoserve_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                   1 - s.num_free_blocks / s.num_blocks),
                  ("nanoserve_prefix_cache_hit_rate", "Prefix-cache block hits / lookups",
                   s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
                  ("nanoserve_grammar_cache_entries", "Compiled structured-output grammars kept",
                   self.engine.inputs.grammars.num_cached),
                  ("nanoserve_grammar_cache_bytes_bound",
                   "The most the kept grammars can hold (bytes)",
                   self.engine.inputs.grammars.cached_bytes_bound)]
        if self.engine.spec is not None:
            drafted, accepted = self.metrics.spec_totals
            gauges.append(("nanoserve_spec_decode_acceptance_rate",
                           "Accepted / drafted tokens of finished requests",
                           accepted / drafted if drafted else 0.0))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in [("nanoserve_prefix_cache_queries",
                                  "Prompt blocks looked up in the prefix cache",
                                  s.prefix_cache_queries),
                                 ("nanoserve_prefix_cache_hits",
                                  "Prompt blocks found in the prefix cache",
                                  s.prefix_cache_hits),
                                 ("nanoserve_num_preemptions", "Sequences preempted so far",
                                  s.num_preemptions)]:
            yield CounterMetricFamily(name, doc, value=value)
