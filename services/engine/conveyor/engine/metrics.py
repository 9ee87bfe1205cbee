"""Prometheus metrics with vLLM's names under the `conveyor:` prefix, served over HTTP.

Each EngineMetrics owns its registry (no process-wide state), so tests can build
several. Counters are exported with the `_total` suffix, as vLLM's are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.iteration_stats import IterationStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("model_name", "engine")


class EngineMetrics:
    """Gauges from EngineStats snapshots, counters and histograms from IterationStats."""

    def __init__(self, model_name: str, engine_id: str):
        self.registry = CollectorRegistry()
        self._labels = (model_name, engine_id)
        self._last = EngineStats()
        self._build_gauges()
        self._build_counters()
        self._build_histograms()

    def _gauge(self, name: str, doc: str) -> Gauge:
        metric = Gauge(f"conveyor:{name}", doc, LABELS, registry=self.registry)
        return metric.labels(*self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        metric = Counter(f"conveyor:{name}", doc, LABELS, registry=self.registry)
        return metric.labels(*self._labels)

    def _histogram(self, name: str, doc: str) -> Histogram:
        metric = Histogram(f"conveyor:{name}", doc, LABELS, buckets=LATENCY_BUCKETS,
                           registry=self.registry)
        return metric.labels(*self._labels)

    def _build_gauges(self) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Requests computing.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting.")
        self.kv_cache_usage_perc = self._gauge("kv_cache_usage_perc", "KV blocks in use, 0-1.")

    def _build_counters(self) -> None:
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = self._counter("num_preemptions", "Requests preempted.")
        self.num_requests_shed = self._counter(
            "num_requests_shed", "Requests refused or pushed out of the full waiting queue.")
        self.prompt_tokens = self._counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")

    def _build_histograms(self) -> None:
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Arrival to first token.")
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Arrival to finish.")
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.")

    def record_stats(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters that the snapshot holds as totals."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        last, self._last = self._last, stats
        _advance(self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries)
        _advance(self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits)
        _advance(self.num_preemptions, stats.num_preemptions, last.num_preemptions)
        _advance(self.num_requests_shed, stats.num_requests_shed, last.num_requests_shed)

    def record_iteration(self, iteration: IterationStats) -> None:
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        _observe_all(self.time_to_first_token, iteration.time_to_first_token)
        _observe_all(self.inter_token_latency, iteration.inter_token_latency)
        _observe_all(self.e2e_request_latency, iteration.e2e_latency)
        _observe_all(self.request_queue_time, iteration.queue_time)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on `port` from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)


def _observe_all(histogram: Histogram, values: list[float]) -> None:
    for value in values:
        histogram.observe(value)


def _advance(counter: Counter, total: int, last_total: int) -> None:
    counter.inc(max(0, total - last_total))
