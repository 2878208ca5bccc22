"""nanoserve.tools.metrics: per-request latencies and run summaries on a trace worked out by hand.

The trace uses times that are sums of powers of two, so most expected values are exact floats.

    request  arrival  scheduled  token times              finish  prompt
    R0       0.0      0.25       1.0, 1.5, 2.5, 3.0       3.5     8
    R1       1.0      1.0        1.5, 2.0, 2.25           -       4      (E2E ends at t_n)
    R2       2.0      3.0        4.0                      4.0     12     (n = 1: no TPOT, no ITL)
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from nanoserve.errors import NanoserveError
from nanoserve.tools.metrics import MetricsSummary, RequestMetrics, percentile, summarize


def trace() -> list[RequestMetrics]:
    return [
        RequestMetrics(0.0, [1.0, 1.5, 2.5, 3.0], prompt_tokens=8, first_scheduled_time=0.25,
                       finish_time=3.5),
        RequestMetrics(1.0, [1.5, 2.0, 2.25], prompt_tokens=4, first_scheduled_time=1.0),
        RequestMetrics(2.0, [4.0], prompt_tokens=12, first_scheduled_time=3.0, finish_time=4.0),
    ]


# --------------------------------------------------------------------------- one request
def test_per_request_latencies_by_hand():
    r0, r1, r2 = trace()
    assert (r0.queue_time, r0.ttft, r0.e2e) == (0.25, 1.0, 3.5)
    assert r0.itls == [0.5, 1.0, 0.5]
    assert r0.tpot == pytest.approx((3.5 - 1.0) / 3)
    assert r0.output_tokens == 4

    assert (r1.queue_time, r1.ttft, r1.e2e) == (0.0, 0.5, 1.25)  # no finish time: E2E = t_n − a
    assert r1.itls == [0.5, 0.25]
    assert r1.tpot == (1.25 - 0.5) / 2

    assert (r2.queue_time, r2.ttft, r2.e2e) == (1.0, 2.0, 2.0)
    assert r2.tpot is None and r2.itls == []


def test_tpot_is_not_e2e_over_n_nor_mean_itl():
    """Negative control: the usual wrong TPOTs give different numbers on R0, so the test above can
    tell."""
    r0 = trace()[0]
    expected = 2.5 / 3  # (E2E − TTFT) / (n − 1)
    assert r0.tpot == pytest.approx(expected)
    # 0.875: counts the prefill in every token
    assert expected != pytest.approx(r0.e2e / r0.output_tokens)
    assert expected != pytest.approx(sum(r0.itls) / len(r0.itls))  # 0.667: misses the gap t_n → f


def test_from_output_is_duck_typed():
    out = SimpleNamespace(arrival_time=1.0, token_times=(1.5, 2.0), prompt_token_ids=[5, 6, 7],
                          finish_time=2.5)
    m = RequestMetrics.from_output(out)  # no first_scheduled_time attribute
    assert (m.prompt_tokens, m.output_tokens, m.queue_time, m.e2e) == (3, 2, None, 1.5)
    out.first_scheduled_time = 1.25
    assert RequestMetrics.from_output(out).queue_time == 0.25


@pytest.mark.parametrize("kwargs", [
    dict(arrival_time=0.0, token_times=[], prompt_tokens=1),  # no output token
    dict(arrival_time=0.0, token_times=[2.0, 1.0], prompt_tokens=1),  # tokens out of order
    dict(arrival_time=3.0, token_times=[2.0], prompt_tokens=1),  # token before arrival
    # scheduled after token
    dict(arrival_time=0.0, token_times=[1.0], prompt_tokens=1, first_scheduled_time=2.0),
    # finished before last token
    dict(arrival_time=0.0, token_times=[1.0], prompt_tokens=1, finish_time=0.5),
    dict(arrival_time=0.0, token_times=[1.0], prompt_tokens=-1),
])
def test_bad_request_times_are_rejected(kwargs):
    with pytest.raises(NanoserveError):
        RequestMetrics(**kwargs)


# --------------------------------------------------------------------------- percentiles
def test_percentile_hand_values():
    x = [2.0, 0.5, 1.0]  # sorted: 0.5, 1, 2; rank h = 2q/100
    assert percentile(x, 0) == 0.5 and percentile(x, 100) == 2.0
    assert percentile(x, 50) == 1.0
    assert percentile(x, 25) == 0.75  # h = 0.5: halfway between 0.5 and 1
    assert percentile(x, 90) == pytest.approx(1.8)  # h = 1.8: 1 + 0.8 · (2 − 1)
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy():
    rng = random.Random(0)
    lists = [[1.0, 2.0], [3.0, 1.0, 2.0, 10.0], [rng.expovariate(1.0) for _ in range(101)],
             [rng.uniform(-5, 5) for _ in range(37)]]
    for values in lists:
        for q in (0, 1, 10, 25, 50, 62.5, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)),
                                                          rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects_bad_input(values, q):
    with pytest.raises(NanoserveError):
        percentile(values, q)


# --------------------------------------------------------------------------- summary
def test_summary_by_hand():
    s = summarize(trace())
    # duration = last end (R2 at 4.0) − first arrival (R0 at 0.0); 8 output and 24 prompt tokens
    assert (s.num_requests, s.duration) == (3, 4.0)
    assert (s.output_throughput, s.total_throughput, s.request_throughput) == (2.0, 8.0, 0.75)
    assert s.goodput is None

    # TTFT [1, 0.5, 2] → sorted [0.5, 1, 2]; p90 at rank 1.8, p99 at rank 1.98
    assert s.ttft == pytest.approx({"mean": 3.5 / 3, "p50": 1.0, "p90": 1.8, "p99": 1.98})
    # TPOT [2.5/3, 0.375]: R2 (n = 1) is left out
    lo, hi = 0.375, 2.5 / 3
    assert s.tpot == pytest.approx({"mean": (lo + hi) / 2, "p50": (lo + hi) / 2,
                                    "p90": lo + 0.9 * (hi - lo), "p99": lo + 0.99 * (hi - lo)})
    # ITL pooled: [0.5, 1, 0.5] + [0.5, 0.25] → sorted [0.25, 0.5, 0.5, 0.5, 1]; ranks 3.6 and 3.96
    assert s.itl == pytest.approx({"mean": 0.55, "p50": 0.5, "p90": 0.8, "p99": 0.98})
    # E2E [3.5, 1.25, 2] → sorted [1.25, 2, 3.5]
    assert s.e2e == pytest.approx({"mean": 2.25, "p50": 2.0, "p90": 3.2, "p99": 3.47})
    # queue [0.25, 0, 1] → sorted [0, 0.25, 1]
    assert s.queue == pytest.approx({"mean": 1.25 / 3, "p50": 0.25, "p90": 0.85, "p99": 0.985})


def test_summary_explicit_duration():
    s = summarize(trace(), duration=8.0)
    assert (s.duration, s.output_throughput, s.total_throughput, s.request_throughput) == (
        8.0, 1.0, 4.0, 0.375,
    )
    with pytest.raises(NanoserveError):
        summarize(trace(), duration=0.0)


def test_goodput_counts_requests_meeting_slos():
    # per request (TTFT, TPOT): R0 (1.0, 0.833), R1 (0.5, 0.375), R2 (2.0, none); duration 4 s
    # R1 only (R0: TPOT, R2: TTFT)
    assert summarize(trace(), slo_ttft=1.0, slo_tpot=0.5).goodput == 1 / 4
    assert summarize(trace(), slo_ttft=1.0).goodput == 2 / 4  # R0 (TTFT = SLO counts) and R1
    assert summarize(trace(), slo_tpot=0.5).goodput == 2 / 4  # R1, and R2 with no TPOT to break
    assert summarize(trace(), slo_ttft=0.1, slo_tpot=0.1).goodput == 0.0


def test_single_token_requests_have_no_tpot_or_itl():
    runs = [RequestMetrics(0.0, [0.5], prompt_tokens=3, finish_time=0.5),
            RequestMetrics(0.25, [1.0], prompt_tokens=3, finish_time=1.0)]
    s = summarize(runs)
    assert s.tpot == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert s.itl == s.tpot and s.queue == s.tpot  # no first_scheduled_time either
    assert s.ttft == pytest.approx({"mean": 0.625, "p50": 0.625, "p90": 0.725, "p99": 0.7475})
    assert s.output_throughput == 2.0  # 2 tokens over 1 s


def test_empty_run_is_an_error():
    with pytest.raises(NanoserveError, match="at least one"):
        summarize([])


def test_table_and_as_dict():
    s = summarize(trace(), slo_ttft=1.0)
    text_ms, text_s = s.table(), s.table(unit="s")
    for row in ("TTFT", "TPOT", "ITL", "E2E", "queue", "goodput", "output throughput"):
        assert row in text_ms
    assert "latency (ms)" in text_ms and "1166.667" in text_ms  # mean TTFT in ms
    assert "latency (s)" in text_s and "1.167" in text_s
    with pytest.raises(NanoserveError):
        s.table(unit="us")

    d = json.loads(json.dumps(s.as_dict(), allow_nan=False))
    assert d["ttft"]["p50"] == 1.0 and d["goodput"] == 0.5 and d["num_requests"] == 3
    assert MetricsSummary(**d) == s
    one = summarize([RequestMetrics(0.0, [0.5], prompt_tokens=1)])
    # None stats print as "-"
    assert "-" in one.table() and json.dumps(one.as_dict(), allow_nan=False)
