"""The gateway's replica sets of the tokenizer and detok services (see
conveyor.common.replica_set): the Redis registry under the gateway's prefix, the
configured addresses while none registered, and the gateway's keepalive."""

from __future__ import annotations

import functools

from redis.asyncio import Redis

from conveyor.common.grpc_client import Keepalive
from conveyor.common.replica_set import ReplicaSet
from conveyor.common.service_registry import ReplicaEntry, ServiceRegistry
from conveyor.gateway.observability import GatewayMetrics
from conveyor.gateway.settings import GatewaySettings


def replica_set(service: str, static_addresses: str, settings: GatewaySettings,
                redis: Redis, metrics: GatewayMetrics) -> ReplicaSet:
    """Replicas of `service` ("tokenizer" or "detok"); `static_addresses` is the
    comma-separated fallback list. Each call or stream sent counts in
    conveyor_gateway_replica_calls_total{service, address}."""
    registry = ServiceRegistry(redis, service=service, entry_type=ReplicaEntry,
                               prefix=settings.redis_prefix)
    return ReplicaSet(
        service, registry, [a.strip() for a in static_addresses.split(",") if a.strip()],
        refresh_s=settings.replica_refresh_s, max_attempts=settings.replica_max_attempts,
        keepalive=Keepalive(settings.keepalive_time_s, settings.keepalive_timeout_s),
        on_pick=functools.partial(metrics.count_replica_call, service))
