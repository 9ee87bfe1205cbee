"""The Engine service fuzzed with malformed Generate requests (hypothesis, derandomized):
every request either streams to a finish or is refused with INVALID_ARGUMENT and a
message; never another status, a crash or a hang. Over a real channel, fake runner."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.v1 import engine_pb2

MAX_MODEL_LEN = 64
UINT32 = st.one_of(st.integers(0, 120), st.sampled_from([2**31, 2**32 - 1]))
FLOATS = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.just(1.0), st.floats(width=32))
FUZZ = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
async def stub(support):
    async with support.serve_engine(support.make_core(max_model_len=MAX_MODEL_LEN)) as served:
        yield served[1]


_SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": FLOATS, "top_p": FLOATS, "min_p": FLOATS, "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "repetition_penalty": FLOATS,
    "top_k": st.integers(-(2**31), 2**31 - 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "logit_bias": st.dictionaries(UINT32, FLOATS, max_size=3),
    "max_tokens": st.one_of(st.integers(0, 8), st.sampled_from([70, 2**32 - 1])),
    "stop_token_ids": st.lists(UINT32, max_size=3), "ignore_eos": st.booleans(),
    "allowed_token_ids": st.lists(st.one_of(st.integers(0, 99), UINT32), max_size=3),
    "bad_words": st.lists(st.builds(engine_pb2.TokenSequence, ids=st.lists(
        st.one_of(st.integers(0, 99), UINT32), max_size=3)), max_size=3),
    "logprobs": st.booleans(), "top_logprobs": st.one_of(st.integers(0, 21), st.just(2**32 - 1)),
    "min_tokens": st.one_of(st.integers(0, 9), st.just(2**32 - 1)),
}).map(lambda fields: engine_pb2.SamplingParams(**fields))
_REQUESTS = st.builds(
    engine_pb2.GenerateRequest,
    request_id=st.text(max_size=8),
    prompt_token_ids=st.one_of(st.lists(st.integers(0, 99), max_size=70),
                               st.lists(UINT32, max_size=4)),
    sampling=_SAMPLING, priority=st.integers(-(2**31), 2**31 - 1),
    cache_salt=st.one_of(st.text(max_size=8), st.just("s" * 100_000)),
)


@FUZZ
@given(request=_REQUESTS)
async def test_malformed_generate_requests_finish_or_are_invalid_argument(stub, request):
    request.request_id = f"fuzz-{id(request)}-{request.request_id}"
    try:
        chunks = [chunk async for chunk in stub.Generate(request, timeout=20)]
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details()
        event("refused")
        return
    event("finished")
    assert chunks[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize(("sampling", "message"), [
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"stop_token_ids": [2**32 - 1]}, "stop_token_ids token id 4294967295 is out of range"),
    ({"allowed_token_ids": [2**32 - 1]}, "allowed_token_ids token id 4294967295 is out of "),
    ({"allowed_token_ids": [5, 5], "stop_token_ids": [5], "min_tokens": 1},
     "leave no token to sample"),
    ({"stop_token_ids": range(99), "bad_words": [engine_pb2.TokenSequence(ids=[99])],
      "min_tokens": 1}, "leave no token to sample"),  # the whole vocabulary of 100
    ({"bad_words": [engine_pb2.TokenSequence(ids=[1, 2**32 - 1])]},
     "bad_words token id 4294967295 is out of range"),
    ({"bad_words": [engine_pb2.TokenSequence(ids=[])]}, "bad_words must be at most 128 "),
    ({"bad_words": [engine_pb2.TokenSequence(ids=[5])], "allowed_token_ids": [5, 6]},
     "bad_words cannot be combined with allowed_token_ids"),
])
async def test_non_finite_floats_foreign_ids_and_empty_masks_are_invalid_argument(
        stub, sampling, message):
    request = engine_pb2.GenerateRequest(request_id="bad", prompt_token_ids=[1, 2],
                                         sampling=engine_pb2.SamplingParams(max_tokens=2,
                                                                            **sampling))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [chunk async for chunk in stub.Generate(request, timeout=20)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
