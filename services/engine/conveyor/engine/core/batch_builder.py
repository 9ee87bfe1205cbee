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

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._scheduled

    def add(self, request: Request, num_tokens: int) -> ScheduledRequest:
        """Schedule `num_tokens` of the request's tokens from `num_computed_tokens` on; its
        blocks must already be allocated."""
        start = request.num_computed_tokens
        end = start + num_tokens
        scheduled = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_in(start, end),
            num_computed_tokens=start,
            block_table=self.kv.block_table(request),
            slot_mapping=self.kv.slot_mapping(request, start, end),
            needs_sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            lora=request.lora,
            grammar=request.grammar.matcher if request.grammar is not None else None,
        )
        self._scheduled[request.request_id] = scheduled
        self.token_budget -= num_tokens
        return scheduled

    def add_drafts(self, request: Request, drafts: list[int], num_slots: int) -> None:
        """Follow a scheduled decoding request's token with `drafts`, or (none given) with
        `num_slots` slots for drafts the runner proposes; their blocks must be allocated.
        After the last `remove` of the step: a draft's budget is never refunded."""
        scheduled = self._scheduled[request.request_id]
        end = scheduled.seq_len
        scheduled.token_ids = scheduled.token_ids + drafts
        scheduled.slot_mapping += self.kv.slot_mapping(request, end, end + num_slots)
        scheduled.draft_token_ids = drafts
        scheduled.num_draft_slots = 0 if drafts else num_slots
        self.token_budget -= num_slots

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
