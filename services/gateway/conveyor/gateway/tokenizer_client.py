"""Client of the tokenizer service (render, tokenize, decode, info)."""

from __future__ import annotations

import grpc

from conveyor.common.grpc_client import is_serving
from conveyor.gateway import convert
from conveyor.gateway.tokenizer_records import (
    PromptInput,
    PromptTokens,
    RenderInput,
    TokenizerFacts,
)
from conveyor.gateway.upstream_error import translate_rpc_errors
from conveyor.v1 import tokenizer_pb2_grpc

SERVICE = "tokenizer"


class TokenizerClient:
    """Unary calls to the tokenizer over one shared channel, each with a deadline."""

    def __init__(self, channel: grpc.aio.Channel, rpc_timeout_s: float):
        self._channel = channel
        self._stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        self._timeout_s = rpc_timeout_s

    async def render(self, render: RenderInput) -> PromptTokens:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Render(
                convert.render_request(render), timeout=self._timeout_s
            )
        return convert.prompt_tokens(reply)

    async def tokenize(self, prompt: PromptInput) -> PromptTokens:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Tokenize(
                convert.tokenize_request(prompt), timeout=self._timeout_s
            )
        return convert.prompt_tokens(reply)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Decode(
                convert.decode_request(token_ids, skip_special_tokens), timeout=self._timeout_s
            )
        return convert.decoded_text(reply)

    async def info(self) -> TokenizerFacts:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Info(
                convert.tokenizer_info_request(), timeout=self._timeout_s
            )
        return convert.tokenizer_facts(reply)

    async def is_serving(self) -> bool:
        return await is_serving(self._channel, timeout_s=self._timeout_s)
