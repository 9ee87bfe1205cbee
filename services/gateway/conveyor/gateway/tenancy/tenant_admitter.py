"""The gateway's auth/admit seam over Redis (the generation endpoint calls it).

`authenticate(headers) -> Tenant`, then `admission(tenant, num_prompt_tokens,
max_tokens) -> TenantAdmission` (no I/O yet): its owner registers `settle` first and
only then `reserve`s, so a reservation whose reply was lost to a cancellation is still
settled (settling is idempotent and by id). `admit` does both steps at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from conveyor.common.batch_store import BatchStore
from conveyor.gateway.tenancy.admission_control import AdmissionControl, Reservation
from conveyor.gateway.tenancy.api_keys import ApiKeyStore, bearer_key
from conveyor.gateway.tenancy.batch_identity import BATCH_ID_HEADER, BatchIdentity
from conveyor.gateway.tenancy.batch_quota import BatchQuota
from conveyor.gateway.tenancy.priority import engine_priority
from conveyor.gateway.tenancy.quota_snapshot import NO_QUOTA
from conveyor.gateway.tenancy.settings import TenancySettings
from conveyor.gateway.tenancy.tenant import ANONYMOUS_TENANT, Tenant


class CompletionCount(Protocol):
    """Anything that counts the completion tokens a request produced."""

    completion_tokens: int


@dataclass(slots=True)
class TenantAdmission:
    """A request's admission: `reserve` it, then `settle` on every way out (once is
    enough, more is harmless, and settling one that was never reserved is a no-op)."""

    tenant: Tenant
    reservation: Reservation
    control: AdmissionControl

    async def reserve(self) -> None:
        """Reserve the quota (RateLimited / RequestTooLarge, 429, when it does not fit)."""
        r = self.reservation
        self.reservation = await self.control.admit(self.tenant, r.request_id,
                                                    r.num_prompt_tokens, r.max_tokens)

    @property
    def rate_limit_headers(self) -> dict[str, str]:
        """x-ratelimit-* to send before the response (stream) starts."""
        return self.reservation.quota.headers()

    def engine_priority(self, requested: int | None) -> int:
        """The engine priority of the request's `priority` field (400 if not allowed)."""
        return engine_priority(self.tenant.tier, requested)

    async def settle(self, usage: CompletionCount | None) -> None:
        """Return the unused tokens and the concurrency slot. `usage` None means the
        request never produced output (failed or cancelled before the first
        token): its prompt tokens are returned too."""
        if usage is None:
            await self.control.settle(self.reservation, 0, refund_prompt=True)
        else:
            await self.control.settle(self.reservation, usage.completion_tokens)


class TenantAdmitter:
    """API key -> tenant, then quota admission, both shared by all gateway replicas."""

    def __init__(self, keys: ApiKeyStore | None, control: AdmissionControl, anonymous: Tenant,
                 batch: BatchIdentity | None = None):
        self._keys = keys
        self._control = control
        self._anonymous = anonymous
        self._batch = batch

    @classmethod
    def from_settings(cls, redis: Redis, settings: TenancySettings) -> TenantAdmitter:
        """Keys are checked when settings.auth_enabled; otherwise every request is
        the anonymous tenant of settings.anonymous_tier."""
        tiers = settings.tier_table
        keys = ApiKeyStore(redis, tiers, prefix=settings.redis_prefix) \
            if settings.auth_enabled else None
        control = AdmissionControl(redis, prefix=settings.redis_prefix,
                                   period_s=settings.quota_period_s,
                                   reservation_ttl_s=settings.reservation_ttl_s)
        batch = BatchIdentity(settings.batch_token,
                              BatchStore(redis, prefix=settings.redis_prefix), tiers)
        return cls(keys, control, Tenant(ANONYMOUS_TENANT, tiers[settings.anonymous_tier]),
                   batch)

    @property
    def auth_enabled(self) -> bool:
        return self._keys is not None

    async def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        """The caller's tenant; MissingApiKey / InvalidApiKey (401) when auth is on.
        A batch worker's line is its batch's tenant (batch_identity)."""
        if self._batch is not None and BATCH_ID_HEADER in headers:
            return await self._batch.authenticate(headers)
        if self._keys is None:
            return self._anonymous
        return await self._keys.authenticate(bearer_key(headers.get("authorization")))

    def admission(self, tenant: Tenant, num_prompt_tokens: int,
                  max_tokens: int) -> TenantAdmission:
        """The request's admission under a fresh reservation id, not reserved yet."""
        reservation = Reservation(f"rsv-{uuid.uuid4().hex}", tenant.tenant_id,
                                  num_prompt_tokens, max_tokens, NO_QUOTA)
        control = BatchQuota() if tenant.batch_id else self._control
        return TenantAdmission(tenant, reservation, control)

    async def admit(self, tenant: Tenant, num_prompt_tokens: int,
                    max_tokens: int) -> TenantAdmission:
        """Reserve the request's quota; RateLimited / RequestTooLarge (429) if it
        does not fit now."""
        admission = self.admission(tenant, num_prompt_tokens, max_tokens)
        await admission.reserve()
        return admission
