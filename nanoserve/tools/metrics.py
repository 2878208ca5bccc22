"""Serving metrics: per-request latencies and their summary over a run, with vLLM's definitions.

For one request (all times in seconds, from one clock, e.g. `time.perf_counter`):

    a    arrival_time            the request reached the engine
    s    first_scheduled_time    the scheduler first gave it a slot (optional)
    t_i  token_times[i - 1]      emission of output token i; t_1 is the first output token
    f    finish_time             the request finished (optional; t_n stands in when missing)

    queue time = s − a
    TTFT       = t_1 − a                         time to first token
    E2E        = f − a                           end-to-end latency
    ITL        = [t_{i+1} − t_i for i = 1..n−1]  every inter-token latency
    TPOT       = (E2E − TTFT) / (n − 1)          time per output token after the first; n ≥ 2 only

TPOT is not E2E / n (that would count the prefill in every token) and, when f > t_n, not the
mean ITL either. These are the definitions of vLLM's benchmark_serving, so numbers printed
here can be read beside vLLM's.

Over a run, `summarize` reports mean / p50 / p90 / p99 of TTFT, TPOT, ITL (all requests' ITLs
pooled into one list), E2E and queue time, and three throughputs over duration = last finish −
first arrival (or a duration you give):

    output throughput  = Σ output tokens / duration            tok/s
    total throughput   = Σ (prompt + output tokens) / duration  tok/s
    request throughput = number of requests / duration         req/s
    goodput            = requests with TTFT ≤ slo_ttft and TPOT ≤ slo_tpot / duration   req/s

Goodput is reported only when at least one SLO is given; a request with one output token has no
TPOT and so cannot break a TPOT SLO (as in vLLM). Percentiles interpolate linearly between
closest ranks, numpy's default method (see `percentile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..errors import NanoserveError

STATS = ("mean", "p50", "p90", "p99")
UNITS = {"s": 1.0, "ms": 1e3}


@dataclass
class RequestMetrics:
    """The timestamps of one finished request; every latency is derived from them."""

    arrival_time: float
    token_times: list[float]  # emission time of each output token, first token first
    prompt_tokens: int
    first_scheduled_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        # The order a ≤ s ≤ t_1 ≤ … ≤ t_n ≤ f is what makes every latency non-negative.
        if not self.token_times:
            raise NanoserveError("RequestMetrics needs at least one output token time, got none")
        if self.prompt_tokens < 0:
            raise NanoserveError(f"prompt_tokens must be ≥ 0, got {self.prompt_tokens}")
        times = [self.arrival_time]
        times += [] if self.first_scheduled_time is None else [self.first_scheduled_time]
        times += list(self.token_times)
        times += [] if self.finish_time is None else [self.finish_time]
        if any(later < earlier for earlier, later in zip(times, times[1:])):
            raise NanoserveError(
                "request times must satisfy arrival ≤ first_scheduled ≤ token_times "
                f"(non-decreasing) ≤ finish, got arrival={self.arrival_time}, "
                f"first_scheduled={self.first_scheduled_time}, token_times={self.token_times}, "
                f"finish={self.finish_time}"
            )

    @classmethod
    def from_output(cls, out) -> RequestMetrics:
        """From any object with arrival_time, token_times, prompt_token_ids, finish_time and,
        optionally, first_scheduled_time (e.g. the engine's RequestOutput)."""
        return cls(
            arrival_time=out.arrival_time,
            token_times=list(out.token_times),
            prompt_tokens=len(out.prompt_token_ids),
            first_scheduled_time=getattr(out, "first_scheduled_time", None),
            finish_time=out.finish_time,
        )

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def end_time(self) -> float:
        """f, or t_n when the finish time was not recorded."""
        return self.token_times[-1] if self.finish_time is None else self.finish_time

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return (
            None if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (n − 1); None for a single output token, which has no 'per token after the
        first'."""
        n = self.output_tokens
        return None if n < 2 else (self.e2e - self.ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of values, numpy's default "linear" method.

    Sort the n values into x_0 ≤ … ≤ x_{n−1}; the percentile sits at fractional rank
    h = (n − 1)·q/100 and is read off the straight line between its neighbours:
    x_⌊h⌋ + (h − ⌊h⌋)·(x_⌊h⌋+1 − x_⌊h⌋). So p0 is the minimum, p100 the maximum, p50 the median.
    """
    if not values:
        raise NanoserveError("percentile of an empty list is undefined")
    if not 0 <= q <= 100:
        raise NanoserveError(f"percentile q must be in [0, 100], got {q}")
    x = sorted(values)
    h = (len(x) - 1) * q / 100
    lo = math.floor(h)
    if lo == len(x) - 1:  # q = 100: no upper neighbour
        return float(x[lo])
    return float(x[lo] + (h - lo) * (x[lo + 1] - x[lo]))


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 of values; all None when there are none (e.g. TPOT when every n =
    1)."""
    if not values:
        return dict.fromkeys(STATS)
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


@dataclass
class MetricsSummary:
    """A run's throughputs (per second) and latency statistics (seconds), see the module
    docstring."""

    num_requests: int
    duration: float  # seconds
    output_throughput: float  # output tok/s
    total_throughput: float  # (prompt + output) tok/s
    request_throughput: float  # req/s
    # each: {"mean", "p50", "p90", "p99"}
    ttft: dict[str, float | None] = field(default_factory=dict)
    tpot: dict[str, float | None] = field(default_factory=dict)
    itl: dict[str, float | None] = field(default_factory=dict)
    e2e: dict[str, float | None] = field(default_factory=dict)
    queue: dict[str, float | None] = field(default_factory=dict)
    goodput: float | None = None  # req/s meeting the SLOs; None when no SLO was given

    def table(self, unit: str = "ms") -> str:
        """A plain-text table; latencies in `unit` ("ms" or "s"), throughputs per second."""
        if unit not in UNITS:
            raise NanoserveError(f"unit must be one of {sorted(UNITS)}, got {unit!r}")
        scale = UNITS[unit]
        lines = [
            f"{'requests':<22}{self.num_requests:>12d}",
            f"{'duration (s)':<22}{self.duration:>12.3f}",
            f"{'request throughput':<22}{self.request_throughput:>12.2f} req/s",
            f"{'output throughput':<22}{self.output_throughput:>12.2f} tok/s",
            f"{'total throughput':<22}{self.total_throughput:>12.2f} tok/s",
        ]
        if self.goodput is not None:
            lines.append(f"{'goodput':<22}{self.goodput:>12.2f} req/s")
        lines.append(f"{f'latency ({unit})':<14}" + "".join(f"{name:>12}" for name in STATS))
        for name, stats in [("TTFT", self.ttft), ("TPOT", self.tpot), ("ITL", self.itl),
                            ("E2E", self.e2e), ("queue", self.queue)]:
            cells = ("-" if stats[s] is None else f"{stats[s] * scale:.3f}" for s in STATS)
            lines.append(f"{name:<14}" + "".join(f"{cell:>12}" for cell in cells))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Plain ints, floats, None and dicts: `json.dumps` takes it as is."""
        return asdict(self)


def _meets_slo(m: RequestMetrics, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    ttft_ok = slo_ttft is None or m.ttft <= slo_ttft
    tpot_ok = slo_tpot is None or m.tpot is None or m.tpot <= slo_tpot
    return ttft_ok and tpot_ok


def summarize(metrics: Sequence[RequestMetrics], duration: float | None = None,
              slo_ttft: float | None = None, slo_tpot: float | None = None) -> MetricsSummary:
    """Summarize a run of requests. SLOs are in seconds, like every time here."""
    if not metrics:
        raise NanoserveError("summarize needs at least one request's metrics, got none")
    if duration is None:
        duration = max(m.end_time for m in metrics) - min(m.arrival_time for m in metrics)
    if duration <= 0:
        raise NanoserveError(f"duration must be > 0 seconds, got {duration}")
    output_tokens = sum(m.output_tokens for m in metrics)
    prompt_tokens = sum(m.prompt_tokens for m in metrics)
    goodput = None
    if slo_ttft is not None or slo_tpot is not None:
        goodput = sum(_meets_slo(m, slo_ttft, slo_tpot) for m in metrics) / duration
    return MetricsSummary(
        num_requests=len(metrics),
        duration=duration,
        output_throughput=output_tokens / duration,
        total_throughput=(prompt_tokens + output_tokens) / duration,
        request_throughput=len(metrics) / duration,
        ttft=_stats([m.ttft for m in metrics]),
        tpot=_stats([m.tpot for m in metrics if m.tpot is not None]),
        itl=_stats([itl for m in metrics for itl in m.itls]),
        e2e=_stats([m.e2e for m in metrics]),
        queue=_stats([m.queue_time for m in metrics if m.queue_time is not None]),
        goodput=goodput,
    )
