"""When an engine is too busy to take a request (`LoadPolicy`), and the prompt's prefix
hashes its hints are kept under (`prefix_block_hashes`, in blocks of `hint_block_size`).

Prefix hints hash a prompt's leading full blocks chained like the engine's block
hashes (block i's hash covers the cache salt and every token up to the end of block
i), so equal hashes mean equal prefixes within one salt: tenants with different salts
never share hints, as they never share cached blocks. The adapter's name is part of the
salt for the same reason (a prompt under another adapter, or the base model, is
another prefix to the engine).

Blocks are the engines' own (each publishes its block size): when the candidate engines
disagree, hints are hashed in the size most of them use (ties: the smaller), which
matches the cache of most engines; a hint is only a preference, so an engine of another
size is still picked by load."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from conveyor.common.engine_registry import (
    DEFAULT_INTERVAL_S,
    EngineEntry,
)


@dataclass(slots=True, frozen=True)
class LoadPolicy:
    """Bounds on an engine's load from its last heartbeat."""

    max_waiting: int = 8
    """More requests waiting than this: overloaded."""
    max_kv_usage: float = 0.95
    """More of the KV cache in use than this (0-1): overloaded."""
    max_imbalance: int = 8
    """A soft preference (a prefix hint) yields once its engine has this many more
    requests than the least loaded engine."""

    def is_full(self, engine: EngineEntry) -> bool:
        """At the engine's own waiting bound (max_num_waiting_seqs/_tokens): it would
        shed the next request of its lowest priority. The one notion of "full"."""
        return engine.load.is_waiting_full

    def is_overloaded(self, engine: EngineEntry) -> bool:
        """Full, or busy: more waiting than max_waiting (the gateway's softer bound,
        past which sessions and hints move to an engine that is not), or its KV nearly
        all in use."""
        return self.is_full(engine) or engine.load.num_waiting > self.max_waiting or \
            engine.load.kv_usage > self.max_kv_usage

    def least_loaded(self, engines: Iterable[EngineEntry]) -> EngineEntry:
        """The engine with the fewest requests (then least KV in use), preferring
        engines that are not full, then not overloaded; ties go to the smaller id."""
        return min(engines, key=lambda e: (self.is_full(e), self.is_overloaded(e),
                                           e.load.num_requests, e.load.kv_usage,
                                           e.engine_id))

    def is_much_busier(self, engine: EngineEntry, least: EngineEntry) -> bool:
        return engine.load.num_requests - least.load.num_requests > self.max_imbalance

    def may_prefer(self, engine: EngineEntry, least: EngineEntry) -> bool:
        """A soft preference (a hint, an adapter held) may send a request to `engine`:
        it is neither overloaded nor much busier than `least`."""
        return not self.is_overloaded(engine) and not self.is_much_busier(engine, least)


def hint_block_size(engines: Iterable[EngineEntry]) -> int:
    """The block size prefix hints are hashed in: the one most of `engines` publish (ties:
    the smaller). `engines` must not be empty."""
    counts = Counter(e.block_size for e in engines)
    return min(counts, key=lambda size: (-counts[size], size))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int,
                        cache_salt: str = "", lora_name: str = "") -> list[str]:
    """Hex hashes of the first min(max_blocks, len // block_size) block prefixes,
    shortest prefix first, under the salt and the LoRA adapter (none: the base model)."""
    num_blocks = min(max_blocks, len(token_ids) // block_size)
    hashes: list[str] = []
    parent = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    if lora_name:
        parent = hashlib.blake2b(parent + b"lora:" + lora_name.encode(), digest_size=16).digest()
    for i in range(num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent.hex())
    return hashes


class RecentPicks:
    """The engines this gateway picked within the last `window_s`.

    Loads come from heartbeats, up to one interval old (and listed up to
    EngineDirectory's max_age_s before that), so a burst would otherwise pile onto the
    engine that looked least loaded (ties going to the smaller id). A recent pick counts
    as one more waiting request of its engine until a listing that has surely seen it is
    in use, so the requests of a burst spread over engines of equal load.
    """

    def __init__(self, window_s: float = 2 * DEFAULT_INTERVAL_S):
        self._window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def add(self, engine_id: str) -> None:
        self._times.setdefault(engine_id, deque()).append(time.monotonic())

    def counted_in(self, engine: EngineEntry) -> EngineEntry:
        """`engine` with its recent picks added to its waiting requests."""
        times = self._times.get(engine.engine_id)
        if not times:
            return engine
        horizon = time.monotonic() - self._window_s
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._times[engine.engine_id]
            return engine
        load = replace(engine.load, num_waiting=engine.load.num_waiting + len(times))
        return replace(engine, load=load)
