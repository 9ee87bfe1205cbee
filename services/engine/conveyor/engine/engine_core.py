"""The synchronous engine: owns the scheduler and the model runner, one `step()` at a time.

Not thread-safe: exactly one thread drives it (AsyncEngine's loop thread, or the
offline LLM's caller). Callers speak in their own request ids; a request with
`n > 1` runs as n scheduler requests `f"{id}-{i}"` whose deltas carry `index = i`.
The scheduler's `requests` is the one map of the requests it holds; each carries its
caller's id, sample index and timing (core.request.Request).

A constrained request (sampling_params.structured_outputs) is queued at once, with its
grammar asked of the GrammarCompiler (compiled on its threads, or found in its cache);
the scheduler passes it over until the start of a step finds the grammar compiled and
gives each sample its matcher, advanced over the output it already has. A grammar that
fails to compile, or does not compile within the timeout, fails the request
(delta.error with invalid_request set) before it ever runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from conveyor.common.sampling_fields import sample_seed
from conveyor.engine import step_timing
from conveyor.engine.core.errors import DuplicateRequestId, RequestTooLong, WaitingQueueFull
from conveyor.engine.core.request import FinishReason, Request
from conveyor.engine.core.request_update import RequestUpdate
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import ModelRunnerOutput, PromptTokenLogprob
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.isolating_runner import IsolatingRunner, ModelRunnerLike
from conveyor.engine.iteration_stats import IterationStats
from conveyor.engine.lora.adapter_store import AdapterStore
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_timing import RequestTiming
from conveyor.engine.step_result import StepResult
from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.grammar_compiler import GrammarCompiler
from conveyor.engine.structured.request_grammar import RequestGrammar

log = logging.getLogger("conveyor.engine.core")


class EngineCore:
    """Adds, aborts and steps requests; turns each step into per-request deltas."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunnerLike, info: EngineInfo,
                 grammars: GrammarCompiler | None = None,
                 grammar_compile_timeout_s: float = 10.0, loras: AdapterStore | None = None):
        self.scheduler = scheduler
        self._isolating = IsolatingRunner(runner)
        self.info = info
        self.grammars = grammars
        """Compiles structured-output constraints; None: such requests are refused."""
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.loras = loras
        """The LoRA adapters held in memory; None: this engine serves none (max_loras 0)."""
        self._children: dict[str, list[str]] = {}
        """Caller request id -> its unfinished scheduler request ids (held ones included)."""
        self._held_siblings: dict[str, list[Request]] = {}
        """First sample's id -> samples 1..n-1, added once its prompt is cached."""
        self._prompt_logprobs: dict[str, list[PromptTokenLogprob]] = {}
        """Scheduler request id -> its prompt logprobs so far, until its first token."""
        self._awaiting_grammar: dict[str, Request] = {}
        """Queued scheduler requests whose grammar has not started yet, by id."""

    @property
    def runner(self) -> ModelRunnerLike:
        """The model runner; steps go through IsolatingRunner, which pins a failure on
        the request that caused it."""
        return self._isolating.runner

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    @property
    def unfinished_request_ids(self) -> list[str]:
        """Caller ids of the requests not finished yet (a copy)."""
        return list(self._children)

    def add_request(self, request: EngineRequest) -> dict[str, WaitingQueueFull]:
        """Queue `request`. Raises DuplicateRequestId, WaitingQueueFull (the waiting queue
        is full and nothing waiting ranks below it) or the scheduler's ValueErrors
        (RequestTooLong, empty prompt), leaving nothing behind.

        Returns the caller requests pushed out of the waiting queue to make room, each
        with the error its caller gets; they are already aborted and forgotten here.
        Only the first sample is held to the waiting bounds: samples 1..n-1 of an
        admitted request join past them and are never pushed out.
        """
        samples = [self._sample(request, i) for i in range(request.sampling_params.n)]
        self._check_new(request, samples)
        self._ask_for_grammar(request, samples)
        first, rest = samples[0], samples[1:]
        shed = self._submit(first)
        self._children[request.request_id] = [s.request_id for s in samples]
        if rest and self._shares_prompt_blocks:
            self._held_siblings[first.request_id] = rest
        else:
            for sample in rest:
                self._submit(sample)
        return self._drop_shed(shed)

    def _check_new(self, request: EngineRequest, samples: list[Request]) -> None:
        """The one check of a new request (the scheduler only asserts): neither its id nor
        its samples' ids in use (a held sample's included), a prompt, and prompt +
        max_tokens within max_model_len."""
        in_use = set(self._children).union(*self._children.values())
        if in_use.intersection([request.request_id, *(s.request_id for s in samples)]):
            raise DuplicateRequestId(f"request_id {request.request_id!r} is already running")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        num_prompt, max_tokens = len(request.prompt_token_ids), request.sampling_params.max_tokens
        max_model_len = self.scheduler.config.max_model_len
        if num_prompt + max_tokens > max_model_len:
            raise RequestTooLong(request.request_id, num_prompt, max_tokens, max_model_len)

    @property
    def _shares_prompt_blocks(self) -> bool:
        # Cached blocks are shared only once computed: later samples wait for the
        # first one's prefill, then find the whole prompt in the prefix cache.
        return self.scheduler.config.enable_prefix_caching

    def _sample(self, request: EngineRequest, index: int) -> Request:
        """Sample `index` as a scheduler request; with a seed it draws as a request seeded
        seed + index would (wrapped to int64, as the gateway does when it moves one)."""
        params = request.sampling_params
        request_id = request.request_id
        if params.n > 1:
            request_id = f"{request.request_id}-{index}"
            seed = None if params.seed is None else sample_seed(params.seed, index)
            prompt_logprobs = params.prompt_logprobs if index == 0 else None  # one copy
            params = dataclasses.replace(params, n=1, seed=seed,
                                         prompt_logprobs=prompt_logprobs)
        return Request(request_id, list(request.prompt_token_ids), params,
                       priority=request.priority, cache_salt=request.cache_salt,
                       lora=request.lora,
                       output_token_ids=list(request.output_token_ids),
                       exempt_from_bounds=index > 0, parent_id=request.request_id,
                       sample_index=index, timing=RequestTiming(request.arrival_time))

    def _ask_for_grammar(self, request: EngineRequest, samples: list[Request]) -> None:
        """Give each sample of a constrained request the grammar being compiled (or cached);
        raises InvalidConstraint when this engine has no compiler."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return
        if self.grammars is None:
            raise InvalidConstraint("this engine does not support structured outputs")
        compiled = self.grammars.compile(constraint)
        deadline = time.monotonic() + self.grammar_compile_timeout_s
        for sample in samples:
            sample.grammar = RequestGrammar(compiled, deadline, self.grammar_compile_timeout_s)

    def _submit(self, request: Request) -> list[Request]:
        shed = self.scheduler.add_request(request)
        if request.grammar is not None:
            self._awaiting_grammar[request.request_id] = request
        return shed

    def _drop_shed(self, shed: list[Request]) -> dict[str, WaitingQueueFull]:
        """Forget the scheduler requests pushed out of the queue and abort the rest of
        their caller requests (a sample of n > 1 fails the whole request)."""
        errors = {}
        for request in shed:
            errors[request.caller_id] = self.scheduler.bounds.full_error(pushed_out=True)
            self.abort([request.caller_id])
        return errors

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop the caller requests `request_ids` (unknown ids are ignored); frees their blocks."""
        for parent_id in request_ids:
            for request_id in self._children.pop(parent_id, []):
                self._held_siblings.pop(request_id, None)
                self._prompt_logprobs.pop(request_id, None)
                self._awaiting_grammar.pop(request_id, None)
                self.scheduler.abort(request_id)  # False for a held sibling: never added

    def close(self) -> None:
        """Drop queued grammar compiles (one already running finishes in its thread)."""
        if self.grammars is not None:
            self.grammars.close()

    def step(self) -> StepResult:
        """Schedule, run the model, and report what each request gained.

        A request the model fails on ends with delta.error set and finish ABORT
        (its blocks freed at the end of the step); the others go on.
        """
        result = StepResult()
        result.deltas = self._start_grammars()
        scheduler_output = self.scheduler.schedule()
        now = time.monotonic()
        self._mark_preempted(scheduler_output.preempted_request_ids, now)
        # This step's requests, looked up now: the scheduler forgets those that finish in it.
        in_step = {item.request_id: self.scheduler.requests[item.request_id]
                   for item in scheduler_output.scheduled}
        prefills = step_timing.mark_scheduled(scheduler_output.scheduled, in_step, now,
                                              result.iteration)
        if scheduler_output.is_empty:  # close the step: aborts in it free their blocks now
            self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
            return result
        executed = self._isolating.execute(scheduler_output)
        # Counted after the step: a draft model fills its draft slots in the runner.
        result.iteration.num_scheduled_tokens = scheduler_output.num_batched_tokens
        step_timing.end_chunks(prefills, time.monotonic())
        for request_id, entries in executed.output.prompt_logprobs.items():
            self._prompt_logprobs.setdefault(request_id, []).extend(entries)
        failed = self._abort_failed(executed.failures)
        updates = self.scheduler.update_from_output(scheduler_output, executed.output)
        result.deltas += [*failed, *self._collect(updates, in_step, result.iteration)]
        return result

    def _start_grammars(self) -> list[RequestDelta]:
        """Start the matcher of each queued request whose grammar has compiled; fail (the
        whole caller request) those whose grammar is invalid or past its deadline."""
        now = time.monotonic()
        failed = []
        for request_id, request in list(self._awaiting_grammar.items()):
            if request_id not in self._awaiting_grammar or not request.grammar.can_start(now):
                continue  # gone with a sibling that failed before it, or still compiling
            del self._awaiting_grammar[request_id]
            try:
                request.grammar.start(request.output_token_ids)
            except InvalidConstraint as exc:
                failed.append(self._fail(request, str(exc), invalid_request=True))
            except Exception as exc:  # a fault of the library, not of the request
                log.exception("starting the grammar of %s failed", request_id)
                failed.append(self._fail(request, f"grammar error: {type(exc).__name__}: {exc}"))
        return failed

    def _fail(self, request: Request, error: str, invalid_request: bool = False) -> RequestDelta:
        """Abort the caller request of `request` (every sample) with `error`; it held no
        blocks (it never ran)."""
        self.abort([request.caller_id])
        return RequestDelta(request_id=request.caller_id, index=request.sample_index,
                            finish_reason=FinishReason.ABORT, error=error,
                            invalid_request=invalid_request,
                            num_prompt_tokens=request.num_prompt_tokens,
                            num_output_tokens=request.num_output_tokens)

    def _mark_preempted(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            self._prompt_logprobs.pop(request_id, None)  # its prompt is computed again
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                request.timing.preemption_times.append(now)

    def _collect(self, updates: list[RequestUpdate], in_step: dict[str, Request],
                 iteration: IterationStats) -> list[RequestDelta]:
        now = time.monotonic()
        deltas = []
        for update in updates:
            request = in_step[update.request_id]
            delta = self._delta(request, update)
            step_timing.record_delta(request, delta, now, iteration)
            iteration.record_drafts(update.num_draft_tokens, update.num_accepted_tokens)
            if delta.finished:
                self._finish(request)
            else:
                self._release_siblings(request.request_id)
            deltas.append(delta)
        return deltas

    def _delta(self, request: Request, update: RequestUpdate) -> RequestDelta:
        wants_logprobs = request.sampling_params.logprobs
        prompt_logprobs = None
        if update.new_token_ids or update.finish_reason is not None:
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, None)
        return RequestDelta(
            request_id=request.caller_id,
            index=request.sample_index,
            new_token_ids=update.new_token_ids,
            new_logprobs=list(update.new_tokens) if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
            finish_reason=update.finish_reason,
            stop_token_id=_stop_token_of(request, update),
            num_prompt_tokens=update.num_prompt_tokens,
            num_output_tokens=update.num_output_tokens,
            num_cached_tokens=update.num_cached_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_tokens,
        )

    def _finish(self, request: Request) -> None:
        """Forget a finished scheduler request (the scheduler has freed its blocks)."""
        self._release_siblings(request.request_id)
        siblings = self._children.get(request.caller_id, [])
        if request.request_id in siblings:
            siblings.remove(request.request_id)
        if not siblings:
            self._children.pop(request.caller_id, None)

    def _release_siblings(self, request_id: str) -> None:
        for sibling in self._held_siblings.pop(request_id, []):
            self._submit(sibling)

    def _abort_failed(self, failures: dict[str, Exception]) -> list[RequestDelta]:
        """Abort requests the model failed on; the scheduler frees their blocks when the
        step ends and gives them no token."""
        deltas = []
        for request_id, exc in failures.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            self.scheduler.abort(request_id)
            self._prompt_logprobs.pop(request_id, None)
            deltas.append(RequestDelta(
                request_id=request.caller_id, index=request.sample_index,
                finish_reason=FinishReason.ABORT,
                error=f"model error: {type(exc).__name__}: {exc}",
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
            ))
            self._finish(request)
        return deltas

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats
        kv = self.scheduler.kv
        return EngineStats(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + self._num_held_siblings,
            num_waiting_tokens=stats.num_waiting_tokens,
            max_num_waiting_seqs=self.scheduler.config.max_num_waiting_seqs or 0,
            max_num_waiting_tokens=self.scheduler.config.max_num_waiting_tokens or 0,
            num_requests_shed=stats.num_requests_shed,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.pool.num_blocks,
            prefix_cache_queries=stats.num_prefix_query_tokens,
            prefix_cache_hits=stats.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, tuple[str, ...]]:
        """The adapters held, running and waiting; nothing when LoRA is off (no walk over
        the queues every step)."""
        if self.loras is None:
            return {}
        return {"lora_adapters": self.loras.names(),
                "running_lora_adapters": _adapter_names(self.scheduler.running),
                "waiting_lora_adapters": _adapter_names(self.scheduler.waiting)}

    @property
    def _num_held_siblings(self) -> int:
        return sum(len(held) for held in self._held_siblings.values())


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The adapters of `requests`, each once, in order."""
    return tuple(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))


def _stop_token_of(request: Request, update: RequestUpdate) -> int | None:
    if update.finish_reason is FinishReason.STOP and request.output_token_ids:
        return request.output_token_ids[-1]
    return None
