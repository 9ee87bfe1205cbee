"""Settings of a replica that registers itself in Redis (engine, tokenizer, detok)."""

from __future__ import annotations

import socket

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from conveyor.common.service_registry import DEFAULT_INTERVAL_S, DEFAULT_TTL_S


class RegistrationSettings(BaseSettings):
    """Where a replica registers so gateways find it; mixed into a service's settings
    (which set the env prefix and the `host` it binds)."""

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis of the registry gateways find this "
        "replica in (empty: do not register).",
    )
    redis_prefix: str = Field("conveyor", description="Namespace of the registry's Redis keys.")
    advertise_address: str = Field(
        "", description="host:port gateways dial, as registered (empty: the bound host, or "
        "the hostname when bound to 0.0.0.0, and the bound port).",
    )
    heartbeat_interval_s: float = Field(
        DEFAULT_INTERVAL_S, gt=0, description="Seconds between registry heartbeats."
    )
    registry_ttl_s: float = Field(
        DEFAULT_TTL_S, gt=0, description="Seconds without a heartbeat before gateways stop "
        "calling this replica.",
    )

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> RegistrationSettings:
        if self.heartbeat_interval_s >= self.registry_ttl_s:
            prefix = self.model_config.get("env_prefix", "")
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be shorter than "
                f"registry_ttl_s ({self.registry_ttl_s}); change {prefix}HEARTBEAT_INTERVAL_S "
                f"or {prefix}REGISTRY_TTL_S")
        return self

    def resolved_advertise_address(self, bound_port: int) -> str:
        """Where gateways reach this replica: `advertise_address`, else host:bound port."""
        if self.advertise_address:
            return self.advertise_address
        bound = self.host  # type: ignore[attr-defined]  # the service's ServiceSettings field
        host = socket.gethostname() if bound in ("0.0.0.0", "::", "[::]") else bound
        return f"{host}:{bound_port}"
