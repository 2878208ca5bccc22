"""/metrics under vLLM's names (nanoserve/serving/metrics.py): a real server on the demo model takes
a small load, its scrape is parsed with prometheus_client's own parser, and then

- every vLLM family a dashboard keys on is there with vLLM's type and label names, and its values
  agree with what the responses say (tokens from `usage`, finish reasons, one histogram
  observation per request, tokens per engine step);
- the queries of vLLM's example Grafana dashboard find every series they name, with the labels they
  select and group by;
- the controls: the same count checks fail on a server that has served nothing, and the dashboard
  check fails on names vLLM does not serve.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from live_server import LiveServer, _http, _pool_whole, _wait_for  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

MODEL = "demo"
BLOCK = 16  # the demo engine's block size: a 40-token prompt is 2 full blocks and a partial one

# vLLM's families, their Prometheus type and the labels besides model_name and engine (and a
# histogram bucket's `le`)
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:num_preemptions": ("counter", set()),
    "vllm:prompt_tokens": ("counter", set()),
    "vllm:generation_tokens": ("counter", set()),
    "vllm:request_success": ("counter", {"finished_reason"}),
    "vllm:prefix_cache_queries": ("counter", set()),
    "vllm:prefix_cache_hits": ("counter", set()),
    "vllm:iteration_tokens_total": ("histogram", set()),
    "vllm:time_to_first_token_seconds": ("histogram", set()),
    "vllm:inter_token_latency_seconds": ("histogram", set()),
    "vllm:e2e_request_latency_seconds": ("histogram", set()),
    "vllm:request_queue_time_seconds": ("histogram", set()),
    "vllm:request_prefill_time_seconds": ("histogram", set()),
    "vllm:request_decode_time_seconds": ("histogram", set()),
    "vllm:request_inference_time_seconds": ("histogram", set()),
    "vllm:request_time_per_output_token_seconds": ("histogram", set()),
    "vllm:request_prompt_tokens": ("histogram", set()),
    "vllm:request_generation_tokens": ("histogram", set()),
    "vllm:request_max_num_generation_tokens": ("histogram", set()),
    "vllm:request_params_n": ("histogram", set()),
}
# one observation per finished request (every request here has n = 1)
PER_REQUEST_HISTOGRAMS = [name for name, (kind, _) in VLLM_FAMILIES.items()
                          if kind == "histogram" and name != "vllm:iteration_tokens_total"
                          and name != "vllm:inter_token_latency_seconds"]

# The queries of vLLM's example Grafana dashboard (titled "vLLM"), panel by panel, written out here
# in PromQL. `$model_name` is the dashboard's variable, filled from label_values(model_name);
# `$__rate_interval` is Grafana's, left as it is.
SEL = '{model_name="$model_name"}'
WINDOW = "[$__rate_interval]"


def _quantiles_and_mean(histogram: str) -> list[str]:
    """A latency panel: p99, p95, p90 and p50 from the buckets, and the mean from sum / count."""
    buckets = f"rate({histogram}_bucket{SEL}{WINDOW})"
    quantiles = [f"histogram_quantile({q}, sum by(le) ({buckets}))" for q in (0.99, 0.95, 0.9, 0.5)]
    mean = f"rate({histogram}_sum{SEL}{WINDOW}) / rate({histogram}_count{SEL}{WINDOW})"
    return [*quantiles, mean]


DASHBOARD_QUERIES = [
    *_quantiles_and_mean("vllm:e2e_request_latency_seconds"),  # E2E request latency
    f"rate(vllm:prompt_tokens_total{SEL}{WINDOW})",  # token throughput
    f"rate(vllm:generation_tokens_total{SEL}{WINDOW})",
    *_quantiles_and_mean("vllm:inter_token_latency_seconds"),  # inter-token latency
    f"vllm:num_requests_running{SEL}",  # scheduler state
    f"vllm:num_requests_waiting{SEL}",
    *_quantiles_and_mean("vllm:time_to_first_token_seconds"),  # time to first token
    f"vllm:kv_cache_usage_perc{SEL}",  # cache utilization
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SEL}{WINDOW}))",  # heatmaps
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SEL}{WINDOW}))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}{WINDOW}))",  # finish reason
    f"rate(vllm:request_queue_time_seconds_sum{SEL}{WINDOW})",  # queue time
    f"rate(vllm:request_prefill_time_seconds_sum{SEL}{WINDOW})",  # prefill and decode time
    f"rate(vllm:request_decode_time_seconds_sum{SEL}{WINDOW})",
    f"rate(vllm:request_max_num_generation_tokens_sum{SEL}{WINDOW})",  # max generation tokens
]
DASHBOARD_VARIABLE_LABEL = "model_name"  # label_values(model_name)


# ----------------------------------------------------------------------------- servers and load
def _new_server() -> LiveServer:
    core = LLMEngine.from_kwargs(MODEL, num_blocks=64)
    return LiveServer(create_app(AsyncLLMEngine(core), MODEL))


@pytest.fixture(scope="module")
def served():
    """A server after a small load, with what the client got back: (server, load)."""
    srv = _new_server()
    try:
        yield srv, _send_load(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def idle():
    """A server that has served nothing."""
    srv = _new_server()
    yield srv
    srv.stop()


def _send_load(srv: LiveServer) -> dict:
    """Five completions, one at a time: two stopped by length, one streamed, one by a stop
    string, and the same 40-token prompt twice (the second finds 2 blocks in the prefix cache).
    Returns each request's usage and finish reason."""
    client = srv.client(api_key="none")
    plain = dict(model=MODEL, temperature=0)
    long_prompt = list(range(65, 105))
    answers = [
        client.completions.create(prompt="ROMEO:", max_tokens=5, **plain,
                                  extra_body={"ignore_eos": True}),
        client.completions.create(prompt="ROMEO:\n", max_tokens=40, stop=[" matter"], **plain),
        client.completions.create(prompt=long_prompt, max_tokens=3, **plain,
                                  extra_body={"ignore_eos": True}),
        client.completions.create(prompt=long_prompt, max_tokens=4, **plain,
                                  extra_body={"ignore_eos": True}),
    ]
    load = {"usage": [a.usage for a in answers],
            "finish_reasons": [a.choices[0].finish_reason for a in answers]}
    stream = client.completions.create(prompt="JULIET:", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}, **plain,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    load["usage"].append(chunks[-1].usage)
    load["finish_reasons"].append(next(c.choices[0].finish_reason for c in chunks
                                       if c.choices and c.choices[0].finish_reason))
    load["prefix_hit_tokens"] = 2 * BLOCK
    _wait_for(lambda: _pool_whole(srv.engine), "the engine to be idle")
    load["num_steps"] = srv.engine.num_steps
    return load


