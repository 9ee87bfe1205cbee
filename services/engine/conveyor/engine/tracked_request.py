"""The engine core's bookkeeping for one scheduled request: who asked, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.core.request import Request
from conveyor.engine.request_timing import RequestTiming


@dataclass(slots=True, eq=False)
class TrackedRequest:
    """A scheduler request plus what the engine has already reported about it.

    `parent_id` / `index` are the caller's request id and the sample index (n > 1
    fans one caller request out into several scheduler requests). `timing` is where
    the request's queue / prefill / decode trace spans are cut from; it travels to
    the caller with the final delta.
    """

    request: Request
    parent_id: str
    index: int
    timing: RequestTiming

    @property
    def request_id(self) -> str:
        return self.request.request_id
