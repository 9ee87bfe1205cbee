"""A scripted fake engine for the detok tests: its Generate streams given token ids per
sample, in given chunks, and records each call and how it ended. conftest.py loads this
file (the tests folder is not a package) as `detok_scripted_engine`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from conveyor.common.errors import ERROR_REASON_KEY
from conveyor.common.grpc_server import GrpcService, ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.v1 import engine_pb2, engine_pb2_grpc

FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
"""How a Generate call ended on the engine's side."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample's script: its token ids, in chunks of `chunk_sizes` (empty: one token a
    chunk; what is left after them is one last chunk), `finish_reason` on the last chunk
    (None: the sample never finishes: the stream stays open once every script is out, as
    if it were still generating, until the call is cancelled), and the stop token id
    that finished it."""

    token_ids: list[int]
    chunk_sizes: tuple[int, ...] = ()
    finish_reason: int | None = engine_pb2.FINISH_REASON_LENGTH
    stop_token_id: int | None = None

    def chunks(self) -> list[list[int]]:
        if not self.chunk_sizes:
            return [[token_id] for token_id in self.token_ids]
        chunks, start = [], 0
        for size in self.chunk_sizes:
            chunks.append(self.token_ids[start:start + size])
            start += size
        if start < len(self.token_ids):
            chunks.append(self.token_ids[start:])
        return chunks


@dataclass(frozen=True, slots=True)
class Failure:
    """The engine fails the call once it has streamed `after_tokens` tokens (all samples
    counted; at the script's end when it has fewer) with `code` and `message`, and
    `reason` (when given) as the trailing metadata's conveyor-error-reason."""

    after_tokens: int
    code: grpc.StatusCode
    message: str
    reason: str | None = None


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Streams `samples[i]` as sample i, for i below the request's n, the samples' chunks
    interleaved (each sample's first chunk, then each one's second, ...); usage counts the
    prompt and each sample's tokens (resumed ones included), logprobs and prompt logprobs
    come when asked for (their alternatives: the ids after the token's). `fail` fails the
    call part way; `hold_after` tokens (all samples counted) the stream waits for
    `release` to be set.

    `requests` holds every call's request, `outcomes` how each ended (FINISHED, FAILED,
    CANCELLED); `ended()` waits until every call so far has ended."""

    def __init__(self, *samples: Sample, fail: Failure | None = None,
                 hold_after: int | None = None):
        self.samples = samples
        self.fail = fail
        self.hold_after = hold_after
        self.release = asyncio.Event()
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.outcomes: list[str] = []
        self._all_ended = asyncio.Event()

    async def ended(self, timeout_s: float = 10.0) -> str:
        """How the last call ended, once every call so far has (at most `timeout_s`)."""
        await asyncio.wait_for(self._all_ended.wait(), timeout_s)
        return self.outcomes[-1]

    async def Generate(self, request, context):
        self.requests.append(request)
        self._all_ended.clear()
        outcome = CANCELLED  # unless the stream gets to its end or its failure
        try:
            num_sent = 0
            for chunk in self._chunks(request):
                if self.fail is not None and num_sent >= self.fail.after_tokens:
                    break
                if self.hold_after is not None and num_sent >= self.hold_after:
                    await self.release.wait()
                yield chunk
                num_sent += len(chunk.token_ids)
            if self.fail is not None:
                outcome = FAILED
                await self._abort(context)
            if any(s.finish_reason is None for s in self._samples(request)):
                await asyncio.Event().wait()  # still generating, until cancelled
            outcome = FINISHED
        finally:
            self.outcomes.append(outcome)
            if len(self.outcomes) == len(self.requests):
                self._all_ended.set()

    def _samples(self, request) -> tuple[Sample, ...]:
        return self.samples[:max(1, request.n)]

    def _chunks(self, request):
        samples = [sample.chunks() for sample in self._samples(request)]
        num_tokens = [len(request.resume_output_token_ids)] * len(samples)
        for position in range(max(len(chunks) for chunks in samples)):
            for index, chunks in enumerate(samples):
                if position < len(chunks):
                    num_tokens[index] += len(chunks[position])
                    yield self._response(request, index, chunks[position],
                                         position == len(chunks) - 1, num_tokens[index])

    def _response(self, request, index: int, token_ids: list[int], last: bool,
                  num_tokens: int) -> engine_pb2.GenerateResponse:
        sample = self.samples[index]
        response = engine_pb2.GenerateResponse(
            index=index, token_ids=token_ids,
            usage=engine_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=num_tokens))
        sampling = request.sampling
        if sampling.logprobs:
            response.logprobs.extend(
                engine_pb2.PositionLogprobs(logprob=-token_id / 1000,
                                            top=_alternatives(token_id, sampling.top_logprobs))
                for token_id in token_ids)
        if sampling.HasField("prompt_logprobs") and index == 0 and \
                num_tokens == len(token_ids):  # sample 0's first chunk
            response.prompt_logprobs.extend(
                engine_pb2.PositionLogprobs(logprob=-0.5, rank=1,
                                            top=_alternatives(i, sampling.prompt_logprobs))
                for i in request.prompt_token_ids[1:])
        if last and sample.finish_reason is not None:
            response.finish_reason = sample.finish_reason
            if sample.stop_token_id is not None:
                response.stop_token_id = sample.stop_token_id
        return response

    async def _abort(self, context) -> None:
        if self.fail.reason is not None:
            context.set_trailing_metadata(((ERROR_REASON_KEY, self.fail.reason),))
        await context.abort(self.fail.code, self.fail.message)


def _alternatives(token_id: int, num: int) -> list[engine_pb2.TokenLogprob]:
    """`num` alternatives of a position: the ids after `token_id`."""
    return [engine_pb2.TokenLogprob(token_id=token_id + k, logprob=-1.0 - k)
            for k in range(1, num + 1)]


async def serve(engine: ScriptedEngine) -> GrpcService:
    """`engine` on a free port of 127.0.0.1 (stop its `server` when done)."""
    return await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, engine)])
