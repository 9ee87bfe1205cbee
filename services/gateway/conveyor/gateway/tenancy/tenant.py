"""A tenant: who a request is billed to, with its tier."""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.gateway.tenancy.tiers import CacheSharing, Tier

ANONYMOUS_TENANT = "anonymous"
"""The tenant of every request when auth is off."""

_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant_id(tenant_id: str) -> str:
    """Tenant ids go into Redis keys: letters, digits, '_', '.', '-', at most 64."""
    if not _TENANT_ID.fullmatch(tenant_id):
        raise ValueError(f"tenant id {tenant_id!r} must be 1-64 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return tenant_id


@dataclass(slots=True, frozen=True)
class Tenant:
    """An authenticated caller. `key_id` is None for the anonymous tenant.

    `batch_id` is set on a line of a batch (batch_identity): the tenant is the
    batch's, its tier the tier's batch form (batch_tier), and its admission does
    not touch the tenant's interactive limits."""

    tenant_id: str
    tier: Tier
    key_id: str | None = None
    batch_id: str | None = None

    @property
    def cache_salt(self) -> str:
        """The engine's prefix-cache salt: the tenant's own, or empty to share globally."""
        if self.tier.cache_sharing is CacheSharing.GLOBAL:
            return ""
        return f"tenant:{self.tenant_id}"
