"""One request's timeline as the endpoint lives it: arrival, admitted, queued,
first token, finished (tenancy.timeline.TimelineStore keeps it in Redis).

A timeline is for looking at, never a reason to fail a request: a write that
fails is logged and the request goes on.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from conveyor.gateway.tenancy.timeline import Stage, TimelineStore
from conveyor.gateway.usage_totals import UsageTotals

log = logging.getLogger("conveyor.gateway.timeline")


class TimelineWriter:
    """Writes the stages of request `request_id` as they happen."""

    def __init__(self, store: TimelineStore, request_id: str):
        self._store = store
        self._request_id = request_id
        self._arrival = time.time()
        self._started = False

    async def start(self, tenant_id: str) -> None:
        """Open the timeline under its tenant (once authenticated), dated at arrival."""
        self._started = await self._write(self._store.start, tenant_id, self._arrival)

    async def mark(self, stage: Stage, **values: int | str) -> None:
        """`stage` happened now; `values` are recorded with it (see TimelineStore.record)."""
        if self._started:
            await self._write(self._store.mark, stage, **values)

    async def finish(self, usage: UsageTotals | None, finish_reason: str) -> None:
        """The request is over: what it produced and why it stopped."""
        counts = {} if usage is None else {
            "num_completion_tokens": usage.num_tokens_spent,
            "num_cached_tokens": usage.cached_tokens,
        }
        await self.mark(Stage.FINISHED, finish_reason=finish_reason, **counts)

    async def _write(self, write, *args, **kwargs) -> bool:
        try:
            await write(self._request_id, *args, **kwargs)
        except RedisError as error:
            log.warning("could not write the timeline of %s: %s", self._request_id, error)
            return False
        return True
