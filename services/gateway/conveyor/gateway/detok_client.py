"""Client of the detok service: one bidirectional stream per generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from conveyor.common.grpc_client import is_serving
from conveyor.gateway import convert
from conveyor.gateway.detok_records import DetokOptions, DetokReply
from conveyor.gateway.upstream_error import translate_rpc_errors
from conveyor.v1 import detok_pb2_grpc

SERVICE = "detok"


class DetokStream:
    """An open Detokenize stream: send token ids in, read text replies out.

    The server ends the stream after a stop match or after `finish()`; sending
    to an ended stream is a no-op that returns False.
    """

    def __init__(self, call: grpc.aio.StreamStreamCall):
        self._call = call

    async def start(self, options: DetokOptions) -> None:
        """Send the stream's options (its first message)."""
        if not await self._write(convert.detok_start(options)):
            raise RuntimeError("the detok stream ended before it started")

    async def send_tokens(self, token_ids: list[int]) -> bool:
        """Send new output tokens; False when the server already ended the stream."""
        return await self._write(convert.detok_tokens(token_ids))

    async def finish(self) -> None:
        """Tell the server the engine finished, so it flushes held-back text."""
        if await self._write(convert.detok_finish()):
            await self._call.done_writing()

    async def replies(self) -> AsyncIterator[DetokReply]:
        with translate_rpc_errors(SERVICE):
            while (message := await self._call.read()) is not grpc.aio.EOF:
                yield convert.detok_reply(message)

    def cancel(self) -> None:
        self._call.cancel()

    async def _write(self, message) -> bool:
        if self._call.done():
            return False
        try:
            with translate_rpc_errors(SERVICE):
                await self._call.write(message)
        except asyncio.InvalidStateError:
            return False
        return True


class DetokClient:
    """Opens detok streams over one shared channel."""

    def __init__(self, channel: grpc.aio.Channel, rpc_timeout_s: float = 2.0):
        self._channel = channel
        self._stub = detok_pb2_grpc.DetokenizerStub(channel)
        self._timeout_s = rpc_timeout_s

    async def is_serving(self) -> bool:
        return await is_serving(self._channel, timeout_s=self._timeout_s)

    async def open(self, options: DetokOptions) -> DetokStream:
        """Start a stream and send its options."""
        stream = DetokStream(self._stub.Detokenize())
        try:
            await stream.start(options)
        except BaseException:
            stream.cancel()
            raise
        return stream
