"""How full the waiting queue may get, and who is shed when an arrival would overfill it."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.core.errors import WaitingQueueFull
from conveyor.engine.core.request import Request
from conveyor.engine.core.waiting_queue import WaitingQueue


@dataclass(slots=True, frozen=True)
class WaitingBounds:
    """At most `max_num_seqs` waiting requests and `max_num_tokens` tokens still to compute
    among them (None: no limit on that count).

    Shedding rule: an arrival that would exceed a bound pushes out waiting requests of
    strictly lower rank (a higher priority value), worst first (the highest value, then
    the latest arrival), as many as it takes; if pushing out all of them is not enough,
    or there are none, the arrival itself is refused and nobody is pushed out. So an
    arrival at the lowest priority, or tying with the lowest (it arrived last), is
    refused. Only requests that never ran may be pushed out (`Request.may_be_shed`):
    a preempted request counts towards the bounds but keeps its place.
    """

    max_num_seqs: int | None = None
    max_num_tokens: int | None = None

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return (self.max_num_seqs is None or num_seqs <= self.max_num_seqs) and (
            self.max_num_tokens is None or num_tokens <= self.max_num_tokens)

    def requests_to_shed(self, waiting: WaitingQueue, arrival: Request) -> list[Request] | None:
        """The waiting requests to push out so that `arrival` fits, worst first: [] when it
        fits as is, None when it cannot (the arrival is refused, nobody is shed)."""
        num_seqs = len(waiting) + 1
        num_tokens = waiting.num_tokens + arrival.num_tokens_to_compute
        shed: list[Request] = []
        for request in reversed(waiting):
            if self.fits(num_seqs, num_tokens) or request.priority <= arrival.priority:
                break  # the queue is sorted: everything further ranks at or above arrival
            if request.may_be_shed:
                shed.append(request)
                num_seqs -= 1
                num_tokens -= request.num_tokens_to_compute
        return shed if self.fits(num_seqs, num_tokens) else None

    def full_error(self, pushed_out: bool = False) -> WaitingQueueFull:
        """The error a refused (or pushed-out) request's caller gets."""
        return WaitingQueueFull(self.max_num_seqs, self.max_num_tokens, pushed_out)
