"""The tokenizer as a real process over real gRPC: health, every RPC, every bad input, drain."""

from __future__ import annotations

import time

import grpc
import pytest

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.common.grpc_client import is_serving, open_channel
from conveyor.v1 import tokenizer_pb2 as pb
from conveyor.v1 import tokenizer_pb2_grpc
from devkit.service_process import ServiceProcess, without_torch_env

pytestmark = pytest.mark.slow
SERVICE = "conveyor.v1.Tokenizer"
ENV = {**without_torch_env(),  # run as the torch-free container does
       "CONVEYOR_TOKENIZER_PORT": "0",
       "HF_HUB_OFFLINE": "1", "OTEL_TRACES_EXPORTER": "none",
       "CONVEYOR_TOKENIZER_ALLOW_REQUEST_CHAT_TEMPLATE": "true"}
USER_HI = [pb.ChatMessage(role="user", content="Hi")]
MODEL_MAX_LEN = 8192
"""The model's own context length (max_position_embeddings)."""
ENGINES_MAX_LEN = 128
"""What a caller passes as the engines' max_model_len."""


@pytest.fixture(scope="module")
def process():
    process = ServiceProcess("conveyor.tokenizer", env=ENV).start()
    yield process
    process.stop()


@pytest.fixture
async def stub(process):
    channel = open_channel(process.address)
    yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await channel.close()


async def test_health_and_info(process, stub):
    channel = open_channel(process.address)
    assert await is_serving(channel, SERVICE)
    await channel.close()
    info = await stub.Info(pb.TokenizerInfoRequest())
    assert info.model == "smollm2-135m-instruct"
    assert (info.vocab_size, info.max_model_len) == (49152, MODEL_MAX_LEN)
    assert list(info.eos_token_ids) == [2] and info.has_bos and info.bos_token_id == 1


async def test_render(stub, tokenizer):
    reply = await stub.Render(pb.RenderRequest(
        messages=[pb.ChatMessage(role="system", content="Be brief."),
                  pb.ChatMessage(role="user", parts=[pb.ContentPart(type="text", text="Hi")])],
        add_generation_prompt=True, max_tokens=16, max_model_len=ENGINES_MAX_LEN))
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert reply.prompt_text == expected
    assert list(reply.token_ids) == tokenizer.encode(expected)
    assert reply.num_tokens == len(reply.token_ids) and reply.max_model_len == ENGINES_MAX_LEN


async def test_tokenize_text_and_ids_and_decode(stub, tokenizer):
    by_text = await stub.Tokenize(pb.TokenizeRequest(text="Hello 😀 你好"))
    assert list(by_text.token_ids) == tokenizer.encode("Hello 😀 你好")
    by_ids = await stub.Tokenize(pb.TokenizeRequest(token_ids=pb.TokenIds(ids=by_text.token_ids)))
    assert by_ids.token_ids == by_text.token_ids and by_ids.num_tokens == by_text.num_tokens
    decoded = await stub.Decode(pb.DecodeRequest(token_ids=[*by_text.token_ids, 2],
                                                 skip_special_tokens=True))
    assert decoded.text == "Hello 😀 你好"


async def test_prompts_are_checked_against_the_max_model_len_the_request_carries(stub):
    """No setting of its own: the caller passes the engines' max_model_len; without one,
    the model's own is the limit."""
    ids = pb.TokenIds(ids=[5] * 200)
    assert (await stub.Tokenize(pb.TokenizeRequest(token_ids=ids))).max_model_len == \
        MODEL_MAX_LEN
    with pytest.raises(grpc.aio.AioRpcError, match="max_model_len 128;"):
        await stub.Tokenize(pb.TokenizeRequest(token_ids=ids, max_model_len=ENGINES_MAX_LEN))
    with pytest.raises(grpc.aio.AioRpcError, match="max_model_len 8192;"):
        await stub.Tokenize(pb.TokenizeRequest(token_ids=ids, max_tokens=8000))


def _render(**fields) -> tuple[str, object]:
    return "Render", pb.RenderRequest(**{"messages": USER_HI, **fields})


