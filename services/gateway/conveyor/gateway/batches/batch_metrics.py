"""Batch counts in the gateway's /metrics: batches per status, lines per outcome.

The counts live in Redis (BatchStore.stats_key, kept by the same Lua scripts that
change statuses and write lines), so every gateway replica shows the same totals.
They are read when /metrics is scraped, with a short socket timeout: a Redis
that does not answer leaves the batch series out of that scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from conveyor.common.batch_record import BatchStatus
from conveyor.common.batch_store import BatchStore
from conveyor.gateway.pipeline import Pipeline


class BatchMetrics(Collector):
    def __init__(self, redis_url: str, stats_key: str):
        self._redis = Redis.from_url(redis_url, decode_responses=True, socket_timeout=0.5,
                                     socket_connect_timeout=0.5)
        self._stats_key = stats_key

    def collect(self) -> Iterator:
        try:
            stats = self._redis.hgetall(self._stats_key)
        except RedisError:
            return
        batches = GaugeMetricFamily("conveyor_gateway_batches", "Batches by status.",
                                    labels=["status"])
        for status in BatchStatus:
            batches.add_metric([str(status)], float(stats.get(f"status:{status}", 0)))
        lines = CounterMetricFamily("conveyor_gateway_batch_lines", "Batch lines written, by "
                                    "outcome (completed: a 2xx response).", labels=["outcome"])
        for outcome in ("completed", "failed"):
            lines.add_metric([outcome], float(stats.get(f"lines:{outcome}", 0)))
        yield batches
        yield lines


def attach_batch_metrics(pipeline: Pipeline) -> None:
    """Add the batch series to the pipeline's metrics registry."""
    settings = pipeline.settings
    stats_key = BatchStore(pipeline.redis, settings.redis_prefix).stats_key
    pipeline.metrics.registry.register(BatchMetrics(settings.redis_url, stats_key))
