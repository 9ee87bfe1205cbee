"""The Tokenizer service fuzzed with malformed messages (hypothesis, derandomized): ids
at the uint32 edges, empty and huge texts, bad JSON fields, wild templates. Each call
answers or is refused with INVALID_ARGUMENT and a message; never another status, a crash
or a hang. In process over a real channel, the real SmolLM2 tokenizer."""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.tokenizer.servicer import TokenizerServicer
from conveyor.v1 import tokenizer_pb2 as pb
from conveyor.v1 import tokenizer_pb2_grpc

IDS = st.one_of(st.integers(0, 49151), st.sampled_from([49152, 2**31, 2**32 - 1]))
UINT32 = st.one_of(st.integers(0, 8), st.integers(0, 70), st.just(2**32 - 1))
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["", "{{", "{% for %}", "[1, 2]",
                                                       "{}", "x" * 2_000]))
FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
async def stub(service):
    registration = ServiceRegistration("conveyor.v1.Tokenizer",
                                       tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
                                       TokenizerServicer(service))
    server = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await channel.close()
    await server.server.stop(grace=None)


_MESSAGES = st.lists(st.builds(
    pb.ChatMessage, role=st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT),
    content=TEXT, parts=st.lists(st.builds(pb.ContentPart, type=TEXT, text=TEXT), max_size=2),
    name=TEXT, tool_call_id=TEXT, tool_calls_json=TEXT), max_size=3)
_RENDER = st.builds(pb.RenderRequest, messages=_MESSAGES, add_generation_prompt=st.booleans(),
                    continue_final_message=st.booleans(), chat_template=TEXT,
                    tools_json=TEXT, max_tokens=UINT32, chat_template_kwargs_json=TEXT,
                    truncate_prompt_tokens=st.one_of(st.none(), st.integers(-2, 70)))
_TOKENIZE = st.one_of(
    st.builds(lambda text, special, max_tokens: pb.TokenizeRequest(
        text=text, add_special_tokens=special, max_tokens=max_tokens),
        TEXT, st.booleans(), UINT32),
    st.builds(lambda ids, max_tokens, keep: pb.TokenizeRequest(
        token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, truncate_prompt_tokens=keep),
        st.lists(IDS, max_size=70), UINT32,
        st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1), st.integers(-2, 70))),
    st.just(pb.TokenizeRequest()))
_DECODE = st.builds(pb.DecodeRequest, token_ids=st.lists(IDS, max_size=8),
                    skip_special_tokens=st.booleans())
_CALLS = st.one_of(st.tuples(st.just("Render"), _RENDER), st.tuples(st.just("Tokenize"),
                   _TOKENIZE), st.tuples(st.just("Decode"), _DECODE))


@FUZZ
@given(call=_CALLS)
async def test_malformed_requests_answer_or_are_invalid_argument(stub, call):
    method, request = call
    try:
        await getattr(stub, method)(request, timeout=20)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details()
        event(f"{method} refused")
        return
    event(f"{method} answered")


@pytest.mark.parametrize("method", ["Tokenize", "Render"])
async def test_text_past_the_character_limit_is_refused_before_tokenizing(stub, service,
                                                                          method):
    text = "word " * 4_000_000  # 20 MB, once 7.8 GB of tokenizer memory and 30 s of a core
    request = (pb.TokenizeRequest(text=text) if method == "Tokenize" else
               pb.RenderRequest(messages=[pb.ChatMessage(role="user", content=text)]))
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(stub, method)(request, timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than the {service.max_text_chars} this service tokenizes" in \
        caught.value.details()
    assert time.monotonic() - started < 5


async def test_text_at_the_character_limit_is_tokenized(stub, service):
    """It passes the character check and is tokenized (then too long in tokens)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Tokenize(pb.TokenizeRequest(text="a" * service.max_text_chars))
    assert caught.value.details().startswith("prompt_len 256 + max_tokens 0")
