"""The catalog of LoRA adapters: name -> folder (as the engines see it) and owner, in Redis,
shared by every gateway replica.

    {prefix}:lora:adapters   HASH  name -> JSON {"path", "tenant" (null: every tenant's),
                                   "created_at"}
    {prefix}:lora:seeded     SET   names of the static adapters (CONVEYOR_GATEWAY_LORA_MODULES)
                                   some gateway already added

Static adapters are added the first time any gateway uses the catalog with them in its
settings (`seed`, one script); an admin may unload one like any other, and it stays
unloaded when gateways restart, until it is loaded again. A changed path in the
setting for a name already seeded is not applied: unload and load it instead.

A gateway reads the whole catalog at most once per `max_age_s`, shared by its requests;
a name missing from that listing is looked up in Redis before it counts as unknown, so
an adapter loaded through any replica is usable at once everywhere, while one unloaded
elsewhere may still be used here for up to max_age_s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.common.engine_registry import require_decoded_responses
from conveyor.gateway.clients.engine import LoraAdapter

log = logging.getLogger("conveyor.gateway.lora")

_NAME = re.compile(r"[^\s,=]{1,128}")

_SEED_LUA = """
-- KEYS: 1 the adapters, 2 the names seeded; ARGV: name, record, name, record, ...
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    added = added + redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return added
"""


def check_adapter_name(name: str) -> str:
    """An adapter's name: 1-128 characters, no whitespace, ',' or '='."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"LoRA adapter name {name!r} must be 1-128 characters without "
                         "whitespace, ',' or '='")
    return name


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """One adapter of the catalog."""

    name: str
    path: str
    """Its folder, as the engines see their file system."""
    tenant_id: str | None = None
    """The one tenant that may use and see it; None: every tenant."""
    created_at: float = 0.0
    """Unix seconds when it entered the catalog."""

    @property
    def adapter(self) -> LoraAdapter:
        return LoraAdapter(self.name, self.path)

    def is_visible_to(self, tenant_id: str | None) -> bool:
        """Whether `tenant_id` may use it (None: a caller without a key sees public ones)."""
        return self.tenant_id is None or self.tenant_id == tenant_id

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "tenant": self.tenant_id,
                           "created_at": self.created_at}, separators=(",", ":"))

    @classmethod
    def from_json(cls, name: str, text: str) -> AdapterRecord:
        data = json.loads(text)
        return cls(name, data["path"], data.get("tenant"), data.get("created_at", 0.0))


class LoraCatalog:
    """Adapters by name, in Redis (see the module doc); safe to share by all requests."""

    def __init__(self, redis: Redis, static: dict[str, str] | None = None, *,
                 prefix: str = "conveyor", max_age_s: float = 1.0):
        require_decoded_responses(redis)
        self._redis = redis
        self._static = dict(static or {})
        self._key = f"{prefix}:lora:adapters"
        self._seeded_key = f"{prefix}:lora:seeded"
        self._seed = redis.register_script(_SEED_LUA)
        self._is_seeded = not self._static
        self._max_age_s = max_age_s
        self._listed: dict[str, AdapterRecord] | None = None
        self._listed_at = float("-inf")
        self._fetch: asyncio.Future[None] | None = None

    async def get(self, name: str) -> AdapterRecord | None:
        """The adapter named `name`, or None."""
        record = (await self._listing()).get(name)
        if record is None:  # maybe loaded through another gateway since the listing
            text = await self._redis.hget(self._key, name)
            record = None if text is None else AdapterRecord.from_json(name, text)
        return record

    async def list(self) -> list[AdapterRecord]:
        """Every adapter, by name."""
        return sorted((await self._listing()).values(), key=lambda r: r.name)

    async def add(self, record: AdapterRecord) -> bool:
        """Add `record`; False (nothing changed) when its name is taken."""
        await self._ensure_seeded()
        added = await self._redis.hsetnx(self._key, record.name, record.to_json())
        self._listed_at = float("-inf")
        return bool(added)

    async def remove(self, name: str) -> bool:
        """Remove adapter `name`; False when there is none."""
        await self._ensure_seeded()
        removed = await self._redis.hdel(self._key, name)
        self._listed_at = float("-inf")
        return bool(removed)

    async def _ensure_seeded(self) -> None:
        """Add the static adapters never added before (once per gateway process)."""
        if self._is_seeded:
            return
        now = time.time()
        args = [part for name, path in self._static.items()
                for part in (name, AdapterRecord(name, path, None, now).to_json())]
        await self._seed(keys=[self._key, self._seeded_key], args=args)
        self._is_seeded = True

    async def _listing(self) -> dict[str, AdapterRecord]:
        """The catalog, at most max_age_s old (while Redis is unavailable: the last one
        read, else RedisError); one fetch at a time for all callers."""
        if time.monotonic() - self._listed_at >= self._max_age_s:
            if self._fetch is None or self._fetch.done():
                self._fetch = asyncio.ensure_future(self._read_all())
            # Shielded: a request that is cancelled must not cancel the shared fetch.
            await asyncio.shield(self._fetch)
        return self._listed or {}

    async def _read_all(self) -> None:
        try:
            await self._ensure_seeded()
            rows = await self._redis.hgetall(self._key)
        except RedisError as error:
            if self._listed is None:
                raise
            log.warning("LoRA catalog unavailable, using what it listed last: %s", error)
        else:
            self._listed = {name: AdapterRecord.from_json(name, text)
                            for name, text in rows.items()}
        self._listed_at = time.monotonic()
