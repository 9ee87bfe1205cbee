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
from conveyor.engine.core.errors import DuplicateRequestId, RequestTooLong, WaitingQueueFull
from conveyor.engine.core.request import FinishReason, Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.isolating_runner import IsolatingRunner, ModelRunnerLike
from conveyor.engine.lora.adapter_store import AdapterStore
from conveyor.engine.request_delta import RequestDelta, delta_of
from conveyor.engine.request_timing import RequestTiming
from conveyor.engine.step_timing import IterationSink, StepTimer
from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.grammar_compiler import GrammarCompiler
from conveyor.engine.structured.request_grammar import RequestGrammar

log = logging.getLogger("conveyor.engine.core")


class EngineCore:
    """Adds, aborts and steps requests; turns each step into per-request deltas."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunnerLike, info: EngineInfo,
                 grammars: GrammarCompiler | None = None,
                 grammar_compile_timeout_s: float = 10.0, loras: AdapterStore | None = None,
                 on_iteration: IterationSink | None = None):
        self.scheduler = scheduler
        self._isolating = IsolatingRunner(runner)
        self.info = info
        self.grammars = grammars
        """Compiles structured-output constraints; None: such requests are refused."""
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.loras = loras
        """The LoRA adapters held in memory; None: this engine serves none (max_loras 0)."""
        self._children: dict[str, dict[int, Request]] = {}
        """Caller request id -> sample index -> its unfinished samples (held ones included:
        a request holds the samples waiting on its prompt, `Request.held_samples`)."""
        self._awaiting_grammar: dict[str, Request] = {}
        """Queued scheduler requests whose grammar has not started yet, by id."""
        self.timer = StepTimer(on_iteration)
        """Times each step; its on_iteration (the metrics) gets each step's stats."""

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
        self._children[request.request_id] = {s.sample_index: s for s in samples}
        if rest and self._shares_prompt_blocks:
            first.held_samples = rest
        else:
            for sample in rest:
                self._submit(sample)
        return self._drop_shed(shed)

    def _check_new(self, request: EngineRequest, samples: list[Request]) -> None:
        """The one check of a new request (the scheduler only asserts): neither its id nor
        its samples' ids in use (a held sample's included), a prompt, and prompt +
        max_tokens within max_model_len."""
        in_use = {*self._children, *(s.request_id for samples in self._children.values()
                                     for s in samples.values())}
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
            for sample in self._children.pop(parent_id, {}).values():
                sample.held_samples = []
                self._awaiting_grammar.pop(sample.request_id, None)
                self.scheduler.abort(sample.request_id)  # False for a held one: never added

    def close(self) -> None:
        """Drop queued grammar compiles (one already running finishes in its thread)."""
        if self.grammars is not None:
            self.grammars.close()

    def step(self) -> list[RequestDelta]:
        """Schedule, run the model, and report what each request gained.

        A request the model fails on ends with delta.error set and finish ABORT (its
        blocks freed as the step ends); the others go on. The step's timing and metrics
        go to `timer` (its on_iteration receives them).
        """
        deltas = self._start_grammars()
        batch = self.scheduler.schedule()
        self.timer.scheduled(batch, self.scheduler.requests)
        output = self._isolating.execute(batch)
        self.timer.executed(batch)
        new = self.scheduler.update_from_output(batch, output)
        self.timer.updated(new, output)
        for delta in new:
            self._settle(delta)
        return deltas + new

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
        request.finish(FinishReason.ABORT)
        return delta_of(request, [], error=error, invalid_request=invalid_request)

    def _settle(self, delta: RequestDelta) -> None:
        """Forget a finished sample; a sample's first delta lets its held siblings in."""
        samples = self._children.get(delta.request_id, {})
        sample = samples.get(delta.index)
        if sample is None:
            return
        held, sample.held_samples = sample.held_samples, []
        for sibling in held:
            self._submit(sibling)
        if delta.finished:
            del samples[delta.index]
            if not samples:
                del self._children[delta.request_id]

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
        return sum(len(s.held_samples) for samples in self._children.values()
                   for s in samples.values())


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The adapters of `requests`, each once, in order."""
    return tuple(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))
