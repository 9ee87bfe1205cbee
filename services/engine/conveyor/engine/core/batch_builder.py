"""One step's batch while the scheduler fills it: the token budget and the scheduled requests."""

from __future__ import annotations

from conveyor.engine.core.kv_cache_manager import KVCacheManager
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput


class BatchBuilder:
    """Collects a step's `ScheduledRequest`s; a request taken out again (preempted in the same
    step) gives its tokens back to the budget.

    Invariant: `token_budget + sum(scheduled tokens) == max_num_batched_tokens`.
    """

    __slots__ = ("kv", "token_budget", "preempted_request_ids", "_scheduled")

    def __init__(self, kv: KVCacheManager, token_budget: int) -> None:
        self.kv = kv
        self.token_budget = token_budget
        self.preempted_request_ids: list[str] = []
        self._scheduled: dict[str, ScheduledRequest] = {}

    def __len__(self) -> int:
        return len(self._scheduled)

    def add(self, request: Request, num_tokens: int, drafts: list[int] | None = None,
            num_draft_slots: int = 0) -> ScheduledRequest:
        """Schedule `num_tokens` of the request's tokens from `num_computed_tokens` on, then
        the `drafts` proposed to follow them (a decoding request: its last token), or slots
        for `num_draft_slots` drafts the runner will propose; the blocks for all of them
        must already be allocated."""
        drafts = drafts or []
        start = request.num_computed_tokens
        end = start + num_tokens
        num_slots = len(drafts) or num_draft_slots
        scheduled = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_in(start, end) + drafts,
            num_computed_tokens=start,
            block_table=self.kv.block_table(request.request_id),
            slot_mapping=self.kv.slot_mapping(request.request_id, start, end + num_slots),
            needs_sample=end == request.num_tokens,
            draft_token_ids=drafts,
            num_draft_slots=num_draft_slots,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            grammar=request.grammar.matcher if request.grammar is not None else None,
        )
        self._scheduled[request.request_id] = scheduled
        self.token_budget -= num_tokens + num_slots
        return scheduled

    def remove(self, request_id: str) -> None:
        """Unschedule a request (no-op if it was not scheduled), refunding its tokens."""
        scheduled = self._scheduled.pop(request_id, None)
        if scheduled is not None:
            self.token_budget += len(scheduled.token_ids)

    def build(self, finished_request_ids: list[str]) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled=list(self._scheduled.values()),
            preempted_request_ids=self.preempted_request_ids,
            block_size=self.kv.block_size,
            finished_request_ids=finished_request_ids,
        )
