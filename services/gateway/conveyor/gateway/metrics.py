"""The gateway's Prometheus metrics, on a registry of its own (one per app)."""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from conveyor.gateway.usage_totals import UsageTotals

log = logging.getLogger("conveyor.gateway.requests")

DISCONNECTED_STATUS = 499
"""The status recorded (never sent) for a request whose client went away (nginx's)."""

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """Request counts and latencies, time to first token, tokens, disconnects."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("conveyor_gateway_requests", "Finished HTTP requests.",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(
            "conveyor_gateway_request_duration_seconds", "Request latency, streaming included.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(
            "conveyor_gateway_time_to_first_token_seconds",
            "From arrival to the first generated text.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("conveyor_gateway_requests_in_flight",
                               "Requests being served.", ["endpoint"], registry=r)
        self.client_disconnects = Counter(
            "conveyor_gateway_client_disconnects", "Requests whose client went away first.",
            ["endpoint"], registry=r)
        self.timeouts = Counter("conveyor_gateway_request_timeouts",
                                "Requests cancelled at the request timeout.", ["endpoint"],
                                registry=r)
        self.replica_calls = Counter(
            "conveyor_gateway_replica_calls", "Calls and streams sent to each tokenizer and "
            "detok replica (retries and rebuilt streams included).", ["service", "address"],
            registry=r)
        self.prompt_tokens = Counter("conveyor_gateway_prompt_tokens", "Prompt tokens served.",
                                     registry=r)
        self.cached_prompt_tokens = Counter(
            "conveyor_gateway_cached_prompt_tokens", "Prompt tokens served from prefix cache.",
            registry=r)
        self.completion_tokens = Counter("conveyor_gateway_completion_tokens",
                                         "Tokens generated.", registry=r)

    def start(self, endpoint: str) -> RequestRecord:
        return RequestRecord(self, endpoint)

    def count_replica_call(self, service: str, address: str) -> None:
        """One call or stream sent to a tokenizer or detok replica (ReplicaSet's on_pick)."""
        self.replica_calls.labels(service, address).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecord:
    """One request's metrics; `finish` records it once (later calls are ignored)."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str):
        self._metrics = metrics
        self.endpoint = endpoint
        self._started = time.perf_counter()
        self._usage: UsageTotals | None = None
        self._first_token_seen = False
        self._finished = False
        metrics.in_flight.labels(endpoint).inc()

    def first_token(self) -> None:
        if not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.first_token_seconds.labels(self.endpoint).observe(
                time.perf_counter() - self._started)

    def tokens(self, usage: UsageTotals) -> None:
        self._usage = usage
        self._metrics.prompt_tokens.inc(usage.prompt_tokens)
        self._metrics.cached_prompt_tokens.inc(usage.cached_tokens)
        self._metrics.completion_tokens.inc(usage.completion_tokens)

    def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        m = self._metrics
        seconds = time.perf_counter() - self._started
        m.in_flight.labels(self.endpoint).dec()
        m.requests.labels(self.endpoint, str(status)).inc()
        m.request_seconds.labels(self.endpoint).observe(seconds)
        tokens = (f", {self._usage.prompt_tokens} prompt + {self._usage.completion_tokens} "
                  f"completion tokens" if self._usage else "")
        log.info("%s -> %d in %.3fs%s", self.endpoint, status, seconds, tokens)
        if status == DISCONNECTED_STATUS:
            m.client_disconnects.labels(self.endpoint).inc()
        elif status == 504:
            m.timeouts.labels(self.endpoint).inc()
