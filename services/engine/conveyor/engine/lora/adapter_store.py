"""The adapters an engine holds in memory, by name, least recently used out first.

Reading an adapter (files, checks, the fused layout) is slow next to a step, so callers
do it on a worker thread (`load`) before the request that names it is queued; the step
loop only ever sees adapters already read. Thread-safe. Past `capacity`, the least
recently used adapter is forgotten; requests that hold it keep its tensors alive until
they finish, so dropping one never disturbs a running request (`unload` likewise).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from conveyor.engine.lora.adapter import InvalidAdapter, LoraAdapter, read_adapter
from conveyor.engine.model.model_config import ModelConfig

MAX_NAME_LENGTH = 128


class AdapterStore:
    def __init__(self, model_config: ModelConfig, max_rank: int, capacity: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.capacity = capacity
        self._held: OrderedDict[str, tuple[str, LoraAdapter]] = OrderedDict()
        """Name -> (the path it was read from, the adapter)."""
        self._lock = threading.Lock()

    def find(self, name: str, path: str = "") -> LoraAdapter | None:
        """The adapter held under `name` (read from `path`, when one is given), or None."""
        with self._lock:
            entry = self._held.get(name)
            if entry is None or (path and entry[0] != path):
                return None
            self._held.move_to_end(name)
            return entry[1]

    def load(self, name: str, path: str) -> LoraAdapter:
        """The adapter `name`, read from `path` unless held from there already (blocking:
        call it off the step loop). InvalidAdapter when it cannot be read or does not fit."""
        if not 1 <= len(name) <= MAX_NAME_LENGTH:
            raise InvalidAdapter(f"an adapter name has 1-{MAX_NAME_LENGTH} characters, "
                                 f"got {len(name)}")
        held = self.find(name, path)
        if held is not None:
            return held
        if not path:
            raise InvalidAdapter(f"adapter {name!r} is not loaded and no path was given")
        adapter = read_adapter(name, path, self.model_config, self.max_rank)
        with self._lock:
            self._held[name] = (path, adapter)
            self._held.move_to_end(name)
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)
        return adapter

    def unload(self, name: str) -> LoraAdapter | None:
        """Forget `name`; the adapter it was, or None when it was not held."""
        with self._lock:
            entry = self._held.pop(name, None)
        return None if entry is None else entry[1]

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._held)
