"""Client of the detok service: one bidirectional stream per generation, balanced over
the detok replicas and rebuilt on another replica when its replica fails.

A rebuilt stream re-sends its options and every token id so far (and the finish,
if sent), and skips as much of the new stream's text as the caller already got:
detokenization is deterministic, so the new text starts with the old. The caller
sees one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from conveyor.common.replica_set import Replica, ReplicaSet, is_replica_failure
from conveyor.gateway import wire
from conveyor.gateway.wire import DetokOptions, DetokReply, translate_rpc_errors
from conveyor.v1 import detok_pb2_grpc

SERVICE = "detok"
_END = object()
log = logging.getLogger("conveyor.gateway.detok")


class _Attempt:
    """One Detokenize call on one replica, fed from a queue that gRPC drains."""

    def __init__(self, replica: Replica, first_messages: list):
        self.replica = replica
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.num_chars_in = 0
        """Text this call produced so far (the caller may have had some of it already)."""
        for message in first_messages:
            self.outbox.put_nowait(message)
        self.call = detok_pb2_grpc.DetokenizerStub(replica.channel).Detokenize(self._outgoing())

    def send(self, message) -> None:
        self.outbox.put_nowait(message)

    def end(self) -> None:
        """Cancel the call and end the outgoing side, so no gRPC task waits on it."""
        self.call.cancel()
        self.outbox.put_nowait(_END)

    async def _outgoing(self):
        while (message := await self.outbox.get()) is not _END:
            yield message


class DetokStream:
    """An open Detokenize stream: send token ids in, read text replies out.

    Messages go out through a queue that gRPC drains (sending never waits on the
    network). The server ends the stream after a stop match or after `finish()`;
    sending to an ended stream is a no-op that returns False. `cancel()` always
    ends the outgoing side too, so no gRPC task is left waiting for messages. The
    call starts on a replica when `replies()` is first iterated.
    """

    def __init__(self, replicas: ReplicaSet, options: DetokOptions):
        self._replicas = replicas
        self._options = options
        self._token_ids: list[int] = []
        self._finished = False
        self._ended = False
        self._num_chars_out = 0
        self._num_tokens_out = 0
        self._attempt: _Attempt | None = None

    def send_tokens(self, token_ids: list[int]) -> bool:
        """Send new output tokens; False when the server already ended the stream."""
        if self._ended:
            return False
        self._token_ids.extend(token_ids)
        if self._attempt is not None:
            self._attempt.send(wire.detok_tokens(token_ids))
        return True

    def finish(self) -> None:
        """Tell the server the engine finished, so it flushes held-back text."""
        self._finished = True
        if self._attempt is not None:
            self._attempt.send(wire.detok_finish())
            self._attempt.send(_END)

    async def replies(self) -> AsyncIterator[DetokReply]:
        """The stream's replies; a replica that fails is replaced (up to the replica set's
        max_attempts replicas), its text not repeated."""
        tried: list[str] = []
        with translate_rpc_errors(SERVICE):
            while not self._ended:  # cancelled before a replica was picked
                attempt = await self._open(tried)
                if self._ended:  # cancelled while one was picked
                    attempt.end()
                    return
                try:
                    async for message in attempt.call:
                        reply = self._fresh(wire.detok_reply(message), attempt)
                        if reply is not None:
                            yield reply
                    self._ended = True
                    return
                except grpc.aio.AioRpcError as error:
                    tried.append(attempt.replica.address)
                    if not is_replica_failure(error) or len(tried) >= self._replicas.max_attempts:
                        raise
                    self._replicas.failed(attempt.replica.address, error)

    def cancel(self) -> None:
        self._ended = True
        if self._attempt is not None:
            self._attempt.end()

    async def _open(self, tried: list[str]) -> _Attempt:
        """A call on a replica not yet tried, fed everything sent so far."""
        replica = await self._replicas.pick(exclude=tried)
        if self._attempt is not None:
            self._attempt.end()
            log.warning("detok stream %s rebuilt on %s from %d token ids (%d chars already "
                        "out)", self._options.request_id, replica.address,
                        len(self._token_ids), self._num_chars_out)
        messages = [wire.detok_start(self._options)]
        if self._token_ids:
            messages.append(wire.detok_tokens(self._token_ids))
        if self._finished:
            messages += [wire.detok_finish(), _END]
        self._attempt = _Attempt(replica, messages)
        return self._attempt

    def _fresh(self, reply: DetokReply, attempt: _Attempt) -> DetokReply | None:
        """`reply` without the text the caller already has; None when nothing is new."""
        num_before = attempt.num_chars_in
        attempt.num_chars_in += len(reply.text_delta)
        text = reply.text_delta[max(0, self._num_chars_out - num_before):]
        self._num_chars_out += len(text)
        if reply.stop_match is not None:
            self._ended = True
        elif not text and reply.num_tokens <= self._num_tokens_out:
            return None
        self._num_tokens_out = max(self._num_tokens_out, reply.num_tokens)
        return DetokReply(text, reply.num_tokens, reply.stop_match)


class DetokClient:
    """Opens detok streams on the detok replicas."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float = 2.0):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    def open(self, options: DetokOptions) -> DetokStream:
        """Start a stream; its options are its first message."""
        return DetokStream(self._replicas, options)

    async def is_serving(self) -> bool:
        return await self._replicas.is_serving(self._timeout_s)

    async def close(self) -> None:
        await self._replicas.close()
