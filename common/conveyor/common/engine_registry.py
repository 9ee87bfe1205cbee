"""The engine registry: which engine replicas are alive, where, and how loaded.

Engines write, gateways read: the service registry (`service_registry`) under
the service name "engines", with entries that carry each engine's load. Each
engine publishes a heartbeat (its id, gRPC address, model, current load, and the
facts gateways must agree with: block size and max_model_len) every `interval_s`;
an entry whose engine stopped beating is dropped `ttl_s` after its last heartbeat.

Redis layout (all under one `prefix`, default "conveyor"):

    {prefix}:engines:entries    HASH  engine_id -> JSON {address, model, load, max_loras,
                                                block_size, max_model_len}
    {prefix}:engines:deadlines  ZSET  engine_id -> Redis-clock ms when it expires

The Redis client must be created with `decode_responses=True`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from conveyor.common.service_registry import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TTL_S,
    Heartbeat,
    ServiceRegistry,
    require_decoded_responses,
)

if TYPE_CHECKING:
    from conveyor.v1 import engine_pb2

__all__ = ["DEFAULT_INTERVAL_S", "DEFAULT_TTL_S", "EngineEntry", "EngineHeartbeat",
           "EngineLoad", "EngineRegistry", "require_decoded_responses"]

SERVICE = "engines"
DEFAULT_BLOCK_SIZE = 16
"""The engine's default CONVEYOR_ENGINE_BLOCK_SIZE: an entry without a block size has it."""


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """An engine's load as its Stats answers it (`from_stats`): at its last heartbeat
    (registry), or as the gateway's static engines asked. The one load type of every
    service."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0-1."""
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_waiting_tokens: int = 0
    """Tokens the waiting requests still have to compute."""
    max_num_waiting_seqs: int = 0
    """The engine's waiting-queue bounds (0: no limit): past them it sheds with
    RESOURCE_EXHAUSTED, reason queue_full."""
    max_num_waiting_tokens: int = 0
    lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters the engine holds in memory (a request naming one
    starts without loading it)."""

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def is_waiting_full(self) -> bool:
        """One more waiting request would pass a bound (as of this snapshot)."""
        return 0 < self.max_num_waiting_seqs <= self.num_waiting or \
            0 < self.max_num_waiting_tokens <= self.num_waiting_tokens

    @classmethod
    def from_stats(cls, message: engine_pb2.EngineStats) -> EngineLoad:
        """The load of an engine's Stats answer (engine.proto's EngineStats, whose field
        names these are): the one conversion, for the engine's heartbeat and the gateway's
        static engines alike, so both see every field."""
        return cls.from_dict({f.name: getattr(message, f.name) for f in fields(cls)})

    @classmethod
    def from_dict(cls, data: dict) -> EngineLoad:
        """Known fields only, so an entry written by a newer engine still reads (and one
        of an older engine, without the newer fields, too); JSON lists become tuples."""
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        if "lora_adapters" in known:
            known["lora_adapters"] = tuple(known["lora_adapters"])
        return cls(**known)


@dataclass(slots=True, frozen=True)
class EngineEntry:
    """One live engine replica as the registry knows it."""

    engine_id: str
    address: str
    """host:port of its gRPC server."""
    model: str
    load: EngineLoad = field(default_factory=EngineLoad)
    max_loras: int = 0
    """Most distinct LoRA adapters it runs in one step; 0: it serves no adapters (as
    every engine that predates them)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block (its CONVEYOR_ENGINE_BLOCK_SIZE): routers hash prefix hints
    in blocks of it."""
    max_model_len: int | None = None
    """Longest sequence it serves, prompt + output (its CONVEYOR_ENGINE_MAX_MODEL_LEN,
    else the model's); None: not published (an engine that predates publishing it)."""

    @property
    def serves_adapters(self) -> bool:
        return self.max_loras > 0

    @property
    def entry_id(self) -> str:
        return self.engine_id

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EngineEntry:
        data = json.loads(text)
        return cls(data["engine_id"], data["address"], data["model"],
                   EngineLoad.from_dict(data["load"]), data.get("max_loras", 0),
                   data.get("block_size", DEFAULT_BLOCK_SIZE), data.get("max_model_len"))


class EngineRegistry(ServiceRegistry[EngineEntry]):
    """Engines register and heartbeat here; routers list the live ones."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = DEFAULT_TTL_S):
        super().__init__(redis, service=SERVICE, entry_type=EngineEntry, prefix=prefix,
                         ttl_s=ttl_s)


class EngineHeartbeat(Heartbeat[EngineEntry]):
    """Publishes one engine's `entry`, with the load `read_load` reads, every `interval_s`."""

    def __init__(self, registry: EngineRegistry, entry: EngineEntry,
                 read_load: Callable[[], EngineLoad], interval_s: float = DEFAULT_INTERVAL_S):
        super().__init__(registry, lambda: replace(entry, load=read_load()), interval_s)
        self._engine_id = entry.engine_id

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def entry_id(self) -> str:
        return self._engine_id
