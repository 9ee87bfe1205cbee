"""Peers left out for a while after a call could not reach them (an engine id, a
replica address), so the next calls move on at once instead of waiting for the
registry entry to expire."""

from __future__ import annotations

import asyncio


class LeftOut:
    """Keys marked unreachable, each for `duration_s` from its last mark (loop time)."""

    def __init__(self, duration_s: float):
        self.duration_s = duration_s
        self._until: dict[str, float] = {}

    def mark(self, key: str) -> None:
        """`key` could not be reached: leave it out for `duration_s`."""
        self._until[key] = asyncio.get_running_loop().time() + self.duration_s

    def __contains__(self, key: str) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._until[key]
        return False
