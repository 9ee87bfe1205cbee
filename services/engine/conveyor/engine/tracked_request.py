"""The engine core's bookkeeping for one scheduled request: who asked, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.core.request import Request


@dataclass(slots=True, eq=False)
class TrackedRequest:
    """A scheduler request plus what the engine has already reported about it.

    `parent_id` / `index` are the caller's request id and the sample index (n > 1
    fans one caller request out into several scheduler requests). Times are
    `time.monotonic()` seconds; None until the event happened. They are where the
    request's queue / prefill / decode trace spans will be cut from.
    """

    request: Request
    parent_id: str
    index: int
    arrival_time: float
    first_scheduled_time: float | None = None
    last_token_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id