def _scrape(srv: LiveServer) -> dict:
    """The families of one /metrics answer, by name (prometheus_client's own parser)."""
    status, headers, body = _http(srv.port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _value(families: dict, sample_name: str, **labels) -> float:
    """The one sample called `sample_name` (with these labels, among others) in the scrape."""
    found = [s.value for family in families.values() for s in family.samples
             if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{sample_name}{labels}: {len(found)} samples"
    return found[0]


# ----------------------------------------------------------------------------- the checks
def check_families(families: dict) -> None:
    """vLLM's families are served with vLLM's types and label names, under the served name."""
    for name, (kind, extra_labels) in VLLM_FAMILIES.items():
        family = families.get(name)
        assert family is not None, f"{name} is not served"
        assert family.type == kind, f"{name} is a {family.type}, vLLM's is a {kind}"
        for sample in family.samples:
            want = {"model_name", "engine"} | extra_labels
            if sample.name.endswith("_bucket"):
                want.add("le")
            assert set(sample.labels) == want, sample
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"


def check_counts(families: dict, load: dict) -> None:
    """The values agree with what the clients got back and with how many steps the engine ran."""
    usage = load["usage"]
    requests = len(usage)
    prompt = sum(u.prompt_tokens for u in usage)
    generated = sum(u.completion_tokens for u in usage)
    assert _value(families, "vllm:prompt_tokens_total") == prompt
    assert _value(families, "vllm:generation_tokens_total") == generated
    for reason in ("length", "stop"):
        want = load["finish_reasons"].count(reason)
        assert want > 0 and _value(families, "vllm:request_success_total",
                                   finished_reason=reason) == want
    for name in PER_REQUEST_HISTOGRAMS:
        assert _value(families, f"{name}_count") == requests, name
    assert _value(families, "vllm:request_prompt_tokens_sum") == prompt
    assert _value(families, "vllm:request_generation_tokens_sum") == generated
    assert _value(families, "vllm:request_params_n_sum") == requests
    itl = sum(u.completion_tokens - 1 for u in usage)
    assert _value(families, "vllm:inter_token_latency_seconds_count") == itl
    hits = _value(families, "vllm:prefix_cache_hits_total")
    assert hits == load["prefix_hit_tokens"]
    assert _value(families, "vllm:prefix_cache_queries_total") == prompt
    # Each step's forward computes the prompt tokens not found in the prefix cache (prefill, maybe
    # in chunks), then one token per decode step, fed back after it was sampled. The last token of
    # each request is never fed back, and nothing was preempted (64 blocks, one request at a time).
    assert _value(families, "vllm:num_preemptions_total") == 0
    computed = prompt - hits + generated - requests
    assert _value(families, "vllm:iteration_tokens_total_sum") == computed
    assert _value(families, "vllm:iteration_tokens_total_count") == load["num_steps"]
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert _value(families, gauge) == 0


# a metric name directly followed by its selector: `name{label="value", ...}`
SELECTED = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")


def dashboard_misses(families: dict, queries: list[str], model_name: str) -> list[str]:
    """What the dashboard's queries ask for and the scrape lacks: for each series a query selects,
    a sample of that name whose labels match the selector (with $model_name filled in) and carry
    every label the query groups by."""
    samples = [s for family in families.values() for s in family.samples]
    misses = []
    for query in queries:
        grouped = {label.strip() for found in GROUPING.findall(query)
                   for label in found.split(",")}
        for name, selector in SELECTED.findall(query):
            wanted = {label: value.replace("$model_name", model_name)
                      for label, value in MATCHER.findall(selector)}
            matching = [s for s in samples if s.name == name
                        and wanted.items() <= s.labels.items() and grouped <= set(s.labels)]
            if not matching:
                misses.append(f"{name}{selector} (by {sorted(grouped)})")
    served = {s.labels.get(DASHBOARD_VARIABLE_LABEL) for s in samples}
    if model_name not in served:
        misses.append(f"label_values({DASHBOARD_VARIABLE_LABEL}) lacks {model_name!r}")
    return misses


# ----------------------------------------------------------------------------- tests
def test_vllm_families_have_vllm_types_and_labels(served):
    srv, _ = served
    check_families(_scrape(srv))


def test_values_agree_with_the_responses(served):
    srv, load = served
    check_counts(_scrape(srv), load)


def test_an_idle_server_fails_the_count_checks(served, idle):
    """The control: the families are all there from the start (a dashboard shows zeros, not
    gaps), but no count matches a load the server never saw."""
    _, load = served
    families = _scrape(idle)
    check_families(families)
    with pytest.raises(AssertionError):
        check_counts(families, load)


def test_the_grafana_dashboard_finds_every_series_it_queries(served):
    srv, _ = served
    assert dashboard_misses(_scrape(srv), DASHBOARD_QUERIES, MODEL) == []


def test_the_dashboard_check_sees_a_missing_series(served):
    """The control: old nanoserve names, a vLLM V0 metric nanoserve does not serve, another model's
    name, and a grouping label no series has are each reported."""
    srv, _ = served
    families = _scrape(srv)
    wrong = [f"nanoserve_num_requests_running{SEL}", f"vllm:num_requests_swapped{SEL}",
             f"sum by(status) (rate(vllm:prompt_tokens_total{SEL}{WINDOW}))"]
    assert len(dashboard_misses(families, wrong, MODEL)) == len(wrong)
    assert len(dashboard_misses(families, DASHBOARD_QUERIES[:1], "other-model")) == 2


def test_http_responses_are_counted_under_the_served_name(served):
    srv, load = served
    families = _scrape(srv)
    ok = _value(families, "nanoserve_http_requests_total", endpoint="/v1/completions",
                status="200")
    assert ok == len(load["usage"])
    assert all(s.labels["model_name"] == MODEL for s in families["nanoserve_http_requests"].samples)
