"""One generation: an engine Generate stream fed through a detok stream.

The engine's tokens go to detok as they arrive (a pump task); detok's replies
come out as GenerationDeltas. A stop-string match cancels the engine stream;
leaving the iteration early (client gone, timeout) cancels both streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conveyor.gateway.detok_client import DetokClient, DetokStream
from conveyor.gateway.detok_records import DetokOptions, DetokReply
from conveyor.gateway.engine_client import EngineClient, EngineStream
from conveyor.gateway.engine_records import (
    EngineChunk,
    FinishReason,
    GenerateJob,
    PositionLogprobs,
    TokenUsage,
)
from conveyor.gateway.upstream_error import UpstreamError


class EngineAborted(Exception):
    """The engine ended the request itself (it is draining or failed to schedule it)."""


@dataclass(slots=True)
class GenerationDelta:
    """New text and the output tokens it came from; the last delta has a finish_reason
    ("stop" or "length"), the stop reason (stop string or token id) and the usage."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: TokenUsage | None = None


@dataclass(slots=True)
class _Progress:
    """What the engine produced so far; detok replies say how much of it became text."""

    usage: TokenUsage
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_reported: int = 0
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None

    def record(self, chunk: EngineChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.usage.prompt_tokens:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_token_id = chunk.stop_token_id

    def delta(self, reply: DetokReply) -> GenerationDelta:
        token_ids, logprobs = self._take(reply.num_tokens)
        return GenerationDelta(reply.text_delta, token_ids, logprobs)

    def stopped_by_string(self, reply: DetokReply) -> GenerationDelta:
        match = reply.stop_match
        token_ids, logprobs = self._take(match.num_tokens)
        usage = TokenUsage(self.usage.prompt_tokens, match.num_tokens, self.usage.cached_tokens)
        return GenerationDelta(reply.text_delta, token_ids, logprobs, "stop", match.stop, usage)

    def finished(self) -> GenerationDelta:
        token_ids, logprobs = self._take(len(self.token_ids))
        usage = TokenUsage(
            self.usage.prompt_tokens, len(self.token_ids), self.usage.cached_tokens
        )
        return GenerationDelta(
            "", token_ids, logprobs, self.finish_reason.value, self.stop_token_id, usage
        )

    def _take(self, upto: int) -> tuple[list[int], list[PositionLogprobs]]:
        """The tokens in [num_reported, upto) and their logprobs (if any were asked for)."""
        start, end = self.num_reported, max(self.num_reported, min(upto, len(self.token_ids)))
        self.num_reported = end
        return self.token_ids[start:end], self.logprobs[start:end]


async def generate(
    engine: EngineClient, detok: DetokClient, job: GenerateJob, detok_options: DetokOptions
) -> AsyncIterator[GenerationDelta]:
    """Run one generation; closing the iterator early cancels the engine and detok streams."""
    progress = _Progress(TokenUsage(prompt_tokens=len(job.prompt_token_ids)))
    detok_stream = detok.open(detok_options)
    engine_stream = engine.generate(job)
    pump = asyncio.create_task(_pump(engine_stream, detok_stream, progress))
    pump.add_done_callback(_retrieve_exception)
    try:
        async for reply in _replies(detok_stream, pump):
            if reply.stop_match is not None:
                engine_stream.cancel()
                yield progress.stopped_by_string(reply)
                return
            if reply.text_delta or reply.num_tokens > progress.num_reported:
                yield progress.delta(reply)
        await pump
        yield progress.finished()
    finally:
        engine_stream.cancel()
        detok_stream.cancel()
        pump.cancel()


async def _pump(engine_stream: EngineStream, detok_stream: DetokStream, progress: _Progress):
    """Feed the engine's tokens to detok; on the engine's finish, let detok flush."""
    try:
        async for chunk in engine_stream:
            progress.record(chunk)
            if chunk.token_ids and not detok_stream.send_tokens(chunk.token_ids):
                return  # detok ended the stream: a stop string matched
            if chunk.finish_reason is not None:
                break
        _check_finished(progress.finish_reason)
        detok_stream.finish()
    except BaseException:
        detok_stream.cancel()  # wakes the reader, which then raises this error
        raise


def _check_finished(reason: FinishReason | None) -> None:
    if reason is None:
        raise UpstreamError("engine", "INTERNAL", "the Generate stream ended without a finish")
    if reason is FinishReason.ABORT:
        raise EngineAborted("the engine aborted the request")


async def _replies(detok_stream: DetokStream, pump: asyncio.Task) -> AsyncIterator[DetokReply]:
    """Detok's replies; when the pump failed (and so cancelled detok), its error instead."""
    try:
        async for reply in detok_stream.replies():
            yield reply
    except (UpstreamError, asyncio.CancelledError):
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            raise pump.exception() from None
        raise


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
