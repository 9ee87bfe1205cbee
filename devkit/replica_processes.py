"""Tokenizer, detok and engine replicas as real processes registered in Redis, and the
gateway's per-replica call counts (for the failover and cross-host tests)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from devkit.service_process import ServiceProcess, settings_env

MODEL = "smollm2-135m-instruct"
HEARTBEAT_S = "0.5"
TTL_S = "2"
"""Registry timing of the test replicas: a dead one leaves the registry within 2 s."""
REPLICA_CALLS = re.compile(
    r'conveyor_gateway_replica_calls_total\{address="([^"]+)",service="([^"]+)"\} ([0-9.e+]+)')


def replica_process(service: str, name: str, log_dir: Path, redis_url: str, prefix: str,
                    argv_prefix: Sequence[str] = (), **settings: str) -> ServiceProcess:
    """A `service` process that registers under `prefix`; `settings` by field name."""
    values = {"MODEL": MODEL, "PORT": "0", "REDIS_URL": redis_url, "REDIS_PREFIX": prefix,
              "HEARTBEAT_INTERVAL_S": HEARTBEAT_S, "REGISTRY_TTL_S": TTL_S, **settings}
    return ServiceProcess(
        f"conveyor.{service}", name=name, log_path=log_dir / f"{name}.log",
        argv_prefix=tuple(argv_prefix),
        env={"HF_HUB_OFFLINE": "1", **settings_env(service, values)})


def replica_calls(metrics_text: str) -> dict[tuple[str, str], int]:
    """(service, address) -> calls the gateway sent there, from its /metrics text."""
    return {(service, address): int(float(count))
            for address, service, count in REPLICA_CALLS.findall(metrics_text)}
