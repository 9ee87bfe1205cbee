"""Client of the tokenizer service (render, tokenize, decode, info), balanced over its
replicas: a call a replica fails to answer is retried on another (ReplicaSet.call)."""

from __future__ import annotations

from conveyor.common.replica_set import ReplicaSet
from conveyor.gateway import wire
from conveyor.gateway.wire import (
    PromptInput,
    PromptTokens,
    RenderInput,
    TokenizerFacts,
    translate_rpc_errors,
)
from conveyor.v1 import tokenizer_pb2_grpc

SERVICE = "tokenizer"


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

        with translate_rpc_errors(SERVICE):
            return await self._replicas.call(on)
