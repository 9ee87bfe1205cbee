"""Benchmark figures from per-request results, with `vllm bench serve`'s definitions.

- request throughput = completed requests / duration
- output throughput = output tokens of completed requests / duration
- total token throughput = (prompt + output tokens of completed requests) / duration
- TTFT: send -> first token chunk; E2EL (latency): send -> last token chunk
- TPOT per request = (latency - TTFT) / (output tokens - 1), for requests with > 1 token
- ITL: every gap between consecutive token chunks, pooled over all requests
- goodput = completed requests meeting every given SLO (TTFT, TPOT, E2EL) / duration

`duration` is the benchmark's wall time from the first send to the last completion.
Latencies are reported in milliseconds; percentiles are numpy's (linear interpolation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.serving.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None leaves one out."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, ttft_ms: float, tpot_ms: float, e2el_ms: float) -> bool:
        limits = ((self.ttft_ms, ttft_ms), (self.tpot_ms, tpot_ms), (self.e2el_ms, e2el_ms))
        return all(limit is None or value <= limit for limit, value in limits)


@dataclass(frozen=True, slots=True)
class Distribution:
    """mean / std / percentiles of one latency, in ms."""

    mean: float
    std: float
    percentiles: dict[int, float]

    @property
    def p50(self) -> float:
        return self.percentiles[50]

    @property
    def p99(self) -> float:
        return self.percentiles[99]

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        ms = np.asarray(values or [0.0], dtype=float) * 1000.0
        return cls(float(ms.mean()), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in PERCENTILES})


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """The figures of one benchmark run."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "request_goodput")}
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution = getattr(self, name)
            out[f"mean_{name}_ms"] = dist.mean
            out.update({f"p{p}_{name}_ms": v for p, v in dist.percentiles.items()})
        out["errors"] = self.errors[:5]
        return out


def tpot_of(result: RequestResult) -> float | None:
    """(latency - TTFT) / (output tokens - 1); None when there is one token or fewer."""
    if result.output_tokens <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      slo: Slo | None = None) -> BenchmarkMetrics:
    done = [r for r in results if r.success]
    tpots = [tpot_of(r) for r in done]
    good = None
    if slo is not None:
        num_good = sum(slo.met_by(r.ttft * 1e3, (t or 0.0) * 1e3, r.latency * 1e3)
                       for r, t in zip(done, tpots, strict=True))
        good = num_good / duration_s
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    return BenchmarkMetrics(
        duration_s=duration_s, completed=len(done), failed=len(results) - len(done),
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=good,
        ttft=Distribution.of_seconds([r.ttft for r in done]),
        tpot=Distribution.of_seconds([t for t in tpots if t is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itl]),
        e2el=Distribution.of_seconds([r.latency for r in done]),
        errors=[r.error for r in results if not r.success],
    )


def format_metrics(name: str, m: BenchmarkMetrics) -> str:
    """A text block like vllm bench serve's summary."""
    lines = [f"{'=' * 16} {name} {'=' * 16}",
             f"Successful requests:            {m.completed}",
             f"Failed requests:                {m.failed}",
             f"Benchmark duration (s):         {m.duration_s:.2f}",
             f"Total input tokens:             {m.total_input_tokens}",
             f"Total generated tokens:         {m.total_output_tokens}",
             f"Request throughput (req/s):     {m.request_throughput:.2f}",
             f"Output token throughput (tok/s): {m.output_throughput:.2f}",
             f"Total token throughput (tok/s): {m.total_token_throughput:.2f}"]
    if m.request_goodput is not None:
        lines.append(f"Request goodput (req/s):        {m.request_goodput:.2f}")
    for label, dist in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2EL", m.e2el)):
        lines.append(f"{label:5s} ms: mean {dist.mean:8.2f}  p50 {dist.p50:8.2f}  "
                     f"p90 {dist.percentiles[90]:8.2f}  p99 {dist.p99:8.2f}")
    if m.errors:
        lines.append(f"first error: {m.errors[0]}")
    return "\n".join(lines)
