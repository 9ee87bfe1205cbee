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
_END = object()


class DetokStream:
    """An open Detokenize stream: send token ids in, read text replies out.

    Messages go out through a queue that gRPC drains (sending never waits on the
    network). The server ends the stream after a stop match or after `finish()`;
    sending to an ended stream is a no-op that returns False. `cancel()` always
    ends the outgoing side too, so no gRPC task is left waiting for messages.
    """

    def __init__(self, stub: detok_pb2_grpc.DetokenizerStub, options: DetokOptions):
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._outbox.put_nowait(convert.detok_start(options))
        self._call = stub.Detokenize(self._outgoing())

    def send_tokens(self, token_ids: list[int]) -> bool:
        """Send new output tokens; False when the server already ended the stream."""
        if self._call.done():
            return False
        self._outbox.put_nowait(convert.detok_tokens(token_ids))
        return True

    def finish(self) -> None:
        """Tell the server the engine finished, so it flushes held-back text."""
        self._outbox.put_nowait(convert.detok_finish())
        self._outbox.put_nowait(_END)

    async def replies(self) -> AsyncIterator[DetokReply]:
        with translate_rpc_errors(SERVICE):
            async for message in self._call:
                yield convert.detok_reply(message)

    def cancel(self) -> None:
        self._call.cancel()
        self._outbox.put_nowait(_END)

    async def _outgoing(self):
        while (message := await self._outbox.get()) is not _END:
            yield message


class DetokClient:
    """Opens detok streams over one shared channel."""

    def __init__(self, channel: grpc.aio.Channel, rpc_timeout_s: float = 2.0):
        self._channel = channel
        self._stub = detok_pb2_grpc.DetokenizerStub(channel)
        self._timeout_s = rpc_timeout_s

    def open(self, options: DetokOptions) -> DetokStream:
        """Start a stream; its options are its first message."""
        return DetokStream(self._stub, options)

    async def is_serving(self) -> bool:
        return await is_serving(self._channel, timeout_s=self._timeout_s)
