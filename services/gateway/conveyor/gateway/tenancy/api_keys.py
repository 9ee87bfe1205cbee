"""API keys and the tenants they stand for: keys created once, stored only as their
SHA-256, checked in constant time; a `Tenant` is who a request is billed to.

A key is `cvy-` + 43 URL-safe characters (256 random bits). Redis never holds
the key itself, only its digest:

    {prefix}:apikey:{key_id}   HASH  digest, tenant, tier, created_at, redacted, admin
    {prefix}:apikeys           SET   every key_id (for `list`)

`admin` is "1" on a key created as an admin's (`create --admin`): such a key may also
call the admin endpoints (loading LoRA adapters); a record without it is not an
admin's (keys made before the field).

`key_id` is the first 16 hex digits of the digest, so authentication finds the
record by hashing the presented key, then compares the full stored digest with
`hmac.compare_digest`: how long the check takes never depends on how much of
the digest matched. (Knowing 64 bits of a digest of a 256-bit random secret
helps no one guess the secret, so key ids can be listed and logged.)

A gateway keeps each key it found valid for `cache_ttl_s` (one registry heartbeat,
1 s, by default) and checks it against Redis again after that, so a busy key costs
one Redis read per second, not one per request. The price: a key revoked on another
gateway replica (or with the CLI) keeps working there for at most `cache_ttl_s`; the
replica that revokes it forgets it at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.common.engine_registry import require_decoded_responses
from conveyor.gateway.tenancy.errors import (
    InvalidApiKey,
    MissingApiKey,
    TierNotConfigured,
    redact_key,
)
from conveyor.gateway.tenancy.tiers import CacheSharing, Tier

KEY_PREFIX = "cvy-"
_KEY_ID_HEX_DIGITS = 16
_MAX_KNOWN = 100_000
DEFAULT_CACHE_TTL_S = 1.0
"""How long a key found valid is taken on trust (one registry heartbeat interval)."""


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

    `batch_id` is set on a line of a batch (batch_lines.BatchIdentity): the tenant is the
    batch's, its tier the tier's batch form (batch_tier), and its admission does
    not touch the tenant's interactive limits."""

    tenant_id: str
    tier: Tier
    key_id: str | None = None
    batch_id: str | None = None
    is_admin: bool = False
    """Its key is an admin's: it may call the admin endpoints."""

    @property
    def cache_salt(self) -> str:
        """The engine's prefix-cache salt: the tenant's own, or empty to share globally."""
        if self.tier.cache_sharing is CacheSharing.GLOBAL:
            return ""
        return f"tenant:{self.tenant_id}"

    def cache_salt_with(self, request_salt: str | None) -> str:
        """The salt of a request that sent its own (vLLM's cache_salt): the tenant's id and
        the request's salt as a JSON pair, which no tenant's salt alone can equal; a tier
        that shares its cache globally shares none of a salted request's."""
        if request_salt is None:
            return self.cache_salt
        return json.dumps([f"tenant:{self.tenant_id}", request_salt])


def key_digest(key: str) -> str:
    """SHA-256 of the key, hex: the only form of a key that is stored."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(authorization: str | None) -> str:
    """The key in an `Authorization: Bearer <key>` header; MissingApiKey without one."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise MissingApiKey()
    return key.strip()


@dataclass(slots=True, frozen=True)
class ApiKeyRecord:
    """What is stored about a key (never the key)."""

    key_id: str
    tenant_id: str
    tier: str
    created_at: float
    """Unix seconds."""
    redacted: str
    """The key's first and last 4 characters, for people to recognise it."""
    admin: bool = False


@dataclass(slots=True, frozen=True)
class CreatedApiKey:
    """A new key: `key` is shown once and cannot be recovered afterwards."""

    key: str
    record: ApiKeyRecord


@dataclass(slots=True)
class _KnownKey:
    """A key this gateway found valid: its digest, tenant, and when Redis said so."""

    digest: str
    tenant: Tenant
    checked_at: float = field(default_factory=time.monotonic)


