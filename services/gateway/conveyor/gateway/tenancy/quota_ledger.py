"""Quotas (`AdmissionControl`): `admit` reserves, in one Lua script (see admission_lua),
one request against requests-per-minute, prompt tokens + max_tokens against
tokens-per-minute and a concurrency slot, or refuses with the limit that refused and
when to retry. `settle` returns the tokens the request did not use and its slot; it
is idempotent, so every exit path may call it without double refunds.

Redis keys (the {tenant} hash tag keeps one tenant's keys in one cluster slot):

    {prefix}:quota:{tenant}:requests       STRING  GCRA TAT of requests, ms
    {prefix}:quota:{tenant}:tokens         STRING  GCRA TAT of tokens, ms
    {prefix}:quota:{tenant}:concurrency    ZSET    request_id -> lease expiry, ms
    {prefix}:quota:{tenant}:rsv:{request}  HASH    tokens reserved, ms per token"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses
from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.tenancy import admission_lua
from conveyor.gateway.tenancy.api_keys import Tenant
from conveyor.gateway.tenancy.errors import (
    RateLimited,
    RequestTooLarge,
)
from conveyor.gateway.tenancy.tiers import Tier
from conveyor.gateway.tenancy.timeline import TimelineWrite


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
