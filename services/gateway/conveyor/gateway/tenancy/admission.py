"""Admission of a request: who it is billed to, its engine priority, and its quota.

`TenantAdmitter.authenticate(headers) -> Tenant` (an API key, a batch worker's line,
or the anonymous tenant when auth is off), then `admission(tenant, num_prompt_tokens,
max_tokens) -> TenantAdmission` (no I/O yet): its owner registers `settle` first and
only then `reserve`s, so a reservation whose reply was lost to a cancellation is still
settled (settling is idempotent and by id). `admit` does both steps at once.

Quotas (`AdmissionControl`): `admit` reserves, in one Lua script (see admission_lua),
one request against requests-per-minute, prompt tokens + max_tokens against
tokens-per-minute and a concurrency slot, or refuses with the limit that refused and
when to retry. `settle` returns the tokens the request did not use and its slot; it
is idempotent, so every exit path may call it without double refunds.

Redis keys (the {tenant} hash tag keeps one tenant's keys in one cluster slot):

    {prefix}:quota:{tenant}:requests       STRING  GCRA TAT of requests, ms
    {prefix}:quota:{tenant}:tokens         STRING  GCRA TAT of tokens, ms
    {prefix}:quota:{tenant}:concurrency    ZSET    request_id -> lease expiry, ms
    {prefix}:quota:{tenant}:rsv:{request}  HASH    tokens reserved, ms per token

Priority: a request's optional `priority` field is an offset from its tier's
priority: 0 (the default) runs at the tier's priority, a larger value later. A
request can never run ahead of its tier, and can go at most
`tier.max_priority_offset` behind it.

Batch lines: a batch worker sends each line with the internal token
(`Authorization: Bearer <CONVEYOR_GATEWAY_BATCH_TOKEN>`) and the batch's id
(`X-Conveyor-Batch-Id`). The tenant and tier are read from the batch's record in
Redis, never from the worker's headers; their admission (`BatchQuota`) touches none
of the tenant's interactive limits.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from conveyor.common.batch_store import BatchStore
from conveyor.common.engine_registry import require_decoded_responses
from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.tenancy import admission_lua
from conveyor.gateway.tenancy.api_keys import ANONYMOUS_TENANT, ApiKeyStore, Tenant, bearer_key
from conveyor.gateway.tenancy.errors import (
    InvalidApiKey,
    PriorityNotAllowed,
    RateLimited,
    RequestTooLarge,
    TenancyError,
    TierNotConfigured,
)
from conveyor.gateway.tenancy.settings import TenancySettings
from conveyor.gateway.tenancy.tiers import Tier, batch_tier
from conveyor.gateway.tenancy.timeline import TimelineWrite

# -- priority ----------------------------------------------------------------------------

def engine_priority(tier: Tier, requested: int | None = None) -> int:
    """tier.priority + requested; PriorityNotAllowed (400) outside 0..max_priority_offset."""
    offset = 0 if requested is None else requested
    if not 0 <= offset <= tier.max_priority_offset:
        raise PriorityNotAllowed(
            f"priority must be between 0 (the default) and {tier.max_priority_offset} for tier "
            f"{tier.name!r}; larger values run later, got {requested}.")
    return tier.priority + offset


# -- quota snapshots ---------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class QuotaSnapshot:
    """Limits and what is left of them; None for an unlimited tier's limit.

    `reset_*_s` is how long until the limit is fully replenished (OpenAI's
    meaning of x-ratelimit-reset-*).
    """

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float
    num_concurrent: int
    """Requests of the tenant in flight, this one included when admitted."""

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (those of unlimited limits left out)."""
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        return headers


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes it in reset headers: 250ms, 12s, 1.5s, 6m0s, 1h2m3s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 3):g}s"
    if minutes or hours:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


NO_QUOTA = QuotaSnapshot(None, None, 0.0, None, None, 0.0, 0)
"""The snapshot of a reservation not made yet (no headers)."""


# -- quota ledger ------------------------------------------------------------------------

_ADMITTED, _REFUSED, _TOO_LARGE, _DUPLICATE = 1, 0, -1, -2
_LIMIT_NAMES = {"requests": "requests per minute (RPM)", "tokens": "tokens per minute (TPM)",
                "concurrency": "concurrent requests"}