class ApiKeyStore:
    """Creates, lists, revokes and checks API keys in Redis."""

    def __init__(self, redis: Redis, tiers: dict[str, Tier], *, prefix: str = "conveyor",
                 cache_ttl_s: float = DEFAULT_CACHE_TTL_S):
        require_decoded_responses(redis)
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s must be >= 0, got {cache_ttl_s}")
        self._redis = redis
        self._tiers = tiers
        self._cache_ttl_s = cache_ttl_s
        self._known: dict[str, _KnownKey] = {}
        """key_id -> keys found valid: trusted for cache_ttl_s, and while Redis is down."""
        self._prefix = prefix

    async def create(self, tenant_id: str, tier: str, *, admin: bool = False) -> CreatedApiKey:
        """A new key for `tenant_id` in `tier`; an admin's when `admin`."""
        check_tenant_id(tenant_id)
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r}; known: {sorted(self._tiers)}")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = key_digest(key)
        record = ApiKeyRecord(digest[:_KEY_ID_HEX_DIGITS], tenant_id, tier, time.time(),
                              redact_key(key), admin)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._record_key(record.key_id), mapping={
                "digest": digest, "tenant": tenant_id, "tier": tier,
                "created_at": repr(record.created_at), "redacted": record.redacted,
                "admin": "1" if admin else "0",
            })
            pipe.sadd(self._index_key, record.key_id)
            await pipe.execute()
        return CreatedApiKey(key, record)

    async def list(self) -> list[ApiKeyRecord]:
        """Every live key, oldest first."""
        key_ids = sorted(await self._redis.smembers(self._index_key))
        async with self._redis.pipeline(transaction=False) as pipe:
            for key_id in key_ids:
                pipe.hgetall(self._record_key(key_id))
            rows = await pipe.execute()
        records = [_record(key_id, row) for key_id, row in zip(key_ids, rows, strict=True) if row]
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    async def revoke(self, key_id: str) -> bool:
        """Delete a key; requests with it fail from now on. False if there was no such key."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._record_key(key_id))
            pipe.srem(self._index_key, key_id)
            deleted, _ = await pipe.execute()
        self._known.pop(key_id, None)
        return bool(deleted)

    async def authenticate(self, key: str) -> Tenant:
        """The tenant of `key`; InvalidApiKey if it is unknown or revoked. A key found
        valid within the last cache_ttl_s passes without a Redis read (so a revocation
        elsewhere takes up to cache_ttl_s to reach this gateway). While Redis cannot be
        reached, a key this gateway saw valid before still passes (a key revoked during
        the outage keeps working until Redis is back); others raise RedisError."""
        digest = key_digest(key)
        key_id = digest[:_KEY_ID_HEX_DIGITS]
        known = self._known.get(key_id)
        if known is not None and not hmac.compare_digest(known.digest, digest):
            known = None
        if known is not None and time.monotonic() - known.checked_at < self._cache_ttl_s:
            return known.tenant
        try:
            row = await self._redis.hgetall(self._record_key(key_id))
        except RedisError:
            if known is None:
                raise
            return known.tenant
        return self._check(key, digest, row)

    def _check(self, key: str, digest: str, row: dict[str, str]) -> Tenant:
        """The tenant of a key whose stored record is `row`, remembered as valid."""
        key_id = digest[:_KEY_ID_HEX_DIGITS]
        if not row or not hmac.compare_digest(row["digest"], digest):
            self._known.pop(key_id, None)
            raise InvalidApiKey(key)
        tier = self._tiers.get(row["tier"])
        if tier is None:
            raise TierNotConfigured(row["tier"])
        tenant = Tenant(row["tenant"], tier, key_id=key_id, is_admin=row.get("admin") == "1")
        if len(self._known) < _MAX_KNOWN or key_id in self._known:
            self._known[key_id] = _KnownKey(digest, tenant)
        return tenant

    @property
    def _index_key(self) -> str:
        return f"{self._prefix}:apikeys"

    def _record_key(self, key_id: str) -> str:
        return f"{self._prefix}:apikey:{key_id}"


def _record(key_id: str, row: dict[str, str]) -> ApiKeyRecord:
    return ApiKeyRecord(key_id, row["tenant"], row["tier"], float(row["created_at"]),
                        row["redacted"], row.get("admin") == "1")
