"""Requests waiting to run, in order: lower priority value first, then earlier arrival."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

from conveyor.engine.core.request import Request


def scheduling_order(request: Request) -> tuple[int, int]:
    """The sort key: (priority, arrival). Unique, because arrival_seq is."""
    return (request.priority, request.arrival_seq)


class WaitingQueue:
    """A list kept sorted by `scheduling_order`.

    A preempted request goes back under its original arrival number, so it lands
    where it first stood, not at the back. Insert and remove are a binary search
    plus a memmove: cheap for the thousands of requests one engine queues.

    `num_tokens` is the sum of the queued requests' `num_tokens_to_compute`, kept
    as they come and go: a queued request's tokens do not change while it waits
    (it has no computed tokens and gains no output until it runs).
    """

    __slots__ = ("_requests", "num_tokens")

    def __init__(self) -> None:
        self._requests: list[Request] = []
        self.num_tokens = 0
        """Tokens the queued requests still have to compute (whole prompts; a preempted
        request's prompt and outputs so far)."""

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __reversed__(self) -> Iterator[Request]:
        """Worst first: the highest priority value, the latest arrival."""
        return reversed(self._requests)

    def add(self, request: Request) -> None:
        insort(self._requests, request, key=scheduling_order)
        self.num_tokens += request.num_tokens_to_compute

    def peek(self, index: int = 0) -> Request:
        """The request `index` places behind the next one to admit; IndexError past the end."""
        return self._requests[index]

    def remove(self, request: Request) -> bool:
        """Take a request out wherever it stands; False if it is not queued."""
        index = bisect_left(self._requests, scheduling_order(request), key=scheduling_order)
        if index < len(self._requests) and self._requests[index] is request:
            del self._requests[index]
            self.num_tokens -= request.num_tokens_to_compute
            return True
        return False