@dataclass(slots=True, frozen=True)
class Reservation:
    """What `admit` reserved for one request; hand it back to `settle`."""

    request_id: str
    tenant_id: str
    num_prompt_tokens: int
    max_tokens: int
    quota: QuotaSnapshot
    """The tenant's quota right after this admission (for x-ratelimit-* headers)."""

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


class AdmissionControl:
    """The Redis-backed quota ledger every gateway replica shares. Its scripts carry
    the request's timeline (`timeline`), so admitting and settling are one round trip
    each, timeline included."""

    carries_timeline = True

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", period_s: float = 60.0,
                 reservation_ttl_s: float = 900.0):
        require_decoded_responses(redis)
        if period_s <= 0 or reservation_ttl_s <= 0:
            raise ValueError("period_s and reservation_ttl_s must be > 0")
        self._prefix = prefix
        self._period_ms = period_s * 1000
        self._lease_ms = reservation_ttl_s * 1000
        self._admit = redis.register_script(admission_lua.ADMIT)
        self._settle = redis.register_script(admission_lua.SETTLE)

    async def admit(self, tenant: Tenant, request_id: str, num_prompt_tokens: int,
                    max_tokens: int, timeline: TimelineWrite | None = None) -> Reservation:
        """Reserve the request or raise RateLimited / RequestTooLarge; nothing is
        reserved when it raises. `request_id` must be generated by the gateway
        (unique per request), never taken from the client. `timeline` (a timeline of
        `tenant`'s) is written in the same script when the request is admitted."""
        if num_prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("token counts must be >= 0")
        tier = tenant.tier
        keys, args = self._admit_keys(tenant.tenant_id, request_id), [
            request_id, self._period_ms, tier.requests_per_minute or 0,
            tier.tokens_per_minute or 0, tier.max_concurrent_requests or 0,
            num_prompt_tokens + max_tokens, self._lease_ms,
        ]
        if timeline is not None:
            keys, args = [*keys, timeline.key], [*args, *timeline.args]
        reply = await self._admit(keys=keys, args=args)
        status, refused_limit, retry_after_ms = int(reply[0]), reply[1], int(reply[2])
        quota = self._snapshot(tier, reply)
        if status == _DUPLICATE:
            raise ValueError(f"request id {request_id!r} is already admitted and not settled")
        if status == _TOO_LARGE:
            raise RequestTooLarge(
                f"Request too large: {num_prompt_tokens} prompt tokens + max_tokens {max_tokens} "
                f"exceed the {tier.tokens_per_minute} tokens per minute of tier {tier.name!r}; "
                "lower max_tokens or shorten the prompt.")
        if status == _REFUSED:
            raise _rate_limited(tier, refused_limit, retry_after_ms / 1000, quota)
        return Reservation(request_id, tenant.tenant_id, num_prompt_tokens, max_tokens, quota)

    async def settle(self, reservation: Reservation, num_completion_tokens: int, *,
                     refund_prompt: bool = False,
                     timeline: TimelineWrite | None = None) -> int | None:
        """Return the unused tokens (max_tokens - num_completion_tokens, plus the
        prompt's when `refund_prompt`, for a request that never reached an engine)
        and the concurrency slot, and write `timeline`. Returns the tokens returned, or
        None when this reservation was already settled (or its lease ran out): safe to
        call twice."""
        call = self.settle_call(reservation, num_completion_tokens,
                                refund_prompt=refund_prompt, timeline=timeline)
        return settled_tokens(await call.script(keys=call.keys, args=call.args))

    def settle_call(self, reservation: Reservation, num_completion_tokens: int, *,
                    refund_prompt: bool = False,
                    timeline: TimelineWrite | None = None) -> ScriptCall:
        """`settle` as a script call, to run in one round trip with others
        (common.redis_scripts); `settled_tokens` reads its reply."""
        unused = max(0, reservation.max_tokens - num_completion_tokens)
        if refund_prompt:
            unused += reservation.num_prompt_tokens
        keys = self._admit_keys(reservation.tenant_id, reservation.request_id)[1:]
        args = [reservation.request_id, unused, self._lease_ms]
        if timeline is not None:
            keys, args = [*keys, timeline.key], [*args, *timeline.args]
        return ScriptCall(self._settle, keys, args)

    def _admit_keys(self, tenant_id: str, request_id: str) -> list[str]:
        base = f"{self._prefix}:quota:{{{tenant_id}}}"
        return [f"{base}:requests", f"{base}:tokens", f"{base}:concurrency",
                f"{base}:rsv:{request_id}"]

    @staticmethod
    def _snapshot(tier: Tier, reply: list) -> QuotaSnapshot:
        req_remaining, req_reset_ms, tok_remaining, tok_reset_ms, concurrent = map(int, reply[3:])
        return QuotaSnapshot(
            tier.requests_per_minute, None if req_remaining < 0 else req_remaining,
            req_reset_ms / 1000, tier.tokens_per_minute,
            None if tok_remaining < 0 else tok_remaining, tok_reset_ms / 1000, concurrent)


