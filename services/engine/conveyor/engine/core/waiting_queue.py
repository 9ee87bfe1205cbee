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
    """

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def add(self, request: Request) -> None:
        insort(self._requests, request, key=scheduling_order)

    def peek(self) -> Request:
        """The next request to admit; IndexError when empty."""
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request) -> bool:
        """Take a request out wherever it stands; False if it is not queued."""
        index = bisect_left(self._requests, scheduling_order(request), key=scheduling_order)
        if index < len(self._requests) and self._requests[index] is request:
            del self._requests[index]
            return True
        return False
