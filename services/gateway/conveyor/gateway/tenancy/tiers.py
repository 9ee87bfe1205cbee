"""Tiers: what a tenant may do (priority, quotas, prefix-cache sharing).

The defaults live here, in one table; a deployment overrides any field of any
tier, or adds tiers, with `CONVEYOR_GATEWAY_TIERS` (JSON, see TenancySettings).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any


class CacheSharing(StrEnum):
    """Whose prefix-cache blocks a tenant's requests may reuse."""

    TENANT = "tenant"
    """Only the tenant's own (the default): tenants never see each other's KV."""
    GLOBAL = "global"
    """Every tenant whose tier also shares globally (an empty cache salt)."""


@dataclass(slots=True, frozen=True)
class Tier:
    """Limits and scheduling class shared by every tenant of a tier.

    A limit of None means unlimited. `priority` is the engine priority of the
    tier's requests (lower runs first); a request may ask for up to
    `max_priority_offset` more (i.e. to run later), never less.
    """

    name: str
    priority: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    """Prompt tokens + max_tokens reserved per request; unused ones are returned."""
    max_concurrent_requests: int | None
    max_priority_offset: int = 9
    cache_sharing: CacheSharing = CacheSharing.TENANT

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"tier {self.name!r}: {name} must be >= 1 or null "
                                 f"(unlimited), got {value}")
        if self.max_priority_offset < 0:
            raise ValueError(f"tier {self.name!r}: max_priority_offset must be >= 0")


DEFAULT_TIERS: dict[str, Tier] = {
    tier.name: tier
    for tier in (
        Tier("premium", priority=0, requests_per_minute=600, tokens_per_minute=1_000_000,
             max_concurrent_requests=64),
        Tier("standard", priority=10, requests_per_minute=120, tokens_per_minute=200_000,
             max_concurrent_requests=16),
        Tier("free", priority=20, requests_per_minute=10, tokens_per_minute=20_000,
             max_concurrent_requests=2),
        Tier("batch", priority=30, requests_per_minute=60, tokens_per_minute=2_000_000,
             max_concurrent_requests=32),
        Tier("unlimited", priority=10, requests_per_minute=None, tokens_per_minute=None,
             max_concurrent_requests=None),
    )
}
"""Lower priority runs first: premium ahead of standard ahead of free ahead of batch.
"unlimited" is the anonymous tenant's when auth is off (local use)."""


BATCH_PRIORITY_BASE = 1000
"""Batch lines run at BATCH_PRIORITY_BASE + their tier's priority: behind every
interactive request of any tier (build_tiers refuses a tier that could reach it)."""


def batch_tier(tier: Tier) -> Tier:
    """The tier a batch line of `tier` runs under: the same tier at batch priority."""
    return replace(tier, priority=BATCH_PRIORITY_BASE + tier.priority)


def build_tiers(overrides: dict[str, dict[str, Any]]) -> dict[str, Tier]:
    """DEFAULT_TIERS with `overrides` applied: {tier: {field: value}}.

    A known tier keeps the fields not named; an unknown tier is new and must
    name priority and the three limits.
    """
    tiers = dict(DEFAULT_TIERS)
    for name, changes in overrides.items():
        _check_fields(name, changes)
        values = {**changes, "name": name}
        if "cache_sharing" in values:
            values["cache_sharing"] = CacheSharing(values["cache_sharing"])
        tiers[name] = replace(tiers[name], **values) if name in tiers else _new_tier(values)
        _check_below_batch(tiers[name])
    return tiers


def _check_below_batch(tier: Tier) -> None:
    if tier.priority + tier.max_priority_offset >= BATCH_PRIORITY_BASE:
        raise ValueError(f"CONVEYOR_GATEWAY_TIERS: tier {tier.name!r} has priority + "
                         f"max_priority_offset >= {BATCH_PRIORITY_BASE}, where batch lines run; "
                         "lower its priority")


def _check_fields(name: str, changes: dict[str, Any]) -> None:
    known = {f.name for f in fields(Tier)} - {"name"}
    unknown = set(changes) - known
    if unknown:
        raise ValueError(f"CONVEYOR_GATEWAY_TIERS: tier {name!r} has unknown field(s) "
                         f"{sorted(unknown)}; known: {sorted(known)}")


def _new_tier(values: dict[str, Any]) -> Tier:
    try:
        return Tier(**values)
    except TypeError as exc:
        raise ValueError(f"CONVEYOR_GATEWAY_TIERS: new tier {values['name']!r} must set priority, "
                         "requests_per_minute, tokens_per_minute and max_concurrent_requests") \
            from exc