def settled_tokens(reply: int | str) -> int | None:
    """The tokens a SETTLE returned, None when there was nothing to settle."""
    returned = int(reply)
    return None if returned < 0 else returned


def _rate_limited(tier: Tier, limit: str, retry_after_s: float,
                  quota: QuotaSnapshot) -> RateLimited:
    value = {"requests": tier.requests_per_minute, "tokens": tier.tokens_per_minute,
             "concurrency": tier.max_concurrent_requests}[limit]
    message = (f"Rate limit reached on {_LIMIT_NAMES[limit]} of tier {tier.name!r}: limit "
               f"{value}. Please try again in {retry_after_s:.1f}s.")
    return RateLimited(message, limit, retry_after_s, quota.headers())


# -- batch lines -------------------------------------------------------------------------

class BatchQuota:
    """AdmissionControl's interface, touching no quota (nor Redis: it carries no
    timeline, which its request writes on its own)."""

    carries_timeline = False

    async def admit(self, tenant: Tenant, request_id: str, num_prompt_tokens: int,
                    max_tokens: int, timeline: TimelineWrite | None = None) -> Reservation:
        return Reservation(request_id, tenant.tenant_id, num_prompt_tokens, max_tokens,
                           NO_QUOTA)

    async def settle(self, reservation: Reservation, num_completion_tokens: int, *,
                     refund_prompt: bool = False,
                     timeline: TimelineWrite | None = None) -> int | None:
        return None

    def settle_call(self, reservation: Reservation, num_completion_tokens: int, *,
                    refund_prompt: bool = False,
                    timeline: TimelineWrite | None = None) -> ScriptCall | None:
        return None



BATCH_ID_HEADER = "x-conveyor-batch-id"


class BatchLinesRefused(TenancyError):
    """A batch line reached a gateway whose batch token is not set."""

    status_code = 401
    code = "batch_lines_refused"

    def __init__(self) -> None:
        super().__init__("This gateway takes no batch lines: CONVEYOR_GATEWAY_BATCH_TOKEN is "
                         "not set.")


class UnknownBatch(TenancyError):
    status_code = 404
    error_type = "not_found_error"
    code = "batch_not_found"

    def __init__(self, batch_id: str):
        super().__init__(f"No batch {batch_id!r} to run a line of.")


class BatchIdentity:
    """Turns a worker's batch-line headers into the batch's tenant."""

    def __init__(self, token: str, batches: BatchStore, tiers: dict[str, Tier]):
        self._token = token
        self._batches = batches
        self._tiers = tiers

    async def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        if not self._token:
            raise BatchLinesRefused()
        key = bearer_key(headers.get("authorization"))
        if not hmac.compare_digest(key.encode(), self._token.encode()):
            raise InvalidApiKey(key)
        batch_id = headers[BATCH_ID_HEADER]
        record = await self._batches.get(batch_id)
        if record is None:
            raise UnknownBatch(batch_id)
        tier = self._tiers.get(record.tier)
        if tier is None:
            raise TierNotConfigured(record.tier)
        return Tenant(record.tenant_id, batch_tier(tier), batch_id=batch_id)


# -- the admitter ------------------------------------------------------------------------

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
