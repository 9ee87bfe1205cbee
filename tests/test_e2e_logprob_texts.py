"""Logprob texts come from detok (issue 31: tokens flow one way): a gateway whose tokenizer
calls all pass through a recording gRPC proxy serves chat and echoed completion logprobs
with the texts the tokenizer's own per-token Decode gives, and calls no Decode. Real
processes and model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
DECODE = "/conveyor.v1.Tokenizer/Decode"
PROMPT = "<|im_start|>user\nSmile 😀 and"
"""A special token, and an emoji whose bytes two tokens share (each alone is U+FFFD)."""


class RecordingProxy(grpc.GenericRpcHandler):
    """Forwards every unary call to `target` as it came (bytes and metadata), recording
    each call's method in `methods`."""

    def __init__(self, target: str):
        self._channel = grpc.insecure_channel(target)
        self.methods: list[str] = []

    def service(self, details):
        metadata = [(k, v) for k, v in details.invocation_metadata if k != "user-agent"]

        def forward(request: bytes, context):
            self.methods.append(details.method)
            try:
                return self._channel.unary_unary(details.method)(request, timeout=60,
                                                                 metadata=metadata)
            except grpc.RpcError as error:
                context.set_trailing_metadata(error.trailing_metadata())
                context.abort(error.code(), error.details())

        return grpc.unary_unary_rpc_method_handler(forward)


@pytest.fixture
def tokenizer_proxy(stack):
    proxy = RecordingProxy(stack.processes["tokenizer"].address)
    server = grpc.server(ThreadPoolExecutor(4), handlers=[proxy])
    proxy.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield proxy
    server.stop(grace=None)


def each_token_text(address: str, text: str) -> list[str]:
    """The tokenizer's own text of each token of `text` (Tokenize, then Decode each_token)."""
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        ids = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=True),
                            timeout=30).token_ids
        return list(stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, each_token=True),
                                timeout=30).token_texts)


def test_logprob_texts_are_detoks_and_the_tokenizer_decodes_none(stack, extra_gateway,
                                                                  tokenizer_proxy):
    gateway = extra_gateway(CONVEYOR_GATEWAY_TOKENIZER_ADDRESS=tokenizer_proxy.address)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello in five words."}],
        max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the best
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=2)
    expected = each_token_text(stack.processes["tokenizer"].address, PROMPT)
    assert "<|im_start|>" in expected and "\ufffd" in "".join(expected)
    assert echoed.choices[0].logprobs.tokens[:len(expected)] == expected
    assert echoed.usage.prompt_tokens == len(expected)
    assert "/conveyor.v1.Tokenizer/Render" in tokenizer_proxy.methods
    assert DECODE not in tokenizer_proxy.methods  # detok sent every token's text
