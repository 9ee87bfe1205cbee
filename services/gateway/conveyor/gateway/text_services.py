"""Clients of the text services, balanced over their replicas, and the model they serve.

The tokenizer: unary calls (render, tokenize, decode, info); a call a replica fails to
answer is retried on another (ReplicaSet.call). `ModelCatalog` asks it once (Info) what
model is served; the served-name setting wins. A LoRA adapter of the adapter catalog
(lora/catalog.py) is a model too, for the tenants it is visible to: the base model run
with that adapter, under the adapter's name (as vLLM serves them).

Detok: one bidirectional stream per generation. A stream whose replica fails is rebuilt
on another replica: it re-sends its options and every token id so far (and the finish,
if sent), and skips as much of the new stream's text and tool-call pieces as the caller
already got: detokenization and tool-call reading are deterministic, so the new stream
starts with the old. The caller sees one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
from redis.exceptions import RedisError

from conveyor.common.replica_set import Replica, ReplicaSet, is_replica_failure
from conveyor.gateway import wire
from conveyor.gateway.errors import model_not_found
from conveyor.gateway.lora.catalog import AdapterRecord, LoraCatalog
from conveyor.gateway.wire import (
    DetokOptions,
    DetokReply,
    LoraAdapter,
    PromptInput,
    PromptTokens,
    RenderInput,
    TokenizerFacts,
    ToolCallDelta,
    UpstreamError,
    translate_rpc_errors,
)
from conveyor.v1 import detok_pb2_grpc, tokenizer_pb2_grpc

# -- tokenizer client --------------------------------------------------------------------

TOKENIZER_SERVICE = "tokenizer"


class TokenizerClient:
    """Unary calls to the tokenizer replicas, each with a deadline."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    async def render(self, render: RenderInput) -> PromptTokens:
        return wire.prompt_tokens(await self._call("Render", wire.render_request(render)))

    async def tokenize(self, prompt: PromptInput) -> PromptTokens:
        return wire.prompt_tokens(
            await self._call("Tokenize", wire.tokenize_request(prompt)))

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return wire.decoded_text(await self._call(
            "Decode", wire.decode_request(token_ids, skip_special_tokens)))

    async def decode_each(self, token_ids: list[int]) -> list[str]:
        """The text of each id alone (special tokens kept), in one call."""
        texts = wire.decoded_token_texts(await self._call(
            "Decode", wire.decode_request(token_ids, False, each_token=True)))
        if len(texts) != len(token_ids):
            raise UpstreamError("tokenizer", "INTERNAL", f"Decode gave {len(texts)} texts for "
                                f"{len(token_ids)} token ids")
        return texts

    async def info(self) -> TokenizerFacts:
        return wire.tokenizer_facts(
            await self._call("Info", wire.tokenizer_info_request()))

    async def is_serving(self) -> bool:
        return await self._replicas.is_serving(self._timeout_s)

    async def close(self) -> None:
        await self._replicas.close()

    async def _call(self, method: str, request):
        """`method` on one replica, on another when that one does not answer."""
        async def on(channel):
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            return await getattr(stub, method)(request, timeout=self._timeout_s)

        with translate_rpc_errors(TOKENIZER_SERVICE):
            return await self._replicas.call(on)


# -- model catalog -----------------------------------------------------------------------

models_log = logging.getLogger("conveyor.gateway.models")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    backend_name: str = ""
    """The name the tokenizer and the engines serve it under (routing filters engines by
    it); `name` differs when the gateway's served_model_name renames it for clients."""
    lora: LoraAdapter | None = None
    """The LoRA adapter its requests run with (None: the base model itself)."""
    parent: str | None = None
    """An adapter's base model, by its name for clients."""

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    def with_adapter(self, record: AdapterRecord) -> ServedModel:
        """This base model run with the adapter of `record`, under the adapter's name."""
        return replace(self, name=record.name, lora=record.adapter, parent=self.name)


class ModelCatalog:
    """Asks the tokenizer once (Info) what it serves; the served-name setting wins. The
    adapters of `adapters` are served on it."""

    def __init__(self, tokenizer: TokenizerClient, served_model_name: str | None,
                 adapters: LoraCatalog):
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self.adapters = adapters
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    async def model(self) -> ServedModel:
        """The served model; the first call asks the tokenizer (UpstreamError if it can't)."""
        if self._model is None:
            async with self._lock:
                if self._model is None:
                    facts = await self._tokenizer.info()
                    self._model = ServedModel(self._served_model_name or facts.model,
                                              facts.max_model_len, facts.vocab_size,
                                              facts.model)
        return self._model

    async def resolve(self, requested: str | None, tenant_id: str | None) -> ServedModel:
        """The served model if `requested` names it (or is absent), the adapter it names if
        `tenant_id` may see that one (None: a caller without a key, who sees the public
        adapters); 404 model_not_found otherwise."""
        model = await self.model()
        if requested is None or requested == model.name:
            return model
        record = await self.adapters.get(requested)
        if record is None or not record.is_visible_to(tenant_id):
            raise model_not_found(requested)
        return model.with_adapter(record)

    async def models(self, tenant_id: str | None) -> list[ServedModel]:
        """The served model, then the adapters `tenant_id` may see (as in `resolve`); the
        served model alone while the adapters cannot be read (Redis unavailable)."""
        model = await self.model()
        try:
            records = await self.adapters.list()
        except RedisError as error:
            models_log.warning("LoRA catalog unavailable, listing the base model alone: %s",
                               error)
            return [model]
        return [model, *(model.with_adapter(r) for r in records
                         if r.is_visible_to(tenant_id) and r.name != model.name)]


# -- detok client ------------------------------------------------------------------------

DETOK_SERVICE = "detok"
_END = object()
log = logging.getLogger("conveyor.gateway.detok")


class _Attempt:
    """One Detokenize call on one replica, fed from a queue that gRPC drains."""

    def __init__(self, replica: Replica, first_messages: list):
        self.replica = replica
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.num_chars_in = 0
        """Text this call produced so far (the caller may have had some of it already)."""
        self.num_arguments_in: dict[int, int] = {}
        """Per tool call, the arguments' characters this call produced so far."""
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
        self._num_arguments_out: dict[int, int] = {}
        """Per tool call the caller has the header of: its arguments' characters out."""
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
        with translate_rpc_errors(DETOK_SERVICE):
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
        tool_calls = [fresh for delta in reply.tool_calls
                      if (fresh := self._fresh_tool_call(delta, attempt)) is not None]
        if reply.stop_match is not None:
            self._ended = True
        elif not text and not tool_calls and reply.num_tokens <= self._num_tokens_out:
            return None
        self._num_tokens_out = max(self._num_tokens_out, reply.num_tokens)
        return DetokReply(text, reply.num_tokens, reply.stop_match, tool_calls)

    def _fresh_tool_call(self, delta: ToolCallDelta, attempt: _Attempt) -> ToolCallDelta | None:
        """`delta` without what the caller already has of its call; None when nothing."""
        if delta.id:  # a call's header
            if delta.index in self._num_arguments_out:
                return None
            self._num_arguments_out[delta.index] = 0
            return delta
        num_before = attempt.num_arguments_in.get(delta.index, 0)
        attempt.num_arguments_in[delta.index] = num_before + len(delta.arguments)
        fragment = delta.arguments[max(0, self._num_arguments_out[delta.index] - num_before):]
        if not fragment:
            return None
        self._num_arguments_out[delta.index] += len(fragment)
        return ToolCallDelta(delta.index, arguments=fragment)


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
