"""Drive a server with a workload: fixed concurrency, a Poisson rate, or both, bounded in time.

Requests are issued in order; with a finite `request_rate` the gaps between sends are
exponential (a Poisson process), and `max_concurrency` caps how many are in flight.
After `duration_s` no new request starts; the ones in flight finish and count.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx

from bench.serving.client import RequestResult, completion_body, send_completion
from bench.serving.metrics import BenchmarkMetrics, Slo, calculate_metrics
from bench.serving.workload import BenchRequest


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How to drive the server."""

    base_url: str
    model: str = "smollm2-135m-instruct"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    duration_s: float | None = None
    ignore_eos: bool = True
    slo: Slo | None = None
    num_warmup: int = 1
    api_key: str | None = None
    seed: int = 0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def _arrivals(requests: list[BenchRequest], rate: float, seed: int):
    """Yield requests at Poisson times (all at once for an infinite rate)."""
    rng = random.Random(seed)
    for request in requests:
        yield request
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(requests: list[BenchRequest], config: RunConfig,
                        transport: httpx.AsyncBaseTransport | None = None
                        ) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    """Send `requests` as `config` says; `transport` replaces the network (tests)."""
    # One connection per request, none kept alive: a pooled connection the server has just
    # closed (llama-server closes some after a streamed response) fails the next request on
    # it with "Server disconnected without sending a response" (2-6 of 64 requests in one
    # run). A loopback connect costs well under a millisecond, the same for every server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        await _warm_up(client, requests, config)
        gate = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
        start = time.perf_counter()
        deadline = start + config.duration_s if config.duration_s else math.inf

        async def limited(request: BenchRequest) -> RequestResult | None:
            async with gate:
                if time.perf_counter() > deadline:
                    return None
                body = completion_body(request, config.model, config.ignore_eos)
                return await send_completion(client, config.url, body, request.prompt_len,
                                             config.headers)

        tasks = []
        async for request in _arrivals(requests, config.request_rate, config.seed):
            if time.perf_counter() > deadline:
                break
            tasks.append(asyncio.create_task(limited(request)))
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        duration = time.perf_counter() - start
    return calculate_metrics(results, duration, config.slo), results


async def _warm_up(client: httpx.AsyncClient, requests: list[BenchRequest],
                   config: RunConfig) -> None:
    """Send a few requests first (not measured); fail early if the server answers badly."""
    for request in requests[: config.num_warmup]:
        body = completion_body(request, config.model, config.ignore_eos)
        result = await send_completion(client, config.url, body, request.prompt_len,
                                       config.headers)
        if not result.success:
            raise RuntimeError(f"warm-up request to {config.url} failed: {result.error}")


def run(requests: list[BenchRequest], config: RunConfig
        ) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    """Blocking wrapper around `run_benchmark`."""
    return asyncio.run(run_benchmark(requests, config))
