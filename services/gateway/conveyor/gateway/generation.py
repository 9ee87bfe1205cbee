"""One choice of a request: an engine Generate stream fed through a detok stream.

A reader task (the only task a token crosses) takes the engine's chunks and sends
their token ids to detok; the request's own task reads detok's replies as
GenerationDeltas (`next_delta`). A stop-string match cancels the engine stream.
`close()` cancels both streams and the reader and waits for the reader to let go;
the request that opened the choice registers it for closing when it opens it
(generation_request.py), so a choice is closed on every way out.

The n samples of one prompt share one engine stream (`SharedStream`, the engine
computes the prompt once): a demultiplexing task hands each chunk to its sample's
`SampleFeed`, which a choice reads as it reads an engine stream of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from conveyor.gateway.errors import EngineAborted
from conveyor.gateway.routing.router import EngineClient, EngineStream
from conveyor.gateway.text_services import DetokClient, DetokStream
from conveyor.gateway.wire import (
    DetokOptions,
    DetokReply,
    EngineChunk,
    FinishReason,
    GenerateJob,
    PositionLogprobs,
    TokenUsage,
    ToolCallDelta,
    UpstreamError,
)


@dataclass(slots=True)
class GenerationDelta:
    """New text (content), pieces of tool calls, and the output tokens they came from; the
    last delta has a finish_reason ("stop" or "length"), the stop reason (stop string or
    token id) and the usage. The first delta of a choice whose engine computed prompt
    logprobs carries them (prompt positions 1 .. len - 1)."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: TokenUsage | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class _Progress:
    """What the engine produced so far; detok replies say how much of it became text."""

    usage: TokenUsage
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_reported: int = 0
    prompt_logprobs: list[PositionLogprobs] | None = None
    """The engine's prompt logprobs until a delta carries them (then [])."""
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    stopped_by_detok: bool = False
    """Detok ended the stream at a stop string: the engine's finish no longer matters."""
    num_earlier_drafts: int = 0
    num_earlier_accepted_drafts: int = 0
    """Draft counts of the engines this choice moved away from (`usage` has the current
    engine's, which start again from 0)."""

    @property
    def num_produced(self) -> int:
        return len(self.token_ids)

    def record(self, chunk: EngineChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.usage.prompt_tokens:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_token_id = chunk.stop_token_id

    def moved(self) -> None:
        """The next chunks come from another engine: keep this one's draft counts."""
        self.num_earlier_drafts += self.usage.draft_tokens
        self.num_earlier_accepted_drafts += self.usage.accepted_draft_tokens
        self.usage = TokenUsage(self.usage.prompt_tokens, cached_tokens=self.usage.cached_tokens)

    def delta(self, reply: DetokReply) -> GenerationDelta:
        token_ids, logprobs = self._take(reply.num_tokens)
        return GenerationDelta(reply.text_delta, token_ids, logprobs,
                               tool_calls=reply.tool_calls,
                               prompt_logprobs=self._take_prompt_logprobs())

    def stopped_by_string(self, reply: DetokReply) -> GenerationDelta:
        match = reply.stop_match
        token_ids, logprobs = self._take(match.num_tokens)
        return GenerationDelta(reply.text_delta, token_ids, logprobs, "stop", match.stop,
                               self._usage(match.num_tokens), reply.tool_calls,
                               self._take_prompt_logprobs())

    def finished(self) -> GenerationDelta:
        token_ids, logprobs = self._take(len(self.token_ids))
        return GenerationDelta("", token_ids, logprobs, self.finish_reason.value,
                               self.stop_token_id, self._usage(len(self.token_ids)),
                               prompt_logprobs=self._take_prompt_logprobs())

    def _usage(self, num_completion_tokens: int) -> TokenUsage:
        """The choice's usage at its end, its draft counts over every engine it ran on."""
        usage = self.usage
        return TokenUsage(usage.prompt_tokens, num_completion_tokens, usage.cached_tokens,
                          self.num_earlier_drafts + usage.draft_tokens,
                          self.num_earlier_accepted_drafts + usage.accepted_draft_tokens)

    def _take_prompt_logprobs(self) -> list[PositionLogprobs]:
        taken, self.prompt_logprobs = self.prompt_logprobs or [], []
        return taken

    def _take(self, upto: int) -> tuple[list[int], list[PositionLogprobs]]:
        """The tokens in [num_reported, upto) and their logprobs (if any were asked for)."""
        start, end = self.num_reported, max(self.num_reported, min(upto, len(self.token_ids)))
        self.num_reported = end
        return self.token_ids[start:end], self.logprobs[start:end]


Move = Callable[[str, UpstreamError | EngineAborted],
                Awaitable[tuple[str, EngineClient] | None]]
"""Where a choice whose engine (by id) failed mid-stream goes on: another engine's id
and client, or None when it may not move (GenerationRequest decides and records it)."""


class SampleFeed:
    """One sample's chunks of a SharedStream, read as an engine stream of its own:
    iterate it for chunks; `cancel()` says this sample wants no more (the engine stream
    is cancelled once every sample's feed is)."""

    def __init__(self, shared: SharedStream):
        self._shared = shared
        self._queue: asyncio.Queue[EngineChunk | UpstreamError | None] = asyncio.Queue()
        self.cancelled = False

    async def __aiter__(self):
        while (item := await self._queue.get()) is not None:
            if isinstance(item, UpstreamError):
                raise item
            yield item

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._shared.left()

    def put(self, item: EngineChunk | UpstreamError | None) -> None:
        """The next chunk, the error that broke the stream, or None at its end."""
        self._queue.put_nowait(item)


class SharedStream:
    """One engine Generate stream carrying the n samples of one prompt, split by each
    chunk's sample index into `feeds[index]` by a task of its own. A broken stream
    reaches every feed as its error (so each sample moves on alone: `GenerateJob.sample`);
    its end ends every feed. `close()` cancels the stream and waits for the task."""

    def __init__(self, stream: EngineStream, n: int):
        self._stream = stream
        self.feeds = [SampleFeed(self) for _ in range(n)]
        self._task = asyncio.create_task(self._split())
        self._task.add_done_callback(_retrieve_exception)

    def left(self) -> None:
        """A feed was cancelled; with the last one, the engine stream goes too."""
        if all(feed.cancelled for feed in self.feeds):
            self._stream.cancel()

    async def close(self) -> None:
        self._stream.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _split(self) -> None:
        end: UpstreamError | None = None
        try:
            async for chunk in self._stream:
                feed = self.feeds[chunk.index] if chunk.index < len(self.feeds) else None
                if feed is not None and not feed.cancelled:  # else nobody reads it
                    feed.put(chunk)
        except UpstreamError as error:
            end = error
        for feed in self.feeds:
            feed.put(end)


class ChoiceStream:
    """One running generation. Opening it starts the detok stream and the reader over
    `stream` (the choice's own engine stream, or its sample's feed of a shared one);
    `next_delta()` returns the next delta, None once the choice is over.

    When the engine stream breaks (the engine died, drained past its timeout, or its
    node went away: UNAVAILABLE, a server-side CANCELLED, or an abort) the reader asks
    `move` for another engine and resubmits `job` there (alone, n = 1) with the tokens
    produced so far as output already produced (resume_output_token_ids), not as
    prompt: the same sampling settings and budget, penalties and logprob positions as
    they were. Detok already has those tokens, so the client's text goes on with no gap
    and nothing repeated. `first_move` (default `move`) answers the first failure: the
    samples of a shared stream leave its engine together, as one move.
    """

    def __init__(self, stream: EngineStream | SampleFeed, engine_id: str, detok: DetokClient,
                 job: GenerateJob, detok_options: DetokOptions, move: Move | None = None,
                 first_move: Move | None = None):
        self.progress = _Progress(TokenUsage(prompt_tokens=len(job.prompt_token_ids)))
        self.engine_id = engine_id
        self._job = job
        self._move = move
        self._next_move = first_move or move
        self._detok = detok.open(detok_options)
        self._engine = stream
        self._replies = aiter(self._detok.replies())
        self._reader = asyncio.create_task(self._read_engine())
        self._reader.add_done_callback(_retrieve_exception)
        self._over = False

    async def next_delta(self) -> GenerationDelta | None:
        """The next text delta (its last one carries the finish), or None after it."""
        while not self._over:
            reply = await self._next_reply()
            if reply is None:
                await self._reader  # raises the engine's failure, if that ended it
                self._over = True
                if self.progress.finish_reason is None:
                    raise UpstreamError("detok", "INTERNAL",
                                        "the Detokenize stream ended before the engine finished")
                return self.progress.finished()
            if reply.stop_match is not None:
                self._engine.cancel()
                self._over = True
                return self.progress.stopped_by_string(reply)
            if reply.text_delta or reply.tool_calls or \
                    reply.num_tokens > self.progress.num_reported:
                return self.progress.delta(reply)
        return None

    async def close(self) -> None:
        """Cancel the engine and detok streams and the reader; wait for the reader."""
        self._over = True
        self._engine.cancel()
        self._detok.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _next_reply(self) -> DetokReply | None:
        """Detok's next reply; when the reader failed (and so cancelled detok), its error."""
        try:
            return await anext(self._replies, None)
        except (UpstreamError, asyncio.CancelledError):
            reader = self._reader
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception() from None
            raise

    async def _read_engine(self) -> None:
        """Feed the engine's tokens to detok (moving to another engine when it fails);
        on the engine's finish, let detok flush."""
        try:
            while (failure := await _forward(self._engine, self._detok, self.progress)):
                if self.progress.num_produced >= self._job.sampling.max_tokens:
                    self.progress.finish_reason = FinishReason.LENGTH  # only the finish lost
                    break
                self._engine = await self._moved(failure)
            if not self.progress.stopped_by_detok:
                _check_finished(self.progress.finish_reason)
                self._detok.finish()
        except BaseException:
            self._detok.cancel()  # wakes the request's task, which then raises this error
            raise

    async def _moved(self, failure: UpstreamError | EngineAborted) -> EngineStream:
        """The generation resubmitted on another engine; else the failure, raised."""
        target = None
        if self._next_move is not None and _is_engine_failure(failure):
            target = await self._next_move(self.engine_id, failure)
            self._next_move = self._move
        if target is None:
            raise failure
        self.engine_id, client = target
        self.progress.moved()
        return client.generate(self._job.resumed(self.progress.token_ids))


async def _forward(engine_stream: EngineStream | SampleFeed, detok_stream: DetokStream,
                   progress: _Progress) -> UpstreamError | EngineAborted | None:
    """Forward chunks until the engine finishes or detok ends the stream at a stop
    string (None), or the engine stream breaks (why it broke)."""
    try:
        async for chunk in engine_stream:
            progress.record(chunk)
            if chunk.token_ids and not detok_stream.send_tokens(chunk.token_ids):
                progress.stopped_by_detok = True  # detok ended the stream: a stop string
                return None
            if chunk.finish_reason is not None:
                break
    except UpstreamError as error:
        return error
    if progress.finish_reason is FinishReason.ABORT:  # e.g. the engine is draining
        progress.finish_reason = None
        return EngineAborted("the engine aborted the request")
    return None


def _is_engine_failure(error: UpstreamError | EngineAborted) -> bool:
    """The engine went away mid-stream, not the request being wrong."""
    if isinstance(error, EngineAborted):
        return True
    return error.service == "engine" and error.code in ("UNAVAILABLE", "CANCELLED")


def _check_finished(reason: FinishReason | None) -> None:
    if reason is None:
        raise UpstreamError("engine", "INTERNAL", "the Generate stream ended without a finish")


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def shared_move(move: Move) -> Move:
    """`move` asked once for all the samples of one shared stream: they left the same
    engine at the same time, so they go on together, and count as one move."""
    lock = asyncio.Lock()
    answers: list[tuple[str, EngineClient] | None] = []

    async def moved(engine_id: str, failure: UpstreamError | EngineAborted):
        async with lock:
            if not answers:
                answers.append(await move(engine_id, failure))
        return answers[0]

    return moved


class ChoiceStreams:
    """The choices of one request, their deltas merged in arrival order.

    One choice is read directly; several are raced with one pending read each, so a
    delta waits on nothing but its own choice. `close()` closes every choice.
    """

    def __init__(self) -> None:
        self.choices: list[ChoiceStream] = []
        self._shared: list[SharedStream] = []
        self._reads: dict[asyncio.Future, int] = {}
        self._done: set[int] = set()

    def add(self, choice: ChoiceStream) -> None:
        self.choices.append(choice)

    def add_shared(self, shared: SharedStream) -> None:
        """A stream some of the choices read (closed after them)."""
        self._shared.append(shared)

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
