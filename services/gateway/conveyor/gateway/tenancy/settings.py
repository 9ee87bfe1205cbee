"""Settings of tenancy (keys, tiers, quotas, timelines): CONVEYOR_GATEWAY_<NAME>.

They share the gateway's prefix so a deployment configures one service; the
gateway's settings class can inherit from this one to hold them all.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from conveyor.gateway.tenancy.tiers import Tier, build_tiers


class TenancySettings(BaseSettings):
    """API keys, tiers, admission and request timelines."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_GATEWAY_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for keys, quotas, "
                           "routing and timelines; every gateway replica uses the same one.")
    redis_prefix: str = Field("conveyor", description="Prefix of every Redis key Conveyor writes.")
    redis_timeout_s: float = Field(2.0, gt=0, description="Longest one Redis call may take "
                                   "(connect or answer); past it Redis counts as unavailable.")
    quota_fail_open: bool = Field(False, description="While Redis is unavailable, serve requests "
                                  "without quota checks (default: refuse them with 503).")
    auth_enabled: bool = Field(True, description="Require an API key (Authorization: Bearer). "
                               "Off: every request is the anonymous tenant (local use only).")
    api_key_cache_ttl_s: float = Field(
        1.0, ge=0, description="How long a gateway trusts a key it found valid before asking "
        "Redis again; a key revoked elsewhere keeps working here for at most this long "
        "(0: ask Redis on every request).")
    anonymous_tier: str = Field("unlimited", description="Tier of the anonymous tenant when "
                                "auth is off.")
    tiers: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description='JSON overrides of the tiers, e.g. {"free": '
        '{"requests_per_minute": 5}}; a new name adds a tier.')
    quota_period_s: float = Field(60.0, gt=0, description="Period of the per-minute limits "
                                  "(shorter only in tests).")
    reservation_ttl_s: float = Field(
        900.0, gt=0, description="How long an unsettled reservation (a concurrency slot) lives if "
        "its gateway died; keep it above the request timeout.")
    batch_token: str = Field("", description="Internal token of batch workers' lines (their "
                             "CONVEYOR_BATCH_GATEWAY_TOKEN); empty: batch lines are refused.")
    timeline_ttl_s: float = Field(3600.0, gt=0, description="How long a request's timeline "
                                  "stays readable at GET /v1/requests/{id}.")

    @model_validator(mode="after")
    def _check_tiers(self) -> TenancySettings:
        tiers = build_tiers(self.tiers)
        if self.anonymous_tier not in tiers:
            raise ValueError(f"CONVEYOR_GATEWAY_ANONYMOUS_TIER={self.anonymous_tier!r} is not a "
                             f"tier; known: {sorted(tiers)}")
        return self

    @property
    def tier_table(self) -> dict[str, Tier]:
        """The default tiers with CONVEYOR_GATEWAY_TIERS applied."""
        return build_tiers(self.tiers)
