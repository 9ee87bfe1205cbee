"""The live replicas of one stateless service (tokenizer, detok), and calls balanced
over them: the one piece of discovery and balancing every such client uses.

Discovery is the Redis service registry the replicas heartbeat into
(`service_registry`): it is re-read every `refresh_s` in the background, so a
replica that registers gets calls within `refresh_s` and one that deregisters
(drain) or stops beating (crash, SIGSTOP, cut link: gone after its TTL) stops
getting new ones. While none is registered, or Redis could not be read yet, the
static addresses stand in (local runs, single-replica setups).

Picking is round robin over the live replicas, minus those a call just failed
to reach (UNAVAILABLE, or a deadline on a peer that stopped answering): those
are left out for `unreachable_for_s`, so the next calls move on at once instead
of waiting for the registry entry to expire. Channels carry keepalive
(`grpc_client.Keepalive`), which turns a peer that vanished without a reset
into UNAVAILABLE within a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from redis.exceptions import RedisError

from conveyor.common.grpc_client import DEFAULT_KEEPALIVE, Channels, Keepalive, is_serving
from conveyor.common.left_out import LeftOut
from conveyor.common.service_registry import DEFAULT_TTL_S, ReplicaEntry, ServiceRegistry

log = logging.getLogger("conveyor.replicas")

T = TypeVar("T")

FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Status codes that mean "this replica did not answer": the call is tried on another."""

LIST_TIMEOUT_S = 2.0
"""Longest one read of the registry may take (a hung Redis keeps the last list)."""

RETIRE_AFTER_S = 900.0
"""A channel to a replica that left the registry is closed this long after it left, so
calls and streams still on it (a draining replica's) end first."""


LOCAL_SEND_FAILURE = 'Failed "execute_batch"'
"""How grpc's client starts the debug string of the INTERNAL it sets when sending a
message fails in its core (the transport under a client-streaming call went away, e.g.
a replica stopping while tokens go out): the replica's failure, not an answer of its."""


def is_replica_failure(error: grpc.aio.AioRpcError) -> bool:
    """True when `error` says the replica, not the request, failed."""
    return error.code() in FAILOVER_CODES or (
        error.code() == grpc.StatusCode.INTERNAL
        and (error.debug_error_string() or "").startswith(LOCAL_SEND_FAILURE))


def no_replica_error(service: str) -> grpc.aio.AioRpcError:
    """The UNAVAILABLE a call gets when there is no replica left to try."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details=f"no {service} replica to call")


@dataclass(slots=True, frozen=True)
class Replica:
    """One replica: its address and the channel to it (shared, never closed by callers)."""

    address: str
    channel: grpc.aio.Channel


class ReplicaSet:
    """Channels to the live replicas of `service`, picked round robin.

    The background refresh starts with the first pick (it needs a running loop);
    `close()` stops it and closes every channel opened. `on_pick(address)` is told
    of every pick (metrics).
    """

    def __init__(self, service: str, registry: ServiceRegistry[ReplicaEntry] | None,
                 static_addresses: Sequence[str], *, refresh_s: float = 1.0,
                 unreachable_for_s: float = DEFAULT_TTL_S, max_attempts: int = 3,
                 keepalive: Keepalive = DEFAULT_KEEPALIVE,
                 on_pick: Callable[[str], None] | None = None,
                 retire_after_s: float = RETIRE_AFTER_S):
        if refresh_s <= 0 or max_attempts < 1:
            raise ValueError(f"{service} replicas: refresh_s must be > 0 and max_attempts >= 1")
        self.service = service
        self.max_attempts = max_attempts
        self._registry = registry
        self._static = list(static_addresses)
        self._refresh_s = refresh_s
        self._addresses: list[str] = list(static_addresses)
        self._listed = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None
        self._left_out = LeftOut(unreachable_for_s)
        self._channels = Channels(keepalive)
        self._left_at: dict[str, float] = {}
        self._retire_after_s = retire_after_s
        self._registry_down = False
        self._num_picks = 0
        self._on_pick = on_pick

    async def live_addresses(self) -> list[str]:
        """The replicas as last listed (waits for the first listing)."""
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_forever(),
                                                  name=f"replicas-{self.service}")
        await self._listed.wait()
        return list(self._addresses)

    async def pick(self, exclude: Collection[str] = ()) -> Replica:
        """The next replica round robin, skipping `exclude` and those marked unreachable
        (unless only those are left); UNAVAILABLE when every live one is excluded."""
        live = [a for a in await self.live_addresses() if a not in exclude]
        reachable = [a for a in live if a not in self._left_out]
        candidates = reachable or live
        if not candidates:
            raise no_replica_error(self.service)
        address = candidates[self._num_picks % len(candidates)]
        self._num_picks += 1
        if self._on_pick is not None:
            self._on_pick(address)
        return Replica(address, self._channels.channel(address))

    def mark_unreachable(self, address: str) -> None:
        """A call could not reach `address`: pick around it for `unreachable_for_s`."""
        self._left_out.mark(address)

    async def call(self, rpc: Callable[[grpc.aio.Channel], Awaitable[T]]) -> T:
        """`rpc(channel)` on one replica; when that replica fails (FAILOVER_CODES), on
        another, up to `max_attempts` replicas. Other errors are raised at once."""
        tried: list[str] = []
        while True:
            replica = await self.pick(exclude=tried)
            try:
                return await rpc(replica.channel)
            except grpc.aio.AioRpcError as error:
                if not is_replica_failure(error):
                    raise
                tried.append(replica.address)
                num_left = min(self.max_attempts, len(await self.live_addresses())) - len(tried)
                if num_left <= 0:
                    self.mark_unreachable(replica.address)
                    raise
                self.failed(replica.address, error)

    def failed(self, address: str, error: grpc.aio.AioRpcError) -> None:
        """Log a replica failure and mark the replica unreachable."""
        log.warning("%s replica %s failed (%s: %s): trying another", self.service, address,
                    error.code().name, error.details())
        self.mark_unreachable(address)

    @property
    def open_addresses(self) -> set[str]:
        """Replicas with an open channel (live ones, and those that left less than
        `retire_after_s` ago)."""
        return set(self._channels.addresses)

    async def is_serving(self, timeout_s: float) -> bool:
        """True when some live replica reports SERVING."""
        for address in await self.live_addresses():
            if await is_serving(self._channels.channel(address), timeout_s=timeout_s):
                return True
        return False

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await self._channels.close()

    async def _refresh_forever(self) -> None:
        while True:
            await self._refresh()
            self._listed.set()
            await asyncio.sleep(self._refresh_s)

    async def _refresh(self) -> None:
        if self._registry is None:
            return
        try:
            entries = await asyncio.wait_for(self._registry.list_live(), LIST_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._registry_down:
                log.warning("cannot read the %s registry (%s): keeping %s until it can be "
                            "read", self.service, exc, self._addresses)
            self._registry_down = True
            return
        self._registry_down = False
        addresses = [e.address for e in entries] or self._static
        if addresses != self._addresses:
            log.info("%s replicas: %s", self.service, ", ".join(addresses) or "none")
        self._addresses = addresses
        await self._retire_channels()

    async def _retire_channels(self) -> None:
        """Close the channels of replicas gone from the list for `retire_after_s`."""
        now = asyncio.get_running_loop().time()
        live = set(self._addresses)
        for address in self._channels.addresses:
            if address in live:
                self._left_at.pop(address, None)
            elif now - self._left_at.setdefault(address, now) >= self._retire_after_s:
                del self._left_at[address]
                await self._channels.close_one(address)
