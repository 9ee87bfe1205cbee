"""Stop strings over a stream of text: hold back only what could still match."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopHit:
    """A stop string found in the text."""

    stop: str
    index: int
    """Position of `stop` in the stream's list of stop strings."""


class StopMatcher:
    """Passes text through until the first stop string appears.

    `push` returns the text that can no longer be part of a stop string, so it
    is safe to stream; the held-back tail is at most the longest stop minus
    one character, and only while it is a prefix of some stop. The first stop
    to complete (earliest end; at equal ends the earliest start) wins; the text
    before it is returned, with the stop itself when `include_in_output`.
    """

    def __init__(self, stops: list[str], include_in_output: bool):
        self._stops = list(stops)
        self._include = include_in_output
        self._lookback = max((len(s) for s in self._stops), default=1) - 1
        self._window = ""
        """Recent text: enough to see a stop split across pushes."""
        self._num_emitted = 0
        """How much of `_window` has been returned."""

    def push(self, text: str) -> tuple[str, StopHit | None]:
        """Add text; return what is now safe to emit and the stop hit, if any."""
        self._window += text
        hit = self._first_hit()
        if hit is not None:
            start, index = hit
            end = start + len(self._stops[index]) if self._include else start
            return self._take(end), StopHit(self._stops[index], index)
        end = len(self._window) - (0 if self._include else self._num_partial())
        out = self._take(end)
        self._trim()
        return out, None

    def flush(self) -> str:
        """The text ended without a stop: release the held-back tail."""
        return self._take(len(self._window))

    def _take(self, end: int) -> str:
        out = self._window[self._num_emitted:end]
        self._num_emitted = max(self._num_emitted, end)
        return out

    def _first_hit(self) -> tuple[int, int] | None:
        best: tuple[int, int, int] | None = None
        for index, stop in enumerate(self._stops):
            start = self._window.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, index)
        return None if best is None else (best[1], best[2])

    def _num_partial(self) -> int:
        """Length of the longest unemitted tail that is a proper prefix of a stop."""
        limit = min(self._lookback, len(self._window) - self._num_emitted)
        for length in range(limit, 0, -1):
            tail = self._window[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

    def _trim(self) -> None:
        keep = max(self._lookback, len(self._window) - self._num_emitted)
        cut = len(self._window) - keep
        if cut > 0:
            self._window = self._window[cut:]
            self._num_emitted -= cut
