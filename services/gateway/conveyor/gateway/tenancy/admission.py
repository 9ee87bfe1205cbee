"""Admission of a request: who it is billed to, its engine priority, and its quota.

`TenantAdmitter.authenticate(headers) -> Tenant` (an API key, a batch worker's line,
or the anonymous tenant when auth is off), then `admission(tenant, num_prompt_tokens,
max_tokens) -> TenantAdmission` (no I/O yet): its owner registers `settle` first and
only then `reserve`s, so a reservation whose reply was lost to a cancellation is still
settled (settling is idempotent and by id). `admit` does both steps at once.

Priority: a request's optional `priority` field is an offset from its tier's
priority: 0 (the default) runs at the tier's priority, a larger value later. A
request can never run ahead of its tier, and can go at most
`tier.max_priority_offset` behind it.

The quota ledger is quota_ledger.py's; batch lines' admission is batch_lines.py's."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from conveyor.common.batch_store import BatchStore
from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.tenancy.api_keys import ANONYMOUS_TENANT, ApiKeyStore, Tenant, bearer_key
from conveyor.gateway.tenancy.batch_lines import BATCH_ID_HEADER, BatchIdentity, BatchQuota
from conveyor.gateway.tenancy.errors import (
    PriorityNotAllowed,
)
from conveyor.gateway.tenancy.quota_ledger import NO_QUOTA, AdmissionControl, Reservation
from conveyor.gateway.tenancy.settings import TenancySettings
from conveyor.gateway.tenancy.tiers import Tier
from conveyor.gateway.tenancy.timeline import TimelineWrite


def engine_priority(tier: Tier, requested: int | None = None) -> int:
    """tier.priority + requested; PriorityNotAllowed (400) outside 0..max_priority_offset."""
    offset = 0 if requested is None else requested
    if not 0 <= offset <= tier.max_priority_offset:
        raise PriorityNotAllowed(
            f"priority must be between 0 (the default) and {tier.max_priority_offset} for tier "
            f"{tier.name!r}; larger values run later, got {requested}.")
    return tier.priority + offset


class CompletionCount(Protocol):
    """Anything that counts the completion tokens a request produced."""

    completion_tokens: int


@dataclass(slots=True)
class TenantAdmission:
    """A request's admission: `reserve` it, then settle it (`settle_call`) on every way
    out (once is enough, more is harmless, and settling one that was never reserved is a
    no-op)."""

    tenant: Tenant
    reservation: Reservation
    control: AdmissionControl

    @property
    def carries_timeline(self) -> bool:
        """Whether `reserve` and `settle_call` write the timeline they are given."""
        return self.control.carries_timeline

    async def reserve(self, timeline: TimelineWrite | None = None) -> None:
        """Reserve the quota (RateLimited / RequestTooLarge, 429, when it does not fit);
        `timeline` is written with the admission (when it carries timelines)."""
        r = self.reservation
        self.reservation = await self.control.admit(self.tenant, r.request_id,
                                                    r.num_prompt_tokens, r.max_tokens,
                                                    timeline)

    @property
    def rate_limit_headers(self) -> dict[str, str]:
        """x-ratelimit-* to send before the response (stream) starts."""
        return self.reservation.quota.headers()

    def engine_priority(self, requested: int | None) -> int:
        """The engine priority of the request's `priority` field (400 if not allowed)."""
        return engine_priority(self.tenant.tier, requested)

    def settle_call(self, usage: CompletionCount | None,
                    timeline: TimelineWrite | None = None) -> ScriptCall | None:
        """Return the unused tokens and the concurrency slot (and write `timeline`), as a
        script call to run with others in one round trip; None when the admission touches
        no Redis (a batch line). `usage` None means the request never produced output
        (failed or cancelled before the first token): its prompt tokens are returned
        too."""
        num_completion_tokens, refund_prompt = self._spent(usage)
        return self.control.settle_call(self.reservation, num_completion_tokens,
                                        refund_prompt=refund_prompt, timeline=timeline)

    @staticmethod
    def _spent(usage: CompletionCount | None) -> tuple[int, bool]:
        """(completion tokens charged, whether the prompt is refunded)."""
        return (0, True) if usage is None else (usage.completion_tokens, False)


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
        keys = ApiKeyStore(redis, tiers, prefix=settings.redis_prefix,
                           cache_ttl_s=settings.api_key_cache_ttl_s) \
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
        A batch worker's line is its batch's tenant (BatchIdentity)."""
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
