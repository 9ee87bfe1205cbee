"""The continuous-batching scheduler: each step, every request catches up under one token budget."""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.engine.core.batch_builder import BatchBuilder
from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.kv_block import KVCacheBlock
from conveyor.engine.core.kv_cache_manager import KVCacheManager
from conveyor.engine.core.preemption import any_below, pick_victim, victims_below
from conveyor.engine.core.request import FinishReason, Request, RequestStatus
from conveyor.engine.core.scheduler_output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from conveyor.engine.core.scheduler_stats import SchedulerStats
from conveyor.engine.core.stop_check import append_sampled
from conveyor.engine.core.waiting_bounds import WaitingBounds
from conveyor.engine.core.waiting_queue import WaitingQueue
from conveyor.engine.request_delta import RequestDelta, delta_of
from conveyor.engine.spec.ngram_proposer import NgramProposer


class Scheduler:
    """Decides who runs each step; owns the requests, the waiting queue and the KV cache.

    The engine loop calls `schedule()`, has the model runner execute the output,
    then calls `update_from_output()` with what came back; `add_request` and
    `abort` may come at any time in between. A step is "in flight" from
    `schedule()` until `update_from_output()`.

    There is no prefill or decode phase: a request lacks `num_tokens -
    num_computed_tokens` tokens of KV, and each step hands out tokens under
    `max_num_batched_tokens` and `max_num_seqs`: running requests first (in
    admission order), then waiting ones in (priority, arrival) order.

    Invariants: `running` holds at most `max_num_seqs` requests, in admission
    order; every live request is in exactly one of `running` and `waiting`;
    only running requests (and requests aborted while a step was in flight,
    until its end) hold blocks, so a waiting request leaves without freeing any.
    The waiting queue is bounded (`WaitingBounds`): `add_request` refuses an
    arrival or pushes lower-priority waiting requests out to make room.
    """

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        config.validate(resolved=True)
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        """Live (waiting or running) requests by id; finished ones leave at once."""
        self.waiting = WaitingQueue()
        self.bounds = WaitingBounds(config.max_num_waiting_seqs, config.max_num_waiting_tokens)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_requests_shed = 0
        """Requests refused or pushed out because the waiting queue was full."""
        self._num_arrivals = 0
        self._step_in_flight = False
        self._aborted_in_flight: list[Request] = []
        self._finished_request_ids: list[str] = []
        self.proposer = (NgramProposer(config.ngram_min, config.ngram_max)
                         if config.speculative_method == "ngram" else None)
        """Proposes the drafts decoding requests are verified with (None: the runner's draft
        model does, in the slots left for them)."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_tokens=self.waiting.num_tokens,
            kv_cache_usage=kv.usage,
            num_prefix_query_tokens=kv.num_prefix_query_tokens,
            num_prefix_hit_tokens=kv.num_prefix_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_evictions=kv.pool.num_evictions,
            num_requests_shed=self.num_requests_shed,
        )

    def add_request(self, request: Request) -> list[Request]:
        """Queue a request; it can join the next `schedule()`. `sampling_params.n` is not
        looked at: n > 1 is fanned out into n requests above the scheduler.

        Returns the waiting requests pushed out to make room for it (finished with
        QUEUE_FULL and gone from the scheduler; they held no blocks), usually none.
        Raises, changing nothing, WaitingQueueFull when the queue is full and nobody ranks
        below the request (see WaitingBounds; `exempt_from_bounds` requests skip the
        check). The request itself was checked by EngineCore.add_request (a new id, a
        prompt, within max_model_len): here that is only asserted.
        """
        assert request.request_id not in self.requests, request.request_id
        assert 0 < request.num_prompt_tokens <= (self.config.max_model_len
                                                 - request.max_tokens), request.request_id
        shed = [] if request.exempt_from_bounds else self._make_room_for(request)
        request.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        return shed

    def _make_room_for(self, request: Request) -> list[Request]:
        shed = self.bounds.requests_to_shed(self.waiting, request)
        if shed is None:
            self.num_requests_shed += 1
            raise self.bounds.full_error()
        for victim in shed:
            self._shed(victim)
        return shed

    def _shed(self, request: Request) -> None:
        """Push a waiting request out of the queue (it holds no blocks)."""
        del self.requests[request.request_id]
        self.waiting.remove(request)
        request.finish(FinishReason.QUEUE_FULL)
        self._finished_request_ids.append(request.request_id)
        self.num_requests_shed += 1

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason "abort"; False (and no change) if it is unknown or
        already finished, so repeating it is harmless.

        A waiting or preempted request holds no blocks and leaves the queue at once.
        A running request leaves `running` at once; its blocks return to the pool at
        once between steps, or at the end of `update_from_output` while a step is in
        flight (the model runner may still be writing them). Tokens sampled for it in
        that step are dropped.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        was_running = request.status is RequestStatus.RUNNING
        request.finish(FinishReason.ABORT)
        self._finished_request_ids.append(request_id)
        if not was_running:
            self.waiting.remove(request)
        elif self._step_in_flight:
            self.running.remove(request)
            self._aborted_in_flight.append(request)
        else:
            self.running.remove(request)
            self.kv.free(request)
        return True

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Running requests get their next tokens first (preempting the
        lowest-priority, latest-admitted running request when blocks run out); waiting
        requests are admitted only if no request was preempted for blocks this step."""
        self._free_aborted()
        batch = BatchBuilder(self.kv, self.config.max_num_batched_tokens)
        self._schedule_running(batch)
        if not batch.preempted_request_ids:
            self._schedule_waiting(batch)
        self._schedule_drafts(batch)
        finished, self._finished_request_ids = self._finished_request_ids, []
        self._step_in_flight = True
        return batch.build(finished)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestDelta]:
        """Record a finished step: advance computed tokens, cache newly full blocks, append
        sampled tokens and finish requests that are done or that the model failed on (their
        blocks return at once).

        Returns one delta per request that got a token or failed, in batch order.
        Requests aborted during the step get none.
        """
        deltas: list[RequestDelta] = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                delta = self._update(request, scheduled, runner_output)
                if delta is not None:
                    deltas.append(delta)
        self._step_in_flight = False
        self._free_aborted()
        return deltas

    def _update(self, request: Request, scheduled: ScheduledRequest,
                runner_output: ModelRunnerOutput) -> RequestDelta | None:
        """One running request's share of the step's output: its delta, or None after a
        prefill chunk that sampled nothing."""
        error = runner_output.failures.get(request.request_id)
        if error is not None:
            self._finish(request, FinishReason.ABORT)
            return delta_of(request, [], error=error)
        _keep_prompt_logprobs(request, runner_output)
        num_known = scheduled.num_scheduled_tokens - len(scheduled.draft_token_ids)
        if not scheduled.needs_sample:
            request.num_computed_tokens += num_known
            self.kv.cache_computed_blocks(request)
            return None
        sampled = runner_output.sampled.get(request.request_id)
        if not sampled:
            raise ValueError(f"model runner returned no token for {request.request_id!r}")
        new_tokens = append_sampled(request, sampled, len(scheduled.draft_token_ids),
                                    self.eos_token_ids, self.config.max_model_len)
        # The KV of the known tokens and of the drafts kept is computed; the last new
        # token's is not, nor (ever) that of the drafts rejected.
        request.num_computed_tokens += num_known + len(new_tokens) - 1
        self.kv.cache_computed_blocks(request)
        if request.finish_reason is not None:
            self._finish(request, request.finish_reason)
        elif scheduled.draft_token_ids:
            self.kv.free_tail(request, request.num_tokens)
        return delta_of(request, new_tokens)

    def _schedule_running(self, batch: BatchBuilder) -> None:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if batch.token_budget == 0:
                break
            num_tokens = self._chunk_size(request.num_tokens_to_compute, batch.token_budget)
            if num_tokens > 0 and self._allocate_or_preempt(request, num_tokens, batch):
                batch.add(request, num_tokens)

    def _schedule_drafts(self, batch: BatchBuilder) -> None:
        """Drafts after the decoding requests' tokens, in the budget and blocks left once
        every request has its tokens, so they never cost anyone a step or a preemption:
        proposed here (n-gram), or slots left for the runner's draft model."""
        config = self.config
        if not config.num_speculative_tokens or len(self.running) > config.speculative_max_running:
            return
        for request in self.running:
            if batch.token_budget == 0:
                break
            num_drafts = self._num_drafts(request, batch) if request.request_id in batch else 0
            if not num_drafts:
                continue
            drafts = (self.proposer.propose(request.all_token_ids, num_drafts)
                      if self.proposer is not None else [])
            num_slots = len(drafts) if self.proposer is not None else num_drafts
            if num_slots and self.kv.allocate_slots(request, 1 + num_slots) is not None:
                batch.add_drafts(request, drafts, num_slots)

    def _num_drafts(self, request: Request, batch: BatchBuilder) -> int:
        """How many drafts may follow a decoding request's last token in its step.

        0 for a request still prefilling or under a grammar (its matcher would have to
        follow the drafts); never more than it may still generate, so that every accepted
        draft and the token sampled after them are output it is allowed."""
        if request.num_tokens_to_compute != 1 or request.grammar is not None:
            return 0
        limit = request.draft_limit or self.config.num_speculative_tokens
        room = min(request.max_tokens - request.num_output_tokens,
                   self.config.max_model_len - request.num_tokens) - 1
        return max(0, min(limit, room, batch.token_budget))

    def _allocate_or_preempt(self, request: Request, num_tokens: int, batch: BatchBuilder) -> bool:
        """Allocate the request's slots, preempting victims until it fits; False if the
        request itself was the victim."""
        while self.kv.allocate_slots(request, num_tokens) is None:
            victim = pick_victim(self.running)
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, batch: BatchBuilder) -> None:
        """Free the victim's blocks and queue it again under its original arrival number;
        it will recompute its prompt and outputs so far (prefix hits permitting)."""
        batch.remove(victim.request_id)
        batch.preempted_request_ids.append(victim.request_id)
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.pending_prompt_logprobs = None  # its prompt is computed again
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(victim)

    def _schedule_waiting(self, batch: BatchBuilder) -> None:
        """Admit waiting requests in order while they fit. A request still waiting for its
        grammar, or whose LoRA adapter would make the running requests' adapters more than
        max_loras, is passed over: those behind it may run meanwhile."""
        adapters = {r.lora.key for r in self.running if r.lora is not None}
        num_passed = 0
        while num_passed < len(self.waiting) and batch.token_budget > 0:
            request = self.waiting.peek(num_passed)
            if request.is_awaiting_grammar or self._over_max_loras(request, adapters):
                num_passed += 1
                continue
            if request.request_id in batch.preempted_request_ids:
                break  # everything behind a request preempted this step ranks below it
            if not self._admit(request, batch):
                break
            if request.lora is not None:
                adapters.add(request.lora.key)

    def _over_max_loras(self, request: Request, adapters: set[str]) -> bool:
        return (request.lora is not None and request.lora.key not in adapters
                and len(adapters) >= self.config.max_loras)

    def _admit(self, request: Request, batch: BatchBuilder) -> bool:
        """Move a waiting request (the first not waiting for its grammar) to running with its
        first chunk scheduled."""
        if self._no_seq_for(request):
            return False
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_tokens = self._chunk_size(request.num_tokens - num_hit_tokens, batch.token_budget)
        if not self._has_room(request, num_tokens, hits) and not self._preempt_for(
            request, num_tokens, hits, batch
        ):
            return False
        if self.kv.allocate_slots(request, num_tokens, hits) is None:
            return False
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
        batch.add(request, num_tokens)
        return True

    def _no_seq_for(self, request: Request) -> bool:
        """max_num_seqs is reached and no running request ranks below `request` (a cheap
        test before the prefix-cache lookup)."""
        if len(self.running) < self.config.max_num_seqs:
            return False
        return not any_below(self.running, request.priority)

    def _has_room(self, request: Request, num_tokens: int, hits: list[KVCacheBlock]) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return self.kv.num_blocks_to_allocate(request, num_tokens, hits) <= self.kv.num_free_blocks

    def _preempt_for(
        self, request: Request, num_tokens: int, hits: list[KVCacheBlock], batch: BatchBuilder
    ) -> bool:
        """Preempt strictly lower-priority running requests (worst first) to admit `request`,
        but only if they free enough sequence slots and blocks; otherwise preempt none.

        Only strictly lower priorities are victims (see `victims_below`). The block
        count is a lower bound (blocks shared between two victims are not counted).
        """
        needs_seq = len(self.running) >= self.config.max_num_seqs
        num_needed = self.kv.num_blocks_to_allocate(request, num_tokens, hits)
        num_free = self.kv.num_free_blocks
        victims: list[Request] = []
        for victim in victims_below(self.running, request.priority):
            if (victims or not needs_seq) and num_needed <= num_free:
                break
            victims.append(victim)
            num_free += self.kv.num_reclaimable_blocks(victim, keep=hits)
        if not ((victims or not needs_seq) and num_needed <= num_free):
            return False
        for victim in victims:
            self._preempt(victim, batch)
        return True

    def _chunk_size(self, num_remaining: int, token_budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            num_remaining = min(num_remaining, threshold)
        return min(num_remaining, token_budget)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish(reason)
        self.running.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    def _free_aborted(self) -> None:
        for request in self._aborted_in_flight:
            self.kv.free(request)
        self._aborted_in_flight.clear()


def _keep_prompt_logprobs(request: Request, runner_output: ModelRunnerOutput) -> None:
    """Add the prompt logprobs of the positions this step computed to those pending."""
    entries = runner_output.prompt_logprobs.get(request.request_id)
    if entries is not None:
        request.pending_prompt_logprobs = [*(request.pending_prompt_logprobs or ()), *entries]