BAD_INPUTS = [
    (*_render(max_tokens=120, max_model_len=ENGINES_MAX_LEN), CONTEXT_LENGTH_EXCEEDED,
     "prompt_len 27 + max_tokens 120 = 147 tokens exceeds this model's maximum context length, "
     "max_model_len 128"),
    ("Tokenize", pb.TokenizeRequest(token_ids=pb.TokenIds(ids=[5] * 129), max_model_len=128),
     CONTEXT_LENGTH_EXCEEDED, "prompt_len 129 + max_tokens 0 = 129 tokens exceeds"),
    ("Tokenize", pb.TokenizeRequest(text="a" * (16 * MODEL_MAX_LEN + 1)), CONTEXT_LENGTH_EXCEEDED,
     "the prompt has 131073 characters, more than the 131072 this service tokenizes"),
    ("Tokenize", pb.TokenizeRequest(text=""), INVALID_REQUEST,
     "prompt is empty; send text or token ids"),
    ("Tokenize", pb.TokenizeRequest(), INVALID_REQUEST, "prompt is missing; set text or token_ids"),
    ("Tokenize", pb.TokenizeRequest(token_ids=pb.TokenIds()), INVALID_REQUEST,
     "prompt token_ids is empty"),
    ("Tokenize", pb.TokenizeRequest(token_ids=pb.TokenIds(ids=[1, 50000])), INVALID_REQUEST,
     "prompt token_ids[1] = 50000 is outside the vocabulary (ids must be below 49152)"),
    ("Decode", pb.DecodeRequest(token_ids=[49152]), INVALID_REQUEST,
     "token_ids[0] = 49152 is outside the vocabulary"),
    ("Render", pb.RenderRequest(), INVALID_REQUEST, "messages is empty; send at least one message"),
    (*_render(messages=[pb.ChatMessage(role="wizard", content="x")]), INVALID_REQUEST,
     "messages[0].role 'wizard' is not one of system, user, assistant, tool, developer"),
    (*_render(messages=[pb.ChatMessage(role="user", parts=[pb.ContentPart(text="x")])]),
     INVALID_REQUEST, "messages[0].content[0] has no type; content parts need type 'text'"),
    (*_render(messages=[pb.ChatMessage(role="user", parts=[pb.ContentPart(type="image_url")])]),
     INVALID_REQUEST,
     "messages[0].content[0] has type 'image_url'; only 'text' content parts are supported"),
    (*_render(chat_template="{% if %}"), INVALID_REQUEST,
     "the request's chat_template is not valid Jinja (line 1)"),
    (*_render(chat_template="{{ raise_exception('bad turn order') }}"), INVALID_REQUEST,
     "the request's chat_template failed to render: bad turn order"),
    (*_render(chat_template="{{ messages + 1 }}"), INVALID_REQUEST,
     "the request's chat_template failed to render these messages: TypeError"),
    (*_render(add_generation_prompt=True, continue_final_message=True), INVALID_REQUEST,
     "add_generation_prompt and continue_final_message cannot both be set"),
    (*_render(tools_json="not json"), INVALID_REQUEST, "tools is not valid JSON"),
    (*_render(chat_template_kwargs_json='{"tools": []}'), INVALID_REQUEST,
     "chat_template_kwargs may not set tools"),
]


@pytest.mark.parametrize("method, request_, reason, message", BAD_INPUTS)
async def test_bad_input_is_invalid_argument_with_a_reason(stub, method, request_, reason, message):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(stub, method)(request_, timeout=10)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(message)
    assert (ERROR_REASON_KEY, reason) in tuple(error.trailing_metadata())


async def test_sigterm_drains_and_exits_cleanly():
    process = ServiceProcess("conveyor.tokenizer", env=ENV, name="tokenizer-drain").start()
    try:
        channel = open_channel(process.address)
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        assert (await stub.Tokenize(pb.TokenizeRequest(text="hi"))).num_tokens == 1
        started = time.monotonic()
        assert process.stop() == 0
        assert time.monotonic() - started < 10
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Info(pb.TokenizerInfoRequest(), timeout=2)
        await channel.close()
    finally:
        process.kill()
