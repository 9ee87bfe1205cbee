"""One choice of a request: the deltas of a detok Generate stream (detok opens the engine's
stream, decodes and streams text with its tokens back; the gateway relays no token).

The request's own task reads each choice (`next_delta`): no task of its own per choice.
`close()` cancels the choice's stream (and so the engine's); the request that opened the
choice registers it for closing when it opens it (generation_request.py), so a choice is
closed on every way out.

`ChoiceStreams.open` opens the choices of one prompt. Its n samples share one stream
(`SharedStream`, the engine computes the prompt once): a demultiplexing task hands each
delta to its sample's `SampleFeed`, which a choice reads as it reads a stream of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from conveyor.gateway.clients.detok import (
    DetokClient,
    DetokOptions,
    GenerationDelta,
    TextSoFar,
    TextStream,
)
from conveyor.gateway.clients.engine import GenerateJob, TokenUsage
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.errors import EngineAborted

Target = tuple[str, str]
"""An engine a generation runs on: its registry id and its address."""

Move = Callable[[str, UpstreamError | EngineAborted], Awaitable[Target | None]]
"""Where a choice whose engine (by id) failed mid-stream goes on, or None when it may not
move (GenerationRequest decides and records it)."""

ABORT = "abort"
"""The finish of a request the engine gave up (e.g. draining): it resumes elsewhere."""


class SampleFeed:
    """One sample's deltas of a SharedStream, read as a stream of its own: iterate it for
    deltas; `cancel()` says this sample wants no more (the shared stream is cancelled once
    every sample's feed is)."""

    def __init__(self, shared: SharedStream):
        self._shared = shared
        self._queue: asyncio.Queue[GenerationDelta | UpstreamError | None] = asyncio.Queue()
        self.cancelled = False

    @property
    def replica(self) -> str:
        return self._shared.stream.replica

    async def __aiter__(self):
        while (item := await self._queue.get()) is not None:
            if isinstance(item, UpstreamError):
                raise item
            yield item

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._shared.left()

    def put(self, item: GenerationDelta | UpstreamError | None) -> None:
        """The next delta, the error that broke the stream, or None at its end."""
        self._queue.put_nowait(item)


class SharedStream:
    """One detok stream carrying the n samples of one prompt, split by each delta's sample
    index into `feeds[index]` by a task of its own. A broken stream reaches every feed as
    its error (so each sample resumes alone: `GenerateJob.sample`); its end ends every
    feed. `close()` cancels the stream and waits for the task."""

    def __init__(self, stream: TextStream, n: int):
        self.stream = stream
        self.feeds = [SampleFeed(self) for _ in range(n)]
        self._task = asyncio.create_task(self._split())
        self._task.add_done_callback(_retrieve_exception)

    def left(self) -> None:
        """A feed was cancelled; with the last one, the stream goes too."""
        if all(feed.cancelled for feed in self.feeds):
            self.stream.cancel()

    async def close(self) -> None:
        self.stream.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _split(self) -> None:
        end: UpstreamError | None = None
        try:
            async for delta in self.stream:
                feed = self.feeds[delta.index] if delta.index < len(self.feeds) else None
                if feed is not None and not feed.cancelled:  # else nobody reads it
                    feed.put(delta)
        except UpstreamError as error:
            end = error
        for feed in self.feeds:
            feed.put(end)


class ChoiceStream:
    """One running generation, read from `source` (its own detok stream, or its sample's
    feed of a shared one); `next_delta()` returns the next delta, None once it is over.

    A broken stream resumes, alone (n = 1), with the tokens the choice has as output
    already produced (resume_output_token_ids) and what it has of their text (detok holds
    that back): on another engine when the engine failed (it died, drained past its
    timeout, or its node went away: UNAVAILABLE, a server-side CANCELLED, or an abort;
    `move` picks the engine), on another detok replica when detok failed (up to the
    replica set's max_attempts replicas). The same sampling settings and budget,
    penalties and logprob positions go on; the client's text goes on with no gap and
    nothing repeated. `first_move` (default `move`) answers the first engine failure: the
    samples of a shared stream leave its engine together, as one move.
    """

    def __init__(self, source: TextStream | SampleFeed, engine: Target, detok: DetokClient,
                 job: GenerateJob, options: DetokOptions, move: Move | None = None,
                 first_move: Move | None = None):
        self.engine_id, self._engine_address = engine
        self._source = source
        self._deltas = aiter(source)
        self._detok = detok
        self._job = job
        self._options = options
        self._move = move
        self._next_move = first_move or move
        self._token_ids: list[int] = []
        self._so_far = TextSoFar()
        self._usage = TokenUsage(prompt_tokens=len(job.prompt_token_ids))
        self._earlier_drafts = (0, 0)
        """Draft counts (verified, accepted) of the engines this choice moved away from
        (`_usage` has the current engine's, which start again from 0)."""
        self._detoks_tried: list[str] = []
        self._num_resumes = 0
        self._over = False

    async def next_delta(self) -> GenerationDelta | None:
        """The next delta (its last one carries the finish), or None after it."""
        while not self._over:
            try:
                delta = await anext(self._deltas, None)
            except UpstreamError as failure:
                if (last := await self._resume(failure)) is not None:
                    return last
                continue
            if delta is None:
                raise UpstreamError("detok", "INTERNAL",
                                    "the Generate stream ended before the generation finished")
            self._record(delta)
            if delta.finish_reason == ABORT:  # e.g. the engine is draining
                delta.finish_reason = delta.usage = None
                failure = EngineAborted("the engine aborted the request")
                if (last := await self._resume(failure)) is not None:
                    return last
                if delta.token_ids or delta.text or delta.tool_calls:
                    return delta
                continue
            if delta.finish_reason is not None:
                self._over = True
                delta.usage = self._total_usage(len(self._token_ids))
            else:
                delta.usage = None  # a choice's usage comes with its last delta
            return delta
        return None

    async def close(self) -> None:
        """Cancel the choice's stream."""
        self._over = True
        self._source.cancel()

    def _record(self, delta: GenerationDelta) -> None:
        self._token_ids.extend(delta.token_ids)
        self._so_far.num_chars += len(delta.text)
        arguments = self._so_far.argument_chars
        for piece in delta.tool_calls:
            if piece.index == len(arguments):  # a new call's header
                arguments.append(0)
            arguments[piece.index] += len(piece.arguments)
        if delta.usage is not None:
            self._usage = delta.usage

    async def _resume(self, failure: UpstreamError | EngineAborted) -> GenerationDelta | None:
        """Go on after `failure` on a new stream; the choice's last delta instead when it
        had produced all its tokens (only the finish was lost). Raises `failure` when the
        choice may not go on."""
        self._source.cancel()
        engine_failed = _is_engine_failure(failure)
        if not engine_failed and not _is_detok_failure(failure):
            raise failure
        if len(self._token_ids) >= self._job.sampling.max_tokens:
            self._over = True
            return GenerationDelta("", [], [], "length",
                                   usage=self._total_usage(len(self._token_ids)))
        if engine_failed:
            await self._move_engine(failure)
        else:
            self._detok.failed(self._source.replica, failure, len(self._token_ids))
            self._detoks_tried.append(self._source.replica)
            if len(self._detoks_tried) >= self._detok.max_attempts:
                raise failure
        resumed = bool(self._token_ids)
        self._num_resumes += 1
        job = replace(self._job.resumed(self._token_ids),
                      request_id=f"{self._job.request_id}-r{self._num_resumes}")
        self._source = await self._detok.generate(
            self._engine_address, job, self._options, [],
            replace(self._so_far, argument_chars=list(self._so_far.argument_chars))
            if resumed else None, exclude=self._detoks_tried)
        self._deltas = aiter(self._source)
        return None

    async def _move_engine(self, failure: UpstreamError | EngineAborted) -> None:
        target = await self._next_move(self.engine_id, failure) \
            if self._next_move is not None else None
        self._next_move = self._move
        if target is None:
            raise failure
        self.engine_id, self._engine_address = target
        usage = self._usage
        self._earlier_drafts = (self._earlier_drafts[0] + usage.draft_tokens,
                                self._earlier_drafts[1] + usage.accepted_draft_tokens)
        self._usage = TokenUsage(usage.prompt_tokens, cached_tokens=usage.cached_tokens)

    def _total_usage(self, num_completion_tokens: int) -> TokenUsage:
        """The choice's usage at its end, its draft counts over every engine it ran on."""
        usage = self._usage
        return TokenUsage(usage.prompt_tokens, num_completion_tokens, usage.cached_tokens,
                          self._earlier_drafts[0] + usage.draft_tokens,
                          self._earlier_drafts[1] + usage.accepted_draft_tokens)


def _is_engine_failure(error: UpstreamError | EngineAborted) -> bool:
    """The engine went away mid-stream, not the request being wrong."""
    if isinstance(error, EngineAborted):
        return True
    return error.service == "engine" and error.code in ("UNAVAILABLE", "CANCELLED")


def _is_detok_failure(error: UpstreamError | EngineAborted) -> bool:
    """The detok replica went away (or gave the call up), not the request being wrong."""
    return isinstance(error, UpstreamError) and error.service == "detok" and \
        error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def shared_move(move: Move) -> Move:
    """`move` asked once for all the samples of one shared stream: they left the same
    engine at the same time, so they go on together, and count as one move."""
    lock = asyncio.Lock()
    answers: list[Target | None] = []

    async def moved(engine_id: str, failure: UpstreamError | EngineAborted):
        async with lock:
            if not answers:
                answers.append(await move(engine_id, failure))
        return answers[0]

    return moved


class ChoiceStreams:
    """The choices of one request, their deltas merged in arrival order.

    One choice is read directly; several are raced with one pending read each, so a
    delta waits on nothing but its own choice. `close()` closes every choice, then the
    shared streams they read.
    """

    def __init__(self) -> None:
        self.choices: list[ChoiceStream] = []
        self._shared: list[SharedStream] = []
        self._reads: dict[asyncio.Future, int] = {}
        self._done: set[int] = set()

    async def open(self, detok: DetokClient, target: Target, job: GenerateJob,
                   choice_ids: list[str], options_of: Callable[[str], DetokOptions],
                   move: Move) -> None:
        """A choice per sample of `job` on the engine `target`, sample i named
        `choice_ids[i]` (its text options are `options_of` that id): for n = 1 on a stream
        of its own; for n > 1 on one stream split by sample, whose samples leave a failed
        engine together (one move). A stream opened is closed by `close()`."""
        if job.n == 1:
            sources = [await detok.generate(target[1], job, options_of(choice_ids[0]), [])]
            first_move = move
        else:
            shared = SharedStream(await detok.generate(
                target[1], job, options_of(job.request_id), choice_ids), job.n)
            self._shared.append(shared)
            sources, first_move = shared.feeds, shared_move(move)
        for sample, (source, choice_id) in enumerate(zip(sources, choice_ids, strict=True)):
            self.choices.append(ChoiceStream(source, target, detok,
                                             job.sample(sample, choice_id),
                                             options_of(choice_id), move, first_move))

    async def next_delta(self) -> tuple[int, GenerationDelta] | None:
        """(choice index, delta) of the next output, None once every choice is over."""
        if len(self.choices) == 1:
            delta = await self.choices[0].next_delta()
            return None if delta is None else (0, delta)
        while True:
            self._start_reads()
            if not self._reads:
                return None
            done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
            read = min(done, key=self._reads.__getitem__)  # lowest index first on a tie
            index = self._reads.pop(read)
            delta = read.result()
            if delta is not None:
                return index, delta
            self._done.add(index)

    async def close(self) -> None:
        for read in self._reads:
            read.cancel()
        await asyncio.gather(*self._reads, *(c.close() for c in self.choices),
                             return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self._shared), return_exceptions=True)
        self._reads.clear()

    def _start_reads(self) -> None:
        reading = set(self._reads.values())
        for index, choice in enumerate(self.choices):
            if index not in reading and index not in self._done:
                self._reads[asyncio.ensure_future(choice.next_delta())] = index
